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

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS = 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 20, 23
IQ2_XXS, IQ2_XS, IQ3_XXS, IQ3_S, IQ2_S, IQ1_S, IQ1_M = 16, 17, 18, 21, 22, 19, 29
MXFP4, TQ2_0, TQ1_0 = 39, 35, 34
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0", Q2_K: "Q2_K", Q3_K: "Q3_K",
         Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K", IQ4_NL: "IQ4_NL", IQ4_XS: "IQ4_XS", IQ2_XXS: "IQ2_XXS",
         IQ2_XS: "IQ2_XS", IQ2_S: "IQ2_S", IQ3_XXS: "IQ3_XXS", IQ3_S: "IQ3_S", IQ1_S: "IQ1_S", IQ1_M: "IQ1_M",
         MXFP4: "MXFP4", TQ2_0: "TQ2_0"}
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, Q2_K: 84, Q3_K: 110, Q4_K: 144, Q5_K: 176,
               Q6_K: 210, IQ4_NL: 18, IQ4_XS: 136, IQ2_XXS: 66, IQ2_XS: 74, IQ2_S: 82, IQ3_XXS: 98, IQ3_S: 110,
               IQ1_S: 50, IQ1_M: 56, MXFP4: 17, TQ2_0: 66, TQ1_0: 54}
BLOCK_VALUES = {Q4_0: 32, Q4_1: 32, Q5_0: 32, Q5_1: 32, Q8_0: 32, Q2_K: 256, Q3_K: 256, Q4_K: 256, Q5_K: 256,
                Q6_K: 256, IQ4_NL: 32, IQ4_XS: 256, IQ2_XXS: 256, IQ2_XS: 256, IQ2_S: 256, IQ3_XXS: 256, IQ3_S: 256,
                IQ1_S: 256, IQ1_M: 256, MXFP4: 32, TQ2_0: 256}
# fp16 scales (and minimums: Q4_1/Q5_1's m, the K-quants' dmin) in a block
SCALE_OFFSETS = {Q4_0: (0,), Q4_1: (0, 2), Q5_0: (0,), Q5_1: (0, 2), Q8_0: (0,), Q2_K: (80, 82), Q3_K: (108,),
                 Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,), IQ4_NL: (0,), IQ4_XS: (0,), IQ2_XXS: (0,), IQ2_XS: (0,),
                 IQ2_S: (0,), IQ3_XXS: (0,), IQ3_S: (0,), IQ1_S: (0,), IQ1_M: (),
                 MXFP4: (), TQ2_0: (64,)}  # IQ1_M's, and MXFP4's E8M0 exponent: _random_weights
WITH_MIN = {Q4_1, Q5_1}  # their activations are q8_1 rows: d, s = d * (sum of the values), values
# 256 .. 8960 values per row (the Qwen shapes; 896 and 4864 in the 0.5B draft; an odd block count, which IQ4_NL's
# one-token kernel ends in scalar code)
BLOCK_COUNTS = {256: (1, 6, 35), 32: (1, 27, 28, 152, 280)}
# the plain layout (SPECULANT_REPACK=0, and types nothing repacks on x86: Q8_0, Q5_0, Q4_1 as in SmolLM2, Q5_1,
# Q5_K as in Q5_K_M files, Q3_K as in Q3_K_M ones, IQ4_XS, Q2_K on AVX2, the IQ2/IQ3 types; IQ4_NL in rows not a
# multiple of 8)
# 16 columns per unpacking: the IQ2/IQ3 kernel (dot_iq_grid) and the IQ1 one (dot_iq1)
IQ_GRID = {IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M}
PLAIN = [Q4_K, Q5_K, Q6_K, Q8_0, Q5_0, Q4_0, Q4_1, Q5_1, Q3_K, IQ4_XS, IQ4_NL, Q2_K, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
         IQ3_S, IQ1_S, IQ1_M, MXFP4, TQ2_0]
# 8 rows at a time (how targets load on x86; IQ4_NL: K-quant rows of 896 or 576 values in IQ4_XS and IQ2/IQ3 files;
# MXFP4: a mixture of experts' expert matrices in MXFP4_MOE files, gpt-oss's)
REPACKED = [Q4_K, Q6_K, Q4_0, IQ4_NL, MXFP4, Q2_K]  # Q2_K: llama.cpp repacks it on AVX-512 CPUs only
KERNELS = [(False, t) for t in PLAIN] + [(True, t) for t in REPACKED]
KERNEL_IDS = [("repacked-" if r else "") + NAMES[t] for r, t in KERNELS]

TEST_ENTRY_ARGS = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]  # speculant_mm_test


class _Kernels:
    """A build's kernel test entry (speculant_mm_test), called like it, and how many tokens its kernels take
    per weight unpacking (speculant_mm_max_group)."""

    def __init__(self, lib):
        self.entry = lib.speculant_mm_test
        self.entry.restype = ctypes.c_int
        self.entry.argtypes = TEST_ENTRY_ARGS
        self._max_group = lib.speculant_mm_max_group
        self._max_group.restype = ctypes.c_int
        self._max_group.argtypes = [ctypes.c_int, ctypes.c_int]

    def __call__(self, *args):
        return self.entry(*args)

    def max_group(self, qtype, repacked) -> int:
        return self._max_group(int(qtype), int(repacked))


def _bind(lib):
    return _Kernels(lib)


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
    return _bind(ctypes.CDLL(str(native.lib_dir() / f"libggml-cpu-{variant}.so")))


def _random_weights(rng, qtype: int, nb: int) -> np.ndarray:
    """8 weight rows of nb random blocks with finite fp16 scales: [8, nb, block bytes]."""
    x = rng.integers(0, 256, (8, nb, BLOCK_BYTES[qtype]), dtype=np.uint8)
    for off in SCALE_OFFSETS[qtype]:
        scales = rng.uniform(-0.02, 0.02, (8, nb)).astype(np.float16)
        x[..., off:off + 2] = scales[..., None].view(np.uint8)
    if qtype == IQ1_M:  # its fp16 scale is the top nibbles of the four uint16 of scales (bytes 48..55)
        bits = rng.uniform(-0.02, 0.02, (8, nb)).astype(np.float16).view(np.uint16)
        sc = x[..., 48:56].copy().view(np.uint16)  # [8, nb, 4]
        for k in range(4):
            sc[..., k] = (sc[..., k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
        x[..., 48:56] = sc.view(np.uint8)
    if qtype == MXFP4:  # its scale is an E8M0 exponent (byte 0): 2^(e - 128) in the kernels; 2^-13 .. 2^-3 here
        x[..., 0] = rng.integers(115, 126, (8, nb), dtype=np.uint8)
    return x


def _random_columns(rng, qtype: int, ncols: int, nb: int) -> tuple[np.ndarray, np.ndarray]:
    """ncols quantized activation rows (q8_K for the K-quants, q8_1 for Q4_1 and Q5_1, q8_0 for the others) and
    their values as floats."""
    if BLOCK_VALUES[qtype] == 256:  # q8_K: float d, int8 qs[256], int16 bsums[16]
        d = rng.uniform(0.001, 0.05, (ncols, nb)).astype(np.float32)
        qs = rng.integers(-127, 128, (ncols, nb, 256)).astype(np.int8)
        bsums = qs.reshape(ncols, nb, 16, 16).sum(-1).astype(np.int16)
        raw = np.concatenate([d[..., None].view(np.uint8), qs.view(np.uint8), bsums.view(np.uint8)], axis=-1)
    else:  # q8_0: fp16 d, int8 qs[32]; q8_1: fp16 d, fp16 s, int8 qs[32]
        d = rng.uniform(0.001, 0.05, (ncols, nb)).astype(np.float16)
        qs = rng.integers(-127, 128, (ncols, nb, 32)).astype(np.int8)
        head = [d[..., None].view(np.uint8)]
        if qtype in WITH_MIN:  # as ggml's quantize_row_q8_1 sets it
            s = (d.astype(np.float32) * qs.astype(np.int32).sum(-1)).astype(np.float16)
            head.append(s[..., None].view(np.uint8))
        raw = np.concatenate(head + [qs.view(np.uint8)], axis=-1)
    values = (d.astype(np.float32)[..., None] * qs).reshape(ncols, -1)
    return np.ascontiguousarray(raw.reshape(ncols, -1)), values


def _mm(fn, qtype, repacked, x, y, ncols, group, reorder=0, with_ggml=False):
    """8 weight rows x ncols columns: ours [ncols, 8], and ggml's one-token kernel (None where ggml has none)."""
    x = np.ascontiguousarray(x)
    out = np.zeros((ncols, 8), np.float32)
    ggml = np.zeros((ncols, 8), np.float32)
    n = x.shape[-2] * BLOCK_VALUES[qtype]
    rc = fn(qtype, int(repacked), n, x.ctypes.data, y.ctypes.data, y.shape[1], ncols, group, reorder,
            out.ctypes.data, ggml.ctypes.data if with_ggml else None)
    if rc < 0 and fn.max_group(qtype, repacked) == 0:
        pytest.skip("this build's CPU variant has no invariant kernels (no AVX2)")
    if rc < 0 and repacked and qtype == Q2_K and fn.max_group(qtype, repacked) < 8:
        pytest.skip("llama.cpp repacks Q2_K on AVX-512 CPUs only (no kernel for it in a 256-bit build)")
    assert rc >= 0, f"no kernel for {NAMES[qtype]}{' repacked' if repacked else ''} in this build"
    return out, (ggml if with_ggml and rc == 0 else None)


@pytest.mark.parametrize("repacked,qtype", KERNELS, ids=KERNEL_IDS)
def test_multi_token_kernel_is_bit_identical_to_the_one_token_one(repacked, qtype):
    """Every column of a multi-token pass has the bits of the same column computed alone, and those are the bits
    of ggml's own one-token kernel for the layout (its AVX2 dot product; its gemv for repacked rows; repacked
    Q6_K has no ggml x86 kernel); and it is the right product (gguf's dequantization as the reference)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    fn = _kernel_lib()
    rng = np.random.default_rng(qtype + 100 * repacked)
    for nb in BLOCK_COUNTS[BLOCK_VALUES[qtype]]:
        x = _random_weights(rng, qtype, nb)
        y, yf = _random_columns(rng, qtype, 9, nb)
        single, ggml = _mm(fn, qtype, repacked, x, y, 9, group=1, with_ggml=True)
        if ggml is not None:
            assert single.tobytes() == ggml.tobytes(), f"{nb} blocks: one token differs from ggml's kernel"
        else:
            assert (repacked, qtype) == (True, Q6_K), "ggml's kernel should have been compared"
        assert fn.max_group(qtype, repacked) >= 4
        for group in range(2, min(fn.max_group(qtype, repacked), 9) + 1):  # 9 columns: full groups and a remainder
            # (the IQ1/IQ2/IQ3 kernels take up to 16 tokens: 9 is all in one unpacking)
            multi, _ = _mm(fn, qtype, repacked, x, y, 9, group=group)
            assert multi.tobytes() == single.tobytes(), f"{nb} blocks, {group} tokens at a time"
        w = dequantize(x.reshape(-1), GGMLQuantizationType(qtype)).reshape(8, -1).astype(np.float64)
        ref = yf.astype(np.float64) @ w.T
        np.testing.assert_allclose(single, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())


@pytest.mark.parametrize("qtype", REPACKED, ids=[NAMES[t] for t in REPACKED])
def test_plain_rows_of_a_repacked_type_give_the_repacked_bits(qtype):
    """Plain rows of a type llama.cpp repacks on this CPU (a model loaded with SPECULANT_REPACK=0; an RPC worker's
    layers, which RPC cannot repack) take the repacked kernels' arithmetic (mode 2 of the test entry is the path
    speculant_mm_rows takes for them): every token count and grouping gives the bits of the repacked rows, on every
    ISA level this CPU runs. So a model's logits do not depend on its weights' layout, and a split target's output
    is a local run's."""
    _kernel_lib()
    rng = np.random.default_rng(31 + qtype)
    ran = []
    for variant, lib in _isa_libs():
        fn = _bind(lib)
        if qtype == Q2_K and "avx512f" not in VARIANT_NEEDS[variant]:
            continue  # llama.cpp repacks Q2_K on AVX-512 CPUs only
        # 70 superblocks: rows of 17920 values, whose scales the Q4_K copy gathers in two parts
        for nb in BLOCK_COUNTS[BLOCK_VALUES[qtype]] + ((70,) if BLOCK_VALUES[qtype] == 256 else ()):
            x = _random_weights(rng, qtype, nb)
            for ncols in (1, 2, 3, 4, 5, 9, 17):
                y, _ = _random_columns(rng, qtype, ncols, nb)
                repacked, _ = _mm(fn, qtype, 1, x, y, ncols, group=fn.max_group(qtype, 1))
                for group in sorted({1, 3, fn.max_group(qtype, 1)}):
                    plain, _ = _mm(fn, qtype, 2, x, y, ncols, group=group)
                    assert plain.tobytes() == repacked.tobytes(), (variant, nb, ncols, group)
        ran.append(variant)
    assert ran


def test_the_plain_as_repacked_check_sees_a_reordered_sum():
    """The comparison above can fail: plain Q4_K and Q6_K rows summed in another order differ from the repacked bits."""
    fn = _kernel_lib()
    rng = np.random.default_rng(9)
    for qtype in (Q4_K, Q6_K):
        x = _random_weights(rng, qtype, 6)
        y, _ = _random_columns(rng, qtype, 4, 6)
        repacked, _ = _mm(fn, qtype, 1, x, y, 4, group=4)
        reordered, _ = _mm(fn, qtype, 2, x, y, 4, group=4, reorder=1)
        assert reordered.tobytes() != repacked.tobytes(), NAMES[qtype]
        np.testing.assert_allclose(reordered, repacked, rtol=1e-4, atol=1e-6 * np.abs(repacked).max())


def test_q8_0_q5_0_and_q4_0_rows_take_8_tokens_per_pass_with_avx512_vnni():
    """Where the variant has AVX-512 VNNI (icelake, zen4), plain Q8_0, Q5_0 and Q4_0 rows take up to 8 tokens per
    pass over the weights (two per 512-bit register; a 5-token verify pass of a Q8_0 target read its weights twice);
    the bits are checked above. Q4_1 and Q5_1 keep 4."""
    fn = _kernel_lib()
    wide = native.loaded_variant() in ("icelake", "zen4")
    for qtype in (Q8_0, Q5_0, Q4_0):
        assert fn.max_group(qtype, 0) == (8 if wide else 4), NAMES[qtype]
    assert fn.max_group(Q4_1, 0) == fn.max_group(Q5_1, 0) == 4


def test_the_batched_types_named_in_python_are_the_builds():
    """native.BATCHED_TYPES (what the warning about one-token-at-a-time targets trusts) is exactly the set of
    quantized types the build's plain-layout kernels take: every other type id gets -1 from the test entry."""
    from gguf import GGMLQuantizationType

    fn = _kernel_lib()
    if fn.max_group(Q4_K, 0) == 0:
        pytest.skip("this build's CPU variant has no invariant kernels (no AVX2)")
    x = np.zeros(64 * 1024, np.uint8)  # room for 8 rows of 256 values of any type; zero scales
    y = np.zeros(64 * 1024, np.uint8)
    taken = set()
    for t in GGMLQuantizationType:
        if t.name in native.FLOAT_TYPES:
            continue
        out = np.zeros((1, 8), np.float32)
        if fn(int(t), 0, 256, x.ctypes.data, y.ctypes.data, 4096, 1, 1, 0, out.ctypes.data, None) >= 0:
            taken.add(t.name)
    assert taken == native.BATCHED_TYPES


@pytest.mark.parametrize("repacked,qtype", [(False, Q8_0), (False, Q4_1), (True, Q4_0), (False, Q3_K)],
                         ids=["Q8_0", "Q4_1", "repacked-Q4_0", "Q3_K"])
def test_long_rows_and_many_tokens_outgrow_the_stack_scratch(repacked, qtype):
    """The per-call column data sits on the stack up to 48 KB and on the heap beyond: 400 blocks (12800 values)
    x 64 tokens needs the heap for both kernels (Q3_K's kernel keeps its column data in a per-thread buffer that
    grows: 400 superblocks x 64 tokens is 6.5 MB); the bits are those of ggml's one-token kernel all the same."""
    fn = _kernel_lib()
    rng = np.random.default_rng(21)
    x = _random_weights(rng, qtype, 400)
    y, _ = _random_columns(rng, qtype, 64, 400)
    multi, ggml = _mm(fn, qtype, repacked, x, y, 64, group=fn.max_group(qtype, repacked), with_ggml=True)
    assert multi.tobytes() == ggml.tobytes()


@pytest.mark.parametrize("repacked,qtype", KERNELS, ids=KERNEL_IDS)
def test_the_bit_identity_check_sees_a_reordered_sum(repacked, qtype):
    fn = _kernel_lib()
    rng = np.random.default_rng(7)
    nb = 6 if BLOCK_VALUES[qtype] == 256 else 28
    x = _random_weights(rng, qtype, nb)
    y, _ = _random_columns(rng, qtype, 8, nb)
    single, _ = _mm(fn, qtype, repacked, x, y, 8, group=1)
    reordered, _ = _mm(fn, qtype, repacked, x, y, 8, group=4, reorder=1)
    assert reordered.tobytes() != single.tobytes()
    np.testing.assert_allclose(reordered, single, rtol=1e-4, atol=1e-6 * np.abs(single).max())  # same sum


# -- doctor ---------------------------------------------------------------------------------------------------

def _q8_K_rows(rng) -> np.ndarray:
    """Activation rows for the Q8_K quantizer [rows, 512], with the cases its scalar reference decides one by one:
    ties of the largest magnitude (+a before -a and the other way), zero blocks, values that scale to exactly
    x.5 (ties to even), tiny and huge magnitudes, negative zeros."""
    rows = [rng.standard_normal(512).astype(np.float32) * s for s in (1e-3, 1.0, 37.0, 3e4)]
    tie = rng.standard_normal(512).astype(np.float32)
    tie[[5, 300]], tie[[77, 260]] = 9.0, -9.0  # block 0: +9 first; block 1: -9 first
    rows.append(tie)
    half = np.full(512, 0.5, np.float32)
    half[0], half[256] = -127.0, 127.0  # iscale +-1: every other value lands on x.5
    half[1:256] = np.arange(1, 256, dtype=np.float32) / 2 - 60
    rows.append(half)
    zero = rng.standard_normal(512).astype(np.float32)
    zero[:256] = 0.0
    zero[10] = -0.0
    rows.append(zero)
    return np.stack(rows)


def test_the_q8_K_quantizer_gives_the_reference_bits():
    """Activations for K-quant weights are quantized by our SIMD quantizer (x86 ggml runs the scalar reference):
    each ISA level's gives the reference's bytes (scale, values, block sums) on random and adversarial rows."""
    _kernel_lib()
    base = ctypes.CDLL(str(native.lib_dir() / "libggml-base.so"))
    base.quantize_row_q8_K_ref.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    rng = np.random.default_rng(5)
    rows = np.concatenate([_q8_K_rows(rng), rng.standard_normal((200, 512)).astype(np.float32)
                           * rng.uniform(1e-4, 1e3, (200, 1)).astype(np.float32)])
    block = 4 + 256 + 32  # block_q8_K: d, qs[256], bsums[16]
    ref = np.zeros((len(rows), 2 * block), np.uint8)
    for r in range(len(rows)):
        base.quantize_row_q8_K_ref(rows[r].ctypes.data, ref[r].ctypes.data, 512)
    ran = []
    for variant, lib in _isa_libs():
        out = np.zeros_like(ref)
        fn = lib.speculant_quantize_row_q8_K
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        for r in range(len(rows)):
            fn(rows[r].ctypes.data, out[r].ctypes.data, 512)
        bad = [r for r in range(len(rows)) if not np.array_equal(out[r], ref[r])]
        assert not bad, f"{variant}: rows {bad[:5]} differ from quantize_row_q8_K_ref"
        ran.append(variant)
    assert ran


def _extreme_q6_K_rows(rng, nb: int) -> np.ndarray:
    """8 Q6_K rows whose products scale * (q - 32) reach both ends of their range, [-4064, 4096]: every value 0 or
    63 and every scale -128 or 127, mixed with random blocks."""
    x = _random_weights(rng, Q6_K, nb)
    for r in range(8):
        ql, qh = (0x00, 0x00) if r % 2 else (0xFF, 0xFF)  # q = 0 or 63 throughout
        x[r, ::2, 0:128], x[r, ::2, 128:192] = ql, qh
        x[r, ::2, 192:208] = np.uint8(0x80 if r < 4 else 0x7F)  # scales -128 or 127
    return x


@pytest.mark.parametrize("qtype", [Q4_K, Q6_K, Q4_0, IQ4_NL, MXFP4], ids=["Q4_K", "Q6_K", "Q4_0", "IQ4_NL", "MXFP4"])
def test_amx_tile_products_give_the_bits_of_the_vnni_kernels(qtype):
    """Repacked Q4_K, Q6_K, Q4_0, IQ4_NL and MXFP4 rows in passes of many tokens go through AMX tile products where
    the CPU has AMX: each row's result equals the VNNI kernel's, bit for bit, on every AVX-512 build this CPU runs,
    and ggml's one-token gemv's too (but for Q6_K: ggml has no x86 kernel for its repacked rows); rows of 1, 6 and 35
    blocks (the 32-value types also 7 and 28: an odd count, as their tiles take blocks in pairs, and the draft's 896
    values); 16-48 rows; tokens filling tiles of 16 exactly, partly and not at all; Q6_K weights at both ends of their
    range, the 32-value types' at both ends of their tables."""
    _kernel_lib()
    rng = np.random.default_rng(11 + qtype)
    ran = []
    for variant, lib in _isa_libs():
        amx = lib.speculant_mm_amx_test
        amx.restype = ctypes.c_int
        amx.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        fn = _bind(lib)
        cases = [(1, 16, 1), (1, 48, 64), (6, 16, 14), (6, 48, 16), (6, 16, 17), (6, 32, 33), (35, 16, 64), (35, 32, 5)]
        if BLOCK_VALUES[qtype] == 32:
            cases += [(7, 32, 24), (28, 16, 64)]
        for nb, nrows, ncols in cases:
            groups = [_random_weights(rng, qtype, nb) for _ in range(nrows // 8)]
            if qtype == Q6_K:
                groups[-1] = _extreme_q6_K_rows(rng, nb)
            if BLOCK_VALUES[qtype] == 32:  # every nibble 0 or 15 (Q4_0: -8 and 7, after its XOR 8: 0 and -1)
                head = 1 if qtype == MXFP4 else 2  # the scale's bytes
                groups[-1][..., head:] = rng.choice(np.array([0x00, 0xFF, 0x0F, 0xF0], np.uint8),
                                                    groups[-1][..., head:].shape)
            x = np.concatenate(groups)  # [nrows, nb, block bytes]
            y, _ = _random_columns(rng, qtype, ncols, nb)
            if qtype == Q6_K:  # q8 values at their ends too, in a token of its own
                y3 = y.reshape(ncols, nb, -1)
                y3[0, :, 4:260] = np.where(np.arange(256) % 2, 127, -127).astype(np.int8).view(np.uint8)
                y3[0, :, 260:] = 0  # its block sums (16 values each)
            out_amx = np.zeros((ncols, nrows), np.float32)
            out_ref = np.zeros((ncols, nrows), np.float32)
            rc = amx(qtype, nb * BLOCK_VALUES[qtype], nrows, x.ctypes.data, y.ctypes.data, y.shape[1], ncols, out_amx.ctypes.data,
                     out_ref.ctypes.data)
            if rc == -1:
                break  # no AMX kernel in this build (AVX2) or no AMX on this CPU
            assert rc == 0, f"{variant}: the AMX kernel did not run (out of memory?)"
            assert out_amx.tobytes() == out_ref.tobytes(), (variant, nb, nrows, ncols)
            for g in range(nrows // 8):  # and ggml's gemv, 8 rows at a time
                if qtype != Q6_K:
                    _, ggml = _mm(fn, qtype, True, x[8 * g:8 * g + 8], y, ncols, group=1, with_ggml=True)
                    assert out_amx[:, 8 * g:8 * g + 8].tobytes() == ggml.tobytes(), (variant, nb, nrows, ncols, g)
        else:
            ran.append(variant)
    if not ran:
        pytest.skip("no AMX on this CPU (or Linux does not grant its tile state)")


def test_the_softmax_maximum_is_the_largest_score_on_every_isa_level():
    """The softmax's maximum, taken 16 or 8 lanes at once in 4 chains plus a scalar tail, is the largest score for
    every length (masked scores are -inf) on each ISA level's build: the AVX2 one runs on AMD days."""
    _kernel_lib()
    rng = np.random.default_rng(3)
    ran = []
    for variant, lib in _isa_libs():
        fn = lib.speculant_vec_max_f32
        fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_int, ctypes.c_void_p]
        for n in [*range(1, 140), 255, 256, 257, 2047]:
            x = (rng.standard_normal(n) * 10).astype(np.float32)
            x[rng.random(n) < 0.3] = -np.inf
            assert fn(n, x.ctypes.data) == x.max(), (variant, n)
        ran.append(variant)
    assert ran


def test_doctor_prints_every_fact():
    proc = subprocess.run([sys.executable, "-m", "speculant", "doctor", "--json"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, _explain(proc)
    facts = json.loads(proc.stdout)
    for key in ("speculant", "cpu", "cpu_features", "cores", "threads", "llama.cpp", "torch", "transformers",
                "gpu", "models"):
        assert key in facts, key
    ll = facts["llama.cpp"]
    for key in ("llama_cpp_python", "build", "llama_cpp_commit", "variant", "kernel_features", "exactness", "amx"):
        assert key in ll, key
    assert facts["models"].get("smollm2-135m-instruct") or not models.cached_path("smollm2-135m-instruct").exists()
    screen = subprocess.run([sys.executable, "-m", "speculant", "doctor"], capture_output=True, text=True,
                            timeout=300).stdout
    for label in ("cpu ", "cpu features", "llama.cpp", "variant", "kernels", "exactness", "amx", "torch", "gpu",
                  "models"):
        assert label in screen, label


VARIANT_NEEDS = {"haswell": {"avx2", "fma"}, "skylakex": {"avx512f", "avx512bw"},
                 "icelake": {"avx512f", "avx512vbmi", "avx512_vnni"}, "zen4": {"avx512f", "avx512_bf16"}}


@pytest.mark.parametrize("repacked,qtype", KERNELS, ids=KERNEL_IDS)
def test_every_isa_level_gives_the_same_bits(repacked, qtype):
    """256-bit (haswell: maddubs) and 512-bit (skylakex without VNNI; icelake and zen4 with it) kernels compute the
    same integers and the same float sequence: the same logits on any machine."""
    _kernel_lib()
    rng = np.random.default_rng(11)
    nb = 6 if BLOCK_VALUES[qtype] == 256 else 28
    x = _random_weights(rng, qtype, nb)
    y, _ = _random_columns(rng, qtype, 9, nb)
    results = {}
    for variant, lib in _isa_libs():
        fn = _bind(lib)
        if repacked and qtype == Q2_K and "avx512f" not in VARIANT_NEEDS[variant]:
            continue  # llama.cpp repacks Q2_K on AVX-512 CPUs only
        groups = sorted({1, 4, fn.max_group(qtype, repacked)})  # AVX-512 kernels take 8 repacked tokens at a time
        outs = {_mm(fn, qtype, repacked, x, y, 9, group=g)[0].tobytes() for g in groups}
        assert len(outs) == 1, f"{variant}: {groups} tokens at a time differ"
        results[variant] = outs.pop()
    if len(results) < 2:
        pytest.skip("fewer than two kernel ISA levels run on this CPU")
    first = next(iter(results.values()))
    assert all(r == first for r in results.values()), {v: r == first for v, r in results.items()}


def test_unbatched_weights_count_the_types_without_kernels(tmp_path):
    """The share the warning reads: matrices of a type without a multi-token kernel (TQ1_0) count, Q2_K does not
    in either layout (plain; repacked 8 rows at a time as llama.cpp does on AVX-512 CPUs, q2_Kx8_cols), nor do
    the token embeddings of an untied model (row lookups, no matmul)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    path = tmp_path / "mixed.gguf"
    writer = GGUFWriter(str(path), "llama")
    for name, rows, qtype in (("blk.0.ffn_up.weight", 8, Q2_K), ("blk.0.ffn_down.weight", 4, Q2_K),
                              ("blk.0.attn_q.weight", 8, TQ1_0), ("token_embd.weight", 8, TQ1_0),
                              ("output.weight", 8, Q4_K)):
        writer.add_tensor(name, np.zeros((rows, BLOCK_BYTES[qtype]), np.uint8), raw_dtype=GGMLQuantizationType(qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    share, slow = native.unbatched_weights(path)
    assert slow == {"TQ1_0": 8 * BLOCK_BYTES[TQ1_0]}
    assert share == pytest.approx(8 * BLOCK_BYTES[TQ1_0] / (12 * BLOCK_BYTES[Q2_K] + 8 * BLOCK_BYTES[TQ1_0]
                                                            + 8 * BLOCK_BYTES[Q4_K]))


def test_unbatched_weights_count_a_mixture_of_experts_expert_matrices_by_type(tmp_path):
    """Expert matrices ([n_embd, n_ff, n_expert]) go through llama.cpp's mul_mat_id, where our kernels take each
    expert's tokens together (test_llamacpp checks the bits): they count as any matrix of their type. Q4_K experts
    verify at batch cost; TQ1_0 ones (no multi-token kernel) do not, and the warning names them."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from speculant import api
    from speculant.backends.llamacpp import LlamaCppBackend

    def moe(name, expert_type):
        path = tmp_path / name
        writer = GGUFWriter(str(path), "qwen3moe")
        for tensor, shape, qtype in (("blk.0.ffn_up_exps.weight", (4, 8, 1), expert_type),
                                     ("blk.0.attn_q.weight", (8, 1), Q4_K), ("output.weight", (8, 1), Q6_K)):
            writer.add_tensor(tensor, np.zeros((*shape[:-1], BLOCK_BYTES[qtype] * shape[-1]), np.uint8),
                              raw_dtype=GGMLQuantizationType(qtype))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    class Target(LlamaCppBackend):  # only what the warning reads
        def __init__(self, path):
            self.path, self.repack, self.name = path, True, "moe"

    batched = moe("q4_k.gguf", Q4_K)
    assert native.unbatched_weights(batched) == (0.0, {})
    assert api.warn_unbatched_weights(Target(batched)) is None
    slow_experts = moe("tq1_0.gguf", TQ1_0)
    experts = 32 * BLOCK_BYTES[TQ1_0]
    share, slow = native.unbatched_weights(slow_experts)
    assert slow == {"TQ1_0": experts}
    assert share == pytest.approx(experts / (experts + 8 * BLOCK_BYTES[Q4_K] + 8 * BLOCK_BYTES[Q6_K]))
    message = api.warn_unbatched_weights(Target(slow_experts))
    assert message and "are TQ1_0, which" in message and "Q4_K_M" in message


def test_gguf_tensors_read_what_gguf_py_reads_and_refuse_a_damaged_file(tmp_path):
    """The fast tensor list (ggml's parser, used at every model load) equals gguf-py's reader on a real model and on
    a synthetic file with 1-, 2- and 3-dimensional tensors; metadata cut short is a ModelError, not a crash."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

    from speculant.errors import ModelError

    synthetic = tmp_path / "shapes.gguf"
    writer = GGUFWriter(str(synthetic), "llama")
    writer.add_tensor("norm.weight", np.ones(64, np.float32))
    writer.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((4, 8, BLOCK_BYTES[Q4_K]), np.uint8),
                      raw_dtype=GGMLQuantizationType(Q4_K))
    writer.add_tensor("output.weight", np.zeros((8, 2 * BLOCK_BYTES[Q6_K]), np.uint8), raw_dtype=GGMLQuantizationType(Q6_K))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for path in (models.resolve(models.DEFAULT_DRAFT), synthetic):
        expected = [(t.name, t.tensor_type.name, [int(x) for x in t.shape], int(t.n_bytes),
                     int(t.data_offset + t.n_bytes)) for t in GGUFReader(path, "r").tensors]
        assert [tuple(t) for t in native.gguf_tensors(path)] == expected
    assert [t.shape for t in native.gguf_tensors(synthetic)] == [[64], [256, 8, 4], [512, 8]]
    assert native.gguf_block_count(models.resolve(models.DEFAULT_DRAFT)) == 24  # Qwen2.5 0.5B
    draft = models.resolve(models.DEFAULT_DRAFT)
    fields = GGUFReader(draft, "r").fields
    keys = ["general.architecture", "qwen2.block_count", "qwen2.rope.freq_base", "general.file_type",
            "tokenizer.ggml.eos_token_id", "tokenizer.ggml.token_type", "tokenizer.ggml.add_bos_token"]
    meta = native.gguf_metadata(draft, keys + ["no.such.key", "tokenizer.ggml.tokens"])  # strings: left out
    assert sorted(meta) == sorted(keys)
    for key in keys:
        expected = fields[key].contents()
        assert meta[key] == (pytest.approx(expected) if isinstance(expected, float) else expected), key
    with pytest.raises(ModelError, match="no integer llama.block_count"):
        native.gguf_block_count(synthetic)
    cut = tmp_path / "cut.gguf"
    with open(models.resolve(models.DEFAULT_DRAFT), "rb") as f:
        cut.write_bytes(f.read(1_000_000))  # ends inside the vocabulary
    with pytest.raises(ModelError, match="not a readable GGUF") as raised:
        native.gguf_tensors(cut)
    assert "gguf_init_from" in str(raised.value)  # ggml's own reason, kept from its log (not printed raw)
    with pytest.raises(ModelError, match="corrupt or truncated.*gguf_init_from"):
        models.check_gguf(cut)


def test_header_reads_in_threads_leave_ggml_logging_to_a_live_logger(tmp_path):
    """Reading GGUF headers swaps ggml's logger for one that keeps the parser's complaint. Two threads doing it at
    once once restored each other's: ggml was left calling a freed ctypes callback, and the next model load in the
    process died in a segfault at its first log line (the CI's gemma-3-270m load, after test_batching's threads).
    Now the logger before is back after any interleaving, and a line another thread logs meanwhile reaches it."""
    import threading

    from speculant.backends import llamacpp  # noqa: F401  (its logger is the one installed)
    from speculant.errors import ModelError

    g = native._ggml_base()

    def logger():
        cb, data = ctypes.c_void_p(), ctypes.c_void_p()
        g.ggml_log_get(ctypes.byref(cb), ctypes.byref(data))
        return cb.value, data.value

    before = logger()
    draft = models.resolve(models.DEFAULT_DRAFT)
    cut = tmp_path / "cut.gguf"
    with open(draft, "rb") as f:
        cut.write_bytes(f.read(1_000_000))  # fails in the parser, which logs why
    errors = []

    def reads():
        try:
            for _ in range(40):
                native.gguf_block_count(draft)
                with pytest.raises(ModelError, match="gguf_init_from"):  # each thread keeps its own complaint
                    native.gguf_tensors(cut)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=reads) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert logger() == before  # not another thread's freed callback
    assert not errors

    # a line logged by another thread while this one keeps its own goes to the logger before, not into the list
    def parse_cut():
        assert not g.gguf_init_from_file(str(cut).encode(), native._GGUFInitParams(True, None))

    with native._ggml_log_kept(g) as alone:
        parse_cut()
    assert any("gguf_init_from" in line for line in alone)
    seen = []  # a logger of the test's own in place of the one before, for the other thread's lines
    own = native._GGML_LOG_CALLBACK(lambda level, text, data: seen.append(text.decode()))
    g.ggml_log_set(ctypes.cast(own, ctypes.c_void_p), None)
    try:
        with native._ggml_log_kept(g) as kept:
            t = threading.Thread(target=parse_cut)
            t.start()
            t.join(30)
            parse_cut()
    finally:
        g.ggml_log_set(*before)
    assert kept == alone and seen == alone
    assert logger() == before


def test_a_failed_load_names_its_own_cause_while_other_threads_log_errors(tmp_path, monkeypatch):
    """llama.cpp's log is one stream for the process, and error messages quote its last error line: a load that
    fails names the cause its own thread logged, not an error another thread logs meanwhile (the server's slots,
    a draft loading beside its target), nor "no details" once their lines have pushed its own out. Here another
    thread logs 300 error lines between llama.cpp's failed load and the message being written."""
    import threading

    import gguf

    from speculant.backends import llamacpp
    from speculant.errors import ModelError

    path = tmp_path / "fooarch.gguf"
    writer = gguf.GGUFWriter(str(path), "fooarch")  # well formed, an architecture llama.cpp does not know
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    load = llamacpp.ll.llama_model_load_from_file

    def load_then_another_thread_logs(*args):
        model = load(*args)

        def other_thread():
            for _ in range(300):
                llamacpp._log_callback(2, b"llama_model_load: error loading model: another thread's cause\n", None)
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        return model

    monkeypatch.setattr(llamacpp.ll, "llama_model_load_from_file", load_then_another_thread_logs)
    with pytest.raises(ModelError) as raised:
        llamacpp.LlamaCppBackend(path, n_ctx=64)
    assert "unknown model architecture: 'fooarch'" in str(raised.value)


def test_ggml_calls_reach_the_copy_libllama_linked():
    """The wheel holds libggml-base.so and libggml-base.so.0 as copies; loading the other name (llama_cpp._ggml
    does) maps a second ggml with a logger and backend registry of its own. Our ggml calls must reach libllama's
    copy whatever else is mapped: they once took the first match in /proc/self/maps, which moved with ASLR."""
    from speculant.backends import llamacpp

    for name in ("libggml-base.so", "libggml.so"):
        ctypes.CDLL(str(native.lib_dir() / name))  # the other copies, mapped as llama_cpp._ggml maps them
    native._ggml_base.cache_clear()
    native._ggml.cache_clear()
    try:
        cb, data = ctypes.c_void_p(), ctypes.c_void_p()
        native._ggml_base().ggml_log_get(ctypes.byref(cb), ctypes.byref(data))
        assert cb.value == ctypes.cast(llamacpp._log_callback, ctypes.c_void_p).value
        assert "CPU" in native.backend_names()  # the registry libllama's loads filled
    finally:
        native._ggml_base.cache_clear()
        native._ggml.cache_clear()
