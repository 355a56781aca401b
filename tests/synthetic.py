"""Tiny synthetic models for fast, exact tests: a Markov table over a small vocabulary behind the real
Backend interface. Logits depend on the two previous tokens *as held in the backend's own cache*, so any
bookkeeping error of the engine (a missed rewind, a stale token) changes what the model says."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from speculant.backends.base import Backend, VocabInfo


class TableBackend(Backend):
    def __init__(self, n_vocab: int = 8, seed: int = 0, sharpness: float = 2.0, n_ctx: int = 256,
                 eos: Optional[int] = None, texts: Optional[list[bytes]] = None):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.name = f"table-{seed}"
        self.n_vocab = n_vocab
        self.n_ctx = n_ctx
        self.table = (rng.standard_normal((n_vocab, n_vocab, n_vocab)) * sharpness).astype(np.float32)
        self.eos = eos
        self.texts = texts or [f"<{i}>".encode() for i in range(n_vocab)]
        self.calls = 0  # forward passes, for structural tests

    def logits_after(self, history: Sequence[int]) -> np.ndarray:
        a = history[-1] if len(history) >= 1 else 0
        b = history[-2] if len(history) >= 2 else 0
        return self.table[b, a]

    def _decode(self, tokens, start, n_logits):
        self.calls += 1
        history = self.tokens[:start]
        rows = []
        for t in tokens:
            history = history + [int(t)]
            rows.append(self.logits_after(history))
        return np.array(rows[len(rows) - n_logits:], dtype=np.float32).reshape(n_logits, self.n_vocab)

    def _truncate(self, n_kept):
        pass

    def tokenize(self, text, add_special=True):
        return [int(x) % self.n_vocab for x in text.split()]

    def token_bytes(self, token):
        return self.texts[token]

    def is_eog(self, token):
        return token == self.eos

    def chat_template(self):
        return None

    @property
    def bos_token(self):
        return ""

    @property
    def eos_token(self):
        return ""

    def vocab_info(self):
        return VocabInfo(self.n_vocab, "test", list(self.texts), {"bos": None, "eos": self.eos}, frozenset())
