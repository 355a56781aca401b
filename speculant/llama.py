"""llama-cpp-python's high-level API over speculant: `Llama(model_path, draft_model=...)` with `create_completion`
(and calling the object), `create_chat_completion`, `tokenize` and `detokenize`, taking llama_cpp.Llama's arguments
and defaults and answering its OpenAI-shaped dicts (an iterator of chunks with stream=True). Code written for
llama-cpp-python runs speculatively by changing its import; the output is the target's alone, token for token at
temperature 0 and with the target's distribution above it (the decoding is speculant's: engine.py).

What llama-cpp-python has and this has not is refused with a SettingsError, never silently ignored: samplers
speculant lacks (Mirostat, typical, tail-free) at other than their off values, logits processors and stopping
criteria (callables that would see only the target's own tokens), and tools (`speculant serve` answers them).
"""

from __future__ import annotations

import time
import uuid
from typing import Iterator, Optional, Sequence

from .errors import SettingsError
from .verify import SamplingParams

# llama_cpp.Llama's loading options that mean nothing for a CPU run here: taken, and ignored
IGNORED_OPTIONS = {"n_batch", "n_ubatch", "use_mmap", "use_mlock", "logits_all", "last_n_tokens_size", "numa",
                   "n_threads_batch", "rope_freq_base", "rope_freq_scale", "chat_handler", "kv_overrides",
                   "split_mode", "main_gpu", "tensor_split", "offload_kqv", "vocab_only", "type_k", "type_v"}
OFF_VALUES = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat_mode": 0}  # the samplers speculant lacks, turned off
PENALTY_WINDOW = 64  # llama-cpp-python's last_n_tokens_size: the penalties count the last 64 tokens


def _lookup_draft(draft_model):
    """llama-cpp-python's draft objects: LlamaPromptLookupDecoding(num_pred_tokens=N) is prompt lookup."""
    if draft_model is None or isinstance(draft_model, str):
        return draft_model, None
    if type(draft_model).__name__ == "LlamaPromptLookupDecoding":
        return "lookup", getattr(draft_model, "num_pred_tokens", None)
    raise SettingsError(f"draft_model must be a model name or path, 'lookup', 'history' or llama-cpp-python's "
                        f"LlamaPromptLookupDecoding, got {type(draft_model).__name__}")


def _grammar_text(grammar) -> Optional[str]:
    """GBNF text, or llama-cpp-python's LlamaGrammar (its text is in `_grammar`)."""
    if grammar is None or isinstance(grammar, str):
        return grammar
    text = getattr(grammar, "_grammar", None)
    if not isinstance(text, str):
        raise SettingsError(f"grammar must be GBNF text or a LlamaGrammar, got {type(grammar).__name__}")
    return text


class Llama:
    """A target (and its drafter) loaded once, answering as llama_cpp.Llama does. draft_model: a draft model's name
    or path, "lookup" (prompt lookup), "history", or llama-cpp-python's LlamaPromptLookupDecoding; None: plain
    decoding. n_ctx 0: the model's training context. seed -1: each call samples with a random seed unless it
    passes one. draft_max, lookup, history: as load_engine's."""

    def __init__(self, model_path: str, *, draft_model=None, n_ctx: int = 512, n_threads: Optional[int] = None,
                 n_gpu_layers: int = 0, seed: int = -1, verbose: bool = True, draft_max: Optional[int] = None,
                 lookup: Optional[bool] = None, history: bool = False, chat_format: Optional[str] = None,
                 flash_attn: bool = False, embedding: bool = False, **options):
        from .api import load_engine, thread_count

        unknown = sorted(set(options) - IGNORED_OPTIONS)
        if unknown:
            raise TypeError(f"Llama() got an unexpected keyword argument {unknown[0]!r}")
        if n_gpu_layers not in (0, None):
            raise SettingsError("n_gpu_layers: the llama.cpp backend runs on the CPU here (0); a GPU runs the torch "
                                "backend: speculant.load_engine(..., backend='torch', device='cuda')")
        for name, on in (("chat_format", chat_format is not None), ("flash_attn", flash_attn),
                         ("embedding", embedding)):
            if on:
                raise SettingsError(f"{name}: not supported (the chat template is the model file's own; flash "
                                    f"attention stays off, as exact verification needs; no embeddings)")
        if not isinstance(seed, int) or seed < -1:
            raise SettingsError(f"seed must be -1 (random) or a non-negative integer, got {seed!r}")
        draft, n_pred = _lookup_draft(draft_model)
        self.model_path, self.verbose, self._seed = model_path, verbose, seed
        self._engine = load_engine(model_path, draft, n_ctx=n_ctx, threads=thread_count(str(n_threads or 0)),
                                   draft_max=draft_max if draft_max is not None else n_pred, lookup=lookup,
                                   history=history)

    # -- llama_cpp.Llama's surface ------------------------------------------------------------------------------
    @property
    def engine(self):
        """The speculant Engine underneath (stats of the last call: `last_stats`)."""
        return self._engine

    def n_ctx(self) -> int:
        return self._engine.target.n_ctx

    def n_vocab(self) -> int:
        return self._engine.target.n_vocab

    def token_bos(self) -> int:
        return self._engine.target.vocab_info().special_ids.get("bos", -1)

    def token_eos(self) -> int:
        return self._engine.target.vocab_info().special_ids.get("eos", -1)

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        """UTF-8 bytes (or text) -> token ids, as llama_cpp.Llama.tokenize."""
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", errors="replace")
        return self._engine.target.tokenize(text, add_special=add_bos, parse_special=special)

    def detokenize(self, tokens: Sequence[int], prev_tokens: Optional[Sequence[int]] = None,
                   special: bool = False) -> bytes:
        """Token ids -> UTF-8 bytes, as llama_cpp.Llama.detokenize (special: control tokens written out)."""
        target = self._engine.target
        bad = [t for t in tokens if not 0 <= t < target.n_vocab]
        if bad:
            raise SettingsError(f"token id {bad[0]} is outside the vocabulary (0..{target.n_vocab - 1})")
        piece = target.token_text if special else target.token_bytes
        return b"".join(piece(t) for t in tokens)

    def close(self) -> None:
        self._engine.close()

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __call__(self, prompt, *args, **kwargs):
        return self.create_completion(prompt, *args, **kwargs)

    def create_completion(self, prompt: str | Sequence[int], suffix: Optional[str] = None,
                          max_tokens: Optional[int] = 16, temperature: float = 0.8, top_p: float = 0.95,
                          min_p: float = 0.05, typical_p: float = 1.0, logprobs: Optional[int] = None,
                          echo: bool = False, stop=None, frequency_penalty: float = 0.0,
                          presence_penalty: float = 0.0, repeat_penalty: float = 1.0, top_k: int = 40,
                          stream: bool = False, seed: Optional[int] = None, tfs_z: float = 1.0,
                          mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                          model: Optional[str] = None, stopping_criteria=None, logits_processor=None,
                          grammar=None, logit_bias: Optional[dict] = None):
        """OpenAI's text completion: {"id", "object": "text_completion", "created", "model", "choices": [{"text",
        "index", "logprobs", "finish_reason"}], "usage"}; stream=True: an iterator of such chunks."""
        self._check_off(typical_p=typical_p, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                        stopping_criteria=stopping_criteria, logits_processor=logits_processor)
        if logprobs is not None and (not isinstance(logprobs, int) or logprobs < 0):
            raise SettingsError(f"logprobs must be a non-negative integer, got {logprobs!r}")
        engine = self._engine
        text = prompt if isinstance(prompt, str) else None
        if suffix is not None:
            prompt = engine.fim_prompt(prompt, suffix)
        params = self._params(temperature, top_k, top_p, min_p, seed, logit_bias, presence_penalty,
                              frequency_penalty, repeat_penalty)
        head = (text if text is not None else engine.target.detokenize(list(prompt))) if echo else ""
        run = self._run(prompt, max_tokens, params, stop, False, grammar, logprobs)
        meta = {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()),
                "model": model or self.model_path}
        if stream:
            return self._completion_chunks(run, meta, head, logprobs is not None)
        result = _drain(run)
        return {**meta, "choices": [{"text": head + result.text, "index": 0,
                                     "logprobs": self._text_logprobs(result, len(head)) if logprobs is not None
                                     else None,
                                     "finish_reason": result.finish_reason}], "usage": _usage(result)}

    def create_chat_completion(self, messages: list[dict], functions=None, function_call=None, tools=None,
                               tool_choice=None, temperature: float = 0.2, top_p: float = 0.95, top_k: int = 40,
                               min_p: float = 0.05, typical_p: float = 1.0, stream: bool = False, stop=None,
                               seed: Optional[int] = None, response_format: Optional[dict] = None,
                               max_tokens: Optional[int] = None, presence_penalty: float = 0.0,
                               frequency_penalty: float = 0.0, repeat_penalty: float = 1.0, tfs_z: float = 1.0,
                               mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                               model: Optional[str] = None, logits_processor=None, grammar=None,
                               logit_bias: Optional[dict] = None, logprobs: Optional[bool] = None,
                               top_logprobs: Optional[int] = None):
        """OpenAI's chat completion: {"id", "object": "chat.completion", "created", "model", "choices": [{"index",
        "message": {"role", "content"}, "logprobs", "finish_reason"}], "usage"}; stream=True: an iterator of
        "chat.completion.chunk" dicts. response_format: {"type": "json_object"} or {"type": "json_schema",
        "json_schema": {"schema": ...}} (or llama-cpp-python's {"type": "json_object", "schema": ...})."""
        from .server import APIError, _get_grammar, render_messages

        self._check_off(typical_p=typical_p, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                        logits_processor=logits_processor)
        if tools or functions or tool_choice not in (None, "none") or function_call is not None:
            raise SettingsError("tools and functions are not supported in the Python API; `speculant serve` answers "
                                "them (OpenAI's tool_calls)")
        if grammar is not None and response_format not in (None, {"type": "text"}):
            raise SettingsError("give grammar or response_format, not both")
        try:
            prompt, continued = render_messages({"messages": messages}, self._engine.chat_prompt, None)
            gbnf = _get_grammar({"response_format": response_format}) if grammar is None else _grammar_text(grammar)
        except APIError as e:
            raise SettingsError(e.message) from None
        if continued and gbnf is not None:
            raise SettingsError("a final assistant message with a response format or grammar: not supported in the "
                                "Python API (`speculant serve` continues one under its grammar)")
        n_top = (top_logprobs or 0) if logprobs else None
        params = self._params(temperature, top_k, top_p, min_p, seed, logit_bias, presence_penalty,
                              frequency_penalty, repeat_penalty)
        run = self._run(prompt, max_tokens, params, stop, True, gbnf, n_top)
        meta = {"id": f"chatcmpl-{uuid.uuid4()}", "created": int(time.time()), "model": model or self.model_path}
        if stream:
            return self._chat_chunks(run, meta, n_top is not None)
        result = _drain(run)
        return {**meta, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                             "logprobs": self._chat_logprobs(result.logprobs) if n_top is not None else None,
                             "finish_reason": result.finish_reason}], "usage": _usage(result)}

    # -- underneath -----------------------------------------------------------------------------------------------
    @staticmethod
    def _check_off(**given) -> None:
        for name, value in given.items():
            if name in OFF_VALUES and value != OFF_VALUES[name]:
                raise SettingsError(f"{name}={value}: speculant has no such sampler (it samples with top-k, top-p, "
                                    f"min-p, the temperature, penalties and logit biases); leave it at "
                                    f"{OFF_VALUES[name]}")
            if name not in OFF_VALUES and value is not None:
                raise SettingsError(f"{name}: not supported (a callable would see only the target's own tokens, "
                                    f"not the drafts it verifies); use stop strings or a grammar")

    def _params(self, temperature, top_k, top_p, min_p, seed, logit_bias, presence, frequency,
                repeat) -> SamplingParams:
        seed = self._seed if seed is None else seed
        if seed is not None and (not isinstance(seed, int) or seed < -1):
            raise SettingsError(f"seed must be -1 (random) or a non-negative integer, got {seed!r}")
        bias = tuple((int(t), float(b)) for t, b in (logit_bias or {}).items())
        return SamplingParams(temperature, top_k, top_p, min_p, None if seed == -1 else seed, logit_bias=bias,
                              presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repeat,
                              penalty_last_n=PENALTY_WINDOW)

    def _run(self, prompt, max_tokens, params, stop, is_chat: bool, grammar, n_top) -> "_Run":
        """The generation, started lazily: events, then its Result."""
        from .engine import Result
        from .stats import SpecStats

        engine = self._engine
        if max_tokens is None or isinstance(max_tokens, int) and not isinstance(max_tokens, bool) and max_tokens <= 0:
            max_tokens = -1  # llama-cpp-python's: None or <= 0 is until the end or a full context
        constraint = engine.target.grammar(_grammar_text(grammar)) if grammar is not None else None
        result = Result("", [], SpecStats())
        events = engine.stream(prompt, max_tokens=max_tokens, params=params, stop=stop or (), is_chat=is_chat,
                               result=result, logprobs=n_top, constraint=constraint)
        self.last_stats = result.stats
        return _Run(events, result)

    def _completion_chunks(self, run: "_Run", meta: dict, head: str, with_logprobs: bool) -> Iterator[dict]:
        if head:
            yield {**meta, "choices": [{"text": head, "index": 0, "logprobs": None, "finish_reason": None}]}
        for event in run.events:
            if event.text:
                yield {**meta, "choices": [{"text": event.text, "index": 0, "logprobs": None, "finish_reason": None}]}
        result = run.result
        yield {**meta, "choices": [{"text": "", "index": 0,
                                    "logprobs": self._text_logprobs(result, len(head)) if with_logprobs else None,
                                    "finish_reason": result.finish_reason}], "usage": _usage(result)}

    def _chat_chunks(self, run: "_Run", meta: dict, with_logprobs: bool) -> Iterator[dict]:
        meta = {**meta, "object": "chat.completion.chunk"}
        yield {**meta, "choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None,
                                    "finish_reason": None}]}
        for event in run.events:
            if event.text or event.logprobs and with_logprobs:
                yield {**meta, "choices": [{"index": 0, "delta": {"content": event.text} if event.text else {},
                                            "logprobs": self._chat_logprobs(event.logprobs) if with_logprobs
                                            else None, "finish_reason": None}]}
        yield {**meta, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                    "finish_reason": run.result.finish_reason}], "usage": _usage(run.result)}

    def _piece(self, token: int) -> str:
        return self._engine.target.token_bytes(token).decode("utf-8", errors="replace")

    def _text_logprobs(self, result, at: int = 0) -> dict:
        """The legacy completions' logprobs: tokens, text_offset (from `at`: after an echoed prompt),
        token_logprobs, top_logprobs, of the generated tokens."""
        tokens, offsets, top = [], [], []
        for entry in result.logprobs or ():
            piece = self._piece(entry.token)
            tokens.append(piece)
            offsets.append(at)
            at += len(piece)
            top.append({self._piece(t): lp for t, lp in entry.top})
        return {"tokens": tokens, "text_offset": offsets,
                "token_logprobs": [e.logprob for e in result.logprobs or ()], "top_logprobs": top}

    def _chat_logprobs(self, entries) -> dict:
        """The chat completions' logprobs: {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}."""
        target = self._engine.target

        def one(token: int, logprob: float) -> dict:
            raw = target.token_bytes(token)
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

        return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                            for e in entries or ()]}


class _Run:
    def __init__(self, events, result):
        self.events, self.result = events, result


def _drain(run: _Run):
    for _ in run.events:
        pass
    return run.result


def _usage(result) -> dict:
    prompt, completion = result.stats.prompt_tokens, result.stats.generated_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
