"""The drafter interface: propose up to k tokens that the target will verify in one pass."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from ..verify import SamplingParams


@dataclass
class Draft:
    tokens: list[int]  # [k] proposed token ids
    probs: Optional[np.ndarray]  # [k, V] the draft's q for each proposal, or None for a deterministic draft
    source: str  # which drafter produced it ("draft", "lookup", ...)
    catchup_time: float = 0.0  # seconds spent bringing the drafter's cache up to the context (a prefill)

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY = Draft([], None, "none")


class Drafter(ABC):
    """Proposes continuations of a context. Keeps whatever state it needs in sync by itself: `propose`
    receives the whole context, so a drafter with a KV cache rewinds to the common prefix on its own."""

    name: str = "drafter"

    @abstractmethod
    def propose(self, context: Sequence[int], k: int, params: SamplingParams,
                rng: np.random.Generator) -> Draft:
        """Up to k tokens continuing `context` (may return fewer, or none)."""

    def prepare(self, context: Sequence[int]) -> None:
        """Process the prompt before decoding starts (a draft model's prefill); optional."""

    def close(self) -> None:
        """Release resources (optional)."""
