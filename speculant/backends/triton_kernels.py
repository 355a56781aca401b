"""Triton kernels for what runs between a layer's matmuls on CUDA, with rows that do not depend on the pass:
RoPE with the K/V stores (rope_and_store), attention (invariant_attention), the residual add with the RMSNorm
after it (add_rms_norm), and SwiGLU (silu_mul): 9 launches a layer with the four matmuls, against ~25 for
StaticTorchBackend's torch code (its block attention alone is ~15 small kernels per KV block and layer).

A captured pass is kernel-bound on a GPU (an H200 ran ~3 us a kernel; the 32B shape's 16-row pass took 24 ms
against a 13.6 ms memory floor, docs/bench/gpu/). The attention does the same online softmax over the same
absolute KV offsets as block_attention in one launch a layer, and the kernels read the row positions on the
device, so one captured graph serves every position and any number of blocks.

Why a row's result does not depend on the pass: each program takes one query head and BLOCK_M rows, and walks
the keys in tiles of BLOCK_N at absolute offsets 0, BLOCK_N, ..., always from tile 0 (position 0 is visible to
every row, so a row's running max is finite after it). The tiles' shapes are constants, so every dot product
and every row reduction runs the same instructions whichever pass holds the row; a tile past a row's position
has every score masked to -inf, which leaves its max, sum and accumulator exactly as they were (x * exp(0) + 0);
how far a program walks (to the last row's position) therefore changes no bits.

The other kernels are per row too: elementwise, or (RMSNorm) one program a row summing its squares in one fixed
reduction, so a row's bits do not depend on the others either.

On CPU tensors the same kernels run in Triton's interpreter (numpy; TRITON_INTERPRET=1), for tests; a CPU
backend uses torch.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

BLOCK_M = 16  # query rows a program takes (a target pass has 16 rows)
BLOCK_N = 64  # keys per tile (divides KV_BLOCK, so the capacity is whole tiles)
SPLIT = 1024  # positions per stretch of keys a program takes when a pass reaches past them (split=True)


def available() -> bool:
    """Whether triton imports (it ships with CUDA builds of torch; CPU tests install it for the interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def rope_reference(qkv: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, rope_scale: float,
                   n_heads: int, n_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rope_and_store's q, k, v ([heads or kv_heads, rows, d]) in torch, in float32."""
    n_rows, d = qkv.shape[0], qkv.shape[1] // (n_heads + 2 * n_kv)
    x = qkv.float().view(n_rows, n_heads + 2 * n_kv, d)
    angle = pos[:, None].float() * inv_freq[None, :].float()  # [rows, d/2]
    cos, sin = (torch.cat((f, f), -1)[:, None] * rope_scale for f in (angle.cos(), angle.sin()))
    rotated = torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1)
    qk = (x[:, :n_heads + n_kv] * cos + rotated[:, :n_heads + n_kv] * sin).to(qkv.dtype)
    return qk[:, :n_heads].transpose(0, 1), qk[:, n_heads:].transpose(0, 1), qkv.view(x.shape)[:, n_heads + n_kv:] \
        .transpose(0, 1)


@functools.cache
def check(device: str, dtype: torch.dtype = torch.bfloat16) -> str:
    """'' where every kernel here compiles and runs on device in dtype and computes what torch does (RoPE and
    the stores, the residual add and RMSNorm, SwiGLU, and attention, whole and split, against block_attention on
    a small GQA problem across a KV block), else why not (an old GPU, a triton that cannot build them). Cached.
    (Triton 3.9's interpreter multiplies bfloat16 tiles as their integer bits: on CPU, check float16/32.)"""
    from .torch import KV_BLOCK
    from .torch_static import attention_masks, block_attention

    if not available():
        return "triton is not installed"
    try:
        g = torch.Generator().manual_seed(0)
        n_heads, n_kv, d, capacity = 4, 2, 64, 2 * KV_BLOCK
        kv = torch.randn(2, n_kv, capacity, d, generator=g).to(device, dtype)
        qkv = torch.randn(BLOCK_M, (n_heads + 2 * n_kv) * d, generator=g).to(device, dtype)
        pos = torch.arange(KV_BLOCK - 5, KV_BLOCK - 5 + BLOCK_M, device=device)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, device=device).float() / d)
        q_ref, k_ref, v_ref = rope_reference(qkv, pos, inv_freq, 1.0, n_heads, n_kv)
        q = rope_and_store(qkv, pos, inv_freq, 1.0, kv[0], kv[1], n_heads, n_kv)
        err = max(float((a.float() - b.float()).abs().max())
                  for a, b in ((q, q_ref), (kv[0][:, pos], k_ref), (kv[1][:, pos], v_ref)))
        if err > 0.05:
            return f"RoPE differs from torch's by {err}"
        h, delta = (torch.randn(BLOCK_M, 96, generator=g).to(device, dtype) for _ in range(2))
        weight = torch.rand(96, generator=g).to(device, dtype) + 0.5
        total, normed = add_rms_norm(h, delta, weight, 1e-6)
        ref = torch.nn.functional.rms_norm(total.float(), (96,), weight.float(), 1e-6)
        err = max(float((total.float() - (h.float() + delta.float())).abs().max()),
                  float((normed.float() - ref).abs().max()))
        if err > 0.05:
            return f"the residual add and RMSNorm differ from torch's by {err}"
        gate, up = h.float(), delta.float()
        err = float((silu_mul(torch.cat((h, delta), -1)).float() - torch.nn.functional.silu(gate) * up).abs().max())
        if err > 0.05:
            return f"SwiGLU differs from torch's by {err}"
        masks = attention_masks(pos.repeat(n_heads // n_kv), torch.arange(KV_BLOCK, device=device), 2)
        ref = block_attention(q, kv[0], kv[1], masks, 0.125)
        err = max(float((invariant_attention(q, kv[0], kv[1], pos, 0.125, split).float() - ref.float()).abs().max())
                  for split in (False, True))  # True: the split kernel and the merge (one stretch here)
    except Exception as e:  # noqa: BLE001 -- any failure to build or run means: use torch's kernels
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return "" if err < 0.05 else f"attention differs from torch's by {err}"


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1 when triton was imported)."""
    try:
        from triton import knobs  # triton >= 3.3
    except ImportError:
        import os

        return os.environ.get("TRITON_INTERPRET", "0") == "1"
    return bool(knobs.runtime.interpret)


@functools.cache
def attention_source():
    """The kernel's Python function, before triton.jit (made on first use so importing this needs no triton)."""
    import triton.language as tl

    def attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, part_acc_ptr, part_stat_ptr,
                         stride_qh, stride_qr, stride_kh, stride_kp, stride_or,
                         n_rows, group, head_dim, scaling, n_splits,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         SPLIT: tl.constexpr, FINAL: tl.constexpr, IEEE: tl.constexpr):
        tile = tl.program_id(0)
        head = tl.program_id(1)
        split = tl.program_id(2)
        kv_head = head // group
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]
        dims = tl.arange(0, BLOCK_D)  # [D]
        row_ok = rows < n_rows
        dim_ok = dims < head_dim
        q = tl.load(q_ptr + head * stride_qh + rows[:, None] * stride_qr + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [M, D]
        q_pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int32)  # [M]
        run_max = tl.full([BLOCK_M], -float("inf"), tl.float32)
        run_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_base = k_ptr + kv_head * stride_kh
        v_base = v_ptr + kv_head * stride_kh
        end = tl.max(q_pos, 0) + 1
        first = 0
        if not FINAL:  # this program's split: keys [split * SPLIT, (split + 1) * SPLIT)
            first = split * SPLIT
            end = tl.minimum(end, first + SPLIT)
        for start in range(first, end, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)  # [N] absolute positions
            at = keys[:, None] * stride_kp + dims[None, :]
            k = tl.load(k_base + at, mask=dim_ok[None, :], other=0.0)  # [N, D]
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(keys[None, :] <= q_pos[:, None], scores * scaling, -float("inf"))  # [M, N] f32
            new_max = tl.maximum(run_max, tl.max(scores, 1))
            rescale = tl.exp(run_max - new_max)
            p = tl.exp(scores - new_max[:, None])
            run_sum = run_sum * rescale + tl.sum(p, 1)
            v = tl.load(v_base + at, mask=dim_ok[None, :], other=0.0)  # [N, D]
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * rescale[:, None] + pv
            run_max = new_max
        if FINAL:
            out = acc / run_sum[:, None]
            tl.store(out_ptr + rows[:, None] * stride_or + head * head_dim + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
        else:  # the split's partial state: acc [heads, rows, splits, D], (max, sum) [heads, rows, splits, 2]
            at = (head * n_rows + rows) * n_splits + split  # [M]
            tl.store(part_acc_ptr + at[:, None] * BLOCK_D + dims[None, :], acc, mask=row_ok[:, None])
            tl.store(part_stat_ptr + 2 * at, run_max, mask=row_ok)
            tl.store(part_stat_ptr + 2 * at + 1, run_sum, mask=row_ok)

    return attention_kernel


@functools.cache
def merge_source():
    """The split attention's merge kernel's Python function, before triton.jit."""
    import triton.language as tl

    def merge_kernel(pos_ptr, out_ptr, part_acc_ptr, part_stat_ptr, stride_or, n_rows, head_dim, n_splits,
                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, SPLIT: tl.constexpr):
        tile = tl.program_id(0)
        head = tl.program_id(1)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]
        dims = tl.arange(0, BLOCK_D)  # [D]
        row_ok = rows < n_rows
        q_pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.int32)  # [M]
        run_max = tl.full([BLOCK_M], -float("inf"), tl.float32)
        run_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for split in range(0, tl.max(q_pos, 0) // SPLIT + 1):  # in order: split 0 holds position 0
            seen = row_ok & (split * SPLIT <= q_pos)  # a split wholly past a row is left out exactly
            at = (head * n_rows + rows) * n_splits + split
            part_max = tl.load(part_stat_ptr + 2 * at, mask=seen, other=-float("inf"))
            part_sum = tl.load(part_stat_ptr + 2 * at + 1, mask=seen, other=0.0)
            part_acc = tl.load(part_acc_ptr + at[:, None] * BLOCK_D + dims[None, :], mask=seen[:, None], other=0.0)
            new_max = tl.maximum(run_max, part_max)
            keep = tl.exp(run_max - new_max)  # 0 for the first split, 1 for one left out
            take = tl.exp(part_max - new_max)  # 1 for the first split, 0 for one left out
            run_sum = run_sum * keep + part_sum * take
            acc = acc * keep[:, None] + part_acc * take[:, None]
            run_max = new_max
        out = acc / run_sum[:, None]
        tl.store(out_ptr + rows[:, None] * stride_or + head * head_dim + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (dims < head_dim)[None, :])

    return merge_kernel


@functools.cache
def rope_source():
    """The RoPE-and-store kernel's Python function, before triton.jit."""
    import triton.language as tl

    def rope_store_kernel(qkv_ptr, pos_ptr, inv_freq_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                          stride_qkv, stride_qo, stride_ch, stride_cp,
                          n_heads, n_kv, head_dim, rope_scale,
                          HEADS: tl.constexpr, HALF: tl.constexpr):
        row = tl.program_id(0)
        hd = tl.arange(0, HEADS)[:, None]  # [H, 1]: q heads, then k heads, then v heads
        i = tl.arange(0, HALF)[None, :]  # [1, HALF]
        half = head_dim // 2
        ok = (hd < n_heads + 2 * n_kv) & (i < half)
        at = qkv_ptr + row * stride_qkv + hd * head_dim + i
        x = tl.load(at, mask=ok, other=0.0)  # [H, HALF]: each head's first half
        y = tl.load(at + half, mask=ok, other=0.0)  # and its second
        position = tl.load(pos_ptr + row)
        angle = position.to(tl.float32) * tl.load(inv_freq_ptr + i, mask=i < half, other=0.0)  # [1, HALF]
        cos = tl.cos(angle) * rope_scale
        sin = tl.sin(angle) * rope_scale
        xf, yf = x.to(tl.float32), y.to(tl.float32)
        rotate = hd < n_heads + n_kv  # rotate_half RoPE on q and k in float32; v as it is
        lo = tl.where(rotate, xf * cos - yf * sin, xf).to(x.dtype)
        hi = tl.where(rotate, yf * cos + xf * sin, yf).to(x.dtype)
        is_q = ok & (hd < n_heads)
        is_k = ok & rotate & (hd >= n_heads)
        is_v = ok & (hd >= n_heads + n_kv)
        q_at = q_out_ptr + row * stride_qo + hd * head_dim + i
        k_at = k_cache_ptr + (hd - n_heads) * stride_ch + position * stride_cp + i
        v_at = v_cache_ptr + (hd - n_heads - n_kv) * stride_ch + position * stride_cp + i
        tl.store(q_at, lo, mask=is_q)
        tl.store(q_at + half, hi, mask=is_q)
        tl.store(k_at, lo, mask=is_k)
        tl.store(k_at + half, hi, mask=is_k)
        tl.store(v_at, lo, mask=is_v)
        tl.store(v_at + half, hi, mask=is_v)

    return rope_store_kernel


def rope_and_store(qkv: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, rope_scale: float,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, n_kv: int) -> torch.Tensor:
    """One kernel for what follows a layer's q/k/v matmul: RoPE (rotate_half, in float32) on q and k, and k and v
    written to the caches [kv_heads, capacity, d] at pos [rows]. qkv [rows, (heads + 2 kv_heads) * d]; inv_freq
    [d / 2] float32. Returns the rotated q [heads, rows, d] (a view of [rows, heads, d])."""
    n_rows = qkv.shape[0]
    d = k_cache.shape[-1]
    if qkv.stride(-1) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("rope_and_store: qkv and the caches need unit strides along head_dim, the caches one layout")
    _interpretable(qkv)
    q = torch.empty(n_rows, n_heads, d, dtype=qkv.dtype, device=qkv.device)
    _jit(rope_source)[(n_rows,)](
        qkv, pos, inv_freq, q, k_cache, v_cache, qkv.stride(0), q.stride(0), k_cache.stride(0), k_cache.stride(1),
        n_heads, n_kv, d, float(rope_scale), HEADS=1 << (n_heads + 2 * n_kv - 1).bit_length(),
        HALF=max(16, 1 << (d // 2 - 1).bit_length()))
    return q.transpose(0, 1)


@functools.cache
def norm_source():
    """The residual-add-and-RMSNorm kernel's Python function, before triton.jit."""
    import triton.language as tl

    def add_rms_norm_kernel(h_ptr, delta_ptr, weight_ptr, h_out_ptr, normed_ptr, hidden, eps,
                            HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        ok = i < hidden
        x = tl.load(h_ptr + row * hidden + i, mask=ok, other=0.0)
        if HAS_DELTA:  # the residual stream keeps the model's dtype: round the sum, then normalize that
            x = (x.to(tl.float32) + tl.load(delta_ptr + row * hidden + i, mask=ok, other=0.0).to(tl.float32))
            x = x.to(h_out_ptr.dtype.element_ty)
            tl.store(h_out_ptr + row * hidden + i, x, mask=ok)
        x = x.to(tl.float32)
        scale = 1.0 / tl.sqrt(tl.sum(x * x, 0) / hidden + eps)
        w = tl.load(weight_ptr + i, mask=ok, other=0.0).to(tl.float32)
        tl.store(normed_ptr + row * hidden + i, (x * scale * w).to(normed_ptr.dtype.element_ty), mask=ok)

    return add_rms_norm_kernel


@functools.cache
def silu_source():
    """The SwiGLU kernel's Python function, before triton.jit."""
    import triton.language as tl

    def silu_mul_kernel(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = i < width
        gate = tl.load(gate_up_ptr + row * 2 * width + i, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * 2 * width + width + i, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * width + i, (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty),
                 mask=ok)

    return silu_mul_kernel


@functools.cache
def _jit(source):
    import triton

    return triton.jit(source())


def add_rms_norm(h: torch.Tensor, delta: Optional[torch.Tensor], weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm in one kernel: (h + delta, rms_norm(h + delta) * weight), the sum
    rounded to h's dtype first, as a separate add would; delta None: (h, rms_norm(h) * weight). h, delta
    [rows, hidden] contiguous; one program a row (its sum of squares in one fixed reduction)."""
    n_rows, hidden = h.shape
    if not h.is_contiguous() or (delta is not None and not delta.is_contiguous()):
        raise ValueError("add_rms_norm: h and delta must be contiguous")
    _interpretable(h)
    h_out = torch.empty_like(h) if delta is not None else h
    normed = torch.empty_like(h)
    _jit(norm_source)[(n_rows,)](h, h if delta is None else delta, weight, h_out, normed, hidden, float(eps),
                                 HAS_DELTA=delta is not None, BLOCK=1 << (hidden - 1).bit_length())
    return h_out, normed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [rows, 2 * width] (gate first, as the fused gate/up matmul writes them), in
    float32 rounded once. Returns [rows, width]."""
    n_rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    if not gate_up.is_contiguous():
        raise ValueError("silu_mul: gate_up must be contiguous")
    _interpretable(gate_up)
    out = torch.empty(n_rows, width, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _jit(silu_source)[(n_rows, -(-width // block))](gate_up, out, width, BLOCK=block)
    return out


def _interpretable(t: torch.Tensor) -> None:
    if not t.is_cuda and not interpreted():
        raise ValueError("triton_kernels: CPU tensors run only in Triton's interpreter (TRITON_INTERPRET=1 "
                         "before triton is imported)")


def invariant_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor,
                        scaling: float, split: bool = False) -> torch.Tensor:
    """q [heads, rows, d] (any strides with a unit last one) against keys/values [kv_heads, capacity, d] at
    the rows' positions pos [rows] (key j is seen by a row at position >= j). Returns [rows, heads * d] in q's
    dtype, the layout o_proj reads. capacity must be whole BLOCK_N tiles past every position.
    split: the keys in stretches of SPLIT positions, one program each (a long context's parallelism), and a
    merge in stretch order: the same bits as one program walking them all (a row's first stretch merged into
    nothing is itself, stretches past it are left out), one launch more."""
    n_heads, n_rows, d = q.shape
    n_kv = keys.shape[0]
    if q.stride(-1) != 1 or keys.stride() != values.stride() or keys.stride(-1) != 1:
        raise ValueError("invariant_attention: q, keys and values need unit strides along head_dim, "
                         "keys and values the same layout")
    _interpretable(q)
    out = torch.empty(n_rows, n_heads * d, dtype=q.dtype, device=q.device)
    block_d = max(16, 1 << (d - 1).bit_length())
    n_splits = -(-keys.shape[1] // SPLIT) if split else 1
    if split:
        part_acc = torch.empty(n_heads, n_rows, n_splits, block_d, dtype=torch.float32, device=q.device)
        part_stat = torch.empty(n_heads, n_rows, n_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_stat = out  # not written
    tiles = -(-n_rows // BLOCK_M)
    _jit(attention_source)[(tiles, n_heads, n_splits)](
        q, keys, values, pos, out, part_acc, part_stat,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), out.stride(0),
        n_rows, n_heads // n_kv, d, float(scaling), n_splits,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=block_d, SPLIT=SPLIT, FINAL=not split,
        IEEE=q.dtype == torch.float32)
    if split:
        _jit(merge_source)[(tiles, n_heads)](pos, out, part_acc, part_stat, out.stride(0), n_rows, d, n_splits,
                                            BLOCK_M=BLOCK_M, BLOCK_D=block_d, SPLIT=SPLIT)
    return out
