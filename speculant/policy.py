"""How many tokens to draft each step, and whether to draft at all.

FixedPolicy drafts k every step. AdaptivePolicy measures online what matters and picks, each step, the k
that maximizes expected tokens per second (Leviathan et al.'s model with measured costs):

    E[tokens | k] = (1 - a^(k+1)) / (1 - a)          a: per-token acceptance of this drafter
    time(k)       = k * c + T(k + 1)                 c: one draft step; T(n): one target pass over n tokens

T(n) is measured per n (on a GPU it is nearly flat, with llama.cpp on a CPU it grows with n); k = 0 is plain
decoding (E = 1, time = T(1)). As a guard against a wrong model, it also compares the realized seconds per
token of speculative steps with plain steps; when speculation loses it decodes plainly for a while and
probes again later (backing off exponentially while it keeps losing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


class FixedPolicy:
    """Draft exactly k tokens every step (bounded by the room left)."""

    adaptive = False

    def __init__(self, k: int):
        self.k = k

    def draft_length(self, source: str) -> int:
        return self.k

    def observe(self, source: str, n_drafted: int, n_accepted: int, draft_time: float, verify_time: float,
                n_emitted: int) -> None:
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
class AdaptivePolicy:
    k_max: int = 8
    k_min: int = 1
    rate: float = 0.1  # EMA rate of the cost estimates
    alpha_rate: float = 0.03  # EMA rate of acceptance, per drafted token (about the last 30 tokens)
    prior_alpha: float = 0.6
    guard_window: int = 8  # speculative steps compared against plain before backing off
    probe_after: int = 8  # plain steps before speculation is tried again (doubles while it keeps losing)
    adaptive: bool = field(default=True, init=False)

    def __post_init__(self):
        if not (0 <= self.k_min <= self.k_max):
            raise SettingsError(f"need 0 <= --draft-min <= --draft-max, got {self.k_min} and {self.k_max}")
        self.alpha: dict[str, _Ema] = {}
        self.draft_cost: dict[str, _Ema] = {}  # seconds per drafted token
        self.target_cost: dict[int, _Ema] = {}  # n tokens -> seconds of one target pass
        self.spec_spt = _Ema(0.0)  # realized seconds per emitted token, speculative steps
        self.plain_spt = _Ema(0.0)  # same, plain steps
        self.backoff = 0  # plain steps still to take before probing again
        self.probe_interval = self.probe_after
        self.recent_spec_steps = 0
        self.probing = False
        self.history: list[int] = []  # k chosen each step (the most recent ones)

    # -- estimates ---------------------------------------------------------------------------------------
    def target_time(self, n: int) -> float:
        """T(n): measured where possible, else linear through the measured points (prior: 0.5 T(1) per token)."""
        measured = {m: e.value for m, e in self.target_cost.items() if e.weight > 0}
        if n in measured:
            return measured[n]
        if not measured:
            return 1.0 + 0.5 * (n - 1)  # unit-free prior, only relative costs matter before any measurement
        pts = sorted(measured.items())
        if len(pts) == 1:
            (m, t), = pts
            per_token = t / (1.0 + 0.5 * (m - 1))
            return per_token * (1.0 + 0.5 * (n - 1))
        lo = max([p for p in pts if p[0] < n], default=pts[0], key=lambda p: p[0])
        hi = min([p for p in pts if p[0] > n], default=pts[-1], key=lambda p: p[0])
        if lo[0] == hi[0]:
            lo, hi = pts[-2], pts[-1]
        slope = max((hi[1] - lo[1]) / (hi[0] - lo[0]), 0.0)
        return max(lo[1] + slope * (n - lo[0]), 1e-6)

    def acceptance(self, source: str) -> float:
        e = self.alpha.get(source)
        return e.value if e else self.prior_alpha

    # -- decisions -----------------------------------------------------------------------------------------
    def draft_length(self, source: str) -> int:
        cost = self.draft_cost.get(source)
        c = cost.value if cost else 0.0
        if 1 not in self.target_cost:
            k = 0  # measure plain decoding's cost first: it is the bar speculation has to clear
        elif self.backoff > 0:
            self.backoff -= 1
            k = 0
            if self.backoff == 0:
                self.probing = True
        elif self.probing:  # probe: speculate once with the best k > 0 to refresh the estimates
            self.probing = False
            k = best_draft_length(self.acceptance(source), c, self.target_time, max(self.k_min, 1), self.k_max)
            k = max(k, max(self.k_min, 1))
        else:
            k = best_draft_length(self.acceptance(source), c, self.target_time, self.k_min, self.k_max)
            if k == 0:  # the model says plain decoding wins: stay plain for a while, then probe
                self.backoff = self.probe_interval
                self.probe_interval = min(self.probe_interval * 2, 256)
        self.history.append(k)
        if len(self.history) > 20_000:  # a long-lived server: keep the recent choices only
            del self.history[:10_000]
        return k

    def observe(self, source: str, n_drafted: int, n_accepted: int, draft_time: float, verify_time: float,
                n_emitted: int) -> None:
        n = n_drafted + 1
        self.target_cost.setdefault(n, _Ema(verify_time)).update(verify_time, self.rate)
        spt = (draft_time + verify_time) / max(n_emitted, 1)
        if n_drafted == 0:
            self.plain_spt.update(spt, self.rate)
            return
        self.draft_cost.setdefault(source, _Ema(0.0)).update(draft_time / n_drafted, self.rate)
        # per-token acceptance, MLE of a geometric law truncated at n_drafted: accepted / (accepted + rejections)
        rejected = 1 if n_accepted < n_drafted else 0
        a = self.alpha.setdefault(source, _Ema(self.prior_alpha))
        for _ in range(n_accepted):
            a.update(1.0, self.alpha_rate)
        for _ in range(rejected):
            a.update(0.0, self.alpha_rate)
        self.spec_spt.update(spt, self.rate)
        self.recent_spec_steps += 1
        if (self.recent_spec_steps >= self.guard_window and self.plain_spt.weight
                and self.spec_spt.value > self.plain_spt.value):  # plain_spt: seconds per token of plain steps
            self.backoff = self.probe_interval  # speculation measurably loses: decode plainly for a while
            self.probe_interval = min(self.probe_interval * 2, 256)
            self.recent_spec_steps = 0
            self.spec_spt = _Ema(0.0)
        elif self.recent_spec_steps >= self.guard_window:
            self.probe_interval = self.probe_after  # it pays again: forget earlier backoffs
