"""The decode loop: draft -> verify -> accept -> rewind.

Plain decoding is the same loop with no drafter (k = 0): one target pass per token. That keeps the
baseline and the speculative path on one code path, so greedy identity compares like with like.
"""

from __future__ import annotations

import atexit
import bisect
import codecs
import contextlib
import dataclasses
import functools
import numbers
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import numpy as np

from . import chat, costprofile, memory
from .backends.base import Backend, common_prefix
from .constraint import Constraint, MaskedRows
from .drafters.base import EMPTY, Drafter
from .drafters.composite import CompositeDrafter
from .drafters.prediction import PredictionDrafter
from .errors import Cancelled, ContextOverflowError, SettingsError, nonfinite_logits
from .policy import AdaptivePolicy, FixedPolicy
from .stats import SpecStats
from .verify import (SamplingParams, TokenLogprob, adjust_logits, coupled_draw, probs_from_logits, sampling_logprobs,
                     token_logprobs, verify_greedy, verify_greedy_lazy, verify_sampled, verify_sampled_lazy)

MAX_DRAFT = 63  # a verify pass (k + 1 tokens) must stay within the invariant kernels (64 tokens: native/)
LONG_MAX = 16  # default bound of long free drafts (a tracking prediction, a history match): the policy picks k
# ... and where long passes are cheap: a 16-token pass costs under CHEAP_R16 one-token passes (AMX tile products;
# a GPU). The built-in code edit with its file as prediction, Sapphire Rapids with AMX: 3.99x / 4.59x plain
# decoding with 16, 4.65x / 5.24x with 32 (two rounds); without AMX (r(16) ~3.4) 32 read alike or worse.
LONG_MAX_CHEAP, CHEAP_R16 = 32, 3.0
# the default bound of a paid drafter's k: DRAFT_MAX, or DRAFT_MAX_FLAT where an 8-token pass costs at most FLAT_R8
# one-token passes (a GPU's fixed-width passes), as longer drafts then pay (docs/bench/trees/: summarization 3.09x at
# k = 4, 3.81x at 8 predicted for the H200); on this CPU (r(8) 1.7) k <= 8 read 1.46x against k <= 4's 1.49x
DRAFT_MAX, DRAFT_MAX_FLAT, FLAT_R8 = 4, 8, 1.3
INFILL_WITH_GRAMMAR = ("the infill sampler with a grammar (or a JSON schema, or required tool calls) is not "
                       "supported: llama.cpp samples those two in an order speculant does not reproduce")
MAX_TOP_LOGPROBS = 20  # alternatives per token with logprobs (OpenAI's bound)


# generations not yet run to their end (a stream a caller stopped reading): closed at exit, while the interpreter
# can still run their ends (left to the garbage collector, `open` and imports were gone: a traceback at exit)
_UNFINISHED: "weakref.WeakSet[Iterator]" = weakref.WeakSet()


@atexit.register
def _close_unfinished() -> None:
    for steps in list(_UNFINISHED):
        try:
            steps.close()
        except Exception:  # running in another thread (ValueError), or its end failed: exiting either way
            pass


@dataclass
class TokenEvent:
    """One emitted token and the text it completes (may be '' while a UTF-8 sequence or a possible
    stop string is pending; the token that reaches max_tokens carries all that was held back; after an
    end-of-generation token, text held back as the start of a stop string is in the result's text only)."""

    token: int
    text: str
    from_draft: bool
    source: str = ""  # the drafter that proposed it ("prediction", "history", "lookup", "draft"), "" if the target's
    # with logprobs: the entries of the tokens whose text began in what was handed out so far, not given before
    # (with this event's text; a stop string can still drop the tokens of text held back)
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Result:
    text: str
    tokens: list[int]
    stats: SpecStats
    finish_reason: str = "length"  # "stop" (EOS or stop string) | "length" (token limit or context full)
    message: str = ""  # a note for the user, e.g. that the context window filled up (finish_reason "length")
    stop_string: str = ""  # the stop string that ended the generation, if one did
    from_draft: list[bool] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)  # [i] the drafter that proposed token i, "" for the target's
    logprobs: Optional[list[TokenLogprob]] = None  # [i] token i's logprob and alternatives, when asked for

    def to_dict(self) -> dict:
        out = {"text": self.text, "tokens": self.tokens, "finish_reason": self.finish_reason,
               "message": self.message, "stats": self.stats.to_dict()}
        if self.logprobs is not None:
            out["logprobs"] = [{"token": e.token, "logprob": e.logprob, "top": [list(t) for t in e.top]}
                               for e in self.logprobs]
        return out


def default_draft_max(cost_profile: Optional[dict[int, float]]) -> int:
    """The bound of a paid drafter's k for a target with this cost profile (r(n), or None): DRAFT_MAX_FLAT where
    it prices an 8-token pass at most FLAT_R8 one-token passes, else DRAFT_MAX. The adaptive policy still picks k."""
    return DRAFT_MAX_FLAT if (cost_profile or {}).get(8, FLAT_R8 + 1) <= FLAT_R8 else DRAFT_MAX


def default_long_max(cost_profile: Optional[dict[int, float]]) -> int:
    """The bound of long free drafts for a target with this measured cost profile (r(n), or None):
    LONG_MAX_CHEAP where it prices a 16-token pass under CHEAP_R16 one-token passes, else LONG_MAX. The adaptive
    policy still picks k."""
    return LONG_MAX_CHEAP if (cost_profile or {}).get(16, CHEAP_R16) < CHEAP_R16 else LONG_MAX


def _is_mixed(prompt) -> bool:
    """A sequence holding text pieces (llama-server's mixed prompt), not a string or plain ids."""
    return isinstance(prompt, (list, tuple)) and any(isinstance(p, str) for p in prompt)


class Engine:
    """A target model, optionally with a drafter, and the speculative decode loop."""

    def __init__(self, target: Backend, drafter: Optional[Drafter] = None, *, draft_max: Optional[int] = DRAFT_MAX,
                 adaptive: bool = False, draft_min: int = 1, long_max: Optional[int] = None):
        """draft_max: tokens drafted per step (the upper bound when adaptive; None: default_draft_max of the
        target's costs when adaptive, else DRAFT_MAX); adaptive: choose k per step from measured costs and
        acceptance, and fall back to plain decoding when speculation does not pay; long_max: the bound for free
        drafters that may go long (prediction, history) when adaptive (default: default_long_max)."""
        if draft_max is not None and (not isinstance(draft_max, int) or not (0 <= draft_max <= MAX_DRAFT)):
            raise SettingsError(f"--draft-max must be an integer in [0, {MAX_DRAFT}], got {draft_max!r}")
        if long_max is not None and (not isinstance(long_max, int) or not (1 <= long_max <= MAX_DRAFT)):
            raise SettingsError(f"long_max must be an integer in [1, {MAX_DRAFT}], got {long_max!r}")
        self.target = target
        self.drafter = drafter
        self.draft_min = draft_min
        self.adaptive = adaptive
        self.long_max = LONG_MAX if long_max is None else long_max
        self._long_max_default = long_max is None
        self.cost_profile: Optional[dict[int, float]] = None  # the target's measured r(n), once a policy needs it
        self.prediction_policy = None  # the policy of an engine without a drafter, given a prediction
        self._scored: tuple[list[int], int, list[TokenLogprob]] = ([], 0, [])  # prompt_logprobs: tokens, n_top, entries
        self.trace: Optional[list] = None  # a list: each step appends [source, k, accepted, pass, draft steps, catch-up]
        self.closed = False
        self._stepping = threading.Lock()  # held while a generation computes a step (released at each yield)
        if drafter is not None and adaptive and draft_max != 0:
            self._load_costs()
            self.draft_max = default_draft_max(self.cost_profile) if draft_max is None else draft_max
            self.policy = AdaptivePolicy(k_max=self.draft_max, k_min=min(draft_min, self.draft_max),
                                         cost_prior=self.cost_profile, t1_prior=target.one_pass_seconds())
        else:
            self.draft_max = DRAFT_MAX if draft_max is None else draft_max
            self.policy = FixedPolicy(self.draft_max if drafter is not None else 0)

    def _load_costs(self) -> None:
        """Read the target's cost profile (measured once per machine where none is cached); the adaptive
        policies start from it, and an unset long_max follows it (default_long_max)."""
        self.cost_profile = self.target.cost_profile()
        if self._long_max_default:
            self.long_max = default_long_max(self.cost_profile)

    def for_slot(self, i: int) -> "Engine":
        """An engine for concurrent request slot i: the same models (their sequence i: Backend.slot), a
        drafter and a policy of its own. Requests on different slots may run on different threads at once;
        their passes merge (speculant/batching.py) and each output is the one it would be alone."""
        if i == 0:
            return self
        target = self.target.slot(i)
        drafter = self.drafter.for_slot(i) if self.drafter is not None else None
        return Engine(target, drafter, draft_max=self.draft_max, adaptive=self.adaptive, draft_min=self.draft_min,
                      long_max=None if self._long_max_default else self.long_max)

    def share_cache(self, source: "Engine", context: Sequence[int]) -> int:
        """Take another slot's prompt cache where it holds more of `context`: the target's KV stream is copied,
        and the draft model's (Backend.copy_prefix), so a prompt another slot processed is not processed again,
        and the entries of the prompt it last scored (prompt_logprobs). The bits are the ones this slot would
        compute. Returns the target positions this slot now holds."""
        copy_prefix = getattr(self.target, "copy_prefix", None)
        if copy_prefix is None or source is self:
            return 0
        held = copy_prefix(source.target, context)
        if self.drafter is not None and source.drafter is not None:
            self.drafter.share_cache(source.drafter, context)
        scored = source._scored  # one assignment there: a consistent snapshot, even while source runs
        if common_prefix(scored[0], context) > common_prefix(self._scored[0], context):
            self._scored = scored
        return held

    # -- prompts ------------------------------------------------------------------------------------------
    def chat_prompt(self, messages: list[dict], tools: Optional[list[dict]] = None) -> str:
        return chat.render(self.target.chat_template(), messages, bos_token=self.target.bos_token,
                           eos_token=self.target.eos_token, tools=tools)

    def tokenize_prompt(self, prompt: str | Sequence[int | str], *, is_chat: bool = False,
                        suffix: Optional[str | Sequence[int | str]] = None) -> list[int]:
        """The prompt's token ids (text, ids, or both mixed: mixed_ids). With a suffix, a fill-in-the-middle
        prompt: the model writes what goes between the prompt and the suffix (fim_prompt)."""
        if _is_mixed(prompt):
            prompt = self.mixed_ids(prompt, first=suffix is None)  # fim_prompt adds BOS itself
        if _is_mixed(suffix):
            suffix = self.mixed_ids(suffix, first=False, what="suffix token id")
        if suffix is not None:
            tokens = self.fim_prompt(prompt, suffix)
        elif isinstance(prompt, str):
            if self.closed:
                raise SettingsError("this engine is closed: load another one")
            # whitespace is text (OpenAI's API takes " "), and an empty prompt is BOS alone where the model
            # starts with one (as llama.cpp generates from it); empty where it does not: refused below
            bos = self.target.bos_token
            add_special = not (is_chat and bos and prompt.startswith(bos))  # the template wrote BOS already
            tokens = self.target.tokenize(prompt, add_special=add_special)
        else:
            tokens = self._checked_ids(prompt, "prompt token id")
        if not tokens:
            raise SettingsError("the prompt is empty" + (f" ({self.target.name} adds no BOS token to start from)"
                                                         if isinstance(prompt, str) else ""))
        if len(tokens) >= self.target.n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(tokens)} tokens but the context window holds {self.target.n_ctx}, "
                f"prompt and answer together (at least one token must be left for the answer); "
                f"shorten the prompt or raise --ctx-size"
            )
        return tokens

    def fim_prompt(self, prefix: str | Sequence[int], suffix: str | Sequence[int]) -> list[int]:
        """Fill in the middle, in the prefix-suffix-middle order of the code models that have it (Qwen2.5-Coder,
        StarCoder; llama-server's /infill): [BOS] <prefix token> prefix <suffix token> suffix <middle token>.
        The model then writes the middle and ends it with an end-of-generation token."""
        fim = self.target.fim_tokens()
        if fim is None:
            raise SettingsError(f"{self.target.name} has no fill-in-the-middle tokens, so a suffix cannot be used; "
                                f"a code model has them (qwen2.5-coder-1.5b-instruct)")
        pre, suf, mid = fim
        parts = []
        for part, what in ((prefix, "prompt token id"), (suffix, "suffix token id")):
            parts.append(self.target.tokenize(part, add_special=False) if isinstance(part, str)
                         else self._checked_ids(part, what))
        return self.target.tokenize("", add_special=True) + [pre] + parts[0] + [suf] + parts[1] + [mid]

    def infill_prompt(self, prefix: str, suffix: str, *, extra: Sequence[tuple[str, str]] = (), middle: str = "",
                      room: int = 0, spm: bool = False) -> tuple[list[int], bool]:
        """llama-server's /infill prompt: code completion at a cursor with other files as context. The extra
        chunks ((filename, text): files the editor has open, snippets it saw) come first, in the repository-level
        layout where the model has its tokens (Qwen2.5-Coder: <|repo_name|>myproject, then <|file_sep|>name and
        the text of each chunk, then <|file_sep|>filename for the file being edited; llama-server's names), else
        each after a "--- snippet ---" line; then fim_prompt(prefix + middle, suffix), `middle` being the text of
        the cursor's line before it. To leave `room` positions of the context for the output, the prefix keeps
        its end and the suffix its start (at least a quarter of the code's share, which is at least half of what
        is left), and of the chunks those at the end that fit whole; room they leave goes to the code. spm: the suffix before the prefix
        (llama-server's --spm-infill, for models trained that way: as the user types, only the cursor's line
        changes at the end of the prompt, so the rest stays cached). Returns the tokens and whether anything was
        cut."""
        fim, repo = self.target.fim_tokens(), self.target.fim_repo_tokens()
        if fim is None:
            raise SettingsError(f"{self.target.name} has no fill-in-the-middle tokens, so it cannot fill in code; "
                                f"a code model has them (qwen2.5-coder-1.5b-instruct)")
        pre, suf, mid = fim

        def tok(text: str) -> list[int]:
            return self.target.tokenize(text, add_special=False) if text else []

        bos = self.target.tokenize("", add_special=True)
        chunks, head, tail = [], [], []  # [i] chunk i's tokens; before the chunks; between them and the prefix
        if repo is not None:
            head = [repo[0]] + tok("myproject\n")
            tail = [repo[1]] + tok("filename\n")
            chunks = [[repo[1]] + tok(name + "\n") + tok(text) for name, text in extra]
        else:
            chunks = [tok("\n\n--- snippet ---\n\n") + tok(text) for _, text in extra]
        prefix_ids, suffix_ids = tok(prefix + middle), tok(suffix)
        avail = self.target.n_ctx - room - len(bos) - 3
        if avail < 1:
            raise ContextOverflowError(f"the context window ({self.target.n_ctx} tokens) leaves no room for the "
                                       f"code around the cursor after {room} for the output; raise --ctx-size")
        if len(head) + len(tail) >= avail // 2:  # a tiny context: the code around the cursor first
            head, tail, chunks = [], [], []
        overhead = len(head) + len(tail)

        def code_split(code: int) -> tuple[int, int]:
            """(suffix, prefix) tokens kept of `code` positions: the suffix at least a quarter."""
            n_suffix = min(len(suffix_ids), max(code // 4, code - len(prefix_ids)))
            return n_suffix, min(len(prefix_ids), code - n_suffix)

        # the code around the cursor gets at least half, the chunks what they need of the rest
        n_suffix, n_prefix = code_split(avail - overhead if not chunks else
                                        max(avail // 2, avail - overhead - sum(map(len, chunks))))
        left = avail - n_suffix - n_prefix - overhead
        kept = []  # the chunks at the end that fit whole
        for chunk in reversed(chunks):
            if len(chunk) > left:
                break
            kept.insert(0, chunk)
            left -= len(chunk)
        # what no whole chunk could use goes back to the code (a chunk left out used to leave it empty)
        n_suffix, n_prefix = code_split(avail - overhead - sum(map(len, kept)))
        cut = n_prefix < len(prefix_ids) or n_suffix < len(suffix_ids) or len(kept) < len(chunks)
        context = head + [t for c in kept for t in c] + tail  # llama-server writes the header with no chunks too
        before, after = [pre] + prefix_ids[len(prefix_ids) - n_prefix:], [suf] + suffix_ids[:n_suffix]
        tokens = bos + context + (after + before if spm else before + after) + [mid]
        return tokens, cut

    def prediction_tokens(self, prediction: str | Sequence[int]) -> list[int]:
        """A predicted output (text, or token ids) -> token ids (no BOS: it is a piece of the output)."""
        if isinstance(prediction, str):
            return self.target.tokenize(prediction, add_special=False) if prediction else []
        return self._checked_ids(prediction, "prediction token id")

    def mixed_ids(self, pieces: Sequence[int | str], first: bool = True, what: str = "prompt token id") -> list[int]:
        """llama-server's mixed prompt, [12, 34, "text", 56]: the texts tokenized (special tokens read as such,
        BOS added only where a first piece of text starts it) between the ids (`what` names them in an error)."""
        tokens: list[int] = []
        for i, piece in enumerate(pieces):
            if isinstance(piece, str):
                tokens += self.target.tokenize(piece, add_special=first and i == 0)
            else:
                tokens += self._checked_ids([piece], what)
        return tokens

    def _checked_ids(self, ids: Sequence[int], what: str) -> list[int]:
        """Token ids as ints, each checked to be in the target's vocabulary (`what` names them in the error)."""
        try:
            ids = ids if isinstance(ids, (bytes, bytearray, str)) else list(ids)  # a generator is read once
            integral = not isinstance(ids, (bytes, bytearray, str)) and all(
                isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in ids)
        except TypeError:  # not a sequence at all
            integral = False
        if not integral:
            raise SettingsError(f"{what}s must be integers: give text or a list of token ids, got {str(ids)[:60]!r}")
        tokens = [int(t) for t in ids]
        self.target.check_ids(tokens, what)
        return tokens

    def prompt_logprobs(self, tokens: Sequence[int], n_top: int, stats: Optional[SpecStats] = None) -> list[TokenLogprob]:
        """Each prompt token's log-probability given the tokens before it, with its n_top likeliest alternatives
        (what /v1/completions' echo returns, and what evaluation harnesses score): tokens [n] -> n entries, the
        first with logprob None (nothing comes before it). Target passes over chunks of at most 64 tokens
        return all their logits; on our llama.cpp build those passes are batch-invariant, so each row has the
        bits a one-token pass gives. There the entries of the prefix shared with the last prompt scored are
        kept, and only the rest is evaluated on its cached positions: a harness scoring one context with each
        of its answers processes the context once (stats.cached_prompt_tokens: the entries kept). A
        generation after it re-does the prompt the usual way (Backend.prefill keeps only what computes as a
        fresh prefill would)."""
        target = self.target
        chunk = min(64, getattr(target, "invariant_rows", 64) or 64)
        out = self._scored_prefix(tokens, n_top) or [TokenLogprob(int(tokens[0]), None, ())]
        start = len(out) - 1  # row `start` predicts token start + 1: the cache holds tokens[:start]
        if start:
            target.prefill(tokens[:start])
        else:
            target.rewind(0)
        scoring = getattr(target, "scoring", None)  # a target on RPC workers: these passes are not decode steps
        with scoring() if scoring is not None else contextlib.nullcontext():
            for a in range(start, len(tokens) - 1, chunk):
                b = min(a + chunk, len(tokens) - 1)  # rows a..b-1 predict tokens a+1..b
                logits = target.eval(tokens[a:b], n_logits=b - a)  # [b - a, V]
                out += token_logprobs(logits, tokens[a + 1:b + 1], n_top)
        if stats is not None:
            stats.cached_prompt_tokens = start
        self._scored = ([int(t) for t in tokens], n_top, out[:])
        return out

    def _scored_prefix(self, tokens: Sequence[int], n_top: int) -> list[TokenLogprob]:
        """The entries of the last prompt scored that `tokens` shares, with at most n_top alternatives each
        (the alternatives are ordered by value, then id, so the first n_top of more are n_top's own); [] where
        the runtime's passes are not batch-invariant (each row must be what a one-token pass gives)."""
        scored_tokens, scored_top, entries = self._scored
        if scored_top < n_top or not (getattr(self.target, "exact_numerics", False)
                                      and getattr(self.target, "invariant_rows", 0)):
            return []
        shared = entries[:common_prefix(scored_tokens, tokens)]
        return [e if len(e.top) <= n_top else e._replace(top=e.top[:n_top]) for e in shared]

    def _with_prediction(self, prediction, start: int):
        """The drafter and policy of a request: with a prediction, the prediction drafter goes first."""
        drafter, policy = (self.drafter if self.draft_max > 0 else None), self.policy
        tokens = self.prediction_tokens(prediction) if prediction is not None else []
        if not tokens:
            return drafter, policy
        pred = PredictionDrafter(tokens, start)
        if drafter is None:  # no drafter of its own: the prediction still gets a policy (adaptive unless asked)
            if self.prediction_policy is None:
                if self.adaptive:
                    self._load_costs()
                self.prediction_policy = (
                    AdaptivePolicy(k_max=max(self.draft_max, 4), k_min=1, cost_prior=self.cost_profile,
                                   t1_prior=self.target.one_pass_seconds())
                    if self.adaptive else FixedPolicy(self.draft_max))
            return pred, self.prediction_policy
        return CompositeDrafter(pred, drafter), policy

    # -- generation ---------------------------------------------------------------------------------------
    def check_settings(self, params: SamplingParams, logprobs: Optional[int] = None,
                       constraint: Optional[Constraint] = None, post_sampling: bool = False) -> None:
        """A generation's settings against this target (stream checks them; `-n 0` generates nothing, but says
        what a generation with them would)."""
        if not isinstance(params, SamplingParams):
            raise SettingsError(f"params must be a SamplingParams, got {type(params).__name__} (speculant.generate "
                                f"takes temperature, top_k, ... as keywords)")
        if logprobs is not None and not (isinstance(logprobs, int) and not isinstance(logprobs, bool)
                                         and 0 <= logprobs <= MAX_TOP_LOGPROBS):
            raise SettingsError(f"top logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {logprobs!r}")
        if constraint is not None and params.infill is not None:
            raise SettingsError(INFILL_WITH_GRAMMAR)
        if post_sampling and logprobs is not None and constraint is not None:
            raise SettingsError("post-sampling probabilities with a grammar are not supported (the model's own "
                                "log-probabilities are)")
        bad = [t for t, _ in params.logit_bias if t >= self.target.n_vocab]
        if bad:
            raise SettingsError(f"logit bias: token id {bad[0]} is outside the vocabulary (0..{self.target.n_vocab - 1})")
        if len({t for t, b in params.logit_bias if b == -np.inf}) >= self.target.n_vocab:  # greedy took token 0
            raise SettingsError("every token's logit is -inf (a logit bias that bans them all)")

    def stream(self, prompt: str | Sequence[int | str], *, max_tokens: Optional[int] = 128,
               params: SamplingParams = SamplingParams(), stop: Sequence[str] = (),
               is_chat: bool = False, result: Optional[Result] = None,
               prediction: Optional[str | Sequence[int]] = None,
               logprobs: Optional[int] = None, constraint: Optional[Constraint] = None,
               post_sampling: bool = False) -> Iterator[TokenEvent]:
        """Generate, yielding tokens as they are accepted. Fills `result` (if given) as it goes.
        prediction: text (or token ids) the output is expected to mostly repeat ("Predicted Outputs"): it is
        drafted first, from wherever the output is aligned with it (drafters/prediction.py); lossless.
        logprobs: also give each token's log-probability under the target and this many alternatives
        (0..MAX_TOP_LOGPROBS) in result.logprobs and the events; they are the same bits as plain decoding's.
        post_sampling: those of the distribution each token was drawn from instead (the sampling settings
        applied; greedy: 1 for the token; llama-server's post_sampling_probs), alternatives only where above 0.
        constraint: a grammar the output must follow (constraint.py; e.g. target.grammar(gbnf)); it is
        advanced as tokens are emitted, so it serves one generation."""
        if self.closed:
            raise SettingsError("this engine is closed: load another one")
        max_tokens = token_limit(max_tokens) or self.target.n_ctx  # -1: until the end or a full context
        self.check_settings(params, logprobs, constraint, post_sampling)
        try:
            stop = [stop] if isinstance(stop, str) else list(stop or ())  # one string is one stop string
        except TypeError:  # not iterable (stop=5)
            stop = [stop]
        if not all(isinstance(s, str) for s in stop):
            raise SettingsError(f"stop must be a string or a list of strings, got {stop!r}")
        stop = [s for s in stop if s]
        if is_chat:  # a model without a chat template gets ChatML, whose turn end it may write as plain text
            from .chat import fallback_stop_strings
            stop += [s for s in fallback_stop_strings(self.target) if s not in stop]
        if params.couples and params.seed is None:  # coupled draws asked for without a seed: a random one
            params = dataclasses.replace(params, seed=int(np.random.SeedSequence().generate_state(1, np.uint64)[0]))
        context = self.tokenize_prompt(prompt, is_chat=is_chat)
        drafter, policy = self._with_prediction(prediction, len(context))
        result = result if result is not None else Result("", [], SpecStats())
        if logprobs is not None:
            result.logprobs = []
        stats = result.stats
        stats.prompt_tokens = len(context)
        stats.exact_numerics = getattr(self.target, "exact_numerics", True)
        target = self.target
        text = _TextTracker(target, stop)

        verify_step = getattr(target, "verify_step", None)  # a GPU backend verifies where its logits are
        if logprobs is not None or params.adjusts or constraint is not None:  # these need the logits on the host
            verify_step = None
        thread = threading.get_ident()
        target.busy(True)  # concurrent requests' passes wait for this one's (batching.py)
        try:
            steps = self._loop(context, drafter, policy, params, max_tokens, result, text, verify_step, logprobs,
                               constraint, post_sampling)
            _UNFINISHED.add(steps)
            while True:
                # one engine computes one step at a time: generations may interleave (a suspended stream), but two
                # threads stepping at once would share its KV cache (llama.cpp crashes, or answers go wrong)
                if not self._stepping.acquire(blocking=False):
                    steps.close()
                    raise SettingsError("this engine is generating in another thread: give each thread its own "
                                        "engine (load_engine(..., parallel=N) and engine.for_slot(i))")
                try:
                    event = next(steps)
                except StopIteration:
                    return
                finally:
                    self._stepping.release()
                yield event
        finally:
            target.busy(False, thread)

    def _loop(self, context: list[int], drafter: Optional[Drafter], policy, params: SamplingParams,
              max_tokens: int, result: Result, text: "_TextTracker", verify_step,
              n_top: Optional[int], constraint: Optional[Constraint],
              post_sampling: bool = False) -> Iterator[TokenEvent]:
        """The decode loop of `stream`: prefill, then draft -> verify -> accept -> rewind until done."""
        stats, target = result.stats, self.target
        n_prompt = len(context)
        rng = np.random.default_rng(params.seed)
        self._prefill(context, drafter, policy, params, max_tokens, stats, constraint)
        # end tokens banned, on which a grammar allowing nothing else still ends the answer (constrain_row)
        banned_eog = {t for t, b in params.logit_bias if b == -np.inf and target.is_eog(t)} if constraint else set()
        out = _Output(result, text, n_top, max_tokens, banned_eog)
        try:
            while True:
                room = min(max_tokens - stats.generated_tokens, target.n_ctx - len(context))
                if room <= 0:
                    if stats.generated_tokens < max_tokens:
                        result.message = f"context window full ({target.n_ctx} tokens); generation stopped"
                    result.finish_reason = "length"
                    return
                # draft
                t = time.perf_counter()
                sharing = target.sharing()  # requests whose passes merge with ours, this one included (batching.py)
                budget = policy.budget(room - 1, self.long_max, sharing) if drafter else None
                draft = drafter.propose(context, budget.k, params, rng, budget) if budget and budget.k > 0 else EMPTY
                draft_time = time.perf_counter() - t
                # verify: one target pass over [last token, drafts...] -> logits for k+1 positions
                t = time.perf_counter()
                candidate = context + draft.tokens
                n_pass = target.behind(candidate) if self.trace is not None else 0
                masking_time = 0.0  # grammar masking (constraint.MaskedRows)
                if verify_step is not None:
                    n_accepted, next_token = verify_step(candidate, len(draft), draft.probs, params, rng)
                else:
                    logits = target.sync(candidate, n_logits=len(draft) + 1)  # [k+1, V]
                    if not np.isfinite(logits[0].sum()):  # one row's sum: a NaN anywhere in it shows there
                        raise nonfinite_logits(getattr(target, "path", None) or target.name)
                    # logit bias and penalties per row, each with the drafts before it
                    adjusted = adjust_logits(logits, params, candidate, n_prompt)  # [k+1, V]
                    n_accepted, next_token, masking_time = _verify(adjusted, draft, params, rng, candidate, constraint)
                # masking costs per emitted token, drafting or not: kept out of what the policy weighs
                verify_time = time.perf_counter() - t - masking_time
                # accept, rewind
                new_tokens = draft.tokens[:n_accepted] + [next_token]
                new_logprobs = None
                if n_top is not None:  # rows 0..n_accepted predicted the new tokens
                    new_logprobs = token_logprobs(logits[:n_accepted + 1], new_tokens, n_top) if not post_sampling \
                        else sampling_logprobs(adjusted[:n_accepted + 1], params, new_tokens, n_top)
                context += new_tokens
                if constraint is not None:
                    for token in new_tokens:
                        if target.is_eog(token):  # the generation ends there (below)
                            break
                        constraint.accept(token)
                target.rewind(len(context) - 1)  # the cache keeps context[:-1]; rejected drafts are gone
                stats.record_step(draft.source, len(draft), n_accepted, draft_time, verify_time, keys=draft.keys)
                if self.trace is not None:  # what `speculant replay` re-runs (speculant/replay.py)
                    self.trace.append([draft.source, len(draft), n_accepted, max(n_pass, len(draft) + 1),
                                       draft.steps, draft.catchup_tokens])
                if drafter:
                    _observe(policy, draft, n_accepted, next_token, draft_time, verify_time, sharing)
                if (yield from out.emit(new_tokens, n_accepted, draft.source, new_logprobs)):
                    if out.taken < len(new_tokens):  # it ended inside the accepted drafts: count what it took
                        stats.end_inside_step(draft.source, len(draft), n_accepted, draft.keys, out.taken)
                    return
        finally:
            stats.decode_time = time.perf_counter() - out.t_decode
            if drafter:
                drafter.end(context)  # e.g. history keeps the output for later requests
                drafter.constrain(None)
            result.text = text.finish()
            stats.peak_rss_mb = memory.engine_peak_rss_mb(self)
            stats.model_memory_mb = memory.engine_models(self)

    def _prefill(self, context: list[int], drafter: Optional[Drafter], policy, params: SamplingParams,
                 max_tokens: int, stats: SpecStats, constraint: Optional[Constraint]) -> None:
        """The target's prompt processing, then the drafter's where the policy expects drafting to earn it."""
        target = self.target
        n_prompt = len(context)
        t0 = time.perf_counter()
        # everything but the last token, which each step feeds
        should_stop = target.should_stop  # this request's
        stats.cached_prompt_tokens = target.prefill(context[:-1]) or 0
        target_seconds = time.perf_counter() - t0
        if should_stop is not None and should_stop():  # before the draft model's prompt processing
            raise Cancelled("stopped after prompt processing")
        if drafter:
            policy.new_request(params.temperature if not params.greedy else 0.0)
            drafter.begin(context)  # e.g. history indexes the prompt
            drafter.constrain(constraint)
            # not if it will not draft (a one-token request, as a harness's echo scoring, never does), nor where
            # drafting could not earn back the draft model's prompt processing (a long new prompt, a short answer)
            behind = drafter.prepare_cost(context) if max_tokens > 1 else 0
            evaluated = n_prompt - 1 - stats.cached_prompt_tokens  # what the target's prefill just evaluated
            if max_tokens > 1 and policy.wants_draft_prefill(
                    drafter.paid, target.sharing(), behind=behind,
                    max_tokens=min(max_tokens, target.n_ctx - n_prompt),
                    target_prefill=(target_seconds, evaluated), draft_share=self.draft_share,
                    prompt_ratio=self.draft_prompt_ratio):
                t = time.perf_counter()
                drafter.prepare(context, should_stop)  # the draft model's prompt processing is prefill too
                draft_seconds = time.perf_counter() - t
                policy.observe_draft_prefill(behind, draft_seconds)
                if self.draft_backend is not None:
                    costprofile.observe_prompt_ratio(self.draft_backend, target, (draft_seconds, behind),
                                                     (target_seconds, evaluated))
        stats.prefill_time = time.perf_counter() - t0

    def generate(self, prompt: str | Sequence[int | str], **kwargs) -> Result:
        result = Result("", [], SpecStats())
        for _ in self.stream(prompt, result=result, **kwargs):
            pass
        return result

    @functools.cached_property
    def draft_share(self) -> Optional[float]:
        """The draft models' weights over the target's (memory.draft_share), read once."""
        return memory.draft_share(self)

    @functools.cached_property
    def draft_backend(self) -> Optional[Backend]:
        """The one draft model's backend (whose prompt processing the policy prices), else None."""
        backends = memory.draft_backends(self.drafter)
        return backends[0] if len(backends) == 1 else None

    @functools.cached_property
    def draft_prompt_ratio(self) -> Optional[float]:
        """The draft model's prompt cost per token over the target's, as earlier processes measured it."""
        return costprofile.prompt_ratio(self.draft_backend, self.target) if self.draft_backend else None

    def close(self) -> None:
        self.closed = True
        if self.drafter:
            self.drafter.close()
        self.target.close()


def _observe(policy, draft, n_accepted: int, next_token: int, draft_time: float, verify_time: float,
             sharing: int) -> None:
    """What the adaptive policy learns from a step: its costs and acceptance (a catch-up prefill is not what one
    more drafted token costs; a merged pass's time is not this request's), and whether shadow proposals at the
    position after a wholly accepted draft were right."""
    policy.observe(draft.source, len(draft), n_accepted, draft_time - draft.catchup_time, verify_time,
                   n_accepted + 1, keys=draft.keys, paid=draft.paid, draft_steps=draft.steps,
                   catchup_time=draft.catchup_time, catchup_tokens=draft.catchup_tokens, timed=sharing == 1)
    if n_accepted == len(draft):  # the position after the draft was reached: were they right?
        for shadow in draft.shadows:
            policy.observe_shadow(shadow.source, shadow.key, shadow.token == next_token)


def token_limit(max_tokens) -> Optional[int]:
    """A generation's token limit as given (an integer of any kind, numpy's too) -> int; None for -1 (or None):
    until the end of generation or a full context, as llama.cpp's -n -1 and llama-cpp-python's max_tokens.
    0 and other negative values are refused (nothing to generate: the CLI's -n 0 only checks the prompt)."""
    if max_tokens is None:
        return None
    if not isinstance(max_tokens, numbers.Integral) or isinstance(max_tokens, bool) or max_tokens < -1 or \
            max_tokens == 0:
        raise SettingsError(f"the token limit (-n / max_tokens) must be a positive integer, or -1 (until the end of "
                            f"generation or a full context), got {max_tokens!r}")
    return None if max_tokens == -1 else int(max_tokens)


GRAMMAR_ENDED = ("the grammar allows nothing here but an end of generation (or only banned tokens): the answer ends "
                 "there, though end-of-generation tokens were banned (ignore_eos or a logit bias)")


class _Output:
    """A request's output as the decode loop hands it out: tokens into the result, text through the stop
    strings, events with their logprobs; says when the generation has ended (end of generation, a stop string,
    max_tokens)."""

    def __init__(self, result: Result, text: "_TextTracker", n_top: Optional[int], max_tokens: int,
                 banned_eog: frozenset | set = frozenset()):
        self.result, self.text, self.n_top, self.max_tokens = result, text, n_top, max_tokens
        self.banned_eog = banned_eog  # end tokens banned (-inf) that a complete grammar still ends on
        self.lp_given = 0  # result.logprobs handed out with events
        self.t_decode = time.perf_counter()
        self.taken = 0  # of the last emit's tokens, how many the output took (the one that ended it included)

    def emit(self, new_tokens: list[int], n_accepted: int, source: str,
             new_logprobs: Optional[list]) -> Iterator[TokenEvent]:
        """Yield one event per new token (the first n_accepted were drafted by `source`); returns True when the
        generation ended with them."""
        result, stats, text, n_top = self.result, self.result.stats, self.text, self.n_top
        for i, token in enumerate(new_tokens):
            self.taken = i + 1
            if text.backend.is_eog(token):
                stats.ended_by_eog = True
                result.finish_reason = "stop"
                if token in self.banned_eog:
                    result.message = GRAMMAR_ENDED
                return True
            stats.generated_tokens += 1
            result.tokens.append(token)
            drafted = i < n_accepted
            by = source if drafted else ""  # the drafter that supplied the token, "" for the target's own
            result.from_draft.append(drafted)
            result.sources.append(by)
            if n_top is not None:
                result.logprobs.append(new_logprobs[i])
            piece, stopped = text.add(token)
            last = not stopped and stats.generated_tokens >= self.max_tokens
            if last:  # nothing is held back any more
                piece += text.release()
            if stopped:  # `tokens` stay the tokens of `text`: drop those that only spelled the stop string
                del result.tokens[text.n_tokens_kept:], result.from_draft[text.n_tokens_kept:], \
                    result.sources[text.n_tokens_kept:]
                if n_top is not None:
                    del result.logprobs[text.n_tokens_kept:]
            stats.decode_time = time.perf_counter() - self.t_decode
            event = TokenEvent(token, piece, drafted, by)
            if n_top is not None:
                n_out = text.n_tokens_out()
                event.logprobs = result.logprobs[self.lp_given:n_out]
                self.lp_given = max(self.lp_given, n_out)
            yield event
            if stopped:
                result.finish_reason, result.stop_string = "stop", text.matched
                return True
            if last:
                result.finish_reason = "length"
                return True
        return False


def _verify(adjusted: np.ndarray, draft, params: SamplingParams, rng: np.random.Generator, candidate: list[int],
            constraint: Optional[Constraint]) -> tuple[int, int, float]:
    """Verify a draft against the target's adjusted logits [k+1, V] (adjust_logits) of the pass over
    candidate[-(k+1):]: a grammar's mask per row (on demand, up to the first rejection), then greedy, coupled
    draws (a seeded request) or rejection sampling. Returns (n_accepted, next token, seconds spent masking)."""
    if params.couples:  # row i draws the token at position len(candidate) - k + i; the drafts' q play no part
        at = len(candidate) - len(draft)
        if constraint is not None:
            rows = MaskedRows(adjusted, constraint, params, draft.tokens)
            return (*verify_greedy_lazy(draft.tokens, lambda i: rows.coupled(i, params.seed, at + i)), rows.seconds)
        return (*verify_greedy_lazy(draft.tokens, lambda i: coupled_draw(probs_from_logits(adjusted[i], params),
                                                                         params.seed, at + i)), 0.0)
    if draft.probs is not None and not isinstance(draft.probs, np.ndarray):  # q left on a draft's device
        draft = dataclasses.replace(draft, probs=draft.probs.cpu().numpy())
    if constraint is not None:
        rows = MaskedRows(adjusted, constraint, params, draft.tokens)
        if params.greedy:
            return (*verify_greedy_lazy(draft.tokens, rows.argmax), rows.seconds)
        return (*verify_sampled_lazy(draft.tokens, draft.probs, rows.probs, rng, rows.draw), rows.seconds)
    if params.greedy:
        return (*verify_greedy(np.asarray(draft.tokens), adjusted.argmax(axis=-1)), 0.0)
    return (*verify_sampled(np.asarray(draft.tokens, dtype=np.int64), draft.probs,
                            probs_from_logits(adjusted, params), rng), 0.0)


class _TextTracker:
    """Incremental detokenization with stop strings: returns only text that can no longer be retracted."""

    def __init__(self, backend: Backend, stop: Sequence[str]):
        self.backend = backend
        self.stop = list(stop)
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # everything decoded (up to a stop string, once found)
        self.emitted = 0  # how much of self.text was handed out
        self.stopped = False
        self.matched = ""  # the stop string found
        self.starts: list[int] = []  # where each token's text begins in self.text
        self.n_tokens_kept = 0  # once stopped: the tokens that begin before the stop string

    def add(self, token: int) -> tuple[str, bool]:
        before = len(self.text)
        self.starts.append(before)
        self.text += self.decoder.decode(self.backend.token_bytes(token))
        for s in self.stop:
            at = self.text.find(s, max(0, before - len(s) + 1))
            if at >= 0:
                self.text = self.text[:at]
                self.stopped, self.matched = True, s
                self.n_tokens_kept = sum(start < at for start in self.starts)
                return self._emit(len(self.text)), True
        hold = max((_overlap(self.text, s) for s in self.stop), default=0)
        return self._emit(len(self.text) - hold), False

    def _emit(self, upto: int) -> str:
        piece = self.text[self.emitted:upto] if upto > self.emitted else ""
        self.emitted = max(self.emitted, upto)
        return piece

    def n_tokens_out(self) -> int:
        """Tokens whose text begins in what was handed out (all kept ones once stopped)."""
        if self.stopped:
            return self.n_tokens_kept
        return bisect.bisect_left(self.starts, self.emitted)  # starts never decrease

    def finish(self) -> str:
        if not self.stopped:  # flush a trailing partial UTF-8 sequence
            self.text += self.decoder.decode(b"", final=True)
        return self.text

    def release(self) -> str:
        """The generation ends here: all the text not handed out yet (held back as the start of a stop string)."""
        return self._emit(len(self.finish()))


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of stop. Only an n with stop[n - 1] equal to
    the text's last character can be one (found by rfind, in C): comparing every n cost len(stop)^2 a token, which
    256 long stop strings made seconds."""
    if not text:
        return 0
    last, hi = text[-1], min(len(stop) - 1, len(text))
    while hi > 0:
        i = stop.rfind(last, 0, hi)
        if i < 0:
            return 0
        if text.endswith(stop[:i + 1]):
            return i + 1
        hi = i
    return 0
