"""Composite drafting: prompt lookup first (free), the draft model when lookup finds nothing."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..verify import SamplingParams
from .base import Draft, Drafter


class CompositeDrafter(Drafter):
    name = "draft+lookup"

    def __init__(self, first: Drafter, fallback: Drafter, min_first: int = 1):
        self.first = first
        self.fallback = fallback
        self.min_first = min_first  # take the first drafter's proposal when it has at least this many tokens

    def propose(self, context: Sequence[int], k: int, params: SamplingParams, rng: np.random.Generator) -> Draft:
        draft = self.first.propose(context, k, params, rng)
        if len(draft) >= self.min_first:
            return draft
        return self.fallback.propose(context, k, params, rng)

    def prepare(self, context: Sequence[int]) -> None:
        self.first.prepare(context)
        self.fallback.prepare(context)

    def close(self) -> None:
        self.first.close()
        self.fallback.close()
