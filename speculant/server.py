"""`speculant serve`: an OpenAI-compatible HTTP server over one speculative Engine.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as server-sent
events ending in `data: [DONE]`), GET /v1/models (/models), llama-server's own (POST /completion, /infill,
/tokenize, /detokenize, /apply-template; GET /props, /slots), GET /health (/v1/health), GET /metrics (Prometheus
text format). llama-server's request fields are read on every endpoint (_get_max_tokens, _get_sampling,
_llama_samplers), and its --api-key list and X-Api-Key header are taken.

Concurrency: an Engine holds one KV cache and is not thread-safe, so every call into it runs on ONE worker
thread (a single-thread executor), and a request holds the engine (an asyncio lock, FIFO) from its first
decode step to its last. Waiting requests form the queue whose depth /metrics and /health report. The decode
loop is driven one step at a time from the event loop, so a client that disconnects is noticed between two
tokens and its generator is closed at once, freeing the engine for the next request; during its prompt, between
two passes of the target's or the draft model's prompt processing.

Errors a client can cause are answered with a 4xx and an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}`; the server keeps serving.

Sampling defaults for fields a request leaves out come from the serve flags (--temp, --top-p, -n, ...),
so an unspecified temperature is greedy by default (OpenAI's own default is 1). Extensions accepted in
request bodies: top_k, min_p. Every response's `usage` carries `speculative`: the request's SpecStats.

Predicted outputs (OpenAI's `prediction`, on chat completions and completions): `{"type": "content", "content":
str or [{"type": "text", "text": str}, ...]}`, drafted first wherever the output follows it (lossless: the
answer is the one without it). `usage.completion_tokens_details` reports `accepted_prediction_tokens` (output
tokens the prediction supplied) and `rejected_prediction_tokens` (prediction tokens the target checked and
rejected). Like OpenAI, a request with a prediction may not ask for n > 1, logprobs, tools or functions, audio,
non-text modalities, or presence/frequency penalties > 0 (400, param naming the field).
"""

import asyncio
import codecs
import contextvars
import dataclasses
import errno
import hashlib
import hmac
import itertools
import json
import logging
import math
import os
import re
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

import numpy as np

from . import samplers
from .backends.base import common_prefix
from .constraint import TriggeredGrammar, either_grammar, json_grammar
from .engine import INFILL_WITH_GRAMMAR, MAX_TOP_LOGPROBS
from .errors import Cancelled, ContextOverflowError, SettingsError, SpeculantError
from .rpc import WorkerError
from .tools import CLOSE, OPEN, ToolsError, held_back, message_for_template, parse_tools
from .samplers import LLAMA_SAMPLERS
from .verify import InfillVocab, SamplingParams, with_eog_banned, with_repeat_last_n

_LOG = logging.getLogger("speculant.server")

MAX_STOP = 256  # stop strings one request may give: OpenAI's API takes 4, llama-server any number (clients written
# for it send more); a bound all the same, each string is matched against the text at every step
MAX_STOP_CHARS = 16384  # their characters together (256 strings of 4000 characters slowed decoding 6x)
MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's bound)
MAX_N = 16  # choices one request may ask for
REUSE_MIN = 32  # cached prompt tokens that decide a request's slot (Worker._pick_slot)
QUEUE_POLL = 0.25  # seconds between checks that a queued request's client is still there (Worker._acquire_slot)
MAX_PROMPTS = 16  # prompts one /v1/completions request may batch (times n: the choices it gets)
_DONE = object()


# ---------------------------------------------------------------------------------------------------------
# errors


class APIError(Exception):
    """An error answered to the client as an OpenAI-style error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # OpenAI's


def _bad(message: str, param: Optional[str] = None, code: Optional[str] = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# ---------------------------------------------------------------------------------------------------------
# configuration and request validation


@dataclass
class ServerConfig:
    model_id: str
    draft_id: Optional[str] = None
    # a request's "model" must be model_id (vLLM, whose --served-model-name sets it); off (serve without
    # --served-model-name), any name is served, as llama-server does (clients hard-code names like "gpt-4o")
    check_model: bool = True
    api_key: Optional[str] = None  # llama-server's --api-key: one key, or several separated by commas
    max_body_bytes: int = 1 << 20
    # llama-server's --timeout: the longest a client may take to send its request body, or to take one chunk of
    # a stream (a client that stops reading held its slot: the stream waits on it); None: no limit
    io_timeout_s: Optional[float] = 600.0
    max_queue: int = 64
    parallel: int = 1  # requests decoded at once (slots), each on its own sequence of the shared models
    spm_infill: bool = False  # /infill's prompt: suffix, prefix, middle (llama-server's --spm-infill)
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])  # CORS: web pages that may call the API
    # defaults for fields a request leaves out (from the serve flags)
    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple = ()  # (token, bias) pairs; a request's own logit_bias replaces them
    ignore_eos: bool = False
    repeat_last_n: int = 64  # llama-server's endpoints: the penalties' window of requests that leave it out
    n_vocab: Optional[int] = None  # the target's vocabulary (logit_bias ids are checked against it)
    n_ctx: Optional[int] = None  # a slot's context (n_predict -1; repeat_last_n); create_app fills it in
    eog_ids: tuple = ()  # the target's end-of-generation tokens (ignore_eos bans them); create_app fills them in
    infill_vocab: Optional[Callable[[], InfillVocab]] = None  # the target's, for the infill sampler (create_app)
    samplers: tuple = LLAMA_SAMPLERS  # the chain of requests without "samplers" (serve --samplers)
    endpoint_slots: bool = True  # GET /slots answers (llama-server's --slots / --no-slots)

    def api_keys(self) -> list[str]:
        """The keys a request may carry (llama-server's comma-separated --api-key list)."""
        return [k.strip() for k in (self.api_key or "").split(",") if k.strip()]


@dataclass
class Job:
    """One validated generation request."""

    prompt: str | list[int]  # text, or (/v1/completions) token ids
    is_chat: bool
    max_tokens: int
    params: Any  # SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    tokens: list[int] = field(default_factory=list)  # the tokenized prompt, filled before generation
    prediction: Optional[str] = None  # the predicted output ("Predicted Outputs"), drafted first
    logprobs: Optional[int] = None  # alternatives per token when logprobs were asked for (0: the token's only)
    post_sampling: bool = False  # llama-server's post_sampling_probs: those of the sampling distribution
    grammar: Optional[str] = None  # GBNF the output must follow (response_format JSON, or `grammar`)
    constraint: Any = None  # its constraint.Constraint, made when the prompt is tokenized
    grammar_param: str = "grammar"  # the request field it came from
    n: int = 1  # choices: generations of the same prompt, each on a slot of its own (they decode at once)
    tools: Any = None  # tools.Tools when the request gives tools the model may call
    cut: bool = False  # generation stopped early because the server is shutting down
    slot: int = -1  # the slot that generates it (llama-server's id_slot), once it has one
    more_prompts: list = field(default_factory=list)  # /v1/completions: the batch's other prompts (str or ids)
    echo: bool = False  # /v1/completions: the prompt comes back before the completion (and its logprobs)
    suffix: Optional[str] = None  # /v1/completions: fill in the middle, between the prompt and this
    prompt_logprobs: Optional[list] = None  # with echo and logprobs: the prompt's TokenLogprobs (Worker.run)
    infill: Optional[dict] = None  # /infill: Engine.infill_prompt's arguments (the prompt is built from them)
    truncated: bool = False  # /infill: the prompt was cut to fit the context
    stop_rule: Any = None  # /infill: InfillStop, which can end the generation on what its text says
    # n > 1: the first choice processes the prompt (then sets `started`); the others wait for it (`after`)
    # and take its cache (Worker.run)
    started: Any = None  # asyncio.Event
    after: Any = None  # asyncio.Event
    admission: Any = None  # the request's places among those admitted (Worker.admit), given back as they end
    choice: int = 0  # n > 1: which generation of its prompt this is (the first processes the prompt)
    bias_texts: tuple = ()  # llama-server's [["text", bias]] logit_bias entries: every token of the text, added
    # to params.logit_bias when the prompt is tokenized (Worker.tokenize)
    continued: str = ""  # chat: the final assistant message's text that the answer continues (its grammar reads it
    # first, so that the message as a whole follows the grammar)
    return_tokens: bool = False  # llama-server's: the ids of every token decoded in "tokens" (/completion, /infill)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _get_int(body: dict, name: str, default, lo=None, hi=None):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise _bad(f"'{name}' must be an integer, got {json.dumps(v)[:50]}", name, "invalid_type")
    if lo is not None and v < lo:
        raise _bad(f"'{name}' must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise _bad(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def _get_num(body: dict, name: str, default, lo, hi, lo_open=False):
    v = body.get(name)
    if v is None:
        return default
    if not _is_num(v):
        raise _bad(f"'{name}' must be a number, got {json.dumps(v)[:50]}", name, "invalid_type")
    if (v <= lo if lo_open else v < lo) or v > hi:
        raise _bad(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", name)
    return float(v)


def _get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(f"'{name}' must be a boolean, got {json.dumps(v)[:50]}", name, "invalid_type")
    return v


def _get_prediction(body: dict) -> Optional[str]:
    """OpenAI's `prediction` ({"type": "content", "content": text or text parts}) -> its text, or None; and
    OpenAI's refusals of what does not go with it."""
    pred = body.get("prediction")
    if pred is None:
        return None
    shape = "'prediction' must be an object {\"type\": \"content\", \"content\": string or array of text parts}"
    if not isinstance(pred, dict) or pred.get("type") != "content" or "content" not in pred:
        raise _bad(shape, "prediction", "invalid_type")
    content = pred["content"]
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise _bad("prediction.content: only text parts ({\"type\": \"text\", \"text\": ...}) are supported",
                       "prediction", "invalid_type")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise _bad(shape, "prediction", "invalid_type")
    n = body.get("n")
    if _is_int(n) and n > 1:
        raise _bad("n > 1 is not supported with predicted outputs ('prediction')", "n", "unsupported_parameter")
    for name in ("logprobs", "top_logprobs", "tools", "functions", "audio"):
        if body.get(name) not in (None, False, [], {}):
            raise _bad(f"'{name}' is not supported with predicted outputs ('prediction')", name,
                       "unsupported_parameter")
    modalities = body.get("modalities")
    if modalities not in (None, ["text"]):
        raise _bad("only text modalities are supported with predicted outputs ('prediction')", "modalities",
                   "unsupported_parameter")
    for name in ("presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if _is_num(v) and v > 0:
            raise _bad(f"'{name}' > 0 is not supported with predicted outputs ('prediction')", name,
                       "unsupported_parameter")
    return content


def render_messages(body: dict, render_chat, tools) -> tuple[str, str]:
    """A chat request's messages (text content) -> the prompt, rendered with the model's chat template (with the
    request's tools where they are active): what /v1/chat/completions decodes and /apply-template answers; and
    the text of a final assistant message that the answer continues ("" where it starts a new turn)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array of {role, content} objects", "messages",
                   "invalid_type")
    flat = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a string 'role'", "messages", "invalid_type")
        if m["role"] not in CHAT_ROLES:  # a typo ("usr") would otherwise go into the prompt as it is
            raise _bad(f"messages[{i}].role {m['role']!r} is not one of {', '.join(CHAT_ROLES)}", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is supported
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _bad(f"messages[{i}].content: only text parts are supported", "messages",
                               "unsupported_value")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None:
            if m["role"] != "assistant":  # only an assistant turn (one that calls tools) may leave it out
                raise _bad(f"messages[{i}] ({m['role']}) has no 'content'", "messages", "invalid_type")
            content = ""
        if not isinstance(content, str):
            raise _bad(f"messages[{i}].content must be a string or an array of text parts", "messages",
                       "invalid_type")
        if m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):
            raise _bad(f"messages[{i}].tool_calls must be an array", "messages", "invalid_type")
        try:
            role = "system" if m["role"] == "developer" else m["role"]  # OpenAI's newer name for system
            flat.append(message_for_template({**m, "role": role, "content": content}))
        except ToolsError as e:
            raise _bad(f"messages[{i}]: {e}", "messages") from None
    # tool_choice none: the model is not told of the tools (so it cannot call them)
    functions = tools.functions if tools is not None and tools.active else None
    continued = body.get("continue_final_message")
    if continued is not None and not isinstance(continued, bool):
        raise _bad("'continue_final_message' must be a boolean", "continue_final_message", "invalid_type")
    last = flat[-1]
    if continued is not False and last["role"] == "assistant" and not last.get("tool_calls") and len(flat) > 1:
        # a final assistant message is continued (llama-server's default; vLLM's continue_final_message): the
        # answer goes on from its text, where the template would close that turn and open a new one
        return render_chat(flat[:-1], functions) + last["content"], last["content"]
    if continued:
        raise _bad("'continue_final_message': the last message must be an assistant's (without tool calls) after "
                   "another role's", "continue_final_message")
    return render_chat(flat, functions), ""


def _no_lora(body: dict) -> None:
    """llama-server's per-request `lora` (adapters loaded with --lora, by id): this server loads none, so a request
    asking for one is refused, as llama-server refuses an id it has not loaded (left out, it would be answered by
    the base model as if the adapter were applied)."""
    if body.get("lora") not in (None, []):
        raise _bad("'lora': this server loads no LoRA adapters", "lora", "unsupported_parameter")


def parse_job(body: Any, cfg: ServerConfig, *, chat: bool, render_chat) -> Job:
    """Validate a request body into a Job; raises APIError (400/404) on anything wrong."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None, "invalid_type")
    _no_lora(body)
    prediction = _get_prediction(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model", "invalid_type")
    if model is not None and model not in (cfg.model_id, "") and cfg.check_model:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{cfg.model_id}'",
                       param="model", code="model_not_found")
    n = _get_int(body, "n", 1, lo=1, hi=MAX_N)
    if body.get("best_of") not in (None, 1):
        raise _bad("only best_of=1 is supported", "best_of", "unsupported_value")
    for name in (("suffix", "echo") if chat else ("tools", "tool_choice")) + ("functions", "function_call"):
        if body.get(name) not in (None, False, {}, []):
            raise _bad(f"'{name}' is not supported by this server{'' if chat else ' on /v1/completions'}"
                       f"{'; use tools' if name.startswith('function') else ''}", name, "unsupported_parameter")
    logprobs = _get_logprobs(body, chat)
    grammar = _get_grammar(body)
    grammar_param = next((k for k in ("grammar", "json_schema") if body.get(k) is not None), "response_format")
    tools = None
    if chat:
        try:
            tools = parse_tools(body)
            tools_grammar = tools.grammar() if tools is not None else None
        except ToolsError as e:
            raise _bad(str(e), e.param) from None
        if tools_grammar is not None:  # calls only; a response_format is for a later answer in text
            if grammar_param == "grammar" and grammar is not None:
                raise _bad(f"tool_choice {tools.choice!r} constrains the answer to tool calls: it cannot also "
                           f"follow 'grammar'", "tool_choice")
            grammar, grammar_param = tools_grammar, "tools"
        elif grammar is not None and tools is not None and tools.active:
            # auto with a response format (OpenAI's Agents SDK sends both): tool calls, or an answer under the
            # format; the format alone left the model no way to call
            grammar = either_grammar(grammar, tools.calls_grammar())

    if chat:
        prompt, continued = render_messages(body, render_chat, tools)
        max_tokens = _get_max_tokens(body, cfg, lo=1)
    else:
        suffix = body.get("suffix")
        if suffix is not None and not isinstance(suffix, str):
            raise _bad("'suffix' must be a string", "suffix", "invalid_type")
        batch = _get_prompts(body.get("prompt"), empty_ok=suffix is not None)  # fill in at a file's start
        prompt = batch[0]
        echo = _get_bool(body, "echo", False)
        if echo and suffix is not None:
            raise _bad("'echo' cannot be used with 'suffix'", "echo", "unsupported_value")
        max_tokens = _get_max_tokens(body, cfg, lo=0 if echo else 1)  # 0: score the prompt

    (params, bias_texts), stop = _get_sampling(body, cfg), _get_stop(body, cfg)
    if grammar_param == "tools":  # the answer is calls only: a stop string would cut one, leaving no call
        stop = []
    stream = _get_bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _bad("'stream_options' must be an object", "stream_options", "invalid_type")
    if opts is not None and not stream:  # as OpenAI's API: the options of a stream, without one
        raise _bad("'stream_options' is only allowed when 'stream' is true", "stream_options", "invalid_value")
    include_usage = bool(opts and opts.get("include_usage") is True)
    job = Job(prompt, chat, max_tokens, params, [s for s in stop if s], stream, include_usage,
              prediction=prediction, logprobs=logprobs, grammar=grammar, grammar_param=grammar_param, n=n,
              tools=tools if tools is not None and tools.active else None, bias_texts=bias_texts)
    if chat:
        job.continued = continued
    else:
        job.echo, job.suffix = echo, suffix
        job.more_prompts = batch[1:]
        if len(batch) * n > MAX_N * 4:
            raise _bad(f"{len(batch)} prompts x n={n} choices is more than {MAX_N * 4}", "n")
    return job


def _get_max_tokens(body: dict, cfg: ServerConfig, lo: int, n_ctx: Optional[int] = None) -> int:
    """The token limit. As llama-server reads it on every endpoint: n_predict, else max_completion_tokens, else
    max_tokens (its aliases, in that order); the server's -n if none. n_predict may be -1 (until the end of
    generation or a full context) or 0 (the prompt processed and cached, nothing generated); `lo` bounds the
    other two (llama-server's own endpoints pass -1), which may be -1 too (llama-server reads them as n_predict)."""
    n_ctx = n_ctx or cfg.n_ctx or 1 << 30
    for name in ("n_predict", "max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            v = _get_int(body, name, None, lo=min(lo, -1) if name == "n_predict" or body[name] == -1 else lo)
            return n_ctx if v == -1 else v
    return cfg.max_tokens


def _get_sampling(body: dict, cfg: ServerConfig, *, random_seed: Optional[int] = -1,
                  n_ctx: Optional[int] = None, native: bool = False) -> tuple[SamplingParams, tuple]:
    """The sampling fields (the server's defaults for those left out), the same on every endpoint: OpenAI's, and
    llama-server's (repeat_penalty, ignore_eos, logit_bias as pairs; its other samplers: _llama_samplers).
    random_seed: a seed that asks for a random one (llama-server's -1, on every endpoint: a client sending -1
    means no seed, and OpenAI's API gives no meaning to one); native: llama-server's own endpoints,
    whose penalties count the last repeat_last_n tokens (the serve flag's, 64, where a request leaves it out) where
    /v1's count as OpenAI's and vLLM's. Returns the params and the logit_bias texts whose tokens are added when the
    prompt is tokenized (Job.bias_texts)."""
    temperature = _get_num(body, "temperature", cfg.temperature, 0.0, 2.0)
    top_p = _get_num(body, "top_p", cfg.top_p, 0.0, 1.0, lo_open=True)
    min_p = _get_num(body, "min_p", cfg.min_p, 0.0, 0.999999)
    top_k = max(0, _get_int(body, "top_k", cfg.top_k))  # vLLM's -1 and llama-server's <= 0: off
    seed = _get_int(body, "seed", cfg.seed)
    if seed is not None and seed == random_seed:
        seed = None
    if seed is not None:
        if not -(1 << 63) <= seed < 1 << 64:
            raise _bad(f"'seed' must be a 64-bit integer, got {seed}", "seed")
        seed %= 1 << 64  # OpenAI seeds are signed 64-bit; numpy wants a non-negative one
    presence = _get_num(body, "presence_penalty", cfg.presence_penalty, -2.0, 2.0)
    frequency = _get_num(body, "frequency_penalty", cfg.frequency_penalty, -2.0, 2.0)
    # llama-server's name and vLLM's, one meaning
    llama_name, vllm_name = body.get("repeat_penalty"), body.get("repetition_penalty")
    if llama_name is not None and vllm_name is not None and llama_name != vllm_name:
        raise _bad(f"'repeat_penalty' ({json.dumps(llama_name)[:20]}) and 'repetition_penalty' "
                   f"({json.dumps(vllm_name)[:20]}) are the same setting: give one", "repeat_penalty")
    repeat = _get_num(body, "repeat_penalty" if llama_name is not None else "repetition_penalty",
                      cfg.repetition_penalty, 0.0, 10.0, lo_open=True)
    logit_bias, texts = _get_logit_bias(body, cfg)
    try:
        params = SamplingParams(temperature, top_k, top_p, min_p, seed, logit_bias=logit_bias,
                                presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repeat)
    except SpeculantError as e:
        raise _bad(str(e)) from None
    if _get_bool(body, "ignore_eos", cfg.ignore_eos):  # llama-server's: every end-of-generation token banned
        params = with_eog_banned(params, cfg.eog_ids)
    return _llama_samplers(body, params, n_ctx or cfg.n_ctx, cfg.repeat_last_n if native else None,
                           cfg.infill_vocab, cfg.samplers), texts


def _sampler_chain(body: dict, default: tuple[str, ...] = LLAMA_SAMPLERS) -> tuple[str, ...]:
    """The "samplers" field as llama-server reads it: names (any case, its aliases) or one string of one character
    each (samplers.py); left out, the server's default chain (serve --samplers)."""
    given = body.get("samplers")
    if given is None:
        return default
    if not (isinstance(given, str) or isinstance(given, list) and all(isinstance(name, str) for name in given)):
        raise _bad("'samplers' must be an array of sampler names or a string of sampler characters", "samplers",
                   "invalid_type")
    try:
        return samplers.from_chars(given) if isinstance(given, str) else samplers.from_names(given)
    except SettingsError as e:
        raise _bad(f"'samplers': {e}", "samplers", "unsupported_value") from None


def _in_chain(params: SamplingParams, chain: tuple[str, ...],
              infill_vocab: Optional[Callable[[], InfillVocab]] = None) -> SamplingParams:
    """samplers.in_chain, its refusals a 400 naming "samplers" (an order that would change the distribution)."""
    try:
        return samplers.in_chain(params, chain, infill_vocab)
    except SettingsError as e:
        raise _bad(f"'samplers': {e}", "samplers", "unsupported_value") from None


def _llama_samplers(body: dict, params: SamplingParams, n_ctx: Optional[int],
                    default_last_n: Optional[int] = None,
                    infill_vocab: Optional[Callable[[], InfillVocab]] = None,
                    default_chain: tuple[str, ...] = LLAMA_SAMPLERS) -> SamplingParams:
    """llama-server's other sampling fields, read on every endpoint as llama-server reads them. repeat_last_n N:
    the penalties count the last N tokens, prompt included, as llama.cpp's (SamplingParams.penalty_last_n; -1: the
    context, 0: no penalties); left out, default_last_n (None: OpenAI's and vLLM's penalties, /v1's).
    Samplers speculant does not have are refused (400 naming the field) at any value that would change the
    output, and pass at their neutral ones (llama-server's defaults) or when "samplers" leaves them out (_in_chain);
    n_keep and n_discard only matter when a full context is shifted, which never happens here (it ends the
    generation)."""
    chain = _sampler_chain(body, default_chain)

    def number(name, default, integer=False):
        v = body.get(name)
        if v is None:
            return default
        if not (_is_int(v) if integer else _is_num(v)):
            raise _bad(f"'{name}' must be {'an integer' if integer else 'a number'}, got {json.dumps(v)[:50]}",
                       name, "invalid_type")
        return v

    def refuse(name, what, neutral):
        raise _bad(f"'{name}': {what} is not supported by this server (it decodes exactly the target's "
                   f"distribution after temperature, top_k, top_p, min_p and the penalties); {neutral}", name,
                   "unsupported_value")

    for name in ("mirostat_tau", "mirostat_eta", "dynatemp_exponent", "dry_base", "adaptive_target",
                 "adaptive_decay"):
        number(name, None)
    for name in ("n_keep", "n_discard", "dry_allowed_length"):
        number(name, None, integer=True)
    breakers = body.get("dry_sequence_breakers")
    if breakers is not None and not (isinstance(breakers, list) and all(isinstance(b, str) for b in breakers)):
        raise _bad("'dry_sequence_breakers' must be an array of strings", "dry_sequence_breakers", "invalid_type")
    if number("mirostat", 0, integer=True) != 0:
        refuse("mirostat", "Mirostat sampling", "0 (off) passes")
    if number("typical_p", 1.0) < 1.0 and "typ_p" in chain:
        refuse("typical_p", "locally typical sampling", "1 (off) passes")
    if number("top_n_sigma", -1.0) > 0 and "top_n_sigma" in chain:
        refuse("top_n_sigma", "top-n-sigma sampling", "-1 or 0 (off) passes")
    if number("dynatemp_range", 0.0) > 0 and "temperature" in chain:
        refuse("dynatemp_range", "dynamic temperature", "0 (off) passes")
    if number("xtc_probability", 0.0) > 0 and number("xtc_threshold", 0.1) <= 0.5 and "xtc" in chain:
        refuse("xtc_probability", "XTC sampling", "0 (off) passes")
    number("xtc_threshold", None)
    if (number("dry_multiplier", 0.0) != 0 and number("dry_penalty_last_n", -1, integer=True) != 0
            and "dry" in chain):
        refuse("dry_multiplier", "DRY sampling", "0 (off) passes")
    number("dry_penalty_last_n", None, integer=True)
    last_n = number("repeat_last_n", default_last_n, integer=True)
    if last_n is not None:
        if last_n < -1:
            raise _bad(f"'repeat_last_n' must be >= -1, got {last_n}", "repeat_last_n")
        params = with_repeat_last_n(params, last_n, n_ctx)
    params = _in_chain(params, chain, infill_vocab)
    if number("min_keep", 0, integer=True) > 1 and (params.top_k or params.top_p < 1.0 or params.min_p > 0.0):
        refuse("min_keep", "min_keep above 1 with top_k, top_p or min_p", "0 or 1 passes")
    return params


def _get_stop(body: dict, cfg: ServerConfig) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return list(cfg.stop)
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP:
            raise _bad(f"'stop' holds at most {MAX_STOP} strings, got {len(stop)}", "stop")
        if sum(len(s) for s in stop) > MAX_STOP_CHARS:
            raise _bad(f"'stop' strings hold at most {MAX_STOP_CHARS} characters together, got "
                       f"{sum(len(s) for s in stop)}", "stop")
        return stop
    raise _bad("'stop' must be a string or an array of strings", "stop", "invalid_type")


class InfillStop:
    """llama-server's stopping rules of /infill, applied to the text as it comes (Worker._run):
    n_indent: a line after the first that begins with less indentation (spaces, tabs) ends the completion
    before its first other character (an empty line too), as the end of the block being written;
    t_max_ms: once generation has run that long, the completion ends as soon as it has a new line."""

    def __init__(self, n_indent: int = 0, t_max_ms: float = 0.0, clock=time.monotonic):
        self.n_indent, self.t_max_ms, self.clock = n_indent, t_max_ms, clock
        self.text = ""  # what was kept so far
        self.line = None  # where the line being checked begins in text (None: before the first new line)
        self.t0: Optional[float] = None  # when the first piece came (generation had started)
        self.ended = ""  # the rule that ended the completion: "n_indent" or "t_max_predict_ms"

    def add(self, piece: str, final: bool = False) -> tuple[str, bool]:
        """The part of `piece` to keep, and whether the completion ends with it. final: the generation has ended
        (the text held back for a stop string that never came): only n_indent can still cut it."""
        if self.t0 is None:
            self.t0 = self.clock()
        begin = start = len(self.text)
        self.text += piece
        if self.n_indent > 0:
            while True:
                if self.line is None:
                    nl = self.text.find("\n", start)
                    if nl < 0:
                        break
                    self.line = nl + 1
                at = self.line
                while at < len(self.text) and self.text[at] in " \t":
                    at += 1
                if at == len(self.text):  # only indentation so far
                    break
                if at - self.line < self.n_indent:
                    self.text, self.ended = self.text[:at], "n_indent"
                    return self.text[begin:], True
                start, self.line = at, None
        if self.t_max_ms > 0 and not final and (self.clock() - self.t0) * 1000 > self.t_max_ms and \
                "\n" in self.text:
            self.ended = "t_max_predict_ms"
        return piece, bool(self.ended)


def parse_native(body: Any, cfg: ServerConfig, n_ctx: int, *, infill: bool) -> tuple[Job, Optional[list]]:
    """A request to llama-server's own endpoints -> a Job, and the response fields asked for (None: all).
    infill (/infill): the prompt is built when tokenized (Worker.tokenize: Engine.infill_prompt); else
    (/completion) `prompt` is a string or token ids. Raises APIError on anything wrong."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", None, "invalid_type")
    _no_lora(body)
    # llama-server's n_cmpl (completions of the prompt): left out one comes back for several asked for
    if _get_int(body, "n_cmpl", 1, lo=1) > 1:
        raise _bad("'n_cmpl' above 1 is not supported on /completion and /infill (one completion each); "
                   "/v1/completions and /v1/chat/completions take 'n'", "n_cmpl", "unsupported_value")
    model = body.get("model")
    if model is not None and model not in (cfg.model_id, "") and cfg.check_model:
        raise APIError(404, f"the model {json.dumps(model)[:80]} does not exist; this server serves "
                       f"'{cfg.model_id}'", param="model", code="model_not_found")
    texts, chunks, prompt = {}, [], ""
    if not infill:
        batch = _get_prompts(body.get("prompt"))
        if len(batch) > 1:
            raise _bad("/completion takes one prompt (a string or token ids); /v1/completions takes a batch",
                       "prompt", "unsupported_value")
        prompt = batch[0]
    for name in ("input_prefix", "input_suffix", "prompt") if infill else ():
        v = body.get(name, "" if name == "prompt" else None)
        if v is None:
            raise _bad(f"'{name}' is required (a string; it may be empty)", name, "missing_required_parameter")
        if not isinstance(v, str):
            raise _bad(f"'{name}' must be a string", name, "invalid_type")
        texts[name] = v
    extra = body.get("input_extra") or [] if infill else []
    if not isinstance(extra, list):
        raise _bad("'input_extra' must be an array of {\"filename\": string, \"text\": string} objects",
                   "input_extra", "invalid_type")
    for i, c in enumerate(extra):
        if not isinstance(c, dict) or not isinstance(c.get("text"), str) or \
                not isinstance(c.get("filename", "tmp"), str):
            raise _bad(f"input_extra[{i}] must be an object with a string 'text' (and a string 'filename')",
                       "input_extra", "invalid_type")
        chunks.append((c.get("filename", "tmp"), c["text"]))
    # 0: the prompt cached, nothing generated (as llama-server: editors such as llama.vim send their context ahead
    # this way)
    max_tokens = _get_max_tokens(body, cfg, lo=-1, n_ctx=n_ctx)
    # llama-server's alias: logprobs when n_probs is not given
    n_probs = _get_int(body, "n_probs" if body.get("n_probs") is not None else "logprobs", 0, lo=0,
                       hi=MAX_TOP_LOGPROBS)
    n_indent = _get_int(body, "n_indent", 0, lo=0)
    t_max = _get_num(body, "t_max_predict_ms", 0.0, 0.0, 1e9)
    _get_num(body, "t_max_prompt_ms", 0.0, -1.0, 1e9)  # accepted (prompt processing is never cut short)
    fields = body.get("response_fields")
    if fields is not None and not (isinstance(fields, list) and all(isinstance(f, str) for f in fields)):
        raise _bad("'response_fields' must be an array of strings", "response_fields", "invalid_type")
    params, bias_texts = _get_sampling(body, cfg, n_ctx=n_ctx, native=True)
    job = Job(prompt, False, max_tokens, params, [s for s in _get_stop(body, cfg) if s],
              _get_bool(body, "stream", False), False, grammar=_get_grammar(body), logprobs=n_probs or None,
              bias_texts=bias_texts)
    job.post_sampling = _get_bool(body, "post_sampling_probs", False)
    job.return_tokens = _get_bool(body, "return_tokens", False)
    if job.post_sampling and job.logprobs is not None and job.grammar is not None:
        raise _bad("'post_sampling_probs' with a grammar or JSON schema is not supported by this server (the "
                   "model's own log-probabilities are: leave it out)", "post_sampling_probs", "unsupported_value")
    if infill:
        job.infill = {"prefix": texts["input_prefix"], "suffix": texts["input_suffix"], "middle": texts["prompt"],
                      "extra": chunks, "room": min(max_tokens, n_ctx // 4), "spm": cfg.spm_infill}
    if n_indent or t_max:
        job.stop_rule = InfillStop(n_indent, t_max)
    return job, fields


def _fields(res: dict, paths: Optional[list]) -> dict:
    """llama-server's response_fields: only those paths ("timings/prompt_n" reads res["timings"]["prompt_n"]),
    each under its path; paths that are not there are left out."""
    if not paths:
        return res
    out = {}
    for path in paths:
        v = res
        for key in path.split("/"):
            if not isinstance(v, dict) or key not in v:
                break
            v = v[key]
        else:
            out[path] = v
    return out


def _get_prompts(prompt, empty_ok: bool = False) -> list:
    """/v1/completions' prompt: a string, an array of token ids, or an array of either (a batch) -> the
    prompts, each a str or a list of ids (empty only where empty_ok). As llama-server, an array may also mix
    token ids and strings ([12, "text", 34]: one prompt, the texts tokenized where they stand; Engine.mixed_ids),
    and so may each prompt of a batch."""
    def one(p, where: str):
        if isinstance(p, str):  # "" is BOS alone where the model starts with one, else refused when tokenized
            return p
        if isinstance(p, list) and (p or empty_ok) and all(_is_int(t) or isinstance(t, str) for t in p):
            return list(p)
        raise _bad(f"{where} must be a string or a non-empty array of token ids (strings may stand between them)",
                   "prompt", "invalid_type")

    mixed = isinstance(prompt, list) and any(_is_int(p) for p in prompt) and any(isinstance(p, str) for p in prompt)
    if isinstance(prompt, list) and prompt and not mixed and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise _bad(f"'prompt' batches at most {MAX_PROMPTS} prompts, got {len(prompt)}", "prompt")
        if len({type(p) for p in prompt}) > 1:  # OpenAI's types: an array of strings or of token-id arrays
            raise _bad("a 'prompt' batch holds strings or token-id arrays, not both", "prompt", "invalid_type")
        return [one(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    if prompt is None:
        raise _bad("'prompt' is required", "prompt", "invalid_type")
    return [one(prompt, "'prompt'")]


def _get_grammar(body: dict) -> Optional[str]:
    """OpenAI's response_format ({"type": "text" | "json_object" | "json_schema", "json_schema": {"schema":
    ...}}) or llama-server's `grammar` (GBNF text) -> the GBNF the output must follow, or None."""
    fmt, gbnf, schema = body.get("response_format"), body.get("grammar"), body.get("json_schema")
    given = [name for name, present in (("response_format", fmt not in (None, {"type": "text"})),
                                        ("grammar", gbnf is not None), ("json_schema", schema is not None)) if present]
    if len(given) > 1:
        raise _bad(f"give one of {' and '.join(repr(g) for g in given)}, not both", given[-1])
    if schema is not None:  # llama-server's field: a JSON schema itself
        return _schema_grammar(schema, "json_schema")
    if gbnf is not None:
        if not isinstance(gbnf, str) or not gbnf.strip():
            raise _bad("'grammar' must be a non-empty GBNF string", "grammar", "invalid_type")
        return gbnf
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise _bad("'response_format' must be an object with a 'type'", "response_format", "invalid_type")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":  # llama-server also reads a schema here
        return json_grammar() if fmt.get("schema") is None else _schema_grammar(fmt["schema"], "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise _bad("response_format.json_schema must be an object with a 'schema' object", "response_format",
                       "invalid_type")
        return _schema_grammar(spec.get("schema", {}), "response_format")
    raise _bad(f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
               "response_format", "unsupported_value")


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _holds_lone_surrogate(obj) -> bool:
    """Whether any string of a parsed JSON body (keys too) holds a surrogate that no pair completed: Python's
    JSON reader accepts "\\ud800" alone, and text with it cannot be encoded for the tokenizer."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _schema_grammar(schema, param: str) -> str:
    if not isinstance(schema, dict):
        raise _bad(f"'{param}' must hold a JSON schema object", param, "invalid_type")
    try:
        return json_grammar(schema)
    except SpeculantError as e:
        raise _bad(str(e), param) from None


def _get_logprobs(body: dict, chat: bool) -> Optional[int]:
    """Chat: logprobs (bool) and top_logprobs (0..20, only with logprobs); completions: logprobs (0..20)
    -> the number of alternatives per token, or None when logprobs are not wanted. llama-server's
    post_sampling_probs is read on its own endpoints (/completion, /infill): with logprobs asked for here it is
    refused rather than ignored."""
    if not chat:
        n = _get_int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    else:
        wanted = _get_bool(body, "logprobs", False)
        top = _get_int(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
        if top is not None and not wanted:
            raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        n = (top or 0) if wanted else None
    if _get_bool(body, "post_sampling_probs", False) and n is not None:
        raise _bad("'post_sampling_probs' is read on /completion and /infill (with n_probs); OpenAI's logprobs "
                   "here are the model's own", "post_sampling_probs", "unsupported_value")
    return n


MAX_BIAS_TOKENS = 4096  # tokens the texts of one request's logit_bias may add up to


def _get_logit_bias(body: dict, cfg: ServerConfig) -> tuple[tuple, tuple]:
    """logit_bias -> ((id, bias), ...) and ((text, bias), ...); the server default if absent. Two forms, on every
    endpoint: OpenAI's object {"token id": bias}, and llama-server's array [[token id or text, bias], ...] (a text:
    each of its tokens). A bias is a number in [-100, 100], or false: the token banned (llama-server's)."""
    bias = body.get("logit_bias")
    if bias is None:
        return cfg.logit_bias, ()
    if isinstance(bias, dict):
        items = list(bias.items())
    elif isinstance(bias, list):
        items = []
        for i, el in enumerate(bias):
            if not (isinstance(el, list) and len(el) == 2):
                raise _bad(f"logit_bias[{i}] must be a [token id or text, bias] pair, got {json.dumps(el)[:50]}",
                           "logit_bias", "invalid_type")
            items.append((el[0], el[1]))
    else:
        raise _bad("'logit_bias' must be an object mapping token ids to biases, or an array of [token id or text, "
                   "bias] pairs", "logit_bias", "invalid_type")
    if len(items) > MAX_LOGIT_BIAS:
        raise _bad(f"'logit_bias' holds at most {MAX_LOGIT_BIAS} tokens, got {len(items)}", "logit_bias")
    out, texts = [], []
    for key, value in items:
        if value is False:
            b = -math.inf
        elif _is_num(value) and -100 <= value <= 100:
            b = float(value)
        else:
            raise _bad(f"logit_bias[{json.dumps(key)[:30]}] must be a number in [-100, 100] or false (a ban), got "
                       f"{json.dumps(value)[:50]}", "logit_bias")
        if isinstance(bias, dict):
            if not (isinstance(key, str) and re.fullmatch(r"\s*[0-9]+\s*", key)):  # ASCII digits: int("²") fails
                raise _bad(f"logit_bias: keys must be token ids, got {key!r} (a text's tokens: the array form "
                           f"[[text, bias]])", "logit_bias", "invalid_type")
            token = int(key)
        elif _is_int(key) and key >= 0:
            token = key
        elif isinstance(key, str) and key:
            texts.append((key, b))
            continue
        else:
            raise _bad(f"logit_bias: {json.dumps(key)[:50]} is not a token id or a non-empty text", "logit_bias",
                       "invalid_type")
        if cfg.n_vocab is not None and token >= cfg.n_vocab:
            raise _bad(f"logit_bias: token id {token} is outside the vocabulary (0..{cfg.n_vocab - 1})", "logit_bias")
        out.append((token, b))
    return tuple(out), tuple(texts)


def _bias_text_tokens(job: Job, backend) -> None:
    """The tokens of the job's logit_bias texts, added to its params (on the tokenizing thread)."""
    if not job.bias_texts:
        return
    # as llama-server: a text's pieces, its control tokens' texts included (<|im_end|> is not the end token)
    extra = [(t, b) for text, b in job.bias_texts for t in backend.tokenize(text, add_special=False,
                                                                              parse_special=False)]
    if len(extra) > MAX_BIAS_TOKENS:
        raise _bad(f"the texts of 'logit_bias' hold {len(extra)} tokens, more than {MAX_BIAS_TOKENS}", "logit_bias")
    job.params = dataclasses.replace(job.params, logit_bias=tuple(job.params.logit_bias) + tuple(extra))
    job.bias_texts = ()


def _prompt_job(job: Job, prompt) -> Job:
    """Another prompt of a batched /v1/completions request, with the same settings."""
    return dataclasses.replace(job, prompt=prompt, tokens=[], more_prompts=[], admission=None)


def _wait_for_shared_prefixes(prompts: list[Job]) -> None:
    """A prompt of a batch that shares REUSE_MIN tokens or more with an earlier one waits until that one's
    prompt is processed (its first token; a scoring's end), then copies that slot's cache and scored entries
    (Engine.share_cache) instead of processing the prefix again at the same time on the same cores. An
    evaluation harness batches each question's answers this way."""
    for b, later in enumerate(prompts[1:], 1):
        shared, a = max((common_prefix(prompts[a].tokens, later.tokens), -a) for a in range(b))
        if shared >= REUSE_MIN:
            earlier = prompts[-a]
            earlier.started = earlier.started or asyncio.Event()
            later.after = earlier.started


def _echo_text(job: Job, engine) -> str:
    """The prompt as echo returns it: the text given, or the ids' text."""
    if isinstance(job.prompt, str):
        return job.prompt
    # ids, or ids and texts mixed: each run of ids as one text (a character may span ids)
    return "".join("".join(run) if is_text else engine.target.detokenize(list(run))
                   for is_text, run in itertools.groupby(job.prompt, key=lambda p: isinstance(p, str)))


def _choice_job(job: Job, i: int, engine) -> Job:
    """Choice i of a request with n > 1: the same prompt, its own seed (the request's + i) and grammar state."""
    seed = job.params.seed
    params = dataclasses.replace(job.params, seed=None if seed is None else (seed + i) % (1 << 64))
    return dataclasses.replace(job, params=params, constraint=_constraint(job, engine), cut=False, admission=None,
                               choice=i)


def _constraint(job: Job, engine):
    """The constraint a job decodes under: its grammar; or with tool_choice auto, one that holds each call the
    model chooses to write (from <tool_call> to </tool_call>) to a request function and its parameters' schema
    (constraint.TriggeredGrammar). Where that grammar cannot be made (the torch backend has no grammars), auto
    calls are only parsed, as before."""
    if job.grammar is not None:
        return _continued(job, engine.target, engine.target.grammar(job.grammar))
    if job.tools is None:
        return None
    try:
        body = job.tools.body_grammar()
        grammar = engine.target.grammar(body) if body is not None else None
    except SpeculantError as e:
        _LOG.debug("tool calls under tool_choice auto stay unconstrained: %s", e)
        return None
    if grammar is None:
        return None
    return TriggeredGrammar(engine.target.token_text, OPEN.encode(), grammar, CLOSE.encode())


def _continued(job: Job, target, constraint):
    """The constraint of a response format or grammar advanced over the final assistant message the answer
    continues (_message_tokens). A message the grammar does not allow is a 400: else the answer would start the
    grammar over after it, and the message as a whole would not follow it (`{"a": ` continued by a whole object).
    Not with tools: their calls are read from the answer's text alone (a call the message began is written anew)."""
    if not job.continued or job.tools is not None:
        return constraint
    for token in _message_tokens(job.tokens, job.continued.encode(), target):
        if not constraint.allowed(np.array([token]))[0]:
            raise _bad(f"the final assistant message, which the answer continues, does not follow the "
                       f"{job.grammar_param} the answer must: it breaks off at "
                       f"{target.token_text(token).decode('utf-8', 'replace')!r}", "messages")
        constraint.accept(token)
    return constraint


def _message_tokens(prompt: list[int], message: bytes, target) -> list[int]:
    """The tokens spelling `message`, which ends the prompt: the prompt's last tokens where they begin where it
    begins (what the model read); else, a token spanning the template and the message, the message's own
    tokens, where they spell it exactly (a SentencePiece vocabulary puts a space before a text of its own: then
    the grammar cannot be lined up with it, a 400)."""
    size, start = 0, len(prompt)
    while start > 0 and size < len(message):
        start -= 1
        size += len(target.token_text(prompt[start]))
    if size == len(message) and b"".join(target.token_text(t) for t in prompt[start:]) == message:
        return prompt[start:]
    alone = target.tokenize(message.decode(), add_special=False, parse_special=False)
    if b"".join(target.token_text(t) for t in alone) != message:
        raise _bad("the final assistant message cannot be lined up with the grammar the answer must follow (its "
                   "tokens spell it otherwise): leave the response format out, or end the conversation with "
                   "another role", "messages")
    return alone


class LogprobsFormat:
    """TokenLogprob entries -> OpenAI's logprobs objects (chat: {"content": [...]}; completions: tokens,
    token_logprobs, top_logprobs, text_offset), keeping the text offset across stream chunks."""

    def __init__(self, backend, chat: bool):
        self.backend, self.chat = backend, chat
        self.offset = 0  # completions' text_offset of the next token: characters of the text completed before it
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")  # a character may span tokens

    def _name(self, token: int) -> str:
        """Completions' name of a token: its text, or where its bytes are not whole UTF-8 characters OpenAI's
        "bytes:\\xe3\\x81" form (distinct tokens keep distinct names, so top_logprobs keys never collide)."""
        raw = self.backend.token_bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def _token(self, token: int) -> tuple[str, list[int]]:
        raw = self.backend.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def __call__(self, entries) -> Optional[dict]:
        if entries is None:
            return None
        if self.chat:
            content = []
            for e in entries:
                text, raw = self._token(e.token)
                top = []
                for t, lp in e.top:
                    t_text, t_raw = self._token(t)
                    top.append({"token": t_text, "logprob": lp, "bytes": t_raw})
                content.append({"token": text, "logprob": e.logprob, "bytes": raw, "top_logprobs": top})
            return {"content": content, "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            name = self._name(e.token)
            out["tokens"].append(name)
            out["token_logprobs"].append(e.logprob)
            # as OpenAI's: the top alternatives, and the chosen token's own logprob beside them (none for an
            # echoed prompt's first token)
            top = {self._name(t): lp for t, lp in e.top}
            if e.logprob is not None:
                top[name] = e.logprob
            out["top_logprobs"].append(top if e.logprob is not None else None)
            out["text_offset"].append(self.offset)
            self.offset += len(self.decoder.decode(self.backend.token_bytes(e.token)))
        return out


# ---------------------------------------------------------------------------------------------------------
# metrics


class _BatchedPasses:
    """The pass gatherer's running counts (batching.GATHERER), read at each scrape: counters, so that rate() and
    increase() see them as such."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        from .batching import GATHERER

        yield CounterMetricFamily("speculant_batched_passes", "forward passes run for concurrent request slots "
                                  "(--parallel > 1), merged or alone", value=GATHERER.passes)
        yield CounterMetricFamily("speculant_batched_pass_sequences", "sequences those passes computed (divided "
                                  "by speculant_batched_passes_total: requests per pass)", value=GATHERER.jobs)


class Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

        disable_created_metrics()

        self.registry = r = CollectorRegistry()
        self.requests = Counter("speculant_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.cancelled = Counter("speculant_requests_cancelled", "generations cut short by a client disconnect "
                                 "or shutdown", registry=r)
        self.prompt_tokens = Counter("speculant_prompt_tokens", "prompt tokens processed", registry=r)
        self.cached_prompt_tokens = Counter("speculant_prompt_tokens_cached", "of those, kept in a slot's cache "
                                            "from an earlier request (not evaluated again)", registry=r)
        self.prompt_copies = Counter("speculant_prompt_cache_copies", "prompt caches a slot copied from another "
                                     "slot (its KV stream) instead of processing the prompt", registry=r)
        self.completion_tokens = Counter("speculant_completion_tokens", "tokens generated", registry=r)
        self.drafted = Counter("speculant_drafted_tokens", "draft tokens sent to verification", registry=r)
        self.accepted = Counter("speculant_accepted_tokens", "draft tokens accepted", registry=r)
        self.target_calls = Counter("speculant_target_calls", "target model passes while decoding", registry=r)
        self.acceptance = Gauge("speculant_acceptance_rate", "accepted / drafted since start", registry=r)
        self.tau = Gauge("speculant_mean_accepted_length", "tau: tokens produced per target pass since start, "
                         "counting the target's own token (as usage.speculative.mean_accepted_length)", registry=r)
        self.queue_depth = Gauge("speculant_queue_depth", "requests waiting for a free slot", registry=r)
        self.in_progress = Gauge("speculant_requests_in_progress", "requests generating now (at most --parallel)",
                                 registry=r)
        r.register(_BatchedPasses())
        self.tps = Histogram("speculant_tokens_per_second", "decode speed per request", registry=r,
                             buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000))
        self.latency = Histogram("speculant_request_duration_seconds", "request latency, queueing included",
                                 registry=r, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.ttft = Histogram("speculant_time_to_first_token_seconds", "time to the first generated token",
                              registry=r, buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self._drafted = self._accepted = self._produced = self._calls = 0
        self._add_memory(r)

    def _add_memory(self, r) -> None:
        """Process memory (prometheus-client's process collector, and the peak it does not give) and the
        memory plan's estimate per model (set_models)."""
        from prometheus_client import Gauge, ProcessCollector

        from . import memory

        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_virtual_memory_bytes, ...
        Gauge("speculant_process_peak_rss_bytes", "peak resident set size of this process (VmHWM), model loading "
              "included", registry=r).set_function(lambda: memory.peak_rss_mb() * 2 ** 20)
        self.model_memory = Gauge("speculant_model_memory_planned_bytes", "the memory plan's estimate per loaded "
                                  "model at its context size (speculant plan: weights, KV cache, compute buffers)",
                                  ["role", "model"], registry=r)

    def set_models(self, planned: dict) -> None:
        for role, m in planned.items():
            self.model_memory.labels(role, m["model"]).set(m["planned_mb"] * 2 ** 20)

    def record(self, stats, prompt: bool = True) -> None:
        """Count a finished generation; prompt=False for a further choice of a prompt (n > 1), which took the
        first choice's processing and counts no prompt tokens of its own (as usage does)."""
        if prompt:
            self.prompt_tokens.inc(stats.prompt_tokens)
            self.cached_prompt_tokens.inc(stats.cached_prompt_tokens)
        self.completion_tokens.inc(stats.generated_tokens)
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.target_calls.inc(stats.target_calls)
        self._drafted += stats.drafted
        self._accepted += stats.accepted
        self._produced += stats.produced_tokens
        self._calls += stats.target_calls
        self.acceptance.set(self._accepted / self._drafted if self._drafted else 0.0)
        self.tau.set(self._produced / self._calls if self._calls else 0.0)
        if stats.generated_tokens and stats.tokens_per_s > 0:
            self.tps.observe(stats.tokens_per_s)


# ---------------------------------------------------------------------------------------------------------
# the engine worker


def worker_down(e: Exception) -> APIError:
    """An RPC worker of the target is down: 503 (the target restarts by itself once it is back)."""
    return APIError(503, str(e), type="server_error", code="worker_down")


def request_error(e: SpeculantError, job: Optional["Job"], prompt_param: str) -> APIError:
    """A request failed while parsed or tokenized: the API error to answer with. prompt_param: the field that
    overflows the context; a grammar or fill-in-the-middle failure names the field it came from."""
    if isinstance(e, ContextOverflowError):
        return APIError(400, str(e), param=prompt_param, code="context_length_exceeded")
    if isinstance(e, WorkerError):
        return worker_down(e)
    message, param = str(e), None
    if job is not None and job.grammar is not None and "grammar" in message:
        param = job.grammar_param
    elif job is not None and job.suffix is not None and ("fill-in-the-middle" in message or "suffix token id" in message):
        param = "suffix"
    elif message.startswith("the prompt is empty") or "prompt token id" in message:
        param = prompt_param
    return _bad(message, param)


def _step(gen):
    try:
        return next(gen)
    except StopIteration:
        return _DONE


SHUTDOWN_ABORT_S = 2.0  # past the grace period, what an RPC target's pass in flight gets before it is abandoned
SHUTDOWN_BACKSTOP_S = 30.0  # past --shutdown-timeout, what a pass in flight gets before uvicorn cancels it


class _Admission:
    """A request's places among the admitted ones (Worker.admitted): one per generation it runs (its prompts x
    n), each given back when that generation's run ends; what is left, when the request is dropped (an invalid
    prompt, a stream never begun)."""

    def __init__(self, worker: "Worker", places: int = 1):
        self._worker, self._left = worker, places
        worker.admitted += places

    def release(self, places: Optional[int] = None) -> None:
        """Give back `places` of them (default: all that are left)."""
        worker = self._worker
        if worker is None:
            return
        n = self._left if places is None else min(places, self._left)
        self._left -= n
        worker.admitted -= n
        if not self._left:
            self._worker = None

    __del__ = release


class _ClientStalled(Exception):
    """A client that took no part of its stream for --timeout seconds."""


_CUT_STREAM = contextvars.ContextVar("speculant_cut_stream", default=False)  # this connection's task cut its stream


class _NotIncomplete(logging.Filter):
    """Drops uvicorn's "returned without completing response" for a stream we cut on purpose (--timeout)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_CUT_STREAM.get() and "without completing response" in str(record.msg))


@dataclass
class SlotTask:
    """What GET /slots tells of a slot's latest generation."""

    id: int
    n_prompt: int
    max_tokens: int
    params: Any  # SamplingParams
    stream: bool
    n_probs: int
    result: Any  # engine.Result, filled as it runs


class Worker:
    """Runs each request on a slot: an engine of its own over a sequence of the shared models, stepped on the
    slot's own thread. Up to `len(engines)` requests decode at once (their passes merge: batching.py); the
    rest wait for a slot in arrival order."""

    def __init__(self, engines: list, metrics: Metrics, max_queue: int):
        self.engines = engines
        self.engine = engines[0]  # slot 0: owns the models; tokenizes, renders chat, reports health
        self.metrics = metrics
        self.max_queue = max_queue
        self.executors = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"speculant-slot{i}")
                          for i in range(len(engines))]
        # tokenizing must not wait for a slot's step (a long prompt held /tokenize and the queue's 503s for
        # seconds); only a target in a worker process (--rpc), which answers one call at a time, keeps it on
        # its slot's thread
        from .backends.supervised import SupervisedBackend

        self.tokenizer = self.executors[0] if isinstance(self.engine.target, SupervisedBackend) else \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="speculant-tokenize")
        self.free = list(range(len(engines)))  # idle slots
        self.last_used = [0] * len(engines)  # when each slot last took a request (_pick_slot)
        self._uses = itertools.count(1)
        # per slot, its latest generation (GET /slots): a SlotTask (not the Job: that holds its request's admission)
        self.last_task: list = [None] * len(engines)
        self._tasks = itertools.count()
        self.slots = asyncio.Semaphore(len(engines))
        self.waiting = 0  # requests waiting for a slot now
        self.admitted = 0  # requests admitted and not ended: running, tokenizing or waiting (Worker.admit)
        self.closing = False  # set on SIGINT/SIGTERM: no new generations; in-flight ones run until `deadline`
        self.deadline = math.inf
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._closed: Optional[asyncio.Event] = None  # set with closing: queued requests get their 503 at once

    def _held(self, prompt: list[int]) -> list[int]:
        """Per slot, how many tokens of the prompt its cache holds (a busy slot's token list, copied at once)."""
        return [common_prefix(list(getattr(e.target, "tokens", [])), prompt) for e in self.engines]

    def _pick_slot(self, held: list[int]) -> int:
        """The free slot for a prompt (held: _held(prompt)), as llama-server picks one: the one whose cache holds
        the longest prefix of it when that saves at least REUSE_MIN tokens of prompt processing (a
        conversation's next turn goes back to its slot), else the one used least recently (it keeps other
        conversations' caches longest) among those that keep the busy slots consecutive: llama.cpp merges the
        passes of consecutive sequence ids only."""
        best = max(self.free, key=lambda s: (held[s], -s))
        if held[best] >= REUSE_MIN:
            return best
        busy = [s for s in range(len(self.engines)) if s not in self.free]
        next_to = [s for s in self.free if not busy or s in (min(busy) - 1, max(busy) + 1)]
        return min(next_to or self.free, key=lambda s: (self.last_used[s], s))

    def _prefix_source(self, slot: int, held: list[int]) -> Optional[int]:
        """Another slot, free or busy, whose cache holds at least REUSE_MIN more tokens of the prompt than `slot`
        does (the one holding most), or None: its cache is copied rather than the prompt processed again."""
        if not hasattr(self.engines[slot].target, "copy_prefix"):
            return None
        best = max((s for s in range(len(self.engines)) if s != slot), key=lambda s: held[s], default=None)
        if best is None or held[best] < held[slot] + REUSE_MIN:
            return None
        return best

    @property
    def in_progress(self) -> int:
        return len(self.engines) - len(self.free)

    @property
    def queued(self) -> int:
        """Admitted requests not running yet (tokenizing, or waiting for a slot)."""
        return max(0, self.admitted - self.in_progress)

    def admit(self, job: Job) -> None:
        """Count a request in, or refuse it with a 503 when every slot is busy and --max-queue requests wait.
        Synchronous, so requests arriving in one event-loop turn are counted one by one (a check against the
        slots' semaphore let a burst through and refused others at random); called as a request arrives,
        before its prompt is tokenized, so a stream is refused before its 200."""
        if job.admission is not None:  # admitted already, or a further generation of an admitted request
            return
        if self.closing:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        if self.admitted >= len(self.engines) + self.max_queue:
            queued = self.queued
            raise APIError(503, f"the server is busy ({queued} request{'s' if queued != 1 else ''} queued); retry "
                                f"later", type="server_error", code="server_overloaded")
        job.admission = _Admission(self, job.n * (1 + len(job.more_prompts)))  # every generation holds a slot

    def begin_shutdown(self, grace_s: float) -> None:
        self.deadline = min(self.deadline, time.monotonic() + grace_s)
        self.closing = True
        abort_at = getattr(self.engine.target, "abort_at", None)  # a target on RPC workers, one of them maybe hung
        if abort_at is not None:
            abort_at(self.deadline + SHUTDOWN_ABORT_S)  # (a pass ends by itself first, and gives a clean cut)
        if self._loop is not None:  # from a signal handler too: the waiters are woken on the loop
            self._loop.call_soon_threadsafe(self._closed.set)

    async def _acquire_slot(self, is_disconnected=None) -> bool:
        """A free slot, waited for in arrival order (False: the client left meanwhile, and its place in the queue
        is given up at once, not when a slot frees: a request that is not streamed is not cancelled when its
        client leaves, so is_disconnected is asked every QUEUE_POLL seconds); a shutdown meanwhile is a 503 at
        once (not after the grace period of the requests in flight)."""
        if self._loop is None:
            self._loop, self._closed = asyncio.get_running_loop(), asyncio.Event()
            if self.closing:
                self._closed.set()
        acquire = asyncio.ensure_future(self.slots.acquire())
        closed = asyncio.ensure_future(self._closed.wait())

        def give_up() -> None:
            if acquire.done() and not acquire.cancelled() and acquire.exception() is None:
                self.slots.release()
            acquire.cancel()  # a pending acquire gives back a slot it was just granted (asyncio.Semaphore)

        try:
            while not (await asyncio.wait({acquire, closed}, return_when=asyncio.FIRST_COMPLETED,
                                          timeout=QUEUE_POLL if is_disconnected is not None else None))[0]:
                if await is_disconnected():
                    give_up()
                    return False
        except BaseException:  # this request was cancelled (its client left) while it waited
            give_up()
            raise
        finally:
            closed.cancel()
        if not acquire.done():
            acquire.cancel()
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        return True  # granted (even if the shutdown came at the same time: the caller checks `closing` next)

    async def tokenize(self, job: Job) -> None:
        """The prompt's tokens, and the grammar's constraint (a grammar llama.cpp rejects fails here, as a 400)."""
        def work():
            if job.infill is not None:
                job.tokens, job.truncated = self.engine.infill_prompt(**job.infill)
            else:
                job.tokens = self.engine.tokenize_prompt(job.prompt, is_chat=job.is_chat, suffix=job.suffix)
            _bias_text_tokens(job, self.engine.target)
            job.constraint = _constraint(job, self.engine)
            if job.constraint is not None and job.params.infill is not None:
                raise _bad(f"'samplers': {INFILL_WITH_GRAMMAR}", "samplers", "unsupported_value")

        await asyncio.get_running_loop().run_in_executor(self.tokenizer, work)

    async def run(self, job: Job, result, is_disconnected=None) -> AsyncIterator:
        """Yield TokenEvents of one generation; `result` is filled when this ends. Closing this iterator
        (a disconnect, a cancellation) stops the generation after the step in progress."""
        self.admit(job)
        try:
            async with aclosing(self._run(job, result, is_disconnected)) as events:
                async for event in events:
                    if job.started is not None:  # the first token: the prompt is in this slot's cache
                        job.started.set()
                    yield event
        finally:
            if job.started is not None:  # however it ended, the other choices stop waiting
                job.started.set()
            if job.admission is not None:
                job.admission.release(1)

    async def _run(self, job: Job, result, is_disconnected) -> AsyncIterator:
        if self.closing:
            raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
        if job.after is not None:  # the first choice processes the prompt; this one then copies its cache
            await job.after.wait()
        self.waiting += 1
        self.metrics.queue_depth.set(self.waiting)
        try:
            granted = await self._acquire_slot(is_disconnected)
        finally:
            self.waiting -= 1
            self.metrics.queue_depth.set(self.waiting)
        if not granted:  # the client left while this waited
            self.metrics.cancelled.inc()
            return
        held = self._held(job.tokens)
        slot = job.slot = self._pick_slot(held)
        self.free.remove(slot)
        self.last_used[slot] = next(self._uses)
        self.last_task[slot] = SlotTask(next(self._tasks), len(job.tokens), job.max_tokens, job.params, job.stream,
                                        job.logprobs or 0, result)
        engine, executor = self.engines[slot], self.executors[slot]
        loop = asyncio.get_running_loop()
        gen = None
        finished = False
        stop = threading.Event()  # set when this request ends early: a prompt in flight stops between its passes
        engine.target.should_stop = stop.is_set
        try:
            if self.closing:
                raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")
            self.metrics.in_progress.set(self.in_progress)
            if is_disconnected is not None and await is_disconnected():
                self.metrics.cancelled.inc()
                return
            source = self._prefix_source(slot, held)
            if source is not None:
                try:
                    now = await loop.run_in_executor(executor, engine.share_cache, self.engines[source], job.tokens)
                except WorkerError as e:
                    raise worker_down(e) from None
                if now > held[slot]:  # copied (between passes the source may have held less than seen here)
                    _LOG.debug("slot %d took %d prompt tokens from slot %d's cache", slot, now, source)
                    self.metrics.prompt_copies.inc()
            if job.echo and job.logprobs is not None:
                try:
                    job.prompt_logprobs = await loop.run_in_executor(executor, engine.prompt_logprobs, job.tokens,
                                                                     job.logprobs, result.stats)
                except WorkerError as e:
                    raise worker_down(e) from None
            if job.max_tokens == 0 and not job.echo:  # llama-server's n_predict 0: the prompt into this slot's cache
                try:
                    cached = await loop.run_in_executor(executor, engine.target.prefill, job.tokens[:-1])
                except WorkerError as e:
                    raise worker_down(e) from None
                result.stats.cached_prompt_tokens = cached or 0
            if job.max_tokens == 0:  # echo only: the prompt scored, nothing generated
                result.stats.prompt_tokens, result.finish_reason = len(job.tokens), "length"
                self.metrics.record(result.stats, prompt=job.choice == 0)
                finished = True
                return
            first_step = True
            gen = engine.stream(job.tokens, max_tokens=job.max_tokens, params=job.params, stop=job.stop,
                                is_chat=job.is_chat, result=result, prediction=job.prediction,
                                logprobs=job.logprobs, constraint=job.constraint, post_sampling=job.post_sampling)
            while True:
                if self.closing and time.monotonic() >= self.deadline:
                    job.cut = True
                    break
                if is_disconnected is not None and await is_disconnected():
                    break
                try:
                    step = loop.run_in_executor(executor, _step, gen)
                    # read its outcome even if this request is cancelled while it runs (no "never retrieved")
                    step.add_done_callback(lambda f: f.cancelled() or f.exception())
                    if first_step:
                        # it processes the prompt (seconds for a long one): watch the client and a shutdown's
                        # deadline meanwhile (past it, uvicorn cancels the handler: a bare 500, a cut stream)
                        while not (await asyncio.wait({step}, timeout=0.25))[0]:
                            if self.closing and time.monotonic() >= self.deadline:
                                job.cut = True
                                stop.set()
                                break
                            if is_disconnected is not None and await is_disconnected():
                                stop.set()
                                break
                    first_step = False
                    event = await step
                except Cancelled:  # the client left during the prompt
                    break
                except WorkerError as e:
                    raise worker_down(e) from None
                if event is _DONE:
                    finished = True
                    rule = job.stop_rule
                    if rule is not None and not rule.ended and result.text.startswith(rule.text):
                        # the tail held back as the start of a stop string that never came: the rule reads it
                        # too (the answer is the rule's text once it ends)
                        if rule.add(result.text[len(rule.text):], final=True)[1]:
                            result.finish_reason = "stop"
                    break
                if job.stop_rule is not None:
                    event.text, ended = job.stop_rule.add(event.text)
                    if ended:  # the rule's text is the answer (the generator's is cut when it is closed)
                        finished, result.finish_reason = True, "stop"
                        yield event
                        break
                yield event
        finally:
            stop.set()
            if gen is not None:
                if not finished:
                    self.metrics.cancelled.inc()
                # on the slot's thread, after the step in flight; runs before the slot's next request
                closing = None
                try:
                    closing = executor.submit(gen.close)
                except RuntimeError:  # the executor is already shut down (a cancellation at exit)
                    pass
                try:
                    if finished and closing is not None:
                        # ended here (a stop rule), not by the engine: its own end fills in the stats the answer
                        # and the metrics give (memory, ...); shielded: a cancellation must not unqueue it
                        try:
                            await asyncio.shield(asyncio.wrap_future(closing))
                        except Exception:
                            _LOG.exception("closing a generation failed")
                finally:
                    self.metrics.record(result.stats, prompt=job.choice == 0)
                    self._release(slot)
            else:
                self._release(slot)

    def _release(self, slot: int) -> None:
        self.free.append(slot)
        self.metrics.in_progress.set(self.in_progress)
        self.slots.release()

    def shutdown(self) -> None:
        self.closing = True
        for executor in self.executors[1:]:  # the other slots' last steps end before slot 0 frees the models
            executor.shutdown(wait=True)
        if self.tokenizer is not self.executors[0]:
            self.tokenizer.shutdown(wait=True)
        self.executors[0].submit(self.engine.close)
        self.executors[0].shutdown(wait=True)


# ---------------------------------------------------------------------------------------------------------
# the app


def _message(result) -> dict:
    """{"message": why} when finish_reason alone misleads (a full context also reads "length")."""
    return {"message": result.message} if result.message else {}


def log_request(request, status: str, t0: float, stats=None, max_tokens: Optional[int] = None,
                n: int = 1) -> None:
    """One info line per /v1 request: what was asked, what it cost, how speculation did. stats: one
    generation's, or a list of its choices' (n per prompt), summed as usage sums them."""
    if not _LOG.isEnabledFor(logging.INFO):
        return
    line = f"{request.method} {request.url.path} {status} {time.perf_counter() - t0:.2f}s"
    every = stats if isinstance(stats, list) else [stats] if stats is not None else []
    calls = sum(s.target_calls for s in every)
    if calls:
        produced, generated = sum(s.produced_tokens for s in every), sum(s.generated_tokens for s in every)
        decode_s = sum(s.decode_time for s in every)
        limit = f"{len(every)}x{max_tokens}" if len(every) > 1 else max_tokens  # choices x max_tokens
        line += (f" prompt={sum(s.prompt_tokens for s in every[::n])} completion={generated}/{limit}"
                 f" drafted={sum(s.drafted for s in every)} "
                 f"accepted={sum(s.accepted for s in every)} tau={produced / calls:.2f}"
                 f" tok/s={generated / decode_s if decode_s > 0 else 0.0:.1f}")
    client = request.client
    _LOG.info("%s%s", line, f" client={client.host}" if client else "")


def _usage(results, n: int = 1) -> dict:
    """OpenAI's usage of one request (its choices, n per prompt: each prompt counted once), and `speculative`:
    the stats of its generation (as `generate --json`), a list of one per choice when there are several."""
    if not isinstance(results, list):
        results = [results]
    stats = [r.stats for r in results]
    prompt = sum(s.prompt_tokens for s in stats[::n])
    cached = sum(s.cached_prompt_tokens for s in stats[::n])
    completion = sum(s.generated_tokens for s in stats)
    accepted = sum(s.accepted_by_source.get("prediction", 0) for s in stats)
    drafted = sum(s.drafted_by_source.get("prediction", 0) for s in stats)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                          "accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": drafted - accepted},
            "speculative": stats[0].to_dict() if len(stats) == 1 else [s.to_dict() for s in stats]}


async def _run_all(coros: list) -> None:
    """Run the coroutines as tasks until all end; the first to fail cancels the others, and its error is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _system_fingerprint(target, build: Optional[dict]) -> str:
    """OpenAI's system_fingerprint: what decides an answer's bits beside the model and the request, as far as the
    server knows them (speculant's version, the llama.cpp build, its version and CPU kernels, repacking, whether the
    numerics are exact; or torch, its device, GPU and dtype). Where it differs, a seed may answer differently."""
    from . import __version__

    parts = [__version__, type(target).__name__, str(getattr(target, "exact_numerics", ""))]
    if hasattr(target, "device"):  # the torch backend
        import torch

        device = getattr(target, "device", None)
        gpu = torch.cuda.get_device_name(device) if getattr(device, "type", "") == "cuda" else ""
        parts += [torch.__version__, str(device), gpu, str(getattr(target, "dtype", ""))]
    else:
        import llama_cpp

        from .api import repack_weights
        from .native import loaded_variant

        parts += [(build or {}).get("key", "stock"), llama_cpp.__version__, loaded_variant() or "",
                  str(repack_weights())]
    return "fp_" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:10]


def create_app(engine, cfg: ServerConfig):
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.requests import ClientDisconnect

    from .engine import Result
    from .stats import SpecStats

    metrics = Metrics()
    from .memory import engine_models

    if cfg.n_vocab is None:
        cfg.n_vocab = engine.target.n_vocab
    if cfg.n_ctx is None:
        cfg.n_ctx = engine.target.n_ctx
    cfg.eog_ids = tuple(engine.target.eog_ids())
    # the infill sampler's vocabulary: built on the first request whose samplers list "infill" (~0.4 s, on the
    # event loop), ahead in a thread for a model editors complete code with (it has fill-in-the-middle tokens)
    cfg.infill_vocab = engine.target.infill_vocab
    if engine.target.fim_tokens() is not None:
        def build():
            try:
                engine.target.infill_vocab()
            except SpeculantError:  # no end-of-text token: requests listing "infill" get the reason, as a 400
                pass
        threading.Thread(target=build, name="infill-vocab", daemon=True).start()

    metrics.set_models(engine_models(engine))
    worker = Worker([engine.for_slot(i) for i in range(cfg.parallel)], metrics, cfg.max_queue)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app):
        yield
        worker.begin_shutdown(0.0)  # anything still generating stops at its next step
        await asyncio.get_running_loop().run_in_executor(None, worker.shutdown)

    app = FastAPI(title="speculant", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    if cfg.allowed_origins:  # a chat page served from elsewhere calls the API from the browser (as vLLM's default)
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=cfg.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"])
    app.state.worker = worker
    app.state.metrics = metrics

    def error_response(e: APIError, endpoint: str = "", request: Optional[Request] = None) -> JSONResponse:
        if endpoint:
            metrics.requests.labels(endpoint, str(e.status)).inc()
        if request is not None and request.url.path.startswith("/v1/"):
            log_request(request, f"{e.status} {e.code}", request.state.t0 if hasattr(request.state, "t0")
                        else time.perf_counter())
        headers = ({"WWW-Authenticate": "Bearer"} if e.status == 401
                   else {"Retry-After": "1"} if e.status == 503 and e.code == "server_overloaded"
                   else {"Connection": "close"} if e.status == 408 else None)  # the rest of its body never came
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e, request.url.path, request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error_response(APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                       code=code), request=request)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, e: ClientDisconnect):
        # the client went away while sending its request body: no one reads an answer; logged and counted
        # as 499, as a client that leaves a stream is
        return error_response(APIError(499, "the client closed the connection before sending its whole request",
                                       code="client_closed_request"), request.url.path, request)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        return error_response(_bad("invalid request: " + "; ".join(str(x.get("msg")) for x in e.errors()),
                                   code="invalid_request"), request=request)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception):
        _LOG.exception("internal error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(e).__name__}", type="server_error",
                                       code="internal_error"), request.url.path, request)

    api_keys = [k.encode() for k in cfg.api_keys()]

    def check_auth(request: Request) -> None:
        """As llama-server: the key in 'Authorization: Bearer KEY', else in 'X-Api-Key: KEY' (Anthropic's header);
        any key of the --api-key list."""
        if not api_keys:
            return
        # either header, with or without its "Bearer " (llama-server strips it where it is there)
        token = (request.headers.get("authorization") or request.headers.get("x-api-key") or "").strip()
        token = token[len("Bearer "):].strip() if token[:len("Bearer ")].lower() == "bearer " else token
        # every key compared (in constant time each): which one matched, or that none did, takes as long
        if not sum(hmac.compare_digest(token.encode(), k) for k in api_keys):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY' or 'X-Api-Key: KEY')",
                           code="invalid_api_key")

    async def read_json(request: Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > cfg.max_body_bytes:
            raise APIError(413, f"the request body is larger than {cfg.max_body_bytes} bytes",
                           code="body_too_large")
        chunks, size = [], 0
        body = request.stream().__aiter__()
        while True:  # each part within --timeout of the one before (a slow upload that goes on is not cut)
            try:
                async with asyncio.timeout(cfg.io_timeout_s):
                    chunk = await anext(body)
            except StopAsyncIteration:
                break
            except TimeoutError:
                raise APIError(408, f"the request body stopped arriving: nothing for {cfg.io_timeout_s:g} s "
                               f"(--timeout); {size} bytes came", code="request_timeout") from None
            size += len(chunk)
            if size > cfg.max_body_bytes:
                raise APIError(413, f"the request body is larger than {cfg.max_body_bytes} bytes",
                               code="body_too_large")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise _bad(f"the request body is not valid JSON: {e}", None, "invalid_json") from None
        if _SURROGATE_ESCAPE.search(raw) and _holds_lone_surrogate(body):
            raise _bad("the request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair), "
                       "which is not text", None, "invalid_json")
        return body

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' and uptime checkers' probes
    @app.api_route("/v1/health", methods=["GET", "HEAD"])  # llama-server's alias
    async def health():
        body = {"status": "shutting_down" if worker.closing else "ok", "model": cfg.model_id,
                "draft_model": cfg.draft_id, "queue_depth": worker.queued,
                "in_progress": worker.in_progress, "slots": len(worker.engines)}
        workers = getattr(engine.target, "health", None)  # RPC workers of a split target
        if workers is None:
            return body
        body["workers"] = await asyncio.to_thread(workers)
        down = [ep for ep, state in body["workers"].items() if state != "up"]
        if down and not worker.closing:
            body["status"] = "worker_down"
            body["message"] = (f"RPC worker {', '.join(down)} is down; requests get 503 until it is back"
                               if all(body["workers"][ep].startswith("down") for ep in down) else
                               "; ".join(f"RPC worker {ep}: {body['workers'][ep]}" for ep in down))
            return JSONResponse(body, status_code=503)
        return body

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    @app.get("/models")  # llama-server's alias
    async def list_models(request: Request):
        request.state.t0 = time.perf_counter()
        check_auth(request)
        metrics.requests.labels(request.url.path, "200").inc()
        log_request(request, "200", request.state.t0)
        return {"object": "list", "data": [model_object()]}

    def model_object() -> dict:
        return {"id": cfg.model_id, "object": "model", "created": created, "owned_by": "speculant",
                "draft_model": cfg.draft_id}

    @app.get("/v1/models/{model_id:path}")  # client.models.retrieve(); ids may hold slashes (paths)
    async def retrieve_model(request: Request, model_id: str):
        request.state.t0 = time.perf_counter()
        try:
            check_auth(request)
            if model_id != cfg.model_id and cfg.check_model:  # else any name is served (as by the completions)
                raise APIError(404, f"the model '{model_id}' does not exist; this server serves '{cfg.model_id}'",
                               param="model", code="model_not_found")
        except APIError as e:  # counted under /v1/models: a label per asked-for id would grow without bound
            return error_response(e, "/v1/models", request)
        metrics.requests.labels("/v1/models", "200").inc()
        log_request(request, "200", request.state.t0)
        return {**model_object(), "id": model_id, "root": cfg.model_id}  # root: what serves it (vLLM's field)

    def settings(params: SamplingParams, max_tokens: int, stream: bool = False, n_probs: int = 0) -> dict:
        """llama-server's generation settings ("params" of /props and /slots, the fields it gives there); the
        samplers speculant does not have at their neutral values, which are the ones it decodes with."""
        banned = {t for t, b in params.logit_bias if b == -math.inf}
        return {"seed": -1 if params.seed is None else params.seed, "temperature": params.temperature,
                "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "top_k": params.top_k, "top_p": params.top_p,
                "min_p": params.min_p, "top_n_sigma": -1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1,
                "typical_p": 1.0,
                # OpenAI's penalties (None) count the whole output (presence, frequency) and context (repetition)
                "repeat_last_n": -1 if params.penalty_last_n is None or params.penalty_last_n >= (cfg.n_ctx or 0)
                else params.penalty_last_n,
                "repeat_penalty": params.repetition_penalty,
                "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
                "dry_multiplier": 0.0, "mirostat": 0, "max_tokens": max_tokens, "n_predict": max_tokens,
                "ignore_eos": bool(cfg.eog_ids) and banned.issuperset(cfg.eog_ids), "stream": stream,
                "n_probs": n_probs}

    from . import __version__
    from .chat import CHATML
    from .native import build_info

    _build = build_info()
    system_fingerprint = _system_fingerprint(engine.target, _build)
    props = {  # what GET /props answers (its fixed part)
        "total_slots": len(worker.engines), "model_alias": cfg.model_id,
        "model_path": str(getattr(engine.target, "path", None) or cfg.model_id),
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": cfg.endpoint_slots, "endpoint_props": False, "endpoint_metrics": True,
        "chat_template": engine.target.chat_template() or CHATML,  # what chat requests render with
        "bos_token": engine.target.bos_token, "eos_token": engine.target.eos_token,
        "build_info": f"speculant-{__version__}" + (f" llama.cpp-{_build['llama_cpp_commit'][:8]}"
                                                    if _build and _build.get("llama_cpp_commit") else ""),
        "is_sleeping": False, "draft_model": cfg.draft_id,
    }

    @app.get("/props")
    async def get_props(request: Request):
        """llama-server's server properties (llama.cpp's webui and other tools read n_ctx, total_slots, model_path,
        chat_template from it)."""
        t0 = request.state.t0 = time.perf_counter()
        check_auth(request)
        defaults = with_repeat_last_n(SamplingParams(
            cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p, cfg.seed, logit_bias=cfg.logit_bias,
            presence_penalty=cfg.presence_penalty, frequency_penalty=cfg.frequency_penalty,
            repetition_penalty=cfg.repetition_penalty), cfg.repeat_last_n, cfg.n_ctx)
        if cfg.ignore_eos:
            defaults = with_eog_banned(defaults, cfg.eog_ids)
        metrics.requests.labels("/props", "200").inc()
        log_request(request, "200", t0)
        params = {**settings(defaults, cfg.max_tokens), "samplers": list(cfg.samplers)}  # as serve --samplers
        return {"default_generation_settings": {"params": params, "n_ctx": cfg.n_ctx}, **props}

    @app.api_route("/v1/embeddings", methods=["POST"])
    @app.api_route("/embeddings", methods=["POST"])
    @app.api_route("/embedding", methods=["POST"])
    @app.api_route("/v1/rerank", methods=["POST"])
    @app.api_route("/rerank", methods=["POST"])
    @app.api_route("/reranking", methods=["POST"])
    @app.api_route("/v1/responses", methods=["POST"])
    async def unsupported(request: Request):
        """OpenAI's and llama-server's endpoints this server has not: a 501 saying so (a bare 404 read as a wrong
        URL), as llama-server answers embeddings without --embeddings."""
        request.state.t0 = time.perf_counter()
        check_auth(request)
        what = ("the Responses API (use /v1/chat/completions)" if request.url.path == "/v1/responses" else
                "reranking" if "rerank" in request.url.path else "embeddings")
        raise APIError(501, f"this server does not support {what}: it generates text, speculatively",
                       type="not_supported_error", code="not_supported")

    @app.get("/slots")
    async def get_slots(request: Request):
        """llama-server's slot monitor (without --slots-debug: no prompt or output text): per slot, whether it is
        decoding, and its latest generation's prompt, cache and progress."""
        t0 = request.state.t0 = time.perf_counter()
        check_auth(request)
        if not cfg.endpoint_slots:
            raise APIError(501, "This server does not support slots endpoint. Start it with `--slots`",
                           type="not_supported_error", code="not_supported")
        if request.query_params.get("fail_on_no_slot") and not worker.free:
            raise APIError(503, "no slot available", type="unavailable_error", code="no_slot_available")
        out = []
        for i, slot_engine in enumerate(worker.engines):
            processing = i not in worker.free
            entry = {"id": i, "n_ctx": slot_engine.target.n_ctx, "speculative": cfg.draft_id is not None,
                     "is_processing": processing}
            task = worker.last_task[i]
            if task is not None:
                stats = task.result.stats
                entry.update({
                    "id_task": task.id, "n_prompt_tokens": task.n_prompt,
                    "n_prompt_tokens_processed": max(0, task.n_prompt - stats.cached_prompt_tokens),
                    "n_prompt_tokens_cache": stats.cached_prompt_tokens,
                    "params": settings(task.params, task.max_tokens, task.stream, task.n_probs),
                    "next_token": [{"has_next_token": processing, "has_new_line": "\n" in task.result.text,
                                    "n_remain": max(0, task.max_tokens - stats.generated_tokens),
                                    "n_decoded": stats.generated_tokens}]})
            out.append(entry)
        metrics.requests.labels("/slots", "200").inc()
        log_request(request, "200", t0)
        return out

    @app.post("/apply-template")
    async def apply_template(request: Request):
        """llama-server's: a chat request's messages (and tools) -> {"prompt": the text /v1/chat/completions
        would decode}, rendered the same way."""
        t0 = request.state.t0 = time.perf_counter()
        check_auth(request)
        body = await read_json(request)
        if not isinstance(body, dict):
            raise _bad("the request body must be a JSON object", None, "invalid_type")
        try:
            tools = parse_tools(body)
        except ToolsError as e:
            raise _bad(str(e), e.param) from None
        try:
            prompt, _ = render_messages(body, engine.chat_prompt, tools)
        except SpeculantError as e:
            raise _bad(str(e), "messages") from None
        metrics.requests.labels("/apply-template", "200").inc()
        log_request(request, "200", t0)
        return {"prompt": prompt}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """llama-server's: {"content": text, "add_special": false, "parse_special": true, "with_pieces": false} ->
        {"tokens": [...]} (with pieces: [{"id", "piece"}], the piece as text, or as byte values where it is not
        whole UTF-8); parse_special false reads control tokens' texts (<|im_end|>) as plain text."""
        t0 = request.state.t0 = time.perf_counter()
        check_auth(request)
        body = await read_json(request)
        if not isinstance(body, dict) or not isinstance(body.get("content"), str):
            raise _bad("'content' must be a string", "content", "invalid_type")
        add_special = _get_bool(body, "add_special", False)
        parse_special = _get_bool(body, "parse_special", True)
        with_pieces = _get_bool(body, "with_pieces", False)
        target = engine.target
        tokens = await asyncio.get_running_loop().run_in_executor(
            worker.tokenizer, lambda: target.tokenize(body["content"], add_special=add_special,
                                                      parse_special=parse_special))
        out: list = tokens
        if with_pieces:
            out = []
            for t in tokens:
                raw = target.token_text(t)
                try:
                    out.append({"id": t, "piece": raw.decode("utf-8")})
                except UnicodeDecodeError:
                    out.append({"id": t, "piece": list(raw)})
        metrics.requests.labels("/tokenize", "200").inc()
        log_request(request, "200", t0)
        return {"tokens": out}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """llama-server's: {"tokens": [ids]} -> {"content": text}."""
        t0 = request.state.t0 = time.perf_counter()
        check_auth(request)
        body = await read_json(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
            raise _bad("'tokens' must be an array of token ids", "tokens", "invalid_type")
        bad = [t for t in tokens if not 0 <= t < engine.target.n_vocab]
        if bad:
            raise _bad(f"token id {bad[0]} is outside the vocabulary (0..{engine.target.n_vocab - 1})", "tokens")
        metrics.requests.labels("/detokenize", "200").inc()
        log_request(request, "200", t0)
        return {"content": engine.target.detokenize(tokens)}

    def probabilities(entries, post_sampling: bool = False) -> list:
        """llama-server's completion_probabilities (n_probs) of TokenLogprob entries; post_sampling: as its
        post_sampling_probs gives them, probabilities ("prob", "top_probs") of the sampling distribution."""
        def one(token: int, logprob: float) -> dict:
            raw = engine.target.token_bytes(token)
            return {"id": token, "token": raw.decode("utf-8", errors="replace"), "bytes": list(raw),
                    **({"prob": math.exp(logprob)} if post_sampling else {"logprob": logprob})}
        top = "top_probs" if post_sampling else "top_logprobs"
        return [{**one(e.token, e.logprob), top: [one(t, lp) for t, lp in e.top]} for e in entries]

    def first_token_timer(t0: float):
        """on_token() for each token event: observes the time to the first one."""
        pending = [True]

        def on_token() -> None:
            if pending[0]:
                metrics.ttft.observe(time.perf_counter() - t0)
                pending[0] = False
        return on_token

    def event_stream(events: AsyncIterator[str], endpoint: str, done) -> StreamingResponse:
        """Server-sent events. An error after the 200 has started goes in-band, as a last `data:` event with
        the error object (where OpenAI's and llama-server's clients read it); done(status) when it ends."""
        async def guarded():
            status = "200"
            try:
                async with aclosing(events) as inner:
                    async for event in inner:
                        yield event
            except APIError as e:
                status = str(e.status)
                yield f"data: {json.dumps(e.body())}\n\n"
            except SpeculantError as e:
                status = "400"
                yield f"data: {json.dumps(_bad(str(e)).body())}\n\n"
            except (asyncio.CancelledError, GeneratorExit):
                status = "499"  # the client went away
                raise
            except Exception as e:  # a bug: tell the client in-band, keep serving
                _LOG.exception("%s failed", endpoint)
                status = "500"
                err = APIError(500, f"internal error: {type(e).__name__}", type="server_error",
                               code="internal_error")
                yield f"data: {json.dumps(err.body())}\n\n"
            finally:
                done(status)

        return TimedStream(guarded(), media_type="text/event-stream",
                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    class TimedStream(StreamingResponse):
        """A stream that gives up on a client that takes no chunk for --timeout seconds: the chunk waits on it
        (uvicorn's send waits while the socket's buffers are full), and with it the request's slot."""

        async def stream_response(self, send) -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async with aclosing(self.body_iterator):  # ends the request (its slot) now, not when it is collected
                async for chunk in self.body_iterator:
                    try:
                        async with asyncio.timeout(cfg.io_timeout_s):
                            await send({"type": "http.response.body", "more_body": True,
                                        "body": chunk.encode(self.charset) if isinstance(chunk, str) else chunk})
                    except TimeoutError:
                        raise _ClientStalled() from None
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def __call__(self, scope, receive, send) -> None:
            try:
                await super().__call__(scope, receive, send)
            except _ClientStalled:  # uvicorn closes the connection of an unfinished response
                _LOG.warning("%s: the client took no data for %g s (--timeout): its stream is cut, its slot freed",
                             scope["path"], cfg.io_timeout_s)
                _CUT_STREAM.set(True)  # uvicorn's error line on that close would read as a bug of ours

    async def native(request: Request, infill: bool):
        """llama-server's own completion endpoints: /completion (a prompt) and /infill (code completion at a
        cursor, for llama.vim and llama.vscode: input_prefix, input_suffix, input_extra (other files), prompt
        (the cursor's line before it)) -> {"content", "stop_type", "timings", ...}; streamed as llama-server
        streams them (data: events, the last with "stop": true)."""
        endpoint = request.url.path
        t0 = request.state.t0 = time.perf_counter()
        check_auth(request)
        body = await read_json(request)
        job = None
        try:
            job, fields = parse_native(body, cfg, engine.target.n_ctx, infill=infill)
            if infill and engine.target.fim_tokens() is None:  # llama-server's answer: 501 not_supported
                raise APIError(501, f"Infill is not supported by this model: {engine.target.name} has no "
                               "fill-in-the-middle tokens; a code model has them (qwen2.5-coder-1.5b-instruct)",
                               type="not_supported_error", code="not_supported")
            worker.admit(job)  # a 503 at once when full, before tokenizing
            await worker.tokenize(job)
        except SpeculantError as e:
            raise request_error(e, job, "input_prefix" if infill else "prompt") from None
        result = Result("", [], SpecStats())
        entries = []  # with n_probs: the TokenLogprobs of the tokens handed out
        on_token = first_token_timer(t0)

        def response(final: bool, content: str, probs=None, tokens=()) -> dict:
            """tokens: with return_tokens, a stream chunk's (the final answer without a stream: all of them)"""
            stats, rule = result.stats, job.stop_rule
            if rule is not None and rule.ended or result.finish_reason == "length":
                stop_type = "limit"
            else:
                stop_type = "word" if result.stop_string else "eos" if stats.ended_by_eog else "none"
            out = {"index": 0, "content": content, "tokens": list(tokens) if job.return_tokens else [],
                   "id_slot": job.slot, "stop": final,
                   "model": cfg.model_id, "tokens_predicted": stats.generated_tokens,
                   "tokens_evaluated": len(job.tokens)}
            if job.logprobs is not None:
                out["completion_probabilities"] = probabilities(entries if probs is None else probs,
                                                                job.post_sampling)
            if not final:
                return out
            prompt_n, prompt_ms = len(job.tokens) - stats.cached_prompt_tokens, stats.prefill_time * 1000
            predicted_n, predicted_ms = stats.generated_tokens, stats.decode_time * 1000
            timings = {"prompt_n": prompt_n, "prompt_ms": prompt_ms,
                       "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
                       "prompt_per_second": 1000 * prompt_n / prompt_ms if prompt_ms else 0.0,
                       "predicted_n": predicted_n, "predicted_ms": predicted_ms,
                       "predicted_per_token_ms": predicted_ms / predicted_n if predicted_n else 0.0,
                       "predicted_per_second": 1000 * predicted_n / predicted_ms if predicted_ms else 0.0}
            if stats.drafted:
                timings.update(draft_n=stats.drafted, draft_n_accepted=stats.accepted)
            return {**out, "tokens_cached": len(job.tokens) + stats.generated_tokens, "truncated": job.truncated,
                    "stop_type": stop_type, "stopping_word": result.stop_string,
                    "has_new_line": "\n" in (rule.text if rule is not None and rule.ended else result.text),
                    "generation_settings": {"n_predict": job.max_tokens, "temperature": job.params.temperature,
                                            "top_k": job.params.top_k, "top_p": job.params.top_p,
                                            "min_p": job.params.min_p,
                                            "seed": -1 if job.params.seed is None else job.params.seed,
                                            "stop": job.stop, "n_indent": rule.n_indent if rule else 0,
                                            "t_max_predict_ms": rule.t_max_ms if rule else 0},
                    "timings": timings, "speculative": stats.to_dict()}

        def answer() -> str:  # the completion's text (a rule that ended it holds what it kept)
            rule = job.stop_rule
            return rule.text if rule is not None and rule.ended else result.text

        def done(status: str) -> None:
            metrics.requests.labels(endpoint, status).inc()
            metrics.latency.observe(time.perf_counter() - t0)
            log_request(request, status, t0, result.stats, job.max_tokens)

        if job.stream:
            async def sse():
                sent = 0  # characters of the answer streamed so far
                pending = []  # with return_tokens: ids of the tokens not yet in a chunk
                async with aclosing(worker.run(job, result)) as events:
                    async for event in events:
                        on_token()
                        pending.append(event.token)
                        if event.text or event.logprobs or job.return_tokens:
                            entries.extend(event.logprobs)
                            sent += len(event.text)
                            event_json = response(False, event.text, event.logprobs, pending)
                            pending = []
                            yield f"data: {json.dumps(event_json, ensure_ascii=False)}\n\n"
                if job.cut:
                    raise APIError(503, "the server shut down before this completion finished",
                                   type="server_error", code="shutting_down")
                rest = answer()[sent:]  # held back as the start of a stop string that never came
                if rest:
                    yield f"data: {json.dumps(response(False, rest, []), ensure_ascii=False)}\n\n"
                yield f"data: {json.dumps(response(True, '', []), ensure_ascii=False)}\n\n"

            return event_stream(sse(), endpoint, done)

        generated = []  # every token decoded, those of a stop string too (llama-server's return_tokens)
        async with aclosing(worker.run(job, result, request.is_disconnected)) as events:
            async for event in events:
                on_token()
                entries.extend(event.logprobs)
                generated.append(event.token)
        if job.cut:
            raise APIError(503, "the server shut down before this completion finished", type="server_error",
                           code="shutting_down")
        if await request.is_disconnected():  # the client left: its generation stopped early, no one reads this
            done("499")
            return Response(status_code=499)
        done("200")
        return _fields(response(True, answer(), tokens=generated), fields)

    @app.post("/infill")
    async def infill(request: Request):
        return await native(request, infill=True)

    @app.post("/completion")
    async def native_completion(request: Request):
        return await native(request, infill=False)

    @app.post("/completions")
    async def native_completions(request: Request):
        return await native(request, infill=False)

    async def completion(request: Request, chat: bool):
        endpoint = request.url.path
        t0 = request.state.t0 = time.perf_counter()
        check_auth(request)
        body = await read_json(request)
        job = None
        try:
            job = parse_job(body, cfg, chat=chat, render_chat=engine.chat_prompt)
            worker.admit(job)  # a 503 at once when full, before tokenizing
            prompts = [job] + [_prompt_job(job, p) for p in job.more_prompts]  # a batch: one job per prompt
            for one in prompts:
                await worker.tokenize(one)
        except SpeculantError as e:
            raise request_error(e, job, "messages" if chat else "prompt") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created_at = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        # choice p * n + i: prompt p's i-th generation (OpenAI's order)
        jobs = [c for p in prompts for c in [p] + [_choice_job(p, i, engine) for i in range(1, job.n)]]
        for a in range(0, len(jobs), job.n) if job.n > 1 else ():  # the choices of a prompt share its processing
            jobs[a].started = asyncio.Event()
            for other in jobs[a + 1:a + job.n]:
                other.after = jobs[a].started
        _wait_for_shared_prefixes(jobs[::job.n])
        for other in jobs[1:]:  # --max-queue admits requests: the first job's admission holds a place for each
            other.admission = job.admission
        results = [Result("", [], SpecStats()) for _ in jobs]
        formats = [LogprobsFormat(engine.target, chat) if job.logprobs is not None else None for _ in jobs]
        echoed = [_echo_text(j, engine) if j.echo else "" for j in jobs]

        def choice(i: int, text: Optional[str], finish: Optional[str], first: bool = False, logprobs=None) -> dict:
            lp = formats[i](logprobs) if logprobs and formats[i] is not None else None
            if chat:
                delta = {} if text is None else {"content": text}
                if first:
                    delta = {"role": "assistant", "content": text or ""}
                return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            return {"index": i, "text": text or "", "logprobs": lp, "finish_reason": finish}

        def chunk(choices: list, usage: Optional[dict] = None, **extra) -> str:
            """One SSE event. As OpenAI's: with include_usage every chunk has "usage": null but the last,
            which has "choices": [] and the usage; without it no chunk has usage."""
            obj = {"id": rid, "object": kind + (".chunk" if chat else ""), "created": created_at,
                   "model": cfg.model_id, "system_fingerprint": system_fingerprint, "choices": choices, **extra}
            if job.include_usage:
                obj["usage"] = usage
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        on_token = first_token_timer(t0)

        def done_metrics(status: str) -> None:
            metrics.requests.labels(endpoint, status).inc()
            metrics.latency.observe(time.perf_counter() - t0)
            log_request(request, status, t0, [r.stats for r in results], job.max_tokens, job.n)

        def cut_error() -> APIError:
            return APIError(503, "the server shut down before this generation finished", type="server_error",
                            code="shutting_down")

        if job.stream:
            async def sse():
                sent = [0] * len(jobs)  # characters of each choice's text sent
                streamed = [""] * len(jobs)  # each choice's text so far
                given = [0] * len(jobs)  # logprobs entries the events carried
                pending: list[list] = [[] for _ in jobs]  # of those, the ones not sent yet (no text came with them)
                queue: asyncio.Queue = asyncio.Queue()

                async def produce(i: int) -> None:  # choice i's events into the queue; None when it ends
                    try:
                        async with aclosing(worker.run(jobs[i], results[i])) as events:
                            async for event in events:
                                await queue.put((i, event))
                        await queue.put((i, None))
                    except Exception as e:
                        await queue.put((i, e))

                tasks = []
                try:
                    if chat:
                        for i in range(len(jobs)):
                            yield chunk([choice(i, "", None, first=True)])
                    tasks = [asyncio.ensure_future(produce(i)) for i in range(len(jobs))]
                    running = len(jobs)
                    while running:
                        i, event = await queue.get()
                        if isinstance(event, Exception):
                            raise event
                        if echoed[i] and not jobs[i].cut:  # the prompt first (its logprobs: Worker.run)
                            yield chunk([choice(i, echoed[i], None, logprobs=jobs[i].prompt_logprobs)])
                            echoed[i] = ""
                        if event is None:  # choice i ended: what it held back, then its finish reason
                            running -= 1
                            if jobs[i].cut:
                                continue
                            result = results[i]
                            rest, finish, calls = result.text[sent[i]:], result.finish_reason, []
                            if job.tools is not None:  # the held-back text: its tool calls, and any text around
                                parsed, finish = job.tools.answer(rest, finish)
                                if parsed.calls or finish == "length":  # (cut: no part of a call's tags is text)
                                    rest, calls = parsed.content or "", parsed.calls
                            if result.logprobs is not None:
                                pending[i] += result.logprobs[given[i]:]
                            if rest or pending[i]:
                                yield chunk([choice(i, rest, None, logprobs=pending[i])])
                            if calls:
                                yield chunk([{"index": i, "delta": {"tool_calls": [
                                    {"index": j, **c} for j, c in enumerate(calls)]}, "logprobs": None,
                                    "finish_reason": None}])
                            yield chunk([choice(i, None, finish)], **_message(result))
                            continue
                        on_token()
                        pending[i] += event.logprobs
                        given[i] += len(event.logprobs)
                        if event.text:
                            streamed[i] += event.text
                            ready = len(streamed[i]) - (held_back(streamed[i], sent[i]) if job.tools is not None
                                                        else 0)
                            if ready > sent[i]:
                                yield chunk([choice(i, streamed[i][sent[i]:ready], None, logprobs=pending[i])])
                                sent[i] = ready
                                pending[i] = []
                    if any(j.cut for j in jobs):
                        raise cut_error()
                    if job.include_usage:
                        yield chunk([], _usage(results, job.n))
                    yield "data: [DONE]\n\n"
                finally:
                    for t in tasks:  # a client gone: each choice stops after its step in flight
                        t.cancel()
                    if tasks:
                        await asyncio.gather(*tasks, return_exceptions=True)

            return event_stream(sse(), endpoint, done_metrics)

        async def consume(i: int) -> None:
            async with aclosing(worker.run(jobs[i], results[i], request.is_disconnected)) as events:
                async for _ in events:
                    on_token()

        await _run_all([consume(i) for i in range(len(jobs))])
        if any(j.cut for j in jobs):
            raise cut_error()
        if await request.is_disconnected():  # the client left: its generation stopped early, no one reads this
            done_metrics("499")
            return Response(status_code=499)
        done_metrics("200")
        choices = []
        for i, result in enumerate(results):
            entries = None
            if job.logprobs is not None and (result.logprobs is not None or jobs[i].prompt_logprobs):
                entries = (jobs[i].prompt_logprobs or []) + (result.logprobs or [])
            logprobs = formats[i](entries) if entries is not None else None
            if chat:
                message, finish = {"role": "assistant", "content": result.text}, result.finish_reason
                if job.tools is not None:
                    parsed, finish = job.tools.answer(result.text, finish)
                    if parsed.calls:
                        message = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.calls}
                    elif finish == "length":  # a call cut before its name: no part of its tags is text
                        message["content"] = parsed.content or ""

                choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
            else:
                choices.append({"index": i, "text": echoed[i] + result.text, "logprobs": logprobs,
                                "finish_reason": result.finish_reason})
        message = next((_message(r) for r in results if r.message), {})
        return {"id": rid, "object": kind, "created": created_at, "model": cfg.model_id,
                "system_fingerprint": system_fingerprint, "choices": choices, "usage": _usage(results, job.n), **message}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await completion(request, chat=True)

    return app


# ---------------------------------------------------------------------------------------------------------
# CLI


def add_cli(sub, add_model_args, add_sampling_args) -> None:
    import argparse

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (speculative with -md)")
    add_model_args(p)
    add_sampling_args(p)
    p.add_argument("--ignore-eos", action="store_true",
                   help="never end at an end-of-generation token (a logit bias of -inf on each, as llama-server's "
                        "flag and request field)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default %(default)s, as llama-server)")
    p.add_argument("--api-key", default=os.environ.get("SPECULANT_API_KEY") or os.environ.get("LLAMA_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (or 'X-Api-Key: KEY') on every endpoint but /health and "
                        "/metrics; several keys separated by commas, each accepted (as llama-server) (default: "
                        "$SPECULANT_API_KEY, else llama-server's $LLAMA_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients send and /v1/models lists (default: the -m value); given, a request "
                        "naming another model is a 404, as vLLM's; left out, any name is served, as llama-server")
    p.add_argument("-np", "--parallel", type=int, default=None,
                   help=f"requests decoded at once (default {DEFAULT_PARALLEL}; 1 for the torch backend, --rpc, "
                        "--self-spec and --draft-vocab), each with its own -c tokens of KV cache: their passes "
                        "merge into one, and each output is the one it would be alone")
    p.add_argument("--spm-infill", action="store_true",
                   help="/infill's prompt puts the suffix before the prefix (suffix/prefix/middle), as some code "
                        "models are trained (llama-server's flag); then while the user types only the cursor's "
                        "line is evaluated again. Default: prefix/suffix/middle (Qwen2.5-Coder's order)")
    p.add_argument("--allowed-origins", default="*",
                   help="web pages (origins, comma separated, e.g. http://localhost:3000) whose scripts may call the "
                        "API from a browser (CORS; default *: any, as vLLM and llama-server; '' allows none; the API "
                        "key is checked either way)")
    p.add_argument("--slots", action=argparse.BooleanOptionalAction, default=True,
                   help="GET /slots, llama-server's slot monitor (default: on, as llama-server; it shows no prompt "
                        "or output text)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests allowed to wait for a free slot; more get 503 (default 64)")
    p.add_argument("--max-body", type=int, default=1 << 20, help="largest request body in bytes (default 1 MiB)")
    p.add_argument("-to", "--timeout", type=float, default=600.0,
                   help="seconds a client may take to send its request body (then a 408) or to take each part of a "
                        "stream (then the stream is cut and its slot freed), as llama-server's read/write timeout "
                        "(default 600; 0: no limit)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="on SIGINT/SIGTERM, in-flight requests get about this many seconds to finish before they "
                        "are cut with a 'shutting_down' error; new connections are refused, queued requests get 503 "
                        "(default 10)")
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                   help="info (default): one line per /v1 request; warning: errors and warnings only")
    request_defaults = {  # the sampling flags are defaults for requests here
        "n_predict": "max_tokens of requests that do not set it (default 128; -1: until the end of generation or "
                     "a full context); a request may ask for more, up to the context",
        "seed": "seed of requests that do not set one (default -1: each samples with a random seed)",
        "repeat_last_n": "the penalties' window (the last N tokens, prompt included, as llama.cpp's; 0: none; -1: "
                         "the context) of requests to llama-server's endpoints (/completion, /infill) that leave "
                         "repeat_last_n out (default 64, as llama-server's); /v1 requests that leave it out count "
                         "as OpenAI's and vLLM's (presence and frequency: the output; repetition: prompt and output)",
    }
    for action in p._actions:
        if action.dest in request_defaults:
            action.help = request_defaults[action.dest]
        elif action.dest in ("temp", "top_k", "top_p", "min_p", "stop", "repeat_penalty", "presence_penalty",
                             "frequency_penalty", "logit_bias", "ignore_eos"):
            action.help = f"default for requests that leave it out; {action.help}"
    p.set_defaults(handler=cmd_serve)


LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]
DEFAULT_PARALLEL = 2  # two requests at once cost ~1.2 target steps a pass instead of 2 (BENCHMARKS.md)


SELF_SPEC = "self-spec"  # the drafter named in /health, /v1/models and the banner under --self-spec


def draft_label(args) -> Optional[str]:
    """What drafts, as /health's and /v1/models' draft_model and the banner name it: the draft model (or
    'lookup' / 'history'), or 'self-spec' when the target drafts with its own layers; None: nothing."""
    if getattr(args, "draft_max", None) == 0:  # nothing drafts: the drafter is not loaded (api.load_engine)
        return None
    if args.self_spec or args.self_spec_exit is not None or args.self_spec_config is not None:
        return SELF_SPEC
    return args.model_draft


def serves_parallel(args) -> bool:
    """Whether these model flags can serve concurrent requests (a local llama.cpp target and draft)."""
    torch = args.backend == "torch" or os.path.isdir(os.path.expanduser(args.model)) \
        or (args.model_draft and (args.backend_draft == "torch" or os.path.isdir(os.path.expanduser(args.model_draft))))
    return not (torch or getattr(args, "rpc", None) or args.self_spec or args.self_spec_exit is not None
                or args.draft_vocab)


def listen(host: str, port: int):
    """The listening socket, bound before any model is loaded: a busy port fails at once."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as e:
        if isinstance(e, socket.gaierror) or (e.errno or 0) < 0:  # getaddrinfo's codes: 256.1.1.1, a typo
            raise SpeculantError(f"cannot listen on {host}:{port}: {host!r} is not an address or host name that "
                                 f"resolves here") from None
        raise SpeculantError(f"cannot listen on {host}:{port}: {os.strerror(e.errno) if e.errno else e}"
                             + (" (another server is using it; pick one with --port)"
                                if e.errno == errno.EADDRINUSE else "")) from None


def cmd_serve(args) -> int:
    import uvicorn

    from .api import load_engine

    if not (0 < args.port < 65536):
        raise SpeculantError(f"--port must be in 1..65535, got {args.port}")
    if args.n_predict < -2 or args.n_predict == 0:
        raise SpeculantError(f"-n must be >= 1, or -1 / -2 (llama.cpp's: until the context is full), got "
                             f"{args.n_predict}")
    if args.max_queue < 0 or args.max_body < 1:
        raise SpeculantError("--max-queue must be >= 0 and --max-body >= 1")
    if not (args.timeout >= 0 and math.isfinite(args.timeout)):
        raise SpeculantError(f"--timeout must be a number of seconds >= 0 (0: no limit), got {args.timeout}")
    from .api import check_parallel

    if args.parallel is None:
        args.parallel = DEFAULT_PARALLEL if serves_parallel(args) else 1
    check_parallel(args.parallel)
    seed = None if args.seed == -1 else args.seed  # -1: every request without a seed samples randomly
    from .cli import sampler_chain, sampling_params

    sampling_params(args, seed)  # validates them, in the chain of --samplers too
    defaults = sampling_params(args, seed, chained=False)  # a request's "samplers" may list what --samplers left out
    if args.host not in ("127.0.0.1", "localhost", "::1") and not (args.api_key or "").strip(", "):
        print(f"speculant: warning: serving on {args.host} without --api-key: anyone who can reach it may use it",
              file=sys.stderr)
    sock = listen(args.host, args.port)
    try:  # the engine the common model flags describe, exactly as `speculant generate` builds it
        from .cli import engine_from_args
    except ImportError:
        engine_from_args = None
    try:
        if engine_from_args is not None:
            engine = engine_from_args(args)
        else:
            engine = load_engine(args.model, args.model_draft, draft_max=args.draft_max,
                                 draft_p_min=args.draft_p_min, n_ctx=args.ctx_size, threads=args.threads,
                                 parallel=args.parallel)
    except BaseException:
        sock.close()
        raise
    from .chat import missing_template_warning

    no_template = missing_template_warning(engine.target.chat_template(), args.model)
    if no_template:
        print(f"speculant: warning: {no_template}; /v1/completions takes the text as it is", file=sys.stderr)
    bad = [t for t, _ in defaults.logit_bias if t >= engine.target.n_vocab]
    if bad:
        engine.close()
        sock.close()
        raise SpeculantError(f"--logit-bias: token id {bad[0]} is outside the vocabulary "
                             f"(0..{engine.target.n_vocab - 1})")
    cfg = ServerConfig(
        model_id=args.served_model_name or args.model, check_model=bool(args.served_model_name), draft_id=draft_label(args), api_key=args.api_key or None,
        max_body_bytes=args.max_body, io_timeout_s=args.timeout or None, max_queue=args.max_queue, parallel=args.parallel, spm_infill=args.spm_infill,
        allowed_origins=[o.strip() for o in args.allowed_origins.split(",") if o.strip()],
        max_tokens=engine.target.n_ctx if args.n_predict < 0 else args.n_predict,
        temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=seed,
        stop=list(args.stop), presence_penalty=defaults.presence_penalty,
        frequency_penalty=defaults.frequency_penalty, repetition_penalty=defaults.repetition_penalty,
        logit_bias=defaults.logit_bias, ignore_eos=args.ignore_eos, repeat_last_n=args.repeat_last_n,
        n_vocab=engine.target.n_vocab, endpoint_slots=args.slots,
        samplers=LLAMA_SAMPLERS if sampler_chain(args) is None else sampler_chain(args),  # (): none run
    )
    app = create_app(engine, cfg)
    _setup_logging(args.log_level)
    # uvicorn's own startup lines repeat ours: it logs warnings and worse unless asked for debug
    uvicorn_level = args.log_level if LOG_LEVELS.index(args.log_level) <= LOG_LEVELS.index("warning") \
        or args.log_level == "debug" else "warning"
    # our deadline cuts the requests in flight (between passes, with a 'shutting_down' error); uvicorn's own,
    # later, only backs it up: when it came first it cancelled the handlers (a bare 500, a stream cut mid-way)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=uvicorn_level,
                            timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_BACKSTOP_S, access_log=False)
    logging.getLogger("uvicorn.error").addFilter(_NotIncomplete())  # after uvicorn.Config has set its logging up
    worker = app.state.worker
    grace = max(0.0, args.shutdown_timeout)
    where = f"http://{'[' + args.host + ']' if ':' in args.host else args.host}:{args.port}/v1"

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                drafts = (f" with {SELF_SPEC}" if cfg.draft_id == SELF_SPEC  # the target drafts with its own layers
                          else f" with draft {cfg.draft_id}" if cfg.draft_id else "")
                first = (["history drafting"] if drafts and getattr(args, "history", False) else []) + \
                    (["prompt lookup"] if drafts and getattr(args, "lookup", False) else [])
                if first:
                    drafts += f" ({', then '.join(first)} first)"
                print(f"speculant: serving {cfg.model_id}{drafts} on {where}", file=sys.stderr, flush=True)

        def handle_exit(self, sig, frame):  # SIGINT/SIGTERM: refuse new work, give in-flight work `grace` s
            worker.begin_shutdown(grace)
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # a graceful stop exits 0 instead of re-raising the signal

    server = _Server(config)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    if not server.started:
        raise SpeculantError(f"the server on {args.host}:{args.port} did not start (see the messages above)")
    print("speculant: server stopped", file=sys.stderr)
    return 0


def _setup_logging(level: str) -> None:
    """speculant.server's lines go to stderr as "speculant: ..." at the chosen level."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("speculant: %(message)s"))
    _LOG.handlers[:] = [handler]
    _LOG.setLevel(level.upper())
    _LOG.propagate = False


def main(argv=None) -> int:
    """`python -m speculant.server ...` = `speculant serve ...`."""
    import argparse

    from .cli import _add_model_args, _add_sampling_args

    parser = argparse.ArgumentParser(prog="speculant-serve")
    add_cli(parser.add_subparsers(dest="command", required=True), _add_model_args, _add_sampling_args)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    try:
        from .cli import check_model_flags

        check_model_flags(args)
        return args.handler(args)
    except SpeculantError as e:
        print(f"speculant: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())


def spawn_local(serve_args: list[str], *, timeout: float = 120.0, exe: Optional[str] = None,
                **popen_kwargs):
    """Start `speculant serve <serve_args>` on a free 127.0.0.1 port and wait until /health answers.

    For tests and the load script. Returns (process, base url); raises RuntimeError (with the server's
    output when it exited) if it does not become healthy within `timeout` seconds."""
    import socket
    import subprocess

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [exe] if exe else [sys.executable, "-m", "speculant"]
    proc = subprocess.Popen([*cmd, "serve", *serve_args, "--port", str(port)], text=True, **popen_kwargs)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = proc.stdout or proc.stderr
            raise RuntimeError(f"server exited with {proc.returncode}:\n{out.read() if out else ''}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not become healthy within {timeout:.0f} s")
