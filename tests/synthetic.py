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

    def tokenize(self, text, add_special=True, parse_special=True):
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


# -- the distribution tests' tools: the exact law of the first n tokens, a seeded sample of them, a chi-square --
def exact_joint(target: TableBackend, prompt: Sequence[int], params, n: int = 3, adjust=None) -> np.ndarray:
    """P(each n-token sequence) [V**n] when the target alone samples with `params`. adjust(logits, history)
    -> logits: what the sampler does to a row first (logit bias, penalties), if anything."""
    import itertools

    from speculant.verify import probs_from_logits

    V = target.n_vocab
    probs = np.zeros((V,) * n)
    for seq in itertools.product(range(V), repeat=n):
        pr, hist = 1.0, list(prompt)
        for t in seq:
            row = target.logits_after(hist)
            pr *= probs_from_logits(row if adjust is None else adjust(row, hist), params)[t]
            hist.append(t)
        probs[seq] = pr
    return probs.ravel()


def sequence_counts(engine, prompt: Sequence[int], params, n_runs: int, n: int = 3, **generate_kw):
    """How often each n-token sequence [V**n] came out of n_runs generations seeded params.seed + i, and the
    tokens drafted over them."""
    import dataclasses

    V = engine.target.n_vocab
    counts = np.zeros(V ** n, dtype=np.int64)
    drafted = 0
    for i in range(n_runs):
        r = engine.generate(list(prompt), max_tokens=n, params=dataclasses.replace(params, seed=params.seed + i),
                            **generate_kw)
        drafted += r.stats.drafted
        counts[np.ravel_multi_index(r.tokens, (V,) * n)] += 1
    return counts, drafted


def pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square p-value of the sample against the exact law (0 when an impossible sequence came out); sparse
    cells are pooled so that the approximation holds."""
    from scipy import stats as sps

    if counts[probs == 0].sum():
        return 0.0
    m = probs > 0
    expected = probs[m] * counts.sum()
    big = expected >= 5
    obs, exp = counts[m][big], expected[big]
    if (~big).any():
        obs, exp = np.append(obs, counts[m][~big].sum()), np.append(exp, expected[~big].sum())
    return sps.chisquare(obs, exp).pvalue


def sqrt_p_verifier(draft_tokens, draft_probs, target_probs, rng):
    """A wrong verify_sampled for deterministic drafts: keeps x with sqrt(p(x)) instead of p(x). The
    distribution tests of deterministic drafters must fail it."""
    from speculant.verify import residual

    V = target_probs.shape[-1]
    for i, x in enumerate(draft_tokens):
        p = target_probs[i]
        if rng.random() >= np.sqrt(p[x]):
            return i, int(rng.choice(V, p=residual(p, None, x)))
    return len(draft_tokens), int(rng.choice(V, p=target_probs[-1]))


def near_copy(shape: str = "tiny", seed: int = 4, std: float = 0.5, noise: float = 0.05, device: str = "cpu"):
    """A StaticTorchBackend (shape classes: a draft) over random_model(shape, seed, std) with normal noise of
    noise * std added to every weight: a draft that agrees with the unperturbed target often, not always."""
    import torch

    from speculant.backends.torch_static import StaticTorchBackend
    from speculant.shapes import random_model

    model = random_model(shape, seed=seed, std=std, device=device)
    gen = torch.Generator(device=device).manual_seed(9)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype) * noise * std)
    return StaticTorchBackend(model, name=f"{shape}-near", n_ctx=512)


def embeddings_only_gguf(path):
    """A GGUF whose header plans (a 1-layer llama) but which llama.cpp cannot load: only token embeddings."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_context_length(512)
    w.add_tensor("token_embd.weight", np.zeros((256, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
