"""Composite drafting: drafters in order of cost, the first one with something worth verifying wins.

The usual chain is prediction (the request's predicted output) -> history (suffix structure over the prompt
and earlier outputs) or prompt lookup -> the draft model. Every drafter's tokens pass the same per-token
budget (policy.DraftBudget), each under its own source and confidence key, so the adaptive policy scores each
proposal by what that source and bucket have measured; a free drafter whose first token is not worth
verifying leaves the budget untouched for the next one. The winning draft's source is what the stats credit
(accepted_by_source)."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..policy import DraftBudget
from ..verify import SamplingParams
from .base import Draft, Drafter


class CompositeDrafter(Drafter):
    name = "draft+lookup"

    def __init__(self, first: Drafter, *rest: Drafter):
        self.drafters = [first, *rest]
        self.name = "+".join(d.name for d in self.drafters)

    @property
    def first(self) -> Drafter:
        return self.drafters[0]

    @property
    def fallback(self) -> Drafter:
        return self.drafters[-1]

    @property
    def free(self) -> bool:
        return all(d.free for d in self.drafters)

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator,
                budget: Optional[DraftBudget] = None) -> Draft:
        budget = budget or DraftBudget(k)
        shadows = []  # proposals for the first position that were not verified: still scored
        draft = None
        for d in self.drafters:
            draft = d.propose(context, k, params, rng, budget)
            if len(draft):
                return draft
            shadows += draft.shadows
        draft.shadows = shadows
        return draft

    @property
    def paid(self) -> Optional[str]:
        return next((d.paid for d in reversed(self.drafters) if d.paid), None)

    def for_slot(self, i: int) -> "CompositeDrafter":
        return self if i == 0 else CompositeDrafter(*(d.for_slot(i) for d in self.drafters))

    def prepare(self, context: Sequence[int], should_stop=None) -> None:
        for d in self.drafters:
            d.prepare(context, should_stop)

    def prepare_cost(self, context: Sequence[int]) -> int:
        return sum(d.prepare_cost(context) for d in self.drafters)

    def share_cache(self, source: Drafter, context: Sequence[int]) -> None:
        if isinstance(source, CompositeDrafter) and len(source.drafters) == len(self.drafters):
            for mine, theirs in zip(self.drafters, source.drafters):
                mine.share_cache(theirs, context)

    def begin(self, context: Sequence[int]) -> None:
        for d in self.drafters:
            d.begin(context)

    def end(self, context: Sequence[int]) -> None:
        for d in self.drafters:
            d.end(context)

    def constrain(self, constraint) -> None:
        self.constraint = constraint
        for d in self.drafters:
            d.constrain(constraint)

    def close(self) -> None:
        for d in self.drafters:
            d.close()
