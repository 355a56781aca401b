"""The llama.cpp build speculant runs on: load its CPU backend for this CPU, and say what was loaded.

Our wheel (native/build-llama.sh) builds ggml's CPU backend once per x86 ISA level
(libggml-cpu-<variant>.so) and loads none of them by itself; `load_backends()` asks ggml to score every
variant against this CPU's CPUID and register the best one (llama-cpp-python never calls
ggml_backend_load_all). A stock llama-cpp-python (backends linked in) is left as it is.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import re
import threading
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple, Optional

from .errors import ModelError

# what ggml's feature names mean in /proc/cpuinfo's flags
FEATURE_FLAGS = {
    "SSE3": "pni", "SSSE3": "ssse3", "AVX": "avx", "AVX2": "avx2", "F16C": "f16c", "FMA": "fma",
    "BMI2": "bmi2", "AVX_VNNI": "avx_vnni", "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi",
    "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16", "AMX_INT8": "amx_int8",
}


def lib_dir() -> Path:
    import llama_cpp
    return Path(llama_cpp.__file__).parent / "lib"


def _mapped(prefix: str) -> Optional[str]:
    """The path of an already loaded library whose file name starts with `prefix` (None if none is)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    found = re.search(r"(/\S*/" + re.escape(prefix) + r"[^/\s]*)$", maps, re.M)
    return found.group(1) if found else None


def _linked_by_libllama(name: str) -> ctypes.CDLL:
    """The ggml functions libllama itself calls: its handle, whose symbol lookups go through the libraries it
    links. Wheels hold copies, not links, of libggml(-base).so and .so.0, and a copy loaded under the other name
    (llama_cpp._ggml does, or a test) is a second ggml, with an empty backend registry and a logger of its own:
    which copy a search of the mapped files finds first changed with the address layout from run to run."""
    from llama_cpp import llama_cpp as bindings

    return ctypes.CDLL(name, handle=bindings._lib._handle)


@lru_cache(maxsize=None)
def _ggml() -> ctypes.CDLL:
    lib = _linked_by_libllama("libggml")
    lib.ggml_backend_reg_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_load.restype = ctypes.c_void_p
    lib.ggml_backend_load.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_reg_get.restype = ctypes.c_void_p
    lib.ggml_backend_reg_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_reg_name.restype = ctypes.c_char_p
    lib.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    return lib


def backend_names() -> list[str]:
    g = _ggml()
    return [g.ggml_backend_reg_name(g.ggml_backend_reg_get(i)).decode() for i in range(g.ggml_backend_reg_count())]


def load_backends() -> None:
    """Register the best CPU variant (and RPC) of a GGML_BACKEND_DL build; a no-op for a linked-in build.
    SPECULANT_CPU_VARIANT=<name> (haswell, skylakex, icelake, zen4, x64) loads that variant instead, where this
    CPU runs it: e.g. the AVX2 kernels on an AVX-512 machine, as an AVX2-only machine would run them."""
    if any(name.upper() == "CPU" for name in backend_names()):
        return
    forced = os.environ.get("SPECULANT_CPU_VARIANT", "")
    if forced:
        path = lib_dir() / f"libggml-cpu-{forced}.so"
        variants = sorted(p.name[len("libggml-cpu-"):-3] for p in lib_dir().glob("libggml-cpu-*.so"))
        if not path.exists():
            raise ModelError(f"SPECULANT_CPU_VARIANT={forced}: no such variant in {lib_dir()} "
                             f"(there are: {', '.join(variants) or 'none'})")
        if not _ggml().ggml_backend_load(str(path).encode()):
            raise ModelError(f"SPECULANT_CPU_VARIANT={forced}: this CPU ({cpu_model()}) cannot run that variant")
        rpc = lib_dir() / "libggml-rpc.so"
        if rpc.exists():
            _ggml().ggml_backend_load(str(rpc).encode())
        return
    _ggml().ggml_backend_load_all_from_path(str(lib_dir()).encode())
    if not any(name.upper() == "CPU" for name in backend_names()):
        variants = sorted(p.name for p in lib_dir().glob("libggml-cpu*.so"))
        raise ModelError(f"no llama.cpp CPU backend loads on this CPU ({cpu_model()}); found {variants or 'none'} "
                         f"in {lib_dir()}: rebuild with `make setup`")


@lru_cache(maxsize=None)
def build_info() -> Optional[dict]:
    """What native/build-llama.sh wrote into the wheel; None for any other llama-cpp-python."""
    try:
        return json.loads((lib_dir().parent / "speculant_build.json").read_text())
    except (OSError, ValueError):
        return None


def system_features() -> dict[str, str]:
    """The loaded CPU backend's features as llama.cpp reports them (llama_print_system_info)."""
    import llama_cpp as ll
    text = ll.llama_print_system_info().decode("utf-8", errors="replace")
    return dict(re.findall(r"([A-Z0-9_]+) = ([^|\s]+)", text))


def loaded_variant() -> Optional[str]:
    """The libggml-cpu variant this process runs (None for a build without variants)."""
    variant = system_features().get("CPU_VARIANT")
    if variant:
        return variant
    path = _mapped("libggml-cpu-")
    return Path(path).name[len("libggml-cpu-"):-len(".so")] if path else None


def invariant_rows() -> int:
    """Passes of at most this many tokens get batch-invariant kernels in our build (the C side reads the same
    variable, native/src/speculant-mm.c); a stock build with the tiled kernel off is invariant at any size."""
    if build_info() is None:
        return 1 << 30
    return rows_setting(os.environ.get("SPECULANT_INVARIANT_ROWS"))


def rows_setting(value: Optional[str]) -> int:
    """SPECULANT_INVARIANT_ROWS as our C kernels read it (speculant_mm_max_rows): 64 when unset, else C's atoll
    (leading spaces and a sign, then the digits up to the first other character; none: 0)."""
    if value is None:
        return 64
    m = re.match(r"[ \t\n\v\f\r]*([+-]?)([0-9]*)", value)
    digits = m.group(2) if m.group(2).isascii() else ""
    return int(m.group(1) + digits) if digits else 0


def exactness_problems() -> list[str]:
    """Why this llama.cpp build cannot promise bit-identical batched logits (empty: it can)."""
    features = system_features()
    problems = []
    if "SPECULANT" not in features:
        problems.append("llama-cpp-python was not built by speculant (native/build-llama.sh)")
        if features.get("LLAMAFILE") == "1":  # ours compiles it in too, but keeps it to prompt passes
            problems.append("llamafile sgemm is compiled in (batched passes round differently)")
    return problems


# Quantized weight types whose matrices our build's multi-token kernels compute, a pass over n tokens for about the
# price of one weight read (native/src/speculant-mm.c, plain or repacked layout, including Q2_K as llama.cpp repacks
# it on AVX-512 CPUs; tests/test_native.py checks this set against the build). Other quantized types (TQ1_0, Q1_0,
# NVFP4, ...) are computed one token at a time: each token of a verify pass adds its own pass over those weights.
BATCHED_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                           "IQ4_NL", "IQ4_XS", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
                           "MXFP4", "TQ2_0"})
FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


class GGUFTensor(NamedTuple):
    name: str
    type: str  # ggml's type name, upper case as gguf-py spells it: "Q4_K", "IQ4_XS", "F16"
    shape: list[int]  # ne0 first (row length), as gguf-py's ReaderTensor.shape
    n_bytes: int
    data_end: int  # where its data ends in the file (bytes)


class _GGUFInitParams(ctypes.Structure):
    _fields_ = [("no_alloc", ctypes.c_bool), ("ctx", ctypes.c_void_p)]


@lru_cache(maxsize=None)
def _ggml_base() -> ctypes.CDLL:
    lib = _linked_by_libllama("libggml-base")
    lib.gguf_init_from_file.restype = ctypes.c_void_p
    lib.gguf_init_from_file.argtypes = [ctypes.c_char_p, _GGUFInitParams]
    lib.gguf_free.argtypes = [ctypes.c_void_p]
    lib.gguf_get_data_offset.restype = ctypes.c_size_t
    lib.gguf_get_data_offset.argtypes = [ctypes.c_void_p]
    lib.gguf_get_n_tensors.restype = ctypes.c_int64
    lib.gguf_get_n_tensors.argtypes = [ctypes.c_void_p]
    for fn, restype in (("gguf_get_tensor_name", ctypes.c_char_p), ("gguf_get_tensor_type", ctypes.c_int),
                        ("gguf_get_tensor_offset", ctypes.c_size_t), ("gguf_get_tensor_size", ctypes.c_size_t),
                        ("gguf_get_tensor_ne", ctypes.POINTER(ctypes.c_int64))):
        getattr(lib, fn).restype = restype
        getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.ggml_type_name.restype = ctypes.c_char_p
    lib.ggml_type_name.argtypes = [ctypes.c_int]
    lib.ggml_log_get.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
    lib.ggml_log_set.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.gguf_find_key.restype = ctypes.c_int64
    lib.gguf_find_key.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    for fn, restype in (("gguf_get_kv_type", ctypes.c_int), ("gguf_get_val_str", ctypes.c_char_p),
                        ("gguf_get_val_data", ctypes.c_void_p), ("gguf_get_arr_type", ctypes.c_int),
                        ("gguf_get_arr_n", ctypes.c_size_t), ("gguf_get_arr_data", ctypes.c_void_p)):
        getattr(lib, fn).restype = restype
        getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.c_int64]
    return lib


# gguf_type -> ctypes type of the scalar types (GGUF_TYPE_STRING 8 and GGUF_TYPE_ARRAY 9 are read apart)
_GGUF_SCALARS = {0: ctypes.c_uint8, 1: ctypes.c_int8, 2: ctypes.c_uint16, 3: ctypes.c_int16, 4: ctypes.c_uint32,
                 5: ctypes.c_int32, 6: ctypes.c_float, 7: ctypes.c_bool, 10: ctypes.c_uint64, 11: ctypes.c_int64,
                 12: ctypes.c_double}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class GGUFHeader:
    """A GGUF's metadata and tensor list as ggml's parser (the one llama.cpp uses) read them, no tensor data.
    gguf-py's reader builds every metadata field in Python first: ~6 s for a 152k-token vocabulary, against
    milliseconds here."""

    def __init__(self, g: ctypes.CDLL, ctx: int):
        self._g, self._ctx = g, ctx

    def metadata(self, keys) -> dict:
        """Those of `keys` the file has -> their values: numbers, strings, lists of numbers (arrays of strings
        are left out). ggml aborts on a getter of the wrong type, so each value is read by its stored type."""
        g, ctx, out = self._g, self._ctx, {}
        for key in keys:
            i = g.gguf_find_key(ctx, key.encode())
            if i < 0:
                continue
            kind = g.gguf_get_kv_type(ctx, i)
            if kind == _GGUF_STRING:
                out[key] = g.gguf_get_val_str(ctx, i).decode("utf-8", errors="replace")
            elif kind in _GGUF_SCALARS:
                out[key] = ctypes.cast(g.gguf_get_val_data(ctx, i), ctypes.POINTER(_GGUF_SCALARS[kind])).contents.value
            elif kind == _GGUF_ARRAY and (item := _GGUF_SCALARS.get(g.gguf_get_arr_type(ctx, i))) is not None:
                n = g.gguf_get_arr_n(ctx, i)
                out[key] = list((item * n).from_address(g.gguf_get_arr_data(ctx, i))) if n else []
        return out

    def tensors(self) -> list[GGUFTensor]:
        g, ctx = self._g, self._ctx
        data = g.gguf_get_data_offset(ctx)
        out = []
        for i in range(g.gguf_get_n_tensors(ctx)):
            ne = g.gguf_get_tensor_ne(ctx, i)[:4]
            n_dims = max((d + 1 for d in range(4) if ne[d] != 1), default=1)
            size = g.gguf_get_tensor_size(ctx, i)
            out.append(GGUFTensor(g.gguf_get_tensor_name(ctx, i).decode(),
                                  g.ggml_type_name(g.gguf_get_tensor_type(ctx, i)).decode().upper(),
                                  list(ne[:n_dims]), size, data + g.gguf_get_tensor_offset(ctx, i) + size))
        return out

    def architecture(self) -> str:
        arch = self.metadata(["general.architecture"]).get("general.architecture")
        if not isinstance(arch, str):
            raise ModelError("the GGUF names no architecture (general.architecture)")
        return arch


_GGML_LOG_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_log_lock = threading.Lock()  # one keeper at a time: two interleaved swaps could restore each other's callback
_log_keeper: Optional[tuple[int, list, ctypes.c_void_p, ctypes.c_void_p]] = None  # (thread, lines, logger before)


@_GGML_LOG_CALLBACK
def _keep_log_line(level, text, data):
    """ggml's logger while _ggml_log_kept runs. A module-level object, never freed: ggml may call whatever it holds
    from any thread at any time, and a callback freed while installed crashes the process at its next log line."""
    keeper = _log_keeper
    if keeper is not None and keeper[0] == threading.get_ident():
        keeper[1].append((text or b"").decode("utf-8", "replace"))
    elif keeper is not None and keeper[2].value not in (None, _KEEP_LOG_LINE):
        _GGML_LOG_CALLBACK(keeper[2].value)(level, text, keeper[3])  # another thread's line: to the logger before


_KEEP_LOG_LINE = ctypes.cast(_keep_log_line, ctypes.c_void_p).value


@contextmanager
def _ggml_log_kept(g: ctypes.CDLL):
    """This thread's ggml log lines while the block runs, kept in a list instead of printed; the logger before is
    put back. Not reentrant: the block is one call into ggml."""
    global _log_keeper
    with _log_lock:
        before_cb, before_data = ctypes.c_void_p(), ctypes.c_void_p()
        g.ggml_log_get(ctypes.byref(before_cb), ctypes.byref(before_data))
        lines: list[str] = []
        _log_keeper = (threading.get_ident(), lines, before_cb, before_data)
        g.ggml_log_set(ctypes.cast(_keep_log_line, ctypes.c_void_p), None)
        try:
            yield lines
        finally:
            g.ggml_log_set(before_cb, before_data)
            _log_keeper = None


@contextmanager
def gguf_header(path):
    """The GGUFHeader of a file, for one or more reads; ModelError when ggml cannot parse it (it says why on
    stderr)."""
    g = _ggml_base()
    with _ggml_log_kept(g) as log:  # the parser's complaint goes into the error, not raw onto stderr
        ctx = g.gguf_init_from_file(str(path).encode(), _GGUFInitParams(True, None))
    if not ctx:
        why = "; ".join(line.strip() for line in log if line.strip())[-300:]
        raise ModelError(f"{path} is not a readable GGUF file (corrupt or truncated metadata{': ' + why if why else ''})")
    try:
        yield GGUFHeader(g, ctx)
    finally:
        g.gguf_free(ctx)


def gguf_tensors(path) -> list[GGUFTensor]:
    """A GGUF's tensor list, as ggml (so llama.cpp) reads it."""
    with gguf_header(path) as header:
        return header.tensors()


def gguf_metadata(path, keys) -> dict:
    """GGUFHeader.metadata of one file."""
    with gguf_header(path) as header:
        return header.metadata(keys)


def gguf_block_count(path) -> int:
    """A GGUF's repeating layers (<general.architecture>.block_count)."""
    with gguf_header(path) as header:
        key = f"{header.architecture()}.block_count"
        n = header.metadata([key]).get(key)
    if not isinstance(n, int) or isinstance(n, bool):
        raise ModelError(f"{path} has no integer {key}")
    return n


def unbatched_weights(path) -> tuple[float, dict[str, int]]:
    """A GGUF's share of matmul weight bytes in quantized types without multi-token kernels, and those bytes by
    type name (empty: none), from one read of its tensor list (the same whether the weights load repacked or not:
    every layout llama.cpp repacks into on x86 has our kernels)."""
    return unbatched_share([(t.name, t.type, t.shape, t.n_bytes) for t in gguf_tensors(path)])


def unbatched_share(tensors) -> tuple[float, dict[str, int]]:
    """unbatched_weights over a tensor list [(name, type name, shape [ne0, ne1, ...], bytes)]: a file's, or what
    the quantizer would make (quantize.dry_run). The token embedding counts only where it is also the output
    layer (a lookup otherwise, no matmul). A mixture of experts' expert matrices ([ne0, ne1, n_expert], llama.cpp's
    mul_mat_id) count as any matrix of their type: our kernels take each expert's tokens in a pass together."""
    tied = not any(name == "output.weight" for name, *_ in tensors)
    slow: dict[str, int] = {}
    total = 0
    for name, ttype, shape, nbytes in tensors:
        if len(shape) < 2 or (name == "token_embd.weight" and not tied):
            continue
        total += nbytes
        if ttype not in BATCHED_TYPES and ttype not in FLOAT_TYPES:
            slow[ttype] = slow.get(ttype, 0) + nbytes
    return sum(slow.values()) / max(1, total), slow


@lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@lru_cache(maxsize=None)
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _variant_fn(name: str):
    """Our build's function `name` in the loaded CPU variant's library, or None (no variants, or a build without
    it)."""
    variant = loaded_variant()
    path = lib_dir() / f"libggml-cpu-{variant}.so"
    return getattr(ctypes.CDLL(str(path)), name, None) if variant and path.exists() else None


@contextmanager
def _kernel_setting(setter: str, value: int, restore: int):
    """Calls our build's `setter` (in the loaded CPU variant's library) with `value` for a block and with `restore`
    after it. Yields False (and changes nothing) on a build without it."""
    fn = _variant_fn(setter)
    if fn is None:
        yield False
        return
    fn.argtypes = [ctypes.c_int64]
    fn(value)
    try:
        yield True
    finally:
        fn(restore)


def set_plain_as_repacked() -> bool:
    """From now on, in this process, unrepacked (plain) rows of the types llama.cpp repacks on this CPU take the
    repacked kernels' arithmetic (native/src/speculant-mm.c), so a model gives the logits of its default, repacked
    load. For RPC: a worker holds its layers plain (RPC offers no repacked buffers) and the process that drives it
    keeps its own layers repacked. False on a build without the switch."""
    fn = _variant_fn("speculant_mm_set_plain_as_repacked")
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int64]
    fn(1)
    return True


def plain_as_repacked():
    """Within this block plain rows take the repacked kernels' arithmetic (set_plain_as_repacked), for tests."""
    return _kernel_setting("speculant_mm_set_plain_as_repacked", 1, 0)


def ggml_kernels():
    """Within this block every pass in this process takes ggml's own kernels, as in llama.cpp's default build
    (not exact): an A/B of the kernels over the very same weights in memory. Yields False (and changes nothing)
    on a build without the switch."""
    return _kernel_setting("speculant_mm_set_max_rows", 0, invariant_rows())


def chunk_rows(rows: int):
    """Within this block our kernels split each matmul of a small pass into chunks of `rows` weight rows (rounded
    up to 8; 0: the default split, a few chunks a thread), for an A/B of the split over the same weights in
    memory. Yields False (and changes nothing) on a build without the switch."""
    return _kernel_setting("speculant_mm_set_chunk_rows", rows, 0)


def ggml_attention():
    """Within this block the attention products of small passes take ggml's own loop (one dot product per
    element) instead of ours, which shares each K / V row between the query columns that read it and computes the
    same bits, and the softmax's maximum ggml's scalar loop instead of our vectorized one (the same maximum): an
    A/B over the same weights and cache in memory. Yields False (and changes nothing) on a build without the
    switch."""
    return _kernel_setting("speculant_mm_set_shared_attention", 0, 1)


def amx() -> bool:
    """Whether our kernels take AMX tile products here (repacked Q4_K and Q6_K rows in passes of 8 tokens or more,
    Q4_0, IQ4_NL and MXFP4 rows in passes of 6 or more: the prompt's passes, long verify passes): the CPU has AMX-INT8, Linux granted its tile state, SPECULANT_AMX is
    not 0, and the loaded variant has the kernels."""
    fn = _variant_fn("speculant_mm_amx")
    if fn is None:
        return False
    fn.restype = ctypes.c_int
    return bool(fn())


def without_amx():
    """Within this block no pass takes the AMX tile products (the VNNI kernels compute the same bits): an A/B over
    the same weights in memory. Yields False (and changes nothing) on a build without the switch."""
    return _kernel_setting("speculant_mm_set_amx_min_cols", 1 << 62, 0)  # 0: the default


THP_ENV = "SPECULANT_THP"  # read by our build's ggml_aligned_malloc at every allocation (native/*.patch)


def huge_pages() -> dict:
    """Transparent huge pages: the kernel's mode, and whether our build asks for them (buffers >= 2 MiB:
    weights, KV cache, compute), which SPECULANT_THP=0 turns off."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
        mode = re.search(r"\[(\w+)\]", text).group(1)
    except (OSError, AttributeError):
        mode = None
    return {"kernel": mode, "requested": os.environ.get(THP_ENV, "1") != "0"}


def one_request_pages() -> None:
    """For a command that loads its models to answer one request (generate, demo): 4 KiB pages unless
    SPECULANT_THP says otherwise. Huge pages make a Qwen 1.5B decode step ~9% cheaper, but on our VMs the
    first touch of that memory costs ~2 s more per GB loaded, which a short generation does not earn back
    (128 tokens: 10.6 s wall on small pages, 12.0 s on huge ones); serve, bench and the Python API keep them."""
    os.environ.setdefault(THP_ENV, "0")
