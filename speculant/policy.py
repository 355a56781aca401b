"""How many tokens to draft each step, and whether to draft at all.

FixedPolicy drafts k every step. AdaptivePolicy measures online what matters and decides in two stages:

1. Before drafting (per step): whether a paid drafter (a draft model) runs at all, and its upper bound k,
   from Leviathan et al.'s model with measured costs:

       E[tokens | k] = (1 - a^(k+1)) / (1 - a)          a: per-token acceptance of this drafter
       time(k)       = k * c + T(k + 1)                 c: one draft step; T(n): one target pass over n tokens

   T(n) is measured per n (nearly flat on a GPU, growing with n with llama.cpp on a CPU); k = 0 is plain
   decoding. Before a size is timed, T(n) = T(1) r(n) with r from the machine's measured cost profile
   (costprofile.py; without one, r(n) = 1 + 0.5 (n - 1)). As a guard against a wrong model it compares the realized seconds per token of speculative and
   plain steps; when speculation loses it decodes plainly for a while and probes again later (backing off
   exponentially while it keeps losing).
2. While drafting (per token): acceptance is measured by the draft's confidence (a bucket of the draft
   model's max probability; the matched n-gram length for prompt lookup). A proposed token is sent to
   verification only if the chance that it and every token before it are accepted pays for the extra verify
   cost, in plain-decoding steps: P(all accepted) >= (T(i+1) - T(i)) / T(1). Another paid draft step is taken
   only if the expected gain pays for it and its verify cost too. These decisions look only at the context
   and the draft's distribution, never at the sampled token's value against the target, so they keep every
   drafter lossless.

Acceptance differs far more between requests than between stretches of one (prompt lookup copies well in a
summary, badly in new code), so an estimate blends the long-run average with this request's own outcomes:
(request_weight * average + hits) / (request_weight + tries). Two misses in a row of a bucket that usually
pays stop it for the rest of the request; unverified lookup proposals are still scored (shadows), so a
request whose text turns repetitive starts copying again. Until a request's first outcome of a drafter is an
accept, a free drafter (and each of its confidence buckets) is trusted no more than its record on first outcomes
(how often the first proposal of a request was right): where copying works in some requests and not at all
in others, that record is low, so the first proposal is only scored, for free, and verifying starts once the
request shows it copies well.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Optional

from .errors import SettingsError


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens per target call when drafting k tokens with i.i.d. acceptance alpha (includes the target's own)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def best_draft_length(alpha: float, draft_cost: float, target_cost, k_min: int, k_max: int) -> int:
    """argmax over k in {0} ∪ [k_min, k_max] of expected tokens per second. target_cost(n) -> seconds."""
    candidates = [0] + list(range(max(k_min, 1), k_max + 1))
    return max(candidates, key=lambda k: expected_tokens(alpha, k) / (k * draft_cost + target_cost(k + 1)))


# -- draft confidence -> bucket keys (the acceptance table is kept per key) ------------------------------------
CONFIDENCE_EDGES = (0.5, 0.8, 0.9, 0.95, 0.98)


def confidence_key(p: float) -> str:
    """The bucket of a draft model's max probability: 'q<0.5', 'q0.5', 'q0.8', ... 'q0.98'."""
    label = "q<0.5"
    for edge in CONFIDENCE_EDGES:
        if p >= edge:
            label = f"q{edge:g}"
    return label


def ngram_key(n: int, first: bool) -> str:
    """Prompt lookup's confidence: the matched n-gram length; continuations of a match are kept apart."""
    return f"n{n}" if first else f"n{n}+"


def run_key(run: int) -> str:
    """A prediction's confidence: how many tokens the output has agreed with it at the current alignment
    (for a drafted token, counting the drafted tokens before it): 'p0', 'p1', 'p2', 'p4', 'p8', 'p16', 'p32', 'p64'."""
    label = "p0"
    for edge in (1, 2, 4, 8, 16, 32, 64):
        if run >= edge:
            label = f"p{edge}"
    return label


HISTORY_LENGTHS = (2, 3, 4, 6, 8, 12, 16)
HISTORY_COUNTS = (1, 2, 4, 8)


def history_key(match: int, count: int) -> str:
    """History drafting's confidence: the matched suffix's length and how often the proposed continuation
    followed it ('h4c2': a 4..5-token match, continued this way 2..3 times)."""
    n = max((e for e in HISTORY_LENGTHS if match >= e), default=1)
    c = max((e for e in HISTORY_COUNTS if count >= e), default=1)
    return f"h{n}c{c}"


def regime_of(temperature: float) -> str:
    """'' for greedy requests, '@T<=0.5' / '@T<=1' / '@T>1' for sampled ones (a suffix of the source name)."""
    if temperature <= 0:
        return ""
    return "@T<=0.5" if temperature <= 0.5 else "@T<=1" if temperature <= 1.0 else "@T>1"


def prior_acceptance(key: str) -> float:
    """A starting guess per bucket before any measurement (weighted as two observations)."""
    if key.startswith("q<"):
        return 0.3
    if key.startswith("q"):
        lo = float(key[1:])
        hi = next((e for e in CONFIDENCE_EDGES if e > lo), 1.0)
        return (lo + hi) / 2
    if key.startswith("n"):
        return 0.7 if key.endswith("+") else min(0.1 + 0.1 * int(key[1:].rstrip("+")), 0.6)
    if key.startswith("p"):  # a prediction: the longer the output has followed it, the likelier it goes on
        return {"p0": 0.2, "p1": 0.3, "p2": 0.4, "p4": 0.5, "p8": 0.7, "p16": 0.85, "p32": 0.9}.get(key, 0.93)
    if key.startswith("h"):
        n, c = (int(x) for x in key[1:].split("c"))
        return min(0.1 + 0.05 * n + 0.05 * c, 0.8)
    return 0.5


class DraftBudget:
    """One step's drafting allowance: at most k tokens. Drafters call `start` before using a source (0: do not),
    `take(source, key)` for each proposed token (False: stop here, the token is not verified) and `more`
    before paying for another draft step. Without a policy it takes everything up to k (fixed-k drafting)."""

    def __init__(self, k: int, policy: Optional["AdaptivePolicy"] = None, k_long: Optional[int] = None,
                 sharing: int = 1):
        self.k = k  # upper bound for this step
        self.sharing = sharing  # requests whose passes merge with this one's (batching.py), this one included
        self.paid = sharing == 1  # may a paid drafter (a draft model) run this step
        self.k_long = k if k_long is None else k_long  # the bound for drafters that may go long (a prediction)
        self.policy = policy
        self.k_now = k  # the bound granted by the last start()
        self.taken = 0  # tokens accepted into the draft
        self.p_all = 1.0  # estimated chance that every taken token is accepted
        self.explore = False  # probing: take every proposal, to measure
        self.last_key: Optional[str] = None  # confidence bucket of the last token taken

    def start(self, source: str, free: bool, behind: int = 0, long: bool = False) -> int:
        """behind: tokens a paid drafter must process before its first guess (a catch-up prefill); long: a
        free drafter whose drafts may run to k_long (a tracking prediction: the per-token rule cuts it)."""
        k = self.k_long if long and free else self.k
        if not free and not self.paid:
            k = 0
        elif self.policy is not None and not free:
            k = min(self.policy.draft_length(source, behind), k)
            self.explore = self.explore or self.policy.last_was_probe
        self.k_now = k
        return k

    def take(self, source: str, key: str) -> bool:
        if self.taken >= self.k_now:
            return False
        if self.policy is not None:
            p = self.p_all * self.policy.key_acceptance(source, key)
            if not self.explore and p < self.policy.verify_price(self.taken + 1, self.sharing):
                return False
            self.p_all = p
        self.taken += 1
        self.last_key = key
        return True

    def more(self, source: str) -> bool:
        """Is another paid draft step worth it? (the next token's expected gain against its costs)"""
        if self.taken >= self.k_now:
            return False
        if self.policy is None or self.explore:
            return True
        pol = self.policy
        price = pol.draft_step_cost(source) / pol.target_time(1) + pol.verify_price(self.taken + 1, self.sharing)
        # the next token's odds: those of the last one's bucket (confidence runs in stretches), else the average
        nxt = pol.key_acceptance(source, self.last_key) if self.last_key else pol.acceptance(source)
        return self.p_all * nxt >= price


class FixedPolicy:
    """Draft exactly k tokens every step (bounded by the room left)."""

    adaptive = False

    def __init__(self, k: int):
        self.k = k

    def budget(self, room: int, long_max: Optional[int] = None, sharing: int = 1) -> DraftBudget:
        return DraftBudget(min(self.k, room))

    def draft_length(self, source: str) -> int:
        return self.k

    def wants_draft_prefill(self, source: Optional[str], sharing: int = 1, **costs) -> bool:
        return True

    def observe(self, *args, **kwargs) -> None:
        pass

    def observe_draft_prefill(self, n_tokens: int, seconds: float) -> None:
        pass

    def new_request(self, temperature: float = 0.0) -> None:
        pass

    def observe_shadow(self, source: str, key: str, accepted: bool) -> None:
        pass


@dataclass
class _Ema:
    value: float
    weight: float = 0.0  # how much evidence backs value (0 = prior only)

    def update(self, x: float, rate: float) -> None:
        self.weight += 1
        r = max(rate, 1.0 / self.weight)  # plain average until enough samples, then exponential
        self.value += r * (x - self.value)


@dataclass
class _Cost(_Ema):
    """A timing: the median of its first samples, then exponential. A process's first draft step and first
    multi-token passes pay page faults and allocations (19 ms for a 10 ms draft step, 80 ms a token for a
    first speculative step): as the plain average's first sample that would price drafting out, and only
    drafting times those passes again."""
    samples: list = field(default_factory=list)

    def update(self, x: float, rate: float) -> None:
        if self.weight >= (1.0 / rate if rate > 0 else 10):  # a plain average from there on at rate 0
            super().update(x, rate)
            return
        self.samples.append(x)
        self.weight += 1
        self.value = median(self.samples)


@dataclass
class AdaptivePolicy:
    k_max: int = 8
    k_min: int = 1
    rate: float = 0.1  # EMA rate of the cost estimates
    alpha_rate: float = 0.03  # EMA rate of acceptance, per drafted token (about the last 30 tokens)
    prior_alpha: float = 0.6
    guard_window: int = 8  # speculative steps compared against plain before backing off
    probe_after: int = 8  # plain steps before speculation is tried again (doubles while it keeps losing)
    catchup_share: float = 0.015  # probes may spend at most this share of decode time on draft catch-up
    catchup_payback: float = 0.25  # .. or this share of what drafting would save over the request's tokens left
    explore_outcomes: int = 4  # a paid drafter's outcomes in a request before its estimate alone decides
    request_weight: float = 3.0  # the long-run acceptance counts as this many of the request's own outcomes
    prior_cost_weight: float = 2.0  # a pass size's first timings are shrunk toward the prior, as this many samples
    cost_prior: Optional[dict] = None  # n -> T(n) / T(1) measured on this machine (costprofile.py), or None
    t1_prior: Optional[float] = None  # seconds of a one-token target pass as that profile measured it, or None
    adaptive: bool = field(default=True, init=False)

    def __post_init__(self):
        if not (0 <= self.k_min <= self.k_max):
            raise SettingsError(f"need 0 <= --draft-min <= --draft-max, got {self.k_min} and {self.k_max}")
        self.alpha: dict[str, _Ema] = {}  # source -> acceptance of its verified tokens
        self.key_alpha: dict[tuple[str, str], _Ema] = {}  # (source, confidence key) -> acceptance
        self.draft_cost: dict[str, _Ema] = {}  # seconds per draft step (one forward of the draft model)
        self.target_cost: dict[int, _Ema] = {}  # n tokens -> seconds of one target pass
        self.plain_spt = _Cost(0.0)  # realized seconds per emitted token, plain steps (speculative ones: recent_spec)
        self.backoff = 0  # plain steps still to take before probing again
        self.probe_interval = self.probe_after
        self.request_probe_every = 1  # requests per request-start probe (doubles while probes find nothing)
        self.requests_to_skip = 0
        self.after_probe = False  # the next decision tells whether the last probe found speculation paying
        self.recent_spec: deque = deque(maxlen=self.guard_window)  # the last speculative steps' (seconds, tokens)
        self.probing = False
        self.last_was_probe = False
        self.decode_time = 0.0  # this request's steps' time, catch-up included
        self.catchup_time = 0.0  # of which draft catch-up prefills
        self.catchup_per_token = _Cost(0.0)
        self.history: list[int] = []  # k chosen for the paid drafter each step (the most recent ones)
        self.regime = ""  # the current request's sampling regime (regime_of)
        self.req_alpha: dict[str, list[int]] = {}  # this request: source -> [accepted, tries]
        self.req_key_alpha: dict[tuple[str, str], list[int]] = {}  # this request: (source, key) -> [accepted, tries]
        self.first_alpha: dict = {}  # source or (source, key) -> how often a request's first outcome was an accept
        self.req_first: dict = {}  # this request: source or (source, key) -> was its first outcome an accept
        self.paid_sources: set[str] = set()  # drafters that cost a step (a draft model), not free ones
        self.room = 0  # tokens this request may still generate (as of the last budget)

    # -- estimates ---------------------------------------------------------------------------------------
    def prior_ratio(self, n: int) -> float:
        """r(n) = T(n) / T(1) before pass size n is timed: the measured profile (interpolated, and extended
        past its largest size by its last step), else 1 + 0.5 (n - 1)."""
        prof = self.cost_prior
        if not prof:
            return 1.0 + 0.5 * (n - 1)
        if n in prof:
            return prof[n]
        sizes = sorted(prof)
        lo = max([m for m in sizes if m < n], default=sizes[0])
        hi = min([m for m in sizes if m > n], default=None)
        if hi is None:  # beyond the profile: its last per-token step
            prev = sizes[-2] if len(sizes) > 1 else None
            step = (prof[lo] - prof[prev]) / (lo - prev) if prev is not None else 0.5
            return prof[lo] + max(step, 0.0) * (n - lo)
        return prof[lo] + (prof[hi] - prof[lo]) * (n - lo) / (hi - lo)

    def target_time(self, n: int) -> float:
        """T(n): measured where possible, else linear through the measured points, or T(1) r(n) from the
        prior profile (prior_ratio) while fewer than two sizes are timed.
        A size timed slower than the prior (T(1) r(n)) only once or twice leans on the prior: on a loaded
        machine one slow pass would otherwise price every draft of that size out, and a size that is never
        verified is never timed again (a free drafter has no probes)."""
        one = self.target_cost.get(1)
        t1 = one.value if one is not None and one.weight > 0 else None
        measured = {m: self._shrunk(m, e, t1) for m, e in self.target_cost.items() if e.weight > 0}
        if n in measured:
            return measured[n]
        if not measured:
            return self.prior_ratio(n)  # unit-free, only relative costs matter before any measurement
        if t1 is not None and self.cost_prior:
            # the profile's shape, times how far the timed sizes around n sit from it now
            factor = {m: t / (t1 * self.prior_ratio(m)) for m, t in measured.items()}
            lo = max([m for m in factor if m < n], default=None)
            hi = min([m for m in factor if m > n], default=None)
            if lo is None or hi is None:
                f = factor[lo if hi is None else hi]
            else:
                f = factor[lo] + (factor[hi] - factor[lo]) * (n - lo) / (hi - lo)
            return t1 * self.prior_ratio(n) * f
        pts = sorted(measured.items())
        if len(pts) == 1:
            (m, t), = pts
            return t / self.prior_ratio(m) * self.prior_ratio(n)
        lo = max([p for p in pts if p[0] < n], default=pts[0], key=lambda p: p[0])
        hi = min([p for p in pts if p[0] > n], default=pts[-1], key=lambda p: p[0])
        if lo[0] == hi[0]:
            lo, hi = pts[-2], pts[-1]
        slope = max((hi[1] - lo[1]) / (hi[0] - lo[0]), 0.0)
        return max(lo[1] + slope * (n - lo[0]), 1e-6)

    def _shrunk(self, n: int, e: _Ema, t1: Optional[float]) -> float:
        if n == 1 or t1 is None:
            return e.value
        prior = t1 * self.prior_ratio(n)
        if e.value <= prior:
            return e.value
        return (e.weight * e.value + self.prior_cost_weight * prior) / (e.weight + self.prior_cost_weight)

    def verify_price(self, i: int, sharing: int = 1) -> float:
        """What verifying an i-th draft token adds to the target pass, in plain steps: (T(i+1) - T(i)) / T(1).
        In a pass merged with s - 1 other requests' (sharing = s), every sequence is padded to the longest, so
        the token adds s tokens to a pass that yields s plain tokens: s (T(s(i+1)) - T(si)) / T(s)."""
        s = max(sharing, 1)
        return s * max(self.target_time(s * (i + 1)) - self.target_time(s * i), 0.0) / self.target_time(s)

    def _src(self, source: str) -> str:
        """Acceptance is kept per sampling regime: greedy and sampled requests accept differently."""
        return source + self.regime

    def _blend(self, long_run: float, counts: Optional[list]) -> float:
        """The long-run estimate, moved by this request's own outcomes (hits / tries)."""
        if not counts:
            return long_run
        hits, tries = counts
        return (self.request_weight * long_run + hits) / (self.request_weight + tries)

    def _request_start(self, source: str, ident, long_run: float) -> float:
        """Until this request's first outcome for `ident` (a free source, or one of its confidence buckets, in
        the current regime; `source` is the drafter's name) is an accept: no more than its first-outcome record (a first miss makes this request look like those
        where it never pays). Copying works in some requests and not at all in others; a draft model's
        acceptance varies far less between requests, so its first miss is only one miss (the record capped a
        draft model that accepts 84% on the next prompt at 0.67, and two early misses ended its drafting for
        the request)."""
        if self.req_first.get(ident) or source in self.paid_sources:
            return long_run
        first = self.first_alpha.get(ident)
        return min(long_run, first.value) if first and first.weight >= 2 else long_run

    def acceptance(self, source: str) -> float:
        e = self.alpha.get(self._src(source))
        long_run = self._request_start(source, self._src(source), e.value if e else self.prior_alpha)
        return self._blend(long_run, self.req_alpha.get(self._src(source)))

    def key_acceptance(self, source: str, key: str) -> float:
        ident = (self._src(source), key)
        e = self.key_alpha.get(ident)
        long_run = self._request_start(source, ident, e.value if e else prior_acceptance(key))
        return self._blend(long_run, self.req_key_alpha.get(ident))

    def _request_outcome(self, ident, counts: dict, hits: int, tries: int) -> None:
        """Count outcomes of `ident` in this request; the first one also goes on its first-outcome record."""
        if ident not in self.req_first:
            self.req_first[ident] = hits > 0
            self.first_alpha.setdefault(ident, _Ema(0.5)).update(1.0 if hits else 0.0, self.rate)
        c = counts.setdefault(ident, [0, 0])
        c[0] += hits
        c[1] += tries

    def draft_step_cost(self, source: str) -> float:
        e = self.draft_cost.get(source)
        return e.value if e else 0.0

    # -- decisions -----------------------------------------------------------------------------------------
    def budget(self, room: int, long_max: Optional[int] = None, sharing: int = 1) -> DraftBudget:
        """long_max: the bound for long free drafts (a prediction), max(k_max, long_max) tokens. sharing: the
        requests decoding at once on this model, this one included (their passes merge: batching.py). Beside
        others the draft model stays idle: a merged pass already spends the compute a verify pass would have
        used for nothing, and its steps and extra tokens cost more than they save (measured: 2 requests at
        once, 16.8 tok/s with the draft model vs 18.1 without). Free drafters still draft, at the price a
        token costs in a merged pass (verify_price)."""
        k = min(self.k_max, room)
        self.room = room
        return DraftBudget(k, self, k_long=min(max(long_max or 0, self.k_max), room), sharing=sharing)

    def new_request(self, temperature: float = 0.0) -> None:
        """A new prompt: the draft model has just processed it (no catch-up), and this prompt's text may suit
        speculation better than the last one's, so an earlier backoff does not carry over: probe now, unless
        request-start probes keep finding nothing (then every 2nd, 4th, ... 16th request: a probe costs about
        one target step, 3% of a 30-token answer). The catch-up allowance starts again too (a share of this
        request's decode time, so no request pays for probes more than that share)."""
        self.backoff = 0
        self.probing = self.requests_to_skip == 0
        self.requests_to_skip = max(self.requests_to_skip - 1, 0)
        self.decode_time = self.catchup_time = 0.0
        self.regime = regime_of(temperature)
        self.req_alpha, self.req_key_alpha, self.req_first = {}, {}, {}

    def wants_draft_prefill(self, source: Optional[str], sharing: int = 1, *, behind: int = 0,
                            max_tokens: Optional[int] = None,
                            target_prefill: Optional[tuple[float, int]] = None,
                            draft_share: Optional[float] = None, prompt_ratio: Optional[float] = None) -> bool:
        """Should the paid drafter process the new prompt? Only if this request may draft: it starts with a
        probe, or the model says drafting pays, and no other request decodes beside it (sharing: see budget).
        Otherwise the prompt's prefill costs the draft model's share of time to first token for nothing (and
        later probes in this request find it too far behind). Nor where the `behind` tokens it would evaluate
        cost more than drafting could save over the request's `max_tokens`: at the expected acceptance, and
        when probing even with every draft accepted (an editor's code completion: ~500 new prompt tokens for
        a 30-token answer). target_prefill: (seconds, tokens) of the target's prefill of this prompt, and
        draft_share (the draft's weights over the target's), to price the draft model's before it was timed;
        prompt_ratio: its prompt cost per token over the target's as earlier processes measured it (better)."""
        if sharing > 1:
            return False
        if source is None:
            return True
        timed = 1 in self.target_cost
        if not timed and not (self.t1_prior and draft_share):
            return True  # nothing to price the savings with
        if behind > 0 and max_tokens is not None:
            cost = behind * self._draft_prefill_per_token(source, target_prefill, draft_share, prompt_ratio)
            alpha = 1.0 if self.probing else self.acceptance(source)
            if timed:
                gain = self._gain(source, alpha)
            else:  # a process's first request: T(1) as the cost profile measured it, a draft step at the
                # draft's share of the weights
                gain = self.t1_prior * self._gain(source, alpha, draft_step=draft_share)
            if cost > max_tokens * gain:
                return False
        if not timed or self.probing:
            return True
        return best_draft_length(self.acceptance(source), self.draft_step_cost(source), self.target_time,
                                 self.k_min, self.k_max) > 0

    def observe_draft_prefill(self, n_tokens: int, seconds: float) -> None:
        """The draft model processed a prompt's n_tokens in `seconds` (prices later prefills and catch-ups)."""
        if n_tokens >= 16:  # a few tokens cost more each (a pass's fixed costs): not a prefill's price
            self.catchup_per_token.update(seconds / n_tokens, self.rate)

    def _draft_prefill_per_token(self, source: str, target_prefill: Optional[tuple[float, int]],
                                 draft_share: Optional[float] = None,
                                 prompt_ratio: Optional[float] = None) -> float:
        """Seconds per token of the draft model's prompt processing: measured (prefills and catch-ups), else
        the target's just now scaled by the prompt costs' ratio an earlier process measured, or else by the step
        costs' ratio (or the weights', before a draft step was timed), which under-prices it; else 0 (unknown:
        no reason to skip)."""
        if self.catchup_per_token.weight:
            return self.catchup_per_token.value
        if target_prefill is None or target_prefill[1] < 16:
            return 0.0
        seconds, n = target_prefill
        if prompt_ratio:
            return seconds / n * prompt_ratio
        c = self.draft_step_cost(source)
        share = c / self.target_time(1) if c > 0 and self.target_time(1) > 0 else draft_share or 0.0
        return seconds / n * share

    def _catchup_affordable(self, source: str, behind: int) -> bool:
        """A probe after many plain steps makes the draft model prefill them all first; allow that only
        within catchup_share of the decode time so far (else probes cost a fixed share of every token)."""
        if behind <= 2:
            return True
        per_token = (self.catchup_per_token.value if self.catchup_per_token.weight
                     else 0.25 * self.draft_step_cost(source) or 0.05 * self.target_time(1))
        allowance = self.catchup_share * self.decode_time + 0.25 * self.target_time(1)
        if self.catchup_time + per_token * behind <= allowance:
            return True
        # Past that share the draft model would never catch up again in this request (a catch-up costs more
        # per token than the share grows per step), so one missed first probe would end drafting for good,
        # even where drafting usually pays (a code edit at T = 0.8: 15.6 tok/s after a miss, 20.6 after a hit).
        # While the long run across requests says drafting pays, a probe may spend up to one target step on it
        # (probes come at doubling intervals, and this request's misses pull the long run down), or, in a long
        # request, up to catchup_payback of what drafting at the long-run acceptance would save over the tokens
        # it has left (else one early backoff leaves the draft model too far behind for the rest of the request).
        if not self._long_run_pays(source):
            return False
        return per_token * behind <= max(self.target_time(1), self.catchup_payback * self.room * self._long_run_gain(source))

    def _long_run_pays(self, source: str) -> bool:
        """Does the source's acceptance over all requests (not this request's first-outcome record) make
        drafting pay?"""
        return self._long_run_gain(source) > 0

    def _long_run_gain(self, source: str) -> float:
        """Seconds per token that drafting with the best k saves over plain decoding, at the source's acceptance
        over all requests (0 where plain decoding wins)."""
        e = self.alpha.get(self._src(source))
        return self._gain(source, e.value if e else self.prior_alpha)

    def _gain(self, source: str, alpha: float, draft_step: Optional[float] = None) -> float:
        """Seconds per token that drafting with the best k saves over plain decoding at acceptance alpha (in
        units of T(1) before the target is timed, with draft_step the draft step's cost in those units)."""
        c = self.draft_step_cost(source) if draft_step is None else draft_step
        k = best_draft_length(alpha, c, self.target_time, self.k_min, self.k_max)
        if k == 0:
            return 0.0
        return max(self.target_time(1) - (k * c + self.target_time(k + 1)) / expected_tokens(alpha, k), 0.0)

    def _worth_a_look(self, source: str) -> bool:
        """After a request's first outcomes of a paid drafter, while there are few (1 to explore_outcomes - 1):
        could drafting pay at an optimistic estimate (one standard deviation above the blend, as from
        request_weight + outcomes samples)? Where the long run is low (a first request that did not suit the
        draft model, or translation before code), a request whose probe hit would otherwise be judged by the
        long run alone and decode plainly however well it copies (measured: adaptive drafted 2 tokens over
        9 prompts, one per category, after its first two requests missed)."""
        counts = self.req_alpha.get(self._src(source))
        outcomes = counts[1] if counts else 0
        if not 0 < outcomes < self.explore_outcomes:
            return False
        a = self.acceptance(source)
        optimistic = min(a + (a * (1.0 - a) / (self.request_weight + outcomes)) ** 0.5, 1.0)
        return best_draft_length(optimistic, self.draft_step_cost(source), self.target_time, self.k_min,
                                 self.k_max) > 0

    def _recent_spec_spt(self) -> float:
        """Seconds per token of the last guard_window speculative steps, all their time over all their tokens,
        leaving out the slowest step: one slow step (a process's first draft step pays page faults: 65 ms a token
        against 29 for plain steps) must not stop drafting that pays."""
        steps = list(self.recent_spec)
        if len(steps) > 2:
            steps.remove(max(steps, key=lambda st: st[0] / st[1]))
        return sum(t for t, _ in steps) / sum(n for _, n in steps)

    def draft_length(self, source: str, behind: int = 0) -> int:
        """Upper bound on k for a paid drafter this step (0: decode plainly). behind: its catch-up, in tokens."""
        c = self.draft_step_cost(source)
        self.last_was_probe = False
        forced = max(self.k_min, 1)
        if 1 not in self.target_cost:
            k = 0  # measure plain decoding's cost first: it is the bar speculation has to clear
        elif self.backoff > 0:
            self.backoff -= 1
            k = 0
            if self.backoff == 0:
                self.probing = True
        elif self.probing and not self._catchup_affordable(source, behind):
            k = 0  # too far behind: wait for the next request (its prompt is prefilled anyway)
            self.probing = False
            self.backoff = self.probe_interval
        elif self.probing:  # probe: speculate once with the best k > 0 to refresh the estimates; what follows
            # is the model's call with them (a forced run of fully accepted 1-token drafts after a probe lost
            # 4% of plain's time over the suite: at this CPU's costs a 1-token draft cannot pay)
            self.probing = False
            self.last_was_probe = self.after_probe = True
            k = max(best_draft_length(self.acceptance(source), c, self.target_time, forced, self.k_max), forced)
        else:
            k = best_draft_length(self.acceptance(source), c, self.target_time, self.k_min, self.k_max)
            if k == 0 and self._worth_a_look(source):
                k = forced  # measured as a probe: every proposal verified
                self.last_was_probe = True
            if self.after_probe:  # did the probe find speculation paying? then probe every request again
                self.after_probe = False
                self.request_probe_every = 1 if k else min(self.request_probe_every * 2, 16)
                self.requests_to_skip = self.request_probe_every - 1
            if k == 0:  # the model says plain decoding wins: stay plain for a while, then probe
                self.backoff = self.probe_interval
                self.probe_interval = min(self.probe_interval * 2, 256)
        self.history.append(k)
        if len(self.history) > 20_000:  # a long-lived server: keep the recent choices only
            del self.history[:10_000]
        return k

    def observe_shadow(self, source: str, key: str, accepted: bool) -> None:
        """A free drafter's proposal that was not verified, compared with what the target produced anyway."""
        self._update_key(source, key, accepted, shadow=True)

    def _update_key(self, source: str, key: str, accepted: bool, shadow: bool = False) -> None:
        e = self.key_alpha.get((self._src(source), key))
        if e is None:
            e = self.key_alpha[(self._src(source), key)] = _Ema(prior_acceptance(key), weight=2.0)
        e.update(1.0 if accepted else 0.0, self.alpha_rate)
        self._request_outcome((self._src(source), key), self.req_key_alpha, int(accepted), 1)
        if shadow:
            self._request_outcome(self._src(source), self.req_alpha, int(accepted), 1)

    def observe(self, source: str, n_drafted: int, n_accepted: int, draft_time: float, verify_time: float,
                n_emitted: int, *, keys: Optional[list] = None, paid: Optional[str] = None,
                draft_steps: Optional[int] = None, catchup_time: float = 0.0, catchup_tokens: int = 0,
                timed: bool = True) -> None:
        """One step's outcome. source: the drafter whose tokens were verified; keys: their confidence keys;
        paid: the paid drafter that ran (even if it proposed nothing), default `source` when it drafted;
        draft_steps: its forward passes (default n_drafted); catchup_*: its catch-up prefill (not in
        draft_time). timed=False: the step's times say nothing of this request's costs (its pass merged with
        other requests'): only the acceptances count."""
        n = n_drafted + 1
        self.decode_time += draft_time + verify_time + catchup_time
        if catchup_tokens > 0:
            self.catchup_time += catchup_time
            self.catchup_per_token.update(catchup_time / catchup_tokens, self.rate)
        if timed:
            self.target_cost.setdefault(n, _Cost(verify_time)).update(verify_time, self.rate)
        spt = (draft_time + verify_time) / max(n_emitted, 1)
        if paid is None and keys is None and n_drafted:
            paid = source  # the original call form: every drafted step was a paid one
        if paid is not None:
            self.paid_sources.add(paid)
        rejected = n_accepted < n_drafted
        if n_drafted:
            # the prior counts as two outcomes (as a bucket's does): a first miss alone would set it to 0, and
            # with it the model's say on drafting for many requests
            a = self.alpha.setdefault(self._src(source), _Ema(self.prior_alpha, weight=2.0))
            for _ in range(n_accepted):  # per-token acceptance: accepted / (accepted + rejections)
                a.update(1.0, self.alpha_rate)
            if rejected:
                a.update(0.0, self.alpha_rate)
            self._request_outcome(self._src(source), self.req_alpha, n_accepted, n_accepted + int(rejected))
        for i, key in enumerate(keys or ()):
            if i > n_accepted:
                break  # after a rejection nothing is known
            self._update_key(source, key, i < n_accepted)
        if paid is None:
            if n_drafted == 0 and timed:
                self.plain_spt.update(spt, self.rate)
            return
        if not timed:
            return
        steps = draft_steps if draft_steps is not None else max(n_drafted, 1)
        self.draft_cost.setdefault(paid, _Cost(0.0)).update(draft_time / max(steps, 1), self.rate)
        self.recent_spec.append((draft_time + verify_time, max(n_emitted, 1)))
        if (len(self.recent_spec) >= self.guard_window and self.plain_spt.weight
                and self._recent_spec_spt() > self.plain_spt.value):  # plain_spt: s per token of plain steps
            self.backoff = self.probe_interval  # speculation measurably loses: decode plainly for a while
            self.probe_interval = min(self.probe_interval * 2, 256)
            self.recent_spec.clear()
        elif len(self.recent_spec) >= self.guard_window:
            self.probe_interval = self.probe_after  # it pays again: forget earlier backoffs
