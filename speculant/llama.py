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

import numbers
import random
import sys
import time
import types
import uuid
from typing import Iterator, Optional, Sequence

from .errors import SettingsError
from .verify import SamplingParams

# llama_cpp.Llama's loading options that would change the model's numbers or what it loads: taken at their defaults
# only. Any other keyword is taken and means nothing here (n_batch, use_mmap, the GPU ones on a CPU run; and those
# llama_cpp.Llama swallows itself: LangChain passes f16_kv, n_parts); RoPE: _check_rope
AT_DEFAULT = {"vocab_only": False, "kv_overrides": None, "rope_scaling_type": -1, "pooling_type": -1,
              "attention_type": -1, "yarn_ext_factor": -1.0,
              "yarn_attn_factor": 1.0, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_orig_ctx": 0,
              "embedding": False, "flash_attn": False, "lora_base": None, "lora_path": None, "chat_format": None,
              "chat_handler": None, "tokenizer": None, "type_k": None, "type_v": None, "spm_infill": False}
OFF_VALUES = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat_mode": 0}  # the samplers speculant lacks, turned off
RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: a random seed


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
                 n_gpu_layers: int = 0, seed: int = RANDOM_SEED, last_n_tokens_size: int = 64, verbose: bool = True,
                 draft_max: Optional[int] = None, lookup: Optional[bool] = None, history: bool = False, **options):
        from .api import load_engine

        for name, default in AT_DEFAULT.items():
            if name in options and options[name] != default:
                raise SettingsError(f"{name}={options[name]!r}: not supported by speculant.Llama (leave it at "
                                    f"{default!r}; the chat template is the model file's own, flash attention stays "
                                    f"off, as exact verification needs, and nothing else is loaded)")
        if n_gpu_layers and verbose:  # as llama-cpp-python built for the CPU: the layers run there
            print(f"speculant: n_gpu_layers={n_gpu_layers}: the llama.cpp backend runs on the CPU here",
                  file=sys.stderr)
        if n_threads is not None and (not isinstance(n_threads, numbers.Integral) or isinstance(n_threads, bool)):
            raise SettingsError(f"n_threads must be an integer, got {n_threads!r}")
        if not isinstance(last_n_tokens_size, numbers.Integral) or last_n_tokens_size < 0:
            raise SettingsError(f"last_n_tokens_size must be an integer >= 0, got {last_n_tokens_size!r}")
        draft, n_pred = _lookup_draft(draft_model)
        self.model_path, self.verbose = model_path, verbose
        self._seed = self._checked_seed(seed) or RANDOM_SEED  # 0 too, as llama-cpp-python reads it
        self._penalty_window = int(last_n_tokens_size)
        threads = int(n_threads) if n_threads is not None and n_threads > 0 else None  # <= 0: all cores
        self._engine = load_engine(model_path, draft, n_ctx=int(n_ctx), threads=threads,
                                   draft_max=draft_max if draft_max is not None else n_pred, lookup=lookup,
                                   history=history)
        self.context_params = types.SimpleNamespace(n_ctx=self.n_ctx(), n_threads=threads)  # llama-index reads it
        try:
            self._check_rope(options.get("rope_freq_base", 0.0), options.get("rope_freq_scale", 0.0))
        except SettingsError:
            self.close()
            raise

    def _check_rope(self, base, scale) -> None:
        """RoPE overrides are taken where they are the model's own (LangChain passes 10000 and 1.0 whatever the
        model): another value would change what the model computes."""
        meta = self._engine.target.metadata
        arch = meta("general.architecture") or ""
        own_base = float(meta(f"{arch}.rope.freq_base") or 10000.0)
        factor = float(meta(f"{arch}.rope.scaling.factor") or 1.0)
        if base not in (0, None) and abs(float(base) - own_base) > 1e-6 * own_base:
            raise SettingsError(f"rope_freq_base={base}: this model's own is {own_base:g}; another would change what it "
                                f"computes (pass 0 or {own_base:g}; LangChain's LlamaCpp passes 10000 by default)")
        if scale not in (0, None) and abs(float(scale) - 1.0 / factor) > 1e-9:
            raise SettingsError(f"rope_freq_scale={scale}: this model's own is {1.0 / factor:g}; another would change "
                                f"what it computes (pass 0)")

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
        target.check_ids(tokens)
        piece = target.token_text if special else target.token_bytes
        return b"".join(piece(t) for t in tokens)

    def token_nl(self) -> int:
        return self.tokenize(b"\n", add_bos=False)[-1]

    def reset(self) -> None:
        """llama-cpp-python's: forget the evaluated tokens. Here each call reuses what its prompt shares with the last
        one by itself; nothing to do."""

    def set_seed(self, seed: int) -> None:
        """The seed the next call's is drawn from (llama-cpp-python's: a call without a seed draws its own from it,
        so a run repeats as a whole and each call samples anew)."""
        self._seed = self._checked_seed(seed)

    def create_embedding(self, *args, **kwargs):
        raise SettingsError("embeddings are not supported: speculant generates text")

    embed = create_embedding

    def __getattr__(self, name: str):
        if name in _LOW_LEVEL:  # llama_cpp.Llama's token-level interface: one engine step drafts and verifies
            raise AttributeError(f"speculant.Llama has no {name}(): the token-level interface (eval, sample, "
                                 f"generate, states) is llama-cpp-python's own; speculant.Llama offers create_completion "
                                 f"and create_chat_completion (speculant.load_engine for the engine itself)")
        raise AttributeError(f"'Llama' object has no attribute {name!r}")

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
        "index", "logprobs", "finish_reason"}], "usage"}; stream=True: an iterator of such chunks. logprobs: as
        llama-cpp-python's (text_offset counted from the prompt's start; with echo the prompt's tokens too)."""
        from .server import LogprobsFormat

        self._check_off(typical_p=typical_p, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                        stopping_criteria=stopping_criteria, logits_processor=logits_processor)
        if logprobs is not None and (not isinstance(logprobs, numbers.Integral) or logprobs < 0):
            raise SettingsError(f"logprobs must be a non-negative integer, got {logprobs!r}")
        engine = self._engine
        text = prompt if isinstance(prompt, str) else engine.target.detokenize(list(prompt))
        if suffix is not None:
            prompt = engine.fim_prompt(prompt, suffix)
        params = self._params(temperature, top_k, top_p, min_p, seed, logit_bias, presence_penalty,
                              frequency_penalty, repeat_penalty)
        run = self._run(prompt, max_tokens, params, stop, False, grammar, logprobs)
        fmt = LogprobsFormat(engine.target, chat=False) if logprobs is not None else None
        head, head_logprobs = "", None
        if echo:
            head = text
            if fmt is not None:
                head_logprobs = fmt(engine.prompt_logprobs(engine.tokenize_prompt(prompt), logprobs))
        elif fmt is not None:
            fmt.offset = len(text)
        meta = {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()),
                "model": model or self.model_path}
        if stream:
            return self._completion_chunks(run, meta, head, head_logprobs, fmt)
        result = _drain(run)
        entries = fmt(result.logprobs) if fmt is not None else None
        if head_logprobs is not None:
            entries = {k: head_logprobs[k] + entries[k] for k in entries}
        return {**meta, "choices": [{"text": head + result.text, "index": 0, "logprobs": entries,
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
        "json_schema": {"schema": ...}} (or llama-cpp-python's {"type": "json_object", "schema": ...}). A final
        assistant message is a closed turn, answered anew (as llama-cpp-python renders it)."""
        from .server import APIError, LogprobsFormat, _get_grammar, render_messages

        self._check_off(typical_p=typical_p, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                        logits_processor=logits_processor)
        if tools or functions or tool_choice not in (None, "none", "auto") or function_call is not None:
            raise SettingsError("tools and functions are not supported in the Python API; `speculant serve` answers "
                                "them (OpenAI's tool_calls)")
        if grammar is not None and response_format not in (None, {"type": "text"}):
            raise SettingsError("give grammar or response_format, not both")
        try:
            prompt, _ = render_messages({"messages": messages, "continue_final_message": False},
                                        self._engine.chat_prompt, None)
            gbnf = _get_grammar({"response_format": response_format}) if grammar is None else grammar
        except APIError as e:
            raise SettingsError(e.message) from None
        n_top = (top_logprobs or 0) if logprobs else None
        params = self._params(temperature, top_k, top_p, min_p, seed, logit_bias, presence_penalty,
                              frequency_penalty, repeat_penalty)
        run = self._run(prompt, max_tokens, params, stop, True, gbnf, n_top)
        fmt = LogprobsFormat(self._engine.target, chat=True) if n_top is not None else None
        meta = {"id": f"chatcmpl-{uuid.uuid4()}", "created": int(time.time()), "model": model or self.model_path}
        if stream:
            return self._chat_chunks(run, meta, fmt)
        result = _drain(run)
        return {**meta, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": result.text},
                             "logprobs": fmt(result.logprobs) if fmt is not None else None,
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

    @staticmethod
    def _checked_seed(seed) -> int:
        if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or not -1 <= seed < 2 ** 64:
            raise SettingsError(f"seed must be -1 (random) or a non-negative integer, got {seed!r}")
        return int(seed)

    def _call_seed(self, seed: Optional[int]) -> Optional[int]:
        """This call's seed, as llama-cpp-python draws it: a seed given sticks (set_seed); else the next of a chain
        drawn from the last one (random.Random(seed).randint), so a run repeats as a whole. -1 or 0xFFFFFFFF
        (llama.cpp's LLAMA_DEFAULT_SEED) samples with a random one (None)."""
        if seed is not None:
            self._seed = self._checked_seed(seed)
        else:
            self._seed = random.Random(self._seed).randint(0, 2 ** 32)
        return None if self._seed in (-1, RANDOM_SEED) else self._seed

    def _params(self, temperature, top_k, top_p, min_p, seed, logit_bias, presence, frequency,
                repeat) -> SamplingParams:
        """llama-cpp-python's sampling: a temperature below 0 samples the model's own distribution (no truncation),
        0 is greedy; top_p 0 keeps the likeliest token; the penalties count the last last_n_tokens_size tokens of
        the output (its penalties sampler sees only the tokens it sampled)."""
        seed = self._call_seed(seed)
        if not self._penalty_window:  # llama.cpp's penalties sampler: a window of 0 turns them off
            repeat, presence, frequency = 1.0, 0.0, 0.0
        if temperature < 0:
            temperature, top_k, top_p, min_p = 1.0, 0, 1.0, 0.0
        elif top_p <= 0:
            temperature = 0.0
        bias = tuple((int(t), float(b)) for t, b in (logit_bias or {}).items())
        return SamplingParams(temperature, top_k, top_p if top_p > 0 else 1.0, min_p, seed, logit_bias=bias,
                              presence_penalty=presence, frequency_penalty=frequency, repetition_penalty=repeat,
                              penalty_last_n=self._penalty_window or None, penalize_prompt=False)

    def _run(self, prompt, max_tokens, params, stop, is_chat: bool, grammar, n_top) -> "_Run":
        """The generation, started lazily: events, then its Result."""
        from .engine import Result
        from .stats import SpecStats

        engine = self._engine
        if isinstance(max_tokens, float) and max_tokens.is_integer():
            max_tokens = int(max_tokens)
        if max_tokens is None or isinstance(max_tokens, numbers.Integral) and not isinstance(max_tokens, bool) \
                and max_tokens <= 0:
            max_tokens = -1  # llama-cpp-python's: None or <= 0 is until the end or a full context
        constraint = engine.target.grammar(_grammar_text(grammar)) if grammar is not None else None
        result = Result("", [], SpecStats())
        events = engine.stream(prompt, max_tokens=max_tokens, params=params, stop=stop or (), is_chat=is_chat,
                               result=result, logprobs=n_top, constraint=constraint)
        self.last_stats = result.stats
        return _Run(events, result)

    @staticmethod
    def _completion_chunks(run: "_Run", meta: dict, head: str, head_logprobs, fmt) -> Iterator[dict]:
        if head:
            yield {**meta, "choices": [{"text": head, "index": 0, "logprobs": head_logprobs, "finish_reason": None}]}
        sent = 0
        for event in run.events:
            sent += len(event.text)
            if event.text or fmt is not None and event.logprobs:
                yield {**meta, "choices": [{"text": event.text, "index": 0,
                                            "logprobs": fmt(event.logprobs) if fmt is not None else None,
                                            "finish_reason": None}]}
        result = run.result  # text held back as the start of a stop string that never came ends the answer
        yield {**meta, "choices": [{"text": result.text[sent:], "index": 0, "logprobs": None,
                                    "finish_reason": result.finish_reason}]}

    @staticmethod
    def _chat_chunks(run: "_Run", meta: dict, fmt) -> Iterator[dict]:
        meta = {**meta, "object": "chat.completion.chunk"}
        yield {**meta, "choices": [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None,
                                    "finish_reason": None}]}
        sent = 0
        for event in run.events:
            sent += len(event.text)
            if event.text or fmt is not None and event.logprobs:
                yield {**meta, "choices": [{"index": 0, "delta": {"content": event.text} if event.text else {},
                                            "logprobs": fmt(event.logprobs) if fmt is not None else None,
                                            "finish_reason": None}]}
        rest = run.result.text[sent:]  # held back as the start of a stop string that never came
        yield {**meta, "choices": [{"index": 0, "delta": {"content": rest} if rest else {}, "logprobs": None,
                                    "finish_reason": run.result.finish_reason}]}


_LOW_LEVEL = {"eval", "sample", "generate", "save_state", "load_state", "set_cache", "eval_tokens", "eval_logits",
              "input_ids", "scores", "n_tokens", "n_embd", "ctx", "model", "tokenizer", "metadata",
              "create_chat_completion_openai_v1", "logits_to_logprobs", "longest_token_prefix"}


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
