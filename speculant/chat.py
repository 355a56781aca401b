"""Chat prompts rendered with the model's own Jinja chat template (from the GGUF metadata)."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Optional

from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import SettingsError

# Used when a model ships no template (ChatML, as Qwen and SmolLM2 use).
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _raise(message):
    raise SettingsError(f"chat template: {message}")


@lru_cache(maxsize=8)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(template)


def missing_template_warning(template: Optional[str], model: str) -> Optional[str]:
    """What to tell a user whose model ships no chat template (a base model: render falls back to CHATML), or
    None when it has one."""
    if template:
        return None
    return (f"{os.path.basename(str(model))} has no chat template (a base model?): chat is formatted as ChatML "
            f"(<|im_start|>role ... <|im_end|>), which it may not know")

IM_END = "<|im_end|>"  # where a CHATML turn ends


def fallback_stop_strings(backend) -> list[str]:
    """The stop strings a chat request needs besides its own: [IM_END] when the model has no template (render
    falls back to CHATML) and IM_END is not one end-of-generation token of its vocabulary. Such a model
    (gemma-3-270m) writes IM_END as plain text, which ends nothing: without the stop string a chat answer runs
    until max_tokens. Empty for a model with a template, or whose IM_END token ends a generation already."""
    if backend.chat_template():
        return []
    try:
        ids = backend.tokenize(IM_END, add_special=False)
    except Exception:  # no tokenizer (a transformers directory without one): its chat fails elsewhere
        return []
    return [] if len(ids) == 1 and backend.is_eog(ids[0]) else [IM_END]


def render(template: str | None, messages: list[dict], *, bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True, tools: Optional[list[dict]] = None) -> str:
    """Render `messages` ([{"role", "content"}], plus an assistant's "tool_calls" and a tool result's
    "tool_call_id") into the prompt text the model was trained on. tools: OpenAI function tools, handed to a
    template that takes them; otherwise described in the system message (tools.system_prompt)."""
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                not isinstance(m.get("content"), str) and not (m.get("content") is None and m.get("tool_calls")):
            raise SettingsError("each chat message needs a string 'role' and a string 'content'")
    template = template or CHATML
    messages = [dict(m, content=m.get("content") or "") for m in messages]
    if "tools" not in template:
        from .tools import CLOSE, OPEN, system_prompt

        # earlier calls as the text the model would have written (also when this request has no tools: else
        # the conversation loses them, and the tool results answer nothing)
        for m in messages:
            for c in m.pop("tool_calls", None) or ():
                call = json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                  ensure_ascii=False)
                m["content"] += f"\n{OPEN}\n{call}\n{CLOSE}"
        if tools:
            described = system_prompt(tools)
            if messages and messages[0]["role"] == "system":
                messages[0]["content"] += "\n\n" + described
            else:
                messages.insert(0, {"role": "system", "content": described})
            tools = None
    try:
        return _compile(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=bos_token, eos_token=eos_token, **({"tools": tools} if tools else {}),
        )
    except SettingsError:
        raise
    except Exception as e:
        raise SettingsError(f"chat template failed to render: {e}") from None
