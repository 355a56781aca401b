"""Prompt-lookup drafter (no model): copy what followed the most recent earlier occurrence of the context's
last n-gram (Saxena's prompt lookup decoding; llama.cpp's lookup). Deterministic, so it is verified as
q = one-hot and stays lossless at any temperature. Its confidence is the matched n-gram's length."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..errors import SettingsError
from ..policy import DraftBudget, ngram_key
from ..verify import SamplingParams
from .base import Draft, Drafter


class LookupDrafter(Drafter):
    name = "lookup"
    free = True

    def __init__(self, ngram_max: int = 4, ngram_min: Optional[int] = None, window: int = 4096):
        """ngram_min: default 2 (1 when ngram_max is 1): a single matching token predicted little (17-24%
        acceptance on the suite), and costs a verification slot whenever the policy trusts its bucket."""
        if ngram_min is None:
            ngram_min = min(2, ngram_max)
        if not (1 <= ngram_min <= ngram_max):
            raise SettingsError(f"lookup n-gram sizes need 1 <= min <= max, got min={ngram_min} max={ngram_max}")
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self.window = window  # only the most recent `window` tokens are searched

    def propose(self, context: Sequence[int], k: int, params: SamplingParams = None,
                rng: np.random.Generator = None, budget: Optional[DraftBudget] = None) -> Draft:
        budget = budget or DraftBudget(k)
        k = budget.start(self.name, free=True)
        tokens, n = self.match(context, k)
        keys = [ngram_key(n, i == 0) for i in range(len(tokens))]
        return self.budgeted(tokens, keys, budget)

    def lookup(self, context: Sequence[int], k: int) -> list[int]:
        """Continuation (<= k tokens) of the most recent earlier match of the longest suffix n-gram."""
        return self.match(context, k)[0]

    def match(self, context: Sequence[int], k: int) -> tuple[list[int], int]:
        """(continuation, matched n-gram length); ([], 0) when nothing matches."""
        if k <= 0:
            return [], 0
        ctx = np.asarray(context[-self.window:], dtype=np.int64)  # [L]
        L = len(ctx)
        for n in range(min(self.ngram_max, L - 1), self.ngram_min - 1, -1):
            suffix = ctx[L - n:]
            windows = sliding_window_view(ctx[: L - 1], n)  # [L-n, n]: starts 0..L-n-1 (excludes the suffix itself)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent match; copy what followed it
                return ctx[start : start + k].tolist(), n
        return [], 0
