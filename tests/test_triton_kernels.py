"""The target's Triton attention kernel (backends/triton_kernels.py), in Triton's interpreter on CPU (the
conftest sets TRITON_INTERPRET=1) and compiled where SPECULANT_TEST_DEVICE=cuda.

The interpreter computes a tile's dot products with numpy, whose BLAS rounds a row by its index in the tile,
so bit-identity across a row's place in the tile is the GPU's property (tests/test_torch_static.py's CUDA
tests and scripts/gpu_bench.sh check it there); what is checked here is the function, the layouts, and that
the tiles a program walks past a row's position change none of its bits."""

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from speculant.backends.torch import KV_BLOCK  # noqa: E402
from speculant.backends.torch_static import attention_masks, block_attention  # noqa: E402
from speculant.backends.triton_kernels import (BLOCK_M, SPLIT, add_rms_norm, invariant_attention,  # noqa: E402
                                                  rope_and_store, rope_reference, silu_mul)

DEVICE = os.environ.get("SPECULANT_TEST_DEVICE", "cpu")


def _inputs(n_heads, n_kv, d, rows, capacity=768, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, n_kv, capacity, d, generator=g).to(DEVICE, dtype)  # [2, kv_heads, capacity, d]
    qk = torch.randn(rows, n_heads + n_kv, d, generator=g).to(DEVICE, dtype)  # as the backend's fused q/k
    return qk[:, :n_heads].transpose(0, 1), kv[0], kv[1]  # q [heads, rows, d] (strided), keys, values


@pytest.mark.parametrize("n_heads,n_kv,d", [(4, 2, 16), (6, 1, 32), (5, 5, 24)])
@pytest.mark.parametrize("start", [0, 3, 250, 500])
def test_the_kernel_computes_block_attention(n_heads, n_kv, d, start):
    """The same function as the torch block attention (GQA groups, a head_dim that is not a power of two,
    passes crossing a KV block), rounding aside, in the [rows, heads * d] layout o_proj reads."""
    rows = 16
    q, keys, values = _inputs(n_heads, n_kv, d, rows)
    pos = torch.arange(start, start + rows, device=DEVICE)
    n_blocks = (start + rows - 1) // KV_BLOCK + 1
    masks = attention_masks(pos.repeat(n_heads // n_kv), torch.arange(KV_BLOCK, device=DEVICE), n_blocks)
    ref = block_attention(q, keys, values, masks, 0.3)  # [rows, heads * d]
    out = invariant_attention(q, keys, values, pos, 0.3)
    assert out.shape == ref.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)


def test_tiles_past_a_row_leave_its_bits():
    """A row's result is the same bits whether its program walks to its own position or far past it (another
    row of the tile sits 400 positions later), and whether the pass has 1 row or 16: blocks past a row's
    position add exactly nothing."""
    q, keys, values = _inputs(4, 2, 16, rows=BLOCK_M)
    near = torch.arange(100, 100 + BLOCK_M, device=DEVICE)
    far = near.clone()
    far[-1] = 600
    a = invariant_attention(q, keys, values, near, 0.25)
    b = invariant_attention(q, keys, values, far, 0.25)
    assert torch.equal(a[:-1], b[:-1])
    assert not torch.equal(a[-1], b[-1])
    alone = invariant_attention(q[:, :1], keys, values, near[:1], 0.25)
    assert torch.equal(alone[0], a[0])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # -inf - -inf: rows a split skips
@pytest.mark.parametrize("start", [0, SPLIT - 6, 2 * SPLIT + 5])
def test_split_keys_give_the_same_bits(start):
    """split=True (stretches of SPLIT keys in programs of their own, then a merge in order): a row before the
    first stretch's end gets the bits of one program walking every key (so a pass may take either way for it),
    rows past it attention rounded otherwise (every pass takes split=True for them); a stretch past a row
    changes none of its bits; and it is attention."""
    q, keys, values = _inputs(4, 2, 16, rows=BLOCK_M, capacity=4 * SPLIT)
    pos = torch.arange(start, start + BLOCK_M, device=DEVICE)
    whole = invariant_attention(q, keys, values, pos, 0.25)
    split = invariant_attention(q, keys, values, pos, 0.25, split=True)
    first = pos < SPLIT
    assert torch.equal(split[first], whole[first])
    torch.testing.assert_close(split, whole, atol=2e-6, rtol=2e-6)
    further = pos.clone()
    further[-1] += SPLIT  # the last row reaches a stretch further: the others' bits stay
    assert torch.equal(invariant_attention(q, keys, values, further, 0.25, split=True)[:-1], split[:-1])
    n_blocks = (start + BLOCK_M - 1) // KV_BLOCK + 1
    masks = attention_masks(pos.repeat(2), torch.arange(KV_BLOCK, device=DEVICE), n_blocks)
    torch.testing.assert_close(whole, block_attention(q, keys, values, masks, 0.25), atol=2e-6, rtol=2e-6)


def test_rows_past_one_tile():
    """A pass of more rows than a tile (a draft's 64-row shape class) takes one program per tile and head."""
    q, keys, values = _inputs(4, 2, 16, rows=40)
    pos = torch.arange(7, 47, device=DEVICE)
    masks = attention_masks(pos.repeat(2), torch.arange(KV_BLOCK, device=DEVICE), 1)
    torch.testing.assert_close(invariant_attention(q, keys, values, pos, 0.25),
                               block_attention(q, keys, values, masks, 0.25), atol=2e-6, rtol=2e-6)


def test_layouts_it_cannot_read_are_refused():
    q, keys, values = _inputs(4, 2, 16, rows=16)
    with pytest.raises(ValueError, match="unit strides"):
        invariant_attention(q.transpose(1, 2).contiguous().transpose(1, 2), keys, values,
                            torch.arange(16, device=DEVICE), 0.25)


def test_float16_tiles():
    """Half-precision inputs (p rounded to the values' dtype before its dot, as block_attention does)."""
    q, keys, values = _inputs(4, 2, 64, rows=16, dtype=torch.float16)
    pos = torch.arange(250, 266, device=DEVICE)
    masks = attention_masks(pos.repeat(2), torch.arange(KV_BLOCK, device=DEVICE), 2)
    torch.testing.assert_close(invariant_attention(q, keys, values, pos, 0.125),
                               block_attention(q, keys, values, masks, 0.125), atol=2e-3, rtol=2e-3)


def test_the_check_passes_here_and_catches_a_wrong_kernel(monkeypatch):
    """check() is what lets a CUDA backend choose the kernel by default: '' where it computes attention, a
    reason where it does not (here: a kernel that forgets the scale)."""
    from speculant.backends import triton_kernels

    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    assert triton_kernels.check(DEVICE, dtype) == ""
    triton_kernels.check.cache_clear()
    real = triton_kernels.invariant_attention
    monkeypatch.setattr(triton_kernels, "invariant_attention",
                        lambda q, k, v, pos, scaling, split=False: real(q, k, v, pos, 1.0, split))
    try:
        assert "attention differs" in triton_kernels.check(DEVICE, dtype)
    finally:
        triton_kernels.check.cache_clear()


@pytest.mark.parametrize("n_heads,n_kv,d", [(4, 2, 16), (5, 1, 24), (14, 2, 64)])
def test_rope_and_the_stores(n_heads, n_kv, d):
    """rope_and_store: q and k rotated (rotate_half, float32, with an attention scaling), k and v written at
    their positions (unordered, not contiguous) and nowhere else; q comes back as [heads, rows, d]."""
    g = torch.Generator().manual_seed(1)
    rows, capacity = 6, 64
    qkv = torch.randn(rows, (n_heads + 2 * n_kv) * d, generator=g).to(DEVICE)
    pos = torch.tensor([3, 9, 10, 40, 2, 63], device=DEVICE)
    inv_freq = (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)).to(DEVICE)
    caches = torch.zeros(2, n_kv, capacity, d, device=DEVICE)
    q = rope_and_store(qkv, pos, inv_freq, 1.25, caches[0], caches[1], n_heads, n_kv)
    q_ref, k_ref, v_ref = rope_reference(qkv, pos, inv_freq, 1.25, n_heads, n_kv)
    assert q.shape == (n_heads, rows, d)
    torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(caches[0][:, pos], k_ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(caches[1][:, pos], v_ref)
    untouched = torch.ones(capacity, dtype=torch.bool, device=DEVICE)
    untouched[pos] = False
    assert not caches[:, :, untouched].any()
    # the reference itself against the torch backend's rotation (cos/sin over both halves, a rolled x)
    angle = pos[:, None].float() * inv_freq[None, :]
    cos = torch.cat((angle.cos(), angle.cos()), -1)[:, None] * 1.25
    sin = torch.cat((-angle.sin(), angle.sin()), -1)[:, None] * 1.25
    x = qkv[:, :n_heads * d].view(rows, n_heads, d)
    torch.testing.assert_close(q_ref, (x * cos + x.roll(d // 2, -1) * sin).transpose(0, 1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_residual_add_and_its_rms_norm(dtype):
    """add_rms_norm: the sum rounded to the stream's dtype as a separate add gives it, then RMSNorm of that sum
    (a hidden size that is not a power of two); without a delta, the norm of h alone and h itself."""
    g = torch.Generator().manual_seed(2)
    h, delta = (torch.randn(5, 96, generator=g).to(DEVICE, dtype) for _ in range(2))
    weight = torch.rand(96, generator=g).to(DEVICE, dtype) + 0.5
    h_out, normed = add_rms_norm(h, delta, weight, 1e-6)
    assert torch.equal(h_out, h + delta)
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(normed, torch.nn.functional.rms_norm((h + delta).float(), (96,), weight.float(),
                                                                    1e-6).to(dtype), atol=tol, rtol=tol)
    same, normed = add_rms_norm(h, None, weight, 1e-6)
    assert same is h
    torch.testing.assert_close(normed, torch.nn.functional.rms_norm(h.float(), (96,), weight.float(), 1e-6).to(dtype),
                               atol=tol, rtol=tol)


def test_swiglu():
    """silu_mul: silu(gate) * up from the fused gate/up matmul's [rows, 2 * width], width past one block."""
    gate_up = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(silu_mul(gate_up), torch.nn.functional.silu(gate) * up, atol=1e-6, rtol=1e-6)


COMPILE = """
import json
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from triton.runtime.jit import JITFunction
from speculant.backends import triton_kernels as tk

out = {}


def build(name, source, signature, constexprs, arch):
    signature = {**signature, **{c: "constexpr" for c in constexprs}}
    kernel = compile(ASTSource(fn=JITFunction(source()), signature=signature, constexprs=constexprs),
                     target=GPUTarget("cuda", arch, 32))
    out[name] = [len(kernel.asm["cubin"]), "mma.sync" in kernel.asm["ptx"]]


# (arch, dtype, head size, hidden size): the H200's sm_90 at the Qwen2.5 shapes' sizes (32B, 0.5B) and in
# float32 (no tensor cores), an A100's sm_80 at 1.5B's
for arch, dtype, d, hidden in ((90, "bf16", 128, 5120), (90, "bf16", 64, 896), (90, "fp32", 128, 1536),
                               (80, "bf16", 128, 1536)):
    at, p, ints = f"sm_{arch} {dtype} d={d} hidden={hidden}", "*" + dtype, lambda *names: dict.fromkeys(names, "i32")
    for final in (True, False):
        part = p if final else "*fp32"
        build(f"{at} attention final={final}", tk.attention_source,
              {"q_ptr": p, "k_ptr": p, "v_ptr": p, "pos_ptr": "*i64", "out_ptr": p, "part_acc_ptr": part,
               "part_stat_ptr": part, **ints("stride_qh", "stride_qr", "stride_kh", "stride_kp", "stride_or",
                                             "n_rows", "group", "head_dim"), "scaling": "fp32", "n_splits": "i32"},
              {"BLOCK_M": tk.BLOCK_M, "BLOCK_N": tk.BLOCK_N, "BLOCK_D": d, "SPLIT": tk.SPLIT, "FINAL": final,
               "IEEE": dtype == "fp32"}, arch)
    build(f"{at} merge", tk.merge_source,
          {"pos_ptr": "*i64", "out_ptr": p, "part_acc_ptr": "*fp32", "part_stat_ptr": "*fp32",
           **ints("stride_or", "n_rows", "head_dim", "n_splits")},
          {"BLOCK_M": tk.BLOCK_M, "BLOCK_D": d, "SPLIT": tk.SPLIT}, arch)
    build(f"{at} rope", tk.rope_source,
          {"qkv_ptr": p, "pos_ptr": "*i64", "inv_freq_ptr": "*fp32", "q_out_ptr": p, "k_cache_ptr": p,
           "v_cache_ptr": p, **ints("stride_qkv", "stride_qo", "stride_ch", "stride_cp", "n_heads", "n_kv",
                                    "head_dim"), "rope_scale": "fp32"}, {"HEADS": 64, "HALF": d // 2}, arch)
    for has_delta in (True, False):
        build(f"{at} norm delta={has_delta}", tk.norm_source,
              {"h_ptr": p, "delta_ptr": p, "weight_ptr": p, "h_out_ptr": p, "normed_ptr": p, "hidden": "i32",
               "eps": "fp32"}, {"HAS_DELTA": has_delta, "BLOCK": 1 << (hidden - 1).bit_length()}, arch)
    build(f"{at} silu", tk.silu_source, {"gate_up_ptr": p, "out_ptr": p, "width": "i32"}, {"BLOCK": 1024}, arch)
print(json.dumps(out))
"""


def test_the_kernel_compiles_for_nvidia_gpus():
    """No GPU needed: Triton compiles every kernel for H100/H200 (sm_90) and A100 (sm_80) to cubins with its own
    ptxas, at sizes of the Qwen2.5 shapes; half-precision tiles multiply on the tensor cores (mma), float32
    ones exactly (no tf32). A process of its own: the interpreter (TRITON_INTERPRET, set for this one) cannot
    compile."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    built = json.loads(run.stdout.splitlines()[-1])
    assert len(built) == 4 * 7
    for name, (cubin_bytes, mma) in built.items():
        assert cubin_bytes > 0, name
        if "attention" in name:  # half-precision tiles on the tensor cores; float32 ones exactly (no tf32)
            assert mma == ("fp32" not in name), name
