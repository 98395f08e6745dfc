"""N-gram lookup core for prompt-lookup decoding.

Prompt-lookup decoding drafts tokens by copying: find the longest suffix of the current
sequence (prompt plus generated tokens) that also occurred earlier, and propose the tokens
that followed that earlier occurrence.  This module is the pure lookup structure; it knows
nothing about models or tensors.

Matching rule used by ``NgramIndex.propose``:

* try suffix lengths ``n`` from ``max_n`` down to ``min_n``; the first (longest) ``n`` whose
  suffix occurred earlier wins;
* among its earlier occurrences take the most recent one; "earlier" means any occurrence
  other than the suffix itself, and it may overlap the suffix;
* propose up to ``k`` tokens that follow it, stopping at the end of the sequence.

Worked example, ``min_n = 1``, ``max_n = 3``, ``k = 4``::

    position   0  1  2  3  4  5  6  7  8  9 10
    token      5  1  2  7  3  1  2  8  5  1  2   (length 11)

    suffix (5, 1, 2) at 8..10 occurred at 0..2  -> propose positions 3..6 = [7, 3, 1, 2]
    (the shorter suffix (1, 2) also occurred, most recently at 5..6, but longer wins)

Overlap example, tokens ``a b a b a b`` with ``min_n = max_n = 2``: the suffix ``(a, b)``
sits at positions 4..5, its most recent earlier occurrence at 2..3, so the proposal copies
what follows position 3, i.e. ``[a, b]`` (only two tokens exist after it, even if
``k = 5``).

Data structure: a trie over n-grams read backwards.  The path ``root -> t_e -> t_{e-1} ->
... -> t_{e-d+1}`` spells the d-gram ending at position ``e``; each node stores the largest
such ``e`` seen so far.  Appending a token inserts one path of length at most ``max_n``
(O(max_n)), and ``propose`` walks the current suffix backwards, at most ``max_n`` steps,
then copies ``k`` tokens (O(max_n + k)).  The path that ends at the last token is inserted
only once a further token arrives, so the walk never finds the suffix itself.  Memory is at
most ``max_n`` trie nodes per token (fewer on repetitive text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from verispec.config import SpeculativeConfig
from verispec.speculative.base import Drafter, DrafterContext, Outcome, Proposal

if TYPE_CHECKING:
    from verispec.sequence import Sequence as Seq

__all__ = ["NgramIndex", "NgramDrafter"]

_ROOT = 0
MAX_RECENT_MATCHES = 8  # occurrences remembered per n-gram, for tree proposals


class NgramIndex:
    """Incremental index over a token sequence (prompt + generated)."""

    def __init__(self, tokens: Sequence[int], min_n: int, max_n: int) -> None:
        """Build the index over ``tokens``.

        Args:
            tokens: initial sequence, usually the prompt.
            min_n: shortest suffix length that may be matched (at least 1).
            max_n: longest suffix length tried (at least ``min_n``).
        """
        if min_n < 1:
            raise ValueError(f"min_n must be >= 1, got {min_n}")
        if max_n < min_n:
            raise ValueError(f"max_n must be >= min_n, got min_n={min_n}, max_n={max_n}")
        self._min_n = min_n
        self._max_n = max_n
        self._tokens: list[int] = []
        # Trie edges keyed by (parent node id, token) -> child node id; node 0 is the root.
        self._children: dict[tuple[int, int], int] = {}
        # Per node: end position of the most recent indexed occurrence of its n-gram.
        self._latest_end: list[int] = [-1]
        # Per node: end positions of its most recent occurrences, newest last (for trees).
        self._recent_ends: list[list[int]] = [[]]
        self.extend(tokens)

    @property
    def min_n(self) -> int:
        return self._min_n

    @property
    def max_n(self) -> int:
        return self._max_n

    @property
    def tokens(self) -> tuple[int, ...]:
        """A copy of the indexed sequence (O(length))."""
        return tuple(self._tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append committed tokens and index them; O(max_n) per token."""
        for token in tokens:
            self._tokens.append(int(token))
            # Now that a token follows it, the n-grams ending at the previous last position
            # become "earlier occurrences" and can be matched.
            self._index_ending_at(len(self._tokens) - 2)

    def truncate(self, length: int) -> None:
        """Roll the sequence back to its first ``length`` tokens.

        Rollback is rare (e.g. undoing a speculative append), so it rebuilds the index from
        the kept prefix in O(length * max_n) rather than keeping undo history.
        """
        if not 0 <= length <= len(self._tokens):
            raise ValueError(f"length must be in 0..{len(self._tokens)}, got {length}")
        if length == len(self._tokens):
            return
        kept = self._tokens[:length]
        self._tokens = []
        self._children = {}
        self._latest_end = [-1]
        self._recent_ends = [[]]
        self.extend(kept)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the
        longest matching suffix (length ``max_n`` down to ``min_n``); ``[]`` if none.

        Cost: O(max_n + k).
        """
        if k <= 0:
            return []
        length = len(self._tokens)
        node = _ROOT
        match_end = -1
        # Walk the suffix backwards: depth d spells tokens[length-d .. length-1].
        for depth in range(1, min(self._max_n, length) + 1):
            child = self._children.get((node, self._tokens[length - depth]))
            if child is None:
                break
            node = child
            if depth >= self._min_n:
                match_end = self._latest_end[node]
        if match_end < 0:
            return []
        # match_end <= length - 2 (the suffix itself is never indexed), so at least one
        # token follows the occurrence.
        return self._tokens[match_end + 1 : match_end + 1 + k]

    def propose_many(self, k: int, max_matches: int) -> list[list[int]]:
        """Up to ``max_matches`` distinct continuations (each up to ``k`` tokens) of earlier
        occurrences of the current suffix: longer matches first, then more recent ones.

        Worked example, tokens ``5 1 2 7 | 9 1 2 8 | 1 2`` (min_n = 1, max_n = 2): the suffix
        (1, 2) occurred ending at 6 and at 2, so with k = 2 the continuations are
        ``[[8, 1], [7, 9]]``.
        """
        if k <= 0 or max_matches <= 0:
            return []
        length = len(self._tokens)
        node, matched = _ROOT, []  # nodes of the matching suffixes, shortest first
        for depth in range(1, min(self._max_n, length) + 1):
            node = self._children.get((node, self._tokens[length - depth]))
            if node is None:
                break
            if depth >= self._min_n:
                matched.append(node)
        out: list[list[int]] = []
        for node in reversed(matched):
            for end in reversed(self._recent_ends[node]):
                cont = self._tokens[end + 1 : end + 1 + k]
                if cont not in out:
                    out.append(cont)
                if len(out) == max_matches:
                    return out
        return out

    def _index_ending_at(self, end: int) -> None:
        """Insert the n-grams (n = 1 .. max_n) that end at position ``end``.

        Worked example, tokens ``[4, 7, 9]``, end = 2, max_n = 2: inserts the path
        root -> 9 -> 7, i.e. the 1-gram (9,) and the 2-gram (7, 9), both with end 2.
        """
        if end < 0:
            return
        node = _ROOT
        for depth in range(min(self._max_n, end + 1)):
            key = (node, self._tokens[end - depth])
            child = self._children.get(key)
            if child is None:
                child = len(self._latest_end)
                self._children[key] = child
                self._latest_end.append(end)
                self._recent_ends.append([end])
            else:
                # Ends arrive in increasing order, so the newest is the most recent.
                self._latest_end[child] = end
                recent = self._recent_ends[child]
                recent.append(end)
                del recent[: -MAX_RECENT_MATCHES]
            node = child


class NgramDrafter(Drafter):
    """``ngram`` (prompt lookup): deterministic drafts copied from earlier in the sequence.

    With ``topk > 1`` it proposes a token trie: the distinct continuations of up to ``topk``
    earlier matches, merged on common prefixes, at most ``budget`` nodes (earlier
    continuations first). The drafts are deterministic, so verification treats every child
    as one-hot ("topk" children), which is exact at any temperature.
    """

    def __init__(self, min_n: int, max_n: int, topk: int = 1, budget: int = 0) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.topk, self.budget = topk, budget
        self._index: dict[int, NgramIndex] = {}  # slot -> index over prompt + output

    def start(self, seq: Seq) -> None:
        self._index[seq.slot] = NgramIndex(seq.token_ids, self.min_n, self.max_n)

    def propose(self, seq: Seq, k: int) -> Proposal:
        if self.topk == 1:
            return Proposal(self._index[seq.slot].propose(k))
        return trie_proposal(self._index[seq.slot].propose_many(k, self.topk), self.budget)

    def feedback(self, seq: Seq, outcome: Outcome) -> None:
        self._index[seq.slot].extend(outcome.committed)

    def finish(self, seq: Seq) -> None:
        self._index.pop(seq.slot, None)


def trie_proposal(continuations: list[list[int]], budget: int) -> Proposal:
    """Merge token sequences into a trie proposal of at most ``budget`` nodes.

    Worked example: ``[[7, 8], [7, 9], [4]]`` -> tokens ``[7, 8, 9, 4]``, parents
    ``(0, 1, 1, 0)`` (node 0 is the root; tokens[i] is node i + 1).
    """
    tokens: list[int] = []
    parents: list[int] = []
    child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
    for cont in continuations:
        node = 0
        for tok in cont:
            if (node, tok) not in child:
                if len(tokens) == budget:
                    break
                tokens.append(tok)
                parents.append(node)
                child[(node, tok)] = len(tokens)
            node = child[(node, tok)]
    if not tokens:
        return Proposal([])
    return Proposal(tokens, parents=tuple(parents), children="topk")


def make_ngram_drafter(config: SpeculativeConfig, context: DrafterContext) -> NgramDrafter:
    if config.speculative_token_tree is not None:
        raise ValueError("ngram proposes a trie of earlier continuations; speculative_token_tree does not apply")
    if config.tree_children != "topk":
        raise ValueError('ngram drafts are deterministic: tree_children must be "topk"')
    return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max,
                        config.speculative_eagle_topk, config.tree_budget)
