"""Draft/target vocabulary compatibility: a draft may only propose token ids that mean the same to the target."""

from __future__ import annotations

from .backends.base import VocabInfo
from .errors import VocabMismatchError

MAX_PADDING_DIFFERENCE = 128  # Qwen-style vocabularies pad their size differently (llama.cpp allows 128 too)


def check_compatible(target: VocabInfo, draft: VocabInfo, target_name: str = "target",
                     draft_name: str = "draft") -> None:
    """Raise VocabMismatchError naming exactly what differs; return None when the draft can serve the target."""
    where = f"draft {draft_name} cannot draft for target {target_name}"
    if target.kind != draft.kind:
        raise VocabMismatchError(f"{where}: tokenizer types differ (target {target.kind}, draft {draft.kind})")
    diff = abs(target.n_vocab - draft.n_vocab)
    if diff > MAX_PADDING_DIFFERENCE:
        raise VocabMismatchError(
            f"{where}: vocabulary sizes differ by {diff} tokens (target {target.n_vocab}, draft "
            f"{draft.n_vocab}; at most {MAX_PADDING_DIFFERENCE} padding tokens may differ)"
        )
    for name in ("bos", "eos", "eot", "pad"):
        t, d = target.special_ids.get(name), draft.special_ids.get(name)
        if t != d and name in ("bos", "eos", "eot"):
            raise VocabMismatchError(f"{where}: special token {name.upper()} differs (target id {t}, draft id {d})")
    n = min(target.n_vocab, draft.n_vocab)
    differing = [
        i for i in range(n)
        if target.texts[i] != draft.texts[i] and not (i in target.unused and i in draft.unused)
    ]
    if differing:
        examples = ", ".join(
            f"id {i}: target {target.texts[i]!r} vs draft {draft.texts[i]!r}" for i in differing[:3]
        )
        raise VocabMismatchError(f"{where}: {len(differing)} token texts differ ({examples})")
    larger, label = (target, "target") if target.n_vocab > draft.n_vocab else (draft, "draft")
    extra = [i for i in range(n, larger.n_vocab) if i not in larger.unused]
    if extra and label == "draft":
        raise VocabMismatchError(
            f"{where}: the draft has {len(extra)} usable token ids beyond the target's {target.n_vocab} "
            f"(first: id {extra[0]} {larger.texts[extra[0]]!r})"
        )
