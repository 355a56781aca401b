"""Prompt lookup, composite drafting and the adaptive draft-length policy."""

import numpy as np
import pytest

from speculant.drafters import CompositeDrafter, LookupDrafter, ModelDrafter
from speculant.engine import Engine
from speculant.errors import SettingsError
from speculant.policy import AdaptivePolicy, best_draft_length, expected_tokens
from speculant.verify import SamplingParams

from synthetic import TableBackend
from test_engine_synthetic import PROMPT, V, exact_joint, pvalue


# -- lookup proposals on hand-made sequences --------------------------------------------------------------
def test_lookup_no_match():
    assert LookupDrafter().lookup([1, 2, 3, 4], 4) == []
    assert LookupDrafter().lookup([7], 4) == []


def test_lookup_copies_what_followed_the_match():
    assert LookupDrafter().lookup([1, 2, 3, 4, 9, 9, 1, 2], 3) == [3, 4, 9]


def test_lookup_prefers_the_longest_ngram():
    # suffix [5, 6, 7]: the 3-gram occurs at 4 (followed by 40); the 1-gram [7] last occurred at 9 (followed by 70)
    ctx = [1, 1, 1, 1, 5, 6, 7, 40, 2, 7, 70, 5, 6, 7]
    assert LookupDrafter(ngram_max=3).lookup(ctx, 1) == [40]
    assert LookupDrafter(ngram_max=1).lookup(ctx, 1) == [70]


def test_lookup_takes_the_most_recent_match():
    assert LookupDrafter(ngram_max=2).lookup([3, 4, 10, 3, 4, 20, 3, 4], 1) == [20]


def test_lookup_overlapping_match_and_end_of_context():
    assert LookupDrafter(ngram_max=3).lookup([5, 5, 5, 5], 8) == [5]  # overlapping run; stops at the end
    assert LookupDrafter(ngram_max=2).lookup([1, 2, 3, 1, 2], 8) == [3, 1, 2]  # continuation runs to the end
    assert LookupDrafter().lookup([1, 2, 1, 2], 0) == []


def test_lookup_settings_are_checked():
    with pytest.raises(SettingsError):
        LookupDrafter(ngram_max=1, ngram_min=2)
    with pytest.raises(SettingsError):
        LookupDrafter(ngram_min=0)


# -- lossless verification of deterministic drafts ----------------------------------------------------------
@pytest.mark.parametrize("params", [SamplingParams(1.0, seed=50_000), SamplingParams(0.7, top_p=0.9, seed=60_000)],
                         ids=["T1", "T0.7-topp"])
def test_lookup_drafts_keep_the_target_distribution(params):
    eng = Engine(TableBackend(V, seed=0), LookupDrafter(ngram_max=2), draft_max=3)
    counts = np.zeros(V ** 3, dtype=np.int64)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # repetitive, so lookup proposes most steps
    drafted = 0
    for i in range(20_000):
        p = SamplingParams(params.temperature, params.top_k, params.top_p, params.min_p, seed=params.seed + i)
        r = eng.generate(prompt, max_tokens=3, params=p)
        drafted += r.stats.drafted
        counts[np.ravel_multi_index(r.tokens, (V,) * 3)] += 1
    assert drafted > 10_000
    import test_engine_synthetic as tes
    old = tes.PROMPT
    tes.PROMPT = prompt
    try:
        probs = exact_joint(params)
    finally:
        tes.PROMPT = old
    assert pvalue(counts, probs) > 1e-4


def test_composite_uses_lookup_first_then_the_model():
    target, draft = TableBackend(V, seed=0), TableBackend(V, seed=1)
    comp = CompositeDrafter(LookupDrafter(ngram_max=2), ModelDrafter(draft, V))
    rng = np.random.default_rng(0)
    assert comp.propose([1, 2, 5, 1, 2], 2, SamplingParams(), rng).source == "lookup"
    assert comp.propose([1, 2, 3, 4], 2, SamplingParams(), rng).source == "draft"
    plain = Engine(target).generate(PROMPT, max_tokens=50).tokens
    out = Engine(target, comp, draft_max=4).generate(PROMPT, max_tokens=50)
    assert out.tokens == plain and set(out.stats.accepted_by_source) <= {"lookup", "draft"}


# -- the policy -----------------------------------------------------------------------------------------------
def test_expected_tokens_formula():
    assert expected_tokens(0.8, 4) == pytest.approx(3.3616)
    assert expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.0, 4) == 1


def test_policy_picks_the_k_the_formula_says():
    flat = lambda n: 1.0  # GPU-like: verifying n tokens costs one step
    # Leviathan et al.: alpha 0.8, c 0.1 -> optimum gamma 6 (speedup 2.47x)
    assert best_draft_length(0.8, 0.1, flat, 1, 16) == 6
    # alpha 0.6, c 0.05 -> gamma 4 (1.92x), as in the worked table of anchors.md
    assert best_draft_length(0.6, 0.05, flat, 1, 16) == 4
    for alpha, c in [(0.5, 0.2), (0.9, 0.02), (0.7, 0.3)]:
        brute = max(range(17), key=lambda k: expected_tokens(alpha, k) / (k * c + 1.0) if k else 1.0)
        assert best_draft_length(alpha, c, flat, 1, 16) == brute


def test_policy_falls_back_to_plain_when_speculation_loses():
    # this CPU with llama.cpp: T(n) grows ~0.45 of a step per extra token, a draft step costs ~0.45 of a step
    cpu = lambda n: 1.0 + 0.45 * (n - 1)
    assert best_draft_length(0.8, 0.45, cpu, 1, 8) == 0
    # zero-cost drafts (lookup) that are accepted well do pay even there
    assert best_draft_length(0.9, 0.0, cpu, 1, 8) > 0


def _drive(policy, steps, alpha, draft_cost, target_cost, seed=0):
    """Feed the policy synthetic steps: acceptance i.i.d. alpha, the given costs. Returns the chosen ks."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        k = policy.draft_length("draft")
        n_acc = 0
        while n_acc < k and rng.random() < alpha:
            n_acc += 1
        policy.observe("draft", k, n_acc, k * draft_cost, target_cost(k + 1), n_acc + 1)
    return policy.history


def test_adaptive_policy_learns_to_speculate_when_it_pays():
    ks = _drive(AdaptivePolicy(k_max=8), 300, alpha=0.8, draft_cost=0.05, target_cost=lambda n: 1.0)
    assert ks[0] == 0  # measures plain first
    rate = lambda k: expected_tokens(0.8, k) / (k * 0.05 + 1.0)  # tokens per unit time
    best = rate(best_draft_length(0.8, 0.05, lambda n: 1.0, 1, 8))
    assert np.mean([rate(k) / best for k in ks[-100:]]) > 0.95  # near-optimal throughput once it has learnt


def test_adaptive_policy_backs_off_when_it_loses_and_probes_again():
    ks = _drive(AdaptivePolicy(k_max=8), 400, alpha=0.5, draft_cost=0.6, target_cost=lambda n: 1.0 + 0.5 * (n - 1))
    late = ks[-200:]
    assert sum(k == 0 for k in late) > 0.9 * len(late)  # mostly plain
    assert any(k > 0 for k in late)  # but still probes


@pytest.mark.parametrize("k", [2, 6])
def test_greedy_identity_with_adaptation(k):
    plain = Engine(TableBackend(V, seed=0)).generate(PROMPT, max_tokens=80).tokens
    for drafter in (ModelDrafter(TableBackend(V, seed=1), V), LookupDrafter()):
        out = Engine(TableBackend(V, seed=0), drafter, draft_max=k, adaptive=True).generate(PROMPT, max_tokens=80)
        assert out.tokens == plain


def test_bad_policy_settings():
    with pytest.raises(SettingsError):
        AdaptivePolicy(k_max=2, k_min=3)


def test_model_drafter_reports_catch_up_separately():
    """A drafter that must prefill (new prompt, or after plain steps) says so, so the policy does not take a
    prefill for the cost of drafting."""
    drafter = ModelDrafter(TableBackend(V, seed=1), V)
    rng = np.random.default_rng(0)
    first = drafter.propose([1, 2, 3, 4, 5, 6], 2, SamplingParams(), rng)
    assert first.catchup_time > 0
    nxt = drafter.propose([1, 2, 3, 4, 5, 6] + first.tokens[:1] + [7], 2, SamplingParams(), rng)
    assert nxt.catchup_time == 0.0
