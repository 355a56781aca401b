"""Constrained decoding (grammars, JSON mode, JSON schemas), exact under speculation.

A constraint says which tokens may come next. The distribution decoded is the target's conditioned on it:
- greedy: the most likely allowed token;
- sampling: the sampler's distribution (temperature, top-k, top-p, min-p) restricted to the allowed tokens and
  renormalised, as if it drew until an allowed token came up; when none of the tokens it keeps is allowed, the
  mask comes first and the settings act on the allowed tokens (as vLLM's structured outputs always do).
Speculation stays exact: row i of a verify pass is masked with the constraint advanced by the drafts before
it, so a draft the grammar forbids has p = 0 there and is rejected, and the recovered / bonus token comes from
the masked row. Rows are masked on demand, up to the first rejection (MaskedRows).

Masking the whole vocabulary is slow (llama.cpp's grammar checks ~150k token texts: 20-50 ms a row on Qwen), so
only the tokens that can matter are asked about, most likely first: greedy, the likeliest until one is allowed;
sampling, the tokens the settings keep when they are few (top-k, top-p or min-p). A sampled row that keeps more
than DRAW_ABOVE tokens (no truncation at all: OpenAI's defaults) is not written out but drawn from
(draw_allowed: rejection, then Gumbel-max asking about tokens in order of their keys), and verification
keeps a draft there iff the draw equals it (verify.verify_sampled_lazy); a seeded request's coupled draw there
asks about blocks of tokens in order of their mass (coupled_draw_allowed). Only a row where the mask must come
first without top-k still checks every token (exact, and slow).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
import weakref
from abc import ABC, abstractmethod
from typing import Optional, Sequence

import numpy as np

from .errors import SettingsError
from .verify import (COUPLED_BLOCK, SamplingParams, block_exponentials, block_masses, coupled_draw, exponentials,
                     probs_from_logits, sample)

FIRST_CHECK = 64  # candidates asked about at once; each miss asks 8x more
DRAFT_CHECK = 512  # a drafter asks about at most this many of its likeliest tokens
DRAW_ABOVE = 2048  # a sampled row keeping more tokens than this is drawn from, not written out (MaskedRows)
REJECTION_TRIES = 8  # draw_allowed: plain draws tried before asking about tokens in order of key


class Constraint(ABC):
    """Which tokens may follow; `accept` advances it by an allowed token."""

    eog: frozenset = frozenset()  # end-of-generation tokens: allowed once complete, never accepted

    @property
    def allows_all(self) -> bool:
        """True when every token may come next (then a row needs no mask)."""
        return False

    @abstractmethod
    def allowed(self, tokens: np.ndarray) -> np.ndarray:
        """tokens [n] int -> [n] bool: may each come next?"""

    @abstractmethod
    def accept(self, token: int) -> None:
        """Advance by `token`, which must be allowed (not an end-of-generation token)."""

    @abstractmethod
    def fork(self) -> "Constraint":
        """An independent copy of the current state."""


def constrain_row(logits: np.ndarray, constraint: Constraint, params: SamplingParams,
                  limit: Optional[int] = None) -> np.ndarray:
    """logits [V] -> a copy with -inf wherever the token is not allowed or, as settled above, cannot be picked
    under `params` once the disallowed tokens are gone. A token whose logit is -inf (banned: a logit bias,
    ignore_eos) is never picked. Where the grammar is complete and allows only end-of-generation tokens, all
    banned, the answer ends there all the same: those tokens get logit 0 (no other token may follow, and
    llama.cpp's grammar aborts the process on any). Raises SettingsError when nothing else is allowed.
    limit: ask about at most this many of the likeliest tokens (a drafter's shortcut: any q is verified
    exactly); what is found among them is kept, possibly nothing (all -inf)."""
    v = logits.shape[-1]
    want = 1 if params.greedy else (params.top_k if 0 < params.top_k < v else v)
    out = np.full(v, -np.inf, dtype=logits.dtype)
    if limit is not None:
        head = _head(logits, min(limit, v))
        ok = head[constraint.allowed(head)][:want]
        out[ok] = logits[ok]
        return out
    pickable = logits > -np.inf  # [V]
    if want >= v:
        ok = pickable & constraint.allowed(np.arange(v))
        if not ok.any():
            return _ended(out, constraint)
        out[ok] = logits[ok]
        return out
    found: list[int] = []
    seen = ~pickable  # asked about already (ties at a cut may fall either side of it), or never picked
    m = 1 if want == 1 else max(FIRST_CHECK, want)
    while len(found) < want:
        order = _head(logits, min(m, v))  # the m most likely, most likely first (ties: lower id first)
        batch = order[~seen[order]]
        seen[batch] = True
        ok = constraint.allowed(batch)
        found.extend(batch[ok][:want - len(found)].tolist())
        if m >= v:
            break
        m *= FIRST_CHECK if m == 1 else 8
    if not found:
        return _ended(out, constraint)
    # tokens tied with the last one kept are kept too (probs_from_logits keeps ties at a top-k cut)
    ties = np.flatnonzero(logits == logits[found[-1]])
    ties = np.setdiff1d(ties, found)
    if len(ties):
        found.extend(ties[constraint.allowed(ties)].tolist())
    found = np.asarray(found)
    out[found] = logits[found]
    return out


def _ended(out: np.ndarray, constraint: Constraint) -> np.ndarray:
    """A row where the constraint allows no token that can be picked: its allowed end-of-generation tokens at
    logit 0 (a complete grammar whose end was banned), else SettingsError."""
    eog = np.array([t for t in sorted(constraint.eog) if t < len(out)], dtype=np.int64)
    eog = eog[constraint.allowed(eog)] if len(eog) else eog
    if not len(eog):
        raise SettingsError("the grammar allows no token here that the logit bias does not ban")
    out[eog] = 0.0
    return out


def masked_probs(logits: np.ndarray, constraint: Constraint, params: SamplingParams,
                 limit: Optional[int] = None, probs: Optional[np.ndarray] = None) -> Optional[np.ndarray]:
    """Sampling (T > 0): logits [V] -> the row's distribution under the constraint [V] float64 (see the module
    docstring). limit: as constrain_row's (a drafter's); then None when nothing allowed was found.
    probs: probs_from_logits(logits, params), when the caller has it already."""
    if probs is None:
        probs = probs_from_logits(logits, params)  # the sampler's own distribution
    support = np.flatnonzero(probs)
    if len(support) < len(probs):  # it truncates: condition what it keeps on the constraint
        keep = support[constraint.allowed(support)]
        if len(keep):
            out = np.zeros_like(probs)
            out[keep] = probs[keep]
            return out / out.sum()
    masked = constrain_row(logits, constraint, params, limit)  # the mask first, then the settings
    if not np.isfinite(masked).any():
        return None
    return probs_from_logits(masked, params)


def drawable(probs: np.ndarray, params: SamplingParams) -> bool:
    """Is a sampled row (the sampler's distribution [V]) better drawn from (draw_allowed) than written out?
    Only where masked_probs conditions the sampler's distribution on the constraint: when the settings truncate
    (a kept token may then be allowed) or truncate nothing at all (then the mask first is the same law)."""
    kept = int(np.count_nonzero(probs))
    return kept > DRAW_ABOVE and (kept < len(probs) or not params.truncates(len(probs)))


def draw_allowed(logits: np.ndarray, constraint: Constraint, params: SamplingParams,
                 probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from the row's law under the constraint (masked_probs's), asking about few tokens when most
    of the likely ones are allowed. probs: the sampler's distribution [V] (probs_from_logits), drawable.
    First by rejection: a draw from p that is allowed is a draw from p conditioned on the allowed tokens; up to
    REJECTION_TRIES draws (each asks about one token). Then, when the allowed tokens hold little of p,
    Gumbel-max in its exponential form: each kept token t gets the key p(t) / E_t, E_t ~ Exp(1), and the allowed
    token with the largest key is such a draw too; tokens are asked about in order of key, 64 first, then 8x
    more each time, until one is allowed. Either way the law is the same, so the switch keeps it."""
    cdf = np.cumsum(probs)  # [V]
    for _ in range(REJECTION_TRIES):
        token = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(cdf) - 1)
        if constraint.allowed(np.array([token]))[0]:
            return token
    support = np.flatnonzero(probs)
    keys = probs[support] / rng.standard_exponential(len(support))  # [n]
    seen = np.zeros(len(support), dtype=bool)
    m = FIRST_CHECK
    while True:
        order = _head(keys, min(m, len(keys)))  # positions in support, largest key first
        batch = order[~seen[order]]
        seen[batch] = True
        ok = np.flatnonzero(constraint.allowed(support[batch]))
        if len(ok):  # every key above batch's was asked about before and was not allowed
            return int(support[batch[ok[0]]])
        if m >= len(keys):
            break
        m *= 8
    # the sampler keeps no allowed token: the mask comes first (masked_probs), whose law is drawn from here
    law = masked_probs(logits, constraint, params, probs=probs)
    if law is None:
        raise SettingsError("the grammar allows no token here")
    return sample(law, rng)


def coupled_draw_allowed(logits: np.ndarray, constraint: Constraint, params: SamplingParams, probs: np.ndarray,
                         seed: int, position: int) -> int:
    """verify.coupled_draw of the row's law under the constraint (the sampler's distribution probs [V] restricted
    to the allowed tokens, as masked_probs's where it keeps one), asking about few tokens when the likely ones are
    allowed: a block's allowed mass is at most its mass, so blocks are asked about in order of the key their whole
    mass would give, until no block left could beat the best allowed one. Then the race among its allowed tokens."""
    mass = block_masses(probs)  # [blocks]
    blocks = np.flatnonzero(mass)
    noise = block_exponentials(seed, position, blocks)  # [n]
    bound = mass[blocks] / noise
    best_key, best = 0.0, None
    for j in np.argsort(-bound, kind="stable"):
        if bound[j] <= best_key:
            break
        start = int(blocks[j]) * COUPLED_BLOCK
        ids = start + np.flatnonzero(probs[start:start + COUPLED_BLOCK])
        ids = ids[constraint.allowed(ids)]
        key = probs[ids].sum() / noise[j] if len(ids) else 0.0
        if key > best_key:
            best_key, best = key, ids
    if best is None:  # the sampler keeps no allowed token: the mask comes first (masked_probs)
        law = masked_probs(logits, constraint, params, probs=probs)
        if law is None:
            raise SettingsError("the grammar allows no token here")
        return coupled_draw(law, seed, position)
    return int(best[np.argmax(probs[best] / exponentials(seed, position, best))])


def _head(logits: np.ndarray, m: int) -> np.ndarray:
    """Ids of the m largest logits, largest first, ties by id (the order of a stable argsort of -logits)."""
    head = np.argpartition(-logits, m - 1)[:m] if m < len(logits) else np.arange(len(logits))
    return head[np.lexsort((head, -logits[head]))]


class MaskedRows:
    """The rows of a verify pass over [last token, x_1..x_k] under a constraint, masked on demand: row i with
    the constraint advanced by x_1..x_i. Verification reads rows only up to its first rejection (verify.*_lazy),
    so a step masks as many rows as it emits tokens, drafting or not. `seconds`: time spent masking.
    A sampled row wider than DRAW_ABOVE tokens is not written out: probs(i) is None and draw(i, rng) draws it."""

    def __init__(self, logits: np.ndarray, constraint: Constraint, params: SamplingParams,
                 draft_tokens: Sequence[int]):
        self.logits, self.params, self.drafts = logits, params, list(draft_tokens)  # logits [k+1, V]
        self.state = constraint.fork() if self.drafts else constraint  # never advanced past the live state
        self.done = 0  # rows masked so far; the state is advanced by drafts[:done]
        self.rows: list[Optional[np.ndarray]] = []
        self.wide: dict[int, np.ndarray] = {}  # row -> the sampler's distribution of a row left to draw()
        self.seconds = 0.0

    def _masked(self, i: int, mask) -> np.ndarray:
        """Row i through mask(logits row, state); reading row i means x_1..x_i were accepted."""
        t = time.perf_counter()
        while self.done <= i:
            if self.done:
                self.state.accept(self.drafts[self.done - 1])  # accepted, so allowed
            self.rows.append(mask(self.logits[self.done], self.state))
            self.done += 1
        self.seconds += time.perf_counter() - t
        return self.rows[i]

    def argmax(self, i: int) -> int:
        """Greedy: the likeliest allowed token of row i."""
        return int(np.argmax(self._masked(i, lambda row, state: row if state.allows_all
                                          else constrain_row(row, state, self.params))))

    def probs(self, i: int) -> Optional[np.ndarray]:
        """Sampling: row i's distribution under the constraint [V] (masked_probs), or None: draw(i, rng)."""
        return self._masked(i, self._law)

    def _law(self, row: np.ndarray, state: Constraint) -> Optional[np.ndarray]:
        probs = probs_from_logits(row, self.params)
        if state.allows_all:
            return probs
        if drawable(probs, self.params):
            self.wide[self.done] = probs
            return None
        return masked_probs(row, state, self.params, probs=probs)

    def coupled(self, i: int, seed: int, position: int) -> int:
        """A seeded request's token at row i (verify.coupled_draw of its law under the constraint); rows are
        read in order, as by verify.verify_greedy_lazy."""
        law = self.probs(i)
        if law is not None:
            return coupled_draw(law, seed, position)
        t = time.perf_counter()
        token = coupled_draw_allowed(self.logits[i], self.state, self.params, self.wide[i], seed, position)
        self.seconds += time.perf_counter() - t
        return token

    def draw(self, i: int, rng: np.random.Generator) -> int:
        """Sampling: one token from row i's law under the constraint; row i must be the last one read (the
        state is advanced by the drafts before it), and probs(i) None."""
        assert self.done == i + 1 and i in self.wide, "draw() reads the row probs() just left to it"
        t = time.perf_counter()
        token = draw_allowed(self.logits[i], self.state, self.params, self.wide[i], rng)
        self.seconds += time.perf_counter() - t
        return token


# ---------------------------------------------------------------------------------------------------------
# llama.cpp's GBNF grammars


_STDERR_CAUGHT = threading.Lock()  # one catch of fd 2 at a time
_PARSE_ERROR = "error parsing grammar: "


def _cut_grammar_dump(text: str, grammar: str) -> tuple[Optional[str], str]:
    """llama_grammar_parser::parse's one fprintf, "parse: error parsing grammar: <what>\n\n<grammar>\n" (<what> may
    run over lines: "expecting ::= at <the rest of the grammar>"), found in `text` -> (its first line of <what>, text
    without the dump); (None, text) where there is none."""
    at = text.find(_PARSE_ERROR)
    if at < 0:
        return None, text
    dump = "\n\n" + grammar + "\n"
    end = text.rfind(dump, at)
    if end < 0:
        return None, text
    line_start = text.rfind("\n", 0, at) + 1
    what = text[at + len(_PARSE_ERROR):end].strip().splitlines()
    return (what[0].strip() if what else None), text[:line_start] + text[end + len(dump):]


def _write_all(fd: int, data: bytes) -> None:
    """All of data to fd, or as much as it takes (stderr closed or full: what other threads wrote is lost, never the
    request)."""
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass


@contextlib.contextmanager
def _grammar_error_caught(grammar: str):
    """llama.cpp prints a grammar it cannot parse to stderr, whole, after its error: catch that, as a callable giving
    the error (None if there was none), and keep it off the terminal. C code writes fd 2 from any thread, so every
    thread's stderr is caught while the grammar is parsed (a server's log lines); all but the dump is written out
    afterwards. Without a temporary file or a stderr to catch, nothing is caught (the dump goes to stderr)."""
    error: Optional[str] = None
    with _STDERR_CAUGHT:
        try:
            sys.stderr.flush()
            sink = tempfile.TemporaryFile()
        except (OSError, ValueError, AttributeError):  # no stderr (a daemon's closed fd 2), no temporary directory
            yield lambda: None
            return
        with sink:
            try:
                saved = os.dup(2)
            except OSError:
                yield lambda: None
                return
            os.dup2(sink.fileno(), 2)
            try:
                yield lambda: error
            finally:
                try:
                    sys.stderr.flush()
                except (OSError, ValueError, AttributeError):
                    pass
                os.dup2(saved, 2)
                os.close(saved)
                sink.seek(0)
                text = sink.read().decode("utf-8", errors="replace")
                if text:
                    error, text = _cut_grammar_dump(text, grammar)
                    _write_all(2, text.encode("utf-8"))


class GrammarConstraint(Constraint):
    """A GBNF grammar over a llama.cpp vocabulary (llama.cpp's grammar sampler: its `apply` masks candidates,
    `accept` advances the parse stacks; end-of-generation tokens are allowed once the grammar is complete)."""

    def __init__(self, sampler, vocab_size: int, eog: frozenset):
        import llama_cpp as ll

        self._ll = ll
        self._sampler = sampler
        self.vocab_size = vocab_size
        self.eog = eog
        weakref.finalize(self, ll.llama_sampler_free, sampler)

    @classmethod
    def from_gbnf(cls, vocab, vocab_size: int, eog: frozenset, grammar: str, root: str = "root",
                  log: Optional[Sequence[str]] = None) -> "GrammarConstraint":
        """vocab: the model's llama_vocab pointer. A grammar llama.cpp cannot parse is a SettingsError."""
        import llama_cpp as ll

        if not grammar.strip():
            raise SettingsError("the grammar is empty")
        with _grammar_error_caught(grammar) as parse_error:
            sampler = ll.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), root.encode("utf-8"))
        if not sampler:
            lines = [parse_error()] if parse_error() else \
                [line.strip() for line in list(log or [])[-4:] if "pars" in line or "error" in line]
            raise SettingsError("invalid grammar (GBNF)" + (f": {lines[-1]}" if lines else ""))
        return cls(sampler, vocab_size, eog)

    def allowed(self, tokens: np.ndarray) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int32)
        n = len(tokens)
        if n == 0:
            return np.zeros(0, dtype=bool)
        data = (self._ll.llama_token_data * n)()
        rec = np.frombuffer(data, dtype=_TOKEN_DATA)
        rec["id"] = tokens
        rec["logit"] = 0.0
        arr = self._ll.llama_token_data_array(data=data, size=n, selected=-1, sorted=False)
        self._ll.llama_sampler_apply(self._sampler, ctypes.byref(arr))
        return np.isfinite(rec["logit"])

    def accept(self, token: int) -> None:
        if token in self.eog:
            return  # the generation ends there
        self._ll.llama_sampler_accept(self._sampler, int(token))

    def fork(self) -> "GrammarConstraint":
        return GrammarConstraint(self._ll.llama_sampler_clone(self._sampler), self.vocab_size, self.eog)


class TriggeredGrammar(Constraint):
    """Free text until the output writes `trigger`, then `grammar` (a constraint in its start state, forked
    for each use) until the output ends with `end`, then free again, and so on: llama.cpp's lazy grammars, for
    the tool calls a model may or may not make (tools.Tools.body_grammar). The trigger must end with a token
    (Qwen's <tool_call> is one token). token_text: a token's text as the output spells it (Backend.token_text).
    While free it allows everything; the end-of-generation tokens are the grammar's to forbid inside a call."""

    def __init__(self, token_text, trigger: bytes, grammar: Constraint, end: bytes):
        self.token_text, self.trigger, self.grammar, self.end = token_text, trigger, grammar, end
        self.eog = grammar.eog
        self.inner: Optional[Constraint] = None  # the grammar of the call being written, or None (free)
        self.tail = b""  # the output's last bytes, enough to see the trigger / end arrive

    @property
    def allows_all(self) -> bool:
        return self.inner is None

    def allowed(self, tokens: np.ndarray) -> np.ndarray:
        if self.inner is None:
            return np.ones(len(tokens), dtype=bool)
        return self.inner.allowed(tokens)

    def accept(self, token: int) -> None:
        if token in self.eog:
            return
        mark = self.trigger if self.inner is None else self.end
        if self.inner is not None:
            self.inner.accept(token)
        self.tail = (self.tail + self.token_text(token))[-len(mark):]
        if self.tail == mark:
            self.inner = self.grammar.fork() if self.inner is None else None
            self.tail = b""

    def fork(self) -> "TriggeredGrammar":
        out = TriggeredGrammar(self.token_text, self.trigger, self.grammar, self.end)
        out.inner = self.inner.fork() if self.inner is not None else None
        out.tail = self.tail
        return out


_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data


# Constraint keywords llama-cpp-python's schema converter drops: a schema that uses one is refused, since answers
# would not hold to it (integer bounds are enforced by _Converter where the values can be listed)
UNENFORCED = ("multipleOf", "uniqueItems", "contains", "minContains", "maxContains", "not", "if", "then", "else",
              "dependentRequired", "dependentSchemas", "patternProperties", "propertyNames", "minProperties",
              "maxProperties", "unevaluatedProperties", "unevaluatedItems")
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
ANY_TYPES = ["string", "number", "boolean", "null", "object", "array"]  # any JSON value


def _check_schema(node, path: str = "schema") -> None:
    """SettingsError naming the first keyword the grammar would not enforce, or an impossible setting."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check_schema(item, f"{path}[{i}]")
        return
    if not isinstance(node, dict):
        return
    for key in UNENFORCED:
        if key in node:
            raise SettingsError(f"{path}: '{key}' cannot be enforced by the grammar; remove it (answers would "
                                f"not hold to it)")
    for key in ("minItems", "maxItems", "minLength", "maxLength"):
        if key in node and not (isinstance(node[key], int) and not isinstance(node[key], bool) and node[key] >= 0):
            raise SettingsError(f"{path}: '{key}' must be an integer >= 0, got {node[key]!r}")
    for lo, hi in (("minItems", "maxItems"), ("minLength", "maxLength")):
        if lo in node and hi in node and node[lo] > node[hi]:
            raise SettingsError(f"{path}: '{lo}' {node[lo]} is more than '{hi}' {node[hi]}: nothing can match")
    if "prefixItems" in node and node.get("items") not in (None, False):
        raise SettingsError(f"{path}: 'items' beside 'prefixItems' (items after the tuple) cannot be enforced; give "
                            f"'items': false or list every item in 'prefixItems'")
    props = node.get("properties")
    if isinstance(props, dict) and "" in props:
        raise SettingsError(f"{path}.properties: an empty property name cannot be written by the grammar")
    for key in ("enum", "anyOf", "oneOf", "allOf", "type"):
        if isinstance(node.get(key), list) and not node[key]:
            raise SettingsError(f"{path}: '{key}' is an empty list: nothing can match")
    for key in ("enum", "const"):
        for value in (node[key] if key == "enum" and isinstance(node.get(key), list) else [node.get(key)]):
            if _non_finite(value):
                raise SettingsError(f"{path}: '{key}' holds NaN or Infinity, which JSON cannot write")
    for key, value in node.items():  # on to the schemas inside (a property named "default" is a schema)
        if key in SCHEMA_MAPS and isinstance(value, dict):
            for sub_name, sub in value.items():
                _check_schema(sub, f"{path}.{key}.{sub_name}")
        elif key in SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                _check_schema(sub, f"{path}.{key}[{i}]")
        elif key in SCHEMA_KEYS and isinstance(value, dict):
            _check_schema(value, f"{path}.{key}")


SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
SCHEMA_KEYS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
               "unevaluatedItems", "unevaluatedProperties")
MAX_COUNT = 2000  # the largest count a grammar holds: llama.cpp's MAX_REPETITION_THRESHOLD (above it an upper
# count silently became unbounded and a lower one did not parse)


def _non_finite(value) -> bool:
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_non_finite(v) for v in value)
    return False


def _fits(value, schema: dict) -> bool:
    """Does an enum/const value satisfy the keywords beside it (type, bounds, lengths, pattern)? Those the grammar
    would otherwise drop: the converter wrote the listed values whatever else the schema said."""
    kinds = schema.get("type")
    kinds = kinds if isinstance(kinds, list) else [kinds] if kinds else None
    json_type = ("null" if value is None else "boolean" if isinstance(value, bool) else
                 "integer" if isinstance(value, int) or isinstance(value, float) and value.is_integer() else
                 "number" if isinstance(value, float) else "string" if isinstance(value, str) else
                 "array" if isinstance(value, list) else "object")
    if kinds is not None and json_type not in kinds and not (json_type == "integer" and "number" in kinds):
        return False
    if json_type in ("integer", "number"):
        for key, ok in (("minimum", lambda b: value >= b), ("maximum", lambda b: value <= b),
                        ("exclusiveMinimum", lambda b: value > b), ("exclusiveMaximum", lambda b: value < b)):
            if isinstance(schema.get(key), (int, float)) and not ok(schema[key]):
                return False
    if json_type == "string":
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", len(value)):
            return False
        if isinstance(schema.get("pattern"), str):
            try:
                if not re.search(schema["pattern"], value):
                    return False
            except re.error:
                return True  # the pattern's own error is named where the grammar is built
    if "const" in schema and schema["const"] != value:
        return False
    return True


def _bounded_number_rule(node: dict) -> Optional[str]:
    """GBNF for an integer or number between the node's bounds (with no trailing space), or None where it has
    none (numrange: digit by digit, any range)."""
    from decimal import Decimal

    from . import numrange

    if not any(key in node for key in BOUNDS) or node.get("type") not in (None, "integer", "number"):
        return None  # bounds constrain numbers only: beside another type they say nothing
    if node.get("type") is None:
        raise SettingsError(f"bounds ({', '.join(k for k in BOUNDS if k in node)}) need \"type\": \"integer\" or "
                            f"\"number\" beside them (without a type, the grammar would not bound a number)")
    bound = {}
    for key in BOUNDS:
        if key in node:
            value = node[key]
            if not (isinstance(value, int) and not isinstance(value, bool)
                    or isinstance(value, float) and math.isfinite(value)):  # (a huge int overflows isfinite)
                raise SettingsError(f"'{key}' must be a number, got {value!r}")
            bound[key] = Decimal(repr(value)) if isinstance(value, float) else Decimal(value)  # as its JSON spells it
    lows = [(bound[k], k == "exclusiveMinimum") for k in ("minimum", "exclusiveMinimum") if k in bound]
    highs = [(bound[k], k == "exclusiveMaximum") for k in ("maximum", "exclusiveMaximum") if k in bound]
    (lo, lo_strict), (hi, hi_strict) = (max(lows) if lows else (None, False),
                                        min(highs, key=lambda b: (b[0], not b[1])) if highs else (None, False))
    between = " and ".join(f"{k} {node[k]}" for k in BOUNDS if k in node)
    if node["type"] == "integer":
        low = None if lo is None else math.floor(lo) + 1 if lo_strict else math.ceil(lo)
        high = None if hi is None else math.ceil(hi) - 1 if hi_strict else math.floor(hi)
        if low is not None and high is not None and low > high:
            raise SettingsError(f"no integer satisfies {between}")
        return numrange.integers(low, high)
    body = numrange.decimals(lo, lo_strict, hi, hi_strict)
    if body is None:
        raise SettingsError(f"no number satisfies {between}")
    return body


# string formats the converter has no rule for (it has date, time, date-time, uuid), as patterns: the shapes
# OpenAI's structured outputs name; other formats stay annotations, as JSON Schema reads them by default
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_OCTET = r"(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
FORMAT_PATTERNS = {
    "email": r"^[A-Za-z0-9._%+-]+@" + _LABEL + r"(\." + _LABEL + r")+$",
    "hostname": "^" + _LABEL + r"(\." + _LABEL + ")*$",
    "ipv4": "^" + _OCTET + r"(\." + _OCTET + "){3}$",
    "uri": r"^[A-Za-z][A-Za-z0-9+.-]*:[^\s]+$",
}

# keywords that describe a schema without constraining its values
ANNOTATIONS = ("description", "title", "default", "examples", "$comment", "$defs", "definitions", "$schema", "$id",
               "deprecated", "readOnly", "writeOnly")


def _merge_schemas(a: dict, b: dict) -> dict:
    """One schema that holds where both a and b hold (allOf of the two), keyword by keyword; SettingsError where
    the two set one keyword differently and no single value means both."""
    out = dict(a)
    for first, second in ((a, b), (b, a)):  # each part's additionalProperties judges the other part's properties
        extra = set(second.get("properties") or ()) - set(first.get("properties") or ())
        if extra and first.get("additionalProperties") not in (None, True):
            raise SettingsError(f"allOf: properties {sorted(extra)} are 'additional' to a part that restricts "
                                f"additionalProperties; merge the parts into one object schema")
    for key, value in b.items():
        if key not in out or out[key] == value:
            out[key] = value
        elif key == "properties" and isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = {**out[key], **{n: (sub if n not in out[key] or out[key][n] == sub
                                           else _merge_schemas(out[key][n], sub)) for n, sub in value.items()}}
        elif key == "required":
            out[key] = list(dict.fromkeys([*out[key], *value]))
        elif key in ANNOTATIONS:  # a description or title says nothing of the values: the first one stays
            continue
        elif key in ("minimum", "exclusiveMinimum", "minLength", "minItems"):
            out[key] = max(out[key], value)
        elif key in ("maximum", "exclusiveMaximum", "maxLength", "maxItems"):
            out[key] = min(out[key], value)
        elif key == "type":
            mine = set(out[key] if isinstance(out[key], list) else [out[key]])
            theirs = set(value if isinstance(value, list) else [value])
            both = mine & theirs  # and an integer is a number:
            both |= {"integer"} if {"integer", "number"} <= mine | theirs and not {"integer", "number"} <= mine \
                and not {"integer", "number"} <= theirs else set()
            if not both:
                raise SettingsError(f"allOf: no value is both {out[key]!r} and {value!r}")
            out[key] = sorted(both)[0] if len(both) == 1 else sorted(both)
        else:
            raise SettingsError(f"allOf: '{key}' is set differently by the schemas it combines ({out[key]!r} and "
                                f"{value!r}); merge them into one")
    return out


def _converter(strict: bool = True):
    """llama-cpp-python's JSON-schema converter, mended: strings hold no raw control characters (JSON forbids them:
    its output did not parse), each $ref gets a rule of its own (a $defs entry named like a built-in rule, "char" or
    "number", was replaced by it), numbers keep their bounds, and a list of types keeps the other keywords."""
    from llama_cpp.llama_grammar import PRIMITIVE_RULES, RESERVED_NAMES, BuiltinRule, SchemaConverter

    def _rule_name(name: str) -> str:
        return name + "-" if name in RESERVED_NAMES else name or "root"  # as the converter names its rules

    class Converter(SchemaConverter):
        def __init__(self, **kw):
            super().__init__(**kw)
            self._ref_rules: dict[str, str] = {}

        def _format_literal(self, literal):
            # the converter escaped only CR, LF and '"': a backslash in a const/enum (JSON's own escapes among
            # them: json.dumps("a\nb") holds one) reached the grammar unescaped, so answers held a raw newline or
            # an invalid escape, or the grammar did not parse
            escaped = literal.replace("\\", "\\\\").replace('"', '\\"').replace("\r", "\\r").replace("\n", "\\n")
            return f'"{escaped}"'

        def _visit_pattern(self, pattern, name):
            # the converter's own reading wrote "\\d" into the grammar (which then did not parse), let "." and
            # [^x] write a raw '"' into the string, and took only ^...$ patterns
            from .jsonpattern import pattern_body

            try:
                body = pattern_body(pattern)
            except SettingsError:
                if strict:
                    raise
                return self.visit({"type": "string"}, name)  # not strict: the pattern is left to the model
            return self._add_rule(name, '"\\"" ' + body + ' "\\"" space')

        def _generate_constant_rule(self, value):
            return self._format_literal(json.dumps(value, ensure_ascii=False))  # "ü" as a model writes it

        def _add_primitive(self, name, rule):
            if name == "char":
                rule = BuiltinRule(PRIMITIVE_RULES["char"].content.replace('[^"\\\\]', '[^"\\\\\\x7F\\x00-\\x1F]', 1),
                                   rule.deps)
            return super()._add_primitive(name, rule)

        def _resolve_ref(self, ref):
            if ref not in self._ref_rules:
                base = "ref-" + ("".join(c if c.isalnum() else "-" for c in ref.split("/")[-1]).strip("-") or "def")
                name, i = base, 1
                while name in self._rules or name in self._ref_rules.values():
                    i += 1
                    name = f"{base}{i}"
                self._ref_rules[ref] = name  # a reference inside its own definition names this rule
                self._ref_rules[ref] = self.visit(self._refs[ref], name)
            return self._ref_rules[ref]

        def _dereferenced(self, part):
            """An allOf part with its $ref (and the $refs that one leads to) merged in, its own keywords kept."""
            seen = set()
            while isinstance(part, dict) and part.get("$ref") in self._refs and part["$ref"] not in seen:
                seen.add(part["$ref"])
                rest = {k: v for k, v in part.items() if k != "$ref"}
                target = self._refs[part["$ref"]]
                part = _merge_schemas(target, rest) if rest else target
            return part

        def _combined(self, schema: dict) -> dict:
            """The schema with its combinations spelled out where the converter read one part and dropped the
            rest: allOf's parts (and a $ref's sibling keywords) merged into one schema, and the keywords beside
            anyOf/oneOf or a list of types carried into each alternative."""
            own = stripped = {k: v for k, v in schema.items() if k not in ANNOTATIONS}
            if "$ref" in own and len(own) > 1:
                own = {"allOf": [{"$ref": own.pop("$ref")}, own]}
            for _ in range(64):
                if "allOf" not in own:
                    break
                parts = own.pop("allOf")
                for part in parts if isinstance(parts, list) else [parts]:
                    part = self._dereferenced(part)
                    own = _merge_schemas(own, {k: v for k, v in part.items() if k not in ANNOTATIONS})
            else:
                raise SettingsError("allOf nests too deep or refers to itself")
            if isinstance(own.get("type"), list) and not {"anyOf", "oneOf"} & set(own):
                own = {"anyOf": [{"type": t} for t in own["type"]],
                       **{k: v for k, v in own.items() if k != "type"}}
            alternatives = own.get("anyOf", own.get("oneOf"))
            rest = {k: v for k, v in own.items() if k not in ("anyOf", "oneOf")}
            if isinstance(alternatives, list) and rest:
                return {"anyOf": [_merge_schemas(rest, alt) if isinstance(alt, dict) else alt
                                  for alt in alternatives]}
            return own if own != stripped else schema

        def _spelled_out(self, schema: dict) -> dict:
            """The combined schema with what the converter would drop or misread made explicit, or refused."""
            if not {k: v for k, v in schema.items() if k not in ANNOTATIONS}:
                return {"type": ANY_TYPES}  # {} or annotations only (pydantic's Any): any value (it was objects)
            out = dict(schema)
            if out.get("items") in ({}, True):  # any items: the converter read {} as no items schema and failed
                out["items"] = {"type": ANY_TYPES}
            if out.get("items") is False and "prefixItems" not in out:  # no items at all: []
                out.update(items={"type": ANY_TYPES}, maxItems=0)
            lengths = "minLength" in out or "maxLength" in out
            if lengths and "pattern" in out:
                raise SettingsError("'minLength'/'maxLength' beside a 'pattern' cannot be enforced (the grammar "
                                    "follows the pattern); write the length into the pattern")
            if lengths and "format" in out:  # a format is an annotation in JSON Schema, lengths are not: keep
                out.pop("format")  # those (pydantic's HttpUrl: format uri, maxLength 2083)
            if out.get("format") in FORMAT_PATTERNS and "pattern" not in out and out.get("type") in (None, "string"):
                out.update(type="string", pattern=FORMAT_PATTERNS[out["format"]])  # else any string
            if out.get("type") == "array" and "items" not in out and "prefixItems" not in out \
                    and ("minItems" in out or "maxItems" in out):
                out["items"] = {"type": ANY_TYPES}  # else the converter's any-array, counts dropped
            tuple_items = out.get("prefixItems")
            if isinstance(tuple_items, list) and (out.get("maxItems", len(tuple_items)) < len(tuple_items)
                                                  or out.get("minItems", 0) > len(tuple_items)):
                raise SettingsError("'minItems'/'maxItems' beside 'prefixItems' cannot be enforced (the grammar "
                                    "writes every prefix item)")
            extra = out.get("additionalProperties")
            if out.get("type") in (None, "object") and isinstance(out.get("required"), list):
                props = dict(out.get("properties") or {})
                missing = [r for r in out["required"] if isinstance(r, str) and r not in props]
                if missing and extra is False:
                    raise SettingsError(f"required property '{missing[0]}' is not among 'properties' and "
                                        f"additionalProperties is false: nothing can match")
                if missing:  # required, so written: valued as additionalProperties says (or anything)
                    props.update({r: extra if isinstance(extra, dict) else {} for r in missing})
                    out["properties"] = props
            if "properties" in out and extra not in (None, False):
                # the converter's extra keys broke JSON after an optional property ('{"a": 1"b": {}}') and could
                # repeat a named one: answers keep to the named properties (valid, if narrower)
                out["additionalProperties"] = False
            for key in ("enum", "const"):
                if key in out:
                    listed = out["enum"] if key == "enum" else [out["const"]]
                    rest = {k: v for k, v in out.items() if k not in ("enum", "const")}
                    kept = [v for v in listed if _fits(v, {**rest, **({"const": out["const"]} if key == "enum"
                                                                       and "const" in out else {})})]
                    if not kept:
                        raise SettingsError(f"no '{key}' value satisfies the keywords beside it: nothing can match")
                    return {"enum": kept}  # the values alone: every one of them satisfies the rest
            return out

        def _counted(self, schema: dict, name: str) -> Optional[str]:
            """Strings with minLength/maxLength and arrays with minItems/maxItems as GBNF counts (x{m,n}): the
            converter nested one optional group per item, and llama.cpp's parser crashed past ~15,000."""
            string = schema.get("type") == "string" and ("minLength" in schema or "maxLength" in schema) \
                and "pattern" not in schema and "format" not in schema
            array = schema.get("type") in (None, "array") and isinstance(schema.get("items"), dict) \
                and ("minItems" in schema or "maxItems" in schema)
            if not (string or array):
                return None
            lo, hi = (schema.get("minLength", 0), schema.get("maxLength")) if string else \
                (schema.get("minItems", 0), schema.get("maxItems"))
            if max(lo, hi or 0) > MAX_COUNT:
                if strict:
                    raise SettingsError(f"counts above {MAX_COUNT} ('{'maxLength' if string else 'maxItems'}' "
                                        f"{hi}) cannot be enforced by a grammar")
                lo, hi = min(lo, MAX_COUNT), None  # not strict: a hint
            rule = _rule_name(name)

            def times(a: int, b: Optional[int]) -> str:
                return f"{{{a},}}" if b is None else f"{{{a},{b}}}"

            if string:
                char = self._add_primitive("char", PRIMITIVE_RULES["char"])
                return self._add_rule(rule, f'"\\"" {char}{times(lo, hi)} "\\"" space')
            if hi == 0:
                return self._add_rule(rule, '"[" space "]" space')
            item = self.visit(schema["items"], f"{name}{'-' if name else ''}item")
            more = f'("," space {item}){times(max(lo - 1, 0), None if hi is None else hi - 1)}'
            body = f"{item} {more}" if lo > 0 else f"({item} {more})?"
            return self._add_rule(rule, f'"[" space {body} "]" space')

        def visit(self, schema, name):
            if schema is True:  # boolean schemas: true is any value
                schema = {}
            if schema is False:
                raise SettingsError("a schema 'false' allows no value: nothing can match")
            if isinstance(schema, dict):
                try:
                    schema = self._spelled_out(self._combined(schema))
                except SettingsError:
                    if strict:
                        raise  # not strict: the converter's reading, keywords dropped as before
            if isinstance(schema, dict) and not {"$ref", "anyOf", "oneOf", "enum", "const"} & set(schema):
                try:
                    body = _bounded_number_rule(schema)
                except SettingsError:
                    if strict:
                        raise
                    body = None  # not strict: the bounds are left to the model, as the converter left them
                if body is not None:
                    return self._add_rule(_rule_name(name), body + " space")
                counted = self._counted(schema, name)
                if counted is not None:
                    return counted
            return super().visit(schema, name)

    return Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


def _prefixed(gbnf: str, prefix: str) -> str:
    """The grammar with each of its rule names prefixed (literals, character sets and comments left as they are)."""
    names = set(re.findall(r"^\s*([A-Za-z0-9-]+)\s*::=", gbnf, re.M))
    out, i = [], 0
    while i < len(gbnf):
        c = gbnf[i]
        if c in "\"[":
            close, j = ('"' if c == '"' else "]"), i + 1
            while j < len(gbnf) and gbnf[j] != close:
                j += 2 if gbnf[j] == "\\" else 1
            out.append(gbnf[i:j + 1])
            i = j + 1
        elif c == "{":  # a count: numbers, not rule names
            j = gbnf.find("}", i)
            j = len(gbnf) if j < 0 else j + 1
            out.append(gbnf[i:j])
            i = j
        elif c == "#":
            j = gbnf.find("\n", i)
            j = len(gbnf) if j < 0 else j
            out.append(gbnf[i:j])
            i = j
        elif c.isalnum() or c == "-":
            j = i
            while j < len(gbnf) and (gbnf[j].isalnum() or gbnf[j] == "-"):
                j += 1
            word = gbnf[i:j]
            out.append(prefix + word if word in names else word)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def either_grammar(first: str, second: str) -> str:
    """GBNF for a sentence of either grammar (their rules kept apart by prefixes)."""
    return f"root ::= a-root | b-root\n{_prefixed(first, 'a-')}\n{_prefixed(second, 'b-')}"


def json_grammar(schema: Optional[str | dict] = None, strict: bool = True) -> str:
    """GBNF for any JSON object (schema None) or for a JSON schema (llama-cpp-python's converter, mended:
    _converter); strict: a keyword the grammar would not enforce is refused rather than dropped (not strict: the
    tools' parameter schemas, which the model also reads in its prompt, keep them as hints)."""
    from llama_cpp.llama_grammar import JSON_GBNF

    if schema is None:
        return JSON_GBNF
    text = schema if isinstance(schema, str) else json.dumps(schema)
    try:
        parsed = json.loads(text)
    except ValueError as e:
        raise SettingsError(f"the JSON schema is not valid JSON: {e}") from None
    if parsed is True:  # JSON Schema's boolean form: any value
        parsed = {}
    if not isinstance(parsed, dict):
        what = "false, which no value matches" if parsed is False else f"{type(parsed).__name__} {text[:40]}"
        raise SettingsError(f"a JSON schema is an object (or true), got {what}")
    if strict:
        _check_schema(parsed)
    if isinstance(parsed, dict) and "$ref" in parsed:  # the converter registers no $defs under a root $ref:
        parsed = {**{k: v for k, v in parsed.items() if k != "$ref"}, "anyOf": [{"$ref": parsed["$ref"]}]}  # one way
    try:
        converter = _converter(strict)
        converter.visit(converter.resolve_refs(parsed, "stdin"), "")
        return converter.format_grammar()
    except SettingsError:
        raise
    except Exception as e:  # the converter's own errors: an unsupported or malformed schema
        raise SettingsError(f"cannot turn the JSON schema into a grammar: {e}") from None
