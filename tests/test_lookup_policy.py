"""Prompt lookup, composite drafting and the adaptive draft-length policy."""

import dataclasses
import numpy as np
import pytest

from speculant.drafters import CompositeDrafter, LookupDrafter, ModelDrafter
from speculant.engine import Engine
from speculant.errors import SettingsError
from speculant.policy import AdaptivePolicy, _Ema, best_draft_length, expected_tokens
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


def test_a_long_verbatim_copy_drafts_long_with_run_keys():
    """Lookup's run is how far the context's end agrees with the text before the copy's source. From 8 tokens
    on (an output quoting its prompt: a code edit) it drafts up to the long bound with run keys ('p8', 'p16',
    ...), as a tracking prediction does; shorter matches keep k and their n-gram keys."""
    source = list(range(100, 140))  # 40 distinct tokens, quoted in the prompt
    quoting = source + [1, 2] + source[:12]  # the output has copied 12 of them so far
    d = LookupDrafter()
    assert d.run(quoting) == 12 and d.run([1, 2, 3, 1, 2]) == 2 and d.run([1, 2, 3]) == 0
    flat = _with_costs(AdaptivePolicy(k_max=4), lambda n: 1.0 + 0.01 * (n - 1))  # cheap long passes
    draft = d.propose(quoting, 4, budget=flat.budget(100, long_max=32))
    # past k = 4, toward the quoted text's end (28 tokens), until the chance that all are right stops paying
    assert 4 < len(draft.tokens) <= 28 and draft.tokens == source[12:12 + len(draft.tokens)]
    assert draft.keys[:5] == ["p8", "p8", "p8", "p8", "p16"]
    short = [7, 8, 9] + source[:10] + [1] + source[:5]  # agrees for 5 tokens: n-gram keys, k = 4
    assert d.run(short) == 5
    draft = d.propose(short, 4, budget=flat.budget(100, long_max=32))
    assert draft.tokens == source[5:9] and draft.keys == ["n4", "n4+", "n4+", "n4+"]


def test_lookup_settings_are_checked():
    with pytest.raises(SettingsError):
        LookupDrafter(ngram_max=1, ngram_min=2)
    with pytest.raises(SettingsError):
        LookupDrafter(ngram_min=0)


# -- lossless verification of deterministic drafts ----------------------------------------------------------
@pytest.mark.parametrize("params", [SamplingParams(1.0, seed=50_000, coupled=False),
                                    SamplingParams(0.7, top_p=0.9, seed=60_000, coupled=False)],
                         ids=["T1", "T0.7-topp"])
def test_lookup_drafts_keep_the_target_distribution(params):
    eng = Engine(TableBackend(V, seed=0), LookupDrafter(ngram_max=2), draft_max=3)
    counts = np.zeros(V ** 3, dtype=np.int64)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # repetitive, so lookup proposes most steps
    drafted = 0
    for i in range(20_000):
        p = dataclasses.replace(params, seed=params.seed + i)
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


# -- acceptance by the draft's confidence: the per-token budget ----------------------------------------------
from speculant.policy import DraftBudget, confidence_key, ngram_key, prior_acceptance, regime_of  # noqa: E402


def _cpu_policy(**kw):
    """A policy that has measured this CPU's costs: T(n) = 1 + 0.5 (n - 1) (a verify token costs half a step)."""
    return _with_costs(AdaptivePolicy(**kw), lambda n: 1.0 + 0.5 * (n - 1))


def _with_costs(policy, target_cost):
    for n in range(1, 10):
        policy.target_cost[n] = _Ema(target_cost(n), weight=100)
    return policy


def test_confidence_keys():
    assert [confidence_key(p) for p in (0.1, 0.5, 0.85, 0.93, 0.97, 0.999)] == \
        ["q<0.5", "q0.5", "q0.8", "q0.9", "q0.95", "q0.98"]
    assert ngram_key(3, True) == "n3" and ngram_key(3, False) == "n3+"


def test_budget_verifies_a_token_only_when_its_acceptance_pays_for_it():
    policy = _cpu_policy()
    assert policy.verify_price(1) == pytest.approx(0.5)
    for key, a in [("q0.95", 0.8), ("q<0.5", 0.3)]:
        policy.key_alpha[("draft", key)] = _Ema(a, weight=100)
    b = policy.budget(8)
    b.k_now = 8  # as if the draft model had been started
    # P(all accepted): 0.8, 0.64, 0.512 >= 0.5 are worth verifying; 0.41 is not
    assert [b.take("draft", "q0.95") for _ in range(4)] == [True, True, True, False]
    b = policy.budget(8)
    assert not b.take("draft", "q<0.5")  # 0.3 < 0.5
    # GPU-like flat verify cost: nearly everything is worth verifying
    b = _with_costs(AdaptivePolicy(), lambda n: 1.0 + 0.01 * (n - 1)).budget(8)
    assert all(b.take("draft", "q<0.5") for _ in range(3))


def test_budget_stops_paying_for_draft_steps_that_cannot_pay_back():
    policy = _cpu_policy()
    policy.draft_cost["draft"] = _Ema(0.4, weight=100)  # a draft step: 0.4 of a target step
    policy.alpha["draft"] = _Ema(0.9, weight=100)
    b = policy.budget(8)
    b.k_now = 8
    b.p_all = 0.95
    assert not b.more("draft")  # 0.95 * 0.9 = 0.855 < 0.4 + 0.5
    policy.draft_cost["draft"] = _Ema(0.05, weight=100)
    assert b.more("draft")  # 0.855 >= 0.05 + 0.5


def test_policy_learns_acceptance_per_confidence_bucket():
    policy = _cpu_policy()
    rng = np.random.default_rng(0)
    for _ in range(400):
        keys = [str(rng.choice(["q0.98", "q0.5"]))]
        accepted = rng.random() < (0.95 if keys[0] == "q0.98" else 0.2)
        policy.observe("draft", 1, int(accepted), 0.01, 1.5, 1 + accepted, keys=keys, paid="draft", draft_steps=1)
    assert policy.key_acceptance("draft", "q0.98") > 0.8
    assert policy.key_acceptance("draft", "q0.5") < 0.45
    assert policy.budget(4).take("draft", "q0.98")
    assert not policy.budget(4).take("draft", "q0.5")


def test_lookup_learns_from_proposals_it_did_not_verify():
    """Shadow observations: with a policy that refuses every lookup proposal, the engine still measures
    how often they would have been accepted, so a profitable n-gram bucket is found without paying for it."""
    target = TableBackend(V, seed=0)
    plain = Engine(target).generate(PROMPT, max_tokens=60).tokens
    eng = Engine(TableBackend(V, seed=0), LookupDrafter(ngram_max=2), draft_max=4, adaptive=True)
    for n in range(1, 10):  # a huge verify cost: nothing is worth verifying
        eng.policy.target_cost[n] = _Ema(1.0 + 5.0 * (n - 1), weight=1e9)
    eng.policy.rate = 0.0
    out = eng.generate(PROMPT, max_tokens=60)
    assert out.tokens == plain and out.stats.drafted == 0
    learned = {k: e.weight for (src, k), e in eng.policy.key_alpha.items() if src == "lookup"}
    assert learned and max(learned.values()) > 10


class _EagerPolicy(AdaptivePolicy):
    """Always starts the draft model with k_max; a fixed verify price and fixed acceptance per bucket, so the
    budget verifies a token exactly when the draft's max probability is >= 0.5."""

    def draft_length(self, source, behind=0):
        self.last_was_probe = False
        return self.k_max

    def verify_price(self, i, sharing=1):
        return 0.35

    def key_acceptance(self, source, key):
        return prior_acceptance(key)

    def acceptance(self, source):
        return 0.9

    def draft_step_cost(self, source):
        return 0.0


def test_confidence_budget_keeps_the_target_distribution():
    """Drafts cut short by the draft's confidence (different lengths every step) stay exact samples."""
    params = SamplingParams(1.0, seed=90_000, coupled=False)
    eng = Engine(TableBackend(V, seed=0), ModelDrafter(TableBackend(V, seed=1), V), draft_max=3)
    eng.policy = _EagerPolicy(k_max=3)
    counts = np.zeros(V ** 3, dtype=np.int64)
    lengths = set()
    for i in range(20_000):
        r = eng.generate(PROMPT, max_tokens=3, params=dataclasses.replace(params, seed=params.seed + i))
        lengths.update(r.stats.draft_lengths)
        counts[np.ravel_multi_index(r.tokens, (V,) * 3)] += 1
    assert {0, 1}.issubset(lengths) and max(lengths) >= 2  # the budget really cut drafts at varying points
    assert pvalue(counts, exact_joint(params)) > 1e-4


def test_stats_report_acceptance_by_confidence():
    eng = Engine(TableBackend(V, seed=0), ModelDrafter(TableBackend(V, seed=1), V), draft_max=4)
    out = eng.generate(PROMPT, max_tokens=60).stats.to_dict()["acceptance_by_confidence"]
    assert out and all(k.startswith("draft:q") for k in out)
    assert sum(v["drafted"] for v in out.values()) <= eng.generate(PROMPT, max_tokens=60).stats.drafted


# -- probes: the model decides after them, bounded catch-up, a fresh look at each request ------------------------------------------
def _losing_policy():
    """This CPU's costs, a draft step 0.45 of a target step, acceptance 0.5: plain decoding wins."""
    policy = _cpu_policy()
    policy.draft_cost["draft"] = _Ema(0.45, weight=100)
    policy.alpha["draft"] = _Ema(0.5, weight=100)
    return policy


def _step(policy, k, n_accepted):
    policy.observe("draft", k, n_accepted, 0.45 * k, 1.0 + 0.5 * k, n_accepted + 1, keys=["q0.98"] * k,
                   paid="draft", draft_steps=k)


def test_after_a_probe_the_model_decides_with_the_refreshed_estimates():
    policy = _losing_policy()
    assert policy.draft_length("draft") == 0  # the model says plain: back off
    ks = [policy.draft_length("draft") for _ in range(policy.probe_after)]
    assert ks == [0] * policy.probe_after
    k = policy.draft_length("draft")  # the probe
    assert k > 0 and policy.last_was_probe
    _step(policy, k, k)  # fully accepted, but one good step does not make a draft step cost less:
    assert policy.draft_length("draft") == 0  # still plain
    cheap = _losing_policy()  # the same acceptance with a draft step of 0.05 target steps pays
    cheap.draft_cost["draft"] = _Ema(0.05, weight=100)
    cheap.alpha["draft"] = _Ema(0.8, weight=100)
    assert all(cheap.draft_length("draft") > 0 for _ in range(5))


def test_probes_do_not_pay_for_long_catch_ups():
    policy = _losing_policy()
    policy.catchup_per_token = _Ema(0.04, weight=100)  # 4% of a target step per token
    policy.decode_time = 10.0  # allowance 1.5% of it + a quarter step = 0.4: 10 tokens
    policy.probing = True
    assert policy.draft_length("draft", behind=200) == 0 and not policy.last_was_probe
    policy.backoff, policy.probing = 0, True
    assert policy.draft_length("draft", behind=5) > 0


def test_where_drafting_usually_pays_a_probe_may_catch_up_one_target_step():
    """Past the 1.5% share the draft model would never catch up again in the request: while the long run across
    requests says drafting pays, a probe may spend up to one target step (T(1) = 1.0 here) on the catch-up; where
    it says plain wins, or beyond one step, not."""
    paying = _losing_policy()
    paying.draft_cost["draft"] = _Ema(0.05, weight=100)
    paying.alpha["draft"] = _Ema(0.8, weight=100)
    for policy, behind, probes in [(paying, 20, True), (paying, 30, False), (_losing_policy(), 20, False)]:
        policy.catchup_per_token = _Ema(0.04, weight=100)  # 20 tokens: 0.8 of a step
        policy.new_request()
        policy.decode_time = 2.0  # allowance 1.5% of it + a quarter step = 0.28: 7 tokens
        policy.backoff, policy.probing = 0, True
        assert (policy.draft_length("draft", behind=behind) > 0) == probes, (behind, probes)


def test_request_start_probes_back_off_while_they_find_nothing():
    """Probes at request start cost about a target step each: while they keep showing that plain wins,
    only every 2nd, 4th, 8th, 16th request starts with one; as soon as drafting pays, every request does."""
    def probed_requests(policy, n_requests, accept, c=0.45):
        def step(k, n_accepted):
            policy.observe("draft", k, n_accepted, c * k, 1.0 + 0.5 * k, n_accepted + 1, keys=["q0.98"] * k,
                           paid="draft", draft_steps=k)

        probed = []
        for _ in range(n_requests):
            policy.new_request()
            k = policy.draft_length("draft", behind=1)
            probed.append(k > 0)
            if k:
                step(k, k if accept else 0)
            for _ in range(3):
                k = policy.draft_length("draft")
                if k:
                    step(k, k)
        return probed

    losing = probed_requests(_losing_policy(), 40, accept=False)
    assert [i for i, p in enumerate(losing) if p] == [0, 2, 6, 14, 30]  # gaps 2, 4, 8, 16 (the cap)
    cheap = _losing_policy()
    cheap.draft_cost["draft"] = _Ema(0.05, weight=100)
    cheap.alpha["draft"] = _Ema(0.8, weight=100)
    assert all(probed_requests(cheap, 10, accept=True, c=0.05))


def test_each_request_gets_a_fresh_probe():
    policy = _losing_policy()
    policy.backoff, policy.probe_interval = 200, 256  # lost for a long while on earlier prompts
    policy.new_request()
    assert policy.draft_length("draft", behind=1) > 0  # the draft model just prefilled the prompt: try it


def test_catch_up_allowance_is_per_request():
    """The 1.5% catch-up share counts this request's decode time: a long earlier request does not pay for
    a big catch-up in a short new one."""
    policy = _losing_policy()
    policy.catchup_per_token = _Ema(0.04, weight=100)
    policy.decode_time = 1000.0  # lifetime: allowance would cover 375 tokens
    policy.new_request()
    assert policy.decode_time == 0.0
    policy.backoff, policy.probing = 0, True
    assert policy.draft_length("draft", behind=50) == 0  # this request: 0 s decoded, a quarter step allowed


def test_acceptance_is_kept_per_sampling_regime():
    policy = AdaptivePolicy(k_max=4)
    policy.new_request(0.0)
    for _ in range(50):
        policy.observe("draft", 1, 1, 0.4, 1.5, 2, keys=["q0.8"], paid="draft")
    greedy = policy.key_alpha[("draft", "q0.8")].value  # the long-run estimate, what a new request starts from
    assert greedy > 0.9 and policy.acceptance("draft") > 0.9
    policy.new_request(0.8)  # sampled requests start from the prior, then learn on their own
    assert policy.key_acceptance("draft", "q0.8") == prior_acceptance("q0.8")
    for _ in range(50):
        policy.observe("draft", 1, 0, 0.4, 1.5, 1, keys=["q0.8"], paid="draft")
    assert policy.key_acceptance("draft", "q0.8") < 0.2
    policy.new_request(0.0)
    assert policy.key_acceptance("draft", "q0.8") == greedy
    assert regime_of(0.0) == "" and regime_of(0.3) != regime_of(0.8) != regime_of(1.5)


def test_a_request_s_own_misses_stop_a_bucket_that_usually_pays():
    """Acceptance blends the long-run estimate with this request's outcomes: lookup's 2-gram copies pay in
    general (0.7), but two misses in this request bring it under the verify price (0.5) and the budget stops
    verifying them; shadows (unverified proposals) that hit bring it back; a new request starts afresh."""
    policy = _cpu_policy()
    policy.key_alpha[("lookup", "n2")] = _Ema(0.7, weight=100)
    policy.new_request(0.0)
    assert policy.key_acceptance("lookup", "n2") == pytest.approx(0.7)
    assert policy.budget(4).take("lookup", "n2")
    policy.observe("lookup", 1, 0, 0.0, 1.5, 1, keys=["n2"])
    long_run = policy.key_alpha[("lookup", "n2")].value  # moved a little by the miss too
    assert policy.key_acceptance("lookup", "n2") == pytest.approx((3 * long_run + 0) / 4)
    policy.observe("lookup", 1, 0, 0.0, 1.5, 1, keys=["n2"])
    assert policy.key_acceptance("lookup", "n2") < 0.5
    assert not policy.budget(4).take("lookup", "n2")
    for _ in range(3):
        policy.observe_shadow("lookup", "n2", True)
    assert policy.budget(4).take("lookup", "n2")
    policy.new_request(0.0)
    assert policy.key_acceptance("lookup", "n2") == pytest.approx(policy.key_alpha[("lookup", "n2")].value)
    # the draft model's overall acceptance (which sets k) is blended the same way
    policy.alpha["draft"] = _Ema(0.8, weight=100)
    for _ in range(3):
        policy.observe("draft", 2, 0, 0.1, 1.5, 1, keys=["q0.8", "q0.8"], paid="draft")
    assert policy.acceptance("draft") < 0.5


def test_a_new_request_trusts_a_drafter_no_more_than_its_first_outcome_record():
    """Copying pays in some requests and not at all in others: the long-run acceptance of lookup's 4-grams
    is high (0.9, learned where it copies), but the first proposal of a request was right in only 1 of 4
    requests. A new request then only scores its first proposal (a shadow, free); a hit there starts
    verifying, a miss keeps it off."""
    policy = _cpu_policy()
    policy.key_alpha[("lookup", "n4")] = _Ema(0.9, weight=100)
    for first_right in (False, True, False, False):
        policy.new_request(0.0)
        policy.observe_shadow("lookup", "n4", first_right)
        policy.observe_shadow("lookup", "n4", True)  # later outcomes do not enter the first-outcome record
    policy.key_alpha[("lookup", "n4")] = _Ema(0.9, weight=100)
    policy.new_request(0.0)
    assert policy.key_acceptance("lookup", "n4") < 0.5 and not policy.budget(4).take("lookup", "n4")
    policy.observe_shadow("lookup", "n4", True)
    assert policy.key_acceptance("lookup", "n4") > 0.8 and policy.budget(4).take("lookup", "n4")
    policy.new_request(0.0)
    policy.observe_shadow("lookup", "n4", False)
    assert not policy.budget(4).take("lookup", "n4")
    # a drafter whose requests start well keeps its long-run estimate from the first token on
    fresh = _cpu_policy()
    fresh.key_alpha[("lookup", "n4")] = _Ema(0.9, weight=100)
    for _ in range(4):
        fresh.new_request(0.0)
        fresh.observe("lookup", 2, 2, 0.0, 1.5, 3, keys=["n4", "n4+"])
    fresh.new_request(0.0)
    assert fresh.key_acceptance("lookup", "n4") == pytest.approx(fresh.key_alpha[("lookup", "n4")].value)


def test_draft_model_skips_the_prompt_when_the_request_will_not_draft():
    """A request that starts without a probe, with the model saying plain decoding wins, does not make the
    draft model process the prompt (its share of time to first token, for nothing); a probing request and
    fixed-k drafting do. Output stays the target's either way."""
    target = TableBackend(V, seed=0)
    plain = Engine(target).generate(PROMPT, max_tokens=12).tokens
    draft = TableBackend(V, seed=1)
    eng = Engine(TableBackend(V, seed=0), ModelDrafter(draft, V), draft_max=4, adaptive=True)
    losing = _losing_policy()
    losing.k_max = 4
    losing.requests_to_skip = 3  # earlier request-start probes found nothing
    eng.policy = losing
    out = eng.generate(PROMPT, max_tokens=12)
    assert out.tokens == plain and out.stats.drafted == 0
    assert draft.tokens == []  # never asked to process anything
    eng.policy.requests_to_skip = 0  # this request starts with a probe: the draft model prefills the prompt
    assert eng.generate(PROMPT, max_tokens=12).tokens == plain
    assert len(draft.tokens) >= len(eng.tokenize_prompt(PROMPT)) - 1
    fixed_draft = TableBackend(V, seed=1)  # (a one-token request never drafts, so it never prefills either)
    Engine(TableBackend(V, seed=0), ModelDrafter(fixed_draft, V), draft_max=4).generate(PROMPT, max_tokens=2)
    assert len(fixed_draft.tokens) >= len(eng.tokenize_prompt(PROMPT)) - 1


def test_draft_prefill_must_pay_for_itself_over_the_answer():
    """A long new prompt for a short answer (an editor's code completion: ~500 new tokens, 32 out): the draft
    model's prompt processing costs more than drafting could save even with every draft accepted, so it is
    skipped; a short prompt or a long answer keeps it. Its price: measured prefills, else the target's
    prefill scaled by the step costs."""
    policy = _cpu_policy(k_max=4)  # T(n) = 1 + 0.5 (n - 1) s
    policy.draft_cost["draft"] = _Ema(0.2, weight=100)
    policy.alpha["draft"] = _Ema(0.9, weight=100)
    policy.new_request(0.0)
    # before any draft step was timed: priced by the draft's weights over the target's
    bare = _cpu_policy(k_max=4)
    bare.new_request(0.0)
    assert bare.wants_draft_prefill("draft", behind=1000, max_tokens=4, target_prefill=(10.0, 1000))  # unknown
    assert not bare.wants_draft_prefill("draft", behind=1000, max_tokens=4, target_prefill=(10.0, 1000),
                                        draft_share=0.3)  # 3 s, where 4 tokens save at most 4 x 0.4 s
    assert bare.wants_draft_prefill("draft", behind=1000, max_tokens=40, target_prefill=(10.0, 1000),
                                    draft_share=0.3)
    best = policy._gain("draft", 1.0)  # seconds per token at best
    assert 0 < best < 1 and policy._gain("draft", 0.9) < best
    # not yet measured: the target's prefill (2 s for 100 tokens) x 0.2 (the draft step's share) = 0.004 s a token
    prefill = (2.0, 100)
    assert policy.probing
    assert not policy.wants_draft_prefill("draft", behind=int(32 * best / 0.004) + 10, max_tokens=32,
                                          target_prefill=prefill)
    assert policy.wants_draft_prefill("draft", behind=int(32 * best / 0.004) - 10, max_tokens=32,
                                      target_prefill=prefill)
    assert policy.wants_draft_prefill("draft", behind=500, max_tokens=4000, target_prefill=prefill)
    policy.observe_draft_prefill(500, 0.5)  # measured: 0.001 s a token
    assert policy.wants_draft_prefill("draft", behind=int(32 * best / 0.004) + 10, max_tokens=32)
    policy.observe_draft_prefill(3, 1.0)  # a few tokens say nothing of a prefill's price
    assert policy.catchup_per_token.value == pytest.approx(0.001)
    policy.probing = False  # not probing: at the expected acceptance, which saves less
    n = int(32 * policy._gain("draft", 0.9) / 0.001)
    assert policy.wants_draft_prefill("draft", behind=n - 5, max_tokens=32)
    assert not policy.wants_draft_prefill("draft", behind=n + 5, max_tokens=32)
    assert policy.wants_draft_prefill("draft")  # nothing to weigh: as before


def test_first_draft_prefill_priced_by_the_cost_profile():
    """A process's first request (a server's, every CLI run's) comes before the target was timed: the savings
    are priced by T(1) as the cost profile measured it and a draft step at the draft's share of the weights
    (probing: every draft accepted). Without that T(1) (or the share) there is nothing to price with: the draft
    model prefills, as before."""
    profile = {n: 1.0 + 0.5 * (n - 1) for n in range(1, 17)}
    fresh = AdaptivePolicy(k_max=4, cost_prior=profile, t1_prior=0.04)  # a 40 ms target step
    fresh.new_request(0.0)
    assert fresh.probing and not fresh.target_cost
    per_token = fresh.t1_prior * fresh._gain("draft", 1.0, draft_step=0.3)  # seconds saved per token at best
    assert 0 < per_token < 0.04
    # ~1600 new prompt tokens (an editor's first request: the open files too) at 0.3 x 14 ms each, 32 out
    prefill = (1600 * 0.014, 1600)
    assert not fresh.wants_draft_prefill("draft", behind=1600, max_tokens=32, target_prefill=prefill,
                                         draft_share=0.3)
    n = int(1600 * 0.014 * 0.3 / per_token)  # the answer length at which it pays
    assert not fresh.wants_draft_prefill("draft", behind=1600, max_tokens=n - 2, target_prefill=prefill,
                                         draft_share=0.3)
    assert fresh.wants_draft_prefill("draft", behind=1600, max_tokens=n + 2, target_prefill=prefill,
                                     draft_share=0.3)
    assert fresh.wants_draft_prefill("draft", behind=50, max_tokens=256, target_prefill=(0.7, 50),
                                     draft_share=0.3)  # a chat prompt
    unknown = AdaptivePolicy(k_max=4, cost_prior=profile)  # no T(1): as before
    unknown.new_request(0.0)
    assert unknown.wants_draft_prefill("draft", behind=1600, max_tokens=32, target_prefill=prefill,
                                       draft_share=0.3)
    assert fresh.wants_draft_prefill("draft", behind=1600, max_tokens=32, target_prefill=prefill)  # no share
    assert not fresh.wants_draft_prefill("draft", 2, behind=50, max_tokens=256)  # beside another request


def test_engine_skips_a_draft_prefill_that_cannot_pay():
    """Through the engine: a probing request whose new prompt would cost the draft model more than its answer
    can save leaves the draft model alone (and decodes plainly: catching up costs as much); the output is the
    target's either way."""
    target = TableBackend(V, seed=0)
    prompt = " ".join(str(3 + i % 5) for i in range(120))
    plain = Engine(target).generate(prompt, max_tokens=6).tokens
    draft = TableBackend(V, seed=1)
    eng = Engine(TableBackend(V, seed=0), ModelDrafter(draft, V), draft_max=4, adaptive=True)

    def policy():  # (a fresh one each time: this machine's microsecond passes would be timed into it)
        p = _cpu_policy(k_max=4)
        p.draft_cost["draft"] = _Ema(0.2, weight=100)
        p.alpha["draft"] = _Ema(0.95, weight=100)  # drafting pays: ~0.2 s a token saved
        p.catchup_per_token = _Ema(0.05, weight=100)  # 120 tokens: 6 s, more than 6 tokens can save
        return p

    eng.policy = policy()
    out = eng.generate(prompt, max_tokens=6)
    assert out.tokens == plain and draft.tokens == [] and out.stats.drafted == 0
    eng.policy = policy()
    out = eng.generate(prompt, max_tokens=200)  # a long answer: worth it
    assert len(draft.tokens) >= 119 and out.tokens[:6] == plain


def test_first_outcome_records_are_kept_per_confidence_bucket():
    """Short n-gram matches miss first in every request, long ones hit: a 1-gram miss does not make the
    request's 4-gram copies look doubtful."""
    policy = _cpu_policy()
    for _ in range(4):
        policy.new_request(0.0)
        policy.observe_shadow("lookup", "n1", False)
        policy.observe_shadow("lookup", "n4", True)
    policy.key_alpha[("lookup", "n4")] = _Ema(0.9, weight=100)
    policy.new_request(0.0)
    policy.observe_shadow("lookup", "n1", False)
    assert policy.key_acceptance("lookup", "n4") == pytest.approx(0.9)
    assert policy.budget(4).take("lookup", "n4")


def test_catch_up_counts_from_the_common_prefix():
    """A draft model whose cache still holds another request's longer text is far behind, not ahead: a probe
    must see the whole catch-up it would pay for (it skipped this prompt's prefill)."""
    draft = TableBackend(V, seed=1)
    draft.sync([1, 2, 3, 4, 5, 6, 7, 1, 2, 3], n_logits=0)
    assert draft.behind([1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]) == 1
    assert draft.behind([5, 4, 3, 2, 1]) == 5
    assert draft.behind([1, 2, 3, 7]) == 1
    policy = _losing_policy()
    policy.catchup_per_token = _Ema(0.04, weight=100)
    policy.probing = True
    assert policy.draft_length("draft", behind=draft.behind([5, 4, 3, 2, 1] * 40)) == 0  # 200 tokens: refused


def test_a_draft_model_s_first_miss_in_a_request_is_only_one_miss():
    """The first-outcome cap is for free drafters, whose copies pay in some requests and never in others. A
    draft model whose requests often started with a miss, but which accepts 85% in the long run, starts each
    request from its long run; lookup with the same record is still capped."""
    policy = _cpu_policy()
    policy.draft_cost["draft"] = _Ema(0.05, weight=100)
    for _ in range(4):
        policy.new_request(0.0)
        policy.draft_length("draft")
        policy.observe("draft", 1, 0, 0.05, 1.5, 1, keys=["q0.9"], paid="draft")
        policy.observe_shadow("lookup", "n4", False)
    policy.alpha["draft"] = _Ema(0.85, weight=100)
    policy.key_alpha[("lookup", "n4")] = _Ema(0.85, weight=100)
    policy.new_request(0.0)
    assert policy.acceptance("draft") == pytest.approx(0.85)
    assert policy.key_acceptance("lookup", "n4") < 0.5
    assert policy.draft_length("draft") > 0


def test_the_acceptance_prior_survives_a_first_miss():
    """A new policy's first verified draft token rejected: the long-run acceptance is the prior moved by one
    outcome (as much as two), not 0, which would price drafting out for many requests."""
    policy = AdaptivePolicy(k_max=4)
    policy.observe("draft", 1, 0, 0.1, 1.5, 1, keys=["q0.9"], paid="draft")
    assert policy.alpha["draft"].value == pytest.approx(policy.prior_alpha * 2 / 3)
    policy.observe("draft", 2, 2, 0.2, 2.0, 3, keys=["q0.9", "q0.9"], paid="draft")
    assert 0.5 < policy.alpha["draft"].value < 0.8


def test_a_long_request_may_catch_up_what_drafting_would_repay():
    """After a backoff the draft model is behind by the plain steps taken. Past the share of decode time and
    one target step, a probe may still pay for the catch-up if drafting at the long-run acceptance would save
    four times that over the tokens the request has left; not in a short remainder, nor where plain wins."""
    def probes(policy, room, behind):
        policy.new_request(0.0)
        policy.catchup_per_token = _Ema(0.04, weight=100)  # 60 tokens: 2.4 target steps
        policy.budget(room)
        policy.backoff, policy.probing = 0, True
        return policy.draft_length("draft", behind=behind) > 0

    def paying():
        policy = _cpu_policy()
        policy.draft_cost["draft"] = _Ema(0.05, weight=100)
        policy.alpha["draft"] = _Ema(0.8, weight=100)
        return policy

    gain = paying()._long_run_gain("draft")  # target steps saved per token
    assert 0.1 < gain < 0.5
    assert probes(paying(), room=400, behind=60)  # 2.4 <= 0.25 * 400 * 0.14
    assert not probes(paying(), room=20, behind=60)
    assert not probes(paying(), room=400, behind=2000)
    assert _losing_policy()._long_run_gain("draft") == 0.0
    assert not probes(_losing_policy(), room=400, behind=60)


def test_a_request_whose_probe_hit_gets_a_few_more_looks():
    """The long run says plain (0.5 where drafting needs 0.69), but this request's probe was accepted: while
    the request has few outcomes and an optimistic estimate would pay, the next steps draft one token each
    (as probes); two misses out of three end it, as does a drafter that could not pay at any likely acceptance."""
    def policy_with(c):
        policy = _with_costs(AdaptivePolicy(k_max=4), lambda n: 1.0 + 0.35 * (n - 1))
        policy.draft_cost["draft"] = _Ema(c, weight=100)
        policy.alpha["draft"] = _Ema(0.5, weight=100)
        policy.new_request(0.0)
        assert policy.draft_length("draft", behind=1) == 1 and policy.last_was_probe  # the request-start probe
        return policy

    def step(policy, n_accepted):
        c = policy.draft_cost["draft"].value
        policy.observe("draft", 1, n_accepted, c, 1.35, n_accepted + 1, keys=["q0.9"], paid="draft")

    policy = policy_with(0.3)
    step(policy, 1)
    assert best_draft_length(policy.acceptance("draft"), 0.3, policy.target_time, 1, 4) == 0  # the blend: plain
    assert policy.draft_length("draft") == 1 and policy.last_was_probe  # but a look
    step(policy, 0)
    assert policy.draft_length("draft") == 1  # one hit, one miss: still worth a look
    step(policy, 0)
    assert policy.draft_length("draft") == 0  # one hit in three: plain
    missed = policy_with(0.3)
    step(missed, 0)
    assert missed.draft_length("draft") == 0  # the probe missed: the long run decides
    costly = policy_with(0.6)
    step(costly, 1)
    assert costly.draft_length("draft") == 0  # even 0.88 would not pay for a 0.6 step (it needs 0.95)


def test_one_slow_speculative_step_does_not_stop_drafting_that_pays():
    """The guard compares the last 8 speculative steps' seconds per token with plain steps'. Drafting that
    saves 10% keeps going through one step 3x slower (a first draft step's page faults); steps that lose 10%
    each back off."""
    def guarded(step_times):
        policy = AdaptivePolicy(k_max=4)
        for _ in range(5):
            policy.observe("draft", 0, 0, 0.0, 1.0, 1)  # plain steps: 1.0 s a token
        for t in step_times:  # k = 1, accepted: 2 tokens a step
            policy.observe("draft", 1, 1, 0.3 * t, 1.5 * t, 2, keys=["q0.9"], paid="draft")
        return policy.backoff > 0

    paying = 2 * 0.9 / 1.8  # a step's time factor for 0.9 s a token
    assert not guarded([3 * paying] + [paying] * 7)
    assert guarded([2 * 1.1 / 1.8] * 8)


def test_a_first_slow_timing_does_not_set_a_cost():
    """A process's first draft step pays page faults (19 ms for a 10 ms step): the estimate is the median of
    the first timings, so two ordinary steps put it back at 10 ms; a mean would say 13 and, with a
    verify price, keep drafting (which alone times draft steps again) from running."""
    policy = AdaptivePolicy(k_max=4)
    for t in (0.019, 0.010, 0.010):
        policy.observe("draft", 1, 1, t, 0.030, 2, keys=["q0.9"], paid="draft")
    assert policy.draft_step_cost("draft") == pytest.approx(0.010)
    for t in (0.040, 0.030, 0.030):  # likewise a first 2-token verify pass
        policy.observe("lookup", 1, 1, 0.0, t, 2, keys=["n3"])
    assert policy.target_time(2) == pytest.approx(0.030)


def test_an_earlier_processs_prompt_ratio_prices_the_first_draft_prefill():
    """A draft's prompt costs more per token, against the target's, than its step does (0.45-0.54 for the Qwen
    pair against a 0.3 step share), so the first request of a process prices it by the ratio an earlier
    process measured when there is one; this process's own measurement still comes first."""
    profile = {n: 1.0 + 0.5 * (n - 1) for n in range(1, 17)}
    fresh = AdaptivePolicy(k_max=4, cost_prior=profile, t1_prior=0.04)
    fresh.new_request(0.0)
    per_token = fresh.t1_prior * fresh._gain("draft", 1.0, draft_step=0.3)
    prefill = (1600 * 0.014, 1600)
    n_share = int(1600 * 0.014 * 0.3 / per_token)  # pays from here, priced by the weights' share
    n_ratio = int(1600 * 0.014 * 0.5 / per_token)  # and from here, priced by a measured prompt ratio of 0.5
    assert n_share + 10 < n_ratio
    answer = (n_share + n_ratio) // 2
    assert fresh.wants_draft_prefill("draft", behind=1600, max_tokens=answer, target_prefill=prefill,
                                     draft_share=0.3)
    assert not fresh.wants_draft_prefill("draft", behind=1600, max_tokens=answer, target_prefill=prefill,
                                         draft_share=0.3, prompt_ratio=0.5)
    assert fresh.wants_draft_prefill("draft", behind=1600, max_tokens=n_ratio + 2, target_prefill=prefill,
                                     draft_share=0.3, prompt_ratio=0.5)
    fresh.observe_draft_prefill(1000, 1000 * 0.014 * 0.3)  # measured in this process: 0.3 after all
    assert fresh.wants_draft_prefill("draft", behind=1600, max_tokens=answer, target_prefill=prefill,
                                     draft_share=0.3, prompt_ratio=0.5)
