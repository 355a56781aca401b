"""The llama.cpp build: portable CPU variants, the build reporting itself, our invariant kernels, doctor."""

import ctypes
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from speculant import models, native

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def _explain(proc: subprocess.CompletedProcess) -> str:
    if proc.returncode == -4:  # SIGILL: kernels this CPU does not have
        return f"killed by SIGILL (illegal instruction) on {native.cpu_model()}: {proc.stderr[-500:]}"
    return f"exit {proc.returncode}: {proc.stderr[-1500:]}"


def test_loaded_variant_uses_only_instructions_this_cpu_has():
    from speculant.backends import llamacpp  # noqa: F401  (loads the backends)

    features = native.system_features()
    assert features, "llama_print_system_info reported nothing"
    flags = native.cpu_flags()
    used = [f for f, v in features.items() if v == "1" and f in native.FEATURE_FLAGS]
    missing = [f for f in used if native.FEATURE_FLAGS[f] not in flags]
    assert not missing, f"variant {native.loaded_variant()} uses {missing}, which this CPU lacks"
    if native.build_info():  # our wheel: a run-time variant was picked, and it is the best one for this CPU
        variant = native.loaded_variant()
        assert variant in native.build_info()["variants"].split(",")
        if "avx2" in flags:
            assert "AVX2" in used, f"an AVX2 CPU got the {variant} variant"
        if {"avx512f", "avx512vbmi", "avx512_vnni"} <= flags:
            assert "AVX512_VNNI" in used, f"an AVX-512 VNNI CPU got the {variant} variant"


def test_a_model_loads_and_decodes_in_a_child_process():
    path = models.cached_path("smollm2-135m-instruct")
    if not path.exists():
        pytest.skip("smollm2-135m-instruct not pulled")
    code = (f"from speculant.backends.llamacpp import LlamaCppBackend\n"
            f"b = LlamaCppBackend({str(path)!r}, n_ctx=256)\n"
            f"toks = b.tokenize('The capital of France is')\n"
            f"out = [int(b.eval(toks)[-1].argmax())]\n"
            f"for _ in range(3): out.append(int(b.eval(out[-1:])[0].argmax()))\n"
            f"print('decoded', out)\n")
    proc = _run(code)
    assert proc.returncode == 0, _explain(proc)
    assert re.search(r"decoded \[\d+, \d+, \d+, \d+\]", proc.stdout)


def test_our_build_reports_itself_and_its_exactness():
    from speculant.backends import llamacpp  # noqa: F401

    info = native.build_info()
    if info is None:
        pytest.skip("llama-cpp-python was not built by native/build-llama.sh")
    features = native.system_features()
    assert features.get("SPECULANT") == info["key"], "the loaded kernels are not the wheel's build"
    assert features.get("CPU_VARIANT") == native.loaded_variant()
    assert features.get("LLAMAFILE") == "1"  # compiled in, and our hook keeps it off passes of <= 64 tokens
    assert native.exactness_problems() == []
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", info["llama_cpp_commit"])


def test_the_patch_applies_to_the_pinned_sources(tmp_path):
    sdist = models.home() / "wheels" / "llama_cpp_python-0.3.36.tar.gz"
    if not sdist.exists():
        pytest.skip("the llama-cpp-python sdist is not cached (native/build-llama.sh fetches it)")
    subprocess.run(["tar", "-xzf", str(sdist), "-C", str(tmp_path)], check=True)
    src = tmp_path / "llama_cpp_python-0.3.36"
    for patch in sorted((ROOT / "native").glob("*.patch")):
        proc = subprocess.run(["patch", "-p1", "--dry-run", "-d", str(src), "-i", str(patch)],
                              capture_output=True, text=True)
        assert proc.returncode == 0, f"{patch.name}: {proc.stdout}{proc.stderr}"
    assert "SPECULANT_MM" in (ROOT / "native" / "llama-cpp-python-0.3.36.patch").read_text()


def test_no_instruction_set_is_hard_coded():
    for path in [ROOT / "Makefile", ROOT / "native" / "build-llama.sh", ROOT / "scripts" / "build_llama_tools.sh"]:
        text = path.read_text()
        assert not re.search(r"-DGGML_(AVX\w*|AMX\w*|F16C|FMA|BMI2)=ON|-march=", text), path.name


# -- the kernels, on random blocks ----------------------------------------------------------------------------

Q4_K, Q6_K = 12, 14  # ggml type ids
BLOCK_BYTES = {Q4_K: 144, Q6_K: 210}
Q8_K_BYTES = 292  # float d, int8 qs[256], int16 bsums[16]


_I, _P, _S = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
TEST_ENTRY_ARGS = {  # the kernels' test entry points (native/src/speculant-mm.h)
    "speculant_mm_test_dot": [_I, _I, _P, _P, _S, _I, _I, _I, _P],
    "speculant_mm_test_q4_Kx8": [_I, _P, _P, _S, _I, _I, _I, _P, _P],
    "speculant_mm_test_q6_Kx8": [_I, _P, _P, _S, _I, _I, _I, _P],
}


def _bind(lib, name: str):
    fn = getattr(lib, name)
    fn.restype = ctypes.c_int
    fn.argtypes = TEST_ENTRY_ARGS[name]
    return fn


def _isa_libs():
    """(variant, library) for every kernel ISA level built and runnable on this CPU, each initialized."""
    for variant, needs in VARIANT_NEEDS.items():
        path = native.lib_dir() / f"libggml-cpu-{variant}.so"
        if path.exists() and needs <= native.cpu_flags():
            lib = ctypes.CDLL(str(path))
            lib.ggml_cpu_init()  # this copy's fp16 table (the loaded variant's was set up by the backend)
            yield variant, lib


def _kernel_lib():
    from speculant.backends import llamacpp  # noqa: F401

    variant = native.loaded_variant()
    if native.build_info() is None or variant is None:
        pytest.skip("not our wheel")
    return _bind(ctypes.CDLL(str(native.lib_dir() / f"libggml-cpu-{variant}.so")), "speculant_mm_test_dot")


def _random_weights(rng, qtype: int, nb: int) -> np.ndarray:
    x = rng.integers(0, 256, (nb, BLOCK_BYTES[qtype]), dtype=np.uint8)
    scale = lambda: np.frombuffer(np.float16(rng.uniform(-0.02, 0.02)).tobytes(), np.uint8)  # noqa: E731
    for b in range(nb):  # finite fp16 scales
        if qtype == Q4_K:
            x[b, 0:2], x[b, 2:4] = scale(), scale()
        else:
            x[b, 208:210] = scale()
    return x


def _random_q8_K(rng, ncols: int, nb: int) -> tuple[np.ndarray, np.ndarray]:
    """ncols q8_K rows of nb blocks, and their values as floats [ncols, nb*256]."""
    d = rng.uniform(0.001, 0.05, (ncols, nb)).astype(np.float32)
    qs = rng.integers(-127, 128, (ncols, nb, 256)).astype(np.int8)
    bsums = qs.reshape(ncols, nb, 16, 16).sum(-1).astype(np.int16)
    raw = np.concatenate([d[..., None].view(np.uint8), qs.view(np.uint8), bsums.view(np.uint8)], axis=-1)
    return np.ascontiguousarray(raw.reshape(ncols, -1)), (d[..., None] * qs).reshape(ncols, -1)


def _dot(fn, qtype, x, y, ncols, group, reorder=0) -> np.ndarray:
    out = np.zeros(ncols, np.float32)
    n = x.shape[0] * 256
    rc = fn(qtype, n, x.ctypes.data, y.ctypes.data, y.shape[1], ncols, group, reorder, out.ctypes.data)
    if rc != 0:
        pytest.skip("this build's CPU variant has no invariant kernels (no AVX2)")
    return out


@pytest.mark.parametrize("qtype", [Q4_K, Q6_K])
def test_multi_token_kernel_is_bit_identical_to_the_single_token_one(qtype):
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    fn = _kernel_lib()
    rng = np.random.default_rng(qtype)
    for nb in (1, 6, 35):  # 256 .. 8960 values per row (the Qwen shapes)
        x = _random_weights(rng, qtype, nb)
        y, yf = _random_q8_K(rng, 9, nb)
        single = _dot(fn, qtype, x, y, 9, group=1)
        for group in (2, 3, 4):
            multi = _dot(fn, qtype, x, y, 9, group=group)
            assert multi.tobytes() == single.tobytes(), f"{nb} blocks, {group} tokens at a time"
        # and it is the right dot product (gguf's own dequantization as the reference)
        w = dequantize(x.reshape(-1), GGMLQuantizationType(qtype)).astype(np.float64)
        ref = yf.astype(np.float64) @ w
        np.testing.assert_allclose(single, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", [Q4_K, Q6_K])
def test_the_bit_identity_check_sees_a_reordered_sum(qtype):
    fn = _kernel_lib()
    rng = np.random.default_rng(7)
    x = _random_weights(rng, qtype, 6)
    y, _ = _random_q8_K(rng, 8, 6)
    single = _dot(fn, qtype, x, y, 8, group=1)
    reordered = _dot(fn, qtype, x, y, 8, group=4, reorder=1)
    assert reordered.tobytes() != single.tobytes()
    np.testing.assert_allclose(reordered, single, rtol=1e-4)  # same sum, other rounding


def _kernel_lib_q4_Kx8():
    _kernel_lib()
    return _bind(ctypes.CDLL(str(native.lib_dir() / f"libggml-cpu-{native.loaded_variant()}.so")),
                 "speculant_mm_test_q4_Kx8")


def _dot_q4_Kx8(fn, x, y, ncols, group, reorder=0, with_ggml=False):
    """x: 8 Q4_K rows [8, nb, 144]; -> ours [ncols, 8] (and ggml's gemv [ncols, 8])."""
    out = np.zeros((ncols, 8), np.float32)
    ggml = np.zeros((ncols, 8), np.float32)
    x = np.ascontiguousarray(x)
    rc = fn(x.shape[1] * 256, x.ctypes.data, y.ctypes.data, y.shape[1], ncols, group, reorder, out.ctypes.data,
            ggml.ctypes.data if with_ggml else None)
    if rc != 0:
        pytest.skip("this build's CPU variant has no invariant kernels (no AVX2)")
    return (out, ggml) if with_ggml else out


def test_repacked_q4_K_kernel_is_bit_identical_to_ggml_one_token_kernel():
    """Q4_K repacked 8 rows at a time (llama.cpp's layout on x86): every column of a multi-token pass has the bits
    of ggml's own one-token kernel (ggml_gemv_q4_K_8x8_q8_K), and it is the right product."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    fn = _kernel_lib_q4_Kx8()
    rng = np.random.default_rng(3)
    for nb in (1, 6, 35):
        x = np.stack([_random_weights(rng, Q4_K, nb) for _ in range(8)])
        y, yf = _random_q8_K(rng, 9, nb)
        single, ggml = _dot_q4_Kx8(fn, x, y, 9, group=1, with_ggml=True)
        assert single.tobytes() == ggml.tobytes(), f"{nb} blocks: one token differs from ggml's gemv"
        for group in (2, 3, 4):
            multi = _dot_q4_Kx8(fn, x, y, 9, group=group)
            assert multi.tobytes() == single.tobytes(), f"{nb} blocks, {group} tokens at a time"
        w = dequantize(x.reshape(-1), GGMLQuantizationType.Q4_K).reshape(8, -1).astype(np.float64)
        ref = yf.astype(np.float64) @ w.T
        np.testing.assert_allclose(single, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())


def test_the_repacked_check_sees_a_reordered_sum():
    fn = _kernel_lib_q4_Kx8()
    rng = np.random.default_rng(8)
    x = np.stack([_random_weights(rng, Q4_K, 6) for _ in range(8)])
    y, _ = _random_q8_K(rng, 8, 6)
    single = _dot_q4_Kx8(fn, x, y, 8, group=1)
    reordered = _dot_q4_Kx8(fn, x, y, 8, group=4, reorder=1)
    assert reordered.tobytes() != single.tobytes()
    np.testing.assert_allclose(reordered, single, rtol=1e-4)


def test_repacked_q6_K_kernel_is_invariant_and_right():
    """Q6_K repacked 8 rows at a time (our build's layout on x86): the same bits however many tokens share the
    unpacked weights, the right product, and a reordered sum is seen."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    _kernel_lib()
    fn = _bind(ctypes.CDLL(str(native.lib_dir() / f"libggml-cpu-{native.loaded_variant()}.so")),
               "speculant_mm_test_q6_Kx8")

    def run(x, y, ncols, group, reorder=0):
        out = np.zeros((ncols, 8), np.float32)
        if fn(x.shape[1] * 256, x.ctypes.data, y.ctypes.data, y.shape[1], ncols, group, reorder, out.ctypes.data):
            pytest.skip("this build's CPU variant has no invariant kernels (no AVX2)")
        return out

    rng = np.random.default_rng(5)
    for nb in (1, 6, 35):
        x = np.ascontiguousarray(np.stack([_random_weights(rng, Q6_K, nb) for _ in range(8)]))
        y, yf = _random_q8_K(rng, 9, nb)
        single = run(x, y, 9, group=1)
        for group in (2, 3, 4):
            assert run(x, y, 9, group=group).tobytes() == single.tobytes(), f"{nb} blocks, {group} at a time"
        w = dequantize(x.reshape(-1), GGMLQuantizationType.Q6_K).reshape(8, -1).astype(np.float64)
        ref = yf.astype(np.float64) @ w.T
        np.testing.assert_allclose(single, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())
        if nb > 1:
            reordered = run(x, y, 9, group=4, reorder=1)
            assert reordered.tobytes() != single.tobytes()


# -- doctor ---------------------------------------------------------------------------------------------------

def test_doctor_prints_every_fact():
    proc = subprocess.run([sys.executable, "-m", "speculant", "doctor", "--json"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, _explain(proc)
    facts = json.loads(proc.stdout)
    for key in ("speculant", "cpu", "cpu_features", "cores", "threads", "llama.cpp", "torch", "transformers",
                "gpu", "models"):
        assert key in facts, key
    ll = facts["llama.cpp"]
    for key in ("llama_cpp_python", "build", "llama_cpp_commit", "variant", "kernel_features", "exactness"):
        assert key in ll, key
    assert facts["models"].get("smollm2-135m-instruct") or not models.cached_path("smollm2-135m-instruct").exists()
    screen = subprocess.run([sys.executable, "-m", "speculant", "doctor"], capture_output=True, text=True,
                            timeout=300).stdout
    for label in ("cpu ", "cpu features", "llama.cpp", "variant", "kernels", "exactness", "torch", "gpu", "models"):
        assert label in screen, label


VARIANT_NEEDS = {"haswell": {"avx2", "fma"}, "skylakex": {"avx512f", "avx512bw"},
                 "icelake": {"avx512f", "avx512vbmi", "avx512_vnni"}, "zen4": {"avx512f", "avx512_bf16"}}


@pytest.mark.parametrize("qtype", [Q4_K, Q6_K])
def test_every_isa_level_gives_the_same_bits(qtype):
    """256-bit (haswell) and 512-bit (skylakex, icelake, ...) kernels: the same logits on any machine."""
    _kernel_lib()
    rng = np.random.default_rng(11)
    x = _random_weights(rng, qtype, 6)
    y, _ = _random_q8_K(rng, 7, 6)
    results = {}
    for variant, lib in _isa_libs():
        fn = _bind(lib, "speculant_mm_test_dot")
        results[variant] = [_dot(fn, qtype, x, y, 7, group=g).tobytes() for g in (1, 4)]
    if len(results) < 2:
        pytest.skip("fewer than two kernel ISA levels run on this CPU")
    first = next(iter(results.values()))
    assert all(r == first for r in results.values()), {v: r == first for v, r in results.items()}


def test_every_isa_level_gives_the_same_bits_repacked():
    """The repacked kernels (256-bit maddubs on haswell, 512-bit without VNNI on skylakex, VNNI on icelake and
    zen4) compute the same integers and the same float sequence: the same logits on any machine."""
    _kernel_lib()
    rng = np.random.default_rng(13)
    x4 = np.ascontiguousarray(np.stack([_random_weights(rng, Q4_K, 6) for _ in range(8)]))
    x6 = np.ascontiguousarray(np.stack([_random_weights(rng, Q6_K, 6) for _ in range(8)]))
    y, _ = _random_q8_K(rng, 7, 6)
    results = {}
    for variant, lib in _isa_libs():
        bits = []
        for name, x in (("speculant_mm_test_q4_Kx8", x4), ("speculant_mm_test_q6_Kx8", x6)):
            fn = _bind(lib, name)
            for group in (1, 4):
                out = np.zeros((7, 8), np.float32)
                args = [x.shape[1] * 256, x.ctypes.data, y.ctypes.data, y.shape[1], 7, group, 0, out.ctypes.data]
                assert fn(*args, *([None] if name.endswith("q4_Kx8") else [])) == 0, variant
                bits.append(out.tobytes())
        results[variant] = bits
    if len(results) < 2:
        pytest.skip("fewer than two kernel ISA levels run on this CPU")
    first = next(iter(results.values()))
    assert all(r == first for r in results.values()), {v: r == first for v, r in results.items()}
