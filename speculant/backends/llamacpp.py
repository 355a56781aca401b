"""llama.cpp backend over llama-cpp-python's low-level API (GGUF models, quantized, CPU).

Numerics: the engine's exactness needs a target pass over k+1 tokens to give bit-identical logits to k+1
single-token passes. Stock llama.cpp has matmul paths that round differently by batch size: the llamafile sgemm,
repacked weights (one-token gemv against 4-token gemm), and the tiled K-quant kernel taken at >= 8 rows; flash attention also switches to a tiled kernel for >= 64 queries, so
it stays off. Our build (native/) sends every pass of at most `invariant_rows()` (64) tokens to batch-invariant
kernels (native/src/speculant-mm.c): weights load repacked 8 rows at a time (`repack=True`, llama.cpp's fastest
layout on x86) and Q4_K/Q6_K/Q4_0/IQ4_NL go through our multi-token kernels (per column the bits of ggml's
one-token kernel), Q2_K (repacked on AVX-512 CPUs only) through ggml's one-token kernel column by column there;
Q8_0/Q5_0/Q4_1/Q5_1/Q2_K/Q3_K/Q5_K/IQ4_XS, the IQ2/IQ3 types, and unrepacked Q4_K/Q6_K/Q4_0/IQ4_NL (`repack=False`: less memory,
slower) through our plain-layout multi-token kernels (with ggml's dot-product arithmetic; RPC workers and the process
driving them: with the repacked kernels', native.set_plain_as_repacked), other types through ggml's dot products
column by column; llamafile's sgemm and the tiled kernels are kept off those passes. So decode and verify passes give
bit-identical logits (tests/test_llamacpp.py); longer passes, which only prompt processing makes, keep
llama.cpp's fast batched kernels (llamafile's sgemm for the attention products included).

"The target alone" is therefore: the prompt (all but its last token) evaluated in chunks of `prefill_chunk`
positions from position 0 (invariant_rows, 64, with our build: batch-invariant passes, so any cached prefix
carries over; n_batch with a stock build), then one token per pass. `prefill()` reproduces exactly that on a
warm cache (the server's prefix reuse): it keeps a cached position only where a fresh prefill would have
computed it by the same kind of pass (see `prefill`). A draft needs no such care: any q is verified exactly.
"""

from __future__ import annotations

import collections
import copy
import ctypes
import itertools
import os
import sys
import threading
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from ..batching import GATHERER, Job
from ..errors import Cancelled, ModelError, SettingsError, nonfinite_logits
from ..native import _ggml, build_info, exactness_problems, invariant_rows, load_backends
from ..signals import deferred_signals
from .base import Backend, VocabInfo, common_prefix


try:
    import llama_cpp as ll
except ImportError as e:  # pragma: no cover - an install problem, reported clearly
    raise ModelError("llama-cpp-python is not installed; run `make setup`") from e

# recent llama.cpp log lines, for error messages, kept per thread as (number, line): a load, a pass or a grammar
# reads the lines its own thread logged since it began (_ThreadLog), so two models loading at once in two threads
# (the server's slots, a draft beside its target) neither give each other's causes nor push them out
_LOG = threading.local()
_LINE_NUMBERS = itertools.count()


def _thread_lines() -> collections.deque:
    lines = getattr(_LOG, "lines", None)
    if lines is None:
        lines = _LOG.lines = collections.deque(maxlen=50)
    return lines
_VERBOSE = os.environ.get("SPECULANT_VERBOSE", "") not in ("", "0")


@ll.llama_log_callback
def _log_callback(level: int, text: bytes, user_data) -> None:
    line = text.decode("utf-8", errors="replace")
    _thread_lines().append((next(_LINE_NUMBERS), line))
    if _VERBOSE:
        print(line, end="", flush=True)


if build_info() is None:  # a stock build: its tiled K-quant kernel would break batch invariance
    os.environ["GGML_CPU_TILED_MM"] = "0"  # read once by ggml at the first matmul
ll.llama_log_set(_log_callback, ctypes.c_void_p(0))
ll.llama_backend_init()
load_backends()  # our wheel picks its CPU kernels (ISA level) at run time: see speculant/native.py


class _TensorBuftOverride(ctypes.Structure):
    """llama_model_tensor_buft_override: tensors whose name matches `pattern` (a regex) go to `buft`."""
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _ggml_cpu_buffer_type() -> int:
    g = _ggml()
    g.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    return g.ggml_backend_cpu_buffer_type()


class _ThreadLog:
    """The llama.cpp log lines this thread logs from now on (an iterable of str, read at any time)."""

    def __init__(self):
        self.lines, self.after = _thread_lines(), next(_LINE_NUMBERS)

    def __iter__(self):
        return iter([line for n, line in list(self.lines) if n > self.after])


def _last_errors(log: _ThreadLog) -> str:
    lines = [line.strip() for line in log if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]  # the cause ("unknown model architecture")
    failed = [line for line in lines if "failed" in line.lower()]  # before llama.cpp's "failed to load model"
    return (errors or failed or lines or ["no details"])[-1]


class LlamaCppBackend(Backend):
    """One GGUF model and one llama.cpp context; this object is its sequence 0, `slot(i)` its sequence i."""

    def __init__(self, path: str | Path, *, n_ctx: int = 4096, n_threads: Optional[int] = None,
                 n_batch: int = 512, repack: bool = True, flash_attn: int = 0, embed=None,
                 devices: Sequence[int] = (), device_layers: Sequence[int] = (),
                 n_seq: int = 1):
        """embed: token ids -> input embeddings [n, n_embd] float32. When given, every pass feeds embeddings
        instead of ids (a draft whose vocabulary was cut still reads every token of the context exactly:
        speculant/vocabcut.py), and ids are not limited to this model's vocabulary.
        devices: ggml devices (RPC workers: speculant/rpc.py) that hold the last repeating layers, device_layers[i]
        of them on devices[i] (in order); the rest stays on this CPU, with the embeddings and the output layer.
        n_seq: sequences (concurrent requests), each with n_ctx positions of its own KV stream; their
        passes merge into one (speculant/batching.py) with the bits each would get alone."""
        super().__init__()
        if not isinstance(n_seq, int) or n_seq < 1:
            raise SettingsError(f"--parallel must be a positive integer, got {n_seq!r}")
        if n_seq > 1 and embed is not None:
            raise SettingsError("a draft with a cut vocabulary (--draft-vocab) serves one request at a time; "
                                "use --parallel 1 or --draft-vocab 0")
        self.n_seq = n_seq
        self._seq = 0  # the llama.cpp sequence id this object reads and writes
        self._owner = True  # frees the model and context (a slot shares them)
        self._primary = self
        self.path = Path(path)
        self.embed = embed
        self.repack = repack
        self.offloaded = bool(devices)  # layers on RPC workers: a pass waits on the network as well
        self.name = self.path.name
        mparams = ll.llama_model_default_params()
        mparams.use_extra_bufts = repack  # weights repacked 8 rows at a time: faster kernels
        # repacking copies the matrices out of the file; mmapped, their pages would stay resident beside the
        # copy (twice the memory): read the file instead (plan.py)
        mparams.load_mode = ll.LLAMA_LOAD_MODE_NONE if repack else ll.LLAMA_LOAD_MODE_MMAP
        mparams.n_gpu_layers = 0
        if devices:  # NULL-terminated; llama.cpp copies these arrays during the load
            device_list = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)
            mparams.devices = ctypes.cast(device_list, ctypes.c_void_p)
            # llama.cpp offloads the output layer as the last of n_gpu_layers; it stays here (its weights below):
            # one row of logits is n_vocab floats (600 KB for Qwen) to fetch over the network, its input n_embd
            mparams.n_gpu_layers = sum(device_layers) + 1
            # device i takes the layers whose index among the offloaded ones is below the split's i-th cumulative
            # fraction: fractions of whole layers give each device exactly its count
            split = (ctypes.c_float * ll.llama_max_devices())(*device_layers[:-1], device_layers[-1] + 1)
            mparams.tensor_split = ctypes.cast(split, ctypes.POINTER(ctypes.c_float))
            cpu = _ggml_cpu_buffer_type()  # weights overridden to it are laid out as a local load's (repacked)
            output_here = (_TensorBuftOverride * 2)((rb"^(output|output_norm|token_embd)\.", cpu), (None, None))
            mparams.tensor_buft_overrides = ctypes.cast(output_here, ctypes.c_void_p)
        log = _ThreadLog()
        # Ctrl-C inside llama.cpp's callbacks would be lost: it is recorded, the progress callback aborts the
        # load, and KeyboardInterrupt is raised when the C call has returned
        with deferred_signals() as interrupt:
            mparams.progress_callback = ll.llama_progress_callback(  # False aborts the load
                lambda progress, user_data: interrupt.received is None)
            self._model = ll.llama_model_load_from_file(str(self.path).encode(), mparams)
            if self._model and interrupt.received is not None:
                ll.llama_model_free(self._model)
                self._model = None
        if not self._model:
            raise ModelError(f"llama.cpp could not load {self.path}: {_last_errors(log)}")
        self._vocab_handle = ll.llama_model_get_vocab(self._model)
        self.n_vocab = ll.llama_vocab_n_tokens(self._vocab)
        self.n_ctx_train = ll.llama_model_n_ctx_train(self._model)
        threads = n_threads or os.cpu_count() or 1
        cparams = ll.llama_context_default_params()
        n_ctx = n_ctx or self.n_ctx_train  # 0: the model's training context
        if 0 < self.n_ctx_train < n_ctx:  # positions past it are ones the model never saw
            print(f"speculant: warning: --ctx-size {n_ctx} is more than {self.name}'s training context "
                  f"({self.n_ctx_train} tokens); using {self.n_ctx_train}", file=sys.stderr)
            n_ctx = self.n_ctx_train
        cparams.n_ctx = n_ctx * n_seq
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq
        cparams.kv_unified = False  # a KV stream per sequence: its cells sit where they would alone
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        cparams.flash_attn_type = flash_attn
        with deferred_signals() as interrupt:
            self._ctx = ll.llama_init_from_model(self._model, cparams)
            if interrupt.received is not None:
                self.close()
        if not self._ctx:
            ll.llama_model_free(self._model)
            self._model = None
            raise ModelError(f"llama.cpp could not create a context for {self.path}: {_last_errors(log)}")
        self._cells = ll.llama_n_ctx_seq(self._ctx)  # KV cells of each sequence's stream
        self.n_ctx = min(n_ctx, self._cells)  # llama.cpp pads n_ctx; keep the user's limit
        self.n_batch = min(n_batch, ll.llama_n_batch(self._ctx), ll.llama_n_ubatch(self._ctx))  # llama.cpp may lower it
        self.n_threads = threads
        self._memory_handle = ll.llama_get_memory(self._ctx)
        self.n_embd = ll.llama_model_n_embd(self._model)
        self._batch = ll.llama_batch_init(self.n_batch, self.n_embd if embed else 0, 1)
        self.invariant_rows = invariant_rows()
        # prompt processing in batch-invariant passes: every cached position is then reusable by a later prompt
        # that shares it (whatever its length), and on our kernels 64-token passes process a prompt faster than
        # llama.cpp's 512-token fast ones (Qwen 1.5B, 2 threads, 512 tokens: 3.7 vs 4.6 s on the AVX-512
        # variant, 6.5 vs 7.6 s on the AVX2 one)
        self.prefill_chunk = min(self.n_batch, self.invariant_rows) or self.n_batch  # SPECULANT_INVARIANT_ROWS=0: ggml's
        self.exact_numerics = not exactness_problems()
        self._passes: list = []  # per cached position, the pass that computed it: _pass_kind(start, n)
        self._piece_cache: dict[int, bytes] = {}
        self._text_cache: dict[int, bytes] = {}  # token_text: control tokens written out
        self._eog = {t for t in range(self.n_vocab) if ll.llama_vocab_is_eog(self._vocab, t)}
        # A process's first passes over a model run slowly (its weights are touched for the first time; Qwen 1.5B:
        # 91 against 61 ms for the first 1-token pass with logits, the 0.5B draft 141 against 18 ms, prompt
        # processing 1.5x slower), and the adaptive policy would time them as what plain decoding and a draft
        # step cost, drafting too much for the rest of the request. One pass here pays that at load instead.
        warm = self.eval([0], n_logits=1)
        self.rewind(0)
        if not np.isfinite(warm).all():
            self.close()
            raise nonfinite_logits(self.path)

    # -- decode loop --------------------------------------------------------------------------------------
    # The vocabulary and KV memory live in the model and context that close() frees: read after it, they crashed
    # the process (a closed engine's chat_prompt, or a slot of a closed primary). Every use goes through these.
    @property
    def _vocab(self):
        self._check_open()
        return self._primary._vocab_handle

    @property
    def _memory(self):
        self._check_open()
        return self._primary._memory_handle

    def _check_open(self) -> None:
        if self._primary._model is None or getattr(self._primary, "_ctx", "loading") is None:
            raise SettingsError(f"{self.name} is closed: load it again")

    def slot(self, i: int) -> "LlamaCppBackend":
        """Sequence i of this context, as a backend of its own (0: this object). Slots share the model, the
        context and its passes: a slot's pass merges with the other slots' waiting ones."""
        if i == 0:
            return self
        if not (isinstance(i, int) and 0 < i < self.n_seq):
            raise SettingsError(f"{self.name}: slot {i!r} does not exist (the context has {self.n_seq} sequences)")
        s = copy.copy(self)
        s._seq, s._owner, s.tokens, s._passes = i, False, [], []
        return s

    def busy(self, on: bool, key: Optional[int] = None) -> None:
        if self.n_seq > 1:
            GATHERER.busy(on, key)

    def sharing(self) -> int:
        return max(GATHERER.busy_count(), 1) if self.n_seq > 1 else 1

    def _decode(self, tokens: Sequence[int], start: int, n_logits: int) -> np.ndarray:
        """Passes of at most prefill_chunk tokens, as a prompt's: a draft model's prompt and catch-ups too (the
        draft's numerics do not matter, but in 512-token passes llama.cpp's fast kernels took 1.87 s for the 0.5B
        Q4_0 draft's 512-token prompt against 1.55 in ours, and 0.85 with AMX)."""
        self._truncate(start)
        n = len(tokens)
        out = np.empty((n_logits, self.n_vocab), dtype=np.float32)
        filled = 0
        step = self.prefill_chunk
        for lo in range(0, n, step):
            chunk = [int(t) for t in tokens[lo : lo + step]]
            want = max(0, min(len(chunk), lo + len(chunk) - (n - n_logits)))  # logits of its last `want`
            job = Job(self._primary, self._seq, start + lo, chunk, want)
            if self.n_seq == 1:
                self._primary.run_group([job])
                rows = job.result
            else:
                rows = GATHERER.submit(job, self._primary.merge)
            self._passes.extend([self._pass_kind(start + lo, len(chunk))] * len(chunk))
            if want:
                out[filled : filled + want] = rows
                filled += want
        return out

    def merge(self, jobs: list[Job]) -> list[Job]:
        """Of the waiting passes (jobs[0] the oldest), those to run with jobs[0] as one pass. A merged pass
        pads every sequence to the longest (run_group), so passes of unlike sizes may cost more merged than
        apart: the waiting passes, by size, are cut into the groups of least total cost (this machine's
        pass costs r(n), costprofile.py), each within the batch-invariant kernels (at most invariant_rows
        tokens) and within every member's KV cells; jobs[0]'s group runs now, the others next."""
        head = jobs[0]
        limit = min(self.invariant_rows, self.n_batch)
        if len(head.tokens) > limit:  # a prompt chunk: llama.cpp's fast kernels, alone
            return [head]
        small = sorted((j for j in jobs if len(j.tokens) <= limit), key=lambda j: (len(j.tokens), j.seq))
        cost = self._pass_cost()
        # best[i]: least cost of running small[:i]; cut[i]: where its last group starts
        best, cut = [0.0] + [float("inf")] * len(small), [0] * (len(small) + 1)
        for i in range(1, len(small) + 1):
            m = len(small[i - 1].tokens)  # the longest of any group ending at i (sorted by size)
            for a in range(i - 1, -1, -1):
                if m * (i - a) > limit or small[a].start + m > self._cells:
                    break
                c = best[a] + cost(m * (i - a))
                if c < best[i]:
                    best[i], cut[i] = c, a
        i = len(small)
        while i > 0:
            group = small[cut[i]:i]
            if head in group:
                return group
            i = cut[i]
        return [head]

    def _pass_cost(self):
        """n -> the cost of one pass over n tokens, in one-token passes (measured r(n), linear beyond it)."""
        if getattr(self, "_cost", None) is None:
            from .. import costprofile

            r = costprofile.get(self, measure=False) or {1: 1.0, 2: 1.5}
            ns, rs = sorted(r), [r[n] for n in sorted(r)]
            slope = (rs[-1] - rs[0]) / (ns[-1] - 1) if ns[-1] > 1 else 0.5
            self._cost = lambda n: float(np.interp(n, ns, rs)) if n <= ns[-1] else rs[-1] + slope * (n - ns[-1])
        return self._cost

    def run_group(self, jobs: list[Job]) -> None:
        """One llama_decode over the jobs (of different sequences; sequence order). A merged pass needs as
        many tokens of every sequence (llama.cpp's split KV streams): shorter ones are padded by repeating
        their last token at the following positions, without logits, and those positions are dropped after."""
        self._check_open()
        jobs = sorted(jobs, key=lambda j: j.seq)
        m = max(len(j.tokens) for j in jobs) if len(jobs) > 1 else len(jobs[0].tokens)
        b = self._batch
        b.n_tokens = len(jobs) * m
        if self.embed is not None:
            rows = np.ctypeslib.as_array(b.embd, shape=(self.n_batch, self.n_embd))
            rows[:m] = self.embed(jobs[0].tokens)
        i = 0
        for job in jobs:
            real = len(job.tokens)
            first_logit = real - job.n_logits
            for p in range(m):
                if self.embed is None:
                    b.token[i] = job.tokens[min(p, real - 1)]
                b.pos[i] = job.start + p
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = job.seq
                b.logits[i] = first_logit <= p < real
                i += 1
        log = _ThreadLog()
        rc = ll.llama_decode(self._ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc} ({_last_errors(log)})")
        n_out = sum(j.n_logits for j in jobs)
        if n_out:
            logits = np.ctypeslib.as_array(ll.llama_get_logits(self._ctx), shape=(n_out, self.n_vocab))
            if self.n_seq > 1:  # the next pass overwrites llama.cpp's buffer before a waiting thread reads it
                logits = logits.copy()
        o = 0
        for job in jobs:
            job.result = logits[o : o + job.n_logits] if job.n_logits else None
            o += job.n_logits
            if len(job.tokens) < m:  # the padding
                ll.llama_memory_seq_rm(self._memory, job.seq, job.start + len(job.tokens), -1)

    def copy_prefix(self, source: "LlamaCppBackend", context: Sequence[int]) -> int:
        """Make this slot's cache hold the longest prefix of `context` that slot `source` (of the same context)
        holds, when that is longer than what it holds itself: llama.cpp copies source's KV stream into this
        one (tens of ms, where evaluating a long prompt again takes seconds; the bits are the source's, which
        are the ones a prefill here would compute). Runs between passes, so `source` may be decoding another
        request: only positions its cache and its token list agree on are taken. Returns the positions held."""
        if source._primary is not self._primary or source._seq == self._seq:
            raise ValueError("copy_prefix: source must be another slot of the same context")

        def copy() -> int:
            own = common_prefix(self.tokens, context)
            tokens, passes = list(source.tokens), list(source._passes)  # taken at once, between passes
            n = min(common_prefix(tokens, context), len(passes),
                    int(ll.llama_memory_seq_pos_max(self._memory, source._seq)) + 1)
            if n <= own:
                return own
            # the stream's cells now, its data at the next pass (before that pass writes anything)
            ll.llama_memory_seq_cp(self._memory, source._seq, self._seq, -1, -1)
            ll.llama_memory_seq_rm(self._memory, self._seq, n, -1)
            self.tokens[:] = tokens[:n]
            self._passes[:] = passes[:n]
            return n

        return GATHERER.run_alone(copy) if self.n_seq > 1 else 0

    def _truncate(self, n_kept: int) -> None:
        ll.llama_memory_seq_rm(self._memory, self._seq, n_kept, -1)
        del self._passes[n_kept:]

    def _pass_kind(self, start: int, n: int):
        """What a position's numerics depend on besides the tokens: 0 for an invariant pass (any size up to
        invariant_rows), else the exact (start, size) of the fast batched pass that computed it."""
        return 0 if n <= self.invariant_rows else (start, n)

    def prefill(self, context: Sequence[int]) -> int:
        """Make the cache hold `context` exactly as a fresh prefill would: chunks of prefill_chunk positions
        from position 0. A cached position is kept only where that prefill would compute it by the same kind of
        pass (an invariant pass, or the same fast pass over the same chunk), and the rest is evaluated in the
        fresh prefill's own chunks, so a warm cache gives the bits a cold one gives. Returns the positions kept."""
        step = self.prefill_chunk
        chunks = [(a, min(a + step, len(context))) for a in range(0, len(context), step)]
        common = common_prefix(self.tokens, context)
        kept = 0
        for a, b in chunks:
            fresh = self._pass_kind(a, b - a)
            if fresh == 0:  # any cached invariant position carries over, up to the first difference
                while kept < min(b, common) and self._passes[kept] == 0:
                    kept += 1
                if kept < b:
                    break
            elif common >= b and all(kind == fresh for kind in self._passes[a:b]):
                kept = b
            else:
                break
        self.rewind(kept)
        stop = self.should_stop  # this request's (a server installs the next request's while this one may run)
        for a, b in chunks:
            if b > kept:
                if stop is not None and stop():
                    raise Cancelled(f"prompt processing stopped after {a} of {len(context)} tokens")
                self.eval(context[max(a, kept):b], n_logits=0)
        return kept

    # -- text ---------------------------------------------------------------------------------------------
    def cost_profile(self) -> Optional[dict[int, float]]:
        from .. import costprofile

        return costprofile.get(self)

    def one_pass_seconds(self) -> Optional[float]:
        from .. import costprofile

        return costprofile.one_pass_seconds(self)

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (ll.llama_token * cap)()
        n = ll.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:  # buffer too small: -n is the size needed
            cap = -n
            buf = (ll.llama_token * cap)()
            n = ll.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def _piece(self, token: int, special: bool, cache: dict) -> bytes:
        piece = cache.get(token)
        if piece is None:
            self.check_ids((token,))  # llama.cpp throws std::out_of_range: the process aborts
            buf = ctypes.create_string_buffer(64)
            n = ll.llama_token_to_piece(self._vocab, token, buf, 64, 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = ll.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
            piece = cache[token] = buf.raw[:n]
        return piece

    def token_bytes(self, token: int) -> bytes:
        return self._piece(token, False, self._piece_cache)

    def token_text(self, token: int) -> bytes:
        return self._piece(token, True, self._text_cache)

    def grammar(self, gbnf: str, root: str = "root"):
        from ..constraint import GrammarConstraint

        return GrammarConstraint.from_gbnf(self._vocab, self.n_vocab, frozenset(self._eog), gbnf, root,
                                           log=_ThreadLog())

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    def metadata(self, key: str) -> Optional[str]:
        self._check_open()
        size = 1 << 16
        while True:
            buf = ctypes.create_string_buffer(size)
            n = ll.llama_model_meta_val_str(self._model, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return buf.value.decode("utf-8", errors="replace")
            size = n + 1

    def chat_template(self) -> Optional[str]:
        return self.metadata("tokenizer.chat_template")

    def _special_text(self, token: int) -> str:
        if token < 0 or token >= self.n_vocab:
            return ""
        return (ll.llama_vocab_get_text(self._vocab, token) or b"").decode("utf-8", errors="replace")

    @property
    def bos_token(self) -> str:
        return self._special_text(ll.llama_vocab_bos(self._vocab))

    @property
    def eos_token(self) -> str:
        return self._special_text(ll.llama_vocab_eos(self._vocab))

    def add_bos(self) -> bool:
        return bool(ll.llama_vocab_get_add_bos(self._vocab))

    def fim_tokens(self) -> Optional[tuple[int, int, int]]:
        ids = tuple(int(f(self._vocab)) for f in (ll.llama_vocab_fim_pre, ll.llama_vocab_fim_suf, ll.llama_vocab_fim_mid))
        return ids if all(0 <= t < self.n_vocab for t in ids) else None

    def fim_repo_tokens(self) -> Optional[tuple[int, int]]:
        ids = tuple(int(f(self._vocab)) for f in (ll.llama_vocab_fim_rep, ll.llama_vocab_fim_sep))
        return ids if all(0 <= t < self.n_vocab for t in ids) else None

    def vocab_info(self) -> VocabInfo:
        v = self._vocab
        kinds = {1: "spm", 2: "bpe", 3: "wpm", 4: "ugm", 5: "rwkv", 6: "plamo2"}
        texts = [ll.llama_vocab_get_text(v, t) or b"" for t in range(self.n_vocab)]
        unused = frozenset(
            t for t in range(self.n_vocab) if ll.llama_vocab_get_attr(v, t) & ll.LLAMA_TOKEN_ATTR_UNUSED
        )
        special = {
            name: (tok if tok >= 0 else None)
            for name, tok in (
                ("bos", ll.llama_vocab_bos(v)),
                ("eos", ll.llama_vocab_eos(v)),
                ("eot", ll.llama_vocab_eot(v)),
                ("pad", ll.llama_vocab_pad(v)),
            )
        }
        return VocabInfo(self.n_vocab, kinds.get(ll.llama_vocab_type(v), "other"), texts, special, unused)

    def close(self) -> None:
        if not getattr(self, "_owner", True):  # a slot: the context and model are its primary's
            return
        if getattr(self, "_ctx", None):
            if getattr(self, "_batch", None) is not None:
                ll.llama_batch_free(self._batch)
                self._batch = None
            ll.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            ll.llama_model_free(self._model)
            self._model = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
