"""A draft model with another tokenizer (e.g. SmolLM2-135M for Qwen2.5): it drafts through text.

The context (target ids) is rendered as bytes and tokenized by the draft; the draft proposes in its own ids;
its text is tokenized by the target, and those target ids are the draft. They are verified as a deterministic
draft (q one-hot: accept x with p(x), else resample from p with x removed), which is exact whatever the draft
proposes, so any model that reads and writes text can draft (Hugging Face calls it universal assisted
decoding). Re-tokenizing the whole context every step would cost O(context): both tokenizations are kept and
only their tails redone."""

from __future__ import annotations

import sys
import time
from typing import Optional, Sequence

import numpy as np

from ..backends.base import Backend, common_prefix
from ..policy import DraftBudget, confidence_key
from ..verify import SamplingParams
from .base import Draft, Drafter

RETOKENIZE_BYTES = 32  # draft tokens ending this close to a change are re-tokenized (BPE merges reach back)
STEPS_PER_TOKEN = 2  # at most this many draft steps per proposed target token (draft tokens may be shorter)


def _utf8_complete(data: bytes | bytearray) -> int:
    """The length of the longest prefix of `data` that ends on a whole UTF-8 character."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b < 0x80:
            return n if back == 1 else n - back + 1
        if b >= 0xC0:  # a lead byte: is its character complete?
            need = 2 if b < 0xE0 else 3 if b < 0xF0 else 4
            return n if back >= need else n - back
    return n


class TextTokens:
    """One tokenizer's ids for a growing text, kept in step with it: `update(text)` re-tokenizes only from a
    little before where the text changed. ids[i] ends at byte ends[i] of the text."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.text = b""
        self.start = backend.tokenize("", add_special=True)  # the BOS the model wants, if any: no text
        self.ids: list[int] = list(self.start)
        self.ends: list[int] = [0] * len(self.start)

    def update(self, text: bytes) -> list[int]:
        """text must end on a whole UTF-8 character."""
        same = len(self.text) if text.startswith(self.text) else common_prefix(self.text, text)
        keep = int(np.searchsorted(self.ends, max(same - RETOKENIZE_BYTES, 0), side="right"))
        keep = max(keep, len(self.start))
        while keep > len(self.start) and self.ends[keep - 1] < len(text) and 0x80 <= text[self.ends[keep - 1]] < 0xC0:
            keep -= 1  # a byte-level token may end inside a character: restart on a character boundary
        begin = self.ends[keep - 1] if keep else 0
        del self.ids[keep:], self.ends[keep:]
        pos = begin
        for t in self.backend.tokenize(text[begin:].decode("utf-8", errors="replace"), add_special=False):
            pos += len(self.backend.token_text(t))
            self.ids.append(t)
            self.ends.append(min(pos, len(text)))
        self.text = bytes(text)
        return self.ids


class CrossVocabDrafter(Drafter):
    """Drafts for a target with another vocabulary by way of text; see the module docstring."""

    name = "draft"

    def __init__(self, backend: Backend, target: Backend, p_min: float = 0.0):
        self.backend = backend  # the draft model
        self.target = target  # only its tokenizer is used
        self.p_min = p_min
        self._context: list[int] = []  # target ids rendered in self._text
        self._ends: list[int] = []  # [len(_context)] byte offset after each
        self._text = bytearray()
        self._draft_ids = TextTokens(backend)

    def _render(self, context: Sequence[int]) -> bytes:
        """The context's text (control tokens written out, so a draft with the same chat markup reads them)."""
        n = common_prefix(self._context, context)
        del self._context[n:], self._ends[n:]
        del self._text[self._ends[-1] if n else 0:]
        for t in context[n:]:
            self._text += self.target.token_text(t)
            self._context.append(int(t))
            self._ends.append(len(self._text))
        return bytes(self._text)

    def _draft_context(self, context: Sequence[int]) -> Optional[list[int]]:
        text = self._render(context)
        if _utf8_complete(text) < len(text):  # the context ends inside a character: no text to continue yet
            return None
        return list(self._draft_ids.update(text))

    def propose(self, context: Sequence[int], k: int, params: SamplingParams,
                rng: np.random.Generator, budget: Optional[DraftBudget] = None) -> Draft:
        budget = budget or DraftBudget(k)
        draft_context = self._draft_context(context)
        if not draft_context:
            return Draft([], None, self.name)
        behind = self.backend.behind(draft_context)
        k = min(budget.start(self.name, free=False, behind=behind), self.target.n_ctx - len(context) + 1,
                self.backend.n_ctx - len(draft_context))
        if k <= 0:
            return Draft([], None, self.name)
        t0 = time.perf_counter()
        logits = self.backend.sync(draft_context)[0]  # [V_draft]
        catchup_time = time.perf_counter() - t0 if behind > 2 else 0.0
        text = bytearray()  # the draft's continuation
        ends: list[int] = []  # byte end in `text` of each draft token
        probs: list[float] = []  # the draft's probability of each of its tokens
        proposed: list[int] = []  # target ids taken into the draft
        keys: list[str] = []
        proposed_end = 0  # where the proposed tokens' text ends in `text`
        steps, done = 1, False
        while not done:
            token = int(np.argmax(logits))
            confidence = 1.0 / float(np.exp(logits - logits[token]).sum())
            if confidence < self.p_min:
                break
            text += self.backend.token_text(token)
            ends.append(len(text))
            probs.append(confidence)
            final = self.backend.is_eog(token)  # the draft's text ends: its last target token is whole
            complete = _utf8_complete(text)
            try:
                ids = self.target.tokenize(text[:complete].decode("utf-8"), add_special=False) if complete else []
            except UnicodeDecodeError:  # a byte-level draft wrote bytes that are no text: the draft ends before them
                break
            whole = ids if final else ids[:-1]  # the last target token may still grow with the next draft token
            if whole[:len(proposed)] != proposed:  # the draft's later text re-split tokens already taken: stop
                break
            for t in whole[len(proposed):]:
                start, pos = proposed_end, proposed_end + len(self.target.token_text(t))
                # the target token's odds: those of the least confident draft token that wrote part of it
                conf = min((c for (a, b), c in zip(zip([0] + ends, ends), probs) if b > start and a < pos),
                           default=0.0)
                key = confidence_key(conf)
                if len(proposed) >= k or not budget.take(self.name, key):
                    done = True
                    break
                proposed.append(t)
                keys.append(key)
                proposed_end = pos
            if done or final or len(proposed) >= k or steps >= STEPS_PER_TOKEN * k or not budget.more(self.name):
                break
            if len(draft_context) + steps > self.backend.n_ctx:  # the next step needs a position the draft lacks
                break
            logits = self.backend.eval([token])[0]
            steps += 1
        n = self.allowed_prefix(proposed)
        # the policy prices a draft as k steps of c (k·c); a target token takes this draft ~1.5 of its steps
        # (its tokens are shorter, and the last one is only known whole after the next), so its steps are
        # counted per proposed token: c becomes the cost of one proposed token
        return Draft(proposed[:n], None, self.name, catchup_time, catchup_tokens=behind if catchup_time else 0,
                     keys=keys[:n], steps=len(proposed) or steps, paid=self.name)

    def _to_prepare(self, context: Sequence[int]) -> Optional[list[int]]:
        """The draft tokens a prompt's processing feeds ahead; None where there is nothing to feed, or where the
        draft's tokens of the text fill its context already (its tokens are often more than the target's, and
        such a context is not drafted from: propose)."""
        draft_context = self._draft_context(context)
        if not draft_context or not 1 < len(draft_context) < self.backend.n_ctx:
            return None
        return draft_context[:-1]

    def prepare(self, context: Sequence[int], should_stop=None) -> None:
        ahead = self._to_prepare(context)
        if ahead:
            self.backend.catch_up(ahead, should_stop)

    def prepare_cost(self, context: Sequence[int]) -> int:
        ahead = self._to_prepare(context)
        return self.backend.behind(ahead) if ahead else 0

    def for_slot(self, i: int) -> "CrossVocabDrafter":
        if i == 0:
            return self
        return CrossVocabDrafter(self.backend.slot(i), self.target, p_min=self.p_min)

    def close(self) -> None:
        self.backend.close()


_SAID: set[tuple[str, str]] = set()  # (target, draft) pairs already reported


def same_vocabulary(target: Backend, draft: Backend, quiet: bool = False) -> bool:
    """Can the draft propose target ids directly (vocab.check_compatible)? If not, say what differs and that it
    drafts through text (CrossVocabDrafter)."""
    from ..errors import VocabMismatchError
    from ..vocab import check_compatible

    try:
        check_compatible(target.vocab_info(), draft.vocab_info(), target.name, draft.name)
        return True
    except VocabMismatchError as e:
        if not quiet and (target.name, draft.name) not in _SAID:
            _SAID.add((target.name, draft.name))
            print(f"speculant: {str(e).replace('cannot draft', 'cannot propose token ids')}; it drafts through "
                  "text instead (re-tokenized: still exact, usually fewer tokens accepted than a same-family "
                  "draft's)", file=sys.stderr)
        return False

