"""PyTorch / Hugging Face transformers backend: a safetensors model directory, or one of our GGUF files
loaded (and dequantized) through transformers' GGUF support.

Numerics: the engine's exactness at temperature 0 needs a target pass over k+1 tokens to give the same
logits as k+1 one-token passes. Measured on CPU (smollm2-135m, torch 2.13, 5 tokens batch vs single):
  bf16 + eager attention  max |diff| = 0.0   (oneDNN bf16 matmuls give the same rows whatever M)
  bf16 + sdpa attention   max |diff| = 0.75  (the fused CPU attention kernel differs by query length)
  fp32 + eager / sdpa     max |diff| ~ 5e-5  (MKL takes a gemv path for M=1, gemm for M>1)
so the backend defaults to bf16 with eager attention on CPUs with native bf16 (AVX512-BF16 / AMX), and
fp32 elsewhere (where argmax agreed in every measurement but bits are not guaranteed). On CUDA the same
caveat applies: cuBLAS picks kernels by shape, so greedy identity is "same argmax", not bit identity.

NOT exact on larger models: Qwen2.5-Coder-1.5B in bf16 + eager on the same CPU gives rows that depend on
how many tokens one pass holds (a block of M tokens after a 40-token cache vs a block of 40: max |diff|
0.13 for M = 1, 0.19-0.25 for M = 2..33). So on that model a speculative run's greedy output can leave
plain-torch decoding at a near tie (2 of 9 built-in prompts did, `docs/bench/runtimes/`). Tried: padding
every pass to 16 rows makes rows agree across pass sizes (max |diff| 0.0 for M = 1..15 padded) but a token
at row i of a pass still differs from the same token in a pass of its own (0.16): the result also depends on
the KV length the pass attends over. What would make it exact: one shape for every pass, i.e. padded rows
AND a static KV cache of fixed length (attention reductions of one length); not done yet. llama.cpp's
backend is bit-exact (see backends/llamacpp.py).

Converting a GGUF file takes tens of seconds (dequantizing, building the tokenizer), so the converted
model is cached once under $SPECULANT_HOME/torch/<gguf name>/ as safetensors and reloaded from there.
"""

from __future__ import annotations

import json
import os
import threading
from functools import lru_cache
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

try:
    import torch
except ImportError as e:  # pragma: no cover - an install problem, reported clearly
    from ..errors import ModelError

    raise ModelError("the torch backend needs `pip install 'speculant[torch]'` (torch==2.13.0, transformers, "
                     "accelerate, gguf)") from e

from ..errors import ModelError
from .base import Backend, VocabInfo

# llama.cpp treats these texts as end-of-generation / end-of-turn when the GGUF does not say (llama-vocab.cpp)
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "_<EOT>",
              "<｜end▁of▁sentence｜>")
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


def _convert_gguf(path: Path, cache_dir: Path) -> Path:
    """Load a GGUF through transformers once, save it as safetensors + tokenizer in cache_dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = cache_dir.with_name(cache_dir.name + f".tmp{os.getpid()}")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    tmp.mkdir(parents=True, exist_ok=True)
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
    (tmp / "source.json").write_text(json.dumps({"gguf": str(path), "size": path.stat().st_size,
                                                 "mtime": path.stat().st_mtime}))
    os.replace(tmp, cache_dir) if not cache_dir.exists() else None
    return cache_dir


def resolve_model_dir(model: str | os.PathLike) -> Path:
    """A registered name, a GGUF path or a transformers model directory -> a transformers model directory."""
    p = Path(model).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelError(f"{p} is a directory without config.json (not a transformers model)")
        return p
    from .. import models

    gguf = models.resolve(str(model))
    cache_dir = models.home() / "torch" / gguf.name
    src = cache_dir / "source.json"
    if src.exists():
        info = json.loads(src.read_text())
        if info.get("size") == gguf.stat().st_size:
            return cache_dir
    with _LOCK:
        if cache_dir.exists():
            import shutil

            shutil.rmtree(cache_dir, ignore_errors=True)
        return _convert_gguf(gguf, cache_dir)


class TorchBackend(Backend):
    """One transformers causal LM and one DynamicCache (sequence 0)."""

    def __init__(self, model, tokenizer=None, *, name: str = "torch", n_ctx: int = 4096,
                 specials: Optional[dict] = None, source: Optional[Path] = None):
        super().__init__()
        from transformers import DynamicCache

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
        self.n_ctx = min(n_ctx, n_train) if n_train > 0 else n_ctx
        self._cache_cls = DynamicCache
        self.cache = DynamicCache(config=cfg)
        self.specials = self._special_ids(specials or {})
        self._eog = self._eog_ids()
        self._piece_cache: dict[int, bytes] = {}
        self._texts: Optional[list[str]] = None

    # -- layers (the self-speculative drafter runs a subset of them) -------------------------------------
    @property
    def n_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    def new_cache(self):
        return self._cache_cls(config=self.model.config)

    @staticmethod
    def crop_cache(cache, n_kept: int) -> None:
        for layer in cache.layers:
            keys = getattr(layer, "keys", None)
            if keys is not None and keys.dim() >= 2 and keys.shape[-2] > n_kept:
                layer.keys = layer.keys[..., :n_kept, :]
                layer.values = layer.values[..., :n_kept, :]

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], start: int, n_logits: int, cache,
                layers: Optional[Sequence[int]] = None) -> np.ndarray:
        """Evaluate tokens at positions start.. with `cache` (cut to start first) through `layers` (all by
        default) and the final norm + LM head; float32 logits of the last n_logits tokens."""
        self.crop_cache(cache, start)
        if not len(tokens):
            return np.empty((0, self.n_vocab), dtype=np.float32)
        base = self.model.model
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        pos = torch.arange(start, start + len(tokens), device=self.device).unsqueeze(0)
        saved = None
        if layers is not None:
            saved = (base.layers, base.config.num_hidden_layers)
            base.layers = torch.nn.ModuleList([saved[0][i] for i in layers])
            base.config.num_hidden_layers = len(layers)
        try:
            hidden = base(input_ids=ids, position_ids=pos, cache=cache, use_cache=True).last_hidden_state
        finally:
            if saved is not None:
                base.layers, base.config.num_hidden_layers = saved
        if n_logits <= 0:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        logits = self.model.get_output_embeddings()(hidden[0, -n_logits:])
        return logits.float().cpu().numpy()

    # -- decode loop --------------------------------------------------------------------------------------
    def _decode(self, tokens: Sequence[int], start: int, n_logits: int) -> np.ndarray:
        return self.forward(tokens, start, n_logits, self.cache)

    def _truncate(self, n_kept: int) -> None:
        self.crop_cache(self.cache, n_kept)

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

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ModelError(f"{self.name} has no tokenizer; pass token ids")
        ids = list(self.tokenizer(text, add_special_tokens=add_special).input_ids)
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


def load_torch_backend(model_name_or_path: str | os.PathLike, dtype=None, device: Optional[str] = None, *,
                       n_ctx: int = 4096, threads: Optional[int] = None) -> TorchBackend:
    """A registered model name, a GGUF path or a transformers directory -> a TorchBackend.

    dtype: None (bf16 on CUDA and on CPUs with native bf16, else fp32), "bf16", "fp32", "fp16" or a torch
    dtype. device: None (CUDA when present, else CPU), "cpu", "cuda", "cuda:1"...
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = _parse_dtype(dtype) or default_dtype(device)
    path = resolve_model_dir(model_name_or_path)
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception:
        tok = None
    # eager attention: the fused sdpa CPU kernel rounds differently by query length (see the docstring)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="eager")
    model.to(device)
    specials_file = path / "gguf_specials.json"
    specials = json.loads(specials_file.read_text()) if specials_file.exists() else {}
    src = path / "source.json"
    name = Path(json.loads(src.read_text())["gguf"]).name if src.exists() else path.name
    return TorchBackend(model, tok, name=name, n_ctx=n_ctx, specials=specials,
                        source=Path(json.loads(src.read_text())["gguf"]) if src.exists() else path)
