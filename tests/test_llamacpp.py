"""Real models through llama.cpp: batch invariance, greedy identity, cache consistency, structure."""

import contextlib
import dataclasses

import numpy as np
import pytest

from speculant import native
from speculant.drafters.model import ModelDrafter
from speculant.backends.base import common_prefix
from speculant.engine import Engine
from speculant.stats import SpecStats
from speculant.verify import SamplingParams
from speculant.vocab import check_compatible

PROMPTS = {
    "code": "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "translation": "Translate into German: The library opens at nine and closes at six on weekdays.",
    "math": "A train travels 180 km in 2.5 hours. What is its average speed? Explain step by step.",
    "story": "Write the opening paragraph of a story about a lighthouse keeper who finds a strange map.",
}


def _batch_vs_single(backend, text, sizes, offsets=(4,)):
    """Largest |logit difference| between passes of each size and one-token passes, at each cache offset."""
    toks = backend.tokenize(text)
    assert len(toks) >= max(offsets) + max(sizes), "text too short for these passes"
    backend.rewind(0)
    backend.eval(toks[:min(offsets)], n_logits=0)
    reach = max(offsets) + max(sizes)  # one-token passes only as far as the batched ones go
    single = {min(offsets) + i: backend.eval([t])[0] for i, t in enumerate(toks[min(offsets):reach])}  # pos -> [V]
    worst = 0.0
    for offset in offsets:
        for size in sizes:
            backend.rewind(offset)
            while len(backend.tokens) < offset:  # refill in invariant passes (<= 64 tokens)
                backend.eval(toks[len(backend.tokens):min(offset, len(backend.tokens) + 64)], n_logits=0)
            batched = backend.eval(toks[offset:offset + size], n_logits=size)
            expected = np.stack([single[offset + i] for i in range(size)])
            worst = max(worst, float(np.abs(batched - expected).max()))
    return worst


LONG_TEXT = ("def add(a, b):\n    return a + b\n\n# Translate: Der Hund schläft im Garten, weil es warm ist.\n"
             + "Once upon a time, in a small village by the sea, there lived an old lighthouse keeper. " * 20)


def test_every_pass_size_up_to_the_invariant_limit_is_bit_identical_smollm2(small_target):
    """Verify and decode passes (1..64 tokens) at two cache offsets, one crossing a 256-position boundary."""
    assert small_target.invariant_rows >= 64
    assert _batch_vs_single(small_target, LONG_TEXT, range(1, 65), offsets=(4, 230)) == 0.0


def test_pass_sizes_are_bit_identical_smollm2(small_target):
    """The CI's cut of the test above: every size a verify pass takes (1..17), then sizes that end inside and on
    the kernels' 4-, 8-, 16- and 64-column tiles, at the same two offsets."""
    assert _batch_vs_single(small_target, LONG_TEXT, list(range(1, 18)) + [24, 31, 33, 48, 63, 64],
                            offsets=(4, 230)) == 0.0


def test_pass_sizes_are_bit_identical_qwen(qwen_target):
    """The Qwen target's Q4_K/Q6_K weights, repacked 8 rows at a time, go through our multi-token kernels
    (native/src/speculant-mm.c); where the CPU has AMX, its Q4_K and Q6_K rows in passes of 8 tokens or more go through
    tile products."""
    assert qwen_target.repack
    sizes = list(range(1, 18)) + [24, 33, 48, 64]
    assert _batch_vs_single(qwen_target, LONG_TEXT, sizes, offsets=(4, 230)) == 0.0


def test_pass_sizes_are_bit_identical_qwen_unrepacked():
    """SPECULANT_REPACK=0 (mmapped, unrepacked weights): our plain-layout kernels are invariant too."""
    from conftest import TARGET, _backend

    b = _backend(TARGET, n_ctx=512, repack=False)
    try:
        assert _batch_vs_single(b, LONG_TEXT, [1, 2, 3, 4, 5, 8, 16, 33, 64], offsets=(4,)) == 0.0
    finally:
        b.close()


def test_repacked_weights_compute_what_the_file_holds(qwen_target):
    """The weights repacked at load (ggml's repack, then our Q6_K order) against the file's own layout, unrepacked.
    By default plain rows keep ggml's dot-product arithmetic: the float sums run in another order, which over 28
    layers moves the logits by 0.07 on average (a weight read from the wrong place would move them by whole units
    and change the top token almost everywhere). With plain_as_repacked on (RPC workers and the process driving them)
    plain Q4_K and Q6_K rows take the repacked kernels' float steps (one token: rep1_rows; more: our own copy of the
    repacked layout, made per pass), and the logits of a prompt, one token and a verify pass are the same bits."""
    from conftest import TARGET, _backend

    toks = qwen_target.tokenize(LONG_TEXT)[:40]

    def logits(b):
        b.rewind(0)
        prompt = b.eval(toks[:24], n_logits=24)
        one = b.eval(toks[24:25], n_logits=1)
        verify = b.eval(toks[25:33], n_logits=8)
        return np.concatenate([prompt, one, verify])

    plain = _backend(TARGET, n_ctx=512, repack=False)
    try:
        expected = logits(plain)
        with native.plain_as_repacked() as switched:
            assert switched
            as_repacked = logits(plain)
    finally:
        plain.close()
    got = logits(qwen_target)
    assert np.abs(got - expected).mean() < 0.2
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.9
    assert got.tobytes() != expected.tobytes()
    assert got.tobytes() == as_repacked.tobytes(), float(np.abs(got - as_repacked).max())


def test_pass_sizes_are_bit_identical_qwen_draft(qwen_draft_shipped):
    """The shipped 0.5B file's rows (896 values) cannot hold K-quant superblocks: most of its weights are Q5_0
    and Q8_0, which go through our plain-layout 32-value kernels."""
    sizes = [1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 64]
    assert _batch_vs_single(qwen_draft_shipped, LONG_TEXT, sizes, offsets=(4, 230)) == 0.0


@pytest.fixture(scope="module")
def small_requantized(tmp_path_factory):
    """SmolLM2 requantized by llama.cpp's quantizer to each 32-value type our kernels take, and to IQ3_S,
    IQ2_XXS, IQ1_M (an importance matrix made up for these two) and TQ2_0 (in these four, the ffn_down rows of
    1536 values; the other rows, of 576, fall back to other types): qtype -> path, made on first use (the CI's
    suite runs some types only)."""
    from conftest import small_imatrix_entries, write_imatrix
    from speculant import models, quantize

    src = models.cached_path("smollm2-135m-instruct")
    if not src.exists():
        pytest.skip("smollm2-135m-instruct not pulled (run `make models`)")
    out = tmp_path_factory.mktemp("requantized")
    imatrix = out / "smollm2.imatrix.gguf"
    write_imatrix(imatrix, small_imatrix_entries())

    def made(qtype):
        path = out / f"smollm2-{qtype}.gguf"
        if not path.exists():
            quantize.make(src, path, quantize.file_type(qtype), allow_requantize=True, progress=False,
                          imatrix=imatrix if qtype in quantize.NEEDS_IMATRIX else None)
        return path
    return made


@pytest.mark.parametrize("qtype,repack", [("Q8_0", True), ("Q5_0", True), ("Q4_0", True), ("Q4_0", False),
                                          ("Q5_1", True), ("IQ4_NL", True), ("IQ4_NL", False), ("IQ3_S", True),
                                          ("IQ2_XXS", True), ("IQ1_M", True), ("TQ2_0", True)])
def test_pass_sizes_are_bit_identical_other_weight_types(small_requantized, qtype, repack):
    """Q8_0, Q5_0 and Q5_1 (plain layout), Q4_0 and IQ4_NL repacked 8 rows at a time (llama.cpp's layout on x86)
    and unrepacked, IQ3_S and IQ2_XXS (one kernel for the IQ2 and IQ3 types), IQ1_M (one for IQ1_S and IQ1_M),
    TQ2_0 (ternary; its ffn_down rows; test_native checks each type against ggml's kernel): every pass size up to
    the invariant limit gives a token the bits of its one-token pass. (The shipped SmolLM2 file is Q4_1: the tests
    above.)"""
    from gguf import GGUFReader

    from speculant.backends.llamacpp import LlamaCppBackend

    path = small_requantized(qtype)
    # IQ2_XXS, IQ1_M: not the first 3
    matrix = "blk.3.ffn_down.weight" if qtype in ("IQ3_S", "IQ2_XXS", "IQ1_M", "TQ2_0") else "blk.0.ffn_up.weight"
    assert {t.name: t.tensor_type.name for t in GGUFReader(path, "r").tensors}[matrix] == qtype
    b = LlamaCppBackend(path, n_ctx=512, repack=repack)
    try:
        sizes = [1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 64]
        assert _batch_vs_single(b, LONG_TEXT, sizes, offsets=(4, 230)) == 0.0
    finally:
        b.close()


def _smollm2_as_moe(src, dst, qtype: str, n_layer: int = 8, n_expert: int = 4, n_used: int = 2, seed: int = 0,
                    noise: float = 0.5):
    """SmolLM2's first n_layer layers rebuilt as a mixture of experts, the llama architecture with
    llama.expert_count (as Mixtral): each feed-forward becomes n_expert experts (its own weights plus noise of
    `noise` times their standard deviation, quantized to qtype) behind a random router, n_used of them per token.
    Attention, norms and embeddings stay the file's. With noise 0 every expert is the dense feed-forward, so the
    router's choices (near ties here, which rounding can flip) change nothing."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(seed)
    reader = GGUFReader(str(src))
    writer = GGUFWriter(str(dst), "llama")
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        value = n_layer if field.name == "llama.block_count" else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None)
    writer.add_expert_count(n_expert)
    writer.add_expert_used_count(n_used)
    for t in reader.tensors:
        part = t.name.split(".")
        if part[0] == "blk" and int(part[1]) >= n_layer:
            continue
        if len(part) == 4 and part[2] in ("ffn_gate", "ffn_up", "ffn_down"):
            w = dequantize(t.data, t.tensor_type).reshape(int(t.shape[1]), int(t.shape[0]))  # [rows, cols]
            experts = w[None] + rng.normal(0, w.std() * noise, (n_expert, *w.shape)).astype(np.float32)
            qt = GGMLQuantizationType[qtype]
            writer.add_tensor(f"blk.{part[1]}.{part[2]}_exps.weight", quantize(experts, qt), raw_dtype=qt)
            if part[2] == "ffn_gate":
                router = rng.normal(0, 0.05, (n_expert, w.shape[1])).astype(np.float32)
                writer.add_tensor(f"blk.{part[1]}.ffn_gate_inp.weight", router)
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """{file type: path} of _smollm2_as_moe for Q4_0 experts (repacked on x86), Q8_0 (not), the Q8_0 file
    requantized to MXFP4_MOE (MXFP4 experts, gpt-oss's type, repacked on x86; the rest Q8_0), and to Q4_K_M: Q4_K
    and Q6_K ffn_down experts (rows of 1536 values: whole K-quant superblocks), which llama.cpp's tiled K-quant
    kernel takes once 8 or more of a pass's tokens go to one expert."""
    from speculant import quantize

    from speculant import models

    src = models.cached_path("smollm2-135m-instruct")
    if not src.exists():
        pytest.skip("smollm2-135m-instruct not pulled (run `make models`)")
    out = tmp_path_factory.mktemp("moe")
    made = {qtype: _smollm2_as_moe(src, out / f"smollm2-moe-{qtype}.gguf", qtype) for qtype in ("Q4_0", "Q8_0")}
    made["MXFP4"] = out / "smollm2-moe-MXFP4.gguf"  # as a user makes one: speculant quantize ... MXFP4_MOE
    quantize.make(made["Q8_0"], made["MXFP4"], quantize.file_type("MXFP4_MOE"), allow_requantize=True, progress=False)
    made["Q4_K_M"] = out / "smollm2-moe-Q4_K_M.gguf"
    quantize.make(made["Q8_0"], made["Q4_K_M"], quantize.file_type("Q4_K_M"), allow_requantize=True, progress=False)
    same = _smollm2_as_moe(src, out / "smollm2-moe-same-Q8_0.gguf", "Q8_0", noise=0.0)
    made["Q4_K_M same experts"] = out / "smollm2-moe-same-Q4_K_M.gguf"
    quantize.make(same, made["Q4_K_M same experts"], quantize.file_type("Q4_K_M"), allow_requantize=True,
                  progress=False)
    return made


@pytest.mark.parametrize("ftype,repack", [("Q4_0", True), ("Q8_0", True), ("Q4_0", False), ("Q4_K_M", True),
                                          ("Q4_K_M", False), ("MXFP4", True), ("MXFP4", False)])
def test_pass_sizes_are_bit_identical_mixture_of_experts(moe_models, ftype, repack):
    """A mixture-of-experts target (SmolLM2's first 8 layers rebuilt with 4 experts each, 2 used per token:
    _smollm2_as_moe): its expert matrices go through llama.cpp's mul_mat_id (per token, the gemv of repacked
    rows or the dot product of plain ones), its router through softmax and top-k, per token. Unrepacked K-quant
    experts (Q4_K_M, SPECULANT_REPACK=0; on AVX2 also Q3_K, Q5_K and the IQ types, which nothing repacks) went to
    llama.cpp's tiled kernel once 8 of a pass's tokens chose one expert, rounding otherwise: our build keeps
    passes of up to 64 tokens off it. Every pass size gives a token the bits of its one-token pass, so
    speculation on a MoE target is exact too."""
    from gguf import GGUFReader

    from speculant.backends.llamacpp import LlamaCppBackend

    path = moe_models[ftype]
    held = {t.name: (t.tensor_type.name, [int(x) for x in t.shape]) for t in GGUFReader(path, "r").tensors}
    up, down = held["blk.0.ffn_up_exps.weight"], held["blk.0.ffn_down_exps.weight"]
    assert up[1] == [576, 1536, 4] and down[1] == [1536, 576, 4]
    assert (up[0], down[0]) == ((ftype, ftype) if ftype != "Q4_K_M" else ("Q5_0", "Q6_K"))
    b = LlamaCppBackend(path, n_ctx=512, repack=repack)
    try:
        assert b.n_vocab == 49152
        sizes = [1, 2, 3, 4, 5, 7, 8, 9, 16, 33, 64]
        assert _batch_vs_single(b, LONG_TEXT, sizes, offsets=(4, 230)) == 0.0
        b.rewind(0)
        assert np.isfinite(b.eval(b.tokenize("The capital of France is"))[-1]).all()
    finally:
        b.close()


def test_repacked_experts_compute_the_product_of_plain_ones(moe_models):
    """Expert matrices repacked 8 rows at a time (the Q4_K_M file's Q4_K and Q6_K down experts; Q6_K in the order
    only our kernels read) give the logits of the same file run unrepacked, within rounding. Every expert here is
    the dense feed-forward, so the router's near ties, which rounding can flip, change nothing. Before our kernels
    took llama.cpp's mul_mat_id, its generic gemv read those Q6_K experts in ggml's order: max diff ~60 of ~80, the
    top token the same at 1 position in 14. (Rounding alone moves this small model's logits by up to ~1.3: plain
    expert rows round as ggml's vec_dot, repacked ones as its gemv.)"""
    from speculant.backends.llamacpp import LlamaCppBackend

    logits = {}
    for repack in (False, True):
        b = LlamaCppBackend(moe_models["Q4_K_M same experts"], n_ctx=512, repack=repack)
        try:
            tokens = b.tokenize(LONG_TEXT)[:200]  # ~100 tokens per expert: repacked ones take 64 at a time
            logits[repack] = b.eval(tokens, n_logits=len(tokens))  # [200, n_vocab]
        finally:
            b.close()
    assert (logits[True].argmax(-1) == logits[False].argmax(-1)).mean() >= 0.9
    assert np.abs(logits[True] - logits[False]).max() < 0.05 * np.abs(logits[False]).max()


@pytest.mark.parametrize("ftype,expected", [
    ("Q3_K_M", {"blk.0.ffn_up.weight": "Q3_K", "blk.0.ffn_down.weight": "Q5_K", "blk.0.attn_output.weight": "Q4_K"}),
    ("Q2_K", {"blk.0.ffn_up.weight": "Q2_K", "blk.0.ffn_down.weight": "Q3_K", "blk.0.attn_v.weight": "Q4_K"}),
])
def test_pass_sizes_are_bit_identical_low_bit_k_quants(tmp_path_factory, ftype, expected):
    """Q3_K_M and Q2_K, the Qwen target requantized (its rows hold whole 256-value superblocks; SmolLM2's 576 do
    not). Q3_K_M: Q3_K for most matrices, Q4_K (repacked), Q5_K (as in Q5_K_M files, the most used K-quant after
    Q4_K_M) for the first layers' attn_v and ffn_down. Q2_K: Q2_K for most, Q3_K, Q4_K. (Q6_K, the output layer's
    type, is made Q8_0 here.) One token takes ggml's own Q2_K and Q5_K loops (Q3_K's too, without VNNI), more take
    ours: the same bits either way. (IQ4_XS, the other 256-value type our kernels take, is checked against ggml's
    kernel in test_native only: quantizing the target to it takes 5 minutes here.)"""
    from gguf import GGUFReader

    from conftest import TARGET
    from speculant import models, quantize
    from speculant.backends.llamacpp import LlamaCppBackend

    src = models.cached_path(TARGET)
    if not src.exists():
        pytest.skip(f"{TARGET} not pulled (run `make models`)")
    path = tmp_path_factory.mktemp(ftype.lower()) / f"qwen-{ftype.lower()}.gguf"
    q8_0 = quantize.tensor_type("Q8_0", "test")  # embedding and output layer: quick to make, and not what is tested here
    quantize.make(src, path, quantize.file_type(ftype), allow_requantize=True, output_tensor_type=q8_0,
                  token_embedding_type=q8_0, progress=False)
    types = {t.name: t.tensor_type.name for t in GGUFReader(path, "r").tensors}
    assert {name: types[name] for name in expected} == expected
    b = LlamaCppBackend(path, n_ctx=512)
    try:
        assert _batch_vs_single(b, LONG_TEXT[:400], [1, 2, 3, 4, 5, 8, 16, 33], offsets=(4,)) == 0.0
    finally:
        b.close()


def test_the_ggml_kernels_switch_is_scoped(small_target):
    """`bench --costs` times llama.cpp's own kernels in our process by switching ours off for a block: inside it,
    batched passes round like stock llama.cpp's (not exact); after it, they are exact again."""
    from speculant import native

    with native.ggml_kernels() as switched:
        if not switched:
            pytest.skip("not our build")
        assert _batch_vs_single(small_target, LONG_TEXT, [16, 33, 64], offsets=(4,)) > 0.0
    assert _batch_vs_single(small_target, LONG_TEXT, [16, 33, 64], offsets=(4,)) == 0.0


def test_how_threads_split_the_rows_changes_no_bit(qwen_target):
    """Each weight row's output is computed alone, so the split of a matmul's rows into chunks that the threads
    claim (8-row chunks, the old 64, the default few per thread) cannot change a logit."""
    from speculant import native

    toks = qwen_target.tokenize(LONG_TEXT)[:40]
    qwen_target.rewind(0)
    qwen_target.eval(toks[:32], n_logits=0)
    logits = {}
    for rows in (0, 8, 64):
        with native.chunk_rows(rows) as switched:
            if not switched:
                pytest.skip("not our build")
            qwen_target.rewind(32)
            logits[rows] = qwen_target.eval(toks[32:40], n_logits=8)
    assert qwen_target.n_threads >= 2
    assert np.array_equal(logits[0], logits[8]) and np.array_equal(logits[0], logits[64])


@pytest.mark.parametrize("model", ["qwen_target", "small_target"], ids=["qwen-head128", "smollm2-head64"])
def test_shared_attention_products_change_no_bit(model, request):
    """Our attention products dot each K / V row with every query column that reads it (a head group's heads and
    a pass's tokens) while it is converted once, by ggml_vec_dot_f16's operations per element (the scores of 16
    or more columns with K rows in the lanes, 16 on AVX-512, 8 on AVX2: Qwen's heads of 128 values, SmolLM2's of
    64): the logits are ggml's loop's, bit for bit, for every pass size, at contexts with and without a scalar tail
    (positions not a multiple of 64), and a token alone still gets the bits it gets in a pass. The switch also
    puts back ggml's scalar loop for the softmax's maximum, which ours takes 16 lanes at once: the same bits too."""
    from speculant import native

    target = request.getfixturevalue(model)
    toks = (target.tokenize(LONG_TEXT) * 3)[:330]
    for context in (37, 300):
        target.rewind(0)
        for a in range(0, context, 64):
            target.eval(toks[a:min(a + 64, context)], n_logits=0)
        ours, ggml = {}, {}
        for n in (1, 2, 3, 5, 8, 13):
            target.rewind(context)
            ours[n] = target.eval(toks[context:context + n], n_logits=n).copy()
            with native.ggml_attention() as switched:
                if not switched:
                    pytest.skip("not our build")
                target.rewind(context)
                ggml[n] = target.eval(toks[context:context + n], n_logits=n).copy()
            assert np.array_equal(ours[n], ggml[n]), (context, n)
            assert np.array_equal(ours[n][0], ours[1][0]), (context, n)


def test_shared_attention_products_on_the_avx2_kernels():
    """The same check on the AVX2 (haswell) variant, as an AVX2-only machine runs it (8 K rows in the lanes, dots
    of 32 values a step)."""
    from conftest import rerun_on_haswell

    rerun_on_haswell(__file__, "test_shared_attention_products_change_no_bit", 2)


@pytest.mark.parametrize("model", ["qwen_target", "qwen_draft"])
def test_amx_tile_products_change_no_bit(model, request):
    """Where the CPU has AMX, repacked Q4_K and Q6_K rows (the target's; Q6_K: the output layer, half the ffn_down and
    attn_v matrices) in passes of 8 tokens or more, and Q4_0 rows (the default draft's) in passes of 6 or more, go
    through tile products: the prompt's 64-token passes, 16-, 9-, 8- and 6-token verify passes give the logits, and
    leave the KV cache, of the VNNI kernels, bit for bit (the next one-token pass reads that cache)."""
    from speculant import native

    if not native.amx():
        pytest.skip("no AMX on this CPU (or SPECULANT_AMX=0)")
    backend = request.getfixturevalue(model)
    toks = (backend.tokenize(LONG_TEXT) * 2)[:200]
    runs = []
    for amx in (True, False):
        with (contextlib.nullcontext(True) if amx else native.without_amx()) as ok:
            assert ok
            backend.rewind(0)
            prompt = backend.eval(toks[:64], n_logits=64).copy()
            verify = backend.eval(toks[64:80], n_logits=16).copy()
            verify9 = backend.eval(toks[80:89], n_logits=9).copy()
            verify8 = backend.eval(toks[89:97], n_logits=8).copy()
            verify6 = backend.eval(toks[97:103], n_logits=6).copy()
            step = backend.eval(toks[103:104]).copy()
        runs.append((prompt, verify, verify9, verify8, verify6, step))
    for got, want in zip(runs[0], runs[1]):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("stock", [False, True], ids=["invariant-prefill", "512-token-prefill"])
def test_a_warm_prefill_gives_the_bits_of_a_cold_one(qwen_target, stock):
    """The server keeps its cache between requests. A prompt that extends an earlier request (its prompt, and
    tokens decoded one at a time) must give the logits a fresh prefill gives. Our build's prefill runs
    batch-invariant 64-token passes, so the whole common prefix is kept; a stock build's runs 512-token fast
    passes (stock: prefill_chunk = n_batch), and then only the first chunk, computed by the same fast pass, is
    kept and the rest recomputed in the fresh prefill's own chunks."""
    # the stock build's first chunk is 512 tokens; ours needs only a rest of more than 64 tokens (one fast pass)
    n_doc, n_prefilled, n_decoded = (700, 519, 610) if stock else (300, 150, 200)
    doc = qwen_target.tokenize(LONG_TEXT * 3)[:n_doc]
    second = doc + qwen_target.tokenize(" How old is the lighthouse keeper?")
    default = qwen_target.prefill_chunk
    assert default == min(qwen_target.n_batch, qwen_target.invariant_rows)
    if stock:
        qwen_target.prefill_chunk = qwen_target.n_batch

    def after_first_request():
        qwen_target.rewind(0)
        qwen_target.prefill(doc[:n_prefilled])
        for t in doc[n_prefilled:n_decoded]:  # decode steps
            qwen_target.eval([t])

    try:
        qwen_target.rewind(0)
        qwen_target.prefill(second[:-1])
        cold = qwen_target.eval(second[-1:])[0]
        after_first_request()
        kept = qwen_target.prefill(second[:-1])
        assert qwen_target.tokens == list(second[:-1])
        if stock:  # the first chunk was kept (the same fast pass), the rest recomputed
            assert kept == qwen_target.n_batch
            assert qwen_target._passes[:kept] == [(0, kept)] * kept
        else:  # every position of the earlier request carries over, the decoded ones included
            assert kept == n_decoded and set(qwen_target._passes) == {0}
        warm = qwen_target.eval(second[-1:])[0]
        assert warm.tobytes() == cold.tobytes()
        # what this guards against: keeping every cached position and evaluating the rest in one fast pass (a
        # stock build's sync); ours evaluates any rest in invariant passes too (of prefill_chunk tokens), so there
        # a plain sync gives the same bits
        after_first_request()
        qwen_target.sync(second[:-1], n_logits=0)
        naive = qwen_target.eval(second[-1:])[0]
        assert (naive.tobytes() == cold.tobytes()) == (not stock)
    finally:
        qwen_target.prefill_chunk = default


def test_scoring_keeps_the_entries_a_prompt_shares_with_the_last_one(small_target):
    """Echo + logprobs as an evaluation harness sends it: one context with each of its answers. The entries of
    the shared context are kept and only the answer is evaluated, on the context's cached positions, and every
    entry is the one a fresh scoring of that prompt gives, bit for bit (with fewer alternatives too)."""
    context = small_target.tokenize(LONG_TEXT)[:150]  # past two 64-token chunks, ending inside a third
    answers = [context + small_target.tokenize(a, add_special=False) for a in (" yes, twice", " no", " maybe not")]
    fresh = [Engine(small_target).prompt_logprobs(a, 3) for a in answers]  # a new engine scores from scratch
    assert all(e.logprob is not None and len(e.top) == 3 for f in fresh for e in f[1:])

    engine = Engine(small_target)
    evaluated = []
    real_eval = small_target.eval

    def counting_eval(tokens, n_logits=1):
        evaluated.append(len(tokens))
        return real_eval(tokens, n_logits)

    small_target.eval = counting_eval
    try:
        stats = SpecStats()
        assert engine.prompt_logprobs(answers[0], 3, stats) == fresh[0] and stats.cached_prompt_tokens == 0
        assert sum(evaluated) == len(answers[0]) - 1
        for i in (1, 2, 0):
            evaluated.clear()
            assert engine.prompt_logprobs(answers[i], 3, stats) == fresh[i]
            shared = max(common_prefix(answers[i], answers[j]) for j in range(3) if j != i)
            assert stats.cached_prompt_tokens >= len(context) - 1 and sum(evaluated) <= len(answers[i]) - shared
        evaluated.clear()  # fewer alternatives: the first of each entry's
        assert engine.prompt_logprobs(answers[1], 1) == [e._replace(top=e.top[:1]) for e in fresh[1]]
        assert sum(evaluated) <= len(answers[1]) - len(context)
        evaluated.clear()  # more alternatives than kept: all evaluated again
        assert [e._replace(top=e.top[:3]) for e in engine.prompt_logprobs(answers[2], 5)] == fresh[2]
        assert sum(evaluated) == len(answers[2]) - 1
        # a generation in between moves the cache; the entries stay the prompt's own
        engine.generate(answers[0], max_tokens=4)
        assert engine.prompt_logprobs(answers[1], 3) == fresh[1]
    finally:
        small_target.eval = real_eval


def _chat(engine, prompt):
    return engine.chat_prompt([{"role": "user", "content": prompt}])


@pytest.mark.parametrize("kind", list(PROMPTS))
def test_greedy_identity_qwen_pair(kind, qwen_target, qwen_draft):
    """Speculative output equals target-only output token for token, for k in {1, 4, 8}."""
    plain = Engine(qwen_target)
    prompt = _chat(plain, PROMPTS[kind])
    reference = plain.generate(prompt, max_tokens=40, is_chat=True)
    for k in (1, 4, 8):
        spec = Engine(qwen_target, ModelDrafter(qwen_draft, qwen_target.n_vocab), draft_max=k)
        out = spec.generate(prompt, max_tokens=40, is_chat=True)
        assert out.tokens == reference.tokens, f"k={k} diverged on {kind}"
        assert out.stats.drafted > 0


def test_fill_in_the_middle_qwen(qwen_target, qwen_draft, small_target):
    """A suffix makes a fill-in-the-middle prompt (Qwen2.5-Coder's <|fim_prefix|> ... <|fim_suffix|> ...
    <|fim_middle|>): the model writes the missing middle and ends it; speculative output (draft model, or prompt
    lookup copying from the suffix) is plain decoding's. A model without the tokens is refused clearly."""
    from speculant.drafters import CompositeDrafter, LookupDrafter
    from speculant.errors import SettingsError

    prefix = 'def mean(values):\n    """The arithmetic mean of a non-empty list."""\n'
    suffix = "\n\n\ndef variance(values):\n    m = mean(values)\n    return sum((v - m) ** 2 for v in values) / len(values)\n"
    plain = Engine(qwen_target)
    tokens = plain.fim_prompt(prefix, suffix)
    pre, suf, mid = qwen_target.fim_tokens()
    assert [qwen_target.token_text(t) for t in (pre, suf, mid)] == [b"<|fim_prefix|>", b"<|fim_suffix|>",
                                                                     b"<|fim_middle|>"]
    assert tokens[0] == pre and tokens[-1] == mid and tokens.count(suf) == 1
    assert plain.tokenize_prompt(prefix, suffix=suffix) == tokens
    reference = plain.generate(tokens, max_tokens=60)
    assert reference.finish_reason == "stop" and "return" in reference.text and "sum(values)" in reference.text
    for drafter in (ModelDrafter(qwen_draft, qwen_target.n_vocab),
                    CompositeDrafter(LookupDrafter(), ModelDrafter(qwen_draft, qwen_target.n_vocab))):
        out = Engine(qwen_target, drafter, draft_max=4).generate(tokens, max_tokens=60)
        assert out.tokens == reference.tokens and out.stats.drafted > 0
    with pytest.raises(SettingsError, match="no fill-in-the-middle tokens"):
        Engine(small_target).fim_prompt(prefix, suffix)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_identity_smollm2_drafting_for_itself(k, small_target, small_draft_same_numerics):
    plain = Engine(small_target)
    spec = Engine(small_target, ModelDrafter(small_draft_same_numerics, small_target.n_vocab), draft_max=k)
    for prompt in PROMPTS.values():
        text = _chat(plain, prompt)
        ref = plain.generate(text, max_tokens=48, is_chat=True)
        out = spec.generate(text, max_tokens=48, is_chat=True)
        assert out.tokens == ref.tokens
        # same weights, same numerics: every draft is accepted
        assert out.stats.accepted == out.stats.drafted


def test_draft_share_is_the_weights_ratio(qwen_target, qwen_draft):
    """What prices the draft model's prompt processing before it was timed (policy.wants_draft_prefill)."""
    from speculant.memory import draft_share

    share = draft_share(Engine(qwen_target, ModelDrafter(qwen_draft, qwen_target.n_vocab)))
    assert share == pytest.approx(qwen_draft.path.stat().st_size / qwen_target.path.stat().st_size) and 0.1 < share < 0.6
    assert draft_share(Engine(qwen_target)) is None


def test_the_draft_models_prompt_cost_is_kept_for_the_next_process(qwen_target, qwen_draft, tmp_path, monkeypatch):
    """A request that prefills both models measures the draft's prompt cost per token over the target's; the next
    process's engine on the same pair reads it (it prices that process's first draft prefill)."""
    from speculant import costprofile

    monkeypatch.setenv("SPECULANT_HOME", str(tmp_path))  # a machine that has measured nothing yet
    monkeypatch.delenv("SPECULANT_COST_PROFILE", raising=False)
    first = Engine(qwen_target, ModelDrafter(qwen_draft, qwen_target.n_vocab), draft_max=4, adaptive=False)
    assert first.draft_backend is qwen_draft and first.draft_prompt_ratio is None
    prompt = "Prompt-cost check. " + " ".join(f"item {i}: the value {i * i}." for i in range(60))
    assert len(qwen_target.tokenize(prompt)) > 2 * costprofile.PROMPT_RATIO_MIN_TOKENS
    first.generate(prompt, max_tokens=4)
    ratio = costprofile.prompt_ratio(qwen_draft, qwen_target)
    assert ratio is not None and 0.1 < ratio < 1.0  # a third of the weights: cheaper, but not a third
    second = Engine(qwen_target, ModelDrafter(qwen_draft, qwen_target.n_vocab), draft_max=4, adaptive=False)
    assert second.draft_prompt_ratio == ratio
    from speculant.drafters import LookupDrafter

    assert Engine(qwen_target, LookupDrafter(), draft_max=4, adaptive=False).draft_prompt_ratio is None


def test_caches_stay_consistent_after_rejections(qwen_target, qwen_draft):
    """Continuing a speculative run (caches full of rejected drafts) equals a fresh run on the same text."""
    spec = Engine(qwen_target, ModelDrafter(qwen_draft, qwen_target.n_vocab), draft_max=6)
    prompt = qwen_target.tokenize(_chat(spec, PROMPTS["story"]))
    first = spec.generate(prompt, max_tokens=24, params=SamplingParams(0.9, seed=1))
    assert first.stats.accepted < first.stats.drafted  # there were rejections to clean up
    continued = spec.generate(prompt + first.tokens, max_tokens=24)
    qwen_target.rewind(0)
    qwen_draft.rewind(0)
    fresh = Engine(qwen_target).generate(prompt + first.tokens, max_tokens=24)
    assert continued.tokens == fresh.tokens


@pytest.mark.parametrize("params", [SamplingParams(0.8, top_p=0.95, seed=123), SamplingParams(1.0, seed=7)],
                         ids=["T0.8-topp", "T1-untruncated"])
def test_a_seeded_sampled_output_is_plain_decodings(params, qwen_target, qwen_draft):
    """Coupled draws on the real pair: with a seed, a sampled output is plain decoding's with that seed, token for
    token, whatever drafts (the draft model at fixed and adaptive k, prompt lookup in front); and reproducible."""
    from speculant.drafters import CompositeDrafter, LookupDrafter

    plain = Engine(qwen_target)
    prompt = _chat(plain, PROMPTS["story"])
    reference = plain.generate(prompt, max_tokens=32, params=params, is_chat=True)
    accepted = 0
    for spec in (Engine(qwen_target, ModelDrafter(qwen_draft, qwen_target.n_vocab), draft_max=4),
                 Engine(qwen_target, CompositeDrafter(LookupDrafter(), ModelDrafter(qwen_draft, qwen_target.n_vocab)),
                        draft_max=6, adaptive=True)):
        for _ in range(2):
            out = spec.generate(prompt, max_tokens=32, params=params, is_chat=True)
            assert out.tokens == reference.tokens
            accepted += out.stats.accepted
    assert accepted > 0
    other = plain.generate(prompt, max_tokens=32, params=dataclasses.replace(params, seed=params.seed + 1),
                           is_chat=True)
    assert other.tokens != reference.tokens


def test_qwen_pair_vocabularies_are_compatible_and_smollm2_is_refused(qwen_target, qwen_draft, small_target):
    check_compatible(qwen_target.vocab_info(), qwen_draft.vocab_info())
    from speculant.errors import VocabMismatchError

    with pytest.raises(VocabMismatchError, match="sizes differ"):
        check_compatible(qwen_target.vocab_info(), small_target.vocab_info())


def test_chat_template_comes_from_the_gguf(qwen_target):
    plain = Engine(qwen_target)
    text = _chat(plain, "hi")
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("thp", ["1", "0"])
def test_weights_sit_on_huge_pages(thp):
    """Our build asks for transparent huge pages for buffers of 2 MiB and more (weights, KV cache): fewer TLB
    misses make a Qwen 1.5B decode step ~9% cheaper. SPECULANT_THP=0 keeps 4 KiB pages. Checked in a fresh
    process: the loaded model's anonymous memory on huge pages."""
    import os
    import subprocess
    import sys

    from conftest import SMALL
    from speculant import models, native

    mode = native.huge_pages()["kernel"]
    if mode not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {mode or 'absent'} on this kernel")
    if thp == "0" and mode == "always":
        pytest.skip("THP is 'always' here: the kernel gives huge pages whatever we ask")
    if not models.cached_path(SMALL).exists():
        pytest.skip(f"{SMALL} not pulled")
    code = ("import sys; from speculant.backends.llamacpp import LlamaCppBackend as B; b = B(sys.argv[1], n_ctx=512); "
            "b.eval(b.tokenize('hello there'));"
            "print([int(l.split()[1]) for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')][0])")
    env = {**os.environ, "SPECULANT_THP": thp}
    proc = subprocess.run([sys.executable, "-c", code, str(models.cached_path(SMALL))], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    huge_kib = int(proc.stdout.split()[-1])
    weights_kib = models.cached_path(SMALL).stat().st_size // 1024
    if thp == "1":
        assert huge_kib > 0.8 * weights_kib, (huge_kib, weights_kib)
    else:
        assert huge_kib < 0.1 * weights_kib, (huge_kib, weights_kib)  # numpy may advise its own big arrays


def test_a_closed_model_is_an_error_not_a_crash():
    """Every use of a closed engine's model, and of a slot whose primary was closed, read freed llama.cpp memory
    (a segfault or an abort: chat_prompt, prediction_tokens, prompt_logprobs, fill in the middle)."""
    from speculant.api import load_engine
    from speculant.errors import SettingsError

    from conftest import SMALL

    engine = load_engine(SMALL, threads=1, n_ctx=256, lookup=False, parallel=2)
    slot = engine.for_slot(1)
    assert slot.generate("hi", max_tokens=2).tokens  # before: fine
    engine.close()
    for use in (lambda: engine.chat_prompt([{"role": "user", "content": "x"}]),
                lambda: engine.prediction_tokens("hi"), lambda: engine.prompt_logprobs([1, 2, 3], 1),
                lambda: engine.target.vocab_info(), lambda: slot.generate("hi", max_tokens=2),
                lambda: slot.generate([1, 2], max_tokens=2), lambda: slot.target.rewind(0)):
        with pytest.raises(SettingsError, match="closed"):
            use()


def test_a_token_id_outside_the_vocabulary_is_an_error_not_an_abort(small_target):
    """detokenize / token_bytes of an id llama.cpp does not have threw std::out_of_range inside ctypes: the
    process aborted (the Python API's one detokenizer; the server checks ids itself)."""
    from speculant.errors import SettingsError

    n = small_target.n_vocab
    assert small_target.detokenize(small_target.tokenize("Hello world", add_special=False)) == "Hello world"
    for bad in ([n], [-1], [1, n + 5]):
        with pytest.raises(SettingsError, match=f"outside the vocabulary \\(0..{n - 1}\\)"):
            small_target.detokenize(bad)
    with pytest.raises(SettingsError, match="outside the vocabulary"):
        small_target.token_bytes(n)


def test_a_stream_left_unfinished_ends_quietly_at_exit():
    """`s = engine.stream(...); next(s)` and the program ends: the generation's end ran when the interpreter had
    already torn down `open` and imports ("Exception ignored in: <generator object Engine._loop>", a traceback)."""
    import subprocess
    import sys

    from conftest import SMALL

    code = ("import speculant\n"
            f"e = speculant.load_engine({str(SMALL)!r}, threads=1, n_ctx=256)\n"
            "s = e.stream('Once upon a time', max_tokens=20)\n"
            "print(repr(next(s).text))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip(), run.stderr[-2000:]
    assert "Traceback" not in run.stderr and "Exception ignored" not in run.stderr, run.stderr[-2000:]
