"""Prediction drafter (OpenAI's "Predicted Outputs"): the request brings text the output will mostly repeat
(the file being edited, a document being quoted), and the drafter proposes the prediction's continuation
from where the output is aligned with it.

Alignment: `j` is the prediction index the output continues at. Each generated token that equals
prediction[j] moves j on (the output "tracks" the prediction). A token that differs loses the alignment;
from then on, after every generated token, the drafter re-anchors: it looks for the output's latest n-gram
(n = ngram_max down to ngram_min; the longest found wins) in the prediction, and among equally long matches
takes the one nearest to where the output would be had the difference been a substitution (`expected`: the
lost position plus the tokens generated since). So an edit in the middle of a file costs a few plain steps
and copying resumes right after it (an insertion, a deletion or a change alike).

Its confidence is how long the output has agreed with the prediction at the current alignment (`run`, for a
drafted token counting the drafted tokens before it; policy.run_key buckets it), so the adaptive policy
learns that a prediction the output has followed for 30 tokens is nearly certain and one just re-anchored on
a bigram is not: drafts grow long (up to the engine's long_max) while it tracks, and stop at once when it is
useless. A deterministic draft, verified as q = one-hot: lossless at any temperature.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from ..errors import SettingsError
from ..policy import DraftBudget, run_key
from ..verify import SamplingParams
from .base import Draft, Drafter


class PredictionDrafter(Drafter):
    name = "prediction"
    free = True

    def __init__(self, prediction: Sequence[int], start: int, ngram_min: int = 2, ngram_max: int = 8):
        """prediction: the predicted output's token ids; start: where the output begins in the contexts that
        propose() will see (the prompt's length)."""
        if not (1 <= ngram_min <= ngram_max):
            raise SettingsError(f"prediction re-anchoring needs 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.pred = np.asarray(list(prediction), dtype=np.int64)  # [P]
        self.start = start
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.seen = start  # context tokens taken into account so far
        self.j: Optional[int] = 0  # the prediction index the output continues at; None: not aligned
        self.run = 0  # tokens the output has agreed with the prediction at this alignment
        self.expected = 0  # where in the prediction the output would be, were every difference a substitution
        self.output: list[int] = []  # the generated tokens (the context after `start`)

    # -- alignment -------------------------------------------------------------------------------------------
    def update(self, context: Sequence[int]) -> None:
        """Take in the tokens generated since the last call (accepted tokens only: the context never shrinks
        within a request)."""
        for t in context[self.seen:]:
            t = int(t)
            self.output.append(t)
            if self.j is not None and self.j < len(self.pred) and self.pred[self.j] == t:
                self.j += 1
                self.run += 1
                self.expected = self.j
            else:
                self.expected += 1
                self.j, self.run = None, 0
                self.reanchor()
        self.seen = max(self.seen, len(context))

    def reanchor(self) -> None:
        """Align the output's latest n-gram with the prediction: the longest match (up to ngram_max), the
        nearest to `expected` among equally long ones. Leaves j = None when nothing of ngram_min matches."""
        out, pred = self.output, self.pred
        if len(out) < self.ngram_min or not len(pred):
            return
        ends = np.flatnonzero(pred == out[-1])  # candidate positions of the n-gram's last token
        length = 1
        longest = min(self.ngram_max, len(out))
        while length < longest and ends.size:
            prev = ends - length
            ok = prev >= 0
            ok[ok] = pred[prev[ok]] == out[-1 - length]
            if not ok.any():
                break
            ends = ends[ok]
            length += 1
        if length < self.ngram_min or not ends.size:
            return
        best = ends[np.argmin(np.abs(ends + 1 - self.expected))]  # ties: the earlier one
        self.j = int(best) + 1
        self.run = length
        self.expected = self.j

    # -- drafting --------------------------------------------------------------------------------------------
    def proposal(self, k: int) -> tuple[list[int], list[str]]:
        """The next k tokens of the prediction from the alignment, with their confidence keys."""
        if self.j is None or k <= 0:
            return [], []
        tokens = self.pred[self.j:self.j + k].tolist()
        return tokens, [run_key(self.run + i) for i in range(len(tokens))]

    def propose(self, context: Sequence[int], k: int, params: SamplingParams = None,
                rng: np.random.Generator = None, budget: Optional[DraftBudget] = None) -> Draft:
        budget = budget or DraftBudget(k)
        self.update(context)
        if self.j is None or self.j >= len(self.pred):
            return Draft([], None, self.name)
        tokens, keys = self.proposal(budget.start(self.name, free=True, long=True))
        return self.budgeted(tokens, keys, budget)
