"""PyTorch / Hugging Face transformers backend: a safetensors model directory, or one of our GGUF files
loaded (and dequantized) through transformers' GGUF support.

Numerics: the engine's exactness at temperature 0 needs a target pass over k+1 tokens to give bit-for-bit the
logits of k+1 one-token passes. Library kernels do not: measured on this CPU (torch 2.13, bf16), a matmul's
rounding depends on the number of rows M (Qwen2.5-1.5B: max |diff| 0.13-0.25 between a block of M tokens and
one-token passes), and attention's on the KV length (fused sdpa: also on the query length). So every pass here
has ONE shape per kernel:
  * rows: a pass is cut into chunks of exactly `pass_rows` tokens (32), the last one padded; the padding
    rows are computed and thrown away. With M fixed, a row's result does not depend on its neighbours.
  * attention (`blocked_attention`, our own): keys and values sit in one buffer per layer; each chunk
    attends block by block (blocks of 256 positions at fixed absolute offsets) with an online softmax in
    float32 and a position mask. Blocks past a row's position contribute exactly 0 (exp(-inf) = 0, scale 1),
    so a row's result depends only on its token, its position and the KV entries before it.
Measured: logits of every token are bit-identical (max |diff| 0.0) whether it is decoded alone, in a block of
5 at any offset, or in a 12-token block (tests/test_torch_backend.py checks this on smollm2, and on Qwen 1.5B
when its conversion is cached). The cost: a one-token pass computes 32 rows (on a CPU with AMX a pass over 32
rows costs about what one over 1 does, weights dominate), and prefill runs in 32-token chunks. On CUDA the
same shapes are used, so cuBLAS picks the same kernels for every pass.

Converting a GGUF file takes tens of seconds (dequantizing, building the tokenizer), so the converted
model is cached once under $SPECULANT_HOME/torch/<gguf name>-<hash of its path>/ as safetensors and reloaded from
there while the GGUF's size, mtime and inode are those recorded (`cache_problem`; else it is converted again).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import threading
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

try:
    import torch
except ImportError as e:  # pragma: no cover - an install problem, reported clearly
    from ..errors import ModelError, SettingsError

    raise ModelError("the torch backend needs `pip install 'speculant[torch]'` (torch==2.13.0, transformers, "
                     "accelerate, gguf)") from e

from ..errors import ModelError, SettingsError
from .base import Backend, VocabInfo

# llama.cpp treats these texts as end-of-generation / end-of-turn when the GGUF does not say (llama-vocab.cpp)
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "_<EOT>",
              "<｜end▁of▁sentence｜>")
_FIM_TEXTS = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder (prefix, suffix, middle)
              ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))  # StarCoder
_FIM_REPO_TEXTS = (("<|repo_name|>", "<|file_sep|>"), ("<reponame>", "<file_sep>"))  # (repository, file separator)
_EOG_TEXTS = _EOT_TEXTS + ("<|eom_id|>", "<|end_of_text|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
_LOCK = threading.Lock()


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        return "avx512_bf16" in flags or "amx_bf16" in flags
    except OSError:
        return False


def default_dtype(device: str) -> "torch.dtype":
    if device.startswith("cuda"):
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_bf16() else torch.float32


def _parse_dtype(dtype) -> Optional["torch.dtype"]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
             "f32": torch.float32, "fp16": torch.float16, "float16": torch.float16, "f16": torch.float16}
    if str(dtype).lower() not in table:
        raise ModelError(f"unknown dtype {dtype!r} (bf16, fp32 or fp16)")
    return table[str(dtype).lower()]


@lru_cache(maxsize=None)
def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode: byte-level BPE token text -> raw bytes."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _gguf_specials(path: Path) -> dict:
    """Special token ids as the GGUF metadata states them (what llama.cpp reads)."""
    out: dict = {}
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        for name in ("bos", "eos", "eot", "pad", "eom"):
            field = reader.fields.get(f"tokenizer.ggml.{name}_token_id")
            if field is not None:
                out[name] = int(field.parts[field.data[0]][0])
        field = reader.fields.get("tokenizer.ggml.add_bos_token")
        if field is not None:
            out["add_bos"] = bool(field.parts[field.data[0]][0])
    except Exception:  # metadata is a refinement; the tokenizer's own ids are the fallback
        pass
    try:  # llama.cpp's own answer (it guesses EOT/EOG from token texts): mixed runtimes then agree exactly
        from .llamacpp import ll

        mp = ll.llama_model_default_params()
        mp.vocab_only = True
        model = ll.llama_model_load_from_file(str(path).encode(), mp)
        if model:
            v = ll.llama_model_get_vocab(model)
            for name, fn in (("bos", ll.llama_vocab_bos), ("eos", ll.llama_vocab_eos),
                             ("eot", ll.llama_vocab_eot), ("pad", ll.llama_vocab_pad)):
                tid = fn(v)
                out[name] = tid if tid >= 0 else None
            out["add_bos"] = bool(ll.llama_vocab_get_add_bos(v))
            out["eog"] = [t for t in range(ll.llama_vocab_n_tokens(v)) if ll.llama_vocab_is_eog(v, t)]
            ll.llama_model_free(model)
    except Exception:
        pass
    return out


CONVERT_FORMAT = 2  # the converted folder's layout: bump it when the files or source.json's fields change, and
# every cache of another format is converted again (1: folders named after the GGUF's file name alone, no record)
_TMP_NAME = re.compile(r"\.tmp(\d+)(\.old)?$")  # <entry>.tmp<pid>: a conversion's work folder; .old: a stale entry going


def cache_dir_for(gguf: str | os.PathLike) -> Path:
    """$SPECULANT_HOME/torch/<file name>-<hash of the resolved path>: two files of one name (model.gguf) never
    share a conversion, and links to one file do."""
    from .. import models

    real = Path(gguf).resolve()
    return models.home() / "torch" / f"{real.name}-{hashlib.sha256(str(real).encode()).hexdigest()[:12]}"


def _source_record(gguf: Path) -> dict:
    """What a conversion is valid for: this file (resolved path, inode) as it is now (size, mtime in ns)."""
    st = gguf.stat()
    return {"format": CONVERT_FORMAT, "gguf": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "inode": st.st_ino}


def cache_problem(cache_dir: Path, gguf: Path) -> Optional[str]:
    """None when cache_dir holds a complete conversion of the GGUF (resolved path) as it is now; else what is wrong
    with it ("missing" when there is none). Checks source.json against the file, every file's recorded size,
    that the JSON files parse and the safetensors header covers its file."""
    if not cache_dir.is_dir():
        return "missing"
    try:
        info = json.loads((cache_dir / "source.json").read_text(encoding="utf-8"))
        if not isinstance(info, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        return f"damaged (source.json: {_reason(e)})"
    if info.get("format") != CONVERT_FORMAT:
        return f"of another format ({info.get('format', 1)!r}; this version writes {CONVERT_FORMAT})"
    now = _source_record(gguf)
    changed = [what for key, what in (("gguf", "path"), ("size", "size"), ("mtime_ns", "modification time"),
                                      ("inode", "inode")) if info.get(key) != now[key]]
    if changed:
        return f"out of date (the GGUF's {', '.join(changed)} changed since it was converted)"
    files = info.get("files")
    if not isinstance(files, dict) or not {"model.safetensors", "config.json", "gguf_specials.json"} <= set(files):
        return "damaged (source.json lists no complete set of files)"
    for name, size in files.items():
        path = cache_dir / Path(name).name
        try:
            if path.stat().st_size != size:
                raise ValueError(f"{path.stat().st_size:,} bytes, not the {size!r} written")
            if name.endswith(".json") and not isinstance(json.loads(path.read_text(encoding="utf-8")), dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as e:
            return f"damaged ({name}: {_reason(e)})"
    try:
        from safetensors import safe_open

        with safe_open(str(cache_dir / "model.safetensors"), "pt") as f:
            f.keys()
    except Exception as e:  # SafetensorError is no OSError
        return f"damaged (model.safetensors: {_reason(e)})"
    return None


def _reason(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:200] or type(e).__name__


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _discard(cache_dir: Path) -> None:
    """Remove an entry at once from its name (renamed away first: no half-deleted folder stays under it)."""
    if cache_dir.exists() or cache_dir.is_symlink():
        old = cache_dir.with_name(cache_dir.name + f".tmp{os.getpid()}.old")
        _remove(old)
        os.replace(cache_dir, old)
        _remove(old)


@contextmanager
def _entry_lock(cache_dir: Path):
    """One conversion of an entry at a time, across processes: another waits, then finds it made."""
    with open(cache_dir.with_name(f".{cache_dir.name}.lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"speculant: waiting for another process converting {cache_dir.name} for the torch backend",
                  file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _sweep_stale_conversions(cache_dir: Path) -> None:
    """Delete the work folders of conversions that were killed (SIGKILL, a crash; other endings delete their
    own): this entry's all (its lock is held here: nobody writes them), another entry's when its process is gone;
    and this GGUF's folder of the layout before CONVERT_FORMAT 2 (torch/<file name>), which nothing reads now."""
    from .. import models

    def owner_alive(work: Path) -> bool:
        m = _TMP_NAME.search(work.name)
        if m is None:  # no work folder: an entry of a GGUF named like x.tmp.gguf
            return True
        return work.name[:m.start()] != cache_dir.name and models.pid_alive(int(m.group(1)))

    models.sweep_stale_dirs(cache_dir.parent, "*.tmp*", owner_alive)
    legacy = cache_dir.parent / cache_dir.name.rsplit("-", 1)[0]
    if legacy.is_dir() and not legacy.is_symlink():
        try:
            old_format = "format" not in json.loads((legacy / "source.json").read_text(encoding="utf-8"))
        except (OSError, ValueError, TypeError):
            old_format = True
        if old_format:
            shutil.rmtree(legacy, ignore_errors=True)


def _convert_gguf(path: Path, cache_dir: Path) -> Path:
    """Load a GGUF through transformers once, save it as safetensors + tokenizer in cache_dir (written in a work
    folder, deleted on any error, Ctrl-C or SIGTERM, then renamed into place)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    record = _source_record(path)  # before reading it: a file changed meanwhile is converted again next time
    tmp = cache_dir.with_name(cache_dir.name + f".tmp{os.getpid()}")
    _remove(tmp)
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        model.config.quantization_config = None
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None
        tmp.mkdir(parents=True)
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
        tok.save_pretrained(str(tmp))
        (tmp / "gguf_specials.json").write_text(json.dumps(_gguf_specials(path)))
        files = {f.name: f.stat().st_size for f in tmp.iterdir() if f.is_file()}
        (tmp / "source.json").write_text(json.dumps({**record, "files": files}))
        _discard(cache_dir)
        os.replace(tmp, cache_dir)
    except BaseException:
        _remove(tmp)
        raise
    return cache_dir


def check_gguf_supported(gguf: Path) -> None:
    """Refuse, from the GGUF's metadata and before any conversion, a model the torch backend cannot run: it
    computes full causal attention in every layer (blocked_attention) and no logit soft-capping, so a model
    with sliding-window layers (Gemma 3, Gemma 2) or soft-capping would give wrong logits (TorchBackend
    checks the converted config again)."""
    from ..native import gguf_header

    try:  # ggml's own header reader: gguf's GGUFReader maps every tokenizer array (~6 s for SmolLM2)
        with gguf_header(gguf) as header:
            arch = header.architecture()
            keys = [f"{arch}.{k}" for k in ("attention.sliding_window", "context_length", "attn_logit_softcapping",
                                              "final_logit_softcapping")]
            meta = header.metadata(keys)
    except Exception:  # unreadable metadata: the conversion reports what is wrong with the file
        return
    if not arch:
        return
    fix = "run it on the llama.cpp backend (--backend llama.cpp, or --backend-draft llama.cpp for a draft)"
    window, trained = meta.get(keys[0]), meta.get(keys[1])
    if window and not (trained and int(window) >= int(trained)):  # a window past the training context limits nothing
        raise ModelError(f"{gguf.name}: the torch backend runs full-attention models only, and this {arch} model "
                         f"has sliding-window attention layers (window {int(window)}); {fix}")
    if any(meta.get(k) for k in keys[2:]):
        raise ModelError(f"{gguf.name}: logit soft-capping ({arch}) is not supported by the torch backend; {fix}")


def resolve_model_dir(model: str | os.PathLike) -> Path:
    """A registered name, a GGUF path or a transformers model directory -> a transformers model directory."""
    p = Path(model).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelError(f"{p} is a directory without config.json (not a transformers model)")
        return p
    from .. import models

    gguf = models.resolve(str(model))
    check_gguf_supported(gguf)  # before a conversion of tens of seconds and a cache of a GB
    real = gguf.resolve()
    cache_dir = cache_dir_for(real)
    if cache_problem(cache_dir, real) is None:
        return cache_dir
    try:
        cache_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ModelError(f"cannot write the torch conversion of {gguf.name} into {cache_dir.parent} "
                         f"({e.strerror or e}); set SPECULANT_HOME to a writable directory") from None
    with _LOCK, _entry_lock(cache_dir):
        _sweep_stale_conversions(cache_dir)
        why = cache_problem(cache_dir, real)  # another process may have converted it while this one waited
        if why is None:
            return cache_dir
        if why != "missing":
            print(f"speculant: warning: the torch conversion of {gguf.name} in {cache_dir} is {why}; converting "
                  f"it again", file=sys.stderr)
        _discard(cache_dir)  # its disk space back before the conversion writes as much again
        return _convert_gguf(real, cache_dir)


PASS_ROWS = 32  # every pass is cut into chunks of exactly this many tokens (see the module docstring)
KV_BLOCK = 256  # attention runs over keys in blocks of this many positions
ATTENTION = "speculant_blocked"


class BlockKVCache:
    """Keys and values per layer in one growing buffer [1, kv_heads, capacity, head_dim] (capacity a multiple
    of KV_BLOCK). Positions are absolute; entries past the sequence are stale and masked, so cutting the
    sequence back costs nothing: a later pass overwrites them. Only a chunk's real rows are stored (padding
    rows never overwrite anything). Layers are keyed by their own index, so a layer subset
    (self-speculation) keeps a cache of just its layers."""

    def __init__(self):
        self.keys: dict[int, "torch.Tensor"] = {}
        self.values: dict[int, "torch.Tensor"] = {}
        self.start = 0  # position of the first row of the chunk being evaluated
        self.n_real = 0  # its rows that are real tokens

    def set_chunk(self, start: int, n_real: int) -> None:
        self.start, self.n_real = start, n_real

    def update(self, key, value, layer_idx, **kwargs):
        """Store a chunk's real rows at start.. ; return the buffers up to the block holding its last row."""
        used = -(-(self.start + key.shape[-2]) // KV_BLOCK) * KV_BLOCK
        buf_k = self.keys.get(layer_idx)
        if buf_k is None or buf_k.shape[-2] < used:
            capacity = max(used, 2 * buf_k.shape[-2] if buf_k is not None else 0)
            new_k = key.new_zeros(*key.shape[:2], capacity, key.shape[-1])
            new_v = value.new_zeros(*value.shape[:2], capacity, value.shape[-1])
            if buf_k is not None:
                new_k[..., :buf_k.shape[-2], :] = buf_k
                new_v[..., :buf_k.shape[-2], :] = self.values[layer_idx]
            self.keys[layer_idx], self.values[layer_idx] = new_k, new_v
        buf_k, buf_v = self.keys[layer_idx], self.values[layer_idx]
        end = self.start + self.n_real
        buf_k[..., self.start:end, :] = key[..., :self.n_real, :]
        buf_v[..., self.start:end, :] = value[..., :self.n_real, :]
        return buf_k[..., :used, :], buf_v[..., :used, :]

    def get_seq_length(self, layer_idx: int = 0) -> int:  # transformers asks; positions are always given
        return self.start


class SharedPrefixCache:
    """A layer-subset draft's cache: layers below n_shared use the target's own cache, the rest the draft's.
    Valid because passes are bit-exact: a layer the draft runs with the same inputs as the target (every
    layer before the first skipped one) computes exactly the target's keys and values."""

    def __init__(self, target, n_shared: int):
        self.target = target  # its .cache is looked up each time (close() replaces it)
        self.own = BlockKVCache()
        self.n_shared = n_shared

    def set_chunk(self, start: int, n_real: int) -> None:
        self.own.set_chunk(start, n_real)
        self.target.cache.set_chunk(start, n_real)

    def update(self, key, value, layer_idx, **kwargs):
        cache = self.target.cache if layer_idx < self.n_shared else self.own
        return cache.update(key, value, layer_idx)

    @property
    def keys(self) -> dict:
        return {i: k for i, k in self.target.cache.keys.items() if i < self.n_shared} | self.own.keys

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.own.start


def blocked_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, position_ids=None,
                      **kwargs):
    """Causal attention with the same kernel shapes for every pass: query [1, heads, rows, d] against
    key/value [1, kv_heads, n_blocks * KV_BLOCK, d], block by block with an online softmax (float32).
    Grouped-query heads share their keys without copies. Returns [1, rows, heads, d]."""
    _, n_heads, n_rows, d = query.shape
    n_kv = key.shape[1]
    group = n_heads // n_kv
    dev = query.device
    q = query.reshape(n_kv, group * n_rows, d)  # [kv_heads, group*rows, d]: head h uses kv head h // group
    q_pos = position_ids[0].to(dev).repeat(group)  # [group*rows]
    run_max = torch.full((n_kv, group * n_rows), -float("inf"), device=dev)
    run_sum = torch.zeros(n_kv, group * n_rows, device=dev)
    acc = torch.zeros(n_kv, group * n_rows, d, device=dev)
    offsets = torch.arange(KV_BLOCK, device=dev)
    last = int(q_pos.max())
    for b0 in range(0, min(key.shape[2], last + 1), KV_BLOCK):
        k_blk, v_blk = key[0, :, b0:b0 + KV_BLOCK], value[0, :, b0:b0 + KV_BLOCK]  # [kv_heads, KV_BLOCK, d]
        scores = torch.matmul(q, k_blk.transpose(1, 2)).float() * scaling  # [kv_heads, group*rows, KV_BLOCK]
        scores = scores.masked_fill((offsets + b0)[None, None, :] > q_pos[None, :, None], -float("inf"))
        new_max = torch.maximum(run_max, scores.amax(-1))
        rescale = torch.exp(run_max - new_max)
        p = torch.exp(scores - new_max[..., None])
        run_sum = run_sum * rescale + p.sum(-1)
        acc = acc * rescale[..., None] + torch.matmul(p.to(value.dtype), v_blk).float()
        run_max = new_max
    out = (acc / run_sum[..., None]).to(query.dtype)
    return out.reshape(1, n_heads, n_rows, d).transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, blocked_attention)


class TorchBackend(Backend):
    """One transformers causal LM and one BlockKVCache (sequence 0); passes of fixed shape (module docstring)."""

    def __init__(self, model, tokenizer=None, *, name: str = "torch", n_ctx: int = 4096,
                 specials: Optional[dict] = None, source: Optional[Path] = None):
        super().__init__()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.source = source
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        cfg = model.config
        if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
            raise ModelError(f"{name}: only full-attention models are supported (layer types {set(cfg.layer_types)})")
        self.n_vocab = int(model.get_output_embeddings().weight.shape[0])
        n_train = int(getattr(cfg, "max_position_embeddings", 0) or 0)
        if 0 < n_train < n_ctx:  # positions past it are ones the model never saw (as the llama.cpp backend says)
            print(f"speculant: warning: --ctx-size {n_ctx} is more than {name}'s training context ({n_train} "
                  f"tokens); using {n_train}", file=sys.stderr)
        self.n_ctx = min(n_ctx or n_train, n_train) if n_train > 0 else n_ctx  # 0: the model's context
        if getattr(cfg, "attn_logit_softcapping", None) or getattr(cfg, "final_logit_softcapping", None):
            raise ModelError(f"{name}: logit soft-capping is not supported by the torch backend")
        _register_attention()
        cfg._attn_implementation = ATTENTION  # whatever it was loaded with: fixed-shape attention only
        self.cache = BlockKVCache()
        self.specials = self._special_ids(specials or {})
        self._eog = self._eog_ids()
        self._piece_cache: dict[int, bytes] = {}
        self._texts: Optional[list[str]] = None

    # -- layers (the self-speculative drafter runs a subset of them) -------------------------------------
    @property
    def n_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    def new_cache(self) -> BlockKVCache:
        return BlockKVCache()

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], start: int, n_logits: int, cache,
                layers: Optional[Sequence[int]] = None) -> np.ndarray:
        """Evaluate tokens at positions start.. with `cache` (a BlockKVCache: entries from start on are
        overwritten) through `layers` (all by default) and the final norm + LM head, in PASS_ROWS-row chunks;
        float32 logits of the last n_logits tokens."""
        if not len(tokens):
            return np.empty((0, self.n_vocab), dtype=np.float32)
        base, head = self.model.model, self.model.get_output_embeddings()
        saved = None
        if layers is not None:
            saved = (base.layers, base.config.num_hidden_layers)
            base.layers = torch.nn.ModuleList([saved[0][i] for i in layers])
            base.config.num_hidden_layers = len(layers)
        first_logit = len(tokens) - max(n_logits, 0)
        logits = []
        try:
            for c in range(0, len(tokens), PASS_ROWS):
                chunk = list(tokens[c:c + PASS_ROWS])
                n_real = len(chunk)
                chunk += [chunk[-1]] * (PASS_ROWS - n_real)  # padding rows: computed, thrown away
                ids = torch.tensor([chunk], dtype=torch.long, device=self.device)
                pos = torch.arange(start + c, start + c + PASS_ROWS, device=self.device).unsqueeze(0)
                cache.set_chunk(start + c, n_real)
                hidden = base(input_ids=ids, position_ids=pos, cache=cache, use_cache=True,
                              attention_mask={"full_attention": None}).last_hidden_state  # [1, rows, hidden]
                if c + n_real > first_logit:  # the head over all rows too: one shape for every pass
                    rows = head(hidden[0]).float()[max(first_logit - c, 0):n_real]
                    logits.append(rows.cpu().numpy())
        finally:
            if saved is not None:
                base.layers, base.config.num_hidden_layers = saved
        if not logits:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        return np.concatenate(logits)

    # -- decode loop --------------------------------------------------------------------------------------
    def _decode(self, tokens: Sequence[int], start: int, n_logits: int) -> np.ndarray:
        return self.forward(tokens, start, n_logits, self.cache)

    def _truncate(self, n_kept: int) -> None:
        pass  # nothing to free: entries past n_kept are masked until a later pass overwrites them

    # -- text ---------------------------------------------------------------------------------------------
    def _special_ids(self, gguf: dict) -> dict:
        tok = self.tokenizer
        out = {}
        for name in ("bos", "eos", "eot", "pad"):
            tid = gguf.get(name)
            if name not in gguf and tok is not None and name != "eot":
                tid = getattr(tok, f"{name}_token_id", None)
            out[name] = tid
        if "eot" not in gguf and tok is not None:  # llama.cpp's guess from the token texts
            vocab = tok.get_vocab()
            for text in _EOT_TEXTS:
                if text in vocab:
                    out["eot"] = vocab[text]
                    break
        out["add_bos"] = gguf.get("add_bos")
        out["eog"] = gguf.get("eog")
        return out

    def _eog_ids(self) -> set[int]:
        if self.specials.get("eog") is not None:
            return set(self.specials["eog"])
        eog = {t for t in (self.specials.get("eos"), self.specials.get("eot")) if t is not None}
        if self.tokenizer is not None:
            vocab = self.tokenizer.get_vocab()
            eog |= {vocab[t] for t in _EOG_TEXTS if t in vocab}
        return eog

    def _token_texts(self) -> list[str]:
        if self._texts is None:
            n_tok = len(self.tokenizer) if self.tokenizer is not None else 0
            texts = self.tokenizer.convert_ids_to_tokens(list(range(min(n_tok, self.n_vocab)))) if n_tok else []
            self._texts = [t or "" for t in texts] + [""] * (self.n_vocab - len(texts))
        return self._texts

    def _special_set(self) -> set[int]:
        tok = self.tokenizer
        if tok is None:
            return set()
        ids = set(tok.all_special_ids)
        for tid, added in getattr(tok, "added_tokens_decoder", {}).items():
            if getattr(added, "special", False):
                ids.add(int(tid))
        return ids

    @property
    def kind(self) -> str:
        texts = self._token_texts()
        if any("Ġ" in t for t in texts[:5000]):
            return "bpe"
        if any(t.startswith("▁") for t in texts[:5000]):
            return "spm"
        return "bpe"

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ModelError(f"{self.name} has no tokenizer; pass token ids")
        ids = list(self.tokenizer(text, add_special_tokens=add_special, split_special_tokens=not parse_special).input_ids)
        bos, add_bos = self.specials.get("bos"), self.specials.get("add_bos")
        if add_bos is not None and bos is not None:  # follow the GGUF's add_bos like llama.cpp does
            if add_special and add_bos and (not ids or ids[0] != bos):
                ids.insert(0, bos)
            elif (not add_special or not add_bos) and ids and ids[0] == bos and not text.startswith(
                    self.tokenizer.convert_ids_to_tokens(bos)):
                ids.pop(0)
        return ids

    def token_bytes(self, token: int) -> bytes:
        piece = self._piece_cache.get(token)
        if piece is None:
            if self.tokenizer is None:
                piece = f"<{token}>".encode()
            elif token in self._special_set() or not 0 <= token < len(self._token_texts()):
                piece = b""
            else:
                text = self._token_texts()[token]
                if self.kind == "spm":
                    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                        piece = bytes([int(text[3:5], 16)])
                    else:
                        piece = text.replace("▁", " ").encode("utf-8")
                else:
                    dec = _byte_decoder()
                    try:
                        piece = bytes(dec[c] for c in text)
                    except KeyError:  # an added (non byte-level) token: its text is literal
                        piece = text.encode("utf-8")
            self._piece_cache[token] = piece
        return piece

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    def chat_template(self) -> Optional[str]:
        return getattr(self.tokenizer, "chat_template", None) if self.tokenizer is not None else None

    def fim_tokens(self) -> Optional[tuple[int, int, int]]:
        return self._ids_of_texts(_FIM_TEXTS)

    def fim_repo_tokens(self) -> Optional[tuple[int, int]]:
        # only with fill-in-the-middle tokens, as llama.cpp reads them (SmolLM2 has <reponame> but no FIM)
        return self._ids_of_texts(_FIM_REPO_TEXTS) if self.fim_tokens() is not None else None

    def _ids_of_texts(self, families: tuple) -> Optional[tuple]:
        """The ids of the first family of special-token texts that the tokenizer has all of, or None."""
        vocab = self.tokenizer.get_vocab() if self.tokenizer is not None else {}
        for texts in families:
            if all(t in vocab for t in texts):
                return tuple(vocab[t] for t in texts)
        return None

    def _text_of(self, tid: Optional[int]) -> str:
        if tid is None or self.tokenizer is None:
            return ""
        return self.tokenizer.convert_ids_to_tokens(int(tid)) or ""

    @property
    def bos_token(self) -> str:
        return self._text_of(self.specials.get("bos"))

    @property
    def eos_token(self) -> str:
        return self._text_of(self.specials.get("eos"))

    def vocab_info(self) -> VocabInfo:
        texts = [t.encode("utf-8") for t in self._token_texts()]
        n_tok = len(self.tokenizer) if self.tokenizer is not None else 0
        unused = frozenset(range(n_tok, self.n_vocab))  # embedding rows past the tokenizer: padding
        special = {k: self.specials.get(k) for k in ("bos", "eos", "eot", "pad")}
        return VocabInfo(self.n_vocab, self.kind, texts, special, unused)

    def close(self) -> None:
        self.cache = self.new_cache() if getattr(self, "model", None) is not None else None


def resolve_device(device: Optional[str]) -> str:
    """The torch device a --device setting names: None is CUDA when a GPU is visible, else the CPU."""
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def check_device(device: str) -> None:
    """A clear SettingsError for a device this torch cannot use."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise SettingsError(f"--device {device!r} is not a torch device ({e})") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise SettingsError(f"--device {device}: {why} (torch {torch.__version__}); use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise SettingsError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif dev.type != "cpu":
        raise SettingsError(f"--device {device}: unsupported device type {dev.type!r} (cpu or cuda)")


def load_torch_backend(model_name_or_path: str | os.PathLike, dtype=None, device: Optional[str] = None, *,
                       n_ctx: int = 4096, threads: Optional[int] = None) -> TorchBackend:
    """A registered model name, a GGUF path or a transformers directory -> a TorchBackend.

    dtype: None (bf16 on CUDA and on CPUs with native bf16, else fp32), "bf16", "fp32", "fp16" or a torch
    dtype. device: None (CUDA when present, else CPU), "cpu", "cuda", "cuda:1"...
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..api import check_threads

    check_threads(threads, "--threads")
    if threads:
        torch.set_num_threads(threads)
    device = resolve_device(device)
    check_device(device)  # before any conversion or loading
    dtype = _parse_dtype(dtype) or default_dtype(device)
    path = resolve_model_dir(model_name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception:
        tok = None
    _register_attention()  # fixed-shape attention: see the module docstring
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation=ATTENTION)
    except (OSError, ValueError, KeyError) as e:  # a broken or foreign config.json, missing weights
        raise ModelError(f"transformers cannot load {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") \
            from None
    model.to(device)
    specials_file = path / "gguf_specials.json"
    specials = json.loads(specials_file.read_text()) if specials_file.exists() else {}
    src = path / "source.json"
    name = Path(json.loads(src.read_text())["gguf"]).name if src.exists() else path.name
    return TorchBackend(model, tok, name=name, n_ctx=n_ctx, specials=specials,
                        source=Path(json.loads(src.read_text())["gguf"]) if src.exists() else path)
