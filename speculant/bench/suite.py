"""Benchmark prompts: the built-in suite and Spec-Bench's `question.jsonl` format.

Both are JSON Lines, one prompt a line: {"question_id", "category", "turns": [first turn, ...]}. Only the
first turn is used (single-turn generation, as Spec-Bench's speed protocol does)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..errors import SettingsError

BUILTIN_SUITE = Path(__file__).resolve().parent.parent / "data" / "suite.jsonl"


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str


def read_suite(path: str | Path | None = None) -> list[Prompt]:
    """Read a suite file (default: the built-in suite). Accepts Spec-Bench's question.jsonl."""
    path = Path(path) if path else BUILTIN_SUITE
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise SettingsError(f"cannot read suite {path}: {e.strerror}") from None
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SettingsError(f"{path}:{no}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise SettingsError(f"{path}:{no}: expected a JSON object")
        turns = obj.get("turns")
        if isinstance(turns, str):
            turns = [turns]
        if not turns or not isinstance(turns, list) or not isinstance(turns[0], str) or not turns[0].strip():
            raise SettingsError(f"{path}:{no}: needs a non-empty 'turns' list (the first turn is the prompt)")
        pid = str(obj.get("question_id", obj.get("id", no)))
        if pid in seen:
            raise SettingsError(f"{path}:{no}: duplicate question_id {pid}")
        seen.add(pid)
        prompts.append(Prompt(pid, str(obj.get("category") or "uncategorized"), turns[0]))
    if not prompts:
        raise SettingsError(f"suite {path} holds no prompts")
    return prompts


def select(prompts: Sequence[Prompt], categories: Optional[Sequence[str]] = None,
           limit: Optional[int] = None) -> list[Prompt]:
    """Keep the given categories (in file order) and at most `limit` prompts of each."""
    if limit is not None and limit < 1:
        raise SettingsError(f"--limit must be >= 1, got {limit}")
    if categories:
        known = {p.category for p in prompts}
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise SettingsError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                                f"this suite has: {', '.join(sorted(known))}")
    counts: dict[str, int] = {}
    out = []
    for p in prompts:
        if categories and p.category not in categories:
            continue
        if limit is not None and counts.get(p.category, 0) >= limit:
            continue
        counts[p.category] = counts.get(p.category, 0) + 1
        out.append(p)
    return out
