"""The decode loop on tiny synthetic models: exactness (greedy identity, distribution of whole sequences),
bookkeeping (acceptance when target == draft, call counts) and stopping rules."""

import dataclasses
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import speculant.engine as engine_mod
from speculant.drafters.model import ModelDrafter
from speculant.engine import Engine
from speculant.errors import ContextOverflowError, SettingsError
from speculant.verify import InfillVocab, SamplingParams, residual

import synthetic
from synthetic import TableBackend, pvalue, sequence_counts

V = 8
PROMPT = [1, 2, 3]


def make_engine(k, target_seed=0, draft_seed=1, **kw):
    target = TableBackend(V, seed=target_seed, **kw)
    draft = TableBackend(V, seed=draft_seed, **kw)
    return Engine(target, ModelDrafter(draft, V), draft_max=k)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_identity(k):
    plain = Engine(TableBackend(V, seed=0)).generate(PROMPT, max_tokens=60)
    spec = make_engine(k).generate(PROMPT, max_tokens=60)
    assert spec.tokens == plain.tokens
    assert spec.stats.drafted > 0 and 0 < spec.stats.accepted < spec.stats.drafted


@pytest.mark.parametrize("k", [1, 3, 5])
def test_same_model_as_draft_accepts_everything(k):
    eng = make_engine(k, target_seed=0, draft_seed=0)
    r = eng.generate(PROMPT, max_tokens=24)
    assert r.stats.acceptance_rate == 1.0
    assert r.stats.target_calls == -(-24 // (k + 1))
    # every (k+1)-th token is the target's own, the others come from the draft
    assert r.from_draft == [(i % (k + 1)) != k for i in range(24)]


def exact_joint(params, n=3):
    return synthetic.exact_joint(TableBackend(V, seed=0), PROMPT, params, n)


def sampled_joint(params, n_runs, k=3, n=3):
    return sequence_counts(make_engine(k), PROMPT, params, n_runs, n)[0]


# rejection sampling (coupled=False: the seeds only seed the runs); the coupled draws of seeded requests below
SETTINGS = [SamplingParams(1.0, seed=10_000, coupled=False), SamplingParams(0.7, top_k=4, seed=20_000, coupled=False),
            SamplingParams(1.3, top_p=0.8, seed=30_000, coupled=False),
            SamplingParams(0.9, min_p=0.05, seed=40_000, coupled=False),
            SamplingParams(1.0, seed=50_000), SamplingParams(0.8, top_k=5, seed=60_000)]
# llama.cpp's infill sampler (verify.infill_keep) over texts that prefix each other; 7 ends the text
INFILL = InfillVocab((b"a", b"ab", b"b", b"ba", b"c", b"abc", b"bc", b""), frozenset({7}), 7)
SETTINGS += [SamplingParams(1.0, seed=70_000, coupled=False, infill=INFILL, infill_after=""),
             SamplingParams(1.3, top_k=6, seed=80_000, infill=INFILL, infill_after="top_k")]


@pytest.mark.parametrize("params", SETTINGS, ids=["T1", "T0.7-topk4", "T1.3-topp0.8", "T0.9-minp", "coupled-T1",
                                                  "coupled-T0.8-topk5", "T1-infill", "coupled-T1.3-topk6-infill"])
def test_sampled_sequences_follow_the_target(params):
    counts = sampled_joint(params, 20_000)
    probs = exact_joint(params)
    if params.infill is not None:  # it changes the law (the test would pass a verifier that ignored it otherwise)
        assert 0.5 * np.abs(probs - exact_joint(dataclasses.replace(params, infill=None))).sum() > 0.2
    assert pvalue(counts, probs) > 1e-4
    assert 0.5 * np.abs(counts / counts.sum() - probs).sum() < 0.06


def test_the_sequence_test_fails_a_wrong_verifier(monkeypatch):
    def wrong(draft_tokens, draft_probs, target_probs, rng):  # accepts with min(1, q/p)
        for i, x in enumerate(draft_tokens):
            p, q = target_probs[i], draft_probs[i]
            if rng.random() >= min(1.0, q[x] / p[x]):
                return i, int(rng.choice(V, p=residual(p, q, x)))
        return len(draft_tokens), int(rng.choice(V, p=target_probs[-1]))

    monkeypatch.setattr(engine_mod, "verify_sampled", wrong)
    params = SamplingParams(1.0, seed=10_000, coupled=False)
    assert pvalue(sampled_joint(params, 20_000), exact_joint(params)) < 1e-6


def test_the_sequence_test_fails_wrong_coupled_draws(monkeypatch):
    """Coupled draws that favour the likeliest token a little: they take it instead at a quarter of the
    positions where the next seed would have drawn another token."""
    right = engine_mod.coupled_draw

    def wrong(probs, seed, position):
        first = right(probs, seed, position)
        second = right(probs, seed + 1, position)
        return int(np.argmax(probs)) if first != second and (seed + position) % 4 == 0 else first

    monkeypatch.setattr(engine_mod, "coupled_draw", wrong)
    params = SamplingParams(1.0, seed=50_000)
    assert pvalue(sampled_joint(params, 20_000), exact_joint(params)) < 1e-6


@pytest.mark.parametrize("temperature,top_k", [(0.9, 0), (1.2, 3)])
def test_a_seeded_sampled_output_is_the_same_whatever_is_drafted(temperature, top_k):
    """Coupled draws: the token at each position is a function of the target's row, the seed and the position,
    so plain decoding, any draft length, the adaptive policy and prompt lookup all give the same tokens; a draft
    model that is the target itself is always accepted (it draws with the same noise)."""
    from speculant.drafters.lookup import LookupDrafter

    prompt = PROMPT * 4
    for seed in range(6):
        params = SamplingParams(temperature, top_k=top_k, seed=seed)
        plain = Engine(TableBackend(V, seed=0)).generate(prompt, max_tokens=40, params=params).tokens
        runs = [make_engine(k).generate(prompt, max_tokens=40, params=params) for k in (1, 2, 5, 8)]
        runs.append(Engine(TableBackend(V, seed=0), ModelDrafter(TableBackend(V, seed=1), V), draft_max=4,
                           adaptive=True).generate(prompt, max_tokens=40, params=params))
        runs.append(Engine(TableBackend(V, seed=0), LookupDrafter(), draft_max=3).generate(
            prompt, max_tokens=40, params=params))
        for r in runs:
            assert r.tokens == plain and r.stats.drafted > 0
        assert sum(r.stats.accepted for r in runs) > 0
        same = make_engine(3, draft_seed=0).generate(prompt, max_tokens=40, params=params)
        assert same.tokens == plain and same.stats.acceptance_rate == 1.0
    unseeded = SamplingParams(temperature, top_k=top_k, coupled=True)  # a random seed of its own
    assert len(make_engine(4).generate(prompt, max_tokens=10, params=unseeded).tokens) == 10


@pytest.mark.parametrize("coupled", [False, True])
def test_seeded_runs_are_reproducible(coupled):
    eng = make_engine(4)
    a = eng.generate(PROMPT, max_tokens=30, params=SamplingParams(0.8, seed=5, coupled=coupled)).tokens
    b = eng.generate(PROMPT, max_tokens=30, params=SamplingParams(0.8, seed=5, coupled=coupled)).tokens
    c = eng.generate(PROMPT, max_tokens=30, params=SamplingParams(0.8, seed=6, coupled=coupled)).tokens
    assert a == b and a != c


def test_stops_on_eos_and_token_limit():
    target = TableBackend(V, seed=0)
    plain = Engine(target).generate(PROMPT, max_tokens=40).tokens
    eos = plain[5]
    first = plain.index(eos)
    r = Engine(TableBackend(V, seed=0, eos=eos), ModelDrafter(TableBackend(V, seed=1), V), draft_max=4).generate(
        PROMPT, max_tokens=40)
    assert r.tokens == plain[:first] and r.finish_reason == "stop"
    r = make_engine(4).generate(PROMPT, max_tokens=7)
    assert len(r.tokens) == 7 and r.finish_reason == "length"


def test_a_one_token_request_leaves_the_draft_model_alone():
    """Its one token comes from the prompt's last pass, so nothing is drafted and the draft model's prompt
    processing would be paid for nothing (evaluation harnesses score with echo and max_tokens 1)."""
    engine = make_engine(4)
    r = engine.generate(PROMPT * 10, max_tokens=1)
    assert r.tokens == Engine(TableBackend(V, seed=0)).generate(PROMPT * 10, max_tokens=1).tokens
    assert engine.drafter.backend.tokens == [] and r.stats.drafted == 0
    r = engine.generate(PROMPT * 10, max_tokens=2)
    assert len(engine.drafter.backend.tokens) >= len(PROMPT * 10) - 1


def test_stop_strings_cut_the_text_and_stream_nothing_past_them():
    eng = make_engine(4)
    full = eng.generate(PROMPT, max_tokens=30)
    stop = full.text[10:16]
    events = []
    r = engine_mod.Result("", [], engine_mod.SpecStats())
    for e in eng.stream(PROMPT, max_tokens=30, stop=[stop], result=r):
        events.append(e.text)
    assert r.text == full.text[: full.text.find(stop)]
    assert "".join(events) == r.text and r.finish_reason == "stop"


def test_context_full_stops_with_a_message():
    eng = make_engine(4, n_ctx=20)
    r = eng.generate(PROMPT, max_tokens=100)
    assert len(PROMPT) + len(r.tokens) == 20
    assert "context window full" in r.message and r.finish_reason == "length"
    plain = Engine(TableBackend(V, seed=0, n_ctx=20)).generate(PROMPT, max_tokens=100)
    assert plain.tokens == r.tokens


def test_a_cancelled_request_stops_the_draft_models_prompt_between_passes():
    """A server sets should_stop when the client leaves: the draft model's prompt processing (seconds for a long
    prompt) stops at its next pass too, not only the target's; what it evaluated stays, and the next request on
    the same engine decodes as ever."""
    from speculant.backends.base import CATCH_UP_TOKENS
    from speculant.errors import Cancelled

    prompt = [int(t) for t in np.random.default_rng(5).integers(0, V, 3 * CATCH_UP_TOKENS + 40)]
    eng = make_engine(4, n_ctx=2048)
    target, draft = eng.target, eng.drafter.backend
    target.should_stop = lambda: draft.calls > 0  # the client leaves during the draft's first pass
    with pytest.raises(Cancelled):
        eng.generate(prompt, max_tokens=20)
    assert len(target.tokens) == len(prompt) - 1  # the target's prompt was done before the draft's began
    assert draft.tokens == prompt[:CATCH_UP_TOKENS]  # one pass of the draft's, then it stopped
    target.should_stop = None
    again = eng.generate(prompt, max_tokens=20)
    assert again.tokens == Engine(TableBackend(V, seed=0, n_ctx=2048)).generate(prompt, max_tokens=20).tokens
    assert again.stats.drafted > 0


@pytest.mark.parametrize("profile,adaptive,expected", [
    ({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.05, 16: 1.1}, True, 8),  # a GPU's passes: flat
    ({1: 1.0, 2: 1.08, 4: 1.23, 8: 1.72, 16: 2.12}, True, 4),  # Sapphire Rapids, 2 cores (measured)
    (None, True, 4),  # unknown
    ({1: 1.0, 8: 1.0}, False, 4),  # a fixed k is the user's, or 4
])
def test_the_default_draft_bound_follows_the_targets_pass_costs(profile, adaptive, expected):
    """Without --draft-max the adaptive policy may draft up to 8 where an 8-token pass costs at most 1.3 one-token
    passes (longer drafts pay there), else 4; the outputs stay plain decoding's."""
    target = _Priced(profile)  # (below)
    eng = Engine(target, ModelDrafter(TableBackend(V, seed=0), V), draft_max=None, adaptive=adaptive)
    assert eng.draft_max == expected
    if adaptive:
        assert eng.policy.k_max == expected
    assert eng.generate(PROMPT, max_tokens=30).tokens == Engine(TableBackend(V, seed=0)).generate(
        PROMPT, max_tokens=30).tokens


def test_bad_settings():
    eng = make_engine(4, n_ctx=10)
    with pytest.raises(SettingsError):
        eng.generate([], max_tokens=5)
    with pytest.raises(SettingsError):
        eng.generate(PROMPT, max_tokens=0)
    for until_the_end in (-1, None, np.int64(-1)):  # until the end of generation or a full context
        r = eng.generate([1, 2, 3], max_tokens=until_the_end)
        assert r.finish_reason == "length" and len(r.tokens) == 10 - 3 and "context window full" in r.message
    assert len(eng.generate([1, 2, 3], max_tokens=np.int32(2)).tokens) == 2
    with pytest.raises(SettingsError):
        eng.generate([99], max_tokens=5)
    with pytest.raises(ContextOverflowError):
        eng.generate(list(range(8)) * 2, max_tokens=5)
    with pytest.raises(SettingsError):
        Engine(TableBackend(V), draft_max=-1)


def _spelled(target, tokens):
    return b"".join(target.token_bytes(t) for t in tokens).decode()


def test_stop_string_tokens_match_the_text():
    """`tokens` are the tokens of `text`: one that only spells the stop string is not in either; one that
    begins before it (and so put text in) stays, in both plain and speculative runs."""
    eng = make_engine(4)
    full = eng.generate(PROMPT, max_tokens=30)
    target = eng.target
    tok = full.tokens[8]
    whole = _spelled(target, [tok])  # a stop string that is exactly one token
    for engine in (eng, Engine(TableBackend(V, seed=0))):
        r = engine.generate(PROMPT, max_tokens=30, stop=[whole])
        assert r.finish_reason == "stop" and _spelled(target, r.tokens) == r.text
        assert r.tokens == full.tokens[:full.tokens.index(tok)] and len(r.from_draft) == len(r.tokens)
    straddle = whole[1:] + "<"  # begins inside a token and ends in the next one
    r = eng.generate(PROMPT, max_tokens=30, stop=[straddle])
    cut = full.text.find(straddle)
    assert r.text == full.text[:cut]
    assert _spelled(target, r.tokens).startswith(r.text) and len(_spelled(target, r.tokens[:-1])) < cut


def test_stats_tell_plain_decoding_from_rejected_drafts():
    plain = Engine(TableBackend(V, seed=0)).generate(PROMPT, max_tokens=12).stats
    assert plain.acceptance_rate is None and plain.to_dict()["acceptance_rate"] is None
    assert plain.mean_accepted_length == 1.0 and plain.plain_steps == plain.target_calls == 12
    line = plain.summary(speculative=False)
    assert "plain decoding" in line and "acceptance" not in line and "%" not in line
    spec = make_engine(3).generate(PROMPT, max_tokens=24).stats
    line = spec.summary(speculative=True)
    assert f"drafted {spec.drafted}, accepted {spec.accepted} (" in line and "τ" in line
    assert spec.mean_accepted_length >= 1


def test_tau_counts_the_end_of_generation_token():
    target = TableBackend(V, seed=0)
    plain = Engine(target).generate(PROMPT, max_tokens=40).tokens
    r = Engine(TableBackend(V, seed=0, eos=plain[3])).generate(PROMPT, max_tokens=40)
    s = r.stats
    assert s.ended_by_eog and s.target_calls == len(r.tokens) + 1
    assert s.mean_accepted_length == 1.0  # plain decoding: one token per call, the EOS included


def test_metrics_tau_is_the_per_request_tau():
    pytest.importorskip("prometheus_client")
    from speculant.server import Metrics

    target = TableBackend(V, seed=0)
    plain = Engine(target).generate(PROMPT, max_tokens=40).tokens
    r = Engine(TableBackend(V, seed=0, eos=plain[3])).generate(PROMPT, max_tokens=40)
    m = Metrics()
    m.record(r.stats)
    m.record(r.stats)
    assert m.tau._value.get() == r.stats.mean_accepted_length == 1.0


class _Priced(TableBackend):
    """A synthetic target with a given measured cost profile r(n)."""

    def __init__(self, profile, **kw):
        super().__init__(V, seed=0, **kw)
        self.profile = profile

    def cost_profile(self):
        return self.profile

    def slot(self, i):
        return self if i == 0 else _Priced(self.profile)


@pytest.mark.parametrize("r16,want", [(2.4, 32), (2.99, 32), (3.0, 16), (5.2, 16), (None, 16)])
def test_long_free_drafts_go_to_32_where_long_passes_are_cheap(r16, want):
    """An adaptive engine bounds long free drafts (a prediction, history) at 32 tokens where its target's measured
    16-token pass costs under 3 one-token passes (AMX tile products: r(16) ~2.4), else at 16 (VNNI ~3.4, AVX2 ~5.2;
    no profile); an explicit bound, or a fixed policy, keeps its own."""
    target = _Priced(None if r16 is None else {1: 1.0, 8: 1.9, 16: r16})
    draft = ModelDrafter(TableBackend(V, seed=1), V)
    assert engine_mod.default_long_max(target.cost_profile()) == want
    assert Engine(target, draft, draft_max=4, adaptive=True).long_max == want
    assert Engine(target, draft, draft_max=4, adaptive=True, long_max=20).long_max == 20
    assert Engine(target, draft, draft_max=4).long_max == engine_mod.LONG_MAX
    plain = Engine(target, adaptive=True)  # no drafter: the costs are read when a prediction comes
    assert plain.cost_profile is None and plain.long_max == engine_mod.LONG_MAX
    slot = plain.for_slot(1)  # made before any prediction: not pinned to the bound of that moment
    plain._with_prediction([1, 2, 3], 0)
    slot._with_prediction([1, 2, 3], 0)
    assert plain.long_max == want and slot.long_max == want


class _Held(TableBackend):
    """A target whose first pass waits until released: a generation is then mid-step in its thread."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.inside, self.release = threading.Event(), threading.Event()

    def _decode(self, tokens, start, n_logits):
        if not self.release.is_set():
            self.inside.set()
            self.release.wait(30)
        return super()._decode(tokens, start, n_logits)


def test_one_engine_refuses_a_second_thread_mid_step_and_use_after_close():
    plain = Engine(TableBackend(V, seed=0)).generate(PROMPT, max_tokens=20).tokens
    target = _Held(V, seed=0)
    eng = Engine(target, ModelDrafter(TableBackend(V, seed=1), V), draft_max=3)
    first = {}
    thread = threading.Thread(target=lambda: first.update(r=eng.generate(PROMPT, max_tokens=20)))
    thread.start()
    assert target.inside.wait(30)
    with pytest.raises(SettingsError, match="generating in another thread"):  # it crashed llama.cpp
        eng.generate(PROMPT, max_tokens=20)
    target.release.set()
    thread.join(30)
    assert first["r"].tokens == plain  # the first generation is untouched
    # interleaved on one thread (a suspended stream) is still fine, and exact
    suspended = eng.stream(PROMPT, max_tokens=20)
    next(suspended)
    assert eng.generate(PROMPT, max_tokens=20).tokens == plain
    assert [next(suspended).token for _ in range(5)] == plain[1:6]
    eng.close()
    with pytest.raises(SettingsError, match="closed"):  # it segfaulted on a llama.cpp model
        eng.generate(PROMPT, max_tokens=4)


def test_api_arguments_of_the_wrong_kind_are_settings_errors():
    eng = Engine(TableBackend(V, seed=0))
    full = eng.generate(PROMPT, max_tokens=12)
    stop = f"<{full.tokens[3]}>"  # one string is one stop string (it was split into characters: '<' stopped at once)
    one = eng.generate(PROMPT, max_tokens=12, stop=stop)
    assert one.stop_string == stop and one.text == full.text[:full.text.index(stop)]
    assert one.tokens == eng.generate(PROMPT, max_tokens=12, stop=[stop]).tokens
    for kwargs, fragment in [
        (dict(params={"temperature": 0}), "SamplingParams"),
        (dict(max_tokens=True), "token limit"),
        (dict(stop=[1]), "stop must be"),
    ]:
        with pytest.raises(SettingsError, match=fragment):
            eng.generate(PROMPT, **kwargs)
    for prompt in (b"hello", [1.5, 2], None, 5, [True]):
        with pytest.raises(SettingsError, match="must be integers"):
            eng.generate(prompt, max_tokens=2)
    for kwargs, fragment in [(dict(temperature=None), "temperature"), (dict(top_k=2.5), "top-k"),
                             (dict(seed="1"), "seed"), (dict(top_p=None), "top-p"),
                             (dict(logit_bias=5), "logit bias"), (dict(logit_bias={1: "x"}), "logit bias")]:
        with pytest.raises(SettingsError, match=fragment):
            SamplingParams(**kwargs)
    assert SamplingParams(logit_bias={1: -2.0}).logit_bias == ((1, -2.0),)  # OpenAI's dict form


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_bias_that_bans_every_token_is_refused(temperature):
    """Greedy decoding took token 0 (a banned one), plain and speculative alike; sampling refused it."""
    v = 8
    params = SamplingParams(temperature, seed=1, logit_bias=tuple((t, -np.inf) for t in range(v)))
    for eng in (Engine(TableBackend(v, seed=0)), Engine(TableBackend(v, seed=0), ModelDrafter(TableBackend(v, seed=1), v),
                                                         draft_max=3)):
        with pytest.raises(SettingsError, match="bans them all"):
            eng.generate([1, 2, 3], max_tokens=4, params=params)


@pytest.mark.parametrize("end", ["eog", "stop"])
def test_drafts_accepted_past_the_end_are_not_counted(end):
    """Drafts the target accepts after an end-of-generation token or a stop string never reach the output:
    accepted (and so usage's accepted_prediction_tokens and the metrics) count only the drafts the output took,
    as τ counts only the tokens it took."""
    plain = Engine(TableBackend(V, seed=0)).generate(PROMPT, max_tokens=40)
    idx = next(i for i in range(2, 8) if plain.tokens[i] not in plain.tokens[:i])
    tok = plain.tokens[idx]
    target = TableBackend(V, seed=0, eos=tok if end == "eog" else None)
    eng = Engine(target, ModelDrafter(TableBackend(V, seed=0), V), draft_max=8, adaptive=False)
    r = eng.generate(PROMPT, max_tokens=40, stop=[_spelled(target, [tok])] if end == "stop" else [])
    s = r.stats
    assert r.tokens == plain.tokens[:idx] and s.target_calls == 1  # the one step drafted 8, all accepted
    assert s.accepted == s.drafted == s.produced_tokens == idx + 1  # idx tokens, and the one that ended it
    assert sum(s.accepted_by_source.values()) == sum(s.accepted_by_position) == s.accepted
    assert sum(s.drafted_by_source.values()) == sum(s.drafted_by_position) == s.drafted
    assert s.draft_lengths == [idx + 1] and s.mean_accepted_length == idx + 1
    assert s.acceptance_by_position == [1.0] * (idx + 1)  # no position past the end, as if none was drafted


def test_a_pass_that_gives_nan_logits_is_an_error():
    """A target whose rows turn NaN after some tokens (damaged weights that only some tokens read) stops the
    generation with a ModelError naming it, instead of decoding NaN rows (whose argmax is a garbage token)."""
    from speculant.errors import ModelError

    target = TableBackend(V, seed=0)
    target.table[:, 3] = np.nan  # every row after token 3
    with pytest.raises(ModelError, match="table-0 computes NaN or infinite logits"):
        Engine(target).generate([3], max_tokens=5)
    target.table[:, 3] = 0.0
    assert len(Engine(target).generate([3], max_tokens=5).tokens) == 5


def test_python_values_a_caller_may_pass():
    """Found by a user of the Python API: numpy integers as seeds (an OverflowError after the models loaded),
    a generator of ids (read twice: "the prompt is empty"), stop=5 (a TypeError), and bools taken as numbers."""
    eng = Engine(TableBackend(V, seed=0))
    for seed in (np.int64(7), np.int32(7), np.uint64(7), np.uint32(7)):
        params = SamplingParams(1.0, seed=seed)
        assert type(params.seed) is int
        assert eng.generate(PROMPT, max_tokens=6, params=params).tokens == \
            eng.generate(PROMPT, max_tokens=6, params=SamplingParams(1.0, seed=7)).tokens
    assert SamplingParams(logit_bias={np.int64(2): np.float32(1.5)}).logit_bias == ((2, 1.5),)
    assert SamplingParams(logit_bias=iter([(2, 1.0)])).logit_bias == ((2, 1.0),)
    assert eng.generate((t for t in PROMPT), max_tokens=4).tokens == eng.generate(PROMPT, max_tokens=4).tokens
    for kwargs, fragment in [(dict(stop=5), "stop must be"), (dict(stop=[5]), "stop must be"),
                             (dict(logprobs=True), "top logprobs")]:
        with pytest.raises(SettingsError, match=fragment):
            eng.generate(PROMPT, max_tokens=2, **kwargs)
    with pytest.raises(SettingsError, match="token ids must be integers"):
        SamplingParams(logit_bias={True: 5})


def _overlap_reference(text, stop):
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


@settings(max_examples=2000, deadline=None)
@given(st.text(alphabet="ab c", max_size=14), st.text(alphabet="ab c", max_size=14))
def test_stop_string_overlap_is_the_reference(text, stop):
    """The text held back while it could still start a stop string: the longest suffix of the text that is a proper
    prefix of the stop string (found by candidates now; comparing every length cost len(stop)^2 a token)."""
    from speculant.engine import _overlap

    assert _overlap(text, stop) == _overlap_reference(text, stop)


def test_a_mixed_prompt_is_its_pieces_tokenized_in_place():
    """llama-server's [ids, "text", ids]: the texts tokenized where they stand, BOS only where the prompt starts
    with text, and not again inside a fill-in-the-middle prompt (which adds its own)."""
    class WithBos(TableBackend):
        def tokenize(self, text, add_special=True, parse_special=True):
            return ([0] if add_special else []) + super().tokenize(text)

        def fim_tokens(self):
            return 5, 6, 7

    eng = Engine(WithBos(V, seed=0))
    assert eng.tokenize_prompt(["1 2", 3]) == [0, 1, 2, 3] == eng.tokenize_prompt("1 2 3")
    assert eng.tokenize_prompt([1, "2 3", 4]) == [1, 2, 3, 4]
    assert eng.tokenize_prompt(["1 2", 3], suffix=[4, "2"]) == eng.tokenize_prompt("1 2 3", suffix="4 2") \
        == [0, 5, 1, 2, 3, 6, 4, 2, 7]
    with pytest.raises(SettingsError, match="prompt token id"):
        eng.tokenize_prompt([1, "2", 99])
