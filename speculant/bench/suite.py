"""Benchmark prompts: the built-in suites and Spec-Bench's `question.jsonl` format.

All are JSON Lines, one prompt a line: {"question_id", "category", "turns": [first turn, ...]}. Only the
first turn is used (single-turn generation, as Spec-Bench's speed protocol does). A prompt may carry a
predicted output for the methods that use one: "prediction" (the text) or "prediction_file" (a path relative
to the suite file); "{prediction}" in the turn is replaced by it (an edit task quotes the file it edits).

Built-in suites, by name (`--suite NAME`): default (9 task types), code_edit_predicted (24 edits of
original code files under data/code/, each file its own prediction), repeated (the same two kinds of
request, JSON extraction and tool-call formatting, asked 8 times each: history drafting learns them),
structured (12 JSON answers, each under its JSON schema: extraction, tool calls, orders), tools (12 requests
with OpenAI tools, the model choosing or required to call one).

A prompt may constrain its answer: "json_schema" (an object: the answer is JSON following it), "grammar" (GBNF
text) or "response_format": "json_object" (any JSON object); every method then decodes under it. A prompt with
"tools" (OpenAI function tools) has them rendered into its chat prompt by the template, and "tool_choice":
"required" (or a named function) decodes it under the grammar of a call (speculant/tools.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from ..errors import SettingsError

DATA = Path(__file__).resolve().parent.parent / "data"
BUILTIN_SUITE = DATA / "suite.jsonl"
BUILTIN_SUITES = {"default": BUILTIN_SUITE, "code_edit_predicted": DATA / "code_edit_predicted.jsonl",
                  "repeated": DATA / "repeated.jsonl", "structured": DATA / "structured.jsonl",
                  "tools": DATA / "tools.jsonl"}


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str
    prediction: Optional[str] = None  # the predicted output, for methods that use one
    grammar: Optional[str] = None  # GBNF the answer must follow (from json_schema, grammar or response_format)
    tools: Optional[list] = None  # OpenAI function tools the chat prompt offers (rendered by the template)
    call_grammar: Optional[str] = None  # tool_choice auto: GBNF of a call the model opens (tools.Tools.body_grammar)

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.text}]


def read_suite(path: str | Path | None = None) -> list[Prompt]:
    """Read a suite file or a built-in suite's name (default: the built-in default suite). Accepts Spec-Bench's
    question.jsonl."""
    path = BUILTIN_SUITES.get(str(path), path) if path else BUILTIN_SUITE
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise SettingsError(f"cannot read suite {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise SettingsError(f"suite {path} is not UTF-8 text") from None
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
        prediction = obj.get("prediction")
        if obj.get("prediction_file"):
            pfile = path.parent / str(obj["prediction_file"])
            try:
                prediction = pfile.read_text(encoding="utf-8")
            except OSError as e:
                raise SettingsError(f"{path}:{no}: cannot read prediction_file {pfile}: {e.strerror}") from None
            except UnicodeDecodeError:
                raise SettingsError(f"{path}:{no}: prediction_file {pfile} is not UTF-8 text") from None
        if prediction is not None and not isinstance(prediction, str):
            raise SettingsError(f"{path}:{no}: 'prediction' must be a string")
        text = turns[0].replace("{prediction}", prediction) if prediction is not None else turns[0]
        tools = _tools(obj, f"{path}:{no}")
        grammar = _grammar(obj, f"{path}:{no}")
        if tools is not None and tools.grammar() is not None:
            if grammar is not None:
                raise SettingsError(f"{path}:{no}: a required tool call cannot also follow a schema or grammar")
            grammar = tools.grammar()
        prompts.append(Prompt(pid, str(obj.get("category") or "uncategorized"), text, prediction, grammar,
                              tools.functions if tools is not None and tools.active else None,
                              tools.body_grammar() if tools is not None else None))
    if not prompts:
        raise SettingsError(f"suite {path} holds no prompts")
    return prompts


def _tools(obj: dict, where: str):
    from ..tools import ToolsError, parse_tools

    try:
        return parse_tools(obj)
    except ToolsError as e:
        raise SettingsError(f"{where}: {e}") from None


def _grammar(obj: dict, where: str) -> Optional[str]:
    from ..constraint import json_grammar

    given = [k for k in ("json_schema", "grammar", "response_format") if obj.get(k) is not None]
    if len(given) > 1:
        raise SettingsError(f"{where}: give one of json_schema, grammar, response_format")
    if not given:
        return None
    value = obj[given[0]]
    if given[0] == "json_schema":
        if not isinstance(value, dict):
            raise SettingsError(f"{where}: 'json_schema' must be an object")
        try:
            return json_grammar(value)
        except SettingsError as e:
            raise SettingsError(f"{where}: {e}") from None
    if given[0] == "grammar":
        if not isinstance(value, str) or not value.strip():
            raise SettingsError(f"{where}: 'grammar' must be GBNF text")
        return value
    if value != "json_object":
        raise SettingsError(f"{where}: 'response_format' may only be \"json_object\"")
    return json_grammar()


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
