"""The verifier: pure functions checked against the textbook reference and against exact distributions."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from scipy import stats as sps

from speculant.errors import SettingsError
import speculant.verify as verify_mod
from speculant.verify import (COUPLED_BLOCK, SamplingParams, coupled_draw, exponentials, probs_from_logits,
                              reference_coupled_draw, reference_verify, residual, verify_greedy, verify_sampled)

V = 10


def _random_dists(rng, n, v=V, sharp=1.5):
    logits = rng.standard_normal((n, v)) * sharp
    p = np.exp(logits)
    return p / p.sum(-1, keepdims=True)


def _wrong_verify(draft_tokens, draft_probs, target_probs, rng):
    """A deliberately wrong verifier: accepts with min(1, q/p) (p and q swapped)."""
    k = len(draft_tokens)
    for i, x in enumerate(draft_tokens):
        p, q = target_probs[i], draft_probs[i]
        if rng.random() >= min(1.0, q[x] / p[x]):
            return i, int(rng.choice(len(p), p=residual(p, q, x)))
    return k, int(rng.choice(target_probs.shape[1], p=target_probs[k]))


def _first_token_counts(verifier, p, q, n_draws, seed, deterministic=False):
    """Draw drafts x_i ~ q_i, verify, and count the first emitted token (which must follow p_0)."""
    rng = np.random.default_rng(seed)
    k = q.shape[0]
    counts = np.zeros(p.shape[1], dtype=np.int64)
    cdf = np.cumsum(q, axis=-1)
    u = rng.random((n_draws, k))
    drafts = np.minimum((u[:, :, None] > cdf[None]).sum(-1), p.shape[1] - 1)  # [n_draws, k] samples of q
    for d in drafts:
        if deterministic:
            d = np.argmax(q, axis=-1)
        n_acc, nxt = verifier(d, None if deterministic else q, p, rng)
        counts[d[0] if n_acc > 0 else nxt] += 1
    return counts


def _chi2_pvalue(counts, probs):
    mask = probs > 0
    if counts[~mask].sum() > 0:
        return 0.0
    return sps.chisquare(counts[mask], probs[mask] * counts.sum()).pvalue


@pytest.mark.parametrize("k", [2, 4])
def test_first_token_follows_target_with_100k_draws(k):
    rng = np.random.default_rng(1)
    p, q = _random_dists(rng, k + 1), _random_dists(rng, k)
    counts = _first_token_counts(verify_sampled, p, q, 100_000, seed=k)
    assert _chi2_pvalue(counts, p[0]) > 1e-4
    tv = 0.5 * np.abs(counts / counts.sum() - p[0]).sum()
    assert tv < 0.01


def test_the_same_test_fails_a_wrong_verifier():
    rng = np.random.default_rng(1)
    p, q = _random_dists(rng, 3), _random_dists(rng, 2)
    counts = _first_token_counts(_wrong_verify, p, q, 100_000, seed=2)
    assert _chi2_pvalue(counts, p[0]) < 1e-6


def test_deterministic_draft_is_lossless():
    rng = np.random.default_rng(3)
    p, q = _random_dists(rng, 4), _random_dists(rng, 3)
    counts = _first_token_counts(verify_sampled, p, q, 100_000, seed=4, deterministic=True)
    assert _chi2_pvalue(counts, p[0]) > 1e-4


def test_error_shrinks_with_more_draws():
    """As in vLLM's convergence test: the distance to the target shrinks as the number of draws grows."""
    rng = np.random.default_rng(5)
    p, q = _random_dists(rng, 3), _random_dists(rng, 2)
    errors = [np.abs(_first_token_counts(verify_sampled, p, q, n, seed=n) / n - p[0]).sum()
              for n in (100, 1_000, 100_000)]
    assert errors[2] < errors[0] / 5


def test_matches_reference_implementation_in_distribution():
    """Fast and reference verifiers produce the same law of (n_accepted, next token)."""
    rng = np.random.default_rng(6)
    k = 3
    p, q = _random_dists(rng, k + 1, v=5), _random_dists(rng, k, v=5)
    outcomes = {}
    for name, fn in (("fast", verify_sampled), ("ref", lambda d, qq, pp, r: (lambda a, n: (len(a), n))(*reference_verify(d, qq, pp, r)))):
        r = np.random.default_rng(7)
        c = np.zeros((k + 1, 5))
        for _ in range(40_000):
            d = np.array([r.choice(5, p=q[i]) for i in range(k)])
            n_acc, nxt = fn(d, q, p, r)
            c[n_acc, nxt] += 1
        outcomes[name] = c.ravel()
    table = np.stack([outcomes["fast"], outcomes["ref"]])
    table = table[:, table.sum(0) > 0]
    assert sps.chi2_contingency(table).pvalue > 1e-4


# -- coupled draws (seeded requests) ---------------------------------------------------------------------------

def _coupled_counts(p, n_draws, position=7):
    counts = np.zeros(len(p), dtype=np.int64)
    for seed in range(n_draws):
        counts[coupled_draw(p, seed, position)] += 1
    return counts


@pytest.mark.parametrize("v", [12, 3 * COUPLED_BLOCK + 40])  # one race; blocks (the last one partial), then tokens
def test_coupled_draws_follow_the_distribution(v):
    rng = np.random.default_rng(v)
    p = _random_dists(rng, 1, v=v, sharp=2.0)[0]
    if v > COUPLED_BLOCK:  # a whole block without mass, as where top-k or a mask leaves nothing
        p[COUPLED_BLOCK:2 * COUPLED_BLOCK] = 0.0
        p /= p.sum()
        small = p < np.quantile(p, 0.9)  # pool the small tokens so that the chi-square holds
        counts = _coupled_counts(p, 60_000)
        assert counts[COUPLED_BLOCK:2 * COUPLED_BLOCK].sum() == 0
        counts, p = np.append(counts[~small], counts[small].sum()), np.append(p[~small], p[small].sum())
    else:
        counts = _coupled_counts(p, 60_000)
    assert _chi2_pvalue(counts, p) > 1e-4
    assert 0.5 * np.abs(counts / counts.sum() - p).sum() < 0.02


def test_the_coupled_test_fails_blocks_that_race_by_their_likeliest_token(monkeypatch):
    """A block race weighted by each block's largest probability instead of its mass."""
    rng = np.random.default_rng(3)
    v = 3 * COUPLED_BLOCK
    p = _random_dists(rng, 1, v=v, sharp=2.0)[0]
    monkeypatch.setattr(verify_mod, "block_masses", lambda probs: probs.reshape(-1, COUPLED_BLOCK).max(axis=1))
    counts = _coupled_counts(p, 60_000)
    blocks = counts.reshape(3, COUPLED_BLOCK).sum(axis=1)
    assert _chi2_pvalue(blocks, p.reshape(3, COUPLED_BLOCK).sum(axis=1)) < 1e-6


def test_coupled_draws_match_the_reference_and_are_independent_across_positions():
    rng = np.random.default_rng(8)
    for v in (9, COUPLED_BLOCK, 2 * COUPLED_BLOCK + 1, 151_936):
        p = _random_dists(rng, 1, v=v, sharp=3.0)[0]
        topk = probs_from_logits(np.log(p), SamplingParams(1.0, top_k=5))  # a truncated row
        for seed in range(20):
            assert coupled_draw(p, seed, 3) == reference_coupled_draw(p, seed, 3)
            assert coupled_draw(topk, seed, 3) == reference_coupled_draw(topk, seed, 3)
            assert topk[coupled_draw(topk, seed, 3)] > 0
    # the pair of draws at positions 5 and 6 of one seed: independent
    p = np.array([0.5, 0.3, 0.2])
    pairs = np.zeros((3, 3))
    for seed in range(30_000):
        pairs[coupled_draw(p, seed, 5), coupled_draw(p, seed, 6)] += 1
    assert _chi2_pvalue(pairs.ravel(), np.outer(p, p).ravel()) > 1e-4
    e = exponentials(1, 2, np.arange(200_000))  # Exp(1)
    assert sps.kstest(e, "expon").pvalue > 1e-4


def test_the_noises_log_is_libm_accurate_and_made_of_basic_operations_only():
    """neg_log, the noise's -log W, is within a few ulps of numpy's log over the whole (0, 1) and at its edges;
    it uses only IEEE additions, multiplications and divisions (so every library and device rounds it alike:
    tests/test_verify_torch.py checks torch's bits against numpy's)."""
    from speculant.verify import _np_frexp, neg_log

    w = np.concatenate([np.random.default_rng(3).random(1_000_000), 2.0 ** -np.arange(1, 1000, 7),
                        [0.5 * 2.0 ** -52, 1 - 2.0 ** -53, 0.5, np.sqrt(0.5), np.nextafter(np.sqrt(0.5), 1)]])
    w = w[w > 0]
    got, want = neg_log(w.copy(), _np_frexp, np.where), -np.log(w)
    assert np.max(np.abs(got - want) / np.spacing(want)) <= 4


def test_a_coupled_draft_is_accepted_at_least_as_the_coupling_bound():
    """A draft drawn with the target's noise from q equals the target's draw from p with probability at least
    (1 - TV) / (1 + TV) (Daliri et al. 2024); rejection sampling's is 1 - TV. And q = p always agrees."""
    rng = np.random.default_rng(9)
    for v in (10, 4 * COUPLED_BLOCK):
        p, q = _random_dists(rng, 2, v=v, sharp=2.0)
        q = 0.7 * p + 0.3 * q
        tv = 0.5 * np.abs(p - q).sum()
        n = 20_000
        same = sum(coupled_draw(p, s, 11) == coupled_draw(q, s, 11) for s in range(n)) / n
        assert same > (1 - tv) / (1 + tv) - 3 * np.sqrt(0.25 / n)
        assert all(coupled_draw(p, s, 11) == coupled_draw(p.copy(), s, 11) for s in range(200))


def test_greedy_verification():
    assert verify_greedy(np.array([3, 4, 5]), np.array([3, 4, 5, 9])) == (3, 9)  # all accepted + bonus
    assert verify_greedy(np.array([3, 4, 5]), np.array([3, 7, 5, 9])) == (1, 7)  # recovered at mismatch
    assert verify_greedy(np.array([], dtype=int), np.array([2])) == (0, 2)  # plain decoding


def _reference_filter(logits, params):
    """Sorting-based reference for top-k/top-p/min-p on the model's probabilities, then the temperature
    (llama.cpp's sampler order)."""
    x = np.asarray(logits, dtype=np.float64)
    p = np.exp(x - x.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.ones_like(p, dtype=bool)
    if params.top_k and params.top_k < len(p):
        keep &= p >= p[order[params.top_k - 1]]
    p = np.where(keep, p, 0)
    p /= p.sum()
    if params.top_p < 1:
        cum = np.cumsum(p[order])
        cut = p[order[min(np.searchsorted(cum, params.top_p), len(p) - 1)]]
        keep &= p >= cut
        p = np.where(keep, p, 0)
        p /= p.sum()
    if params.min_p:
        keep &= p >= params.min_p * p.max()
    z = np.where(keep, (x - x[keep].max()) / params.temperature, -np.inf)
    p = np.exp(z)
    return p / p.sum()


def _llama_cpp_chain(logits, params, chain=("top_k", "top_p", "min_p", "temperature")):
    """llama.cpp's own samplers (by default top_k, top_p, min_p, temp: its default chain's order; else those of
    `chain`, in its order) applied to one row of float32 logits -> the probabilities its final `dist` sampler
    draws from."""
    import ctypes

    import llama_cpp as ll

    n = len(logits)
    data = (ll.llama_token_data * n)()
    for i, v in enumerate(logits):
        data[i].id, data[i].logit, data[i].p = i, float(v), 0.0
    arr = ll.llama_token_data_array(data=data, size=n, selected=-1, sorted=False)
    init = {"top_k": lambda: ll.llama_sampler_init_top_k(params.top_k),
            "top_p": lambda: ll.llama_sampler_init_top_p(params.top_p, 1),
            "min_p": lambda: ll.llama_sampler_init_min_p(params.min_p, 1),
            "temperature": lambda: ll.llama_sampler_init_temp(params.temperature)}
    samplers = [init[name]() for name in chain if name in init]
    for s in samplers:
        ll.llama_sampler_apply(s, ctypes.byref(arr))
        ll.llama_sampler_free(s)
    kept = {data[i].id: data[i].logit for i in range(arr.size)}
    z = np.full(n, -np.inf)
    z[list(kept)] = list(kept.values())
    p = np.exp(z - z.max())
    return p / p.sum()


@pytest.mark.parametrize("v", [50, 3000])
def test_probs_follow_llama_cpps_own_sampler_chain(v):
    """`--temp 0.8` with llama-cli's top-k/top-p/min-p samples as llama-cli does: llama.cpp truncates on the
    model's probabilities and applies the temperature last (Hugging Face scales first, which keeps other tokens:
    the check fails on that order). The very tokens kept, and their probabilities up to float32 rounding."""
    rng = np.random.default_rng(v)
    for case in range(300):
        logits = (rng.standard_normal(v) * rng.uniform(0.5, 6.0)).astype(np.float32)
        params = SamplingParams(float(rng.choice([0.3, 0.8, 1.0, 1.5, 2.5])), int(rng.choice([0, 5, 40])),
                                float(rng.choice([1.0, 0.95, 0.7, 0.3])), float(rng.choice([0.0, 0.05, 0.2])))
        want = _llama_cpp_chain(logits, params)
        got = probs_from_logits(logits, params)
        assert np.array_equal(got > 0, want > 0), (case, params)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7)


def test_llama_servers_samplers_field_samples_as_its_chain_or_is_refused():
    """llama-server's "samplers" (names, aliases or characters) says which samplers run and in what order; it was
    accepted and ignored (llama.vim sends one). Every chain the server takes must give llama.cpp's own chain's
    distribution, those left out doing nothing (temperature left out: 1); an order that would change the
    distribution is a 400 naming the field, and so is adaptive-p, which speculant lacks."""
    from speculant.server import APIError, LLAMA_SAMPLERS, _llama_samplers

    rng = np.random.default_rng(5)
    names = ["top_k", "top_p", "min_p", "temperature", "dry", "typ_p", "xtc", "penalties"]
    accepted = refused = 0
    for case in range(400):
        logits = (rng.standard_normal(300) * rng.uniform(0.5, 6.0)).astype(np.float32)
        params = SamplingParams(float(rng.choice([0.3, 0.8, 1.0, 1.5])), int(rng.choice([0, 5, 40])),
                                float(rng.choice([1.0, 0.95, 0.5])), float(rng.choice([0.0, 0.05, 0.2])))
        chain = list(rng.choice(names, size=int(rng.integers(0, 6)), replace=False))
        try:
            got = _llama_samplers({"samplers": chain}, params, 4096)
        except APIError as e:
            assert e.status == 400 and e.param == "samplers", e
            refused += 1
            continue
        accepted += 1
        want = _llama_cpp_chain(logits, params, chain)
        assert np.array_equal(probs_from_logits(logits, got) > 0, want > 0), (case, chain, params)
        np.testing.assert_allclose(probs_from_logits(logits, got), want, rtol=2e-5, atol=1e-7)
    assert accepted > 100 and refused > 30
    params = SamplingParams(0.8, 40, 0.95, 0.05)
    assert _llama_samplers({"samplers": list(LLAMA_SAMPLERS)}, params, 4096) == params
    assert _llama_samplers({}, params, 4096) == params
    # llama-server's spellings: aliases in any case, one character per sampler; unknown ones skipped, as it does
    for spelled in (["Top-K", "nucleus", "temp"], ["topk", "top_p", "no_such", "temperature"], "kpt", "kp?t"):
        assert _llama_samplers({"samplers": spelled}, params, 4096) == SamplingParams(0.8, 40, 0.95, 0.0), spelled
    # llama.vim's and llama.vscode's list: the rest as listed, the infill sampler after top-p (tests/test_infill_sampler.py)
    vim = _llama_samplers({"samplers": ["top_k", "top_p", "infill"]}, params, 4096, infill_vocab=lambda: "vocab")
    assert vim == SamplingParams(1.0, 40, 0.95, 0.0, infill="vocab", infill_after="top_p")
    for body in ({"samplers": ["top_k", "adaptive_p"]}, {"samplers": "kpa"}, {"samplers": 3},
                 {"samplers": ["top_p", "top_k"]}, {"samplers": ["temperature", "min_p"]}):
        with pytest.raises(APIError) as raised:
            _llama_samplers(body, params, 4096)
        assert raised.value.param == "samplers", body
    # a sampler speculant lacks is refused only where the chain runs it
    with pytest.raises(APIError, match="typical"):
        _llama_samplers({"typical_p": 0.5}, params, 4096)
    assert _llama_samplers({"typical_p": 0.5, "samplers": "kpmt"}, params, 4096) == params
    # serve --samplers: the chain of requests that leave "samplers" out
    from speculant.server import ServerConfig, _get_sampling

    cfg = ServerConfig("m", samplers=("top_k",), temperature=0.8, top_k=40, top_p=0.9)
    got = _get_sampling({}, cfg)[0]
    assert (got.temperature, got.top_k, got.top_p) == (1.0, 40, 1.0)
    got = _get_sampling({"samplers": ["top_p", "temperature"]}, cfg)[0]
    assert (got.temperature, got.top_k, got.top_p) == (0.8, 0, 0.9)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10_000), t=st.floats(0.1, 3.0), top_k=st.integers(0, 40),
       top_p=st.floats(0.05, 1.0), min_p=st.floats(0.0, 0.5), v=st.sampled_from([7, 50, 3000]))
def test_probs_from_logits_matches_reference(seed, t, top_k, top_p, min_p, v):
    logits = np.random.default_rng(seed).standard_normal(v) * 3
    params = SamplingParams(t, top_k, top_p, min_p)
    np.testing.assert_allclose(probs_from_logits(logits, params), _reference_filter(logits, params), atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), t=st.floats(0.1, 3.0), top_k=st.sampled_from([0, 1, 5, 40, 2000]),
       top_p=st.sampled_from([1.0, 0.95, 0.5]), min_p=st.sampled_from([0.0, 0.05]),
       banned=st.sampled_from([0.0, 0.5, 0.999]), ties=st.booleans())
def test_probs_from_logits_on_a_whole_vocabulary(seed, t, top_k, top_p, min_p, banned, ties):
    """A Qwen-sized float32 row, as backends give it: rows are computed over the tokens top-k keeps (or the
    finite logits), which must not change what survives any filter nor the probabilities beyond rounding."""
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((2, 151_936)) * rng.uniform(1.0, 8.0)).astype(np.float32)
    logits[0, rng.random(151_936) < banned] = -np.inf  # a mask or a logit bias of -inf
    logits[0, 7] = logits[0].max() + 1.0
    if ties:
        logits[1] = np.round(logits[1])
    params = SamplingParams(t, top_k, top_p, min_p)
    got = probs_from_logits(logits, params)
    want = np.stack([_reference_filter(r, params) for r in logits])
    assert np.array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-300)
    assert np.allclose(got.sum(-1), 1.0)


@pytest.mark.parametrize("top_k", [0, 2])
def test_a_vanishing_temperature_is_greedy_not_nan(top_k):
    """logits / T overflowed to inf for T < ~1e-307 (inf - inf: NaN rows): plain decoding then drew the last id
    and verification accepted every draft, so the output depended on the drafter."""
    logits = np.array([[3.0, 20.5, -4.0, 20.0, 7.0], [-1.0, 0.0, 30.0, -np.inf, 29.0]], dtype=np.float32)
    for t in (1e-300, 1e-310, 5e-324):
        probs = probs_from_logits(logits, SamplingParams(t, top_k))
        np.testing.assert_array_equal(probs, np.eye(5)[[1, 2]])


def test_probs_from_logits_refuses_a_row_with_nothing_left():
    row = np.full(50, -np.inf, dtype=np.float32)
    for params in (SamplingParams(1.0), SamplingParams(0.7, top_k=5)):
        with pytest.raises(SettingsError, match="-inf"):
            probs_from_logits(row, params)


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0),
                                    dict(top_p=1.5), dict(top_k=-1), dict(min_p=1.0), dict(min_p=-0.1)])
def test_bad_sampling_settings_are_refused(kwargs):
    with pytest.raises(SettingsError):
        SamplingParams(**kwargs)
