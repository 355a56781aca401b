"""Composite drafting: prompt lookup first (free), the draft model when lookup has nothing worth verifying."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..policy import DraftBudget
from ..verify import SamplingParams
from .base import Draft, Drafter


class CompositeDrafter(Drafter):
    name = "draft+lookup"

    def __init__(self, first: Drafter, fallback: Drafter):
        self.first = first
        self.fallback = fallback

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator,
                budget: Optional[DraftBudget] = None) -> Draft:
        budget = budget or DraftBudget(k)
        draft = self.first.propose(context, k, params, rng, budget)
        if len(draft):
            return draft
        other = self.fallback.propose(context, k, params, rng, budget)
        if not len(other):
            other.shadow = other.shadow or draft.shadow  # still the proposal for the next position
        return other

    @property
    def paid(self) -> Optional[str]:
        return self.fallback.paid or self.first.paid

    def prepare(self, context: Sequence[int]) -> None:
        self.first.prepare(context)
        self.fallback.prepare(context)

    def close(self) -> None:
        self.first.close()
        self.fallback.close()
