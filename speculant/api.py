"""The Python API, shaped like the CLI: `speculant.generate(prompt, model=..., draft_model=...)`."""

from __future__ import annotations

from typing import Optional, Sequence

from . import models
from .backends.base import Backend
from .drafters.model import ModelDrafter
from .engine import Engine, Result
from .errors import SettingsError
from .verify import SamplingParams
from .vocab import check_compatible


def load_backend(model: str, *, n_ctx: int = 4096, threads: Optional[int] = None,
                 role: str = "target") -> Backend:
    """A registered model name or a GGUF path -> a loaded backend."""
    if not isinstance(n_ctx, int) or n_ctx < 16:
        raise SettingsError(f"--ctx-size must be an integer >= 16, got {n_ctx!r}")
    if threads is not None and threads < 1:
        raise SettingsError(f"--threads must be >= 1, got {threads}")
    path = models.resolve(model)
    from .backends.llamacpp import LlamaCppBackend

    # a draft may use the faster repacked weights: its numerics need not match anything (see llamacpp.py)
    return LlamaCppBackend(path, n_ctx=n_ctx, n_threads=threads, repack=(role == "draft"))


def load_engine(model: str = models.DEFAULT_TARGET, draft_model: Optional[str] = None, *,
                draft_max: int = 4, draft_p_min: float = 0.0, n_ctx: int = 4096,
                threads: Optional[int] = None) -> Engine:
    """Load a target (and a draft model when given) and check that the draft can draft for the target."""
    if not (0.0 <= draft_p_min < 1.0):
        raise SettingsError(f"--draft-p-min must be in [0, 1), got {draft_p_min}")
    if not isinstance(draft_max, int) or draft_max < 0:
        raise SettingsError(f"--draft-max must be a non-negative integer, got {draft_max!r}")
    target = load_backend(model, n_ctx=n_ctx, threads=threads)
    drafter = None
    if draft_model:
        try:
            draft = load_backend(draft_model, n_ctx=target.n_ctx, threads=threads, role="draft")
            check_compatible(target.vocab_info(), draft.vocab_info(), target.name, draft.name)
        except BaseException:
            target.close()
            raise
        drafter = ModelDrafter(draft, target.n_vocab, p_min=draft_p_min)
    return Engine(target, drafter, draft_max=draft_max if drafter else 0)


def generate(prompt: str | Sequence[int], *, model: str = models.DEFAULT_TARGET,
             draft_model: Optional[str] = None, draft_max: int = 4, draft_p_min: float = 0.0,
             max_tokens: int = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             min_p: float = 0.0, seed: Optional[int] = None, stop: Sequence[str] = (), chat: bool = False,
             n_ctx: int = 4096, threads: Optional[int] = None) -> Result:
    """One-shot generation (loads the models, generates, frees them). Mirrors `speculant generate`."""
    params = SamplingParams(temperature, top_k, top_p, min_p, seed)
    engine = load_engine(model, draft_model, draft_max=draft_max, draft_p_min=draft_p_min, n_ctx=n_ctx,
                         threads=threads)
    try:
        text = engine.chat_prompt([{"role": "user", "content": prompt}]) if chat else prompt
        return engine.generate(text, max_tokens=max_tokens, params=params, stop=stop, is_chat=chat)
    finally:
        engine.close()
