"""Speculation statistics, carried by every generate call, CLI run, server response and benchmark row."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence


@dataclass
class SpecStats:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of those, kept in the target's cache from an earlier request (not evaluated)
    generated_tokens: int = 0
    ended_by_eog: bool = False  # the last target call produced an end-of-generation token (not in the text)
    drafted: int = 0  # draft tokens sent to verification
    accepted: int = 0  # of those, accepted
    target_calls: int = 0  # target passes during decoding (prefill excluded)
    drafted_by_position: list[int] = field(default_factory=list)  # [i] drafts made at draft position i
    accepted_by_position: list[int] = field(default_factory=list)  # [i] of those, accepted
    accepted_by_source: Counter = field(default_factory=Counter)  # drafter name -> accepted tokens
    drafted_by_source: Counter = field(default_factory=Counter)  # drafter name -> tokens sent to verification
    draft_lengths: list[int] = field(default_factory=list)  # k of each step, in order
    # "source:confidence key" -> [drafted, accepted]; after a rejection later tokens count as neither
    by_confidence: dict = field(default_factory=dict)
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    decode_time: float = 0.0  # wall time from the end of prefill to the last token
    peak_rss_mb: float = 0.0  # the process's peak resident set so far (VmHWM), model loading included
    model_memory_mb: dict = field(default_factory=dict)  # role -> the memory plan's estimate for that model
    exact_numerics: bool = True  # False: the target's runtime cannot promise bit-identical batched logits

    def record_step(self, source: str, n_drafted: int, n_accepted: int, draft_time: float = 0.0,
                    verify_time: float = 0.0, keys: Sequence[str] = ()) -> None:
        self.target_calls += 1
        self.draft_time += draft_time
        self.verify_time += verify_time
        self.draft_lengths.append(n_drafted)
        self._tally(source, n_drafted, n_accepted, keys, 1)

    def end_inside_step(self, source: str, n_drafted: int, n_accepted: int, keys: Sequence[str], taken: int) -> None:
        """The output ended at the last recorded step's token `taken` (counted from 1, taken <= n_accepted: an
        end-of-generation token or a stop string among its accepted drafts): count only the drafts it took, not
        those accepted past its end."""
        self._tally(source, n_drafted, n_accepted, keys, -1)
        self._tally(source, taken, taken, keys[:taken], 1)
        self.draft_lengths[-1] = taken
        while self.drafted_by_position and not self.drafted_by_position[-1]:  # positions no step drafted at
            del self.drafted_by_position[-1], self.accepted_by_position[-1]

    def _tally(self, source: str, n_drafted: int, n_accepted: int, keys: Sequence[str], sign: int) -> None:
        self.drafted += sign * n_drafted
        self.accepted += sign * n_accepted
        grow = n_drafted - len(self.drafted_by_position)
        if grow > 0:
            self.drafted_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for i in range(n_drafted):
            self.drafted_by_position[i] += sign
        for i in range(n_accepted):
            self.accepted_by_position[i] += sign
        for counter, n in ((self.drafted_by_source, n_drafted), (self.accepted_by_source, n_accepted)):
            if n:
                counter[source] += sign * n
                if not counter[source]:
                    del counter[source]
        for i, key in enumerate(keys[: n_accepted + 1]):
            cell = self.by_confidence.setdefault(f"{source}:{key}", [0, 0])
            cell[0] += sign
            cell[1] += sign * (i < n_accepted)
            if cell == [0, 0]:
                del self.by_confidence[f"{source}:{key}"]

    @property
    def acceptance_rate(self) -> Optional[float]:
        """accepted / drafted; None when nothing was drafted (not 0: nothing was rejected either)."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def produced_tokens(self) -> int:
        """Tokens the target calls produced: the generated ones and an end-of-generation token."""
        return self.generated_tokens + self.ended_by_eog

    @property
    def mean_accepted_length(self) -> Optional[float]:
        """τ: tokens produced per target call, counting the target's own (recovered or bonus) token, so
        >= 1 (1 for plain decoding); None before the first call. The one definition, also in /metrics and bench."""
        return self.produced_tokens / self.target_calls if self.target_calls else None

    @property
    def plain_steps(self) -> int:
        """Target calls that verified no draft (plain decoding steps, e.g. where the adaptive policy chose k = 0)."""
        return self.draft_lengths.count(0)

    @property
    def tokens_per_s(self) -> float:
        """Generation speed: generated tokens over decode time (prefill excluded)."""
        return self.generated_tokens / self.decode_time if self.decode_time > 0 else 0.0

    def summary(self, speculative: bool, speed: bool = True) -> str:
        """One line for people: counts, never a rate of nothing ("acceptance 0%" would read as all rejected)."""
        parts = [f"{self.generated_tokens} tokens, {self.tokens_per_s:.2f} tokens/s"] if speed else []
        if not speculative:
            parts.append(f"plain decoding, {self.target_calls} target calls")
        else:
            rate = f" ({self.acceptance_rate:.1%})" if self.drafted else ""
            tau = f"τ {self.mean_accepted_length:.2f} over " if self.target_calls else ""
            plain = self.plain_steps
            parts.append(f"drafted {self.drafted}, accepted {self.accepted}{rate}, {tau}{self.target_calls} target "
                         f"calls" + (f" ({plain} decoded plainly)" if plain else ""))
        return ", ".join(parts)

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": _round(self.acceptance_rate),
            "acceptance_by_position": [round(x, 4) for x in self.acceptance_by_position],
            "mean_accepted_length": _round(self.mean_accepted_length),
            "ended_by_eog": self.ended_by_eog,
            "target_calls": self.target_calls,
            "plain_steps": self.plain_steps,
            "accepted_by_source": dict(self.accepted_by_source),
            "drafted_by_source": dict(self.drafted_by_source),
            "mean_draft_length": round(sum(self.draft_lengths) / len(self.draft_lengths), 3)
            if self.draft_lengths else 0.0,
            "draft_length_histogram": {str(k): n for k, n in sorted(Counter(self.draft_lengths).items())},
            "acceptance_by_confidence": {k: {"drafted": d, "accepted": a, "rate": round(a / d, 4)}
                                         for k, (d, a) in sorted(self.by_confidence.items())},
            "prefill_s": round(self.prefill_time, 4),
            "draft_s": round(self.draft_time, 4),
            "verify_s": round(self.verify_time, 4),
            "decode_s": round(self.decode_time, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "peak_rss_mb": round(self.peak_rss_mb, 1),
            "model_memory_mb": self.model_memory_mb,
            "exact_numerics": self.exact_numerics,
        }


def _round(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 4)
