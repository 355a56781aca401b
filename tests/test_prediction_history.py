"""Predicted outputs and history drafting: alignment and re-anchoring on hand-made sequences, the bounded
suffix trie, greedy identity and the target's distribution on synthetic models."""

import numpy as np
import pytest

import speculant.engine as engine_mod
from speculant.drafters import CompositeDrafter, LookupDrafter, ModelDrafter
from speculant.drafters.history import HistoryDrafter, SuffixTrie
from speculant.drafters.prediction import PredictionDrafter
from speculant.engine import Engine
from speculant.policy import AdaptivePolicy, DraftBudget, FixedPolicy, history_key, prior_acceptance, run_key
from speculant.verify import SamplingParams

from synthetic import TableBackend, exact_joint, pvalue, sequence_counts, sqrt_p_verifier
from test_engine_synthetic import V

P = list(range(100, 160))  # a prediction of 60 distinct tokens


def aligned(prediction, output, k=4, start=0, **kw):
    """The drafter's proposal after seeing `output` token by token."""
    d = PredictionDrafter(prediction, start, **kw)
    ctx = list(range(start))
    for t in output:
        ctx.append(t)
        d.update(ctx)
    return d.proposal(k)[0]


# -- alignment --------------------------------------------------------------------------------------------------
def test_tracks_a_correct_prediction_and_proposes_its_continuation():
    assert aligned(P, []) == P[:4]
    assert aligned(P, P[:10], k=5) == P[10:15]
    assert aligned(P, P, k=5) == []  # the prediction is used up


def test_the_prompt_is_not_part_of_the_output():
    d = PredictionDrafter(P, start=3)
    d.update([100, 101, 102])  # the prompt happens to hold the prediction's first tokens
    assert d.proposal(2)[0] == P[:2]


def test_insertion_in_the_middle_reanchors_after_it():
    out = P[:20] + [1, 2, 3] + P[20:22]  # three inserted tokens, then the prediction again
    assert aligned(P, out[:22]) == []  # inside the insertion: nothing to propose
    assert aligned(P, out) == P[22:26]


def test_deletion_in_the_middle_reanchors_after_it():
    out = P[:20] + P[25:27]  # five tokens of the prediction left out
    assert aligned(P, out) == P[27:31]


def test_change_at_the_start():
    assert aligned(P, [1, 2] + P[2:4]) == P[4:8]  # a substitution of the first two tokens
    assert aligned(P, [1, 2, 3, 4, 5] + P[:2]) == P[2:6]  # a preamble before the predicted text


def test_unrelated_prediction_proposes_nothing():
    rng = np.random.default_rng(0)
    out = rng.integers(0, 90, size=200).tolist()
    d = PredictionDrafter(P, 0)
    proposals = 0
    for i in range(1, len(out) + 1):
        d.update(out[:i])
        proposals += bool(d.proposal(4)[0])
    assert proposals == 0


def test_reanchoring_takes_the_match_nearest_to_the_expected_position():
    pred = [1, 2, 3, 4, 50, 51, 52, 1, 2, 3, 4, 60, 61]
    # follows the prediction to index 7, then one token differs: [2, 3] occurs twice, the second is expected
    assert aligned(pred, [1, 2, 3, 4, 50, 51, 52, 9, 2, 3]) == [4, 60, 61]
    # the same n-gram early in the output: the first occurrence is the expected one
    assert aligned(pred, [9, 2, 3]) == [4, 50, 51, 52]


def test_reanchoring_prefers_the_longest_match():
    pred = [5, 6, 7, 8, 1, 2, 20, 0, 0, 0, 3, 1, 2, 30]
    # the output's tail [3, 1, 2] matches at 10..12 (3 tokens) though [1, 2] is nearer at 4..5
    assert aligned(pred, [5, 6, 7, 9, 3, 1, 2]) == [30]


def test_confidence_grows_with_the_agreement():
    d = PredictionDrafter(P, 0)
    d.update(P[:6])
    tokens, keys = d.proposal(4)
    assert keys == [run_key(6), run_key(7), run_key(8), run_key(9)] == ["p4", "p4", "p8", "p8"]
    d.update(P[:6] + [1, 2] + P[8:10])  # a 2-token change, re-anchored on a bigram
    assert d.proposal(1) == ([P[10]], ["p2"])
    assert prior_acceptance("p0") < prior_acceptance("p4") < prior_acceptance("p64")


def test_long_drafts_go_past_draft_max_and_stop_where_acceptance_stops_paying():
    from speculant.policy import _Ema

    policy = AdaptivePolicy(k_max=4)
    for n in range(1, 20):  # a verify pass costs 0.05 of a step more per token: long drafts pay
        policy.target_cost[n] = _Ema(1.0 + 0.05 * (n - 1), weight=5)
    for key in ("p16", "p32", "p64"):
        policy.key_alpha[("prediction", key)] = _Ema(0.99, weight=50)
    d = PredictionDrafter(P, 0)
    draft = d.propose(P[:20], 4, budget=policy.budget(100, long_max=16))
    assert draft.tokens == P[20:36]  # 16 > k_max = 4
    policy.key_alpha[("prediction", "p32")] = _Ema(0.01, weight=50)  # the 32nd+ agreeing token: rarely right
    d = PredictionDrafter(P, 0)
    draft = d.propose(P[:20], 4, budget=policy.budget(100, long_max=16))
    assert draft.tokens == P[20:32] and draft.shadows[0].token == P[32]


# -- the suffix trie ------------------------------------------------------------------------------------------
def _trie_with(*docs, depth=4):
    trie = SuffixTrie(depth)
    for doc in docs:
        active = []
        for t in doc:
            active = trie.extend(active, t)
    return trie


def test_trie_counts_substrings_up_to_its_depth():
    trie = _trie_with([1, 2, 3, 1, 2, 4], depth=3)
    assert trie.find([1, 2]).count == 2 and trie.find([1, 2, 3]).count == 1 and trie.find([2]).count == 2
    assert trie.find([1, 2, 3, 1]) is None  # deeper than 3
    assert trie.find([3, 2]) is None


def test_trie_removal_takes_back_exactly_what_was_added():
    a, b = [1, 2, 3, 1, 2, 4], [2, 3, 5, 5, 5]
    both = _trie_with(a, b)
    only_b = _trie_with(b)
    both.remove(a)
    assert both.nodes == only_b.nodes

    def dump(node, path=()):
        out = {path: node.count}
        for t, c in (node.kids or {}).items():
            out.update(dump(c, path + (t,)))
        return out
    assert dump(both.root) == dump(only_b.root)
    both.remove(b)
    assert both.nodes == 1 and not both.root.kids


def _request(h, prompt, output):
    """One request through the drafter's lifecycle hooks, as the engine drives them."""
    h.begin(prompt)
    h.end(prompt + output)


def test_history_proposes_an_earlier_output_continuation():
    h = HistoryDrafter(depth=8)
    _request(h, [7, 7, 7], [10, 11, 12, 13, 14, 15])
    h.begin([8, 9, 10, 11])  # a new request whose prompt ends like the earlier output began
    tokens, keys = h.continuation(8)
    assert tokens == [12, 13, 14, 15]
    assert keys[0] == history_key(2, 1)


def test_history_takes_the_most_frequent_continuation():
    h = HistoryDrafter(depth=8)
    for out in ([1, 2, 3, 9], [1, 2, 3, 9], [1, 2, 4, 9]):
        _request(h, [50], out)
    h.begin([60, 1, 2])
    tokens, keys = h.continuation(2)
    assert tokens == [3, 9] and keys[0] == history_key(2, 2)
    _request(h, [50], [1, 2, 4, 9])  # the end of the open request replaced... now 4 follows [1, 2] twice too
    _request(h, [50], [1, 2, 4, 9])
    h.begin([60, 1, 2])
    assert h.continuation(1)[0] == [4]


def test_history_needs_a_match_of_min_match_tokens():
    h = HistoryDrafter(depth=8, min_match=2)
    _request(h, [50], [1, 2, 3])
    h.begin([60, 9, 1])  # only [1] matches
    assert h.continuation(4)[0] == []


def test_history_indexes_the_current_prompt_and_output_but_keeps_only_outputs():
    h = HistoryDrafter(depth=8)
    prompt = [20, 21, 22, 23, 30, 20, 21]
    h.begin(prompt)
    assert h.continuation(3)[0] == [22, 23, 30]  # like prompt lookup
    h.end(prompt + [40, 41])
    assert h.trie.find([20, 21]) is None and h.trie.find([40, 41]).count == 1
    assert h.stats()["tokens"] == 2


def test_history_forgets_the_oldest_outputs_first_and_stays_bounded():
    h = HistoryDrafter(max_tokens=20, depth=6)
    rng = np.random.default_rng(1)
    outs = [rng.integers(0, 1000, size=8).tolist() for _ in range(30)]
    for out in outs:
        _request(h, [1, 2, 3], out)
        assert h.kept <= 20
    assert list(h.outputs) == outs[-2:]
    assert h.trie.find(outs[0][:2]) is None and h.trie.find(outs[-1][:2]) is not None
    assert h.trie.nodes == _trie_with(*outs[-2:], depth=6).nodes
    h0 = HistoryDrafter(max_tokens=0)
    _request(h0, [1, 2, 3], [4, 5, 6])
    assert h0.trie.nodes == 1


def test_history_rematches_past_its_depth():
    h = HistoryDrafter(depth=4)
    seq = list(range(200, 220))
    _request(h, [1], seq)
    h.begin([2, 200, 201])
    assert h.continuation(12)[0] == seq[2:14]


# -- greedy identity and composition in the engine ------------------------------------------------------------
PROMPT = [1, 2, 3]


def _priced(policy):
    """Fix the policy's pass costs (a verified token adds 0.3 of a step, as on this CPU), so that its choices
    depend on acceptance only, never on how long the synthetic passes happened to take."""
    from speculant.policy import _Ema

    class Fixed(_Ema):
        def update(self, x, rate):
            pass

    for n in range(1, 70):
        policy.target_cost[n] = Fixed(1.0 + 0.3 * (n - 1), weight=100)
    return policy


def _plain(n=60, prompt=PROMPT):
    return Engine(TableBackend(V, seed=0)).generate(prompt, max_tokens=n).tokens


@pytest.mark.parametrize("kind", ["correct", "insertion", "deletion", "wrong-start", "unrelated"])
def test_greedy_identity_with_a_prediction(kind):
    plain = _plain()
    prediction = {"correct": plain, "insertion": plain[:20] + [0, 0, 0] + plain[20:],
                  "deletion": plain[:20] + plain[26:], "wrong-start": [(t + 1) % V for t in plain[:4]] + plain[4:],
                  "unrelated": [int(x) for x in np.random.default_rng(3).integers(0, V, 60)]}[kind]
    eng = Engine(TableBackend(V, seed=0))
    eng.prediction_policy = _priced(AdaptivePolicy())
    for _ in range(3):  # the policy learns across requests
        r = eng.generate(PROMPT, max_tokens=60, prediction=prediction)
        assert r.tokens == plain
    assert set(r.stats.accepted_by_source) <= {"prediction"}
    if kind == "correct":
        assert r.stats.accepted_by_source["prediction"] >= 40 and r.stats.target_calls <= 15
        assert max(r.stats.draft_lengths) > 4  # long drafts
    assert [s for s in r.sources if s] == ["prediction"] * r.stats.accepted_by_source["prediction"]


def test_a_prediction_alone_drafts_draft_max_every_step_without_adapting():
    """--no-adapt with a prediction and no drafter of its own: every step drafts up to --draft-max tokens of it
    (the adaptive policy may judge drafting a loss on this machine and draft nothing)."""
    plain = _plain()
    eng = Engine(TableBackend(V, seed=0), draft_max=3, adaptive=False)
    r = eng.generate(PROMPT, max_tokens=60, prediction=plain)
    assert isinstance(eng.prediction_policy, FixedPolicy) and r.tokens == plain
    assert r.stats.accepted_by_source["prediction"] >= 40 and max(r.stats.draft_lengths) == 3
    assert isinstance(Engine(TableBackend(V, seed=0), adaptive=True)._with_prediction(plain, 0)[1], AdaptivePolicy)


def test_prediction_composes_with_history_lookup_and_a_draft_model():
    plain = _plain()
    drafter = CompositeDrafter(HistoryDrafter(), LookupDrafter(), ModelDrafter(TableBackend(V, seed=1), V))
    eng = Engine(TableBackend(V, seed=0), drafter, draft_max=4, adaptive=True)
    _priced(eng.policy)
    sources = set()
    for prediction in (None, plain[:30] + [0, 0] + plain[40:], plain, None):
        r = eng.generate(PROMPT, max_tokens=60, prediction=prediction)
        assert r.tokens == plain
        sources |= set(r.stats.accepted_by_source)
        assert sum(r.stats.accepted_by_source.values()) == r.stats.accepted
    assert {"prediction", "history"} <= sources
    assert drafter.drafters[0].stats()["outputs"] == 4  # history kept each request's output


def test_history_learns_across_requests_in_the_engine():
    plain = _plain(40)
    eng = Engine(TableBackend(V, seed=0), HistoryDrafter(), draft_max=4, adaptive=True)
    _priced(eng.policy)
    calls = [eng.generate(PROMPT, max_tokens=40).stats for _ in range(4)]
    assert all(s.generated_tokens == 40 for s in calls)
    assert calls[-1].accepted_by_source["history"] > 20 and calls[-1].target_calls < calls[0].target_calls
    assert eng.generate(PROMPT, max_tokens=40).tokens == plain


def test_fixed_policy_prediction_drafts_without_adapting():
    plain = _plain(30)
    eng = Engine(TableBackend(V, seed=0), LookupDrafter(), draft_max=3)
    r = eng.generate(PROMPT, max_tokens=30, prediction=plain)
    assert r.tokens == plain and max(r.stats.draft_lengths) == 3 and r.stats.target_calls == 8


def test_prediction_text_and_bad_ids():
    eng = Engine(TableBackend(V, seed=0))
    assert eng.prediction_tokens("4 5 6") == [4, 5, 6] and eng.prediction_tokens("") == []
    with pytest.raises(Exception, match="outside the vocabulary"):
        eng.generate(PROMPT, max_tokens=3, prediction=[99])


# -- the target's distribution with prediction drafts ---------------------------------------------------------
def exact_joint_from(prompt, params, n=3):
    return exact_joint(TableBackend(V, seed=0), prompt, params, n)


def sampled_with_prediction(params, n_runs, prediction, n=3):
    eng = Engine(TableBackend(V, seed=0))
    eng.prediction_policy = FixedPolicy(3)  # always verify the prediction's next 3 tokens
    return sequence_counts(eng, PROMPT, params, n_runs, n, prediction=prediction)


@pytest.mark.parametrize("params", [SamplingParams(1.0, seed=70_000, coupled=False),
                                    SamplingParams(0.8, top_k=5, seed=80_000, coupled=False),
                                    SamplingParams(0.8, top_k=5, seed=85_000)],
                         ids=["T1", "T0.8-topk5", "coupled-T0.8-topk5"])
def test_prediction_drafts_keep_the_target_distribution(params):
    greedy = _plain(3)
    counts, drafted = sampled_with_prediction(params, 20_000, greedy)
    assert drafted >= 20_000 * 2  # every first step verifies two (the room left for a 3-token answer)
    probs = exact_joint_from(PROMPT, params)
    assert pvalue(counts, probs) > 1e-4
    assert 0.5 * np.abs(counts / counts.sum() - probs).sum() < 0.03


def test_the_distribution_test_fails_a_wrong_verifier_of_predictions(monkeypatch):
    monkeypatch.setattr(engine_mod, "verify_sampled", sqrt_p_verifier)
    params = SamplingParams(1.0, seed=70_000, coupled=False)
    counts, _ = sampled_with_prediction(params, 20_000, _plain(3))
    assert pvalue(counts, exact_joint_from(PROMPT, params)) < 1e-6


def test_one_slow_timing_does_not_price_long_drafts_out_for_good():
    """On a loaded machine one verify pass can take twice its usual time; a free drafter has no probes, so if
    that one timing stood, no draft of that size would be verified (and re-timed) again."""
    from speculant.policy import _Ema

    policy = AdaptivePolicy()
    policy.target_cost[1] = _Ema(1.0, weight=20)
    policy.target_cost[2] = _Ema(2.2, weight=1)  # one pass over 2 tokens, slowed by another process
    assert policy.verify_price(1) < 0.75  # 1.2 as measured
    policy.key_alpha[("prediction", "p8")] = _Ema(0.9, weight=50)
    assert policy.budget(10, long_max=16).take("prediction", "p8")
    policy.target_cost[2] = _Ema(2.2, weight=50)  # measured slow again and again: it is slow
    assert policy.verify_price(1) > 1.1
