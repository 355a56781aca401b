"""A cheaper draft model: the same GGUF with its output layer (and token embeddings) cut to the first N token
ids, so a draft step streams fewer weights.

Why: a 0.5B draft spends a large share of each step on its 152k-row output matrix (Qwen2.5-Coder-0.5B
Q4_K_M: output.weight is Q8_0, 145 MB of the 485 MB file; every step reads all of it). llama.cpp always
computes the full output layer, so the only way to skip rows is a model file without them.

Which ids: byte-level BPE ids follow merge order, which is roughly frequency order, so the first N ids are
the frequent ones (on the built-in suite's prompts and outputs 92.6% of Qwen tokens are below 32768); control
and user-defined tokens (im_start, im_end, fim...) are always kept. The cut file stores the kept target ids
as `speculant.vocab_keep`. Its input side must not lose tokens (a context token the draft cannot read
corrupts every later guess: on a coding prompt acceptance fell from 77% to 42%), so the draft reads the
context as embeddings taken from the ORIGINAL model's full token_embd table (`TokenEmbeddings`, rows
dequantized on demand), fed to llama.cpp instead of ids. Only what it can propose is cut: the drafter
scatters its distribution back over the target's ids, zero outside the set.

Measured (Qwen2.5-Coder 1.5B / 0.5B, `speculant demo --no-adapt`, coding prompt, k = 4): a draft step costs
38.7 ms full, 30.0 ms cut to 32768 ids; acceptance 76.8% full, 63.6% cut to 32768, 70.7% cut to 65536
(42.5% when context tokens outside the cut were fed as stand-ins); speedup 0.96x full, 0.85x / 0.91x cut.
The ids a draft cannot propose (7% of this suite's tokens at 32768, 2% at 65536) cost more than the
cheaper step saves, so the cut is opt-in (`--draft-vocab N`), not the default. A frequency ranking from
local Python sources covered no more tokens than id order did.

Exactness does not depend on any of this: the draft only proposes; a token it cannot propose simply has
q = 0, which the rejection test handles like any other draft distribution.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import numpy as np

from .errors import ModelError, SettingsError

KEEP_KEY = "speculant.vocab_keep"
CUT_TENSORS = ("output.weight", "token_embd.weight")  # [n_vocab, ...] row-major: rows are token ids
NORMAL = 1  # llama.cpp's LLAMA_TOKEN_TYPE_NORMAL


def kept_ids(token_types: list[int], n: int) -> np.ndarray:
    """The first n ids plus every non-normal token (control / user-defined: chat and FIM markers)."""
    ids = list(range(min(n, len(token_types))))
    ids += [i for i in range(n, len(token_types)) if token_types[i] != NORMAL]
    return np.asarray(ids, dtype=np.int64)


def write_cut(src: Path, dst: Path, n: int) -> Path:
    """Write `src` with its vocabulary cut to kept_ids(n) to `dst` (atomically)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(src))
    fields = reader.fields
    if "tokenizer.ggml.tokens" not in fields or "tokenizer.ggml.token_type" not in fields:
        raise ModelError(f"{src.name}: no tokenizer in the GGUF, cannot cut its vocabulary")
    n_tokens = len(fields["tokenizer.ggml.tokens"].data)
    keep = kept_ids([int(t) for t in fields["tokenizer.ggml.token_type"].contents()], n)
    new_id = {int(t): i for i, t in enumerate(keep)}
    tensors = {t.name: t for t in reader.tensors}
    for name in CUT_TENSORS:
        if name in tensors and tensors[name].data.shape[0] != n_tokens:
            raise ModelError(f"{src.name}: {name} has {tensors[name].data.shape[0]} rows for {n_tokens} tokens")
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    writer = GGUFWriter(str(tmp), fields["general.architecture"].contents())
    for field in fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
            value = [value[i] for i in keep]
        elif field.name.startswith("tokenizer.ggml.") and field.name.endswith("_token_id"):
            if int(value) not in new_id:
                continue
            value = new_id[int(value)]
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    writer.add_key_value(KEEP_KEY, [int(t) for t in keep], GGUFValueType.ARRAY, sub_type=GGUFValueType.INT32)
    data = {}
    for t in reader.tensors:
        data[t.name] = np.ascontiguousarray(t.data[keep]) if t.name in CUT_TENSORS else t.data
        writer.add_tensor_info(t.name, data[t.name].shape, data[t.name].dtype, data[t.name].nbytes, t.tensor_type)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in reader.tensors:
            writer.write_tensor_data(data[t.name])
        writer.close()
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dst


MIN_KEPT = 256  # the smallest --draft-vocab


def check_draft_vocab(n: int) -> None:
    """--draft-vocab N: 0 (the full vocabulary) or at least MIN_KEPT ids."""
    if n != 0 and n < MIN_KEPT:
        raise SettingsError(f"--draft-vocab must be 0 (the full vocabulary) or at least {MIN_KEPT}, got {n}")


def _stamp(path: Path) -> Optional[dict]:
    """The source record a cut was made from (None: absent, empty or corrupt: the cut is made again)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def cut_model(src: Path, n: int) -> Path:
    """The cut copy of `src` under $SPECULANT_HOME/cut/, made once (rebuilt if the source changes)."""
    from . import models

    if n == 0:
        raise SettingsError("--draft-vocab 0 is the full vocabulary: nothing to cut")
    check_draft_vocab(n)
    out_dir = models.home() / "cut"
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / f"{src.stem}.top{n}.gguf"
    stamp = dst.with_suffix(".json")
    source = {"source": str(src), "size": src.stat().st_size, "mtime": src.stat().st_mtime, "n": n}
    if dst.exists() and _stamp(stamp) == source:
        return dst
    write_cut(src, dst, n)
    tmp = stamp.with_name(stamp.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(source), encoding="utf-8")
    os.replace(tmp, stamp)
    return dst


def read_keep(path: Path) -> Optional[np.ndarray]:
    """The target ids a cut GGUF keeps (None: not a cut file)."""
    from .native import gguf_metadata

    keep = gguf_metadata(path, [KEEP_KEY]).get(KEEP_KEY)
    return None if keep is None else np.asarray(keep, dtype=np.int64)


class TokenEmbeddings:
    """Input embeddings of any token id, read from a GGUF's token_embd table (mmapped; rows dequantized on
    first use and kept)."""

    def __init__(self, path: Path):
        from gguf import GGMLQuantizationType

        from .native import gguf_tensors

        tensor = next((t for t in gguf_tensors(path) if t.name == "token_embd.weight"), None)
        if tensor is None or len(tensor.shape) != 2:
            raise ModelError(f"{Path(path).name}: no token_embd.weight matrix")
        n_vocab = tensor.shape[1]
        self.table = np.memmap(path, np.uint8, "r", offset=tensor.data_end - tensor.n_bytes,
                               shape=(n_vocab, tensor.n_bytes // n_vocab))  # [n_vocab, row bytes]
        self.kind = GGMLQuantizationType[tensor.type]
        self.rows: dict[int, np.ndarray] = {}

    def __call__(self, tokens) -> np.ndarray:
        from gguf.quants import dequantize

        missing = sorted({int(t) for t in tokens} - self.rows.keys())
        if missing:
            for t, row in zip(missing, dequantize(self.table[missing], self.kind)):
                self.rows[t] = row.astype(np.float32)
        return np.stack([self.rows[int(t)] for t in tokens])


def load_cut_draft(src: Path, n: int, *, n_ctx: int, threads: Optional[int] = None):
    """The llama.cpp draft from the cut copy of `src`, reading its input through src's full embedding table;
    returns (backend, kept target ids)."""
    from .backends.llamacpp import LlamaCppBackend

    path = cut_model(src, n)
    # repacked weights: a draft's numerics need not match anything (see backends/llamacpp.py)
    backend = LlamaCppBackend(path, n_ctx=n_ctx, n_threads=threads, repack=True, embed=TokenEmbeddings(src))
    return backend, read_keep(path)
