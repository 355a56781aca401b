"""The drafter interface: propose up to k tokens that the target will verify in one pass."""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np

from ..verify import SamplingParams

if TYPE_CHECKING:
    from ..policy import DraftBudget


@dataclass
class Shadow:
    """A free drafter's proposal for the position after the draft, not verified: the engine compares it with
    the token the target produces there, so the acceptance of unverified proposals is measured at no cost."""

    source: str
    key: str
    token: int


@dataclass
class Draft:
    tokens: list[int]  # [k] proposed token ids
    probs: Optional[np.ndarray]  # [k, V] the draft's q for each proposal (a torch tensor left on the device by a
    # static draft: draft_steps), or None for a deterministic draft
    source: str  # which drafter produced it ("draft", "lookup", ...)
    catchup_time: float = 0.0  # seconds spent bringing the drafter's cache up to the context (a prefill)
    catchup_tokens: int = 0  # tokens processed by that catch-up
    keys: list[str] = field(default_factory=list)  # [k] the draft's confidence bucket for each token
    steps: int = 0  # paid draft steps (forward passes of a draft model) this proposal took
    paid: Optional[str] = None  # the paid drafter that ran, even if it proposed nothing
    shadows: list[Shadow] = field(default_factory=list)  # free proposals for the position after the draft

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY = Draft([], None, "none")


class Drafter(ABC):
    """Proposes continuations of a context. Keeps whatever state it needs in sync by itself: `propose`
    receives the whole context, so a drafter with a KV cache rewinds to the common prefix on its own."""

    name: str = "drafter"
    free: bool = False  # proposing costs (next to) nothing, e.g. prompt lookup

    @property
    def paid(self) -> Optional[str]:
        """The source name of the paid drafter (a model) this drafter runs, or None when it runs none."""
        return None if self.free else self.name

    @abstractmethod
    def propose(self, context: Sequence[int], k: int, params: SamplingParams,
                rng: np.random.Generator, budget: Optional["DraftBudget"] = None) -> Draft:
        """Up to k tokens continuing `context` (may return fewer, or none). With a budget, the budget decides
        token by token how far to go (see policy.DraftBudget)."""

    def prepare(self, context: Sequence[int], should_stop: Optional[Callable[[], bool]] = None) -> None:
        """Process the prompt before decoding starts (a draft model's prefill); optional. should_stop: asked
        between its passes; True stops it with errors.Cancelled (the request was cancelled)."""

    def prepare_cost(self, context: Sequence[int]) -> int:
        """How many tokens `prepare(context)` would evaluate with a model (0 for a free drafter)."""
        return 0

    def begin(self, context: Sequence[int]) -> None:
        """A request starts with this prompt (always called, unlike prepare); optional."""

    def end(self, context: Sequence[int]) -> None:
        """The request ended with this context (prompt + output, however it ended); optional."""

    constraint = None  # the request's grammar (constraint.Constraint), when it has one

    def constrain(self, constraint) -> None:
        """The request's constraint (constraint.Constraint, live: the engine advances it by every emitted
        token), or None. Drafters follow it: a draft it forbids would only be rejected."""
        self.constraint = constraint

    def allowed_prefix(self, tokens: Sequence[int]) -> int:
        """How many of these proposed tokens the request's grammar allows in a row (all without one)."""
        if self.constraint is None or not len(tokens):
            return len(tokens)
        state = self.constraint.fork()
        for i, token in enumerate(tokens):
            if not state.allowed([token])[0]:
                return i
            if token in state.eog:
                return i + 1
            state.accept(int(token))
        return len(tokens)

    def budgeted(self, tokens: Sequence[int], keys: Sequence[str], budget: "DraftBudget") -> Draft:
        """A free drafter's proposal (tokens [n], their confidence keys [n]) as a Draft: cut where the grammar
        forbids a token, then where the budget refuses one; the first refused token becomes a shadow, so its
        acceptance is still measured."""
        cut = self.allowed_prefix(tokens)
        tokens, keys = list(tokens[:cut]), list(keys[:cut])
        for i, key in enumerate(keys):
            if not budget.take(self.name, key):
                return Draft(tokens[:i], None, self.name, keys=keys[:i],
                             shadows=[Shadow(self.name, key, tokens[i])])
        return Draft(tokens, None, self.name, keys=keys)

    def for_slot(self, i: int) -> "Drafter":
        """The drafter for concurrent request slot i (backends: Backend.slot): a copy of its own (a request's
        constraint is per slot); drafters with models or caches make theirs."""
        return self if i == 0 else copy.copy(self)

    def share_cache(self, source: "Drafter", context: Sequence[int]) -> None:
        """Take the prompt cache of the same drafter on another slot (source), where it holds more of
        `context` (Backend.copy_prefix); optional."""

    def close(self) -> None:
        """Release resources (optional)."""
