"""Chat prompts rendered with the model's own Jinja chat template (from the GGUF metadata)."""

from __future__ import annotations

from functools import lru_cache

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


def render(template: str | None, messages: list[dict], *, bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True) -> str:
    """Render `messages` ([{"role", "content"}]) into the prompt text the model was trained on."""
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise SettingsError("each chat message needs a string 'role' and a string 'content'")
    try:
        return _compile(template or CHATML).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=bos_token, eos_token=eos_token,
        )
    except SettingsError:
        raise
    except Exception as e:
        raise SettingsError(f"chat template failed to render: {e}") from None
