"""A torch backend for GPUs: static KV buffers, fixed-shape passes, and one CUDA graph per pass shape.

A decode step on a GPU is launch-bound: a 1.5B model's eager pass issues ~400 small kernels (issue 15
measured 38 ms eager vs 4.4 ms as one captured CUDA graph on an H200). A graph replays a fixed sequence of
kernels on fixed buffers, so everything a pass touches is allocated once and every pass has a fixed shape:
  * KV: one preallocated buffer [layers, 2, kv_heads, capacity, head_dim]; a pass writes its rows at their
    absolute positions (index_copy_ from a position tensor, so the same graph serves every position).
  * rows: a pass over n tokens is padded to a shape class (1, 2, 4, ... 64 rows, longer passes in chunks of
    64). Padding rows get the positions after the real ones; what they write there is stale and masked, and
    a later pass overwrites it (capacity keeps room past n_ctx for them and for graph warm-up).
  * attention: a target's (rows set) runs over fixed KV blocks at absolute offsets (KV_BLOCK positions each)
    with an online softmax and a position mask, as in torch.py. Blocks past a row's position contribute
    exactly 0, so a row's result does not depend on how many blocks a pass visits; a graph is captured per
    (rows, blocks). A draft's (rows None) is one scaled_dot_product_attention call over the visited blocks.
    On CUDA both run Triton kernels between the matmuls instead (triton_kernels: RoPE with the K/V stores, the
    same online softmax over the same absolute offsets, residual add + RMSNorm, SwiGLU; 9 launches a layer
    against ~25), which read the positions on the device, so one graph per row count serves every position.
  * kernels: a graph replays every kernel of a pass, so their number sets a small model's pass time (an H200
    runs ~3 us per kernel). q/k/v and gate/up are one matmul each (the modules keep their weights as views
    into the fused ones), RoPE runs on q and k at once, the masks are made once per pass, and RMSNorm is
    torch's fused rms_norm: 1.5B 6.1 -> 3.7 ms per pass, 0.5B draft 4.7 -> 1.8 ms (docs/bench/gpu/).

Exactness: a matmul's rounding depends on its row count M (measured on this CPU, fp32: up to 2.3e-5 between
M = 1 and M = 16 for one row), so passes of different shape classes are NOT bit-identical. A target that
needs batched == one-at-a-time logits (greedy identity) sets `rows`: every pass then runs exactly that many
rows (longer ones in chunks), one shape for everything, and a token's logits are bit-identical however the
passes are cut. A draft model needs no invariance and uses the shape classes. On a GPU a 16-row pass of a
launch- or memory-bound model costs about what a 1-row pass does, which is what makes the fixed width cheap.

The forward pass is written here (embedding, RMSNorm, attention, MLP, LM head of the Llama/Qwen2 family) over
the weights of a transformers model, so nothing in it depends on transformers' cache API; the text side
(tokenizer, specials) is TorchBackend's.
"""

from __future__ import annotations

import sys
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from .. import verify_torch
from ..errors import ModelError, SettingsError, nonfinite_logits
from ..verify import SamplingParams
from . import triton_kernels
from .base import common_prefix
from .torch import KV_BLOCK, TorchBackend

SHAPE_CLASSES = (1, 2, 4, 8, 16, 32, 64)
# the decoder layers _run computes (no q/k norms, no extra layer norms, no sliding window, no soft-capping)
MODEL_TYPES = ("llama", "qwen2")
MAX_ROWS = SHAPE_CLASSES[-1]


def shape_class(n: int) -> int:
    """The smallest shape class holding n rows (n <= MAX_ROWS)."""
    return next(c for c in SHAPE_CLASSES if c >= n)


def _joined(parts: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """The tensor that parts [rows_i, ...] are consecutive slices of (layers fused before: another backend over
    the same model), as a view; None when they are not."""
    first = parts[0]
    at = first.storage_offset()
    for t in parts:
        if t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or t.storage_offset() != at \
                or not t.is_contiguous():
            return None
        at += t.numel()
    shape = (sum(t.shape[0] for t in parts),) + tuple(first.shape[1:])
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape)


def _fuse_linears(mods) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One weight [sum of out, in] (and bias) for linear layers that read the same input: one matmul instead
    of several. The modules keep their parameters as views into it, so no weight is held twice (nor when the
    model was fused already: then the fused weight is a view of theirs)."""
    weights = [m.weight.data for m in mods]
    weight = _joined(weights)
    if weight is None:
        weight = torch.cat(weights)
    bias = None
    if any(m.bias is not None for m in mods):
        biases = [m.bias.data if m.bias is not None else m.weight.new_zeros(m.weight.shape[0]) for m in mods]
        bias = _joined(biases) if all(m.bias is not None for m in mods) else None
        if bias is None:
            bias = torch.cat(biases)
    at = 0
    for m in mods:
        rows = m.weight.shape[0]
        m.weight.data = weight[at:at + rows]
        if m.bias is not None:
            m.bias.data = bias[at:at + rows]
        at += rows
    return weight, bias


def attention_masks(q_pos: torch.Tensor, offsets: torch.Tensor, n_blocks: int) -> list[torch.Tensor]:
    """Additive float32 masks [rows, KV_BLOCK] per KV block: 0 where a key position <= the row's, else -inf.
    Made once per pass (every layer reads the same ones)."""
    return [torch.where((offsets + b * KV_BLOCK)[None, :] > q_pos[:, None], -float("inf"), 0.0)
            for b in range(n_blocks)]


def block_attention(q, keys, values, masks: list[torch.Tensor], scaling: float) -> torch.Tensor:
    """q [heads, rows, d] against keys/values [kv_heads, capacity, d] over the KV blocks that masks
    ([group*rows, KV_BLOCK] each, q's rows repeated per head of a group) cover, with an online softmax in
    float32. Returns [rows, heads * d]. Every pass runs block 0 through the same first-block code, so a row's
    result does not depend on how many blocks its pass visits (later blocks past it add exactly 0)."""
    n_heads, n_rows, d = q.shape
    n_kv = keys.shape[0]
    qg = q.reshape(n_kv, n_heads // n_kv * n_rows, d)  # head h uses kv head h // group
    run_max = run_sum = acc = None
    for b, mask in enumerate(masks):
        b0 = b * KV_BLOCK
        k_blk, v_blk = keys[:, b0:b0 + KV_BLOCK], values[:, b0:b0 + KV_BLOCK]  # [kv_heads, KV_BLOCK, d]
        # mask + scaling * scores in float32: one kernel for the scale, the cast and the mask
        scores = torch.add(mask, torch.matmul(qg, k_blk.transpose(1, 2)), alpha=scaling)  # [kv, group*rows, B]
        if run_max is None:  # block 0 holds position 0, so no row of it is fully masked
            run_max = scores.amax(-1)
            p = torch.exp(scores - run_max[..., None])
            run_sum = p.sum(-1)
            acc = torch.matmul(p.to(values.dtype), v_blk).float()
            continue
        new_max = torch.maximum(run_max, scores.amax(-1))
        rescale = torch.exp(run_max - new_max)
        p = torch.exp(scores - new_max[..., None])
        run_sum = run_sum * rescale + p.sum(-1)
        acc = acc * rescale[..., None] + torch.matmul(p.to(values.dtype), v_blk).float()
        run_max = new_max
    out = (acc / run_sum[..., None]).to(q.dtype)  # [kv_heads, group*rows, d]
    return out.reshape(n_heads, n_rows, d).transpose(0, 1).reshape(n_rows, n_heads * d)


def fused_attention(q, keys, values, keep: torch.Tensor, scaling: float) -> torch.Tensor:
    """block_attention's result (rounding aside) in one scaled_dot_product_attention call over the keys that
    keep [group*rows, n_keys] (True: attend) covers, for a draft model, which needs no invariance: its
    rounding depends on the number of keys. Returns [rows, heads * d]."""
    n_heads, n_rows, d = q.shape
    n_kv = keys.shape[0]
    n_keys = keep.shape[-1]
    qg = q.reshape(1, n_kv, n_heads // n_kv * n_rows, d)  # kv heads as the batch heads: no key copy for GQA
    out = torch.nn.functional.scaled_dot_product_attention(qg, keys[None, :, :n_keys], values[None, :, :n_keys],
                                                           attn_mask=keep, scale=scaling)
    return out.reshape(n_heads, n_rows, d).transpose(0, 1).reshape(n_rows, n_heads * d)


def _eps(norm) -> float:
    """An RMSNorm module's epsilon (transformers names it variance_epsilon or eps)."""
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _rms_norm(norm, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), norm.weight, _eps(norm))


class StaticTorchBackend(TorchBackend):
    """TorchBackend with a static KV buffer and fixed-shape passes, captured as CUDA graphs on CUDA.

    rows: None = shape classes (a draft model); an int = every pass has exactly that many rows (a target
    whose batched logits must equal one-at-a-time logits). graphs: capture CUDA graphs (default: on CUDA).
    kernels: "triton" (triton_kernels between the matmuls: RoPE with the K/V stores, attention, residual add +
    RMSNorm, SwiGLU; invariant), "torch" (block_attention for a target, fused_attention for a draft), or None:
    Triton's on CUDA where they build and compute what torch does (triton_kernels.check), else torch. (A draft
    needs no invariance; Triton's are fewer launches.)"""

    def __init__(self, model, tokenizer=None, *, rows: Optional[int] = None, graphs: Optional[bool] = None,
                 kernels: Optional[str] = None, **kwargs):
        super().__init__(model, tokenizer, **kwargs)
        if rows is not None and not (isinstance(rows, int) and 1 <= rows <= MAX_ROWS):
            raise SettingsError(f"rows must be an integer in [1, {MAX_ROWS}] or None, got {rows!r}")
        on_cuda = self.device.type == "cuda"
        if graphs and not on_cuda:
            raise SettingsError(f"CUDA graphs need a CUDA device; this model is on {self.device}")
        if kernels is None:  # Triton's where they build and check out on this device (once per device)
            kernels = "triton" if on_cuda and not triton_kernels.check(str(self.device), self.dtype) else "torch"
        if kernels not in ("triton", "torch"):
            raise SettingsError(f"kernels must be 'triton' or 'torch', got {kernels!r}")
        if kernels == "triton" and not triton_kernels.available():
            raise SettingsError("kernels='triton' needs triton (it ships with CUDA builds of torch)")
        if kernels == "triton" and not on_cuda and not triton_kernels.interpreted():
            raise SettingsError(f"kernels='triton' on {self.device} run only in Triton's interpreter "
                                "(TRITON_INTERPRET=1, for tests); use kernels='torch'")
        self.rows = rows
        self.kernels = kernels
        self.graphs = on_cuda if graphs is None else bool(graphs)
        cfg = model.config
        base = model.model
        if getattr(cfg, "model_type", None) not in MODEL_TYPES or not all(
                hasattr(layer, a) for layer in base.layers
                for a in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")):
            raise ModelError(f"{self.name}: the static backend computes {' and '.join(MODEL_TYPES)} decoder layers "
                             f"only, not {getattr(cfg, 'model_type', None)!r}")
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(getattr(cfg, "num_key_value_heads", None) or self.n_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads)
        # past n_ctx: room for padding rows (< MAX_ROWS) and a scratch stretch for graph warm-up (MAX_ROWS)
        self.capacity = -(-(self.n_ctx + 2 * MAX_ROWS) // KV_BLOCK) * KV_BLOCK
        self.kv = torch.zeros(len(base.layers), 2, self.n_kv, self.capacity, self.head_dim, dtype=self.dtype,
                              device=self.device)  # [layers, 2 (k, v), kv_heads, capacity, head_dim]
        self._offsets = torch.arange(KV_BLOCK, device=self.device)  # [KV_BLOCK]
        rot = base.rotary_emb
        self._inv_freq = rot.inv_freq.to(device=self.device, dtype=torch.float32)  # [head_dim / 2]
        self._rope_scale = float(getattr(rot, "attention_scaling", 1.0))
        # a pass is launch-bound on a GPU: q/k/v and gate/up each become one matmul
        with torch.no_grad():
            self._qkv = [_fuse_linears((l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj))
                         for l in base.layers]
            self._gate_up = [_fuse_linears((l.mlp.gate_proj, l.mlp.up_proj)) for l in base.layers]
        # (weight, eps) of every RMSNorm in order: layer inputs, post-attention, ..., the final norm
        self._norms = [(n.weight, _eps(n))
                       for n in [m for layer in base.layers
                                 for m in (layer.input_layernorm, layer.post_attention_layernorm)] + [base.norm]]
        self._silu = getattr(cfg, "hidden_act", "silu") == "silu"  # SwiGLU in a Triton kernel (else torch's act)
        self._graphs: dict = {}  # (rows, n_blocks, draft attention) -> (graph, ids, pos, logits)
        self._pool = None
        self._gen: Optional[torch.Generator] = None  # device random draws: sampled verification, a draft's draws

    # -- one fixed-shape pass -----------------------------------------------------------------------------
    def _run(self, ids: torch.Tensor, pos: torch.Tensor, n_blocks: int) -> torch.Tensor:
        """ids, pos [rows] -> float32 logits [rows, V]; writes every row's K/V at its position."""
        if self.kernels == "triton":
            return self._run_triton(ids, pos, split=n_blocks * KV_BLOCK > triton_kernels.SPLIT)
        base = self.model.model
        n, d = ids.shape[0], self.head_dim
        n_qk = (self.n_heads + self.n_kv) * d
        h = base.embed_tokens(ids)  # [rows, hidden]
        freqs = pos[:, None].float() * self._inv_freq[None, :]  # [rows, d/2]
        cos, sin = freqs.cos() * self._rope_scale, freqs.sin() * self._rope_scale
        cos = torch.cat((cos, cos), -1).to(h.dtype)[:, None]  # [rows, 1, d]
        sin = torch.cat((-sin, sin), -1).to(h.dtype)[:, None]  # rotate_half(x) * sin == roll(x, d/2) * this
        q_pos = pos.repeat(self.n_heads // self.n_kv)  # [group*rows]: the rows of every head of a kv group
        if self.rows is None:  # a draft (no invariance): one attention kernel over the visited blocks
            keep = torch.arange(n_blocks * KV_BLOCK, device=pos.device)[None, :] <= q_pos[:, None]
            attend = lambda q, k, v, scaling: fused_attention(q, k, v, keep, scaling)  # noqa: E731
        else:
            masks = attention_masks(q_pos, self._offsets, n_blocks)
            attend = lambda q, k, v, scaling: block_attention(q, k, v, masks, scaling)  # noqa: E731
        for i, layer in enumerate(base.layers):
            attn = layer.self_attn
            qkv = torch.nn.functional.linear(_rms_norm(layer.input_layernorm, h), *self._qkv[i])  # [rows, (H+2KV)d]
            qk = qkv[:, :n_qk].view(n, self.n_heads + self.n_kv, d)
            qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)  # RoPE on q and k at once
            q, k = qk[:, :self.n_heads].transpose(0, 1), qk[:, self.n_heads:].transpose(0, 1)  # [heads, rows, d]
            v = qkv[:, n_qk:].view(n, self.n_kv, d).transpose(0, 1)  # [kv_heads, rows, d]
            self.kv[i, 0].index_copy_(1, pos, k)
            self.kv[i, 1].index_copy_(1, pos, v)
            h = h + attn.o_proj(attend(q, self.kv[i, 0], self.kv[i, 1], attn.scaling))
            gate, up = torch.nn.functional.linear(_rms_norm(layer.post_attention_layernorm, h),
                                                  *self._gate_up[i]).chunk(2, -1)
            h = h + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
        return self.model.get_output_embeddings()(_rms_norm(base.norm, h)).float()  # [rows, V]

    def _run_triton(self, ids: torch.Tensor, pos: torch.Tensor, split: bool) -> torch.Tensor:
        """_run with Triton kernels between the matmuls (triton_kernels), 9 launches a layer instead of ~25:
        RoPE with the K/V stores, attention (both read the positions on the device, so any number of KV blocks),
        each residual add with the RMSNorm after it, and SwiGLU. split: the pass reaches past the first SPLIT
        positions, so the attention splits the keys (a row before them gets the same bits either way, a row
        past them is in such a pass whichever pass it is in)."""
        base = self.model.model
        tk = triton_kernels
        h, x = tk.add_rms_norm(base.embed_tokens(ids), None, *self._norms[0])  # h [rows, hidden], x: normed
        for i, layer in enumerate(base.layers):
            attn = layer.self_attn
            k_cache, v_cache = self.kv[i, 0], self.kv[i, 1]  # [kv_heads, capacity, d]
            qkv = torch.nn.functional.linear(x, *self._qkv[i])  # [rows, (H+2KV)d]
            q = tk.rope_and_store(qkv, pos, self._inv_freq, self._rope_scale, k_cache, v_cache, self.n_heads,
                                  self.n_kv)  # [heads, rows, d]
            out = tk.invariant_attention(q, k_cache, v_cache, pos, attn.scaling, split)  # [rows, heads * d]
            h, x = tk.add_rms_norm(h, attn.o_proj(out), *self._norms[2 * i + 1])
            gate_up = torch.nn.functional.linear(x, *self._gate_up[i])  # [rows, 2 * intermediate]
            if self._silu:
                act = tk.silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, -1)
                act = layer.mlp.act_fn(gate) * up
            h, x = tk.add_rms_norm(h, layer.mlp.down_proj(act), *self._norms[2 * i + 2])
        return self.model.get_output_embeddings()(x).float()  # [rows, V]

    def _graph(self, rows: int, n_blocks: int):
        """The captured graph for this shape (captured on first use; warm-up writes only scratch slots)."""
        if self.kernels == "triton":  # one graph serves every position before SPLIT, one every position past it
            n_blocks = 1 if n_blocks * KV_BLOCK <= triton_kernels.SPLIT else self.capacity // KV_BLOCK
        key = (rows, n_blocks, self.rows is None)  # the last: which attention _run takes
        if key not in self._graphs:
            ids = torch.zeros(rows, dtype=torch.long, device=self.device)
            pos = torch.arange(self.capacity - rows, self.capacity, device=self.device)  # scratch, never read
            with torch.cuda.device(self.device):  # torch.cuda.graph captures on the current device's stream
                stream = torch.cuda.Stream(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        self._run(ids, pos, n_blocks)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    logits = self._run(ids, pos, n_blocks)
            self._graphs[key] = (graph, ids, pos, logits)
        return self._graphs[key]

    def _pass(self, chunk, start: int) -> torch.Tensor:
        """One fixed-shape pass over up to MAX_ROWS tokens at positions start.. -> logits [len(chunk), V].
        chunk: token ids, or a long tensor of them already on the device (a draft step's chosen token)."""
        n_real = len(chunk)
        rows = self.rows or shape_class(n_real)
        if torch.is_tensor(chunk):  # padding rows repeat the last token
            ids = chunk if rows == n_real else torch.cat([chunk, chunk[-1:].expand(rows - n_real)])
        else:  # pinned (graphs run on CUDA only): a copy from pageable memory would make the host wait for the GPU
            ids = torch.tensor(list(chunk) + [chunk[-1]] * (rows - n_real), dtype=torch.long,
                               pin_memory=self.graphs)
        n_blocks = (start + rows - 1) // KV_BLOCK + 1
        if self.graphs:
            graph, g_ids, g_pos, g_logits = self._graph(rows, n_blocks)
            g_ids.copy_(ids, non_blocking=True)
            positions = torch.arange(start, start + rows)
            g_pos.copy_(positions.pin_memory(), non_blocking=True)
            graph.replay()
            return g_logits[:n_real].clone()  # the graph's output buffer is overwritten by the next replay
        pos = torch.arange(start, start + rows, device=self.device)
        return self._run(ids.to(self.device), pos, n_blocks)[:n_real]

    @torch.no_grad()
    def decode_device(self, tokens, start: int, n_logits: int) -> torch.Tensor:
        """Evaluate tokens (ids, or a long tensor of them on the device) at positions start..; float32 logits of
        the last n_logits on the device [n_logits, V]."""
        width = self.rows or MAX_ROWS
        first_logit = len(tokens) - max(n_logits, 0)
        out = []
        for c in range(0, len(tokens), width):
            chunk = tokens[c:c + width]
            logits = self._pass(chunk, start + c)
            if c + len(chunk) > first_logit:
                out.append(logits[max(first_logit - c, 0):])
        if not out:
            return torch.empty(0, self.n_vocab, device=self.device)
        return torch.cat(out)

    def sync_device(self, context: Sequence[int], n_logits: int) -> torch.Tensor:
        """Backend.sync, with the logits left on the device [n_logits, V]."""
        if len(context) > self.n_ctx:
            raise RuntimeError(f"{self.name}: {len(context)} tokens exceed n_ctx={self.n_ctx}")
        common = common_prefix(self.tokens[:min(len(self.tokens), len(context) - n_logits)], context)
        self.rewind(common)
        logits = self.decode_device(context[common:], common, n_logits)
        self.tokens.extend(int(t) for t in context[common:])
        return logits

    @torch.no_grad()
    def draft_steps(self, context: Sequence[int], params: SamplingParams, n_vocab: int, seed: int,
                    k: int, read_each: bool = True) -> Iterator[tuple[int, float, Optional[torch.Tensor]]]:
        """A draft model's steps with each token chosen on the device and fed to the next pass there, so no
        logits cross to the host. Yields (token, confidence, q) per step: the argmax (greedy) or a draw from q
        (a seeded request's coupled draw, with the target's noise at the token's position; else from the seeded
        generator), q being the draft's probabilities over n_vocab ids [n_vocab] float64, left on the device (None
        when greedy), and the draft's max probability. Resuming the generator runs the next step's pass; at most k
        steps.
        read_each: the caller decides step by step, so each step's token and confidence cross (one small
        transfer a step); False: all k passes run back to back and one transfer brings every token (a draft of
        fixed length, whose decisions do not depend on the values)."""
        gen = None
        if not params.greedy and not params.couples:
            if self._gen is None:
                self._gen = torch.Generator(device=self.device)
            gen = self._gen.manual_seed(seed)

        def choose(logits: torch.Tensor, at: int):
            """logits [1, V] of the step whose token goes to position `at` -> token [1] long, confidence [1]
            float64, q [n_vocab] (None when greedy)."""
            v = logits.shape[-1]
            if v > n_vocab:
                logits = logits[:, :n_vocab]
            elif v < n_vocab:  # the draft's vocabulary padded to the target's: the others get no probability
                logits = torch.nn.functional.pad(logits, (0, n_vocab - v), value=-float("inf"))
            if params.greedy:
                return logits.argmax(-1), torch.softmax(logits.double(), -1).amax(-1), None
            q = verify_torch.probs_from_logits(logits, params)[0]  # [n_vocab]
            if params.couples:  # the target's noise at the token's position (verify.coupled_draw)
                return verify_torch.coupled_draws(q.view(1, -1), params.seed, [at]), q.amax().view(1), q
            return verify_torch.sample(q, gen).view(1), q.amax().view(1), q

        logits = self.sync_device(context, 1)  # [1, V]
        start = len(self.tokens)  # where the first drafted token goes
        if read_each:
            for i in range(k):
                token, confidence, q = choose(logits, start + i)
                t, c = torch.cat([token.double(), confidence]).tolist()
                yield int(t), c, q
                if i + 1 < k:
                    logits = self.decode_device(token, start + i, 1)
                    self.tokens.append(int(t))
            return
        picks = []
        for i in range(k):
            picks.append(choose(logits, start + i))
            if i + 1 < k:
                logits = self.decode_device(picks[-1][0], start + i, 1)
        values = torch.stack([torch.cat([t.double(), c]) for t, c, _ in picks]).tolist()  # [k, 2]: one transfer
        self.tokens.extend(int(t) for t, _ in values[:-1])
        for (t, c), (_, _, q) in zip(values, picks):
            yield int(t), c, q

    def verify_step(self, context: Sequence[int], k: int, draft_probs: Optional[np.ndarray],
                    params: SamplingParams, rng: np.random.Generator) -> tuple[int, int]:
        """One target pass over the last k+1 tokens of context (the last token and k drafts) and their
        verification on the device (verify_torch); returns (n_accepted, next token), the only host transfer."""
        logits = self.sync_device(context, k + 1)  # [k+1, V] on the device
        # read after the verification's own transfer (no extra wait): NaN rows would pick token 0 or EOS silently
        finite = torch.isfinite(logits[0].sum())
        drafts = torch.tensor(list(context[len(context) - k:]), dtype=torch.long).to(self.device)  # [k]
        if params.greedy:
            out = verify_torch.verify_greedy(drafts, logits)
        elif params.couples:  # a seeded request: drafts kept while they equal the target's coupled draws
            out = verify_torch.verify_coupled(drafts, verify_torch.probs_from_logits(logits, params), params.seed,
                                              len(context) - k)
        else:
            if self._gen is None:
                self._gen = torch.Generator(device=self.device)
            self._gen.manual_seed(int(rng.integers(2**63)))  # the request's seed decides the device draws too
            # q [k, V]: numpy, or already on the device when a static draft chose there (draft_steps)
            q = None if draft_probs is None else torch.as_tensor(draft_probs).to(self.device)
            out = verify_torch.verify_sampled(drafts, q, verify_torch.probs_from_logits(logits, params), self._gen)
        if not bool(finite):
            raise nonfinite_logits(self.name)
        return out

    def _decode(self, tokens: Sequence[int], start: int, n_logits: int) -> np.ndarray:
        return self.decode_device(tokens, start, n_logits).cpu().numpy()

    def cost_profile(self) -> Optional[dict[int, float]]:
        """r(n) by construction for a target of fixed width: n tokens take ceil(n / rows) passes of the same shape
        (the adaptive policy then times them itself); None for a draft (shape classes)."""
        if self.rows is None:
            return None
        return {n: float(-(-n // self.rows)) for n in range(1, 65)}  # a verify pass: at most 64 tokens

    def forward(self, *args, **kwargs):
        raise ModelError(f"{self.name}: the static backend runs whole models only (no layer subsets)")

    def close(self) -> None:
        self._graphs.clear()
        super().close()


def load_static_backend(model_name_or_path, dtype=None, device: Optional[str] = None, *, rows: Optional[int] = 16,
                        graphs: Optional[bool] = None, n_ctx: int = 4096, threads: Optional[int] = None,
                        kernels: Optional[str] = None) -> TorchBackend:
    """load_torch_backend's model and tokenizer (registered name, GGUF or transformers directory) behind the
    static backend. rows: the fixed pass width (None: shape classes, for a draft). A model of another type
    than MODEL_TYPES stays on the TorchBackend (with a warning), which runs transformers' own layers."""
    from .torch import load_torch_backend

    tb = load_torch_backend(model_name_or_path, dtype, device, n_ctx=n_ctx, threads=threads)
    model_type = getattr(tb.model.config, "model_type", None)
    if model_type not in MODEL_TYPES:  # e.g. Gemma 3 (q/k norms, four norms a layer): transformers' own modules
        print(f"speculant: warning: {tb.name} ({model_type}) runs on the eager torch backend: the static one (CUDA "
              f"graphs) computes {' and '.join(MODEL_TYPES)} layers only", file=sys.stderr)
        return tb
    return StaticTorchBackend(tb.model, tb.tokenizer, name=tb.name, n_ctx=tb.n_ctx, specials=tb.specials,
                              source=tb.source, rows=rows, graphs=graphs, kernels=kernels)
