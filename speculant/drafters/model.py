"""Draft model drafter: a small model of the same family proposes k tokens, one forward pass each."""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from ..backends.base import Backend
from ..verify import SamplingParams, probs_from_logits, sample
from .base import Draft, Drafter


class ModelDrafter(Drafter):
    name = "draft"

    def __init__(self, backend: Backend, n_vocab_target: int, p_min: float = 0.0):
        self.backend = backend
        self.n_vocab_target = n_vocab_target  # the draft's logits are cut or padded to the target's ids
        self.p_min = p_min  # stop drafting once the draft's own probability for its token falls below this

    def _fit(self, logits: np.ndarray) -> np.ndarray:
        n = self.n_vocab_target
        if logits.shape[-1] == n:
            return logits
        if logits.shape[-1] > n:
            return logits[..., :n]
        return np.concatenate([logits, np.full(logits.shape[:-1] + (n - logits.shape[-1],), -np.inf,
                                               dtype=logits.dtype)], axis=-1)

    def propose(self, context: Sequence[int], k: int, params: SamplingParams,
                rng: np.random.Generator) -> Draft:
        tokens: list[int] = []
        probs: list[np.ndarray] = []
        if k <= 0:
            return Draft(tokens, None, self.name)
        room = self.backend.n_ctx - len(context)
        k = min(k, room + 1)
        t0 = time.perf_counter()
        behind = len(context) - len(self.backend.tokens)
        logits = self._fit(self.backend.sync(context)[0])  # [V]
        # more than the usual one or two new tokens: a prefill (new prompt, or after plain steps)
        catchup_time = time.perf_counter() - t0 if behind > 2 else 0.0
        for i in range(k):
            if params.greedy:
                token = int(np.argmax(logits))
                if self.p_min > 0.0:
                    z = logits - logits[token]
                    if 1.0 / np.exp(z.astype(np.float64)).sum() < self.p_min:
                        break
            else:
                q = probs_from_logits(logits, params)
                # the cut-off looks at the draft's confidence, never at the sampled token: proposals must
                # stay exact samples of q for the rejection test to be lossless
                if self.p_min > 0.0 and q.max() < self.p_min:
                    break
                token = sample(q, rng)
                probs.append(q)
            tokens.append(token)
            if i + 1 < k:
                logits = self._fit(self.backend.eval([token])[0])
        return Draft(tokens, np.stack(probs) if probs else None, self.name, catchup_time)

    def prepare(self, context: Sequence[int]) -> None:
        self.backend.sync(context[:-1], n_logits=0)  # the prompt, as for the target: part of the prefill

    def close(self) -> None:
        self.backend.close()
