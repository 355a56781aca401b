"""History drafter: a suffix structure over the prompt and this process's previous outputs (SuffixDecoding,
Oliaro et al. 2024, in small): it proposes the continuation that most often followed the context's longest
matching suffix, with that count as its confidence.

The structure is a suffix trie of bounded depth D (every substring of length <= D of the stored texts is a
path from the root; each node counts the substring's occurrences): the current request's prompt and output
are added token by token as they are accepted (the prompt when the request begins), and when the request
ends its prompt is taken out again while its output stays, as history, for later requests. Memory is bounded:
at most `max_tokens` output tokens are kept (about D nodes each at worst), the oldest outputs forgotten first
(their counts taken back out, empty branches pruned).

Proposing: the longest suffix of the context (of at least `min_match` tokens) that has been followed by
something, then, token by token, the child with the highest count (ties: the most recently seen one),
descending while the match grows; at depth D it re-matches on the shorter suffix. The confidence key is
(match length, count) bucketed (policy.history_key), and the adaptive policy keeps acceptance per key: a
4-token match continued the same way 8 times is trusted, a 2-token match seen once is not. This also fixes
prompt lookup's weak matches (lookup proposed on single-token matches).

Privacy: in a server one structure serves every request, so one user's earlier output may be *proposed*
while generating another user's answer. Proposals are only checked by the target: what is emitted is
exactly the target's own output (greedy: token for token; sampled: the target's distribution), so no text
leaks into another answer; only the speed of a request can depend on earlier requests.
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Sequence

import numpy as np

from ..errors import SettingsError
from ..policy import DraftBudget, history_key
from ..verify import SamplingParams
from .base import Draft, Drafter


class _Node:
    __slots__ = ("count", "kids", "last")

    def __init__(self):
        self.count = 0  # occurrences of the substring this node spells
        self.kids: Optional[dict] = None  # token -> _Node
        self.last = 0  # stamp of the latest occurrence (tie-break: the most recent continuation)

    def child(self, token: int) -> Optional["_Node"]:
        return self.kids.get(token) if self.kids else None


class SuffixTrie:
    """Counts of every substring of length <= depth over a set of token sequences ("documents"); documents
    are appended token by token and can be removed whole (or their first part)."""

    def __init__(self, depth: int = 16):
        if depth < 2:
            raise SettingsError(f"the history's suffix depth must be >= 2, got {depth}")
        self.depth = depth
        self.root = _Node()
        self.stamp = 0
        self.nodes = 1  # live nodes (memory)

    def _add(self, parent: _Node, token: int) -> _Node:
        if parent.kids is None:
            parent.kids = {}
        node = parent.kids.get(token)
        if node is None:
            node = parent.kids[token] = _Node()
            self.nodes += 1
        node.count += 1
        node.last = self.stamp
        return node

    def extend(self, active: list, token: int) -> list:
        """Append a token to a document whose suffix nodes (deepest first, depths len(active)..1) are
        `active`; returns the new suffix nodes."""
        self.stamp += 1
        parents = active[1:] if len(active) >= self.depth else active
        return [self._add(p, token) for p in parents] + [self._add(self.root, token)]

    def remove(self, doc: Sequence[int], starts: Optional[int] = None) -> None:
        """Take out the substrings of `doc` that start before `starts` (default: all of them)."""
        n = len(doc)
        for s in range(n if starts is None else min(starts, n)):
            node = self.root
            for p in range(s, min(s + self.depth, n)):
                child = node.kids[doc[p]]
                child.count -= 1
                if child.count == 0:  # nothing else passes here: drop the branch
                    del node.kids[doc[p]]
                    self.nodes -= _size(child)
                    break
                node = child

    def find(self, tokens: Sequence[int]) -> Optional[_Node]:
        node = self.root
        for t in tokens:
            node = node.child(t)
            if node is None:
                return None
        return node


def _size(node: _Node) -> int:
    n, stack = 0, [node]
    while stack:
        x = stack.pop()
        n += 1
        if x.kids:
            stack.extend(x.kids.values())
    return n


def _best(node: _Node) -> tuple[int, _Node]:
    return max(node.kids.items(), key=lambda kv: (kv[1].count, kv[1].last))


class HistoryDrafter(Drafter):
    name = "history"
    free = True

    def __init__(self, max_tokens: int = 16384, depth: int = 16, min_match: int = 2, window: int = 1 << 20):
        """max_tokens: earlier output tokens kept (the oldest go first); depth: the trie's depth (longest
        match + continuation it holds before re-matching); min_match: shortest suffix match that proposes."""
        if not (1 <= min_match < depth):
            raise SettingsError(f"history needs 1 <= min_match < depth, got {min_match} and {depth}")
        if max_tokens < 0:
            raise SettingsError(f"history max_tokens must be >= 0, got {max_tokens}")
        self.trie = SuffixTrie(depth)
        self.depth = depth
        self.max_tokens = max_tokens
        self.min_match = min_match
        self.window = window  # a request's prompt: only its last `window` tokens are indexed
        self.outputs: deque = deque()  # earlier outputs (token lists), oldest first
        self.kept = 0  # tokens in self.outputs
        self.doc: list[int] = []  # the current request: its (indexed part of the) prompt, then its output
        self.prompt_len = 0
        self.active: list = []  # the current document's suffix nodes, deepest first
        self.seen = 0  # context tokens indexed (positions in the engine's context)
        self.offset = 0  # context position of doc[0]
        self.open = False

    def for_slot(self, i: int) -> "HistoryDrafter":
        """Another concurrent slot keeps a history of its own (the trie follows one request at a time)."""
        return self if i == 0 else HistoryDrafter(self.max_tokens, self.depth, self.min_match, self.window)

    # -- request lifecycle ------------------------------------------------------------------------------------
    def begin(self, context: Sequence[int]) -> None:
        if self.open:  # the last request never ended (a caller dropped its stream unfinished)
            self.end(None)
        self.offset = max(0, len(context) - self.window)
        self.doc, self.active, self.seen = [], [], self.offset
        self.open = True
        self._ingest(context)
        self.prompt_len = len(self.doc)

    def end(self, context: Optional[Sequence[int]]) -> None:
        if not self.open:
            return
        if context is not None:
            self._ingest(context)
        self.open = False
        output = self.doc[self.prompt_len:]
        self.trie.remove(self.doc, starts=self.prompt_len)  # the prompt is this request's own
        self.doc, self.active = [], []
        if output and self.max_tokens:
            self.outputs.append(output)
            self.kept += len(output)
        else:
            self.trie.remove(output)
        while self.kept > self.max_tokens and self.outputs:
            old = self.outputs.popleft()
            self.kept -= len(old)
            self.trie.remove(old)

    def _ingest(self, context: Sequence[int]) -> None:
        trie = self.trie
        for t in context[self.seen:]:
            t = int(t)
            self.doc.append(t)
            self.active = trie.extend(self.active, t)
        self.seen = max(self.seen, len(context))

    # -- drafting ---------------------------------------------------------------------------------------------
    def match(self, tail: Sequence[int]) -> tuple[Optional[_Node], int]:
        """The node of the longest suffix of `tail` (>= min_match tokens, < depth) that has a continuation."""
        for n in range(min(len(tail), self.trie.depth - 1), self.min_match - 1, -1):
            node = self.trie.find(tail[len(tail) - n:])
            if node is not None and node.kids:
                return node, n
        return None, 0

    def continuation(self, k: int) -> tuple[list[int], list[str]]:
        """Up to k tokens continuing the current document, with their confidence keys."""
        node, n = None, 0
        for d, nd in enumerate(self.active):  # deepest first: depth len(active) - d
            depth = len(self.active) - d
            if depth < self.min_match:
                break
            if nd.kids and depth < self.trie.depth:
                node, n = nd, depth
                break
        tokens: list[int] = []
        keys: list[str] = []
        while node is not None and len(tokens) < k:
            token, child = _best(node)
            tokens.append(token)
            keys.append(history_key(n, child.count))
            node, n = child, n + 1
            if not node.kids or n >= self.trie.depth:  # the end of what the trie holds here: re-match
                tail = (self.doc[-self.trie.depth:] + tokens)[-(self.trie.depth - 1):]
                node, n = self.match(tail)
        return tokens, keys

    def propose(self, context: Sequence[int], k: int, params: SamplingParams = None,
                rng: np.random.Generator = None, budget: Optional[DraftBudget] = None) -> Draft:
        budget = budget or DraftBudget(k)
        if not self.open:
            self.begin(context)
        self._ingest(context)
        tokens, keys = self.continuation(budget.start(self.name, free=True, long=True))
        return self.budgeted(tokens, keys, budget)

    def stats(self) -> dict:
        return {"outputs": len(self.outputs), "tokens": self.kept, "nodes": self.trie.nodes}
