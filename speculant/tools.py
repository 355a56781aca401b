"""OpenAI tool calling: the tools go into the prompt through the model's chat template, and the model's
<tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks (the Hermes format Qwen2.5 is trained on) come
back as `tool_calls`. tool_choice "required" or a named function constrains the output with a grammar built
from the tools' parameter schemas, so the call is well-formed by construction (and still decoded exactly:
constraint.py); under "auto" each call the model opens is held to that grammar until it closes
(body_grammar, constraint.TriggeredGrammar)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Optional

from .errors import SettingsError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: no parameters given
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class ToolsError(SettingsError):
    """A malformed `tools` / `tool_choice`; `param` names the request field."""

    def __init__(self, message: str, param: str = "tools"):
        super().__init__(message)
        self.param = param


@dataclass
class Tools:
    """A request's tools: the functions (OpenAI's {"type": "function", "function": {...}} objects, as the chat
    template reads them), and what tool_choice asks."""

    functions: list[dict]
    choice: str = "auto"  # "auto" | "required" | "none"
    forced: Optional[str] = None  # tool_choice naming one function
    parallel: bool = True  # parallel_tool_calls: more than one call per answer

    @property
    def names(self) -> set:
        return {f["function"]["name"] for f in self.functions}

    @property
    def active(self) -> bool:
        return bool(self.functions) and self.choice != "none"

    def answer(self, text: str, finish: str) -> tuple["Parsed", str]:
        """The model's answer read for calls, and its finish reason ("tool_calls" when it called and stopped).
        With parallel_tool_calls false only the first call counts (the auto grammar does not stop a second)."""
        parsed = parse_calls(text, self.names, cut=finish == "length")
        if not self.parallel:
            parsed.calls = parsed.calls[:1]
        return parsed, ("tool_calls" if parsed.calls and finish == "stop" else finish)

    def grammar(self) -> Optional[str]:
        """GBNF for answers that must call a tool (required / named), else None."""
        if not self.active or (self.choice == "auto" and self.forced is None):
            return None
        return self.calls_grammar()

    def calls_grammar(self) -> str:
        """GBNF for an answer that is tool calls only (one with parallel_tool_calls false)."""
        more = ' ("\\n" tool-call)*' if self.parallel else ""
        return (f'root ::= tool-call{more}\ntool-call ::= "{OPEN}\\n" tool-call-json "\\n{CLOSE}"\n'
                + self._call_json())

    def body_grammar(self) -> Optional[str]:
        """tool_choice auto: GBNF for what follows a <tool_call> the model chose to write: one call of a
        request function, its arguments under their schema, then </tool_call> (constraint.TriggeredGrammar)."""
        if not self.active or self.choice != "auto" or self.forced is not None:
            return None
        return f'root ::= [ \\n]? tool-call-json [ \\n]? "{CLOSE}"\n' + self._call_json()

    def _call_json(self) -> str:
        """GBNF whose rule tool-call-json is one call's JSON object: {"name": ..., "arguments": {...}}."""
        from .constraint import json_grammar

        wanted = [f for f in self.functions if self.forced in (None, f["function"]["name"])]
        calls = [{"type": "object", "properties": {"name": {"const": f["function"]["name"]},
                                                   "arguments": f["function"].get("parameters") or NO_PARAMETERS},
                  "required": ["name", "arguments"]} for f in wanted]
        try:
            gbnf = json_grammar(calls[0] if len(calls) == 1 else {"anyOf": calls}, strict=False)
        except SettingsError as e:
            raise ToolsError(f"cannot build a grammar from the tools' parameters: {e}") from None
        # the converter's root becomes one call
        return re.sub(r"^root ::=", "tool-call-json ::=", gbnf, flags=re.M)


def parse_tools(body: dict) -> Optional[Tools]:
    """The request's `tools`, `tool_choice` and `parallel_tool_calls` -> Tools, or None without tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ToolsError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise ToolsError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise ToolsError("'tools' must be an array of {type: function, function: {name, parameters}} objects")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolsError(f"tools[{i}] must be an object with type 'function' and a 'function' object")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolsError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-'")
        if name in names:
            raise ToolsError(f"tools[{i}]: the function name {name!r} appears twice")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolsError(f"tools[{i}].function.parameters must be a JSON schema object")
        if params is not None:  # a schema the grammar cannot read: refused whatever tool_choice (auto took it
            from .constraint import json_grammar  # silently and left its calls unconstrained)

            try:
                json_grammar(params, strict=False)
            except SettingsError as e:
                raise ToolsError(f"tools[{i}].function.parameters: {e}") from None
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ToolsError(f"tools[{i}].function.description must be a string")
        functions.append({"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters")
                                                           if fn.get(k) is not None}})
    forced = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ToolsError("'tool_choice' must be none, auto, required or {type: function, function: {name}}",
                             "tool_choice")
        if fn["name"] not in names:
            raise ToolsError(f"tool_choice names {fn['name']!r}, which is not among the tools", "tool_choice")
        forced, choice = fn["name"], "required"
    elif choice not in ("none", "auto", "required"):
        raise ToolsError("'tool_choice' must be none, auto, required or {type: function, function: {name}}",
                         "tool_choice")
    return Tools(functions, choice, forced, parallel)


def system_prompt(functions: list[dict]) -> str:
    """How the tools are described to a model whose chat template does not take tools (Qwen2.5's wording)."""
    listing = "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
            f"with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n</tools>\n\nFor each "
            f"function call, return a json object with function name and arguments within {OPEN}{CLOSE} XML "
            f'tags:\n{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')


@dataclass
class Parsed:
    content: Optional[str]  # the text outside the calls (None when there is none)
    calls: list[dict] = field(default_factory=list)  # OpenAI tool_calls


def _call(obj, names: Optional[set]) -> Optional[dict]:
    """{"name": ..., "arguments": ...} -> an OpenAI tool call, or None when it is not one (or, with names,
    not one of the request's functions)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"],
                         "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}


def _bare(text: str, names: Optional[set]) -> list[dict]:
    """An answer that is nothing but a call's JSON (or a list of them), maybe in a ```json fence: small models
    often write that instead of the tags. Only calls to the request's own functions count."""
    body = text.strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.S)
    if fence:
        body = fence.group(1)
    if not body.startswith(("{", "[")):
        return []
    try:
        obj = json.loads(body)
    except ValueError:
        return []
    calls = [_call(o, names) for o in (obj if isinstance(obj, list) else [obj])]
    return calls if calls and all(calls) else []


_CUT_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"(?:\s*,\s*"(?:arguments|parameters)"\s*:\s*(.*))?',
                       re.S)


def _cut_call(block: str, names: Optional[set]) -> tuple[Optional[dict], bool]:
    """A call the token limit cut off (the text after its <tool_call>): as OpenAI answers one, with its arguments
    as far as they were written (finish_reason "length"), or None; and whether it is text (a whole name that is
    not one of the request's functions: such a block stays text, as a whole one does)."""
    whole = block.rstrip()
    cut_tag = next((n for n in range(len(CLOSE) - 1, 0, -1) if whole.endswith(CLOSE[:n])), 0)
    try:
        obj = json.loads(whole[:len(whole) - cut_tag])  # whole, only (some of) its closing tag was cut
        return _call(obj, names), isinstance(obj, dict) and _call(obj, names) is None
    except ValueError:
        pass
    m = _CUT_CALL.match(block)
    if m is None:  # cut before its name was whole
        return None, False
    if names is not None and m.group(1) not in names:
        return None, True
    call = _call({"name": m.group(1)}, names)
    call["function"]["arguments"] = m.group(2) or ""
    return call, False


def _unclosed(text: str) -> int:
    """Where the first <tool_call> that no </tool_call> closes begins (whole blocks before it, kept as text, are
    stepped over; one inside its arguments is part of it), or -1."""
    pos = 0
    while (at := text.find(OPEN, pos)) >= 0:
        end = text.find(CLOSE, at)
        if end < 0:
            return at
        pos = end + len(CLOSE)
    return -1


def parse_calls(text: str, names: Optional[set] = None, cut: bool = False) -> Parsed:
    """The model's answer -> its text and its tool calls. A block that is not a JSON object with a string
    "name" stays in the text (the client sees what the model wrote rather than losing it). names: the
    request's functions, which an answer without tags must call to be read as calls. cut: the token limit ended
    the answer: a call it cut off is given as far as it was written, and no part of its tags is text."""
    calls, kept, pos = [], [], 0
    for m in _BLOCK.finditer(text):
        try:
            call = _call(json.loads(m.group(1)), names)  # a call to a function the request lacks stays text
        except ValueError:
            continue
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    rest = text[pos:]
    at = _unclosed(rest)  # the call begun and never closed: the one the token limit cut off
    open_call = at >= 0
    if cut and open_call:  # a call as far as it was written, not text
        partial, is_text = _cut_call(rest[at + len(OPEN):], names)
        if not is_text:
            rest = rest[:at]
        if partial is not None:
            calls.append(partial)
    elif calls and open_call:  # a further call the token limit cut off: not text the model meant to say
        rest = rest[:at]
    if cut:  # a tag the limit cut inside ("<tool"; a lone "<" may be text): the start of a call, not text
        tail = _open_tag_tail(rest)
        rest = rest[:len(rest) - tail] if tail > 1 else rest
    kept.append(rest)
    if not calls:
        bare = _bare(text, names) if names else []
        return Parsed(None, bare) if bare else Parsed((rest if cut else text) or None, [])
    content = "".join(kept).strip()
    return Parsed(content or None, calls)


def _may_be_a_bare_call(stripped: str) -> bool:
    """The answer so far may still become a call written as bare JSON (or in a ```json fence): _bare reads it."""
    if stripped[:1] in ("{", "["):
        return True
    if not stripped.startswith("```"):
        return bool(stripped) and "```".startswith(stripped)
    language, newline, body = stripped[3:].partition("\n")
    if not newline:
        return "json".startswith(language.strip())  # still writing the fence's first line
    body = body.lstrip()
    return language.strip() in ("", "json") and (not body or body[0] in "{[")


def held_back(text: str, sent: int = 0) -> int:
    """How many characters at the end of a streamed text must wait: a tool call (or what may be the start of
    one) is sent as tool_calls once the answer is complete, not as content. An answer that starts like JSON
    (or a code fence) waits whole: it may be a call written without the tags. sent: how much of the text went
    out already (held back by an earlier call, it holds nothing that starts a call): only what follows is
    searched, so streaming stays linear in the answer's length."""
    if not sent and _may_be_a_bare_call(text.lstrip()):
        return len(text)
    at = text.find(OPEN, max(sent - len(OPEN) + 1, 0))
    if at >= 0:
        return len(text) - at
    return _open_tag_tail(text)


def _open_tag_tail(text: str) -> int:
    """How many characters at the end of text may begin a <tool_call> tag ("<", "<tool", ...; 0: none)."""
    return next((n for n in range(min(len(OPEN) - 1, len(text)), 0, -1) if OPEN.startswith(text[-n:])), 0)


def message_for_template(m: dict) -> dict:
    """An OpenAI chat message -> what chat templates read: an assistant's tool_calls with their arguments as
    objects (templates write them with `tojson`), a tool result's content as text."""
    out = {k: v for k, v in m.items() if k in ("role", "content", "name", "tool_call_id")}
    if m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ToolsError("each tool_calls entry needs a 'function' with a string 'name'", "messages")
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError:
                    raise ToolsError(f"tool call {fn['name']!r}: 'arguments' is not valid JSON", "messages") from None
            calls.append({"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
        out["tool_calls"] = calls
    return out
