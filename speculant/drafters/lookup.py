"""Prompt-lookup drafter (no model): copy what followed the most recent earlier occurrence of the context's
last n-gram (Saxena's prompt lookup decoding; llama.cpp's lookup). Deterministic, so it is verified as
q = one-hot and stays lossless at any temperature. Its confidence is the matched n-gram's length."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..errors import SettingsError
from ..policy import DraftBudget, ngram_key, run_key
from ..verify import SamplingParams
from .base import Draft, Drafter


LONG_RUN = 8  # a copy that has followed its source this long drafts like a prediction (long, run-keyed)
RUN_CAP = 64  # runs are measured up to this many tokens (the last confidence bucket)


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
        # a long verbatim copy in progress (the output quoting its prompt: a code edit, a cited passage) may draft
        # as far as a prediction may (budget.k_long); its tokens' confidence is then the run so far
        ctx, n, start = self._source(context)
        run = _run(ctx, start) if n else 0
        k = budget.start(self.name, free=True, long=run >= LONG_RUN)
        tokens = ctx[start : start + k].tolist() if n and k > 0 else []
        keys = [run_key(run + i) if run >= LONG_RUN else ngram_key(n, i == 0) for i in range(len(tokens))]
        return self.budgeted(tokens, keys, budget)

    def lookup(self, context: Sequence[int], k: int) -> list[int]:
        """Continuation (<= k tokens) of the most recent earlier match of the longest suffix n-gram."""
        return self.match(context, k)[0]

    def run(self, context: Sequence[int]) -> int:
        """How many tokens the context's end agrees with the text before the source it would copy (the match
        extended back, up to RUN_CAP); 0 when nothing matches."""
        ctx, n, start = self._source(context)
        return _run(ctx, start) if n else 0

    def match(self, context: Sequence[int], k: int) -> tuple[list[int], int]:
        """(continuation, matched n-gram length); ([], 0) when nothing matches."""
        if k <= 0:
            return [], 0
        ctx, n, start = self._source(context)
        return (ctx[start : start + k].tolist(), n) if n else ([], 0)

    def _source(self, context: Sequence[int]) -> tuple[np.ndarray, int, int]:
        """(the searched context [L], matched n-gram length, where the continuation starts); n = 0: no match."""
        ctx = np.asarray(context[-self.window:], dtype=np.int64)  # [L]
        L = len(ctx)
        for n in range(min(self.ngram_max, L - 1), self.ngram_min - 1, -1):
            suffix = ctx[L - n:]
            windows = sliding_window_view(ctx[: L - 1], n)  # [L-n, n]: starts 0..L-n-1 (excludes the suffix itself)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                return ctx, n, int(hits[-1]) + n  # the most recent match; copy what followed it
        return ctx, 0, 0


def _run(ctx: np.ndarray, start: int) -> int:
    """The common length (up to RUN_CAP) of ctx's end [L] and the tokens before ctx[start]."""
    src = ctx[max(start - RUN_CAP, 0):start][::-1]  # backwards from the copy's source
    own = ctx[max(len(ctx) - RUN_CAP, 0):][::-1]  # backwards from the context's end
    m = min(len(src), len(own))
    differ = np.flatnonzero(src[:m] != own[:m])
    return int(differ[0]) if differ.size else m
