"""Suffix decoding: model-free drafts from a depth-bounded suffix trie (Oliaro et al. 2024).

SuffixDecoding (arXiv 2411.04975, as in Snowflake's Arctic Inference and vLLM's ``suffix``
method) drafts by pattern matching: find the longest suffix of the current sequence that was
seen before, and propose what most often followed it. Two structures are searched:

* a per-request trie over the request's prompt and every token committed so far;
* a global trie over the outputs of the last ``max_cached_requests`` finished requests, so a
  request that repeats an earlier one (agentic loops, code edits) drafts from its answer.

Data structure: :class:`SuffixTrie` holds every substring of length <= ``depth`` of the
sequences inserted into it, each path node counting how many times its substring occurred.
Appending one token to a sequence extends the paths of the (at most ``depth``) suffixes that end
at the previous token, so an update costs O(depth) and nothing is ever rebuilt. A node's
``followed`` count says how many of those occurrences had a next token; ``child.count /
node.followed`` is the empirical probability of that next token. Nodes at full depth are never
extended, so their ``followed`` stays 0.

Worked example, depth 3, sequence ``a b a b c``: the trie holds ``a`` (count 2), ``a b`` (2),
``a b a`` (1), ``a b c`` (1), ``b`` (2), ``b a`` (1), ``b a b`` (1), ``b c`` (1), ``c`` (1), ...
For the context ``... a b`` the longest match that was followed by something is ``a b`` (twice,
once by ``a``, once by ``c``): each continuation has empirical probability 1/2.

Proposal rule, for one trie and a budget of ``k`` tokens:

1. match: the longest suffix of the context, of length m <= ``depth - k`` (the trie depth bounds
   match plus draft, as in vLLM), whose node was followed at least once; found by binary search,
   since a suffix of a matched suffix is matched too;
2. draft: from that node follow the most frequent child, multiplying the empirical
   probabilities; stop when the path's probability drops below ``min_token_prob``, when the
   trie ends, or after ``min(k, floor(max_spec_factor * m), depth - m)`` tokens.

The per-request and global drafts are scored by their expected accepted length (the sum of the
path probabilities along the draft) and the better one is proposed. Proposals are chains: when
several continuations are frequent, the most frequent one wins. Tree proposals, which keep the
other frequent branches, will come with the tree-verification module.

Rollback safety: the drafter only ever inserts tokens the engine reports as committed (through
``feedback``); rejected drafts never enter a trie, so there is nothing to undo.

Memory bound: a trie holds at most ``depth`` nodes per token inserted (plus the root). The
global store evicts whole requests, oldest first, once it holds more than
``max_cached_requests`` requests or more than ``max_cached_tokens`` tokens, so it never holds
more than ``max_cached_tokens`` tokens and ``depth * max_cached_tokens + 1`` nodes. Eviction
walks the evicted output again and decrements counts, deleting nodes that reach zero.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from verispec.config import SpeculativeConfig
from verispec.speculative.base import Drafter, DrafterContext, Outcome, Proposal

if TYPE_CHECKING:
    from verispec.sequence import Sequence as Seq

__all__ = ["SuffixTrie", "SuffixStore", "SuffixDraft", "SuffixDrafter"]


class _Node:
    __slots__ = ("count", "followed", "children")

    def __init__(self) -> None:
        self.count = 0  # occurrences of this node's substring
        self.followed = 0  # occurrences that had a next token (= sum of the children's counts)
        self.children: dict[int, _Node] = {}


@dataclass(frozen=True)
class SuffixDraft:
    tokens: list[int]
    score: float  # expected number of accepted tokens under the trie's empirical frequencies
    match_length: int


NO_DRAFT = SuffixDraft([], 0.0, 0)


class SuffixTrie:
    """Counted trie of every substring of length <= ``depth`` of the sequences inserted."""

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"the suffix trie depth must be >= 1, got {depth}")
        self.depth = depth
        self.root = _Node()
        self.num_nodes = 1

    # ---- updates -------------------------------------------------------------------------

    def extend(self, open_nodes: list[_Node], tokens: Iterable[int]) -> list[_Node]:
        """Append ``tokens`` to a sequence whose open suffixes are ``open_nodes``.

        ``open_nodes[i]`` is the node of the sequence's suffix of length ``i + 1`` (``[]`` for
        an empty sequence). Returns the open suffixes after the append. O(depth) per token.
        """
        for token in tokens:
            open_nodes = [self._step(node, int(token)) for node in [self.root, *open_nodes[: self.depth - 1]]]
        return open_nodes

    def insert(self, tokens: Sequence[int]) -> None:
        """Insert a whole sequence."""
        self.extend([], tokens)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo :meth:`insert` of the same sequence, deleting nodes whose count reaches zero."""
        open_nodes: list[_Node] = []
        for token in tokens:
            open_nodes = [self._unstep(node, int(token)) for node in [self.root, *open_nodes[: self.depth - 1]]]

    def _step(self, node: _Node, token: int) -> _Node:
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = _Node()
            self.num_nodes += 1
        child.count += 1
        node.followed += 1
        return child

    def _unstep(self, node: _Node, token: int) -> _Node:
        child = node.children[token]
        child.count -= 1
        node.followed -= 1
        if child.count == 0:
            # Detached; the walk may still pass through it and its subtree reaches zero too.
            del node.children[token]
            self.num_nodes -= 1
        return child

    # ---- lookup --------------------------------------------------------------------------

    def find(self, tokens: Sequence[int]) -> _Node | None:
        """The node spelling ``tokens`` (from the root), or ``None``."""
        node = self.root
        for token in tokens:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def match(self, context: Sequence[int], max_length: int) -> tuple[int, _Node | None]:
        """Longest suffix of ``context`` (length <= ``max_length``) that was followed before.

        Returns ``(m, node)``, or ``(0, None)`` when not even the last token was followed.
        Binary search: if a suffix was followed somewhere, so was each of its own suffixes.
        """
        lo, hi, best = 1, min(max_length, len(context), self.depth - 1), None
        while lo <= hi:
            mid = (lo + hi) // 2
            node = self.find(context[len(context) - mid :])
            if node is not None and node.followed > 0:
                lo, best = mid + 1, (mid, node)
            else:
                hi = mid - 1
        return best if best is not None else (0, None)

    def draft(self, context: Sequence[int], k: int, max_spec_factor: float, min_token_prob: float) -> SuffixDraft:
        """Up to ``k`` tokens continuing ``context`` (the module docstring has the rule)."""
        if k <= 0:
            return NO_DRAFT
        m, node = self.match(context, max(1, self.depth - k))
        if node is None:
            return NO_DRAFT
        limit = min(k, int(max_spec_factor * m), self.depth - m)
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        while len(tokens) < limit and node.followed > 0:
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            prob *= child.count / node.followed
            if prob < min_token_prob:
                break
            tokens.append(token)
            score += prob
            node = child
        return SuffixDraft(tokens, score, m)


class SuffixStore:
    """The global trie over the outputs of the most recently finished requests.

    Holds at most ``max_requests`` outputs and ``max_tokens`` tokens; inserting more evicts the
    oldest outputs first (vLLM's order for ``suffix_decoding_max_cached_requests``). An output
    longer than ``max_tokens`` is kept by its last ``max_tokens`` tokens.
    """

    def __init__(self, depth: int, max_requests: int, max_tokens: int) -> None:
        if max_requests < 0 or max_tokens < 0:
            raise ValueError(f"store bounds must be >= 0, got {max_requests} requests, {max_tokens} tokens")
        self.trie = SuffixTrie(depth)
        self.max_requests, self.max_tokens = max_requests, max_tokens
        self._outputs: OrderedDict[int, list[int]] = OrderedDict()  # insertion id -> tokens
        self._next_id = 0
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._outputs)

    def add(self, tokens: Sequence[int]) -> None:
        if self.max_requests == 0 or self.max_tokens == 0 or not tokens:
            return
        kept = [int(t) for t in tokens[-self.max_tokens :]]
        while self._outputs and (len(self._outputs) >= self.max_requests
                                 or self.num_tokens + len(kept) > self.max_tokens):
            self._evict_oldest()
        self.trie.insert(kept)
        self._outputs[self._next_id] = kept
        self._next_id += 1
        self.num_tokens += len(kept)

    def _evict_oldest(self) -> None:
        _, tokens = self._outputs.popitem(last=False)
        self.trie.remove(tokens)
        self.num_tokens -= len(tokens)


class _RequestState:
    """One request's trie and the open suffixes of its prompt + committed tokens."""

    def __init__(self, depth: int, tokens: Sequence[int]) -> None:
        self.trie = SuffixTrie(depth)
        self.open = self.trie.extend([], tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        self.open = self.trie.extend(self.open, tokens)


class SuffixDrafter(Drafter):
    """``suffix``: deterministic drafts from the request's own trie and the global store."""

    def __init__(self, max_tree_depth: int, max_cached_requests: int, max_cached_tokens: int,
                 max_spec_factor: float, min_token_prob: float) -> None:
        self.depth = max_tree_depth
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        self.store = SuffixStore(max_tree_depth, max_cached_requests, max_cached_tokens)
        self._requests: dict[int, _RequestState] = {}  # slot -> state

    def start(self, seq: Seq) -> None:
        self._requests[seq.slot] = _RequestState(self.depth, seq.token_ids)

    def propose(self, seq: Seq, k: int) -> Proposal:
        return Proposal(self.draft(seq, k).tokens)

    def draft(self, seq: Seq, k: int) -> SuffixDraft:
        """The better of the request's and the global trie's drafts (by score, then length)."""
        context = seq.token_ids[-self.depth :]
        drafts = (
            trie.draft(context, k, self.max_spec_factor, self.min_token_prob)
            for trie in (self._requests[seq.slot].trie, self.store.trie)
        )
        return max(drafts, key=lambda d: (d.score, len(d.tokens)))

    def feedback(self, seq: Seq, outcome: Outcome) -> None:
        self._requests[seq.slot].extend(outcome.committed)

    def finish(self, seq: Seq) -> None:
        self._requests.pop(seq.slot, None)
        self.store.add(seq.output_ids)


def make_suffix_drafter(config: SpeculativeConfig, context: DrafterContext | None = None) -> SuffixDrafter:
    return SuffixDrafter(
        config.suffix_decoding_max_tree_depth,
        config.suffix_decoding_max_cached_requests,
        config.suffix_decoding_max_cached_tokens,
        config.suffix_decoding_max_spec_factor,
        config.suffix_decoding_min_token_prob,
    )
