"""Draft model drafter: a small model of the same family proposes k tokens, one forward pass each."""

from __future__ import annotations

import time
from typing import Optional, Sequence

import numpy as np

from ..backends.base import Backend
from ..errors import SettingsError
from ..constraint import DRAFT_CHECK, constrain_row, masked_probs
from ..policy import DraftBudget, confidence_key
from ..verify import SamplingParams, adjust_logits, coupled_draw, probs_from_logits, sample
from .base import Draft, Drafter


def _stack(probs: list):
    """The drafted tokens' q [k, V] (numpy, or a torch tensor where the draft chose on its device), or None."""
    if not probs:
        return None
    if isinstance(probs[0], np.ndarray):
        return np.stack(probs)
    import torch

    return torch.stack(probs)


class ModelDrafter(Drafter):
    name = "draft"

    def __init__(self, backend: Backend, n_vocab_target: int, p_min: float = 0.0,
                 keep: Optional[np.ndarray] = None, map_inputs: bool = True):
        """keep: for a draft whose vocabulary was cut (speculant/vocabcut.py), the target id of each draft
        id [n_vocab_draft]: its logits are scattered back over the target's ids. map_inputs: also map
        context ids into the draft's ids (an id outside the cut becomes a stand-in); False for a backend
        that reads target ids itself (embeddings of the full vocabulary)."""
        self.backend = backend
        self.map_inputs = map_inputs
        self.n_vocab_target = n_vocab_target  # the draft's logits are cut or padded to the target's ids
        self.p_min = p_min  # stop drafting once the draft's own probability for its token falls below this
        self.keep = None if keep is None else np.asarray(keep, dtype=np.int64)
        self.to_draft = None
        if self.keep is not None:
            if len(self.keep) != backend.n_vocab or self.keep.max() >= n_vocab_target:
                raise SettingsError(f"{backend.name}: its kept-id table does not fit (draft vocab "
                                    f"{backend.n_vocab}, target vocab {n_vocab_target})")
        if self.keep is not None and map_inputs:
            # an id outside the cut is fed as draft id 0: the draft sees a stand-in, it only proposes worse
            self.to_draft = np.zeros(n_vocab_target, dtype=np.int64)
            self.to_draft[self.keep] = np.arange(len(self.keep))
        self.n_prompt: Optional[int] = None  # the request's prompt length (begin): where its penalties count from

    def _ids(self, tokens: Sequence[int]) -> Sequence[int]:
        """Target ids -> the draft's ids (the same sequence, not a copy, when they are the same ids)."""
        if self.to_draft is None:
            return tokens
        return self.to_draft[np.asarray(tokens, dtype=np.int64)].tolist()

    def _fit(self, logits: np.ndarray) -> np.ndarray:
        n = self.n_vocab_target
        if self.keep is not None:  # scatter over the target's ids; the others get no probability
            out = np.full(n, -np.inf, dtype=logits.dtype)
            out[self.keep] = logits
            return out
        if logits.shape[-1] == n:
            return logits
        if logits.shape[-1] > n:
            return logits[..., :n]
        return np.concatenate([logits, np.full(logits.shape[:-1] + (n - logits.shape[-1],), -np.inf,
                                               dtype=logits.dtype)], axis=-1)

    def propose(self, context: Sequence[int], k: int, params: SamplingParams,
                rng: np.random.Generator, budget: Optional[DraftBudget] = None) -> Draft:
        budget = budget or DraftBudget(k)
        behind = self.backend.behind(context)  # tokens to catch up on (about: rejections rewind)
        k = min(budget.start(self.name, free=False, behind=behind), self.backend.n_ctx - len(context) + 1)
        if k <= 0:
            return Draft([], None, self.name)
        tokens: list[int] = []
        probs: list = []  # [V] per token: numpy, or torch tensors on the draft's device
        keys: list[str] = []
        state = self.constraint.fork() if self.constraint is not None else None
        t0 = time.perf_counter()
        catchup_time = 0.0
        steps = 1  # draft passes run: the first catches up, then one per drafted token fed back
        for i, (token, confidence, q) in enumerate(self._steps(context, k, params, rng, state, tokens, budget,
                                                               timed=behind > 2)):
            if i == 0 and behind > 2:  # a prefill (new prompt, or after plain steps)
                catchup_time = time.perf_counter() - t0
            # the draft's confidence is its max probability, never a property of the sampled token: which
            # proposals get verified must not depend on the sampled value, or the rejection test is not exact
            if confidence < self.p_min:
                break
            key = confidence_key(confidence)
            if not budget.take(self.name, key):
                break
            if token is None:  # a seeded request: the target's own noise at this position (verify.coupled_draw)
                token = coupled_draw(q, params.seed, len(context) + i) if params.couples else sample(q, rng)
            if q is not None:
                probs.append(q)
            tokens.append(token)
            keys.append(key)
            if state is not None:
                if token in state.eog:  # the grammar is complete: nothing follows
                    break
                state.accept(token)
            if not (i + 1 < k and budget.more(self.name)):
                break
            steps += 1  # resuming runs the next pass
        return Draft(tokens, _stack(probs), self.name, catchup_time, catchup_tokens=behind if catchup_time else 0,
                     keys=keys, steps=steps, paid=self.name)

    def _steps(self, context, k, params, rng, state, tokens, budget, timed: bool = False):
        """(token, confidence, q) per draft step; resuming runs the next step's pass, fed tokens[-1]. token is
        None where the caller samples it from q (on the host, once the budget has taken the proposal). timed:
        the first step is a catch-up whose time is measured, so it must have finished when it is yielded.
        A static torch backend chooses on its device (draft_steps: no logits cross to the host) where no
        host-side transform is needed (a grammar, logit bias and penalties, a cut vocabulary)."""
        device_steps = getattr(self.backend, "draft_steps", None)
        if device_steps is not None and state is None and not params.adjusts and self.keep is None:
            fixed = budget.policy is None and self.p_min <= 0.0 and not timed  # every step is taken up to k
            # the request's seed decides the draws (a seeded request's are coupled: params.seed)
            seed = 0 if params.greedy or params.couples else int(rng.integers(2**63))
            yield from device_steps(context, params, self.n_vocab_target, seed, k, read_each=not fixed)
            return
        # the request's logit bias and penalties, as the target's (verify.adjust_logits): q then follows p
        n_prompt = min(self.n_prompt or len(context), len(context))
        fit = (lambda x: adjust_logits(self._fit(x), params, list(context) + tokens, n_prompt)) if params.adjusts \
            else self._fit
        logits = fit(self.backend.sync(self._ids(context))[0])  # [V]
        while True:
            # under a grammar, q is over the allowed ones among the DRAFT_CHECK likeliest tokens (any q is
            # verified exactly): a full scan costs ms more than the usual one or two new tokens
            if params.greedy:
                allowed = constrain_row(logits, state, params, limit=DRAFT_CHECK) \
                    if state is not None and not state.allows_all else logits
                if state is not None and not np.isfinite(allowed).any():  # none allowed among the likeliest
                    return
                token = int(np.argmax(allowed))
                yield token, 1.0 / float(np.exp(logits - logits[token]).sum()), None  # softmax of the token
            else:
                q = masked_probs(logits, state, params, limit=DRAFT_CHECK) \
                    if state is not None and not state.allows_all else probs_from_logits(logits, params)
                if q is None:
                    return
                yield None, float(q.max()), q
            logits = fit(self.backend.eval(self._ids([tokens[-1]]))[0])

    def begin(self, context: Sequence[int]) -> None:
        self.n_prompt = len(context)

    def for_slot(self, i: int) -> "ModelDrafter":
        """The same draft model on sequence i of its context (its own KV cache)."""
        if i == 0:
            return self
        return ModelDrafter(self.backend.slot(i), self.n_vocab_target, p_min=self.p_min, keep=self.keep,
                            map_inputs=self.map_inputs)

    def share_cache(self, source: Drafter, context: Sequence[int]) -> None:
        copy_prefix = getattr(self.backend, "copy_prefix", None)
        if copy_prefix is not None and isinstance(source, ModelDrafter) and source.backend is not self.backend:
            copy_prefix(source.backend, self._ids(context))

    def prepare(self, context: Sequence[int], should_stop=None) -> None:
        self.backend.catch_up(self._ids(context[:-1]), should_stop)  # the prompt, as for the target: prefill too

    def prepare_cost(self, context: Sequence[int]) -> int:
        return self.backend.behind(self._ids(context[:-1]))

    def close(self) -> None:
        self.backend.close()
