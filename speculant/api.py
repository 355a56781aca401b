"""The Python API, shaped like the CLI: `speculant.generate(prompt, model=..., draft_model=...)`."""

from __future__ import annotations

import functools
import os
import sys
from typing import Optional, Sequence

import numpy as np

from . import models
from .backends.base import Backend
from .drafters import CompositeDrafter, Drafter, HistoryDrafter, LookupDrafter, ModelDrafter
from .drafters.crossvocab import CrossVocabDrafter, same_vocabulary
from .engine import MAX_DRAFT, Engine, Result, token_limit
from .errors import SettingsError
from .verify import SamplingParams


BACKENDS = ("auto", "llama.cpp", "torch")


STATIC_TARGET_ROWS = 16  # a GPU target's fixed pass width: a verify pass of k + 1 <= 16 tokens is one pass


def uses_static_torch(device: Optional[str], self_spec: bool = False) -> bool:
    """The torch backend on a CUDA device is StaticTorchBackend (static KV, CUDA graphs: a pass costs ~1/8 of
    an eager one); CPUs, and a target that drafts with its own layers (self_spec: layer subsets), keep
    TorchBackend."""
    from .backends.torch import resolve_device

    return resolve_device(device).startswith("cuda") and not self_spec


def on_torch(model: Optional[str], backend: Optional[str]) -> bool:
    """Whether a model given with this backend setting runs on torch (auto: a transformers directory does)."""
    if not model or model in FREE_DRAFTERS:
        return False
    return backend == "torch" or (backend in (None, "auto") and os.path.isdir(os.path.expanduser(model)))


def check_torch_settings(model: str, backend: str, draft_model: Optional[str], draft_backend: str,
                         dtype: Optional[str], device: Optional[str], self_spec: bool = False) -> None:
    """--dtype / --device need a model on torch: the target, or a draft model (which may be on torch under a
    llama.cpp target)."""
    if not (dtype or device) or on_torch(model, backend):
        return
    if not self_spec and on_torch(draft_model, draft_backend):
        return
    raise SettingsError("--dtype and --device apply to the torch backend only: add --backend torch (the target) "
                        "or --backend-draft torch (the draft model), or leave them out")


MAX_THREADS = 512  # ggml's GGML_MAX_N_THREADS: more crashes inside its thread pool


def check_ctx_size(n_ctx) -> None:
    """-c: 0 (the model's training context) or an integer >= 16."""
    if not isinstance(n_ctx, int) or not (n_ctx == 0 or n_ctx >= 16):
        raise SettingsError(f"--ctx-size must be 0 (the model's training context) or an integer >= 16, got {n_ctx!r}")


def thread_count(text: str) -> Optional[int]:
    """A -t/--threads value as llama.cpp reads one: <= 0 (its default -1) is all cores (None)."""
    n = int(text)
    return None if n <= 0 else n


thread_count.__name__ = "int"  # argparse's message for a non-number: "invalid int value"


def check_threads(threads: Optional[int], flag: str) -> None:
    """None (all cores) or 1..MAX_THREADS."""
    if threads is not None and (not isinstance(threads, (int, np.integer)) or isinstance(threads, bool)):
        raise SettingsError(f"{flag} must be an integer, got {threads!r}")
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        raise SettingsError(f"{flag} must be 1..{MAX_THREADS}, got {threads} (this machine has {os.cpu_count()} "
                            f"cores)")


def load_backend(model: str, *, n_ctx: int = 4096, threads: Optional[int] = None, role: str = "target",
                 backend: str = "auto", dtype: Optional[str] = None, device: Optional[str] = None,
                 rpc: Sequence[str] = (), tensor_split: Optional[str] = None, parallel: int = 1,
                 self_spec: bool = False) -> Backend:
    """A registered model name, a GGUF path or a transformers directory -> a loaded backend.

    backend: "llama.cpp" (GGUF), "torch" (transformers; GGUFs are converted once), or "auto": torch for a
    directory, llama.cpp otherwise. rpc: llama.cpp RPC workers ("HOST:PORT") that hold part of the target's
    layers (in the proportions of tensor_split, see rpc.parse_tensor_split); the target then runs in a
    supervised child process (backends/supervised.py). parallel: concurrent requests the backend serves
    (llama.cpp: sequences of one context, each n_ctx long; backend.slot(i) is request slot i). self_spec: the
    target will draft with its own layers (a torch target on CUDA then stays TorchBackend, see
    uses_static_torch)."""
    check_ctx_size(n_ctx)
    check_threads(threads, "--threads")
    if backend not in BACKENDS:
        raise SettingsError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    check_parallel(parallel)
    if backend == "auto":
        backend = "torch" if os.path.isdir(os.path.expanduser(model)) else "llama.cpp"
    if parallel > 1 and (backend == "torch" or rpc):
        raise SettingsError("--parallel > 1 needs a local llama.cpp (GGUF) model: the torch backend and a target "
                            "split over --rpc workers serve one request at a time")
    if backend == "torch":
        try:
            from .backends.torch import load_torch_backend
        except ImportError as e:
            raise SettingsError(f"the torch backend needs torch and transformers ({e}); "
                                "install them with: pip install -e '.[torch]'") from None
        if uses_static_torch(device, self_spec):
            from .backends.torch_static import load_static_backend

            # a target's passes all have one width (bit-identical logits however they are cut); a draft's
            # take the smallest shape class that fits (it needs no invariance)
            return load_static_backend(model, dtype, device, rows=STATIC_TARGET_ROWS if role == "target" else None,
                                       n_ctx=n_ctx, threads=threads)
        return load_torch_backend(model, dtype=dtype, device=device, n_ctx=n_ctx, threads=threads)
    if dtype or device:
        raise SettingsError("--dtype and --device apply to the torch backend only")
    path = models.resolve(model)
    from .backends.llamacpp import LlamaCppBackend

    if role == "target":
        _warn_if_inexact()
    if rpc:
        from .backends.supervised import SupervisedBackend
        from .rpc import parse_tensor_split

        return SupervisedBackend(path, rpc, parse_tensor_split(tensor_split, len(rpc)), n_ctx=n_ctx,
                                 n_threads=threads)
    # repacked weights: faster, and exact in our build (see llamacpp.py); SPECULANT_REPACK=0 saves their memory
    return LlamaCppBackend(path, n_ctx=n_ctx, n_threads=threads, repack=repack_weights(), n_seq=parallel)


def check_parallel(parallel: int) -> None:
    if not isinstance(parallel, int) or isinstance(parallel, bool) or not 1 <= parallel <= MAX_PARALLEL:
        raise SettingsError(f"--parallel must be an integer in [1, {MAX_PARALLEL}], got {parallel!r}")


MAX_PARALLEL = 64  # llama.cpp's sequences per context (LLAMA_MAX_SEQ is 256); a merged pass holds <= 64 tokens


def repack_weights() -> bool:
    """Whether models load with their weights repacked (the default; SPECULANT_REPACK=0: not)."""
    return os.environ.get("SPECULANT_REPACK", "1") != "0"


@functools.lru_cache(maxsize=None)
def _warn_if_inexact() -> None:
    """Exactness depends on how llama.cpp was built: say so loudly, once, when it cannot be promised (results
    carry stats.exact_numerics = False)."""
    from .native import exactness_problems

    problems = exactness_problems()
    if problems:
        print(f"speculant: warning: greedy speculative output is NOT guaranteed to equal plain decoding: "
              f"{'; '.join(problems)}. Rebuild with `make setup` (native/build-llama.sh).", file=sys.stderr)


UNBATCHED_WARN_SHARE = 0.3  # warn when this share of a target's matrix bytes verifies one token at a time


def warn_unbatched_weights(target: Backend) -> Optional[str]:
    """Say (stderr; also returned) when much of a llama.cpp target's weights are of quantized types that verify
    passes compute one token at a time: there each drafted token adds much of a plain step to the check (a Q5_K_M
    Qwen 1.5B before its kernel: r(4) 2.5 against 1.7), so speculation pays far less (the adaptive policy prices
    that), and a user should know why, and what to use instead."""
    from .backends.llamacpp import LlamaCppBackend
    from .native import build_info, unbatched_weights

    if not isinstance(target, LlamaCppBackend) or build_info() is None:
        return None
    try:
        share, slow = unbatched_weights(target.path)
    except Exception:  # a file llama.cpp loaded but gguf-py cannot read: no advice rather than a failure
        return None
    if share < UNBATCHED_WARN_SHARE:
        return None
    types = ", ".join(sorted(slow, key=slow.get, reverse=True))
    advice = ("Q3_K_M, Q4_0, Q4_K_M, Q5_K_M, Q6_K, Q8_0, IQ3_M, IQ4_NL and IQ4_XS verify at batch cost "
              "(`speculant quantize`)")
    message = (f"speculant: warning: {share:.0%} of {target.name}'s weights are {types}, which verify passes "
               f"compute one token at a time (no multi-token kernel for them): each drafted token adds much of a plain "
               f"step to the check, so speculation pays far less on this file. {advice}.")
    print(message, file=sys.stderr)
    return message


LOOKUP = "lookup"  # -md lookup: prompt lookup instead of a draft model
HISTORY = "history"  # -md history: the suffix structure over the prompt and earlier outputs, no draft model
FREE_DRAFTERS = (LOOKUP, HISTORY)
DRAFT_VOCAB = 0  # default --draft-vocab: 0 keeps the full vocabulary (a cut did not pay for the Qwen pair)


def _chain(*drafters: Optional[Drafter]) -> Optional[Drafter]:
    """The present drafters in order (cheapest first); one alone is itself."""
    present = [d for d in drafters if d is not None]
    if len(present) > 1:
        return CompositeDrafter(*present)
    return present[0] if present else None


def lookup_by_default(draft_model: Optional[str], self_spec: bool) -> bool:
    """Whether prompt lookup drafts in front when not asked either way: in front of a model drafter (a draft
    model or self_spec), whose steps it saves where the text repeats (BENCHMARKS.md, 28th session)."""
    return bool(draft_model and draft_model not in FREE_DRAFTERS) or self_spec


def load_drafter(target: Backend, draft_model: Optional[str], *, lookup: Optional[bool] = None,
                 draft_p_min: float = 0.0, ngram_max: int = 4, ngram_min: int = 2, threads: Optional[int] = None,
                 draft_backend: str = "auto", dtype: Optional[str] = None, device: Optional[str] = None,
                 self_spec: bool = False, self_spec_exit: Optional[int] = None,
                 self_spec_config: Optional[str | os.PathLike] = None, draft_vocab: int = DRAFT_VOCAB,
                 history: bool = False, history_tokens: int = 16384, parallel: int = 1) -> Optional[Drafter]:
    """The drafter for a target: a draft model, prompt lookup (`draft_model="lookup"`), history drafting
    (`draft_model="history"`: a suffix trie over the prompt and this process's earlier outputs), or a chain
    (`lookup` / `history=True` with a model: history, then lookup, then the model when neither has
    anything worth verifying), or the target's own first layers (`self_spec`, torch targets: the layers
    `speculant calibrate` saved for the model, or those in the file self_spec_config, which implies self_spec;
    self_spec_exit: the first that many instead). lookup: None
    puts prompt lookup in front of a model (draft or self_spec) as the CLI does; False: the model alone.
    A draft with another vocabulary (another tokenizer) drafts through text (drafters/crossvocab.py). draft_vocab: a llama.cpp draft with more token ids than this
    runs from a copy whose output layer keeps only the first draft_vocab ids (speculant/vocabcut.py: a
    cheaper draft step, still lossless); 0 keeps them all. A request's prediction (Engine.stream) goes
    before all of them."""
    if not (0.0 <= draft_p_min < 1.0):
        raise SettingsError(f"--draft-p-min must be in [0, 1), got {draft_p_min}")
    if draft_vocab < 0:
        raise SettingsError(f"--draft-vocab must be >= 0, got {draft_vocab}")
    if self_spec_config is not None and self_spec_exit is not None:
        raise SettingsError("choose a self-spec calibration file or an exit layer, not both")
    self_spec = self_spec or self_spec_config is not None
    if lookup is None:
        lookup = lookup_by_default(draft_model, self_spec or self_spec_exit is not None)
    lookup_drafter = LookupDrafter(ngram_max, ngram_min) if lookup or draft_model == LOOKUP else None
    history_drafter = HistoryDrafter(max_tokens=history_tokens) if history or draft_model == HISTORY else None
    if draft_model or lookup or history:
        warn_unbatched_weights(target)
    if self_spec or self_spec_exit is not None:
        if draft_model and draft_model not in FREE_DRAFTERS:
            raise SettingsError("--self-spec drafts with the target's own layers: do not also pass a draft model")
        from .backends.torch import TorchBackend
        from .drafters.selfspec import SelfSpecDrafter

        if not isinstance(target, TorchBackend):
            raise SettingsError("--self-spec needs the torch backend for the target (--backend torch)")
        own = (SelfSpecDrafter(target, exit_layer=self_spec_exit, p_min=draft_p_min) if self_spec_exit is not None
               else SelfSpecDrafter.from_config(target, self_spec_config, p_min=draft_p_min))
        return _chain(history_drafter, lookup_drafter, own)
    if not draft_model or draft_model in FREE_DRAFTERS:
        return _chain(history_drafter, lookup_drafter)
    if parallel > 1 and draft_vocab:
        raise SettingsError("a draft with a cut vocabulary (--draft-vocab) serves one request at a time: use "
                            "--parallel 1 or --draft-vocab 0")
    draft_on_torch = on_torch(draft_model, draft_backend)
    torch_backends = sys.modules.get("speculant.backends.torch")  # loaded when the target runs on torch
    taken = (torch_backends.torch.get_num_threads()
             if draft_on_torch and torch_backends is not None and isinstance(target, torch_backends.TorchBackend)
             else None)
    if taken is not None:  # torch's thread count is one per process: the target's (-t) stays
        if threads is not None and threads != taken:
            print(f"speculant: warning: --threads-draft {threads} has no effect when the target and the draft "
                  f"both run on torch (its thread count is one per process): both use the target's {taken} "
                  f"(-t)", file=sys.stderr)
        threads = None
    draft = load_backend(draft_model, n_ctx=target.n_ctx, threads=threads, role="draft", backend=draft_backend,
                         dtype=dtype if draft_on_torch else None,
                         device=device if draft_on_torch else None, parallel=parallel)
    keep = None
    try:
        same_vocab = same_vocabulary(target, draft)
        from .backends.llamacpp import LlamaCppBackend

        if draft_vocab and not (same_vocab and isinstance(draft, LlamaCppBackend) and draft.n_vocab > draft_vocab):
            why = (f"the draft has only {draft.n_vocab} token ids" if same_vocab and isinstance(draft, LlamaCppBackend)
                   else "it cuts a llama.cpp draft of the target's vocabulary")
            print(f"speculant: warning: --draft-vocab {draft_vocab} has no effect: {why}", file=sys.stderr)
        elif draft_vocab:
            from .vocabcut import load_cut_draft

            draft.close()
            draft, keep = load_cut_draft(models.resolve(draft_model), draft_vocab, n_ctx=target.n_ctx,
                                         threads=threads)
    except BaseException:
        draft.close()
        raise
    model_drafter = (ModelDrafter(draft, target.n_vocab, p_min=draft_p_min, keep=keep, map_inputs=False) if same_vocab
                     else CrossVocabDrafter(draft, target, p_min=draft_p_min))
    return _chain(history_drafter, lookup_drafter, model_drafter)


def load_engine(model: str = models.DEFAULT_TARGET, draft_model: Optional[str] = None, *,
                draft_max: Optional[int] = None, draft_min: int = 1, draft_p_min: float = 0.0,
                adaptive: bool = True, lookup: Optional[bool] = None, ngram_max: int = 4, ngram_min: int = 2,
                n_ctx: int = 4096,
                threads: Optional[int] = None, backend: str = "auto", draft_backend: str = "auto",
                dtype: Optional[str] = None, device: Optional[str] = None, self_spec: bool = False,
                self_spec_exit: Optional[int] = None, self_spec_config: Optional[str | os.PathLike] = None,
                draft_vocab: int = DRAFT_VOCAB, draft_threads: Optional[int] = None, history: bool = False,
                history_tokens: int = 16384,
                long_max: Optional[int] = None, rpc: Sequence[str] = (), tensor_split: Optional[str] = None,
                parallel: int = 1) -> Engine:
    """Load a target and its drafter (see load_drafter). Without a drafter it is plain decoding.

    adaptive: choose the draft length per step (draft_max is then an upper bound, draft_min a lower one)
    and fall back to plain decoding when speculation does not pay; adaptive=False drafts draft_max always.
    draft_max None: 4, or 8 where the target's passes cost the same up to 8 tokens (engine.default_draft_max).
    long_max: the bound on free drafters that may go long (a request's prediction, history) when adaptive
    (default: 16, or 32 where long passes are cheap: engine.default_long_max).
    draft_threads: CPU threads of the draft model (default: threads). rpc, tensor_split: the target's
    layers spread over RPC workers (see load_backend); the draft stays local. parallel: concurrent requests
    (engine.for_slot(i) for i < parallel: one engine each, sharing the models; speculant/batching.py).
    Names, paths and a registered draft's tokenizer are checked before anything is loaded or downloaded."""
    if draft_max is not None and (not isinstance(draft_max, int) or draft_max < 0):
        raise SettingsError(f"--draft-max must be a non-negative integer, got {draft_max!r}")
    bound = MAX_DRAFT if draft_max is None else draft_max  # None: the engine's default, at least draft_min
    if not isinstance(draft_min, int) or not (0 <= draft_min <= max(bound, 1)):
        raise SettingsError(f"--draft-min must be an integer in [0, --draft-max], got {draft_min!r}")
    check_threads(threads, "--threads")
    check_threads(draft_threads, "--threads-draft")
    check_parallel(parallel)
    model = os.fspath(model) if isinstance(model, os.PathLike) else model
    draft_model = os.fspath(draft_model) if isinstance(draft_model, os.PathLike) else draft_model
    if not isinstance(model, str) or not model:
        raise SettingsError(f"model must be a registered name or a path, got {model!r}")
    if draft_model is not None and not isinstance(draft_model, str):
        raise SettingsError(f"draft_model must be a registered name, a path or 'lookup', got {draft_model!r}")
    if lookup is not None and not isinstance(lookup, bool):
        raise SettingsError(f"lookup must be True, False or None (the default), got {lookup!r}")
    self_spec = self_spec or self_spec_config is not None
    if parallel > 1 and (self_spec or self_spec_exit is not None):
        raise SettingsError("--self-spec runs on the torch backend, which serves one request at a time (--parallel 1)")
    for name in (model, draft_model):
        if name and name not in FREE_DRAFTERS and name not in models.REGISTRY and not os.path.isdir(os.path.expanduser(name)):
            models.resolve(name)  # an unknown name or a missing file fails now, not after a load
    if draft_max == 0 and (draft_model is not None or self_spec or self_spec_exit is not None or history):
        # nothing can be drafted: the drafter is not loaded (a draft model's memory and load time for nothing)
        draft_model, lookup, history, draft_vocab = None, None, False, 0
        self_spec, self_spec_exit, self_spec_config = False, None, None
    if rpc and (backend == "torch" or os.path.isdir(os.path.expanduser(model))):
        raise SettingsError("--rpc splits a llama.cpp (GGUF) target; the torch backend does not use RPC workers")
    check_torch_settings(model, backend, draft_model, draft_backend, dtype, device,
                         self_spec or self_spec_exit is not None)
    target_on_torch = on_torch(model, backend)
    target = load_backend(model, n_ctx=n_ctx, threads=threads, backend=backend,
                          dtype=dtype if target_on_torch else None, device=device if target_on_torch else None,
                          rpc=rpc, tensor_split=tensor_split, parallel=parallel,
                          self_spec=self_spec or self_spec_exit is not None)
    try:
        drafter = load_drafter(target, draft_model, lookup=lookup, draft_p_min=draft_p_min,
                               ngram_max=ngram_max, ngram_min=ngram_min, threads=draft_threads or threads,
                               draft_backend=draft_backend, dtype=dtype, device=device, self_spec=self_spec,
                               self_spec_exit=self_spec_exit, self_spec_config=self_spec_config,
                               draft_vocab=draft_vocab, history=history,
                               history_tokens=history_tokens, parallel=parallel)
    except BaseException:
        target.close()
        raise
    # (without a drafter draft_max still bounds a request's prediction when not adaptive)
    return Engine(target, drafter, draft_max=draft_max, adaptive=adaptive, draft_min=draft_min, long_max=long_max)


def generate(prompt: str | Sequence[int], *, model: str = models.DEFAULT_TARGET,
             draft_model: Optional[str] = None, draft_max: Optional[int] = None, draft_min: int = 1,
             draft_p_min: float = 0.0, adaptive: bool = True, lookup: Optional[bool] = None,
             max_tokens: Optional[int] = 128, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             min_p: float = 0.0, seed: Optional[int] = None, stop: Sequence[str] = (), chat: bool = False,
             n_ctx: int = 4096, threads: Optional[int] = None, prediction: Optional[str] = None,
             history: bool = False, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
             repetition_penalty: float = 1.0, penalty_last_n: Optional[int] = None,
             logit_bias: Optional[dict[int, float]] = None, logprobs: Optional[int] = None,
             suffix: Optional[str] = None, backend: str = "auto",
             draft_backend: str = "auto", dtype: Optional[str] = None, device: Optional[str] = None,
             self_spec: bool = False, self_spec_exit: Optional[int] = None,
             self_spec_config: Optional[str | os.PathLike] = None, draft_threads: Optional[int] = None) -> Result:
    """One-shot generation (loads the models, generates, frees them). Mirrors `speculant generate`, except that
    sampling is untruncated unless asked (top_k 0, top_p 1, min_p 0, as OpenAI's API; the CLI and the server's
    defaults take llama-cli's 40 / 0.95 / 0.05).
    max_tokens: -1 or None generates until the end of generation or a full context (as -n -1).
    prediction: text the output will mostly repeat (e.g. the file being edited): drafted first, lossless;
    result.stats.accepted_by_source["prediction"] counts the tokens it supplied.
    logit_bias {token id: bias} and the penalties adjust the target's logits (verify.adjust_logits; penalty_last_n:
    None counts as OpenAI and vLLM, N the last N tokens as llama.cpp's repeat_last_n); logprobs=N
    fills result.logprobs with each token's log-probability and N alternatives. suffix: fill in the middle
    between prompt and suffix (a code model with FIM tokens; Engine.fim_prompt). backend, draft_backend, dtype,
    device, self_spec, self_spec_exit, self_spec_config, draft_threads: as load_engine's (--backend,
    --backend-draft, --dtype, --device, --self-spec, --self-spec-exit, --self-spec-config, -td)."""
    params = SamplingParams(temperature, top_k, top_p, min_p, seed,
                            logit_bias=logit_bias or (),
                            presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                            repetition_penalty=repetition_penalty, penalty_last_n=penalty_last_n)
    token_limit(max_tokens)  # a bad one is refused before anything loads
    if suffix is not None and chat:
        raise SettingsError("a suffix fills in the middle of a text: it does not go with chat")
    if chat and not isinstance(prompt, str):
        raise SettingsError("chat=True takes the user's message as text, not token ids")
    engine = load_engine(model, draft_model, draft_max=draft_max, draft_min=draft_min, draft_p_min=draft_p_min,
                         adaptive=adaptive, lookup=lookup, n_ctx=n_ctx, threads=threads, history=history,
                         backend=backend, draft_backend=draft_backend, dtype=dtype, device=device,
                         self_spec=self_spec, self_spec_exit=self_spec_exit, self_spec_config=self_spec_config,
                         draft_threads=draft_threads)
    try:
        if suffix is not None:
            text = engine.fim_prompt(prompt, suffix)
        else:
            text = engine.chat_prompt([{"role": "user", "content": prompt}]) if chat else prompt
        return engine.generate(text, max_tokens=max_tokens, params=params, stop=stop, is_chat=chat,
                               prediction=prediction, logprobs=logprobs)
    finally:
        engine.close()
