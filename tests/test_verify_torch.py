"""Device verification (speculant/verify_torch.py) on CPU torch, against the numpy reference (verify.py) and
against exact distributions, in the style of tests/test_verify.py. SPECULANT_TEST_DEVICE=cuda runs the same
tests on a GPU (scripts/gpu_bench.sh's machine)."""

import os

import numpy as np
import pytest
from scipy import stats as sps

torch = pytest.importorskip("torch")
torch.set_num_threads(1)
DEVICE = torch.device(os.environ.get("SPECULANT_TEST_DEVICE", "cpu"))

from speculant import verify as ref  # noqa: E402
from speculant import verify_torch as vt  # noqa: E402
from speculant.verify import SamplingParams  # noqa: E402

from test_verify import _chi2_pvalue, _first_token_counts, _random_dists  # noqa: E402


def torch_verifier(p, q, seed):
    """verify_torch.verify_sampled behind verify.verify_sampled's signature (p, q fixed; drafts vary)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    p_t = torch.from_numpy(p).to(DEVICE)
    q_t = None if q is None else torch.from_numpy(q).to(DEVICE)

    def verifier(draft, draft_probs, target_probs, rng):
        return vt.verify_sampled(torch.from_numpy(np.asarray(draft, dtype=np.int64)).to(DEVICE),
                                 None if draft_probs is None else q_t, p_t, gen)
    return verifier


@pytest.mark.parametrize("params", [
    SamplingParams(1.0), SamplingParams(0.7), SamplingParams(1.3, top_k=5), SamplingParams(0.8, top_p=0.9),
    SamplingParams(1.0, min_p=0.1), SamplingParams(0.9, top_k=20, top_p=0.8, min_p=0.05),
    SamplingParams(1.0, top_k=3, top_p=0.5),
])
def test_probs_match_numpy_reference(params):
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 300)).astype(np.float32) * 3
    logits[0, :10] = logits[0, 0]  # ties at the cut-offs
    logits[1] = np.round(logits[1])  # many ties
    want = ref.probs_from_logits(logits, params)
    got = vt.probs_from_logits(torch.from_numpy(logits).to(DEVICE), params).cpu().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    assert np.array_equal(got > 0, want > 0)  # the same tokens survive every filter


def test_a_vanishing_temperature_is_greedy_not_nan():
    logits = torch.tensor([[3.0, 20.5, -4.0, 20.0, 7.0]], device=DEVICE)
    for params in (SamplingParams(1e-310), SamplingParams(1e-310, top_k=2)):
        assert vt.probs_from_logits(logits, params).cpu().tolist() == [[0.0, 1.0, 0.0, 0.0, 0.0]]


def test_greedy_verification():
    t = lambda *x: torch.tensor(x, device=DEVICE)  # noqa: E731
    logits = lambda best: torch.nn.functional.one_hot(torch.tensor(best, device=DEVICE), 10).float()  # noqa: E731
    assert vt.verify_greedy(t(3, 4, 5), logits([3, 4, 5, 9])) == (3, 9)  # all accepted + bonus
    assert vt.verify_greedy(t(3, 4, 5), logits([3, 7, 5, 9])) == (1, 7)  # recovered at the mismatch
    assert vt.verify_greedy(t(3, 4, 5), logits([2, 4, 5, 9])) == (0, 2)
    assert vt.verify_greedy(torch.tensor([], dtype=torch.long, device=DEVICE), logits([2])) == (0, 2)  # plain decoding


def test_greedy_matches_numpy_on_random_logits():
    rng = np.random.default_rng(1)
    for _ in range(200):
        k = int(rng.integers(0, 6))
        logits = rng.standard_normal((k + 1, 8))
        draft = np.where(rng.random(k) < 0.7, logits[:k].argmax(-1), rng.integers(0, 8, k))
        assert vt.verify_greedy(torch.from_numpy(draft).to(DEVICE), torch.from_numpy(logits).to(DEVICE)) == \
            ref.verify_greedy(draft, logits.argmax(-1))


@pytest.mark.parametrize("k", [2, 4])
def test_first_token_follows_target(k):
    rng = np.random.default_rng(1)
    p, q = _random_dists(rng, k + 1), _random_dists(rng, k)
    counts = _first_token_counts(torch_verifier(p, q, seed=k), p, q, 30_000, seed=k)
    assert _chi2_pvalue(counts, p[0]) > 1e-4
    assert 0.5 * np.abs(counts / counts.sum() - p[0]).sum() < 0.02


def test_the_same_test_fails_a_wrong_target():
    """The statistic can fail: verifying against the wrong target row is detected."""
    rng = np.random.default_rng(1)
    p, q = _random_dists(rng, 3), _random_dists(rng, 2)
    counts = _first_token_counts(torch_verifier(p[::-1].copy(), q, seed=3), p, q, 30_000, seed=2)
    assert _chi2_pvalue(counts, p[0]) < 1e-6


def test_deterministic_draft_is_lossless():
    rng = np.random.default_rng(3)
    p, q = _random_dists(rng, 4), _random_dists(rng, 3)
    counts = _first_token_counts(torch_verifier(p, None, seed=4), p, q, 30_000, seed=4, deterministic=True)
    assert _chi2_pvalue(counts, p[0]) > 1e-4


def test_same_law_as_numpy_verifier():
    """(n_accepted, next token) has the same law from the torch and the numpy verifier."""
    rng = np.random.default_rng(6)
    k, v = 3, 5
    p, q = _random_dists(rng, k + 1, v=v), _random_dists(rng, k, v=v)
    fast = torch_verifier(p, q, seed=8)
    tables = []
    for fn in (fast, ref.verify_sampled):
        r = np.random.default_rng(7)
        c = np.zeros((k + 1, v))
        for _ in range(20_000):
            d = np.array([r.choice(v, p=q[i]) for i in range(k)])
            n_acc, nxt = fn(d, q, p, r)
            c[n_acc, nxt] += 1
        tables.append(c.ravel())
    table = np.stack(tables)
    table = table[:, table.sum(0) > 0]
    assert sps.chi2_contingency(table).pvalue > 1e-4


def test_impossible_draft_is_always_rejected():
    """A deterministic draft the target gives probability 0 is rejected; the recovered token is drawn from p."""
    p = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64, device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    outcomes = {vt.verify_sampled(torch.tensor([2], device=DEVICE), None, p, gen) for _ in range(50)}
    assert outcomes == {(0, 0), (0, 1)}


# -- coupled draws (seeded requests) on the device ---------------------------------------------------------

def test_coupled_noise_and_draws_are_the_numpy_ones():
    """The keyed noise bit for bit (int64 arithmetic wrapping as uint64's); the draws token for token on random
    rows (a 152k one, a truncated one, one under a block); verify_coupled keeps drafts while they equal them."""
    rng = np.random.default_rng(4)
    ids = np.concatenate([np.arange(300), rng.integers(0, 2**40, 300)])
    for seed, pos in ((0, 0), (2**64 - 1, 12345), (77, 2**40)):
        got = vt.exponentials(seed, [pos], torch.from_numpy(ids).to(DEVICE).view(1, -1)).cpu().numpy()[0]
        assert np.array_equal(got, ref.exponentials(seed, pos, ids))
    for v in (200, 1000, 151_936):
        rows = _random_dists(rng, 3, v=v, sharp=3.0)
        rows[2] = ref.probs_from_logits(np.log(rows[2]), SamplingParams(1.0, top_k=7))
        probs = torch.from_numpy(rows).to(DEVICE)
        for seed in range(30):
            got = vt.coupled_draws(probs, seed, [5, 6, 7]).tolist()
            assert got == [ref.coupled_draw(rows[i], seed, 5 + i) for i in range(3)]
    p = _random_dists(rng, 4, v=50)
    p_t = torch.from_numpy(p).to(DEVICE)
    for seed in range(40):
        drawn = [ref.coupled_draw(p[i], seed, 9 + i) for i in range(4)]
        for drafts in (drawn[:3], drawn[:1] + [(drawn[1] + 1) % 50, drawn[2]], []):
            want = ref.verify_greedy_lazy(drafts, lambda i: drawn[i])
            t = torch.tensor(drafts, dtype=torch.long, device=DEVICE)
            assert vt.verify_coupled(t, p_t[:len(drafts) + 1], seed, 9) == want
