"""Self-speculative drafter: the target drafts with a subset of its own layers (early exit after the first L
layers, or a set of skipped layers), then its final norm and LM head. The weights are the target's (the
layer modules are borrowed, never copied). KV entries are shared where that is exact: every layer before the
first skipped one sees the same inputs in the draft as in the target, and torch passes are bit-exact however
they are cut (backends/torch.py), so those layers use the target's own KV cache, in both directions. An
early-exit draft (the first L layers) therefore has no cache of its own and never prefills or catches up:
the target's passes already computed everything it needs, and it only evaluates the newest token. Layers
after the first skipped one keep the draft's own entries. Lossless like every drafter: the target verifies.

The layer subset comes from `speculant calibrate` (<model>.selfspec.json, see speculant/calibrate.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..backends.base import Backend, VocabInfo, common_prefix
from ..errors import SettingsError
from .model import ModelDrafter


def normalize_layers(n_layers: int, *, exit_layer: Optional[int] = None,
                     skip: Optional[Sequence[int]] = None) -> list[int]:
    """The layers a draft runs: the first `exit_layer`, or all but `skip`. Layer 0 is always run (the
    caches take their length from it), and at least one layer is left out: a draft of every layer is the
    target itself, which costs a target pass per drafted token and saves none."""
    if exit_layer is not None and skip:
        raise SettingsError("choose an early-exit depth or a set of skipped layers, not both")
    if n_layers < 2:
        raise SettingsError(f"self-speculation needs a model of 2 layers or more; this one has {n_layers}: "
                            "use plain decoding or a draft model")
    if exit_layer is not None:
        if not 1 <= exit_layer < n_layers:
            raise SettingsError(f"--self-spec-exit must be in [1, {n_layers - 1}] for a model of {n_layers} "
                                f"layers (exiting after all of them drafts with the whole target), got {exit_layer}")
        return list(range(exit_layer))
    skip_set = set(int(i) for i in (skip or ()))
    if any(not 0 <= i < n_layers for i in skip_set):
        raise SettingsError(f"self-spec skipped layers must be in [0, {n_layers}), got {sorted(skip_set)}")
    if 0 in skip_set:
        raise SettingsError("self-spec cannot skip layer 0")
    if not skip_set:
        raise SettingsError("self-spec skips no layer: the draft would be the whole target; skip at least one")
    return [i for i in range(n_layers) if i not in skip_set]


class LayerSubsetBackend(Backend):
    """A view of a TorchBackend that runs only `layers`; the layers before the first skipped one share the
    target's KV cache, the others have their own."""

    def __init__(self, target, layers: Sequence[int]):
        from ..backends.torch import SharedPrefixCache

        super().__init__()
        self.target = target
        self.layers = list(layers)
        self.name = f"{target.name}[{len(self.layers)}/{target.n_layers} layers]"
        self.n_vocab = target.n_vocab
        self.n_ctx = target.n_ctx
        self.n_shared = next((i for i, layer in enumerate(self.layers) if layer != i), len(self.layers))
        self.early_exit = self.n_shared == len(self.layers)
        self.cache = SharedPrefixCache(target, self.n_shared)

    def sync(self, context, n_logits: int = 1):
        """The shared layers hold the target's entries for target.tokens: an early-exit draft takes them as
        its own; a draft with own layers keeps only the part of its cache that agrees with them."""
        mine, theirs = self.tokens, self.target.tokens
        if self.early_exit:
            self.tokens = list(theirs)
        elif self.n_shared and mine[:len(theirs)] != theirs[:len(mine)]:
            self.rewind(common_prefix(mine, theirs))
        return super().sync(context, n_logits)

    def _decode(self, tokens, start, n_logits):
        layers = None if len(self.layers) == self.target.n_layers else self.layers
        logits = self.target.forward(tokens, start, n_logits, self.cache, layers=layers)
        theirs = self.target.tokens
        if self.n_shared and start < len(theirs):  # positions start.. of the shared layers now hold our tokens
            written = list(self.tokens[:start]) + list(tokens)
            agree = common_prefix(written, theirs)
            if agree < len(written):  # the target's entries from `agree` on are not its own any more
                self.target.rewind(max(start, agree))
        return logits

    def behind(self, context) -> int:
        known = self.target.tokens if self.early_exit else self.tokens
        return len(context) - common_prefix(known, context)

    def _truncate(self, n_kept: int) -> None:
        pass  # entries past n_kept are masked until overwritten (BlockKVCache)

    # text: the target's
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        return self.target.tokenize(text, add_special, parse_special)

    def token_bytes(self, token: int) -> bytes:
        return self.target.token_bytes(token)

    def is_eog(self, token: int) -> bool:
        return self.target.is_eog(token)

    def chat_template(self):
        return self.target.chat_template()

    def vocab_info(self) -> VocabInfo:
        return self.target.vocab_info()

    @property
    def bos_token(self) -> str:
        return self.target.bos_token

    @property
    def eos_token(self) -> str:
        return self.target.eos_token

    def close(self) -> None:
        self.cache.own = self.target.new_cache()
        self.tokens = []


class SelfSpecDrafter(ModelDrafter):
    """Drafts with the target's own layer subset: q = probs_from_logits(subset logits) at temperature > 0,
    argmax at 0 (the ModelDrafter loop, over a LayerSubsetBackend)."""

    name = "selfspec"

    def __init__(self, target, layers: Optional[Sequence[int]] = None, *, exit_layer: Optional[int] = None,
                 skip: Optional[Sequence[int]] = None, p_min: float = 0.0):
        if layers is None:
            layers = normalize_layers(target.n_layers, exit_layer=exit_layer, skip=skip)
        layers = sorted(set(int(i) for i in layers))
        if not layers or layers[0] != 0 or layers[-1] >= target.n_layers:
            raise SettingsError(f"invalid self-spec layer set {layers} for {target.n_layers} layers")
        super().__init__(LayerSubsetBackend(target, layers), target.n_vocab, p_min=p_min)
        self.layers = layers

    @classmethod
    def from_config(cls, target, path: Optional[str | os.PathLike] = None, p_min: float = 0.0) -> "SelfSpecDrafter":
        """Use the calibrated layer set (`path`, else <model>.selfspec.json); half the layers by early exit
        when there is none (a named file must exist)."""
        from ..calibrate import load_config

        cfg = load_config(target, path)
        if cfg is None:
            return cls(target, exit_layer=max(1, target.n_layers // 2), p_min=p_min)
        return cls(target, cfg["layers"], p_min=p_min)

    def close(self) -> None:  # the target is the engine's to close
        self.backend.close()
