"""Logit bias, repetition / frequency / presence penalties and logprobs: exact under speculation.

Penalties depend on the tokens before each position; in a verify pass those include the drafts before it, so
each row of the pass must be adjusted with its own history. The tests check adjust_logits against a plain
per-position reference, the law of whole sampled sequences against the exact one (and that the same test fails
an engine that adjusts every row with the history before the pass), greedy identity, and that logprobs from
verify passes are the very numbers of plain decoding (synthetic models here, the real Qwen pair below)."""

from collections import Counter

import dataclasses
import numpy as np
import pytest

import speculant.engine as engine_mod
from speculant.cli import parse_logit_bias
from speculant.drafters.lookup import LookupDrafter
from speculant.drafters.model import ModelDrafter
from speculant.engine import Engine
from speculant.errors import SettingsError
from speculant.verify import SamplingParams, adjust_logits, token_logprobs

import synthetic
from synthetic import TableBackend, pvalue, sequence_counts

V = 8
PROMPT = [1, 2, 3]
PENALTIES = dict(presence_penalty=1.2, frequency_penalty=0.8, repetition_penalty=1.5, logit_bias=((2, 1.0), (5, -2.0)))


def reference_adjust(row, params, history, n_prompt):
    """One position, written plainly: row [V] predicts the token after `history`."""
    x = np.array(row, dtype=np.float64)
    for token, bias in params.logit_bias:
        x[token] += bias
    output = Counter(history[n_prompt:])
    for token in set(history):
        if params.repetition_penalty != 1.0:
            x[token] = x[token] / params.repetition_penalty if x[token] > 0 else x[token] * params.repetition_penalty
    for token, count in output.items():
        x[token] -= params.frequency_penalty * count + params.presence_penalty
    return x


def make_spec(k=3, draft_seed=1):
    return Engine(TableBackend(V, seed=0), ModelDrafter(TableBackend(V, seed=draft_seed), V), draft_max=k)


@pytest.mark.parametrize("seed", range(6))
def test_adjust_logits_matches_the_per_position_reference(seed):
    rng = np.random.default_rng(seed)
    v, n_prompt, n_out, n = 50, int(rng.integers(1, 12)), int(rng.integers(0, 20)), int(rng.integers(1, 9))
    tokens = rng.integers(0, v, n_prompt + n_out + n - 1).tolist()  # prompt, output, then n - 1 drafts
    params = SamplingParams(0.0, presence_penalty=float(rng.uniform(-2, 2)), frequency_penalty=float(rng.uniform(-2, 2)),
                            repetition_penalty=float(rng.uniform(0.5, 3)),
                            logit_bias=((int(rng.integers(v)), float(rng.uniform(-100, 100))),))
    logits = (rng.standard_normal((n, v)) * 3).astype(np.float32)
    got = adjust_logits(logits, params, tokens, n_prompt)
    base = len(tokens) - n + 1
    for i in range(n):
        want = reference_adjust(logits[i], params, tokens[:base + i], n_prompt)
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-4)
    assert got is not logits and np.array_equal(logits, logits.copy())  # the input stays as it was
    plain = SamplingParams(0.0)
    assert adjust_logits(logits, plain, tokens, n_prompt) is logits  # nothing to do: no copy
    with pytest.raises(ValueError):  # a row inside the prompt has no meaning here
        adjust_logits(logits, params, tokens[:n_prompt], n_prompt + 1)


def _llama_cpp_penalties(row, params, history):
    """llama.cpp's own penalties sampler (llama_sampler_init_penalties, after its logit_bias one) over one row of
    float32 logits, having accepted `history`: what llama-cli and llama-server apply with repeat_last_n."""
    import ctypes

    import llama_cpp as ll

    data = (ll.llama_token_data * len(row))()
    for i, v in enumerate(row):
        data[i].id, data[i].logit, data[i].p = i, float(v), 0.0
    arr = ll.llama_token_data_array(data=data, size=len(row), selected=-1, sorted=False)
    bias = (ll.llama_logit_bias * len(params.logit_bias))(*[ll.llama_logit_bias(t, b) for t, b in params.logit_bias])
    samplers = [ll.llama_sampler_init_logit_bias(len(row), len(params.logit_bias), bias),
                ll.llama_sampler_init_penalties(len(row), params.penalty_last_n, params.repetition_penalty,
                                                params.frequency_penalty, params.presence_penalty)]
    for t in history:
        ll.llama_sampler_accept(samplers[1], int(t))
    for s in samplers:
        ll.llama_sampler_apply(s, ctypes.byref(arr))
        ll.llama_sampler_free(s)
    return np.array([data[i].logit for i in range(len(row))])


@pytest.mark.parametrize("seed", range(6))
def test_a_penalty_window_is_llama_cpps_repeat_last_n(seed):
    """penalty_last_n = N (llama.cpp's repeat_last_n; llama-server's endpoints default to 64): the three penalties
    over the last N tokens before each row, prompt included, as llama.cpp's own sampler computes them; each row of
    a verify pass with its own window (the drafts before it in, the oldest tokens out)."""
    rng = np.random.default_rng(100 + seed)
    v, n_prompt, n_out, n = 40, int(rng.integers(1, 30)), int(rng.integers(0, 30)), int(rng.integers(1, 9))
    tokens = rng.integers(0, v, n_prompt + n_out + n - 1).tolist()
    params = SamplingParams(0.0, presence_penalty=float(rng.uniform(-2, 2)),
                            frequency_penalty=float(rng.uniform(-2, 2)), repetition_penalty=float(rng.uniform(0.5, 3)),
                            logit_bias=((int(rng.integers(v)), float(rng.uniform(-10, 10))),),
                            penalty_last_n=int(rng.choice([1, 4, 16, 64])))
    logits = (rng.standard_normal((n, v)) * 3).astype(np.float32)
    got = adjust_logits(logits, params, tokens, n_prompt)
    base = len(tokens) - n + 1
    for i in range(n):
        want = _llama_cpp_penalties(logits[i], params, tokens[:base + i])
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5)
    # penalize_prompt False: the sampler having accepted only the output (llama-cpp-python's Llama)
    out_only = adjust_logits(logits, dataclasses.replace(params, penalize_prompt=False), tokens, n_prompt)
    for i in range(n):
        want = _llama_cpp_penalties(logits[i], params, tokens[n_prompt:base + i])
        np.testing.assert_allclose(out_only[i], want, rtol=1e-5, atol=1e-5)
    whole = adjust_logits(logits, dataclasses.replace(params, penalty_last_n=None), tokens, n_prompt)
    assert not np.allclose(whole, got)  # the window matters here
    with pytest.raises(SettingsError, match="window"):
        SamplingParams(0.0, penalty_last_n=0)


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_with_a_penalty_window_equals_plain_decoding(k):
    params = SamplingParams(0.0, penalty_last_n=5, **PENALTIES)
    plain = Engine(TableBackend(V, seed=0)).generate(PROMPT, max_tokens=60, params=params)
    spec = make_spec(k).generate(PROMPT, max_tokens=60, params=params)
    assert spec.tokens == plain.tokens and spec.stats.accepted > 0
    whole = Engine(TableBackend(V, seed=0)).generate(PROMPT, max_tokens=60, params=dataclasses.replace(
        params, penalty_last_n=None))
    assert whole.tokens != plain.tokens
    out_only = dataclasses.replace(params, penalize_prompt=False)  # the output alone: still exact
    plain = Engine(TableBackend(V, seed=0)).generate(PROMPT, max_tokens=60, params=out_only)
    assert make_spec(k).generate(PROMPT, max_tokens=60, params=out_only).tokens == plain.tokens


def exact_joint(params, n=3):
    """P(sequence) of n tokens from the target alone, each position adjusted with its own history."""
    return synthetic.exact_joint(TableBackend(V, seed=0), PROMPT, params, n,
                                 adjust=lambda row, hist: reference_adjust(row, params, hist, len(PROMPT)))


def sampled_joint(params, n_runs, n=3):
    eng = make_spec(k=3)
    counts, drafted = sequence_counts(eng, PROMPT, params, n_runs, n)
    assert drafted > 0
    return counts


STRONG = SamplingParams(1.0, seed=50_000, presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=3.0,
                        logit_bias=((2, 1.5), (5, -3.0)))


@pytest.mark.parametrize("coupled", [False, True], ids=["rejection", "coupled"])
def test_sampled_sequences_with_penalties_follow_the_target(coupled):
    counts = sampled_joint(dataclasses.replace(STRONG, coupled=coupled), 20_000)
    probs = exact_joint(STRONG)
    assert pvalue(counts, probs) > 1e-4
    assert 0.5 * np.abs(counts / counts.sum() - probs).sum() < 0.06
    # the penalties matter: without them the law is far from this one
    plain = exact_joint(SamplingParams(1.0))
    assert 0.5 * np.abs(plain - probs).sum() > 0.15


def test_the_same_test_fails_rows_adjusted_with_the_history_before_the_pass(monkeypatch):
    def stale(logits, params, tokens, n_prompt):  # forgets the drafts: every row sees the history of row 0
        n = len(logits)
        return np.stack([adjust_logits(row, params, list(tokens[:len(tokens) - n + 1]), n_prompt) for row in logits])

    monkeypatch.setattr(engine_mod, "adjust_logits", stale)
    assert pvalue(sampled_joint(STRONG, 5_000), exact_joint(STRONG)) < 1e-6  # ~1e-46 at 3,000 runs


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_with_penalties_equals_plain_decoding(k, temperature):
    params = SamplingParams(temperature, seed=5, **PENALTIES)
    plain = Engine(TableBackend(V, seed=0)).generate(PROMPT, max_tokens=60, params=params)
    spec = make_spec(k).generate(PROMPT, max_tokens=60, params=params)
    assert spec.tokens == plain.tokens
    assert spec.stats.accepted > 0
    assert plain.tokens != Engine(TableBackend(V, seed=0)).generate(PROMPT, max_tokens=60).tokens
    # a deterministic drafter (prompt lookup) too
    lookup = Engine(TableBackend(V, seed=0), LookupDrafter(), draft_max=k).generate(PROMPT * 5, max_tokens=60,
                                                                                    params=params)
    assert lookup.tokens == Engine(TableBackend(V, seed=0)).generate(PROMPT * 5, max_tokens=60, params=params).tokens


def test_a_banned_token_never_appears():
    unbanned = Engine(TableBackend(V, seed=0)).generate(PROMPT, max_tokens=60).tokens
    banned = Counter(unbanned).most_common(1)[0][0]
    for temp in (0.0, 1.0):
        params = SamplingParams(temp, seed=3, logit_bias=((banned, -np.inf),))
        out = make_spec(4).generate(PROMPT, max_tokens=60, params=params).tokens
        assert banned not in out and len(out) == 60


def test_logprobs_from_verify_passes_equal_plain_decoding():
    for params in (SamplingParams(0.0), SamplingParams(0.0, **PENALTIES)):
        plain = Engine(TableBackend(V, seed=0)).generate(PROMPT, max_tokens=40, params=params, logprobs=3)
        spec = make_spec(4).generate(PROMPT, max_tokens=40, params=params, logprobs=3)
        assert spec.stats.accepted > 0 and spec.tokens == plain.tokens
        assert spec.logprobs == plain.logprobs  # the same bits
    # the model's own log-softmax at each position (before any sampling setting), alternatives most likely first
    target, hist = TableBackend(V, seed=0), list(PROMPT)
    for entry, token in zip(spec.logprobs, spec.tokens):
        row = target.logits_after(hist).astype(np.float64)
        logp = row - np.log(np.exp(row - row.max()).sum()) - row.max()
        assert entry.token == token and entry.logprob == pytest.approx(logp[token], abs=1e-9)
        assert [t for t, _ in entry.top] == list(np.argsort(-logp, kind="stable")[:3])
        hist.append(token)
    assert spec.logprobs[0].top[0][1] >= spec.logprobs[0].top[1][1] >= spec.logprobs[0].top[2][1]
    none = make_spec(4).generate(PROMPT, max_tokens=5, params=SamplingParams(0.0))
    assert none.logprobs is None
    zero = make_spec(4).generate(PROMPT, max_tokens=5, params=SamplingParams(0.0), logprobs=0)
    assert [e.top for e in zero.logprobs] == [()] * 5


def test_post_sampling_probabilities_are_the_samplers_and_equal_plain_decodings():
    """llama-server's post_sampling_probs: each token's probability under the distribution it was drawn from (bias,
    penalties with the drafts before the row, top-k, temperature), its alternatives those above 0, most likely
    first; the same numbers from verify passes as from plain decoding, and at temperature 0 all on the token."""
    from speculant.verify import probs_from_logits

    for params in (SamplingParams(0.8, top_k=4, seed=3, **PENALTIES), SamplingParams(1.3, top_p=0.7, seed=4),
                   SamplingParams(0.0, **PENALTIES)):
        plain = Engine(TableBackend(V, seed=0)).generate(PROMPT, max_tokens=40, params=params, logprobs=6,
                                                         post_sampling=True)
        spec = make_spec(4).generate(PROMPT, max_tokens=40, params=params, logprobs=6, post_sampling=True)
        assert spec.stats.accepted > 0 and spec.tokens == plain.tokens and spec.logprobs == plain.logprobs
        target, hist = TableBackend(V, seed=0), list(PROMPT)
        for entry, token in zip(spec.logprobs, spec.tokens):
            row = reference_adjust(target.logits_after(hist), params, hist, len(PROMPT))
            if params.greedy:
                assert int(np.argmax(row)) == token and entry.logprob == 0.0 and entry.top == ((token, 0.0),)
            else:
                probs = probs_from_logits(row, params)
                assert np.exp(entry.logprob) == pytest.approx(probs[token], rel=1e-6)  # float32 logits
                alternatives = [t for t in np.argsort(-probs, kind="stable") if probs[t] > 0][:6]
                assert [t for t, _ in entry.top] == alternatives
                assert np.exp([lp for _, lp in entry.top]) == pytest.approx(probs[alternatives], rel=1e-6)
            hist.append(token)
        truncated = [len(e.top) for e in spec.logprobs]
        assert max(truncated) <= (4 if params.top_k else 6) and (params.greedy or min(truncated) < 6)
    model = Engine(TableBackend(V, seed=0)).generate(PROMPT, max_tokens=5, params=params, logprobs=2)
    assert [e.logprob for e in model.logprobs] != [0.0] * 5  # without it: the model's own, as before


def test_logprobs_follow_the_tokens_through_stop_strings_and_events():
    texts = [b"a", b"b", b"c", b"d", b"e", b"f", b"\xe2\x82", b"\xac"]  # 6 + 7: a split euro sign
    eng = Engine(TableBackend(V, seed=0, texts=texts), ModelDrafter(TableBackend(V, seed=1, texts=texts), V),
                 draft_max=4)
    full = eng.generate(PROMPT, max_tokens=60, logprobs=2)
    text = full.text
    for stop in (text[20:22], text[35:38], "no such stop"):
        result = engine_mod.Result("", [], engine_mod.SpecStats())
        events = list(eng.stream(PROMPT, max_tokens=60, stop=[stop], result=result, logprobs=2))
        assert len(result.logprobs) == len(result.tokens)
        assert [e.token for e in result.logprobs] == result.tokens
        given = [e for ev in events for e in ev.logprobs]
        assert given == result.logprobs[:len(given)]  # events never give a token the stop string dropped
        assert len(given) >= len(result.logprobs) - 2  # only tokens of text held back come after the events
        assert result.logprobs == full.logprobs[:len(result.tokens)]


def test_settings_are_checked():
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3.0), dict(repetition_penalty=0.0),
                dict(repetition_penalty=float("nan")), dict(logit_bias=((1, 101.0),)), dict(logit_bias=((-1, 1.0),)),
                dict(logit_bias=((1, float("inf")),)), dict(logit_bias=((1, float("nan")),))):
        with pytest.raises(SettingsError):
            SamplingParams(0.0, **bad)
    eng = make_spec(2)
    with pytest.raises(SettingsError, match="outside the vocabulary"):
        eng.generate(PROMPT, max_tokens=2, params=SamplingParams(0.0, logit_bias=((V, 1.0),)))
    for n_top in (-1, 21, 1.5):
        with pytest.raises(SettingsError, match="logprobs"):
            eng.generate(PROMPT, max_tokens=2, logprobs=n_top)


def test_logit_bias_flag_parses_as_llama_cpp():
    assert parse_logit_bias(["15043+1", "15043-0.5", "7-inf", "9+2e1"]) == ((15043, -0.5), (7, -np.inf), (9, 20.0))
    for bad in ("15043", "x+1", "1+inf", "1*2"):
        with pytest.raises(SettingsError, match="logit-bias"):
            parse_logit_bias([bad])


def test_token_logprobs_rows_sum_to_one():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 100)).astype(np.float32) * 5
    out = token_logprobs(logits, [3, 1, 4, 1], 100)
    for entry in out:
        assert sum(np.exp(lp) for _, lp in entry.top) == pytest.approx(1.0)
        assert len({t for t, _ in entry.top}) == 100


def test_token_logprobs_match_a_plain_log_softmax_and_stable_sort():
    """Row by row, with the alternatives searched above a cut: the values of a full log_softmax, and the
    alternatives of a stable sort (ties by id, also at the n-th place), on rows full of ties."""
    rng = np.random.default_rng(3)
    for trial in range(60):
        v = int(rng.choice([7, 300, 151936]))
        logits = (rng.standard_normal((3, v)) * rng.uniform(0.05, 30)).astype(np.float32)
        if trial % 2:
            logits = np.round(logits)  # many ties
        if trial % 5 == 0:
            logits[:, rng.integers(0, v, 3)] = -np.inf  # banned tokens
        tokens = rng.integers(0, v, 3)
        n_top = int(rng.integers(0, 25))
        for entry, row, token in zip(token_logprobs(logits, tokens, n_top), logits, tokens):
            x = row.astype(np.float64) - row.max()
            logp = x - np.log(np.exp(x).sum())
            order = np.argsort(-logp, kind="stable")[:min(n_top, v)]
            assert entry.token == token and entry.logprob == logp[token]
            assert entry.top == tuple((int(t), float(logp[t])) for t in order)


# -- the real models (llama.cpp) ------------------------------------------------------------------------------

@pytest.mark.models
def test_real_models_logprobs_and_penalties_are_exact(qwen_target, qwen_draft):
    """Qwen 1.5B target with the 0.5B draft: greedy output with penalties equals plain decoding's, and the
    logprobs of every token (computed in verify passes of up to 5 tokens) are bit for bit plain decoding's."""
    prompt = qwen_target.tokenize("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    plain = Engine(qwen_target)
    spec = Engine(qwen_target, ModelDrafter(qwen_draft, qwen_target.n_vocab), draft_max=4)
    for params in (SamplingParams(0.0), SamplingParams(0.0, presence_penalty=0.5, frequency_penalty=0.3,
                                                       repetition_penalty=1.1, logit_bias=((220, -1.0),))):
        a = plain.generate(prompt, max_tokens=40, params=params, logprobs=5)
        b = spec.generate(prompt, max_tokens=40, params=params, logprobs=5)
        assert b.stats.accepted > 10 and b.tokens == a.tokens
        assert b.logprobs == a.logprobs
    assert a.tokens != plain.generate(prompt, max_tokens=40).tokens  # the penalties changed the text
