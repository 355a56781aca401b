"""Prompt-lookup drafter (no model): copy what followed the most recent earlier occurrence of the context's
last n-gram (Saxena's prompt lookup decoding; llama.cpp's lookup). Deterministic, so it is verified as
q = one-hot and stays lossless at any temperature."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..errors import SettingsError
from ..verify import SamplingParams
from .base import Draft, Drafter


class LookupDrafter(Drafter):
    name = "lookup"

    def __init__(self, ngram_max: int = 4, ngram_min: int = 1, window: int = 4096):
        if not (1 <= ngram_min <= ngram_max):
            raise SettingsError(f"lookup n-gram sizes need 1 <= min <= max, got min={ngram_min} max={ngram_max}")
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self.window = window  # only the most recent `window` tokens are searched

    def propose(self, context: Sequence[int], k: int, params: SamplingParams = None,
                rng: np.random.Generator = None) -> Draft:
        return Draft(self.lookup(context, k), None, self.name)

    def lookup(self, context: Sequence[int], k: int) -> list[int]:
        """Continuation (<= k tokens) of the most recent earlier match of the longest suffix n-gram."""
        if k <= 0:
            return []
        ctx = np.asarray(context[-self.window:], dtype=np.int64)  # [L]
        L = len(ctx)
        for n in range(min(self.ngram_max, L - 1), self.ngram_min - 1, -1):
            suffix = ctx[L - n:]
            windows = sliding_window_view(ctx[: L - 1], n)  # [L-n, n]: starts 0..L-n-1 (excludes the suffix itself)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent match; copy what followed it
                return ctx[start : start + k].tolist()
        return []
