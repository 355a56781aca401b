"""Constrained decoding (grammars, JSON): exact under speculation.

On synthetic models with a small automaton as the constraint: the law of whole sampled sequences equals the
exact masked law (and the same test fails when verify rows are masked with the state before the pass), greedy
output equals plain decoding. constrain_row's lazy search equals masking the whole vocabulary. On the real Qwen
pair with llama.cpp's GBNF grammars: JSON mode and a JSON schema give valid JSON, token for token plain
decoding's."""

import dataclasses
import itertools
import json
import re
from decimal import Decimal

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import speculant.engine as engine_mod
import speculant.constraint as constraint_mod
from speculant.constraint import (Constraint, MaskedRows, TriggeredGrammar, constrain_row, coupled_draw_allowed,
                                  draw_allowed, json_grammar, masked_probs)
from speculant.drafters.lookup import LookupDrafter
from speculant.drafters.model import ModelDrafter
from speculant.engine import Engine
from speculant.errors import SettingsError
from speculant.verify import (SamplingParams, coupled_draw, probs_from_logits, verify_greedy, verify_greedy_lazy,
                              verify_sampled, verify_sampled_lazy)

from synthetic import TableBackend, pvalue

V = 8
PROMPT = [1, 2, 3]


class Automaton(Constraint):
    """t may follow s only if (s + t) % 3 != 0; token 0 never after token 5 has appeared."""

    def __init__(self, last=PROMPT[-1], seen5=False, log=None):
        self.last, self.seen5 = last, seen5
        self.log = log  # every accepted token, to check nothing forbidden is ever accepted

    def _ok(self, t):
        return (self.last + t) % 3 != 0 and not (t == 0 and self.seen5)

    def allowed(self, tokens):
        return np.array([self._ok(int(t)) for t in tokens], dtype=bool)

    def accept(self, token):
        assert self._ok(token), f"accepted a forbidden token {token} after {self.last}"
        if self.log is not None:
            self.log.append(token)
        self.last, self.seen5 = token, self.seen5 or token == 5

    def fork(self):
        return Automaton(self.last, self.seen5)


def reference_probs(logits, allowed, params):
    """The law under a constraint, from the whole mask: the sampler's distribution conditioned on the allowed
    tokens; the mask first when the sampler keeps no allowed token (or truncates nothing)."""
    p = probs_from_logits(logits, params)
    keep = (p > 0) & allowed
    if (p > 0).all() or not keep.any():
        return probs_from_logits(np.where(allowed, logits, -np.inf), params)
    return np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()


@pytest.mark.parametrize("seed", range(20))
def test_constrain_row_gives_the_law_of_masking_everything(seed):
    rng = np.random.default_rng(seed)
    v = 3000
    logits = rng.standard_normal(v).astype(np.float32) * 4
    logits[rng.integers(0, v, 50)] = logits[int(rng.integers(v))]  # ties
    allowed_ids = rng.random(v) < rng.choice([0.001, 0.01, 0.3, 0.9])
    allowed_ids[int(rng.integers(v))] = True

    class Some(Constraint):
        calls = 0

        def allowed(self, tokens):
            Some.calls += len(tokens)
            return allowed_ids[np.asarray(tokens)]

        def accept(self, token):
            pass

        def fork(self):
            return self

    for params in (SamplingParams(0.0), SamplingParams(0.9, top_k=40), SamplingParams(1.0, top_k=7, top_p=0.8,
                                                                                        min_p=0.05),
                   SamplingParams(1.0, top_p=0.5), SamplingParams(1.0)):
        Some.calls = 0
        if params.greedy:
            got = constrain_row(logits, Some(), params)
            assert np.argmax(got) == np.argmax(np.where(allowed_ids, logits, -np.inf))
        else:
            got = masked_probs(logits, Some(), params)
            np.testing.assert_allclose(got, reference_probs(logits, allowed_ids, params), rtol=1e-9, atol=1e-15)
        kept = probs_from_logits(logits, params) > 0 if not params.greedy else None
        conditioned = not params.greedy and not kept.all() and (kept & allowed_ids).any()
        if allowed_ids.mean() > 0.2 and (params.top_k or params.greedy) or conditioned:
            assert Some.calls < v // 4, params  # only the head of the distribution was asked about


class Fixed(Constraint):
    """The same allowed set at every position; counts the tokens asked about."""

    def __init__(self, allowed_ids):
        self.ids, self.calls = allowed_ids, 0

    def allowed(self, tokens):
        self.calls += len(tokens)
        return self.ids[np.asarray(tokens)]

    def accept(self, token):
        pass

    def fork(self):
        return self


def test_a_banned_token_is_never_picked_and_a_complete_grammar_ends_on_a_banned_end():
    """A token at logit -inf (a logit bias, ignore_eos) is never picked, greedy or sampled. Where the grammar allows
    only end-of-generation tokens and they are banned (a complete answer under ignore_eos), the row ends the answer
    on them: it picked token 0 (llama.cpp's grammar then aborted the process on it) or raised a KeyError when
    sampled; where nothing else is allowed either, a clear error."""
    v, eog = 50, 7
    logits = np.linspace(3.0, -3.0, v)
    allowed = np.zeros(v, dtype=bool)
    allowed[[eog, 20]] = True
    logits[20] = -np.inf  # the only allowed token that is not an end: banned
    logits[eog] = -np.inf  # ignore_eos
    complete = Fixed(allowed)
    complete.eog = frozenset({eog, 9})
    for params in (SamplingParams(), SamplingParams(0.8, top_k=5), SamplingParams(1.0), SamplingParams(1.0, top_p=0.5)):
        row = constrain_row(logits, complete, params)
        assert np.flatnonzero(np.isfinite(row)).tolist() == [eog], params
        if not params.greedy:
            assert masked_probs(logits, complete, params)[eog] == 1.0
            probs = probs_from_logits(logits, params)
            assert coupled_draw_allowed(logits, complete, params, probs, seed=1, position=0) == eog
            assert draw_allowed(logits, complete, params, probs, np.random.default_rng(0)) == eog
            rows = MaskedRows(logits[None], complete, params, [])
            assert rows.coupled(0, seed=1, position=0) == eog
    allowed[25] = True  # another token allowed, not banned: it is picked, never the banned end
    assert constrain_row(logits, complete, SamplingParams()).argmax() == 25
    nothing = Fixed(np.eye(v, dtype=bool)[20])  # only the banned token 20, and no end allowed
    with pytest.raises(SettingsError, match="logit bias"):
        constrain_row(logits, nothing, SamplingParams())


class SkewedRng:
    """Wrong randomness for draw_allowed: uniform draws squared (rejection) and keys p / U with U uniform
    instead of exponential (Gumbel-max): close, but not the law."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def standard_exponential(self, n):
        return self.rng.random(n)

    def random(self, *a):
        return self.rng.random(*a) ** 2


@pytest.mark.parametrize("tries", [constraint_mod.REJECTION_TRIES, 0], ids=["rejection", "gumbel"])
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.97), SamplingParams(1.0, top_k=30)],
                         ids=["untruncated", "top-p", "top-k-none-allowed"])
def test_draws_under_a_constraint_follow_the_masked_law(params, tries, monkeypatch):
    """draw_allowed (draws from p kept when allowed; else Gumbel-max, asking about tokens in order of key) draws
    from masked_probs's law, also when the sampler keeps no allowed token (then the mask comes first); the same
    test fails skewed uniform draws and keys made with uniform instead of exponential noise."""
    monkeypatch.setattr(constraint_mod, "REJECTION_TRIES", tries)
    rng = np.random.default_rng(1)
    v = 40
    logits = (rng.standard_normal(v) * 1.5).astype(np.float32)
    allowed_ids = rng.random(v) < 0.6
    if params.top_k:  # none of the 30 likeliest is allowed: the mask comes first
        allowed_ids[:] = False
        allowed_ids[np.argsort(-logits)[30:]] = True
    law = masked_probs(logits, Fixed(allowed_ids), params)
    probs = probs_from_logits(logits, params)
    n = 40_000

    def counts(draw_rng):
        c = np.zeros(v, dtype=np.int64)
        for _ in range(n):
            c[draw_allowed(logits, Fixed(allowed_ids), params, probs, draw_rng)] += 1
        return c

    right = counts(np.random.default_rng(2))
    assert pvalue(right, law) > 1e-4 and 0.5 * np.abs(right / n - law).sum() < 0.02
    if not params.top_k:
        assert pvalue(counts(SkewedRng(2)), law) < 1e-6


class SkewedNoise:
    """Wrong noise for coupled_draw_allowed's block race: uniform instead of exponential."""

    def __init__(self):
        self.right = constraint_mod.block_exponentials

    def __call__(self, seed, position, blocks):
        return 1.0 - np.exp(-self.right(seed, position, blocks))


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_p=0.97),
                                    SamplingParams(1.0, top_k=300)], ids=["untruncated", "top-p", "top-k-none-allowed"])
def test_coupled_draws_under_a_constraint_are_those_of_the_masked_law(params, monkeypatch):
    """A seeded request's wide row (coupled_draw_allowed: blocks asked about in order of the key their mass
    would give) draws the very token coupled_draw draws from masked_probs's law, seed by seed, so its law is
    that law; the same test fails uniform noise in the block race. Blocks: 3 and a partial one."""
    rng = np.random.default_rng(1)
    v = 3 * 256 + 40
    logits = (rng.standard_normal(v) * 2.0).astype(np.float32)
    allowed_ids = rng.random(v) < 0.6
    allowed_ids[256:512] = False  # a block with nothing allowed
    if params.top_k:  # none of the 300 likeliest is allowed: the mask comes first
        allowed_ids[:] = False
        allowed_ids[np.argsort(-logits)[300:]] = True
    law = masked_probs(logits, Fixed(allowed_ids), params)
    probs = probs_from_logits(logits, params)
    got = [coupled_draw_allowed(logits, Fixed(allowed_ids), params, probs, seed, 9) for seed in range(400)]
    assert got == [coupled_draw(law, seed, 9) for seed in range(400)]
    assert all(allowed_ids[got]) and len(set(got)) > 20
    if not params.top_k:
        monkeypatch.setattr(constraint_mod, "block_exponentials", SkewedNoise())
        skewed = [coupled_draw_allowed(logits, Fixed(allowed_ids), params, probs, seed, 9) for seed in range(400)]
        assert skewed != got


def test_a_wide_row_asks_about_few_tokens():
    """Untruncated sampling over a big vocabulary with most tokens allowed: a draw asks about a few dozen
    tokens, where writing the row out asks about every one."""
    rng = np.random.default_rng(0)
    v = 150_000
    logits = (rng.standard_normal(v) * 3).astype(np.float32)
    allowed = Fixed(rng.random(v) < 0.5)
    params = SamplingParams(1.0)
    probs = probs_from_logits(logits, params)
    assert constraint_mod.drawable(probs, params)
    for _ in range(20):
        assert allowed.ids[draw_allowed(logits, allowed, params, probs, rng)]
    assert allowed.calls <= 20 * (constraint_mod.REJECTION_TRIES + constraint_mod.FIRST_CHECK)
    allowed.calls = 0
    for seed in range(20):  # a seeded request's: a block or two of 256 tokens (half of them allowed)
        assert allowed.ids[coupled_draw_allowed(logits, allowed, params, probs, seed, 3)]
    assert allowed.calls <= 20 * 2 * 256
    masked_probs(logits, allowed, params)
    assert allowed.calls > v
    assert not constraint_mod.drawable(probs_from_logits(logits, SamplingParams(1.0, top_k=40)), params)


def test_nothing_allowed_is_a_clear_error():
    class Nothing(Constraint):
        def allowed(self, tokens):
            return np.zeros(len(tokens), dtype=bool)

        def accept(self, token):
            pass

        def fork(self):
            return self

    for params in (SamplingParams(0.0), SamplingParams(1.0, top_k=3), SamplingParams(1.0)):
        with pytest.raises(SettingsError, match="allows no token"):
            constrain_row(np.zeros(10, dtype=np.float32), Nothing(), params)


def exact_joint(params, n=3, make=Automaton):
    target = TableBackend(V, seed=0)
    probs = np.zeros((V,) * n)
    for seq in itertools.product(range(V), repeat=n):
        pr, hist, state = 1.0, list(PROMPT), make()
        for t in seq:
            p = reference_probs(target.logits_after(hist), state.allowed(np.arange(V)), params)[t]
            pr *= p
            if p == 0:
                break
            state.accept(t)
            hist.append(t)
        probs[seq] = pr
    return probs.ravel()


def sampled_joint(params, n_runs, n=3, k=3, make=None):
    eng = Engine(TableBackend(V, seed=0), ModelDrafter(TableBackend(V, seed=1), V), draft_max=k)
    counts = np.zeros(V ** n, dtype=np.int64)
    drafted = 0
    for i in range(n_runs):
        p = dataclasses.replace(params, seed=params.seed + i)
        log = []
        r = eng.generate(PROMPT, max_tokens=n, params=p, constraint=Automaton(log=log) if make is None else make())
        assert make is not None or log == r.tokens[:len(log)]
        drafted += r.stats.drafted
        counts[np.ravel_multi_index(r.tokens, (V,) * n)] += 1
    assert drafted > n_runs  # it speculated
    return counts


@pytest.mark.parametrize("params", [SamplingParams(1.0, seed=60_000, coupled=False),
                                    SamplingParams(0.8, top_k=3, seed=70_000, coupled=False),
                                    SamplingParams(1.2, top_p=0.6, seed=80_000, coupled=False),
                                    SamplingParams(0.8, top_k=3, seed=75_000)],
                         ids=["T1", "T0.8-topk3", "T1.2-topp", "coupled-T0.8-topk3"])
def test_sampled_sequences_under_a_constraint_follow_the_target(params):
    probs = exact_joint(params)
    counts = sampled_joint(params, 20_000)
    assert pvalue(counts, probs) > 1e-4
    assert 0.5 * np.abs(counts / counts.sum() - probs).sum() < 0.06


@pytest.mark.parametrize("params", [SamplingParams(1.0, seed=90_000, coupled=False),
                                    SamplingParams(1.2, top_p=0.6, seed=95_000, coupled=False),
                                    SamplingParams(1.2, top_p=0.6, seed=97_000)],
                         ids=["T1", "T1.2-topp", "coupled-T1.2-topp"])
def test_sampled_sequences_with_drawn_rows_follow_the_target(params, monkeypatch):
    """Every row drawn from (DRAW_ABOVE 0, as a wide row over a real vocabulary): the draft model's tokens are
    kept iff the target's draw equals them, and the law of sequences is still the masked one."""
    monkeypatch.setattr(constraint_mod, "DRAW_ABOVE", 0)
    drawn = []
    real_draw, real_coupled = MaskedRows.draw, constraint_mod.coupled_draw_allowed
    monkeypatch.setattr(MaskedRows, "draw", lambda self, i, rng: drawn.append(i) or real_draw(self, i, rng))
    monkeypatch.setattr(constraint_mod, "coupled_draw_allowed", lambda *a: drawn.append(0) or real_coupled(*a))
    counts = sampled_joint(params, 20_000)
    assert len(drawn) >= 20_000
    assert pvalue(counts, exact_joint(params)) > 1e-4


def test_a_drawn_row_keeps_its_draft_iff_the_draw_equals_it():
    p = np.full((3, 4), 0.25)
    draws = iter([2, 3])
    rows = lambda i: None if i < 2 else p[i]  # noqa: E731
    got = verify_sampled_lazy([2, 1], None, rows, np.random.default_rng(0), lambda i, rng: next(draws))
    assert got == (1, 3)  # row 0 drew the draft 2: kept; row 1 drew 3, not the draft 1: emitted
    draws = iter([2, 1, 0])
    rows = lambda i: None  # noqa: E731
    assert verify_sampled_lazy([2, 1], p[:2], rows, np.random.default_rng(0), lambda i, rng: next(draws)) == (2, 0)


def _triggered():
    """Free until token 2 ("c"), then the automaton until token 4 ("e"), then free again."""
    return TriggeredGrammar(lambda t: bytes([97 + t]), b"c", Automaton(), b"e")


class SharedTrigger(TriggeredGrammar):
    """A wrong fork: the copy shares the call's grammar state with the original."""

    def fork(self):
        out = SharedTrigger(self.token_text, self.trigger, self.grammar, self.end)
        out.inner, out.tail = self.inner, self.tail
        return out


@pytest.mark.parametrize("params", [SamplingParams(1.0, seed=110_000, coupled=False),
                                    SamplingParams(0.8, top_k=3, seed=120_000, coupled=False)],
                         ids=["T1", "T0.8-topk3"])
def test_sampled_sequences_under_a_triggered_grammar_follow_the_target(params):
    """A grammar that starts when the output writes its trigger (tool calls under tool_choice auto): the law of
    sampled sequences under speculation is the exact one; a fork sharing the grammar's state fails the test."""
    probs = exact_joint(params, make=_triggered)
    assert pvalue(sampled_joint(params, 20_000, make=_triggered), probs) > 1e-4
    shared = lambda: SharedTrigger(lambda t: bytes([97 + t]), b"c", Automaton(), b"e")  # noqa: E731
    with pytest.raises(AssertionError):  # it accepts forbidden tokens, or its law is wrong
        assert pvalue(sampled_joint(params, 20_000, make=shared), probs) > 1e-6


@pytest.mark.parametrize("params", [SamplingParams(0.0), SamplingParams(1.0)], ids=["greedy", "T1"])
def test_rows_in_free_text_ask_the_grammar_nothing(params, monkeypatch):
    """While a triggered grammar is free (before its trigger), rows skip the mask: nothing is asked about; the
    row after the trigger is masked by the call's grammar."""
    asked = []
    monkeypatch.setattr(TriggeredGrammar, "allowed", lambda self, tokens: asked.append(len(tokens)) or
                        (np.ones(len(tokens), dtype=bool) if self.inner is None else self.inner.allowed(tokens)))
    rows = np.random.default_rng(3).standard_normal((3, V)).astype(np.float32)
    read = (lambda m, i: m.argmax(i)) if params.greedy else (lambda m, i: m.probs(i))
    free = MaskedRows(rows, _triggered(), params, [0, 1])  # "a", "b": no trigger
    for i in range(3):
        read(free, i)
    assert asked == []
    called = MaskedRows(rows, _triggered(), params, [2, 1])  # "c" opens the call
    read(called, 0)
    assert asked == []
    read(called, 1)
    assert asked, "the row after the trigger was not masked"


def test_the_same_test_fails_rows_masked_with_the_state_before_the_pass(monkeypatch):
    class Stale(MaskedRows):  # every row masked as row 0: the drafts before it are forgotten
        def probs(self, i):
            return masked_probs(self.logits[i], self.state, self.params)

    monkeypatch.setattr(engine_mod, "MaskedRows", Stale)
    params = SamplingParams(1.0, seed=60_000, coupled=False)
    with pytest.raises(AssertionError):  # it accepts forbidden tokens, or its law is wrong
        assert pvalue(sampled_joint(params, 20_000), exact_joint(params)) > 1e-6


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_under_a_constraint_equals_plain_decoding(k):
    plain = Engine(TableBackend(V, seed=0)).generate(PROMPT, max_tokens=60, constraint=Automaton())
    spec = Engine(TableBackend(V, seed=0), ModelDrafter(TableBackend(V, seed=1), V), draft_max=k)
    out = spec.generate(PROMPT, max_tokens=60, constraint=Automaton())
    assert out.tokens == plain.tokens and out.stats.accepted > 0
    assert plain.tokens != Engine(TableBackend(V, seed=0)).generate(PROMPT, max_tokens=60).tokens
    check = Automaton()
    for t in out.tokens:
        check.accept(t)  # every token was allowed where it stands
    # a deterministic drafter proposes forbidden tokens too: the masked rows reject them
    lookup = Engine(TableBackend(V, seed=0), LookupDrafter(), draft_max=k)
    assert lookup.generate(PROMPT * 4, max_tokens=60, constraint=Automaton()).tokens == \
        Engine(TableBackend(V, seed=0)).generate(PROMPT * 4, max_tokens=60, constraint=Automaton()).tokens


@pytest.mark.parametrize("draw_above", [constraint_mod.DRAW_ABOVE, 0], ids=["written-out", "drawn"])
def test_a_seeded_sampled_output_under_a_constraint_is_the_same_whatever_is_drafted(draw_above, monkeypatch):
    monkeypatch.setattr(constraint_mod, "DRAW_ABOVE", draw_above)
    for seed in range(5):
        params = SamplingParams(1.0, seed=seed)
        plain = Engine(TableBackend(V, seed=0)).generate(PROMPT * 4, max_tokens=40, params=params,
                                                         constraint=Automaton()).tokens
        for drafter, k in ((ModelDrafter(TableBackend(V, seed=1), V), 1), (ModelDrafter(TableBackend(V, seed=1), V), 4),
                           (LookupDrafter(), 3)):
            out = Engine(TableBackend(V, seed=0), drafter, draft_max=k).generate(
                PROMPT * 4, max_tokens=40, params=params, constraint=Automaton())
            assert out.tokens == plain and out.stats.drafted > 0


def test_lazy_verification_is_the_eager_one():
    """Rows computed on demand, only up to the first rejection, give the eager verifiers' results draw for
    draw (the same random numbers in the same order)."""
    rng = np.random.default_rng(0)
    for trial in range(300):
        k, v = int(rng.integers(0, 6)), 6
        p = rng.dirichlet(np.ones(v) * 0.5, size=k + 1)
        q = rng.dirichlet(np.ones(v) * 0.5, size=k) if trial % 2 else None
        drafts = [int(rng.choice(v, p=q[i])) if q is not None else int(rng.integers(v)) for i in range(k)]
        read = []

        def row(i):
            read.append(i)
            return p[i]

        eager = verify_sampled(np.asarray(drafts, dtype=np.int64), q, p, np.random.default_rng(trial))
        lazy = verify_sampled_lazy(drafts, q, row, np.random.default_rng(trial))
        assert lazy == eager and max(read, default=0) <= eager[0]
        argmax = p.argmax(axis=-1)
        assert verify_greedy_lazy(drafts, lambda i: int(argmax[i])) == verify_greedy(np.asarray(drafts), argmax)


def test_masked_rows_advance_a_fork_only_by_accepted_drafts():
    rows = np.random.default_rng(0).standard_normal((4, V)).astype(np.float32)
    live = Automaton(last=1)  # after 1: 2 and 5 are forbidden (1 + 2 = 3, 1 + 5 = 6)
    masked = MaskedRows(rows, live, SamplingParams(1.0), [4, 1, 7])
    assert (masked.probs(0)[[2, 5]] == 0).all() and masked.probs(0)[4] > 0
    assert (masked.probs(1)[[2, 5]] == 0).all()  # after 4: 2 (4 + 2 = 6) and 5 (9) are forbidden
    assert masked.done == 2 and live.last == 1  # the live state is the engine's: not advanced by drafts
    assert (masked.probs(3)[[2, 5]] == 0).all() and masked.state.last == 7  # reading row 3 accepted 1 and 7
    assert masked.seconds > 0


def test_free_drafts_stop_before_a_forbidden_token_and_slots_keep_their_own_grammar():
    lookup = LookupDrafter(ngram_max=2, ngram_min=1)
    context = [1, 2, 4, 2, 5, 1, 2]  # lookup continues with 4, 2, 5, 1, 2 (after the earlier "1 2")
    assert lookup.propose(context, 5).tokens == [4, 2, 5, 1, 2]
    lookup.constrain(Automaton(last=2))  # after 2, 4 is forbidden (2 + 4 = 6)
    assert lookup.propose(context, 5).tokens == []
    lookup.constrain(Automaton(last=1))  # 1 + 4 = 5 fine, 4 + 2 = 6 forbidden
    assert lookup.propose(context, 5).tokens == [4]
    other = lookup.for_slot(1)
    other.constrain(None)
    assert other is not lookup and lookup.constraint is not None
    assert other.propose(context, 5).tokens == [4, 2, 5, 1, 2]


def test_grammars_need_the_llama_cpp_backend():
    with pytest.raises(SettingsError, match="llama.cpp backend"):
        TableBackend(V).grammar('root ::= "a"')


# -- the real models (llama.cpp grammars) ---------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"planets": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "moons": {"type": "integer"}},
    "required": ["name", "moons"]}}}, "required": ["planets"]}


@pytest.mark.models
def test_json_mode_and_schema_on_the_real_pair(qwen_target, qwen_draft):
    plain = Engine(qwen_target)
    spec = Engine(qwen_target, ModelDrafter(qwen_draft, qwen_target.n_vocab), draft_max=4)
    prompt = plain.chat_prompt([{"role": "user", "content": "Give Earth and Mars with their number of moons as JSON."}])
    for gbnf in (json_grammar(), json_grammar(SCHEMA)):
        a = plain.generate(prompt, max_tokens=120, is_chat=True, constraint=qwen_target.grammar(gbnf))
        b = spec.generate(prompt, max_tokens=120, is_chat=True, constraint=qwen_target.grammar(gbnf))
        assert b.tokens == a.tokens and b.stats.accepted > 10
        assert a.finish_reason == "stop", a.text  # the grammar completed, then the end of generation
        value = json.loads(a.text)
        assert isinstance(value, dict)
    assert isinstance(value["planets"], list) and all(set(p) >= {"name", "moons"} for p in value["planets"])
    assert all(isinstance(p["moons"], int) for p in value["planets"])
    # sampled (top-k: only the head is checked): valid JSON still
    r = spec.generate(prompt, max_tokens=120, is_chat=True, params=SamplingParams(0.8, top_k=40, seed=1),
                      constraint=qwen_target.grammar(json_grammar(SCHEMA)))
    assert r.finish_reason == "stop" and "planets" in json.loads(r.text)


@pytest.mark.models
def test_bad_grammars_are_clear_errors(small_target):
    with pytest.raises(SettingsError, match="invalid grammar"):
        small_target.grammar('root ::= "yes')
    with pytest.raises(SettingsError, match="empty"):
        small_target.grammar("  ")
    with pytest.raises(SettingsError, match="not valid JSON"):
        json_grammar("{bad")
    g = small_target.grammar('root ::= "yes" | "no"')
    r = Engine(small_target).generate(small_target.tokenize("Is the sky blue?"), max_tokens=10, constraint=g)
    assert r.text in ("yes", "no") and r.finish_reason == "stop"


@pytest.mark.models
def test_a_bad_grammar_names_its_fault_on_any_thread_and_its_dump_stays_off_stderr(small_target, capfd):
    """The parse error of a grammar file (several lines, a trailing newline: llama.cpp's message runs over lines)
    on the main thread and on a server's; without a temporary directory a valid grammar still works, no fd lost."""
    import os
    import tempfile
    import threading

    def on_thread(grammar):
        said = []

        def build():
            try:
                small_target.grammar(grammar)
                said.append("ok")
            except SettingsError as e:
                said.append(str(e))

        t = threading.Thread(target=build)
        t.start()
        t.join()
        return said[0]

    for grammar, fault in (('root = "a"\n', "expecting ::= at = \"a\""),
                           ('root ::= "a" x\nx ::= "b" )\n', "expecting newline or end at )"),
                           ("root ::= foo", "Undefined rule identifier 'foo'")):
        with pytest.raises(SettingsError) as e:
            small_target.grammar(grammar)
        assert str(e.value) == f"invalid grammar (GBNF): {fault}"
        assert on_thread(grammar) == f"invalid grammar (GBNF): {fault}"
    assert "error parsing grammar" not in capfd.readouterr().err
    fds = len(os.listdir("/proc/self/fd"))
    saved, tempfile.tempdir = tempfile.tempdir, "/nonexistent-directory"
    try:
        assert on_thread('root ::= "yes"') == "ok"
    finally:
        tempfile.tempdir = saved
    assert len(os.listdir("/proc/self/fd")) == fds


def test_the_grammar_dump_is_cut_and_other_lines_kept():
    from speculant.constraint import _cut_grammar_dump

    grammar = 'root ::= "a" x\nx ::= "b" )\n'
    text = ("another thread's line\n" + "parse: error parsing grammar: expecting newline or end at )\n\n\n"
            + grammar + "\n" + "a later line\n")
    assert _cut_grammar_dump(text, grammar) == ("expecting newline or end at )", "another thread's line\na later line\n")
    assert _cut_grammar_dump("just a log line\n", grammar) == (None, "just a log line\n")


def test_schema_answers_parse_and_hold_to_the_schema(small_target):
    """Schemas that the converter got wrong: strings took raw newlines (JSON forbids control characters, so the
    answer did not parse), a $defs entry named like a built-in rule ("char", "number") was replaced by it, and
    integer bounds were dropped. Keywords the grammar cannot enforce are refused, not dropped."""
    import json

    from speculant.verify import SamplingParams

    newline = small_target.tokenize("\n", add_special=False)[0]
    eng = Engine(small_target)

    def answer(schema, prompt, **bias):
        params = SamplingParams(0.0, logit_bias=tuple(bias.get("bias", ())))
        r = eng.generate(small_target.tokenize(prompt), max_tokens=48, params=params,
                         constraint=small_target.grammar(json_grammar(schema)))
        assert r.finish_reason == "stop", r.text
        return json.loads(r.text)

    poem = answer({"type": "object", "properties": {"poem": {"type": "string"}}, "required": ["poem"]},
                  "A two-line poem as JSON:", bias=[(newline, 8.0)])
    assert isinstance(poem["poem"], str)
    got = answer({"type": "object", "properties": {"s": {"type": "string", "maxLength": 8},
                                                  "c": {"$ref": "#/$defs/char"}, "n": {"$ref": "#/$defs/number"}},
                  "required": ["s", "c", "n"], "$defs": {"char": {"enum": ["x", "y"]}, "number": {"enum": [1, 2]}}},
                 "JSON with s, c and n:")
    assert got["c"] in ("x", "y") and got["n"] in (1, 2)
    for kind, bounds, ok in [("integer", {"minimum": 18}, lambda v: v >= 18),
                             ("integer", {"minimum": 0, "maximum": 3}, lambda v: 0 <= v <= 3),
                             ("integer", {"exclusiveMinimum": 2, "exclusiveMaximum": 6}, lambda v: 2 < v < 6),
                             ("integer", {"minimum": -40, "maximum": -7}, lambda v: -40 <= v <= -7),
                             ("integer", {"minimum": 1000, "maximum": 250000}, lambda v: 1000 <= v <= 250000),
                             ("number", {"minimum": 0, "maximum": 1}, lambda v: 0 <= v <= 1),
                             ("number", {"exclusiveMinimum": -2.5, "maximum": -0.25}, lambda v: -2.5 < v <= -0.25)]:
        n = answer({"type": "object", "properties": {"n": {"type": kind, **bounds}}, "required": ["n"]},
                   "JSON with n = 99:")["n"]
        assert isinstance(n, int if kind == "integer" else (int, float)) and ok(n), (bounds, n)
    # a list of types: the converter kept the type names only, and dropped maxLength, items, bounds
    quote = small_target.tokenize("abcdefgh", add_special=False)[0]
    short = answer({"type": "object", "properties": {"s": {"type": ["string", "null"], "maxLength": 3},
                                                    "a": {"type": ["array", "null"], "items": {"type": "integer",
                                                                                               "maximum": 5}}},
                    "required": ["s", "a"]}, "JSON with a long string s and a list a of big numbers:",
                   bias=[(quote, 6.0)])
    assert short["s"] is None or len(short["s"]) <= 3, short
    # allOf, and keywords beside a $ref or anyOf: the converter read one part (pydantic v1's allOf-wrapped enum
    # became "{}"; a required name in allOf, or beside anyOf, was dropped)
    merged = answer({"type": "object", "properties": {"color": {"allOf": [{"$ref": "#/$defs/Color"}], "title": "C"},
                                                      "n": {"type": "integer"}, "s": {"type": "string"}},
                     "allOf": [{"required": ["color"]}, {"properties": {"n": {"minimum": -9, "maximum": -3}}}],
                     "anyOf": [{"required": ["n"]}, {"required": ["s"]}], "$defs": {"Color": {"enum": ["red", "blue"]}}},
                    "JSON with an empty object {}:")
    assert merged["color"] in ("red", "blue") and ("n" in merged or "s" in merged), merged
    assert "n" not in merged or -9 <= merged["n"] <= -3, merged
    phone = answer({"type": "object", "properties": {"phone": {"type": "string", "pattern": r"^\d{3}-\d{4}$"}},
                    "required": ["phone"]}, "JSON with a phone number:")["phone"]
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone), phone
    assert short["a"] is None or all(isinstance(v, int) and v <= 5 for v in short["a"]), short
    anything = answer({"type": "object", "properties": {"list": {"type": "array", "items": {}, "minItems": 2,
                                                                "maxItems": 3}}, "required": ["list"]},
                      "JSON with a list of two things:")  # items {}: any values (the converter failed on it)
    assert 2 <= len(anything["list"]) <= 3
    node = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                             "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}},
            "required": ["v", "next"]}
    null = small_target.tokenize("null", add_special=False)[0]
    linked = answer({"$ref": "#/$defs/node", "$defs": {"node": node}}, "A linked list of two digits as JSON:",
                    bias=[(null, 10.0)])
    assert 0 <= linked["v"] <= 9  # a recursive schema from a root $ref (refused before)
    for schema, fragment in [
        ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "'uniqueItems' cannot be enforced"),
        ({"minimum": 1.5}, 'need "type": "integer" or "number"'),
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "no value is both 'string' and 'integer'"),
        ({"allOf": [{"const": 1}, {"const": 2}]}, "'const' is set differently"),
        ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "write the length into the pattern"),
        ({"type": "array", "prefixItems": [{"type": "string"}], "items": {"type": "integer"}}, "'items' beside"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "no integer satisfies minimum 5 and maximum 1"),
        ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2}, "no integer satisfies"),
        ({"type": "number", "minimum": 1.5, "exclusiveMaximum": 1.5}, "no number satisfies"),
        ({"type": "number", "maximum": float("inf")}, "must be a number"),
        ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"], "additionalProperties": False},
         "'b' is not among"),
        ({"type": "object", "properties": {"": {"type": "integer"}}}, "empty property name"),
        ({"type": "string", "maxLength": 20000}, "counts above 2000"),
        ({"type": "string", "minLength": 2500}, "counts above 2000"),  # llama.cpp's limit: it did not parse
        ({"type": "string", "pattern": "^a{0,2500}$"}, "a count above 2000"),  # and this one took 2600
        ({"type": "integer", "enum": [5, 6], "maximum": 3}, "no 'enum' value satisfies"),
        ({"enum": []}, "'enum' is an empty list"),
        ({"const": float("nan")}, "NaN or Infinity"),
        ({"type": "object", "properties": {"a": False}}, "allows no value"),
        ({"properties": {"default": {"type": "array", "uniqueItems": True}}}, "properties.default: 'uniqueItems'"),
        ({"type": "array", "prefixItems": [{"type": "integer"}] * 2, "items": False, "maxItems": 1}, "beside 'prefixItems'"),
        ({"allOf": [{"type": "object", "properties": {"a": {}}, "additionalProperties": False},
                    {"properties": {"b": {}}}]}, "'additional' to a part"),
        ({"type": "array", "minItems": 3, "maxItems": 1}, "nothing can match"),
        ({"type": "array", "minItems": -1}, "'minItems' must be an integer >= 0"),
    ]:
        with pytest.raises(SettingsError, match=fragment):
            json_grammar(schema)


# -- numbers between bounds (speculant.numrange), checked by llama.cpp's own grammar engine -----------------------

JSON_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
BOUND = st.one_of(st.none(), st.integers(-1200, 1200).map(Decimal),
                  st.decimals(-120, 120, places=3, allow_nan=False, allow_infinity=False))


def _grammar_takes(model, gbnf: str, text: str) -> bool:
    """llama.cpp's grammar engine over SmolLM2's tokens, a character at a time: text is a whole sentence of the
    grammar."""
    g = model.grammar(gbnf)
    for ch in text:
        for token in model.tokenize(ch, add_special=False):
            if not g.allowed(np.array([token]))[0]:
                return False
            g.accept(token)
    return bool(g.allowed(np.array([min(g.eog)]))[0])


def _spellings(value: Decimal) -> list[str]:
    """A value written the way the bounded grammar writes it, and ways it does not (exponent, -0, leading zero)."""
    text = format(value.normalize(), "f") if value != 0 else "0"
    out = [text, text + ("0" if "." in text else ".0"), text + "e0", "0" + text.lstrip("-")]
    return out + (["-0", "-0.0"] if value == 0 else [])


@given(kind=st.sampled_from(["integer", "number"]), lo=BOUND, hi=BOUND, lo_strict=st.booleans(),
       hi_strict=st.booleans(), extra=st.lists(st.decimals(-2000, 2000, places=3, allow_nan=False,
                                                            allow_infinity=False), max_size=4))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_bounded_numbers_are_exactly_the_values_between_the_bounds(small_target, kind, lo, hi, lo_strict, hi_strict,
                                                                    extra):
    """Every JSON number the grammar takes lies between the bounds and is JSON; every value between them, written
    plainly (no exponent; an integer without a point), is taken."""
    schema = {"type": kind}
    if lo is not None:
        schema["exclusiveMinimum" if lo_strict else "minimum"] = float(lo) if lo % 1 else int(lo)
    if hi is not None:
        schema["exclusiveMaximum" if hi_strict else "maximum"] = float(hi) if hi % 1 else int(hi)

    def inside(v: Decimal) -> bool:
        return ((lo is None or (v > lo if lo_strict else v >= lo)) and (hi is None or (v < hi if hi_strict else v <= hi))
                and (kind == "number" or v % 1 == 0))

    try:
        gbnf = json_grammar(schema)
    except SettingsError as e:  # nothing between: then no candidate value may lie between either
        assert "satisfies" in str(e)
        candidates = [Decimal(i) / 8 for i in range(-10000, 10000)] if lo is not None and hi is not None else []
        assert not any(inside(v) for v in candidates), schema
        return
    near = [b + d for b in (lo, hi) if b is not None for d in map(Decimal, ("-1", "-0.001", "0", "0.001", "0.5", "1"))]
    values = {v for v in near + extra + [Decimal(0), Decimal("0.5"), Decimal(-1)]}
    for v in values:
        for i, text in enumerate(_spellings(v)):
            takes = _grammar_takes(small_target, gbnf, text)
            if takes:
                assert JSON_NUMBER.fullmatch(text) and inside(Decimal(text)), (schema, text)
            plain = i == 0 and (kind == "number" or v % 1 == 0)
            if plain and inside(v):
                assert takes, (schema, text, gbnf)


PATTERNS = [r"^\d{3}-\d{4}$", r"^[\w.]+@[\w.]+$", r"\d+", r"^a.b$", r"^[^x]*$", r"^(ab|c)*$", r'^"\\?$', r"^[\s]+$",
            r"^[a-c]{2,3}$", r"^\D\W?$", r"^x|y$", r"b", r"^$", r"^[-+]?\d+(\.\d+)?$", r"^(?:no|yes)$", r"^\S+ \S+$",
            r"^[^\d\s]+$", r"^[é-ü]+$"]


@given(which=st.integers(0, len(PATTERNS) - 1),
       text=st.text(alphabet='ab1c2-.x y"\\\t\n@Zé_+', max_size=7))
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_patterns_take_exactly_the_strings_that_match(small_target, which, text):
    """A JSON string the pattern's grammar takes is valid JSON whose value matches the pattern (as ECMA-262 reads
    it: ASCII classes, a search unless anchored); every matching value without control characters is taken."""
    pattern = PATTERNS[which]
    gbnf = json_grammar({"type": "string", "pattern": pattern})
    reference = re.compile(pattern[:-1] + r"\Z" if pattern.endswith("$") else pattern, re.ASCII)
    spelled = json.dumps(text, ensure_ascii=False)
    takes = _grammar_takes(small_target, gbnf, spelled)
    if takes:
        assert reference.search(json.loads(spelled)), (pattern, spelled)
    if reference.search(text) and not any(ord(c) < 0x20 for c in text):
        assert takes, (pattern, spelled, gbnf)
    raw = '"' + text + '"'  # the characters unescaped: taken only where that is JSON whose value matches
    if _grammar_takes(small_target, gbnf, raw):
        try:
            value = json.loads(raw)
        except ValueError:
            raise AssertionError(f"{pattern}: the grammar takes {raw!r}, which is not JSON") from None
        assert reference.search(value), (pattern, raw)


def test_patterns_a_grammar_cannot_hold_are_refused():
    for pattern, fragment in [(r"^(a)\1$", "back-reference or look-around"), (r"^a(?=b)", "look-around"),
                              (r"(?i)^a$", "inline flags"), (r"^a\bb$", "anchor"), (r"^[a$", "not a regular expression")]:
        with pytest.raises(SettingsError, match=re.escape(fragment)):
            json_grammar({"type": "string", "pattern": pattern})
    # tool parameters (not strict) keep such a pattern as a hint: a plain string
    assert "string" in json_grammar({"type": "string", "pattern": r"^(a)\1$"}, strict=False)


def test_constants_with_escapes_and_array_counts_without_items(small_target):
    """A const/enum string holding a backslash, quote, newline or tab: the converter's grammar took a raw newline
    or an invalid escape, or did not parse; minItems/maxItems without items were dropped."""
    values = ["C:\\dir\\f", 'say "hi"', "a\nb", "x\ty", "ü"]
    gbnf = json_grammar({"enum": values})
    for v in values:
        assert _grammar_takes(small_target, gbnf, json.dumps(v, ensure_ascii=False)), v
    assert not _grammar_takes(small_target, gbnf, '"a\nb"'.replace("\\n", "\n"))  # a raw newline: not JSON
    assert _grammar_takes(small_target, json_grammar({"const": "q\"q"}), '"q\\"q"')
    counted = json_grammar({"type": "array", "minItems": 1, "maxItems": 2})
    assert [_grammar_takes(small_target, counted, t) for t in ("[]", "[1]", '[1, "a"]', "[1, 2, 3]")] == \
        [False, True, True, False]


@pytest.mark.parametrize("fmt, good, bad", [
    ("email", ["a.b+c@example.com", "x@y.io"], ["not an email", "a@b", "@example.com"]),
    ("ipv4", ["192.168.0.1", "0.0.0.0", "255.255.255.255"], ["256.1.1.1", "1.2.3", "01.2.3.4"]),
    ("hostname", ["example.com", "a-b.c"], ["-a.com", "a..b", "a b"]),
    ("uri", ["https://example.com/x?y=1", "mailto:a@b"], ["example.com", "http:// x"]),
])
def test_string_formats_are_held(small_target, fmt, good, bad):
    """Formats the converter had no rule for became any string (an answer {"e": "Produce"} for an email)."""
    gbnf = json_grammar({"type": "string", "format": fmt})
    for text in good:
        assert _grammar_takes(small_target, gbnf, json.dumps(text)), text
    for text in bad:
        assert not _grammar_takes(small_target, gbnf, json.dumps(text)), text


@pytest.mark.parametrize("schema, takes, refuses", [
    # additionalProperties true (pydantic extra="allow"): the converter took '{"a": 1"b": {}}', refused '{"a": 1}'
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
     ['{"a": 1}', "{}"], ['{"a": 1"b": {}}', '{"a": {}}']),
    # enum beside bounds or a type: only the values that satisfy both
    ({"type": "integer", "enum": [1, 2, 4, 8], "minimum": 1, "maximum": 3}, ["1", "2"], ["3", "4"]),
    ({"type": "string", "enum": ["a", 1, "bb"], "minLength": 2}, ['"bb"'], ['"a"', "1"]),
    # required without properties: written, any value; {} and annotation-only schemas: any value (were objects)
    ({"type": "object", "required": ["a"]}, ['{"a": 1}', '{"a": "x"}'], ["{}"]),
    ({"type": "object", "properties": {"x": {"title": "X"}}, "required": ["x"]}, ['{"x": 1}', '{"x": [true]}'], ["{}"]),
    # counts as GBNF counts (the nested form crashed llama.cpp's parser past ~15,000)
    ({"type": "string", "maxLength": 1900}, ['"abc"'], []),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, ["[1, 2]", "[1, 2, 3]"],
     ["[1]", "[1, 2, 3, 4]", "[]"]),
    ({"type": "string", "minLength": 2, "maxLength": 3}, ['"ab"', '"abc"'], ['"a"', '"abcd"']),
    # a format beside lengths is an annotation (pydantic's HttpUrl): the lengths hold
    ({"type": "string", "format": "uri", "maxLength": 4}, ['"abcd"'], ['"abcde"']),
    # ECMA's \s holds Unicode's white space: \S and [^\s] took a no-break space
    ({"type": "string", "pattern": "^\\S+$"}, ['"ab"'], ['"\u00a0"', '"a\u2003"']),
    ({"type": "string", "pattern": "^[^\\s]+$"}, ['"ab"'], ['"\u00a0"']),
    ({"type": "array", "items": False}, ["[]"], ["[1]"]),  # it failed with "'prefixItems'"
    # an allOf part's own keywords beside its $ref, and a $ref to a $ref (required was dropped)
    ({"$defs": {"A": {"type": "object", "properties": {"x": {"type": "integer"}}}},
      "allOf": [{"$ref": "#/$defs/A", "required": ["x"]}]}, ['{"x": 1}'], ["{}"]),
    ({"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"type": "object", "properties": {"z": {"type": "integer"}}}},
      "allOf": [{"$ref": "#/$defs/A"}, {"required": ["z"]}]}, ['{"z": 1}'], ["{}"]),
    # parts that describe one property differently merge (a description said "set differently")
    ({"allOf": [{"properties": {"a": {"type": "string", "description": "x"}}, "required": ["a"]},
                {"properties": {"a": {"type": "string", "description": "y", "maxLength": 2}}}]}, ['{"a": "ab"}'],
     ['{"a": "abc"}']),
    ({"type": "string", "pattern": "^a$|^b$"}, ['"a"', '"b"'], ['"ab"']),  # the parser hoists the shared ^
    # a list of property maps: a property named like a keyword is a property
    ({"type": "object", "properties": {"enum": {"type": "integer"}}, "required": ["enum"]}, ['{"enum": 3}'], ['{"enum": "x"}']),
])
def test_keywords_beside_each_other_hold(small_target, schema, takes, refuses):
    """From a fresh-eyes sweep of the schema grammars against jsonschema (each case was wrong before)."""
    gbnf = json_grammar(schema)
    for text in takes:
        assert _grammar_takes(small_target, gbnf, text), (schema, text)
    for text in refuses:
        assert not _grammar_takes(small_target, gbnf, text), (schema, text)


def test_tools_beside_a_format_whose_rules_have_numeric_names(small_target):
    """either_grammar prefixed the numbers inside counts ({1} became {a-1}) when a rule was named '1' (a property
    named "1"): tools beside such a response_format were a 400."""
    from speculant.constraint import either_grammar
    from speculant.tools import parse_tools

    schema = {"type": "object", "properties": {"1": {"type": "integer", "minimum": 0, "maximum": 500},
                                               "3": {"type": "string", "minLength": 3, "maxLength": 5}},
              "required": ["1", "3"]}
    calls = parse_tools({"tools": [{"type": "function", "function": {"name": "f"}}]}).calls_grammar()
    gbnf = either_grammar(json_grammar(schema), calls)
    assert _grammar_takes(small_target, gbnf, '{"1": 250, "3": "abcd"}')
    assert not _grammar_takes(small_target, gbnf, '{"1": 501, "3": "abcd"}')
    assert _grammar_takes(small_target, gbnf, '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("schema, message", [
    ("123", "got int 123"), ("[]", "got list []"), ('"x"', 'got str "x"'), ("false", "got false, which no value matches"),
])
def test_a_schema_that_is_not_an_object_is_refused_by_name(schema, message):
    """A JSON schema is an object (or true); others were "'int' object has no attribute 'get'"."""
    with pytest.raises(SettingsError, match=re.escape(f"a JSON schema is an object (or true), {message}")):
        json_grammar(schema)
    assert json_grammar("true") == json_grammar("{}")
