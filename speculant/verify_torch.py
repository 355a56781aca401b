"""Verification on the device: speculant/verify.py's sampling transforms and verifiers over torch tensors, so
a GPU target's logits never leave the GPU; only (n_accepted, next token) cross to the host, once per step.

Same vocabulary and the same laws as verify.py (the numpy reference they are tested against): probabilities
after top-k, top-p and min-p, then temperature; greedy = the longest prefix equal to the target's argmax, then the
target's token; sampled = modified rejection sampling with the recovered token from normalize(max(0, p - q))
at the first rejection, or the bonus token from p_{k+1}. Probabilities are float64 as in the reference.
The random draws of rejection sampling come from a torch.Generator on the device, so a seed gives a different
(equally exact) stream than the numpy path. A seeded request's coupled draws (verify.coupled_draw) use the very
noise of the numpy path (the same keyed hash, in int64 arithmetic that wraps as uint64's does); the block masses
are summed in another order, so a near tie may break otherwise, and each backend keeps to one path.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import verify
from .verify import COUPLED_BLOCK, SamplingParams


def _signed(x: int) -> int:
    """A uint64 as the int64 of the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(z: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> n) & ((1 << (64 - n)) - 1)


def exponentials(seed: int, positions, ids: torch.Tensor) -> torch.Tensor:
    """verify.exponentials on the device: E(seed, positions[i], ids[i, j]) [n, m] float64 (positions [n] ints,
    ids [n, m] long), bit for bit the numpy values."""
    keys = [verify._mix((seed & verify._MASK) ^ verify._mix((p * verify._GAMMA + 1) & verify._MASK)) for p in positions]
    key = torch.tensor([_signed(k) for k in keys], dtype=torch.long, device=ids.device).view(-1, 1)  # [n, 1]
    z = (ids + 1) * _signed(verify._GAMMA) + key  # wraps: two's complement
    z = z ^ _shr(z, 30)
    z = z * _signed(verify._M1)
    z = z ^ _shr(z, 27)
    z = z * _signed(verify._M2)
    z = z ^ _shr(z, 31)
    w = (_shr(z, 12).to(torch.float64) + 0.5) * 2.0 ** -52  # (0, 1)
    return verify.neg_log(w, _torch_frexp, torch.where)


def _torch_frexp(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    f, e = torch.frexp(w)
    return f, e.to(torch.float64)


def coupled_draws(probs: torch.Tensor, seed: int, positions) -> torch.Tensor:
    """verify.coupled_draw for each row of probs [n, V] at positions [n] (ints): tokens [n] long, on the device,
    with no host round trip. The block race, then the race among the winning block's tokens."""
    n, v = probs.shape
    dev = probs.device
    if v <= COUPLED_BLOCK:
        ids = torch.arange(v, device=dev).expand(n, v)
        return (probs / exponentials(seed, positions, ids)).argmax(-1)
    n_blocks = -(-v // COUPLED_BLOCK)
    padded = torch.nn.functional.pad(probs, (0, n_blocks * COUPLED_BLOCK - v))  # [n, blocks * B]
    mass = padded.view(n, n_blocks, COUPLED_BLOCK).sum(-1)  # [n, blocks]
    blocks = torch.arange(n_blocks, device=dev).expand(n, n_blocks)
    block = (mass / exponentials(seed ^ verify._BLOCK_KEY, positions, blocks)).argmax(-1, keepdim=True)  # [n, 1]
    ids = block * COUPLED_BLOCK + torch.arange(COUPLED_BLOCK, device=dev)  # [n, B]
    weights = padded.gather(1, ids)  # the padding's ids have no mass
    return ids.gather(1, (weights / exponentials(seed, positions, ids)).argmax(-1, keepdim=True))[:, 0]


def verify_coupled(draft_tokens: torch.Tensor, target_probs: torch.Tensor, seed: int, position: int) -> tuple[int, int]:
    """A seeded request's verification: the target's coupled draw at each row (positions position.. position+k),
    drafts kept while they equal it, then its draw. draft_tokens [k] long, target_probs [k+1, V]; one transfer."""
    k = draft_tokens.shape[0]
    return _kept_while_equal(draft_tokens, coupled_draws(target_probs, seed, range(position, position + k + 1)))


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, V] (any float) -> float64 probabilities [n, V], rows summing to 1 (verify.probs_from_logits:
    top-k, top-p and min-p on the model's own probabilities, then the temperature)."""
    x = logits.to(torch.float64)
    x = x - x.amax(-1, keepdim=True)  # the maximum off first: x / T overflows for tiny T
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[:, -1:]  # [n, 1]; ties at the cut are all kept
        x = torch.where(x >= kth, x, torch.full_like(x, -float("inf")))
    probs = torch.exp(x)
    probs = probs / probs.sum(-1, keepdim=True)
    keep = None  # [n, V] bool
    if params.top_p < 1.0:
        ordered = torch.sort(probs, dim=-1, descending=True, stable=True).values  # [n, V]
        cum = torch.cumsum(ordered, dim=-1)
        at = torch.searchsorted(cum, torch.full_like(cum[:, :1], params.top_p)).clamp_(max=x.shape[-1] - 1)
        keep = probs >= ordered.gather(-1, at)  # the probability of the last token the nucleus needs
    if params.min_p > 0.0:
        above = probs >= params.min_p * probs.amax(-1, keepdim=True)
        keep = above if keep is None else keep & above
    if keep is None and params.temperature == 1.0:
        return probs
    if keep is not None:
        x = torch.where(keep, x, torch.full_like(x, -float("inf")))
    probs = torch.exp(x / params.temperature)  # x <= 0 with a maximum of 0 per row: no overflow
    return probs / probs.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One draw from a normalised [V] distribution (inverse CDF, as verify.sample); a 0-d long tensor."""
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.rand((1,), generator=generator, device=probs.device, dtype=cdf.dtype) * cdf[-1]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[-1] - 1)[0]


def verify_greedy(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """draft_tokens [k] long, target_logits [k+1, V] -> (n_accepted, next_token); one transfer to the host."""
    return _kept_while_equal(draft_tokens, target_logits.argmax(-1))


def _kept_while_equal(draft_tokens: torch.Tensor, chosen: torch.Tensor) -> tuple[int, int]:
    """The drafts [k] kept while they equal the target's chosen tokens [k+1], then its token there:
    (n_accepted, next_token), one transfer to the host."""
    k = draft_tokens.shape[0]
    match = (chosen[:k] == draft_tokens).to(torch.long)  # [k]
    n = torch.cumprod(match, 0).sum() if k else torch.zeros((), dtype=torch.long, device=chosen.device)
    n_accepted, token = torch.stack([n, chosen.gather(0, n.view(1))[0]]).tolist()  # no 0-d index: it syncs
    return n_accepted, token


def verify_sampled(draft_tokens: torch.Tensor, draft_probs: Optional[torch.Tensor], target_probs: torch.Tensor,
                   generator: Optional[torch.Generator] = None) -> tuple[int, int]:
    """Modified rejection sampling (verify.verify_sampled) without a host round trip until the result.

    draft_tokens [k] long; draft_probs [k, V] (q) or None for a deterministic draft; target_probs [k+1, V]."""
    k, n_vocab = draft_tokens.shape[0], target_probs.shape[-1]
    dev = target_probs.device
    if draft_probs is None:
        q = torch.nn.functional.one_hot(draft_tokens, n_vocab).to(target_probs.dtype)  # [k, V]
    else:
        q = draft_probs.to(target_probs.dtype)
    q = torch.cat([q, torch.zeros(1, n_vocab, dtype=q.dtype, device=dev)])  # [k+1, V]: no draft at the bonus row
    rows = torch.arange(k, device=dev)
    p_x, q_x = target_probs[rows, draft_tokens], q[rows, draft_tokens]  # [k] p_i(x_i), q_i(x_i)
    u = torch.rand((k,), generator=generator, device=dev, dtype=p_x.dtype)
    rejected = torch.cat([u * q_x >= p_x, torch.ones(1, dtype=torch.bool, device=dev)])  # [k+1]: accept iff u < p/q
    j = rejected.to(torch.int8).argmax()  # the first rejection, k when all were accepted
    p_j = target_probs.index_select(0, j.view(1))[0]  # indexing by a 0-d device tensor would sync
    r = (p_j - q.index_select(0, j.view(1))[0]).clamp_(min=0.0)  # at j = k: q is 0, so r = p_{k+1} (the bonus law)
    total = r.sum()
    r = torch.where(total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), p_j)  # total 0 only when p == q
    n_accepted, token = torch.stack([j.to(torch.long), sample(r, generator)]).tolist()
    return n_accepted, token
