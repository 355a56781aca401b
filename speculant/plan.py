"""`speculant plan`: what a target and its draft cost in memory, before loading them.

Per model (llama.cpp backend), from the GGUF header alone (tensor types and shapes, n_layer, heads, ...):
- weights: the file's tensor data is mmapped (file-backed pages, shared through the page cache with every
  process and every copy that maps the same file); every page is touched by the first passes, so all of it
  counts in the process's resident set. Models load with repacking on (faster kernels, exact in our build;
  SPECULANT_REPACK=0 turns it off): their Q4_0 / Q4_K / Q6_K / IQ4_NL matrices are also copied into an
  anonymous, repacked buffer (the mapped pages stay resident too).
- KV cache: n_layer x n_ctx x (n_head_kv x (head_dim_k + head_dim_v)) x 2 bytes (f16 K and V); llama.cpp
  clears it when the context is made, so all of it is resident from the start.
- compute buffers: llama.cpp reserves address space for the worst pass it can imagine (all 512 logits of a
  prompt chunk: `compute_reserved`, its "compute buffer size" log line), but pages count only once touched.
  Our passes touch at worst: a prompt chunk's attention scores over the whole prompt (f32 scores
  and mask, plus ggml's work buffer holding them again in f16 for the product with V), its feed-forward
  activations, or the logits of the positions the engine asks for. A chunk is what the backend reads a prompt
  in (prefill_chunk: 64 tokens with our build, SPECULANT_INVARIANT_ROWS=0: 512). The plan's default is a
  prompt that fills the context (the worst case); --prompt-tokens plans a shorter one.
- output buffer: logits of the positions one pass returns (n_vocab floats each; k+1 for a verify pass).
Plus the runtime: the interpreter, numpy and llama.cpp's libraries, the token tables of each vocabulary
(llama.cpp's and ours) and what each loaded model holds beside its buffers: constants (`RUNTIME_*`) fit to
measured peaks; `plan --measure` checks the whole plan against a fresh child process, and tests/test_plan.py
against the real pair.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from . import api, models, native, quantize
from .errors import ModelError, SettingsError

MiB = 2 ** 20
N_UBATCH = 512  # the backend's n_batch = n_ubatch (backends/llamacpp.py): what llama.cpp reserves for
# matrices our build repacks on x86: with AVX2 and up, and also with AVX-512 (llama.cpp's repack.cpp chooses)
REPACKED_TYPES = {"Q4_0", "Q4_K", "Q6_K", "IQ4_NL", "MXFP4"}
REPACKED_WITH_AVX512 = {"Q2_K"}
KV_BYTES = 2  # f16 K and V cache
RUNTIME_BASE = 48 * MiB  # interpreter, numpy, llama.cpp's libraries (fit to measured peaks, see below)
# bytes per vocabulary entry of each loaded model: llama.cpp's token tables and ours (fit to measured peaks:
# smollm2 at n_ctx 1024-8192 and the Qwen pair at 2048-4096, 2 parameters for 6 measurements)
RUNTIME_PER_VOCAB = 366
# what each loaded model (and its context) holds beyond the buffers above, the same ~30 MiB for SmolLM2 and each
# Qwen: fit to peaks measured with 64-token prompt chunks (SmolLM2 at n_ctx 1024-8192 with prompts of 200 to
# n_ctx tokens, the Qwen pair at 4096); until then the 512-token chunks' attention buffers, overstated, hid it
RUNTIME_PER_MODEL = 30 * MiB
# a target split over RPC workers: its part here runs in a child process (backends/supervised.py) with an interpreter
# and llama.cpp's libraries of its own; a `speculant worker` process holds the same beside its layers (both fit to
# peaks measured with Qwen 1.5B and SmolLM2 split over one and two workers, below)
RUNTIME_SPLIT_CHILD = RUNTIME_BASE
RUNTIME_WORKER = 60 * MiB


@dataclass
class ModelMemory:
    """One model's memory in bytes (resident at peak) and the facts it was computed from."""

    name: str
    role: str  # target | draft
    path: str
    file_type: str
    file_bytes: int
    mapped: int  # mmapped tensor data: file-backed, shared across processes and copies
    repacked: int  # anonymous copies of repacked matrices
    loaded: int  # the rest of the tensor data, read into this process (repacking loads without mmap)
    kv_per_token: int
    kv: int
    compute: int  # resident: what the worst pass touches (compute_resident)
    compute_reserved: int  # address space llama.cpp reserves (its "compute buffer size" log line)
    output: int
    vocab_tables: int
    n_params: int
    n_layer: int
    n_vocab: int
    types: dict = field(default_factory=dict)  # tensor type -> bytes
    unbatched: float = 0.0  # share of matmul weight bytes our kernels compute one token at a time on this CPU
    other: int = RUNTIME_PER_MODEL  # the model's and its context's bookkeeping beside the buffers

    @property
    def total(self) -> int:
        return self.mapped + self.loaded + self.repacked + self.kv + self.compute + self.output + self.vocab_tables \
            + self.other

    @property
    def anonymous(self) -> int:
        """What only this process holds (everything but the shared mmapped weights)."""
        return self.total - self.mapped


@dataclass
class WorkerMemory:
    """A `speculant worker`'s share of a target split over RPC (resident at peak, bytes): its layers' weights in
    llama.cpp's plain layout (RPC offers no repacked buffers), their KV cache, the compute buffers its part of a
    pass touches (no logits: the output layer stays on the machine that runs the model) and the process."""

    endpoint: str
    first_layer: int
    layers: int
    weights: int
    kv: int
    compute: int
    other: int = RUNTIME_WORKER

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute + self.other


@dataclass
class Plan:
    n_ctx: int
    models: list[ModelMemory]
    runtime: int = RUNTIME_BASE
    n_prompt: Optional[int] = None  # None: a prompt that fills the context
    parallel: int = 1  # request slots (serve -np): a KV cache of n_ctx each
    workers: list[WorkerMemory] = field(default_factory=list)  # --rpc: the target's last layers are theirs

    @property
    def total(self) -> int:
        """This machine's total (with --rpc: without the workers' shares)."""
        return self.runtime + sum(m.total for m in self.models)

    def to_dict(self) -> dict:
        """The plan as JSON: the *_mb sizes are MiB (2^20 bytes), as the table prints them."""
        return {"n_ctx": self.n_ctx, "parallel": self.parallel, "prompt_tokens": self.n_prompt or self.n_ctx,
                "runtime_mb": _mb(self.runtime),
                "total_mb": _mb(self.total),
                "models": [{**{k: v for k, v in asdict(m).items() if k != "types"},
                            **{f"{k}_mb": _mb(getattr(m, k)) for k in ("mapped", "loaded", "repacked", "kv", "compute",
                                                                         "output", "vocab_tables", "other", "total",
                                                                         "anonymous")},
                            "types_mb": {k: _mb(v) for k, v in sorted(m.types.items())}} for m in self.models],
                **({"workers": [{"endpoint": w.endpoint, "first_layer": w.first_layer, "layers": w.layers,
                                 **{f"{k}_mb": _mb(getattr(w, k)) for k in ("weights", "kv", "compute", "other",
                                                                             "total")}} for w in self.workers]}
                   if self.workers else {})}


def _mb(n: int) -> float:
    return round(n / MiB, 1)


# The layout of a plan-cache file: {"format": PLAN_CACHE_FORMAT, "value": ...}. Raise it whenever what
# _read_facts or quantize.dry_run's tensor list holds changes: an older file is then a miss, made again.
PLAN_CACHE_FORMAT = 2
_FACT_NUMBERS = ("n_layer", "n_embd", "n_head", "n_head_kv", "n_ff", "head_k", "head_v", "n_vocab", "n_ctx_train",
                 "file_bytes", "data_bytes")


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _tensor_list(value) -> bool:
    """A tensor list as _read_facts and quantize.dry_run make it: [name, type, shape, bytes, elements] each."""
    return isinstance(value, list) and all(
        isinstance(t, list) and len(t) == 5 and isinstance(t[0], str) and isinstance(t[1], str)
        and isinstance(t[2], list) and all(_count(d) for d in t[2]) and _count(t[3]) and _count(t[4]) for t in value)


def _facts_shape(value) -> bool:
    """Whether a cached value has exactly the keys and types _read_facts writes."""
    return isinstance(value, dict) and set(value) == {"arch", "file_type", "tensors", *_FACT_NUMBERS} \
        and isinstance(value["arch"], str) and isinstance(value["file_type"], str) \
        and all(_count(value[k]) for k in _FACT_NUMBERS) and _tensor_list(value["tensors"])


def _cached(path: Path, tag: str, compute, valid):
    """compute() for a file, kept as JSON in $SPECULANT_HOME/plan-cache, keyed by file, size, mtime and tag. A
    stored value is used only where it is of this PLAN_CACHE_FORMAT and valid(value) holds (the producer's keys
    and types); anything else (damaged, older, edited) is a miss: computed again and the file replaced."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}{tag}".encode()).hexdigest()[:24]
    cache = models.home() / "plan-cache" / f"{key}{'.quantized' if tag else ''}.json"
    try:
        stored = json.loads(cache.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        stored = None
    if isinstance(stored, dict) and stored.get("format") == PLAN_CACHE_FORMAT and set(stored) == {"format", "value"} \
            and valid(stored["value"]):
        return stored["value"]
    value = compute()
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"format": PLAN_CACHE_FORMAT, "value": value}), encoding="utf-8")
        os.replace(tmp, cache)
    except OSError:
        pass  # a read-only cache only costs time
    finally:
        try:
            tmp.unlink()  # gone already where the replace succeeded
        except OSError:
            pass
    return value


def gguf_facts(path: Path) -> dict:
    """Shapes and types from a GGUF header: what the plan is computed from (ggml's parser, milliseconds), kept in
    $SPECULANT_HOME/plan-cache, keyed by file and mtime."""
    return _cached(path, "", lambda: _read_facts(path), _facts_shape)


def _read_facts(path: Path) -> dict:
    from .native import gguf_header

    with gguf_header(path) as header:
        try:
            arch = header.architecture()
        except ModelError as e:
            raise ModelError(f"cannot read the GGUF header of {path}: {e}") from None
        keys = {name: f"{arch}.{name}" for name in ("embedding_length", "attention.head_count", "block_count",
                                                     "attention.head_count_kv", "attention.key_length",
                                                     "attention.value_length", "feed_forward_length",
                                                     "context_length")}
        meta = header.metadata([*keys.values(), "general.file_type"])
        file_tensors = header.tensors()

    def number(name, default=None):
        value = meta.get(keys[name], default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):  # missing, or per layer (a list)
            raise ModelError(f"cannot read the GGUF header of {path}: {keys[name]} is "
                             f"{'missing' if value is None else repr(value)[:40]}, not one number")
        return int(value)

    n_embd, n_head = number("embedding_length"), number("attention.head_count")
    tensors = [(t.name, t.type, t.shape, t.n_bytes, math.prod(t.shape)) for t in file_tensors]
    embd = next((t for t in tensors if t[0] == "token_embd.weight"), None)
    if embd is None or len(embd[2]) < 2:
        raise ModelError(f"cannot read the GGUF header of {path}: no token_embd.weight matrix")
    return {"arch": arch, "n_layer": number("block_count"), "n_embd": n_embd, "n_head": n_head,
            "n_head_kv": number("attention.head_count_kv", n_head), "n_ff": number("feed_forward_length", 4 * n_embd),
            "head_k": number("attention.key_length", n_embd // n_head),
            "head_v": number("attention.value_length", n_embd // n_head), "n_vocab": embd[2][1],
            "n_ctx_train": number("context_length", 0), "file_type": _file_type_name(meta.get("general.file_type")),
            "tensors": tensors, "file_bytes": path.stat().st_size,
            "data_bytes": sum(t[3] for t in tensors)}


def _file_type_name(ft) -> str:
    from gguf import LlamaFileType

    try:
        return LlamaFileType(ft).name.replace("MOSTLY_", "").replace("ALL_", "") if ft is not None else "?"
    except ValueError:
        return str(ft)


def compute_reserved(f: dict, n_ctx: int) -> int:
    """The CPU compute buffer llama.cpp reserves (and logs) for n_ctx, no flash attention, n_ubatch = 512: the
    larger of an all-outputs logits phase and the attention-scores phase of a full ubatch (within ~2% of
    llama.cpp's report for the registered models at n_ctx 256-16384). Address space, mostly never touched."""
    n_ub = min(N_UBATCH, n_ctx)
    n_kv = _padded(n_ctx)
    rows = 3 * n_ub * f["n_embd"] * 4
    return max(n_ub * f["n_vocab"] * 4 + rows, n_ub * n_kv * f["n_head"] * 4 + n_ub * n_kv * 4 + rows)


def prefill_chunk() -> int:
    """Tokens per prompt pass, as the llama.cpp backend chooses them (LlamaCppBackend.prefill_chunk): at most
    invariant_rows() (64 with our build; SPECULANT_INVARIANT_ROWS=0 or a stock build: n_batch)."""
    return min(N_UBATCH, native.invariant_rows()) or N_UBATCH


def compute_resident(f: dict, n_ctx: int, n_outputs: int, n_prompt: Optional[int] = None,
                     chunk: Optional[int] = None) -> int:
    """The part of the compute buffer our passes touch at worst: a prompt chunk (`chunk` tokens, default
    prefill_chunk()) over the whole prompt (attention scores and the mask, n_kv = n_prompt, at worst n_ctx), the
    feed-forward activations of a chunk, or the logits of a pass's n_outputs positions (the engine asks for the
    last positions only, never all of a chunk's)."""
    n_prompt = min(n_prompt or n_ctx, n_ctx)
    n_ub = min(chunk or prefill_chunk(), n_prompt)
    n_kv = _padded(n_prompt)
    rows = 3 * n_ub * f["n_embd"] * 4
    # f32 scores and mask in the compute buffer, plus ggml's CPU work buffer: an f16 copy of the attention
    # weights for their product with the f16 V cache
    attention = n_ub * n_kv * (f["n_head"] + 1) * 4 + n_ub * n_kv * f["n_head"] * 2 + rows
    ffn = n_ub * (3 * f["n_ff"] + 2 * f["n_embd"]) * 4
    logits = n_outputs * f["n_vocab"] * 4 + rows
    return max(attention, ffn, logits)


def _padded(n_ctx: int) -> int:
    return -(-n_ctx // 256) * 256  # llama.cpp pads the KV cache to 256 cells


def _pulled(model: str) -> Path:
    """The model's GGUF, checked as every command checks it (a truncated one is refused)."""
    if model in models.REGISTRY and not models.cached_path(model).exists():  # a local model: resolve says it
        raise ModelError(f"{model} is not pulled: the plan reads its GGUF header; run `speculant pull {model}`")
    return models.resolve(model)


def _layer(tensor_name: str) -> Optional[int]:
    """The repeating layer a tensor belongs to (blk.N.*); None for the embeddings, the output layer and its norm."""
    m = re.match(r"blk\.(\d+)\.", tensor_name)
    return int(m.group(1)) if m else None


def _model_facts(model: str, n_ctx: int, as_type: Optional[str]) -> tuple[Path, dict, int, Optional[str], list]:
    """(path, facts, n_ctx within the training context (0: that context), the type to plan or None for the file's
    own, its tensor list) of a model to plan."""
    path = _pulled(model)
    f = gguf_facts(path)
    n_ctx = n_ctx or f["n_ctx_train"]
    if f["n_ctx_train"]:
        n_ctx = min(n_ctx, f["n_ctx_train"])
    as_type = None if as_type == f["file_type"] else as_type
    return path, f, n_ctx, as_type, quantized_facts(path, as_type) if as_type else f["tensors"]


def plan_model(model: str, role: str, n_ctx: int, *, verify_positions: int = 5, n_prompt: Optional[int] = None,
               as_type: Optional[str] = None, parallel: int = 1, layers_here: Optional[int] = None) -> ModelMemory:
    """One model's plan. as_type: the same model quantized to that type (what `speculant quantize` would make,
    tensor by tensor: quantized_facts) instead of the file as it is. parallel: request slots, each with a KV stream of
    n_ctx cells; a merged pass returns the logits of every slot's positions (at most 64). layers_here: a target
    split over RPC workers keeps only its first layers_here repeating layers (and the rest but the layers) here,
    in a child process of its own (worker_plans: the workers' part)."""
    path, f, n_ctx, as_type, tensors = _model_facts(model, n_ctx, as_type)
    split = layers_here is not None
    if split:
        tensors = [t for t in tensors if (_layer(t[0]) is None or _layer(t[0]) < layers_here)]
    types: dict[str, int] = {}
    repacked = 0
    repack = api.repack_weights()
    repacked_types = REPACKED_TYPES | (REPACKED_WITH_AVX512 if "avx512f" in native.cpu_flags() else set())
    for name, ttype, shape, nbytes, n_elements in tensors:
        types[ttype] = types.get(ttype, 0) + nbytes
        # the token embeddings are read by row lookups, not matmuls: never repacked
        if repack and ttype in repacked_types and name != "token_embd.weight" and len(shape) >= 2 \
                and shape[1] % 8 == 0:
            repacked += nbytes
    file_bytes = f["file_bytes"] - f["data_bytes"] + sum(types.values())
    data_bytes = sum(types.values())
    kv_per_token = (layers_here if split else f["n_layer"]) * f["n_head_kv"] * (f["head_k"] + f["head_v"]) * KV_BYTES
    n_kv = _padded(n_ctx) * parallel
    outputs = min(64, (verify_positions if role == "target" else 1) * parallel)
    return ModelMemory(
        name=model, role=role, path=str(path), file_type=f"{as_type} (quantized)" if as_type else f["file_type"],
        file_bytes=file_bytes, mapped=0 if repack else file_bytes, repacked=repacked,
        loaded=data_bytes - repacked if repack else 0, kv_per_token=kv_per_token,
        kv=kv_per_token * n_kv, compute=compute_resident(f, n_ctx, outputs, n_prompt),
        compute_reserved=compute_reserved(f, n_ctx), output=outputs * f["n_vocab"] * 4,
        vocab_tables=RUNTIME_PER_VOCAB * f["n_vocab"], n_params=sum(t[4] for t in f["tensors"]),
        n_layer=f["n_layer"], n_vocab=f["n_vocab"], types=types,
        unbatched=native.unbatched_share([t[:4] for t in tensors])[0],
        other=RUNTIME_PER_MODEL + (RUNTIME_SPLIT_CHILD if split else 0))


def worker_plans(model: str, endpoints: list, device_layers: list, n_ctx: int, *, n_prompt: Optional[int] = None,
                 as_type: Optional[str] = None) -> list[WorkerMemory]:
    """What each RPC worker holds of a target split as rpc.layer_plan splits it: device_layers[i] repeating layers
    on endpoints[i], the last ones, in order."""
    _, f, n_ctx, as_type, tensors = _model_facts(model, n_ctx, as_type)
    kv_per_layer = f["n_head_kv"] * (f["head_k"] + f["head_v"]) * KV_BYTES * _padded(n_ctx)
    out, first = [], f["n_layer"] - sum(device_layers)
    for endpoint, n in zip(endpoints, device_layers):
        held = range(first, first + n)
        out.append(WorkerMemory(endpoint=endpoint, first_layer=first, layers=n,
                                weights=sum(t[3] for t in tensors if _layer(t[0]) in held), kv=kv_per_layer * n,
                                compute=compute_resident(f, n_ctx, 0, n_prompt)))
        first += n
    return out


def quantized_facts(path: Path, type_name: str) -> list:
    """The tensor list (as gguf_facts' "tensors") `speculant quantize --type TYPE` would make of the file:
    llama.cpp's quantizer in a dry run (quantize.dry_run), kept in $SPECULANT_HOME/plan-cache like the facts."""
    return _cached(path, f":{type_name}", lambda: quantize.dry_run(path, type_name).tensors,
                   lambda value: _tensor_list(value) and bool(value))


def plan(target: str, draft: Optional[str] = None, *, n_ctx: int = 4096, draft_max: int = 4,
         n_prompt: Optional[int] = None, target_type: Optional[str] = None, draft_type: Optional[str] = None,
         parallel: int = 1, rpc: Sequence[str] = (), tensor_split: Optional[str] = None) -> Plan:
    """The memory plan of a target (and a draft model) at a context of n_ctx tokens, at its peak: once a
    prompt of n_prompt tokens (default: one that fills the context, the worst case) has been processed.
    parallel: request slots (`serve -np`), each with its own n_ctx tokens of KV cache. rpc, tensor_split: the
    target split over these RPC workers as generate and serve split it (the workers are not contacted): this
    machine's part in the plan's models, each worker's in its workers."""
    api.check_parallel(parallel)
    api.check_ctx_size(n_ctx)
    layers_here, device_layers = None, []
    if rpc:
        if parallel > 1:
            raise SettingsError("a target split over --rpc workers serves one request at a time: plan it with -np 1")
        from .rpc import layer_plan, parse_tensor_split

        n_layer = gguf_facts(_pulled(target))["n_layer"]
        device_layers = layer_plan(n_layer, parse_tensor_split(tensor_split, len(rpc)))
        layers_here = n_layer - sum(device_layers)
    n_ctx_train = gguf_facts(_pulled(target))["n_ctx_train"]
    if n_ctx == 0:  # the target's training context, as generate's -c 0
        n_ctx = n_ctx_train or 4096
    elif n_ctx_train and n_ctx > n_ctx_train:  # lowered as the backend lowers it when it loads
        print(f"speculant: warning: --ctx-size {n_ctx} is more than {target}'s training context "
              f"({n_ctx_train} tokens); using {n_ctx_train}", file=sys.stderr)
        n_ctx = n_ctx_train
    if n_prompt is not None and not (isinstance(n_prompt, int) and 1 <= n_prompt <= n_ctx):
        raise SettingsError(f"--prompt-tokens must be an integer in [1, --ctx-size], got {n_prompt!r}")
    out = [plan_model(target, "target", n_ctx, verify_positions=draft_max + 1, n_prompt=n_prompt,
                      as_type=target_type, parallel=parallel, layers_here=layers_here)]
    if draft:
        out.append(plan_model(draft, "draft", n_ctx, n_prompt=n_prompt, as_type=draft_type, parallel=parallel))
    workers = worker_plans(target, list(rpc), device_layers, n_ctx, n_prompt=n_prompt, as_type=target_type) \
        if rpc else []
    return Plan(n_ctx, out, n_prompt=n_prompt, parallel=parallel, workers=workers)


# -- measuring (tests and `plan --measure`) ---------------------------------------------------------------
MEASURE_TEXT = ("def merge_intervals(intervals):\n    intervals.sort()\n    out = []\n    for lo, hi in "
                  "intervals:\n        if out and lo <= out[-1][1]:\n            out[-1][1] = max(out[-1][1], hi)\n"
                  "        else:\n            out.append([lo, hi])\n    return out\n")  # about 70 tokens
MARK = "SPECULANT_PLAN "


def measure(target: str, draft: Optional[str], n_ctx: int, *, n_prompt: Optional[int] = None, n_tokens: int = 4,
            timeout: float = 900, parallel: int = 1, rpc: Sequence[str] = (),
            tensor_split: Optional[str] = None) -> dict:
    """Peak RSS (VmHWM) of a fresh child process that loads the pair the way `speculant generate` does (with
    `parallel` slots, as `serve -np` does: every slot's KV cache is resident once made) and generates n_tokens
    after a prompt of n_prompt tokens (default: one that fills the rest of the context, the plan's worst case).
    With rpc: plus the peak of the process the target's part here runs in (the workers' are theirs to read)."""
    spec = json.dumps({"target": target, "draft": draft, "n_ctx": n_ctx, "n_tokens": n_tokens, "n_prompt": n_prompt,
                       "parallel": parallel, "rpc": list(rpc), "tensor_split": tensor_split})
    try:
        proc = subprocess.run([sys.executable, "-m", "speculant.plan", spec], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ModelError(f"memory measurement failed: the child process took more than {timeout:.0f} s") from None
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    tail = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    raise ModelError(f"memory measurement failed: {tail.removeprefix('speculant: error: ')}")


def _child(spec: dict) -> dict:
    from .api import load_engine
    from .bench.memory import _mb_status
    from .verify import SamplingParams

    from .memory import engine_peak_rss_mb

    start = _mb_status()
    engine = load_engine(spec["target"], spec["draft"], n_ctx=spec["n_ctx"], draft_max=4, adaptive=False,
                         lookup=False, parallel=spec.get("parallel", 1), rpc=spec.get("rpc", ()),
                         tensor_split=spec.get("tensor_split"))
    try:
        n_prompt = min(spec.get("n_prompt") or engine.target.n_ctx, engine.target.n_ctx - spec["n_tokens"] - 8)
        prompt = engine.target.tokenize(MEASURE_TEXT * (n_prompt // 50 + 1))[:n_prompt]
        res = engine.generate(prompt, max_tokens=spec["n_tokens"], params=SamplingParams(0.0))
        peak = engine_peak_rss_mb(engine)  # with a split target: while its process is there to read
    finally:
        engine.close()
    return {**_mb_status(), "peak_rss_mb": peak, "startup_rss_mb": start.get("rss_mb"),
            "prompt_tokens": res.stats.prompt_tokens}


# -- what fits in a memory budget ---------------------------------------------------------------------------
SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([KMGT])(i?)B?|B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'8G', '7.5GiB', '900M', '123456789' -> bytes. K/M/G/T and KiB/MiB/GiB/TiB are powers of 1024 (as llama.cpp
    prints them), KB/MB/GB/TB powers of 1000."""
    m = SIZE.match(text or "")
    if not m:
        raise SettingsError(f"--mem {text!r} is not a size: write e.g. 8G, 7.5GiB or 900M")
    number, prefix, binary = m.groups()
    si = prefix and not binary and text.strip()[-1] in "bB"  # KB, MB, ...: the SI units
    size = float(number) * (1000 if si else 1024) ** " KMGT".index((prefix or " ").upper())
    if not 1 <= size <= 2 ** 60:
        raise SettingsError(f"--mem {text[:24]!r} is not a memory size: it must be from 1 byte to 1024 PiB")
    return int(size)


CTX_STEPS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
# besides each file's own type, what `plan --mem` considers (sizes from llama.cpp's quantizer in a dry run): for a
# target also the smaller types whose verify passes run at batch cost (IQ4_XS, Q3_K_M, IQ3_M, Q2_K; fits()
# says where a CPU computes one of them one token at a time); a draft reads its weights once per token either way
TARGET_TYPES = ("Q8_0", "Q4_0", "IQ4_XS", "Q3_K_M", "IQ3_M", "Q2_K")
DRAFT_TYPES = ("Q8_0", "Q4_0")


def fits(target: str, draft: Optional[str], mem: int, *, n_ctx: Optional[int] = None, draft_max: int = 4,
         parallel: int = 1) -> list[dict]:
    """For each (target type, draft type): the largest context (of CTX_STEPS, or n_ctx when given) whose plan
    fits in mem bytes, or why none does. Types other than the files' own are what `speculant quantize` would
    make (llama.cpp's quantizer in a dry run); for the target also the share of its weights this CPU would verify
    one token at a time ("unbatched")."""
    n_ctx_train = gguf_facts(_pulled(target))["n_ctx_train"]
    if n_ctx and n_ctx_train:  # the caller's plan said it once already: lowered here without a word
        n_ctx = min(n_ctx, n_ctx_train)
    steps = [n_ctx] if n_ctx else [c for c in CTX_STEPS if not n_ctx_train or c <= n_ctx_train] or [n_ctx_train]
    rows = []
    own = plan(target, draft, n_ctx=steps[0]).models
    t_types = [None] + [t for t in TARGET_TYPES if t != own[0].file_type]
    d_types = [None] + [t for t in DRAFT_TYPES if t != own[-1].file_type] if draft else [None]
    NO_DRAFT = "no draft"  # the target alone: plain decoding, or a free drafter (-md lookup / history)
    for tt in t_types:
        for dt in d_types + ([NO_DRAFT] if draft else []):
            pair = None if dt == NO_DRAFT else draft
            plans = [plan(target, pair, n_ctx=c, draft_max=draft_max, target_type=tt,
                          draft_type=None if dt == NO_DRAFT else dt, parallel=parallel) for c in steps]
            ok = [p for p in plans if p.total <= mem]
            smallest = plans[0]
            row = {"target_type": smallest.models[0].file_type,
                   "draft_type": smallest.models[1].file_type if pair else (NO_DRAFT if draft else None),
                   "fits": bool(ok), "n_ctx": ok[-1].n_ctx if ok else None,
                   "total_mb": _mb(ok[-1].total if ok else smallest.total),
                   "unbatched": round(smallest.models[0].unbatched, 3)}
            if not ok:
                weights = sum(m.mapped + m.loaded + m.repacked for m in smallest.models)
                row["why"] = (f"the weights alone take {_mb(weights):.0f} MiB" if weights > mem
                              else f"at n_ctx {smallest.n_ctx} it needs {_mb(smallest.total):.0f} MiB (weights "
                              f"{_mb(weights):.0f}, KV cache {_mb(sum(m.kv for m in smallest.models)):.0f}, compute "
                              f"and output buffers {_mb(sum(m.compute + m.output for m in smallest.models)):.0f}, "
                              f"runtime and vocabularies "
                              f"{_mb(smallest.runtime + sum(m.vocab_tables + m.other for m in smallest.models)):.0f})")
            rows.append(row)
    return rows


# -- CLI ------------------------------------------------------------------------------------------------------
def table(p: Plan) -> str:
    cols = [("weights mmapped", "mapped"), ("weights read", "loaded"), ("repacked", "repacked"), ("KV cache", "kv"), ("compute", "compute"),
            ("output", "output"), ("vocab tables", "vocab_tables"), ("other", "other"), ("total", "total")]
    head = "| model | type | " + " | ".join(c for c, _ in cols) + " |"
    slots = f" x {p.parallel} request slots (-np)" if p.parallel > 1 else ""
    lines = [f"memory plan at n_ctx {p.n_ctx}{slots} (MiB; resident at peak, after a prompt of "
             f"{p.n_prompt or p.n_ctx} tokens)", "",
             head, "|" + "---|" * (len(cols) + 2)]
    for m in p.models:
        lines.append(f"| {m.role}: {m.name} | {m.file_type} | " +
                     " | ".join(f"{getattr(m, k) / MiB:.0f}" for _, k in cols) + " |")
        lines.append(f"|  KV per token: {m.kv_per_token / 1024:.1f} KiB |" + " |" * (len(cols) + 1))
    lines.append(f"| runtime (interpreter, libraries) |" + " |" * len(cols) + f" {p.runtime / MiB:.0f} |")
    lines.append(f"| **total{' on this machine' if p.workers else ''}** |" + " |" * len(cols) +
                 f" **{p.total / MiB:.0f}** |")
    if p.workers:
        n_layer = p.models[0].n_layer
        here = n_layer - sum(w.layers for w in p.workers)
        lines += ["", f"The target's {n_layer} layers: {here} here (with the embeddings and the output layer; the "
                      "target runs in a child process, its \"other\" counts that process), the last "
                      f"{n_layer - here} on the RPC workers:", "",
                  "| worker | layers | weights (plain layout) | KV cache | compute | other | total |", "|---" * 7 + "|"]
        for w in p.workers:
            lines.append(f"| {w.endpoint} | {w.first_layer}-{w.first_layer + w.layers - 1} ({w.layers}) | " +
                         " | ".join(f"{getattr(w, k) / MiB:.0f}" for k in ("weights", "kv", "compute", "other")) +
                         f" | **{w.total / MiB:.0f}** |")
    shared = sum(m.mapped for m in p.models)
    if shared:
        lines += ["", f"Of the total, {shared / MiB:.0f} MiB are mmapped weights: file-backed pages shared with "
                      "every other process (and bench copy) that maps the same files; the rest is this process's own."]
    if any(m.repacked for m in p.models):
        lines += ["", "Repacked weights (faster kernels) are read, not mmapped; SPECULANT_REPACK=0 mmaps the files "
                      "unrepacked instead (shared pages, slower passes)."]
    return "\n".join(lines) + "\n"


def add_cli(sub, add_model_args=None, add_sampling_args=None) -> None:
    p = sub.add_parser("plan", help="memory a target and draft need (weights, KV cache, compute), and what fits",
                       description="Plan memory before loading: weights (mmapped and shared, or repacked), KV cache "
                                   "per token and for the context, compute buffers, for the target and the draft. "
                                   "With --mem: which quantization of target and draft and what context fit.")
    p.add_argument("-m", "--model", default=models.DEFAULT_TARGET, help="target model (default %(default)s)")
    p.add_argument("-md", "--model-draft", "--draft-model", dest="model_draft", default=None,
                   help="draft model (name or GGUF path); lookup or history: the target alone (those drafters "
                        "hold no model)")
    p.add_argument("-c", "--ctx", "--ctx-size", dest="ctx", type=int, default=None,
                   help="context size (default 4096; 0: the model's training context, as generate; with --mem: "
                        "the largest that fits)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="plan the peak after a prompt this long (default: one that fills the context)")
    p.add_argument("--mem", default=None,
                   help="memory budget, e.g. 4G, 1500M or 1.5GiB (K/M/G/T: powers of 1024; KB/MB/GB: of 1000): "
                        "what fits in it")
    p.add_argument("--draft-max", type=int, default=4, help="tokens drafted per step (verify logits; default 4)")
    p.add_argument("-np", "--parallel", type=int, default=1,
                   help="request slots, as `serve -np N` (serve's default is 2): a KV cache of -c tokens each "
                        "(default 1, as generate)")
    p.add_argument("--rpc", default=None, metavar="HOST:PORT[,...]",
                   help="plan the target split over these `speculant worker`s as generate and serve split it: "
                        "this machine's part and each worker's (the workers are not contacted)")
    p.add_argument("-ts", "--tensor-split", dest="tensor_split", default=None,
                   help="with --rpc: share of the target's layers per worker and optionally this machine, as "
                        "generate's")
    p.add_argument("--backend", default="llama.cpp", help="backend (llama.cpp; the only one planned)")
    p.add_argument("--measure", action="store_true",
                   help="also load the models in a child process and report its measured peak RSS")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (its *_mb sizes are MiB, 2^20 bytes, as the table's)")
    p.set_defaults(handler=cmd_plan)


def cmd_plan(args) -> int:
    if args.backend not in ("llama.cpp", "auto"):
        raise SettingsError(f"plan covers the llama.cpp backend (GGUF files); --backend {args.backend} is not "
                            "planned (the torch backend holds bf16 weights: about 2 bytes per parameter)")
    if args.draft_max < 0:
        raise SettingsError(f"--draft-max must be >= 0, got {args.draft_max}")
    mem = parse_size(args.mem) if args.mem is not None else None
    rpc = []
    if args.tensor_split is not None and args.rpc is None:
        raise SettingsError("--tensor-split splits the target over --rpc workers: pass --rpc too")
    if args.rpc is not None:
        from .rpc import parse_endpoints

        if not args.rpc.strip():
            raise SettingsError("--rpc is empty: name the workers (HOST:PORT[,HOST:PORT...]), or leave --rpc out")

        rpc = parse_endpoints(args.rpc)
        if mem is not None or args.measure:
            raise SettingsError(f"{'--mem' if mem is not None else '--measure'} plans one machine; with --rpc the "
                                "plan gives each machine's part: leave it out")
    if args.model_draft in api.FREE_DRAFTERS:  # prompt lookup and history hold no model: the target's plan
        args.model_draft = None
    p = plan(args.model, args.model_draft, n_ctx=4096 if args.ctx is None else args.ctx, draft_max=args.draft_max,
             n_prompt=args.prompt_tokens, parallel=args.parallel, rpc=rpc, tensor_split=args.tensor_split)
    out = p.to_dict()
    if mem is not None:
        out["mem_mb"] = _mb(mem)
        out["fits"] = fits(args.model, args.model_draft, mem, n_ctx=args.ctx, draft_max=args.draft_max,
                           parallel=args.parallel)
    if args.measure:
        out["measured"] = measure(args.model, args.model_draft, p.n_ctx, n_prompt=args.prompt_tokens,
                                  parallel=args.parallel)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(table(p), end="")
    if args.measure:
        m = out["measured"]
        print(f"\nmeasured in a fresh process: peak RSS {m['peak_rss_mb']:.0f} MiB (planned {out['total_mb']:.0f}, "
              f"{out['total_mb'] / m['peak_rss_mb'] - 1:+.1%})")
    if mem is not None:
        print(f"\nin {mem / MiB:.0f} MiB:" if mem >= MiB else f"\nin {mem} bytes:")
        for r in out["fits"]:
            pair = f"target {r['target_type']}" + (
                " alone (plain decoding, -md lookup or -md history)" if r["draft_type"] == "no draft"
                else f" + draft {r['draft_type']}" if r["draft_type"] else "")
            slow = (f"; verify passes one token at a time over {r['unbatched']:.0%} of the target's weights on "
                    "this CPU (speculation gains little)") if r["unbatched"] >= api.UNBATCHED_WARN_SHARE else ""
            print(f"  {'fits' if r['fits'] else 'does not fit'}: {pair}" +
                  (f", n_ctx up to {r['n_ctx']} ({r['total_mb']:.0f} MiB)" if r["fits"] else f": {r['why']}") + slow)
        if any("(quantized)" in f"{r['target_type']} {r['draft_type']}" for r in out["fits"]):
            print("(quantized: what `speculant quantize MODEL --type TYPE` would make of the file, sized by "
                  "llama.cpp's quantizer in a dry run; add --allow-requantize when the file is already quantized)")
    return 0


if __name__ == "__main__":
    from .errors import SpeculantError

    try:
        print(MARK + json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
    except SpeculantError as e:  # the parent reports it in one line
        print(f"speculant: error: {e}", file=sys.stderr)
        sys.exit(1)
