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
from verispec.spec.base import DrafterContext, Outcome, Proposal, register_drafter

if TYPE_CHECKING:
    from verispec.engine.sequence import Sequence as Seq

__all__ = ["NgramIndex", "NgramDrafter"]

_ROOT = 0


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
            else:
                # Ends arrive in increasing order, so the newest is the most recent.
                self._latest_end[child] = end
            node = child


class NgramDrafter:
    """``ngram`` (prompt lookup): deterministic drafts copied from earlier in the sequence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._index: dict[int, NgramIndex] = {}  # slot -> index over prompt + output

    def start(self, seq: Seq) -> None:
        self._index[seq.slot] = NgramIndex(seq.token_ids, self.min_n, self.max_n)

    def propose(self, seq: Seq, k: int) -> Proposal:
        return Proposal(self._index[seq.slot].propose(k))

    def feedback(self, seq: Seq, outcome: Outcome) -> None:
        self._index[seq.slot].extend(outcome.committed)

    def finish(self, seq: Seq) -> None:
        self._index.pop(seq.slot, None)


@register_drafter("ngram")
def make_ngram_drafter(config: SpeculativeConfig, context: DrafterContext) -> NgramDrafter:
    return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
