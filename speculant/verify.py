"""Verification of drafted tokens: pure functions over arrays.

Vocabulary (as in vLLM's rejection sampler, after Leviathan et al. 2023 / Chen et al. 2023):
- *draft tokens* x_1..x_k, proposed by a drafter with probabilities q_i (None for a deterministic drafter,
  which is verified as q_i = one-hot(x_i): that keeps n-gram and greedy drafts lossless at any temperature);
- *target probabilities* p_1..p_{k+1}, from one target pass over [last token, x_1..x_k];
- *accepted* tokens: the longest prefix that passes the test (greedy: x_i == argmax p_i; sampled: u_i < p_i(x_i) / q_i(x_i));
- the *recovered* token, sampled from normalize(max(0, p_j - q_j)) at the first rejection j;
- the *bonus* token, sampled from p_{k+1} when all k drafts were accepted.
Output = accepted + (recovered or bonus): always at least one token, exactly distributed as the target's.

A seeded request draws differently (`SamplingParams.couples`; Gumbel-max coupling, Daliri et al. 2024, "Coupling
without Communication and Drafter-Invariant Speculative Decoding"): the token at output position t is
argmax_i p_t(i) / E(seed, t, i), E an Exp(1) variate keyed by seed, position and token id (`coupled_draw`, in two
races: blocks of tokens, then tokens), which is a draw from p_t. Plain decoding takes that token; verification
keeps a draft while it equals it and emits it at the first mismatch (`verify_greedy_lazy` with these draws). So
the output is a fixed function of the target's rows and the seed, whatever was drafted; a draft model that drafts
argmax q_t(i) / E(seed, t, i) with the same E is accepted with probability >= (1 - TV) / (1 + TV) (against 1 - TV
by rejection sampling), and a one-hot draft is kept with p(x), as by rejection sampling.

Sampling settings are applied to target and draft logits alike, so p and q are the distributions the user
asked for: first `adjust_logits` (logit bias, then repetition, frequency and presence penalties: these depend on
the tokens before each position, which in a verify pass include the drafts before it), then `probs_from_logits`
(temperature, top-k, top-p, min-p). Greedy decoding takes the argmax of the adjusted logits.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np

from .errors import SettingsError


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into a distribution. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    seed: Optional[int] = None
    # logit adjustments, as OpenAI's and vLLM's request fields (adjust_logits)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), e.g. -100 bans a token
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output holds; [-2, 2]
    frequency_penalty: float = 0.0  # times the token's count in the output; [-2, 2]
    repetition_penalty: float = 1.0  # > 1 discourages tokens of prompt or output: logits > 0 / r, < 0 * r
    # which tokens the penalties count: None, as vLLM and OpenAI (repetition: the prompt and the output;
    # presence and frequency: the output); N >= 1, as llama.cpp's repeat_last_n: all three over the last N
    # tokens before the position, prompt included
    penalty_last_n: Optional[int] = None
    # False: the penalties count the output alone (llama-cpp-python's Llama, whose penalties sampler sees only the
    # tokens it sampled: with penalty_last_n N, the last N of the output)
    penalize_prompt: bool = True
    # position-keyed draws (coupled_draw): True, False (rejection sampling), None: whenever a seed is given
    coupled: Optional[bool] = None
    # llama.cpp's infill sampler (llama-server's "samplers": [..., "infill"]; infill_keep): the vocabulary it
    # reads, and the sampler of INFILL_STAGES it comes after ("": before them all)
    infill: Optional["InfillVocab"] = None
    infill_after: str = "temperature"

    def __post_init__(self):
        if isinstance(self.logit_bias, dict):  # {token id: bias}, as OpenAI's field, is taken as its pairs
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float, np.integer, np.floating)) or isinstance(v, bool):
                shown = name.replace("_", "-") if name in ("top_p", "min_p") else name.replace("_", " ")
                raise SettingsError(f"{shown} must be a number, got {v!r}")
        for name in ("top_k", "seed"):
            v = getattr(self, name)
            if not (v is None and name == "seed") and (not isinstance(v, (int, np.integer)) or isinstance(v, bool)):
                raise SettingsError(f"{name.replace('_', '-')} must be an integer, got {v!r}")
            if v is not None:  # a numpy integer as a Python one: mixed with Python ints later, it overflowed
                object.__setattr__(self, name, int(v))
        try:
            pairs = [(t, b) for t, b in self.logit_bias]
        except (TypeError, ValueError):
            raise SettingsError(f"logit bias must be {{token id: bias}} or (token id, bias) pairs, got "
                                f"{self.logit_bias!r}") from None
        object.__setattr__(self, "logit_bias", tuple(pairs))  # an iterator is read once
        if not all(isinstance(b, (int, float, np.integer, np.floating)) and not isinstance(b, bool) for _, b in pairs):
            raise SettingsError(f"logit bias values must be numbers, got {self.logit_bias!r}")
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise SettingsError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SettingsError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise SettingsError(f"top-p must be in (0, 1], got {self.top_p}")
        if not (0.0 <= self.min_p < 1.0):
            raise SettingsError(f"min-p must be in [0, 1), got {self.min_p}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise SettingsError(f"seed must be an integer in [0, 2^64), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (np.isfinite(v) and -2.0 <= v <= 2.0):
                raise SettingsError(f"{name.replace('_', ' ')} must be in [-2, 2], got {v}")
        if self.penalty_last_n is not None and (not isinstance(self.penalty_last_n, (int, np.integer))
                                                or isinstance(self.penalty_last_n, bool) or self.penalty_last_n < 1):
            raise SettingsError(f"the penalties' window must be an integer >= 1 (or None: the whole prompt and "
                                f"output), got {self.penalty_last_n!r}")
        if not (np.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0):
            raise SettingsError(f"repetition penalty must be in (0, 10] (1 disables it), got {self.repetition_penalty}")
        for token, bias in self.logit_bias:
            if not isinstance(token, (int, np.integer)) or isinstance(token, bool) or token < 0:
                raise SettingsError(f"logit bias: token ids must be integers >= 0, got {token!r}")
            if not (-100.0 <= bias <= 100.0 or bias == -np.inf):  # -inf bans the token outright
                raise SettingsError(f"logit bias of token {token} must be in [-100, 100] (or -inf), got {bias}")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in self.logit_bias))
        if self.penalty_last_n is not None:
            object.__setattr__(self, "penalty_last_n", int(self.penalty_last_n))
        if self.infill_after not in ("",) + INFILL_STAGES:
            raise SettingsError(f"the infill sampler comes after one of {', '.join(INFILL_STAGES)} (or first), "
                                f"got {self.infill_after!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def couples(self) -> bool:
        """Sampled with position-keyed draws (coupled_draw): the output is then the same for any drafts."""
        return not self.greedy and (self.seed is not None if self.coupled is None else self.coupled)

    def truncates(self, vocab_size: int) -> bool:
        """Whether top-k, top-p or min-p may drop a token from a row of vocab_size."""
        return 0 < self.top_k < vocab_size or self.top_p < 1.0 or self.min_p > 0.0 or self.infill is not None

    @property
    def adjusts(self) -> bool:
        """Whether adjust_logits changes anything (or may: the infill sampler runs on the host, see there)."""
        return bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 \
            or self.repetition_penalty != 1.0 or self.infill is not None

    @property
    def penalizes(self) -> bool:
        """Whether the adjustment depends on the tokens before a position."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


WHOLE_CONTEXT = 1 << 30  # a penalty window past any context: every token before the position


def with_repeat_last_n(params: SamplingParams, last_n: int, n_ctx: Optional[int] = None) -> SamplingParams:
    """params with llama.cpp's repeat_last_n (>= -1): 0 no penalties, -1 the context (n_ctx; None: every token
    before the position), N the last N tokens, prompt included."""
    if last_n == 0:
        return dataclasses.replace(params, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                                   penalty_last_n=None)
    return dataclasses.replace(params, penalty_last_n=(n_ctx or WHOLE_CONTEXT) if last_n == -1 else last_n)


def with_eog_banned(params: SamplingParams, eog_ids: Sequence[int]) -> SamplingParams:
    """params with a logit bias of -inf on each end-of-generation token (llama.cpp's ignore_eos), beside its own
    biases. The draft model samples with the same params, so speculation stays exact."""
    bias = dict(params.logit_bias)
    bias.update((t, -np.inf) for t in eog_ids)
    return dataclasses.replace(params, logit_bias=tuple(bias.items()))


# ---------------------------------------------------------------------------------------------------------
# logit adjustments


def adjust_logits(logits: np.ndarray, params: SamplingParams, tokens: Sequence[int], n_prompt: int) -> np.ndarray:
    """Logit bias and penalties for the last n positions of a pass (_biased_and_penalized); the input is left as
    it is. Greedy decoding with the infill sampler before the temperature (0: argmax) takes the argmax of what
    the infill sampler keeps, so its rows keep only that (-inf elsewhere: infill_mask)."""
    x = _biased_and_penalized(logits, params, tokens, n_prompt)
    if params.infill is not None and params.greedy and params.infill_after != "temperature":
        x = infill_mask(x, params)
    return x


def _biased_and_penalized(logits: np.ndarray, params: SamplingParams, tokens: Sequence[int],
                          n_prompt: int) -> np.ndarray:
    """Logit bias and penalties for the last n positions of a pass; the input is left as it is.

    logits: [n, V] (or [V]): row i predicts the token after tokens[:len(tokens) - n + 1 + i], so in a verify
    pass over [last token, drafts...] row i sees the drafts before it. tokens[:n_prompt] is the prompt, the rest
    the output so far. Returns float32 (or the input's float type) of the same shape.
    As vLLM: repetition (tokens of prompt or output: positive logits / r, negative * r), then frequency
    (count in the output) and presence (in the output at all) subtracted; the bias is added first. With
    params.penalty_last_n = N, as llama.cpp's penalties sampler: the same three over the last N tokens before the
    row's position, prompt included (params.penalize_prompt False: the output alone, both ways).
    """
    if not (params.logit_bias or params.penalizes):  # (params.adjusts counts the infill sampler too)
        return logits
    x = np.array(logits, dtype=np.result_type(logits.dtype, np.float32), copy=True)
    squeeze = x.ndim == 1
    x = np.atleast_2d(x)
    n, v = x.shape
    for token, bias in params.logit_bias:
        if token < v:
            x[:, token] += bias
    if not params.penalizes:
        return x[0] if squeeze else x
    tokens = np.asarray(tokens, dtype=np.int64)
    base = len(tokens) - n + 1  # row 0 sees tokens[:base]
    if base < n_prompt:
        raise ValueError(f"a pass row before the end of the prompt ({base} < {n_prompt})")
    if params.penalty_last_n is not None:
        first = 0 if params.penalize_prompt else n_prompt
        for i in range(n):
            ids, counts = np.unique(tokens[max(first, base + i - params.penalty_last_n):base + i],
                                    return_counts=True)
            _penalize(x[i], params, ids, ids, counts)
        return x[0] if squeeze else x
    out_ids, out_counts = np.unique(tokens[n_prompt:base], return_counts=True)
    seen_prompt = np.unique(tokens[:n_prompt]) if params.repetition_penalty != 1.0 and params.penalize_prompt \
        else None
    for i in range(n):
        if i:  # the drafts before row i join the output
            out_ids, out_counts = _count_one(out_ids, out_counts, int(tokens[base + i - 1]))
        seen = np.union1d(seen_prompt, out_ids) if seen_prompt is not None else out_ids
        _penalize(x[i], params, seen, out_ids, out_counts)
    return x[0] if squeeze else x


def _penalize(row: np.ndarray, params: SamplingParams, seen: np.ndarray, ids: np.ndarray, counts: np.ndarray) -> None:
    """The penalties on one row [V], in place: repetition on the tokens `seen` (positive logits / r, negative * r),
    then frequency (times counts) and presence subtracted on `ids`. Ids past the row (a draft's larger vocabulary)
    are left out."""
    v = len(row)
    if params.repetition_penalty != 1.0:
        seen = seen[seen < v]
        vals = row[seen]
        row[seen] = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    row[ids[ids < v]] -= params.frequency_penalty * counts[ids < v] + params.presence_penalty


def _count_one(ids: np.ndarray, counts: np.ndarray, token: int) -> tuple[np.ndarray, np.ndarray]:
    """(sorted ids, counts) with one more `token`."""
    at = int(np.searchsorted(ids, token))
    if at < len(ids) and ids[at] == token:
        counts = counts.copy()
        counts[at] += 1
        return ids, counts
    return np.insert(ids, at, token), np.insert(counts, at, 1)


class TokenLogprob(NamedTuple):
    """The model's log-probability of an emitted token, and the most likely alternatives at its position."""

    token: int
    logprob: Optional[float]  # None for a prompt's first token (echo: nothing comes before it)
    top: tuple[tuple[int, float], ...]  # (token, logprob), most likely first


def token_logprobs(logits: np.ndarray, tokens: Sequence[int], n_top: int) -> list[TokenLogprob]:
    """log_softmax of the model's own logits (before any sampling setting, as OpenAI's and vLLM's default),
    at each of the positions: logits [n, V], tokens [n] the token emitted at each. Row by row in float64 (a
    [n, V] float64 matrix of a 64-row pass is 78 MB: 4x slower), with the alternatives found by top_ids."""
    out = []
    for row, token in zip(np.atleast_2d(logits), tokens):
        x = row.astype(np.float64)  # [V]
        x -= x.max()
        log_z = np.log(np.exp(x).sum())
        top: tuple = ()
        if n_top > 0:
            top = tuple((int(t), float(x[t] - log_z)) for t in top_ids(row, min(n_top, len(row))))
        out.append(TokenLogprob(int(token), float(x[token] - log_z), top))
    return out


def sampling_logprobs(adjusted: np.ndarray, params: SamplingParams, tokens: Sequence[int],
                      n_top: int) -> list[TokenLogprob]:
    """token_logprobs of the distributions the tokens were drawn from: adjusted [n, V] (adjust_logits) through
    probs_from_logits, or at temperature 0 all on the argmax (llama-server's post_sampling_probs; its
    alternatives stop at the first of probability 0, as its do)."""
    out = []
    for row, token in zip(np.atleast_2d(adjusted), tokens):
        if params.greedy:
            probs = np.zeros(len(row))  # [V]
            probs[int(np.argmax(row))] = 1.0
        else:
            probs = probs_from_logits(row, params)  # [V]
        top = top_ids(probs, min(n_top, len(probs)))
        with np.errstate(divide="ignore"):  # a token the sampler left out: log 0 = -inf
            out.append(TokenLogprob(int(token), float(np.log(probs[token])),
                                    tuple((int(t), float(np.log(probs[t]))) for t in top if probs[t] > 0.0)))
    return out


def top_ids(row: np.ndarray, n: int) -> np.ndarray:
    """Ids of the n largest values of row [V], largest first, ties by id (the head of a stable argsort of
    -row). Sorted among the values above a cut lowered until at least n are in: every value at least the n-th
    largest is then in, and a 152k row costs ~0.1 ms instead of a full partition's ~2 ms."""
    top = float(row.max())
    low = float(np.min(row, where=row > -np.inf, initial=top))  # the smallest finite value
    step = 4.0
    while top - step > low:
        ids = np.flatnonzero(row >= top - step)
        if len(ids) >= n:
            break
        step *= 4.0
    else:  # the cut is past every finite value (or the row holds NaN)
        ids = np.arange(len(row))
    return ids[np.lexsort((ids, -row[ids]))][:n]


# ---------------------------------------------------------------------------------------------------------
# logits -> probabilities


def probs_from_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Keep the top-k, top-p and min-p tokens of the logits, then apply the temperature, and normalise.

    logits: [n, V] (or [V]) float; returns float64 of the same shape, rows summing to 1.
    Order (llama.cpp's default sampler chain: top_k, top_p, min_p, temperature): keep the k largest; keep the
    smallest set of most likely tokens whose mass reaches top_p; drop tokens below min_p * max prob (both on the
    model's own probabilities, T = 1); then softmax(logits / T) over what is left. Ties at a cut-off are all kept.
    (Hugging Face and vLLM scale by 1/T first: the same without truncation, else top-p and min-p keep more
    tokens above T = 1 and fewer below.) With top-k a row is computed over the tokens it keeps, not the whole
    vocabulary: with llama-cli's top-k 40 a row costs ~0.3 ms instead of ~3-5 ms on a 152k vocabulary, and a
    verify pass has k+1 rows.
    """
    x = np.asarray(logits)
    squeeze = x.ndim == 1
    x = np.atleast_2d(x)
    out = np.zeros(x.shape, dtype=np.float64)  # [n, V]
    v = x.shape[-1]
    if params.infill is not None:
        out[:] = [_staged_row(row, params) for row in x]
        return out[0] if squeeze else out
    for row, dst in zip(x, out):
        # the row's maximum comes off before dividing: x / T overflows to inf (and then NaN) for T < ~1e-307
        top = row.max()
        if top == -np.inf:
            raise SettingsError("every token's logit is -inf (a logit bias or mask that bans them all)")
        if params.top_k and params.top_k < v:
            kth = np.partition(row, v - params.top_k)[v - params.top_k]  # the k-th largest
            ids = np.flatnonzero(row >= kth)  # ties at the cut are all kept
            dst[ids] = _filtered(row[ids].astype(np.float64) - top, params)
        else:
            dst[:] = row  # as float64
            dst -= top
            _filtered(dst, params)
    return out[0] if squeeze else out


def _filtered(x: np.ndarray, params: SamplingParams) -> np.ndarray:
    """x [n] float64 logits, maximum 0 -> the row's probabilities, in place (x is returned): top-p and min-p
    on softmax(x), then softmax(x / T) over the tokens they keep."""
    probs = np.exp(x)  # [n] the model's own probabilities (unnormalised: the maximum is 1)
    probs /= probs.sum()
    keep = None
    if params.top_p < 1.0:
        keep = probs >= _nucleus_cut(probs, params.top_p)
    if params.min_p > 0.0:
        # min-p after top-p: the most likely token survives top-p, so its threshold is the same either way
        above = probs >= params.min_p * probs.max()
        keep = above if keep is None else keep & above
    if keep is None:
        if params.temperature == 1.0:
            x[:] = probs
            return x
        kept = x
    else:
        kept = x[keep]  # [m] (usually a few tokens: top-p and min-p keep the head)
    with np.errstate(over="ignore"):  # a tiny T sends the others to -inf, as it should
        kept /= params.temperature  # kept <= 0 with a maximum of 0: no overflow, exp(0) = 1 stays
    np.exp(kept, out=kept)
    kept /= kept.sum()
    if keep is not None:
        x[:] = 0.0
        x[keep] = kept
    return x


def _nucleus_cut(probs: np.ndarray, top_p: float) -> float:
    """probs [n] normalised -> the probability of the last token the nucleus needs (the smallest set of most
    likely tokens whose mass reaches top_p); every token at least that likely is kept. Only the head of the
    distribution is sorted: the tokens above a threshold, lowered 10x until they hold top_p."""
    floor = probs.max() * 0.1
    while True:
        head = np.flatnonzero(probs >= floor) if floor > 0.0 else np.arange(len(probs))
        head = head[np.argsort(-probs[head], kind="stable")]  # a prefix of the whole order (ties all in)
        cum = np.cumsum(probs[head])
        if cum[-1] >= top_p or len(head) == len(probs) or floor == 0.0:
            return float(probs[head[min(int(np.searchsorted(cum, top_p)), len(head) - 1)]])
        floor = floor * 0.1 if floor > 1e-300 else 0.0


# ---------------------------------------------------------------------------------------------------------
# llama.cpp's infill sampler (src/llama-sampler.cpp, llama_sampler_infill_apply)

INFILL_STAGES = ("top_k", "top_p", "min_p", "temperature")  # the samplers it may come after, in their order


@dataclass(frozen=True, eq=False)
class InfillVocab:
    """What llama.cpp's infill sampler reads of the target's vocabulary: each token's text (token_to_piece
    without special tokens: control tokens are empty), which tokens end a generation, and the token it ends with
    when no text token is left (EOT, else EOS). Ids past its end (a draft's padding) read as empty text."""

    pieces: tuple[bytes, ...]  # [V]
    eog: frozenset[int]
    end: int

    def piece(self, token: int) -> bytes:
        return self.pieces[token] if token < len(self.pieces) else b""


def infill_keep(ids: np.ndarray, probs: np.ndarray, vocab: InfillVocab,
                n_candidates: Optional[int] = None) -> tuple[np.ndarray, Optional[int]]:
    """What llama.cpp's infill sampler keeps of the candidates ids [n] (probabilities probs [n], summing to 1):
    (mask [n] of the kept, None), or (None, token) when it ends the text with that token alone (EOT, else EOS).

    The sampler: if the end-of-generation tokens hold enough of the mass (3 * p_eog * n > p_text), keep just
    them. Else, over the candidates most likely first, wherever one token's text starts another's, merge the
    less likely of the two into the other (in its loop's order: each merge changes the masses later pairs
    compare); drop
    text tokens below 0.2, then, renormalised, below 1 / (n_text + 1); none left: EOT alone. The `dist` sampler
    after it draws from the logits of what it kept, so its merged masses only decide what is kept. n_candidates:
    the size of llama.cpp's candidate array when it holds tokens at -inf besides these (the EOG test counts
    them). Pairs are found by sorting the texts, not by comparing all n^2 as llama.cpp does; reference_infill_keep
    is that loop."""
    n = len(ids)
    order = np.argsort(-probs, kind="stable")  # llama.cpp sorts the candidates by logit first
    p = probs[order].astype(np.float64)  # [n] in that order
    eog = np.fromiter((int(t) in vocab.eog for t in ids[order]), bool, n)
    kept = np.zeros(n, dtype=bool)
    if 3.0 * p[eog].sum() * (n_candidates or n) > p[~eog].sum():
        kept[order[eog]] = True
        return kept, None
    alive = np.ones(n, dtype=bool)  # llama.cpp: logit > -inf (the candidates given are; merged ones are not)
    pieces = [vocab.piece(int(t)) for t in ids[order]]
    for i0, later in _extensions(pieces):
        for i1 in later:  # ascending: the order of llama.cpp's inner loop
            if not alive[i0]:
                break
            if alive[i1]:
                dst, src = (i1, i0) if p[i1] > p[i0] else (i0, i1)
                p[dst] += p[src]
                p[src] = 0.0
                alive[src] = False
    keep = eog | (p >= np.float32(0.2))  # llama.cpp's thresholds are floats
    n_text = int(np.count_nonzero(keep & ~eog))
    if n_text == 0:
        return None, vocab.end
    p = p / p[keep].sum()
    keep &= eog | (p >= np.float32(1.0 / (n_text + 1)))
    kept[order[keep & alive]] = True
    return kept, None


def _extensions(pieces: list[bytes]):
    """(i0, [i1, ... ascending]) for every i0 whose non-empty text starts the text of each i1 != i0."""
    by_text = sorted(range(len(pieces)), key=pieces.__getitem__)
    texts = [pieces[i] for i in by_text]
    for i0 in range(len(pieces)):
        head = pieces[i0]
        if not head:
            continue
        at = bisect.bisect_left(texts, head)  # texts starting with head follow it in sorted order
        later = []
        while at < len(texts) and texts[at].startswith(head):
            if by_text[at] != i0:
                later.append(by_text[at])
            at += 1
        if later:
            yield i0, sorted(later)


def reference_infill_keep(ids, probs, vocab: InfillVocab, n_candidates=None):
    """infill_keep as llama.cpp writes it: every ordered pair compared, in its loops' order."""
    n = len(ids)
    order = sorted(range(n), key=lambda i: -probs[i])
    cand = [[int(ids[i]), float(probs[i]), True, i] for i in order]  # id, p, alive, index in ids
    is_eog = [c[0] in vocab.eog for c in cand]
    p_eog = sum(c[1] for c, e in zip(cand, is_eog) if e)
    p_txt = sum(c[1] for c, e in zip(cand, is_eog) if not e)
    kept = np.zeros(n, dtype=bool)
    if 3 * p_eog * (n_candidates or n) > p_txt:
        for c, e in zip(cand, is_eog):
            kept[c[3]] = e
        return kept, None
    for i0 in range(n):
        for i1 in range(n):
            if not cand[i0][2]:
                break
            if i0 == i1 or not cand[i1][2]:
                continue
            t0, t1 = vocab.piece(cand[i0][0]), vocab.piece(cand[i1][0])
            if 0 < len(t0) <= len(t1) and t1[:len(t0)] == t0:
                dst, src = (cand[i1], cand[i0]) if cand[i1][1] > cand[i0][1] else (cand[i0], cand[i1])
                dst[1] += src[1]
                src[1], src[2] = 0.0, False
    survivors = [(c, e) for c, e in zip(cand, is_eog) if e or c[1] >= np.float32(0.2)]
    n_text = sum(1 for _, e in survivors if not e)
    if n_text == 0:
        return None, vocab.end
    total = sum(c[1] for c, _ in survivors)
    for c, e in survivors:
        if (e or c[1] / total >= np.float32(1.0 / (n_text + 1))) and c[2]:
            kept[c[3]] = True
    return kept, None


def _staged_row(row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """probs_from_logits of one row [V] with the infill sampler in the chain: top_k, top_p, min_p and the
    temperature in that order, each over what the ones before it kept (as llama.cpp's chain), the infill
    sampler after params.infill_after; then softmax over what is left. Temperature 0 keeps the argmax."""
    v = len(row)
    ids = np.flatnonzero(row > -np.inf)  # [m] llama.cpp's array still holds the others (its EOG test counts them)
    if not len(ids):
        raise SettingsError("every token's logit is -inf (a logit bias or mask that bans them all)")
    x = row[ids].astype(np.float64)
    size = v

    def softmax(z):
        e = np.exp(z - z.max())
        return e / e.sum()

    for stage in ("",) + INFILL_STAGES:
        keep = None
        if stage == "top_k" and params.top_k > 0:
            size = min(size, params.top_k)
            if params.top_k < len(x):
                keep = x >= np.partition(x, len(x) - params.top_k)[len(x) - params.top_k]  # ties at the cut kept
        elif stage == "top_p" and params.top_p < 1.0:
            probs = softmax(x)
            keep = probs >= _nucleus_cut(probs, params.top_p)
        elif stage == "min_p" and params.min_p > 0.0:
            probs = softmax(x)
            keep = probs >= params.min_p * probs.max()
        elif stage == "temperature":
            if params.temperature == 0.0:  # llama.cpp sends the others to -inf (they stay in its array)
                keep = np.arange(len(x)) == int(np.argmax(x))
            else:
                with np.errstate(over="ignore"):  # x <= 0: a tiny T sends the others to -inf, as it should
                    x = (x - x.max()) / params.temperature
        if keep is not None:
            ids, x = ids[keep], x[keep]
            size = size if stage in ("top_k", "temperature") else len(x)
        if stage == params.infill_after:
            keep, end = infill_keep(ids, softmax(x), params.infill, size)
            if end is not None:
                out = np.zeros(v)
                out[end] = 1.0
                return out
            ids, x = ids[keep], x[keep]
            size = len(x)
    out = np.zeros(v)  # [V]
    out[ids] = softmax(x)
    return out


def infill_mask(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """logits [n, V] (or [V]) with -inf where the infill sampler (and the samplers before it, at temperature
    1) leaves nothing: greedy decoding then takes the argmax of what it keeps, as llama.cpp's temperature 0
    after it does."""
    x = np.array(logits, copy=True)
    at_one = dataclasses.replace(params, temperature=1.0)
    for row in np.atleast_2d(x):
        kept = _staged_row(row, at_one) > 0.0  # [V]
        row[~kept] = -np.inf
        if np.count_nonzero(kept) == 1 and row[kept][0] == -np.inf:  # EOT alone, though banned: llama.cpp's pick
            row[kept] = 0.0
    return x


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from a normalised [V] distribution (inverse CDF; robust to rounding in the sum)."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(probs) - 1))


# ---------------------------------------------------------------------------------------------------------
# position-keyed draws (Gumbel-max coupling)

_GAMMA, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's constants
_MASK = (1 << 64) - 1


def _mix(z: int) -> int:
    """SplitMix64's finalizer on one Python int."""
    z = ((z ^ (z >> 30)) * _M1) & _MASK
    z = ((z ^ (z >> 27)) * _M2) & _MASK
    return z ^ (z >> 31)


def exponentials(seed: int, position: int, ids: np.ndarray) -> np.ndarray:
    """E(seed, position, id) ~ Exp(1) for each of ids [n], independent across ids, positions and seeds: SplitMix64
    (its finalizer over a per-row state plus (id + 1) golden-ratio steps), 52 bits as a uniform W in (0, 1), -log W.
    Random access by id, so a truncated row costs only its kept tokens."""
    key = _mix((seed & _MASK) ^ _mix((position * _GAMMA + 1) & _MASK))
    with np.errstate(over="ignore"):
        z = (np.asarray(ids, dtype=np.uint64) + np.uint64(1)) * np.uint64(_GAMMA) + np.uint64(key)
        z ^= z >> np.uint64(30)
        z *= np.uint64(_M1)
        z ^= z >> np.uint64(27)
        z *= np.uint64(_M2)
        z ^= z >> np.uint64(31)
    w = (z >> np.uint64(12)).astype(np.float64)  # [n] integers below 2^52, exact in a float64
    w += 0.5
    w *= 2.0 ** -52  # (0, 1), never 0 or 1
    return neg_log(w, _np_frexp, np.where)


_LN2 = 0.6931471805599453
_SQRT_HALF = 0.7071067811865476
# log f = 2 s (1 + s^2/3 + s^4/5 + ...); |s| < 0.172, so the terms after these are below 3e-17 of the sum
_ATANH_SERIES = tuple(1.0 / (2 * k + 1) for k in range(10))


def _np_frexp(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    f, e = np.frexp(w)
    return f, e.astype(np.float64)


def neg_log(w, frexp, where):
    """-log(w) elementwise for w in (0, 1) [numpy array or torch tensor, float64], from IEEE additions,
    multiplications and divisions in one fixed order, so numpy, torch and CUDA give the same bits: their log
    functions differ in the last bit between libraries and CPUs (numpy's and torch's disagreed on 0.3% of values
    on a Zen 4), and a seeded draw's noise must be the same on every backend. frexp(w) -> (f, e) with
    w = f 2^e, f in [0.5, 1), e float64; where: the library's."""
    f, e = frexp(w)
    low = f < _SQRT_HALF
    f = where(low, f * 2.0, f)  # in [sqrt(1/2), sqrt(2)): s = (f - 1) / (f + 1) is small
    e = where(low, e - 1.0, e)
    s = (f - 1.0) / (f + 1.0)
    s2 = s * s
    series = s2 * _ATANH_SERIES[-1]
    for c in reversed(_ATANH_SERIES[1:-1]):  # Horner, in place
        series += c
        series *= s2
    series += _ATANH_SERIES[0]
    series *= 2.0 * s
    e *= _LN2
    series += e
    return -series


COUPLED_BLOCK = 256  # tokens per block of coupled_draw's first race
_BLOCK_KEY = 0xB10C  # the block race's noise: another seed's


def coupled_draw(probs: np.ndarray, seed: int, position: int) -> int:
    """The token at `position` of a seeded request: a draw from probs [V] (any non-negative weights) that is a
    fixed function of (probs, seed, position). Gumbel-max in its exponential form, in two races, so that a
    152k row costs ~0.1 ms instead of ~3 ms of noise for every token: blocks of COUPLED_BLOCK ids race with their
    masses P_b (argmax P_b / E'(b): block b wins with probability P_b), then the winner's tokens (argmax
    p(i) / E(i)). Ties, of probability ~0, go to the lowest id."""
    v = len(probs)
    if v <= COUPLED_BLOCK:
        return int(np.argmax(probs / exponentials(seed, position, np.arange(v))))
    mass = block_masses(probs)  # [blocks]
    blocks = np.flatnonzero(mass)
    block = int(blocks[np.argmax(mass[blocks] / block_exponentials(seed, position, blocks))])
    ids = np.arange(block * COUPLED_BLOCK, min(v, (block + 1) * COUPLED_BLOCK))
    return int(ids[np.argmax(probs[ids] / exponentials(seed, position, ids))])


def block_masses(probs: np.ndarray) -> np.ndarray:
    """probs [V] -> the mass of each block of COUPLED_BLOCK ids [ceil(V / COUPLED_BLOCK)]."""
    n_full = len(probs) // COUPLED_BLOCK
    mass = probs[:n_full * COUPLED_BLOCK].reshape(n_full, COUPLED_BLOCK).sum(axis=1)
    return np.append(mass, probs[n_full * COUPLED_BLOCK:].sum()) if len(probs) > n_full * COUPLED_BLOCK else mass


def block_exponentials(seed: int, position: int, blocks: np.ndarray) -> np.ndarray:
    """The block race's Exp(1) variates [n]: those of another seed, so independent of the tokens'."""
    return exponentials(seed ^ _BLOCK_KEY, position, blocks)


def reference_coupled_draw(probs: np.ndarray, seed: int, position: int) -> int:
    """coupled_draw written plainly, as Gumbel-max usually is (argmax log w + G, G = -log E a Gumbel variate),
    block by block."""
    def gumbel_max(weights, seed, ids):
        with np.errstate(divide="ignore"):
            return ids[int(np.argmax(np.log(weights) - np.log(exponentials(seed, position, ids))))]

    blocks = [np.arange(b, min(b + COUPLED_BLOCK, len(probs))) for b in range(0, len(probs), COUPLED_BLOCK)]
    if len(blocks) == 1:
        return int(gumbel_max(probs, seed, blocks[0]))
    block = gumbel_max(np.array([probs[ids].sum() for ids in blocks]), seed ^ _BLOCK_KEY, np.arange(len(blocks)))
    # (a block with no mass never wins: log 0 = -inf)
    return int(gumbel_max(probs[blocks[block]], seed, blocks[block]))


# ---------------------------------------------------------------------------------------------------------
# verification


def verify_greedy(draft_tokens: np.ndarray, target_argmax: np.ndarray) -> tuple[int, int]:
    """Greedy verification. draft_tokens: [k]; target_argmax: [k+1].

    Returns (n_accepted, next_token): the longest prefix equal to the target's argmax, then the target's own
    token after it (the recovered token on a mismatch, the bonus token when all k match).
    """
    k = len(draft_tokens)
    mismatch = np.flatnonzero(np.asarray(draft_tokens) != np.asarray(target_argmax[:k]))
    n_accepted = int(mismatch[0]) if mismatch.size else k
    return n_accepted, int(target_argmax[n_accepted])


def verify_sampled(
    draft_tokens: np.ndarray,
    draft_probs: Optional[np.ndarray],
    target_probs: np.ndarray,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Modified rejection sampling.

    draft_tokens: [k] int; draft_probs: [k, V] (q, rows normalised) or None for a deterministic draft;
    target_probs: [k+1, V] (p). Returns (n_accepted, next_token) where next_token is the recovered token
    (from normalize(max(0, p_j - q_j)) at the first rejection j) or the bonus token (from p_{k+1}).
    """
    k = len(draft_tokens)
    rows = np.arange(k)
    p_draft = target_probs[rows, draft_tokens]  # [k] p_i(x_i)
    q_draft = np.ones(k) if draft_probs is None else draft_probs[rows, draft_tokens]  # [k] q_i(x_i)
    u = rng.random(k)  # [k]
    rejected = np.flatnonzero(u * q_draft >= p_draft)  # accept iff u < p/q (q > 0 for a proposed token)
    if rejected.size == 0:
        return k, sample(target_probs[k], rng)
    j = int(rejected[0])
    return j, sample(residual(target_probs[j], None if draft_probs is None else draft_probs[j], draft_tokens[j]), rng)


def verify_greedy_lazy(draft_tokens: Sequence[int], argmax: Callable[[int], int]) -> tuple[int, int]:
    """verify_greedy with row i's argmax computed on demand (argmax(i)), only up to the first mismatch.
    Also the verification of coupled draws, argmax(i) then being row i's coupled_draw."""
    for i, x in enumerate(draft_tokens):
        top = argmax(i)
        if top != x:
            return i, top
    return len(draft_tokens), argmax(len(draft_tokens))


def verify_sampled_lazy(draft_tokens: Sequence[int], draft_probs: Optional[np.ndarray],
                        target_row: Callable[[int], Optional[np.ndarray]], rng: np.random.Generator,
                        target_draw: Optional[Callable[[int, np.random.Generator], int]] = None) -> tuple[int, int]:
    """verify_sampled with row i of p computed on demand (target_row(i) -> [V]), only up to the first rejection.
    The same draws in the same order, so the same result as verify_sampled over the same rows.

    A row may instead be drawn from: target_row(i) None, then target_draw(i, rng) -> one token from p_i. Such a
    row keeps its draft iff the draw equals it, and otherwise emits the draw. That is exact for any q (the token
    emitted is always the target's own draw); a deterministic draft is kept with probability p(x), as above, and
    a sampled one with sum_x q(x) p(x) instead of sum_x min(p(x), q(x))."""
    k = len(draft_tokens)
    u = rng.random(k)  # [k]
    for i, x in enumerate(draft_tokens):
        p = target_row(i)
        if p is None:
            drawn = target_draw(i, rng)
            if drawn != x:
                return i, drawn
            continue
        q_x = 1.0 if draft_probs is None else draft_probs[i, x]
        if u[i] * q_x >= p[x]:
            return i, sample(residual(p, None if draft_probs is None else draft_probs[i], x), rng)
    p = target_row(k)
    return k, target_draw(k, rng) if p is None else sample(p, rng)


def residual(p: np.ndarray, q: Optional[np.ndarray], draft_token: int) -> np.ndarray:
    """normalize(max(0, p - q)) for one position [V]; q None means one-hot at draft_token."""
    if q is None:
        r = p.copy()
        r[draft_token] = 0.0
    else:
        r = np.maximum(p - q, 0.0)
    total = r.sum()
    if total <= 0.0:  # only reachable through rounding when p == q; then p itself is the right law
        return p
    return r / total


# ---------------------------------------------------------------------------------------------------------
# reference implementation: the textbook algorithm, one position at a time, for the tests to check against


def reference_verify(draft_tokens, draft_probs, target_probs, rng) -> tuple[list[int], int]:
    """Algorithm 1 of Leviathan et al., written plainly. Returns (accepted tokens, next token)."""
    accepted: list[int] = []
    for i, x in enumerate(draft_tokens):
        p = target_probs[i]
        q = np.eye(len(p))[x] if draft_probs is None else draft_probs[i]
        if rng.random() < min(1.0, p[x] / q[x]):
            accepted.append(int(x))
            continue
        r = np.maximum(p - q, 0.0)
        return accepted, int(rng.choice(len(p), p=r / r.sum()))
    return accepted, int(rng.choice(target_probs.shape[1], p=target_probs[len(draft_tokens)]))
