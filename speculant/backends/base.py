"""The backend interface: what the engine needs from a model runtime, and nothing more.

A backend owns one model and one KV cache for one sequence. The engine never imports a runtime
(llama_cpp, torch) directly; it talks to this interface.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np

from ..errors import Cancelled, SettingsError

_INFILL_VOCAB_LOCK = threading.Lock()
# a draft model's prompt is processed this many tokens at a time, so that a request whose client left stops it
# between two (the default 0.5B draft, 2 cores: 0.18-0.4 s each over a 2k-token prompt, 4.5 s in all, as in one go)
CATCH_UP_TOKENS = 128


@dataclass
class VocabInfo:
    """What the vocabulary check compares between a draft and a target."""

    n_vocab: int
    kind: str  # tokenizer family, e.g. "bpe", "spm"
    texts: list[bytes]  # token id -> raw token text
    special_ids: dict[str, Optional[int]] = field(default_factory=dict)  # bos/eos/eot/pad -> id
    unused: frozenset[int] = frozenset()  # ids the model never emits (padding slots, unused/control)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences (per decode step: the usual case, one a
    prefix of the other, is compared at C speed)."""
    m = min(len(a), len(b))
    if list(a[:m]) == list(b[:m]):
        return m
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Backend(ABC):
    """One model with one KV cache holding the tokens `self.tokens` at positions 0..len-1."""

    name: str
    n_ctx: int
    n_vocab: int
    # checked between a prompt's passes (prefill): True stops it with errors.Cancelled (a server sets it for a
    # request whose client may leave during a long prompt)
    should_stop: Optional[Callable[[], bool]] = None

    def __init__(self) -> None:
        self.tokens: list[int] = []  # what the KV cache holds now

    # -- the two calls of the decode loop ----------------------------------------------------------------
    @abstractmethod
    def _decode(self, tokens: Sequence[int], start: int, n_logits: int) -> np.ndarray:
        """Evaluate `tokens` at positions start.. after the cache was cut to `start`; return the logits of
        the last `n_logits` of them as float32 [n_logits, n_vocab]."""

    @abstractmethod
    def _truncate(self, n_kept: int) -> None:
        """Drop KV entries at positions >= n_kept."""

    def rewind(self, n_kept: int) -> None:
        """Forget everything after the first n_kept tokens."""
        if n_kept < len(self.tokens):
            self._truncate(n_kept)
            del self.tokens[n_kept:]

    def eval(self, tokens: Sequence[int], n_logits: int = 1) -> np.ndarray:
        """Append `tokens` to the cache; logits for the last n_logits of them: [n_logits, n_vocab]."""
        if len(self.tokens) + len(tokens) > self.n_ctx:
            raise RuntimeError(f"{self.name}: {len(self.tokens) + len(tokens)} tokens exceed n_ctx={self.n_ctx}")
        start = len(self.tokens)
        logits = self._decode(tokens, start, n_logits)
        self.tokens.extend(int(t) for t in tokens)
        return logits

    def sync(self, context: Sequence[int], n_logits: int = 1) -> np.ndarray:
        """Make the cache hold exactly `context` (keep the common prefix, evaluate the rest) and return the
        logits of its last n_logits tokens. At least the last token is always (re-)evaluated."""
        limit = min(len(self.tokens), len(context) - n_logits)
        common = common_prefix(self.tokens[:limit], context)
        self.rewind(common)
        return self.eval(context[common:], n_logits)

    def catch_up(self, context: Sequence[int], should_stop: Optional[Callable[[], bool]] = None) -> None:
        """sync(context, n_logits=0) for a draft model's prompt, in syncs of CATCH_UP_TOKENS more tokens each;
        should_stop() is asked before each, and True stops it (errors.Cancelled), keeping what was evaluated."""
        start = len(context) - self.behind(context)
        for end in [*range(start + CATCH_UP_TOKENS, len(context), CATCH_UP_TOKENS), len(context)]:
            if should_stop is not None and should_stop():
                raise Cancelled(f"{self.name}: prompt processing stopped at {len(self.tokens)} of {len(context)} "
                                f"tokens")
            self.sync(context[:end], n_logits=0)

    def prefill(self, context: Sequence[int]) -> int:
        """Prompt processing: make the cache hold `context` as "the model alone" would have computed it
        (a runtime whose numerics depend on how passes are cut says how: llamacpp.py). Returns how many of
        its tokens the cache kept from before (not evaluated again)."""
        kept = common_prefix(self.tokens, context)
        self.sync(context, n_logits=0)
        return kept

    def behind(self, context: Sequence[int]) -> int:
        """How many tokens a sync to `context` evaluates (a drafter's catch-up): past the common prefix, so a
        cache still holding another request's text counts as far behind, not as ahead."""
        return len(context) - common_prefix(self.tokens, context)

    # -- text ---------------------------------------------------------------------------------------------
    @abstractmethod
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """text -> token ids. add_special: the model's BOS (and EOS) where it adds them; parse_special: control
        tokens' texts (<|im_end|>) read as those tokens (False: as plain text, as llama-server's logit_bias texts)."""

    @abstractmethod
    def token_bytes(self, token: int) -> bytes:
        """The raw bytes a token renders to (special tokens render as nothing)."""

    def token_text(self, token: int) -> bytes:
        """The token's bytes, control tokens written out (b"<|im_end|>"): text another tokenizer can read."""
        piece = self.token_bytes(token)
        if piece:
            return piece
        if not hasattr(self, "_control_texts"):
            self._control_texts = self.vocab_info().texts
        texts = self._control_texts
        return texts[token] if 0 <= token < len(texts) else b""

    def check_ids(self, tokens: Sequence[int], what: str = "token id") -> None:
        """A SettingsError naming the first id outside the vocabulary (llama.cpp aborts the process on one)."""
        bad = [t for t in tokens if not 0 <= t < self.n_vocab]
        if bad:
            raise SettingsError(f"{what} {bad[0]} is outside the vocabulary (0..{self.n_vocab - 1})")

    def detokenize(self, tokens: Sequence[int]) -> str:
        """token ids -> text (check_ids first)."""
        self.check_ids(tokens)
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", errors="replace")

    @abstractmethod
    def is_eog(self, token: int) -> bool:
        """End of generation (EOS, EOT, ...)."""

    def eog_ids(self) -> list[int]:
        """Every end-of-generation token id, ascending: what `--ignore-eos` bans (a logit bias of -inf each)."""
        return [t for t in range(self.n_vocab) if self.is_eog(t)]

    def infill_vocab(self) -> "InfillVocab":
        """What llama.cpp's infill sampler reads of this vocabulary (verify.InfillVocab): every token's text,
        built once (~0.3 s for 152k tokens)."""
        with _INFILL_VOCAB_LOCK:  # built once, whichever thread asks first (the server builds it ahead)
            return self._built_infill_vocab()

    def _built_infill_vocab(self) -> "InfillVocab":
        if getattr(self, "_infill_vocab", None) is None:
            from ..verify import InfillVocab

            special = self.vocab_info().special_ids
            end = special.get("eot") if special.get("eot") is not None else special.get("eos")
            if end is None:
                raise SettingsError("the infill sampler needs an end-of-text token (EOT or EOS); this model has none")
            self._infill_vocab = InfillVocab(tuple(self.token_bytes(t) for t in range(self.n_vocab)),
                                             frozenset(self.eog_ids()), end)
        return self._infill_vocab

    @abstractmethod
    def chat_template(self) -> Optional[str]: ...

    @abstractmethod
    def vocab_info(self) -> VocabInfo: ...

    def fim_tokens(self) -> Optional[tuple[int, int, int]]:
        """The model's fill-in-the-middle tokens (prefix, suffix, middle), or None where it has none."""
        return None

    def fim_repo_tokens(self) -> Optional[tuple[int, int]]:
        """The tokens of repository-level fill in the middle (repository name, file separator; Qwen2.5-Coder's
        <|repo_name|> and <|file_sep|>), or None where the model has none."""
        return None

    @property
    @abstractmethod
    def bos_token(self) -> str: ...

    @property
    @abstractmethod
    def eos_token(self) -> str: ...

    # -- concurrent requests ------------------------------------------------------------------------------
    def grammar(self, gbnf: str, root: str = "root"):
        """A constraint.Constraint for this GBNF grammar over this model's vocabulary."""
        from ..errors import SettingsError

        raise SettingsError(f"{self.name}: grammars (and JSON mode) need the llama.cpp backend")

    def slot(self, i: int) -> "Backend":
        """Sequence i of this model, a backend of its own for one more concurrent request (0: this object).
        Runtimes that serve one request at a time have only slot 0."""
        if i == 0:
            return self
        from ..errors import SettingsError

        raise SettingsError(f"{self.name}: this runtime serves one request at a time (--parallel 1)")

    def busy(self, on: bool, key: Optional[int] = None) -> None:
        """A request starts (on) or ends on this slot; a runtime that merges concurrent requests' passes
        waits for busy slots (speculant/batching.py). key: the thread that started it (default: this one)."""

    def sharing(self) -> int:
        """Requests decoding on this model now, this one included (their passes merge: batching.py)."""
        return 1

    def cost_profile(self) -> Optional[dict[int, float]]:
        """T(n) / T(1) measured on this machine (costprofile.py), the adaptive policy's prior; None: unknown."""
        return None

    def one_pass_seconds(self) -> Optional[float]:
        """T(1) in seconds as that profile measured it (prices a process's first draft-model prefill); None."""
        return None

    def close(self) -> None:
        """Release the model (optional)."""
