"""`speculant quantize`: llama.cpp's own quantizer (llama_model_quantize) on a registered model or a GGUF file.

The quantizer runs in a child process (an abort inside llama.cpp cannot take the caller down, and Ctrl-C
stops it cleanly); its log ("[  12/ 291] blk.0.attn_q.weight ...") drives a progress bar. The output is
written next to its final place under a temporary name, checked, and renamed into place, so an interrupted
run never leaves a half-written model; the result gets a local registry entry (models.local_entries) that
every command can name, e.g. `speculant generate -md qwen2.5-coder-0.5b-instruct-q4_0`.

`--dry-run` (dry_run) asks the same quantizer what it would write, tensor by tensor, without writing: `speculant
plan --mem` sizes the types it offers that way.

Requantizing (quantized weights in, e.g. from the shipped Q4_K_M files) loses some quality and is refused
unless asked for (--allow-requantize). For a draft model that is harmless to correctness: any draft is
verified exactly by the target, so its quality only moves acceptance, never the output.

    python -m speculant.quantize '{"input": ..., "output": ..., "ftype": 2, ...}'   # the child
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import models
from .errors import ModelError, SettingsError

# llama_ftype values (llama.h) of the file types worth making here (every one but Q1_0 verifies at batch cost;
# MXFP4_MOE: a mixture of experts' expert matrices in MXFP4, as gpt-oss ships, the rest Q8_0; TQ2_0: ternary, for
# models trained so (BitNet b1.58), others lose their meaning)
FILE_TYPES = {"F32": 0, "F16": 1, "BF16": 32, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q8_0": 7,
              "Q2_K": 10, "Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16,
              "Q5_K_M": 17, "Q6_K": 18, "IQ2_XXS": 19, "IQ2_XS": 20, "IQ2_S": 28, "IQ2_M": 29, "IQ3_XXS": 23,
              "IQ3_XS": 22, "IQ3_S": 26, "IQ3_M": 27, "IQ4_NL": 25, "IQ4_XS": 30, "IQ1_S": 24, "IQ1_M": 31,
              "MXFP4_MOE": 38, "TQ2_0": 37, "Q1_0": 40}
# file types whose main tensor type llama.cpp's quantizer refuses to make without an importance matrix (--imatrix:
# what llama-imatrix computes from a calibration text, .gguf or the older .dat)
NEEDS_IMATRIX = {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS"}
# ggml tensor types for --output-tensor-type / --token-embedding-type (those two need no importance matrix)
TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
                "Q1_0")
UNQUANTIZED = {"F32", "F16", "BF16"}
STAGING_PREFIX = ".quantize-"
DISK_FULL_BYTES = 16 << 20  # less free than this after a failed write: the disk filled up
_PROGRESS = re.compile(r"\[\s*(\d+)\s*/\s*(\d+)\s*\]")
# a dry run's line per tensor: "[  11/ 339] blk.0.attn_v.weight - [  1536,   256, 1, 1], type =   q6_K,
# size =     0.31 MiB ->     0.21 MiB (q4_K)" (no arrow: the tensor keeps its type)
_DRY_LINE = re.compile(r"\[\s*\d+\s*/\s*\d+\s*\]\s+(\S+)\s+-\s+\[([\d,\s]+)\],\s+type\s*=\s*(\w+),\s+size\s*=\s*"
                       r"[\d.]+\s*MiB(?:\s*->\s*[\d.]+\s*MiB\s*\((\w+)\))?")
_QUANT_SUFFIX = re.compile(r"[-._](q\d\w*|iq\d\w*|f16|bf16|f32)$", re.IGNORECASE)


def file_type(name: str) -> int:
    key = name.upper()
    if key not in FILE_TYPES:
        raise SettingsError(f"unknown quantization type {name!r}; choose one of {', '.join(FILE_TYPES)}")
    return FILE_TYPES[key]


def tensor_type(name: str, flag: str) -> int:
    from gguf import GGMLQuantizationType

    key = name.upper()
    if key not in TENSOR_TYPES:
        raise SettingsError(f"unknown tensor type {name!r} for {flag}; choose one of {', '.join(TENSOR_TYPES)}")
    return GGMLQuantizationType[key].value


def quantized_types(path: Path) -> dict[str, int]:
    """Quantized weight types in a GGUF file -> how many matrices have each (empty for an F32/F16/BF16 file)."""
    from .native import gguf_tensors

    out: dict[str, int] = {}
    for t in gguf_tensors(path):
        name = t.type
        if len(t.shape) >= 2 and name not in UNQUANTIZED:
            out[name] = out.get(name, 0) + 1
    return out


def default_name(model: str, type_name: str, output_type: Optional[str], embd_type: Optional[str]) -> str:
    """e.g. qwen2.5-coder-0.5b-instruct + Q4_0 (+ output Q4_0) -> qwen2.5-coder-0.5b-instruct-q4_0-out-q4_0."""
    base = model if model in models.REGISTRY else _QUANT_SUFFIX.sub("", Path(model).name.removesuffix(".gguf"))
    spec = models.spec_of(model)
    if spec is not None and model not in models.REGISTRY:  # a local model: name from its own source
        base = models.local_entries()[model].get("source", base)
    name = f"{base}-{type_name.lower()}"
    if output_type:
        name += f"-out-{output_type.lower()}"
    if embd_type:
        name += f"-embd-{embd_type.lower()}"
    return name


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
RESERVED = ("lookup", "history")  # -md's drafters: a model so named could never be drafted with


def check_name(name: Optional[str]) -> None:
    """--name is a name every command can take for -m/-md: one word of letters, digits and . _ + - (a folder of
    its own, or one outside $SPECULANT_HOME/models, by '/' or '..'), and not a drafter's."""
    if name is None:
        return
    if not NAME.fullmatch(name) or name.lower().endswith(".gguf"):
        raise SettingsError(f"--name {name!r}: a model name is letters, digits and . _ + - (starting with a letter "
                            "or digit, without .gguf); it names the file in $SPECULANT_HOME/models (-o FILE writes "
                            "elsewhere)")
    if name.lower() in RESERVED:
        raise SettingsError(f"--name {name!r} is the name of a drafter (-md {name.lower()}): choose another")


def quantize(model: str, type_name: str, *, output: Optional[str] = None, name: Optional[str] = None,
             allow_requantize: bool = False, output_tensor_type: Optional[str] = None,
             token_embedding_type: Optional[str] = None, threads: Optional[int] = None,
             imatrix: Optional[str] = None, progress: bool = True) -> tuple[str, Path]:
    """Quantize MODEL (registered/local name or GGUF path) to type_name, with an importance matrix file when
    given; returns (registry name, path)."""
    ftype = file_type(type_name)
    if imatrix:
        read_imatrix(imatrix)  # a missing or unreadable file: a clear error before anything runs
    elif type_name.upper() in NEEDS_IMATRIX:
        raise SettingsError(f"{type_name.upper()} needs an importance matrix: pass --imatrix FILE (llama-imatrix's "
                            f"output for this model, .gguf or .dat); IQ3_S, IQ3_M and Q2_K do not need one")
    out_type = tensor_type(output_tensor_type, "--output-tensor-type") if output_tensor_type else -1
    embd_type = tensor_type(token_embedding_type, "--token-embedding-type") if token_embedding_type else -1
    from .api import check_threads

    check_threads(threads, "--threads")
    src = models.resolve(model)  # missing or corrupt input: a clear ModelError
    already = quantized_types(src)
    if already and not allow_requantize:
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(already.items()))
        raise SettingsError(f"{model} already holds quantized weights ({kinds}); requantizing them loses some "
                            "quality: pass --allow-requantize to do it anyway (for a draft model it only affects "
                            "acceptance, never the output, which the target verifies exactly)")
    check_name(name)
    named = name
    name = name or default_name(model, type_name, output_tensor_type, token_embedding_type)
    known = models.REGISTRY.get(name)
    if known and known.derived_from == model and known.quant_type == type_name.upper() and not output \
            and known.output_type == (output_tensor_type or "").upper() and not token_embedding_type \
            and not imatrix:  # a registered derived model: made where and as pull makes it
        return name, models.pull(name, quiet=not progress, threads=threads)
    if name in models.REGISTRY:
        raise SettingsError(f"{'--name' if named else 'the default name'} {name!r} is a registered model's name; "
                            "choose another with --name")
    final = Path(output).expanduser() if output else models.home() / "models" / f"{name}.gguf"
    if final.resolve() == src.resolve():
        raise SettingsError(f"the output {final} is the input file; choose another -o")
    if final.is_dir():
        raise SettingsError(f"-o {final} is a directory; pass a file name ending in .gguf")
    make(src, final, ftype, allow_requantize=allow_requantize, output_tensor_type=out_type,
         token_embedding_type=embd_type, threads=threads, imatrix=imatrix, progress=progress,
         desc=f"quantizing {model} to {type_name.upper()}")
    source = models.spec_of(model)
    models.register_local(name, {
        "path": str(final.resolve()), "size": final.stat().st_size, "sha256": models.sha256_file(final),
        "source": model if source is not None else str(src),
        "type": type_name.upper(), "output_tensor_type": output_tensor_type, "token_embedding_type":
        token_embedding_type, "requantized": bool(already), "tokenizer": source.tokenizer if source else "",
        "n_vocab": source.n_vocab if source else 0, "imatrix": str(Path(imatrix).resolve()) if imatrix else None,
        "description": f"{type_name.upper()} of {model}" + (f", output layer {output_tensor_type.upper()}"
                                                              if output_tensor_type else "")
                       + (" (requantized)" if already else "") + ", made by speculant quantize"})
    return name, final


def make(src: Path, final: Path, ftype: int, *, allow_requantize: bool = False, output_tensor_type: int = -1,
         token_embedding_type: int = -1, threads: Optional[int] = None, imatrix: Optional[str] = None,
         progress: bool = True, desc: str = "quantizing") -> None:
    """Quantize src into final through a staging file beside it: final appears whole or not at all."""
    spec = {"input": str(src), "ftype": ftype, "threads": threads or os.cpu_count() or 1,
            "allow_requantize": allow_requantize, "output_tensor_type": output_tensor_type,
            "token_embedding_type": token_embedding_type, "imatrix": str(imatrix) if imatrix else None}
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = tempfile.TemporaryDirectory(prefix=STAGING_PREFIX, dir=final.parent)
    except OSError as e:
        raise SettingsError(f"cannot write {final}: {e.strerror or e}") from None
    with staging as tmp:
        staged = Path(tmp) / final.name
        try:
            _run_child({**spec, "output": str(staged)}, desc, progress)
        except ModelError:
            # llama.cpp reports a full disk as "iostream error": name the cause while the partial file is there
            free = shutil.disk_usage(tmp).free
            if free < DISK_FULL_BYTES:
                written = staged.stat().st_size if staged.exists() else 0
                part = f", {written / 2**20:.0f} MiB of {final.name} written" if written >= 1 << 20 else ""
                raise ModelError(f"the disk holding {final.parent} is full ({free / 2**20:.0f} MiB free{part}); "
                                 f"nothing was kept: free some space or write elsewhere with -o") from None
            raise
        models.check_gguf(staged)
        os.replace(staged, final)


@dataclass
class DryRun:
    """What llama.cpp's quantizer would make of a file, tensor by tensor, without writing anything."""

    source: str
    type_name: str
    tensors: list  # [(name, ggml type name, shape [ne0, ne1, ...], bytes, n_elements)] as the new file holds them
    source_bytes: int  # the source's tensor data
    source_quantized: bool  # the source holds quantized matrices: the real run needs allow_requantize
    needs_imatrix: bool  # some tensor's new type cannot be made without an importance matrix
    fallbacks: int  # tensors whose rows do not fit the type's blocks, given a fallback type by llama.cpp

    @property
    def data_bytes(self) -> int:
        return sum(t[3] for t in self.tensors)

    def bytes_by_type(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, ttype, _, nbytes, _ in self.tensors:
            out[ttype] = out.get(ttype, 0) + nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def dry_run(model: "str | Path", type_name: str, *, output_tensor_type: Optional[str] = None,
            token_embedding_type: Optional[str] = None) -> DryRun:
    """The tensor types and sizes `quantize` would give MODEL (registered/local name or GGUF path): llama.cpp's
    own dry run (llama_model_quantize with dry_run set), so the same per-tensor rules, mixes and fallbacks as a
    real run, in about a second and with nothing written. Needs no --allow-requantize and no importance matrix
    (it says whether the real run would need one). A Path is taken as an already checked GGUF file (checking
    reads it all: seconds for a big model)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    ftype = file_type(type_name)
    out_type = tensor_type(output_tensor_type, "--output-tensor-type") if output_tensor_type else -1
    embd_type = tensor_type(token_embedding_type, "--token-embedding-type") if token_embedding_type else -1
    src = model if isinstance(model, Path) else models.resolve(model)
    spec = {"input": str(src), "output": "", "ftype": ftype, "threads": 1, "allow_requantize": True,
            "output_tensor_type": out_type, "token_embedding_type": embd_type, "imatrix": None, "dry_run": True}
    proc = subprocess.run([sys.executable, "-m", "speculant.quantize", json.dumps(spec)], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, errors="replace")
    lines = proc.stderr.splitlines()
    if proc.returncode != 0:
        raise ModelError(f"llama.cpp's quantizer (dry run) failed: {_reason(lines, proc.returncode)}")
    tensors, source_bytes, source_quantized = [], 0, False
    for line in lines:
        m = _DRY_LINE.search(line)
        if not m:
            continue
        name, dims, old, new = m.group(1), m.group(2), m.group(3).upper(), (m.group(4) or m.group(3)).upper()
        shape = [int(x) for x in dims.split(",") if x.strip()]
        n_elements = 1
        for d in shape:
            n_elements *= d
        while len(shape) > 1 and shape[-1] == 1:  # llama.cpp prints 4 dimensions; gguf's lists end at the last
            shape.pop()
        sizes = [GGML_QUANT_SIZES[GGMLQuantizationType[t]] for t in (old, new)]
        (old_block, old_size), (block, size) = sizes
        source_bytes += n_elements // old_block * old_size
        tensors.append((name, new, shape, n_elements // block * size, n_elements))
        source_quantized |= len(shape) >= 2 and old not in UNQUANTIZED
    if not tensors:
        raise ModelError(f"llama.cpp's quantizer (dry run) listed no tensors of {src}")
    fallback = re.search(r"(\d+) of \d+ tensor\(s\) required fallback", proc.stderr)
    return DryRun(source=str(src), type_name=type_name.upper(), tensors=tensors, source_bytes=source_bytes,
                  source_quantized=source_quantized,
                  # llama.cpp's own need, or ours (make() refuses those types without one)
                  needs_imatrix="will require an imatrix" in proc.stderr or type_name.upper() in NEEDS_IMATRIX,
                  fallbacks=int(fallback.group(1)) if fallback else 0)


def _run_child(spec: dict, desc: str, progress: bool) -> None:
    """llama_model_quantize in a child process, a progress bar from its per-tensor log lines."""
    bar = None
    tail: deque[str] = deque(maxlen=20)
    proc = subprocess.Popen([sys.executable, "-m", "speculant.quantize", json.dumps(spec)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace")
    try:
        for line in proc.stderr:
            tail.append(line.rstrip())
            m = _PROGRESS.search(line)
            if m and progress:
                done, total = int(m.group(1)), int(m.group(2))
                if bar is None:
                    from tqdm import tqdm

                    bar = tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, disable=None)
                bar.update(done - bar.n)
        rc = proc.wait()
    except BaseException:  # Ctrl-C, SIGTERM: stop the child; the staging directory goes with the caller's with
        proc.kill()
        proc.wait()
        raise
    finally:
        if bar is not None:
            bar.close()
    if rc != 0:
        raise ModelError(f"llama.cpp's quantizer failed: {_reason(list(tail), rc)}")


def _reason(lines: list[str], rc: int) -> str:
    """llama.cpp's own reason in the quantizer child's log ("failed to quantize: imatrix size 64 is different from
    ...", "ncols 576 not divisible by 128"), not the child's closing "returned 1"; else its last word."""
    lines = [s for s in lines if s.strip()]
    why = next((s for s in reversed(lines) if ("error" in s.lower() or "failed" in s.lower())
                and "llama_model_quantize returned" not in s), lines[-1] if lines else f"exit status {rc}")
    return why.strip()[-300:]


def read_imatrix(path) -> dict[str, "np.ndarray"]:
    """An importance matrix file as llama.cpp's quantizer reads it: {tensor name: float32 values per input column
    (per expert, one after another)}, the mean squared activations. GGUF (llama-imatrix's format since 2025: per
    tensor NAME.in_sum2 [experts, columns] and NAME.counts [experts]) or the older binary .dat (per entry its
    name, call count and values already averaged per call)."""
    import numpy as np
    from gguf import GGUFReader

    path = Path(path).expanduser()
    if path.is_dir():
        raise SettingsError(f"--imatrix {path} is a directory; pass llama-imatrix's output file (.gguf or .dat)")
    if not path.is_file():
        raise SettingsError(f"--imatrix {path}: no such file")
    bad = f"--imatrix {path} is not an importance matrix (llama-imatrix's .gguf or .dat)"
    with open(path, "rb") as f:
        is_gguf = f.read(4) == b"GGUF"
    out: dict[str, np.ndarray] = {}
    if is_gguf:
        try:
            reader = GGUFReader(path, "r")
            tensors = {t.name: np.asarray(t.data, dtype=np.float32).reshape(-1) for t in reader.tensors}
        except Exception as e:
            raise ModelError(f"{bad}: {e}") from None
        if not {"imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size"} <= set(reader.fields):
            raise ModelError(f"{bad}: it lacks the imatrix.* metadata llama-imatrix writes")
        for key, sums in tensors.items():
            if not key.endswith(".in_sum2"):
                continue
            name = key.removesuffix(".in_sum2")
            counts = tensors.get(f"{name}.counts")
            if counts is None or counts.size == 0 or sums.size % counts.size:
                raise ModelError(f"{bad}: {name} has no matching counts")
            per = sums.reshape(counts.size, -1)
            out[name] = np.where(counts[:, None] > 0, per / np.maximum(counts[:, None], 1), 1.0) \
                .astype(np.float32).reshape(-1)
    else:
        data = path.read_bytes()
        try:
            (n_entries,), pos = np.frombuffer(data, np.int32, 1, 0), 4
            for _ in range(int(n_entries)):
                (length,) = np.frombuffer(data, np.int32, 1, pos)
                if not 0 < length <= len(data) - pos - 4:
                    raise ValueError(f"entry name of {int(length)} bytes")
                name = data[pos + 4:pos + 4 + int(length)].decode()
                pos += 4 + int(length)
                ncall, nval = (int(v) for v in np.frombuffer(data, np.int32, 2, pos))
                values = np.frombuffer(data, np.float32, nval, pos + 8)
                pos += 8 + 4 * nval
                if nval < 1:
                    raise ValueError(f"entry {name!r} has no values")
                out[name] = (values / ncall if ncall > 0 else values).astype(np.float32)
        except (ValueError, UnicodeDecodeError) as e:
            raise ModelError(f"{bad}: {e}") from None
        if n_entries < 1:
            raise ModelError(f"{bad}: no entries")
    if not out:
        raise ModelError(f"{bad}: no entries")
    return out


def child(spec: dict) -> int:
    """In the child: call llama_model_quantize; llama.cpp logs each tensor on stderr."""
    import ctypes

    import llama_cpp as ll

    from .native import load_backends

    ll.llama_backend_init()
    load_backends()
    params = ll.llama_model_quantize_default_params()
    params.ftype = spec["ftype"]
    params.nthread = spec["threads"]
    params.allow_requantize = spec["allow_requantize"]
    params.dry_run = bool(spec.get("dry_run"))
    if spec["output_tensor_type"] >= 0:
        params.output_tensor_type = spec["output_tensor_type"]
    if spec["token_embedding_type"] >= 0:
        params.token_embedding_type = spec["token_embedding_type"]
    if spec.get("imatrix"):  # llama_model_imatrix_data entries, a NULL name last; kept alive through the call
        values = read_imatrix(spec["imatrix"])
        entries = (ll.llama_model_imatrix_data * (len(values) + 1))()
        for e, (name, v) in zip(entries, values.items()):
            e.name, e.data, e.size = name.encode(), v.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), v.size
        params.imatrix = entries
    rc = ll.llama_model_quantize(spec["input"].encode(), spec["output"].encode(), ctypes.byref(params))
    if rc != 0:
        print(f"error: llama_model_quantize returned {rc}", file=sys.stderr, flush=True)
    return 0 if rc == 0 else 1


def add_cli(sub, add_model_args=None, add_sampling_args=None) -> None:
    from .api import thread_count

    p = sub.add_parser("quantize", help="quantize a model with llama.cpp's quantizer (a local model you can name)",
                       description="Quantize a registered model or a GGUF file with llama.cpp's own quantizer. "
                                   "The result goes into the model cache (or -o) and gets a name that -m/-md accept. "
                                   "The shipped models are already quantized (Q4_K_M): requantizing them needs "
                                   "--allow-requantize and loses some quality, which for a draft model only "
                                   "lowers acceptance; the output stays exactly the target's.")
    p.add_argument("model", help="registered or local model name, or a GGUF file")
    p.add_argument("--type", required=True, metavar="TYPE", help=f"file type: {', '.join(FILE_TYPES)}")
    p.add_argument("-o", "--output", default=None, help="output GGUF (default: the cache, named after the model)")
    p.add_argument("--name", default=None, help="name of the local registry entry (default MODEL-TYPE)")
    p.add_argument("--allow-requantize", action="store_true",
                   help="allow quantizing weights that are already quantized (loses some quality)")
    p.add_argument("--output-tensor-type", default=None, metavar="TYPE",
                   help=f"type of the output layer (output.weight): {', '.join(TENSOR_TYPES)}")
    p.add_argument("--token-embedding-type", default=None, metavar="TYPE",
                   help="type of the token embeddings (token_embd.weight)")
    p.add_argument("--imatrix", default=None, metavar="FILE",
                   help="importance matrix for this model (llama-imatrix's .gguf or .dat): needed by "
                        + ", ".join(sorted(NEEDS_IMATRIX)) + "; improves the other low-bit types")
    p.add_argument("-t", "--threads", type=thread_count, default=None, help="threads (default: all cores)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--dry-run", action="store_true",
                   help="write nothing: print the size and tensor types the file would get (llama.cpp's dry run), "
                        "and whether its verify passes would run at batch cost on this CPU")
    p.set_defaults(handler=cmd_quantize)


def dry_run_report(model: str, d: DryRun, allow_requantize: bool = False) -> str:
    """What `quantize --dry-run` prints."""
    from . import api, native

    n_elements = sum(t[4] for t in d.tensors)
    mib = lambda n: f"{n / 2**20:.0f} MiB"
    lines = [f"{model} as {d.type_name} (llama.cpp's quantizer, dry run: nothing written)",
             f"  tensor data {mib(d.data_bytes)} ({8 * d.data_bytes / n_elements:.2f} bits per weight), "
             f"from {mib(d.source_bytes)}",
             "  by type: " + ", ".join(f"{t} {mib(n)}" for t, n in d.bytes_by_type().items())]
    share, slow = native.unbatched_share([t[:4] for t in d.tensors])
    if share >= api.UNBATCHED_WARN_SHARE:
        lines.append(f"  verify passes on this CPU: one token at a time over {share:.0%} of the matmul weights "
                     f"({', '.join(sorted(slow, key=slow.get, reverse=True))}): speculation would gain little")
    else:
        lines.append("  verify passes on this CPU: at batch cost" + (
            f" (except {share:.0%} of the matmul weights: {', '.join(sorted(slow))})" if slow else ""))
    if d.fallbacks:
        lines.append(f"  {d.fallbacks} tensor{'s get' if d.fallbacks > 1 else ' gets'} a fallback type (rows not a "
                     "multiple of the type's blocks)")
    if d.needs_imatrix:
        lines.append("  needs an importance matrix: pass --imatrix FILE (llama-imatrix's output for this model)")
    if d.source_quantized:
        lines.append("  the source is already quantized: " + ("requantized, as --allow-requantize asks"
                                                              if allow_requantize else
                                                              "the real run needs --allow-requantize"))
    return "\n".join(lines) + "\n"


def cmd_quantize(args) -> int:
    if args.dry_run and (args.output or args.name or args.imatrix):
        raise SettingsError("--dry-run writes nothing: -o, --name and --imatrix have no use with it")
    file_type(args.type)  # an unknown type before the model is read
    if args.type.upper() == "MXFP4_MOE":
        from .native import gguf_tensors

        if not any(len(t.shape) == 3 for t in gguf_tensors(models.resolve(args.model))):
            print(f"speculant: warning: MXFP4_MOE puts a mixture of experts' expert matrices in MXFP4 and the rest in "
                  f"Q8_0; {args.model} has no expert matrices, so it comes out all Q8_0 (--type Q8_0 says so)",
                  file=sys.stderr)
    if args.dry_run:
        d = dry_run(args.model, args.type, output_tensor_type=args.output_tensor_type,
                    token_embedding_type=args.token_embedding_type)
        print(dry_run_report(args.model, d, args.allow_requantize), end="")
        return 0
    name, path = quantize(args.model, args.type, output=args.output, name=args.name,
                          allow_requantize=args.allow_requantize, output_tensor_type=args.output_tensor_type,
                          token_embedding_type=args.token_embedding_type, threads=args.threads,
                          imatrix=args.imatrix, progress=not args.quiet)
    entry = models.local_entries().get(name) or {  # a registered derived model, made as `speculant pull` makes it
        "size": path.stat().st_size, "sha256": models.sha256_file(path), "requantized": True}
    note = " (requantized: a draft's quality only affects acceptance, never the output)" if entry["requantized"] else ""
    print(f"{name}: {path} ({entry['size'] / 2**20:.0f} MiB, sha256 {entry['sha256'][:16]}…){note}")
    return 0


if __name__ == "__main__":
    sys.exit(child(json.loads(sys.argv[1])))
