"""Lookahead decoding: the target drafts for itself with Jacobi iterations (Fu et al. 2024).

Lookahead decoding (arXiv 2402.02057) needs no draft model. Every verify pass of the target also
carries a *lookahead branch*: a 2-D window of guessed future tokens, ``N - 1`` rows of ``W``
columns, refined by one Jacobi iteration per pass. The columns of the window, plus the newly
predicted row, are n-grams the target itself produced; they go into an n-gram pool keyed by
their first token. The draft of the next round is a pool n-gram that starts with the last
committed token. Both branches share one forward pass through an aux branch
(:class:`~verispec.speculative.base.AuxBranch`): the engine appends the window after the verify segment,
with the custom attention mask below, and hands the window's logits back in ``feedback``.

Window layout, offsets from the last committed token ``t`` (offset 0), ``W = 3``, two rows::

    row 0:   a0 a1 a2      at offsets 1 2 3
    row 1:   b0 b1 b2      at offsets 2 3 4

Token ``(r, j)`` sits at offset ``r + j + 1`` and reads the sequence ``t, row0[0..j], row1[j],
.., row_r[j]`` (the prefix in the cache is visible to every row; the drafts are not). So ``b1``
attends to ``t, a0, a1, b1``. Its output guesses the token at offset ``r + j + 2``. The outputs
of the last row form the new row; column ``j`` then spells the n-gram ``row0[j], ..,
row_{N-2}[j], new[j]`` (N tokens at consecutive offsets), the oldest row is dropped and the new
one appended. Until the window has ``N - 1`` rows (the first ``N - 2`` passes) rows are only
added. The window starts from random prompt tokens, as in the paper.

The pool keeps at most ``G`` continuations (the guess set) per first token, most recent last.
It also holds the n-grams of the request's own prompt and output, like the reference
implementation's prompt pool. Proposals are chains: the most recent continuation of the last
token is verified; verifying up to ``G`` of them at once comes with tree proposals.

Exactness: the draft of a round is fixed before the round's verification, from tokens that are
already committed and from logits of earlier passes, so it is a deterministic draft (q one-hot)
and the standard verification rule is exact at every temperature. The window's own guesses use
the target's argmax whatever the temperature; that only affects how often drafts are accepted.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from verispec.config import SpeculativeConfig
from verispec.speculative.base import AuxBranch, DrafterContext, Outcome, Proposal, register_drafter

if TYPE_CHECKING:
    from verispec.engine.sequence import Sequence as Seq

__all__ = ["NgramPool", "LookaheadDrafter", "window_branch"]


class NgramPool:
    """Continuations (``n - 1`` tokens) keyed by their preceding token, ``guess`` per key, LRU."""

    def __init__(self, n: int, guess: int) -> None:
        self.n, self.guess = n, guess
        self._pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, gram: Sequence[int]) -> None:
        if len(gram) != self.n:
            raise ValueError(f"expected a {self.n}-gram, got {len(gram)} tokens")
        entries = self._pool.setdefault(int(gram[0]), OrderedDict())
        key = tuple(int(x) for x in gram[1:])
        entries[key] = None
        entries.move_to_end(key)
        if len(entries) > self.guess:
            entries.popitem(last=False)

    def add_all(self, tokens: Sequence[int]) -> None:
        """Add every n-gram of ``tokens``."""
        for i in range(len(tokens) - self.n + 1):
            self.add(tokens[i : i + self.n])

    def candidates(self, token: int) -> list[tuple[int, ...]]:
        """Continuations of ``token``, most recent first."""
        return list(reversed(self._pool.get(token, ())))


def window_branch(rows: list[list[int]], num_drafts: int) -> AuxBranch:
    """The aux branch for a window of ``rows`` (each ``W`` tokens) after ``num_drafts`` drafts.

    Worked example, ``W = 2``, two rows ``[[a0, a1], [b0, b1]]``, one draft ``d``: the segment
    is ``(t, d)`` and aux index ``r * W + j`` holds ``(r, j)``::

        aux    offset  mask over  t d | a0 a1 b0 b1
        a0     1                  1 0 | 1  0  0  0
        a1     2                  1 0 | 1  1  0  0
        b0     2                  1 0 | 1  0  1  0
        b1     3                  1 0 | 1  1  0  1
    """
    width = len(rows[0])
    n1, m = num_drafts + 1, len(rows) * width
    mask = torch.zeros(m, n1 + m, dtype=torch.bool)  # [m, n+1+m]
    mask[:, 0] = True  # every window token follows t
    for r in range(len(rows)):
        for j in range(width):
            mask[r * width + j, n1 : n1 + j + 1] = True  # row 0, columns 0..j
            for above in range(1, r + 1):
                mask[r * width + j, n1 + above * width + j] = True  # rows 1..r of column j
    tokens = [tok for row in rows for tok in row]
    positions = [r + j + 1 for r in range(len(rows)) for j in range(width)]
    return AuxBranch(tokens, positions, mask)


class _Request:
    def __init__(self, rows: list[list[int]], pool: NgramPool, tokens: list[int]) -> None:
        self.rows, self.pool, self.tokens = rows, pool, tokens


class LookaheadDrafter:
    """``lookahead``: Jacobi window of ``window`` columns, ``ngram``-grams, ``guess`` per key."""

    def __init__(self, window: int, ngram: int, guess: int, seed: int = 0) -> None:
        self.window, self.ngram, self.guess, self.seed = window, ngram, guess, seed
        self._requests: dict[int, _Request] = {}  # slot -> state

    def start(self, seq: Seq) -> None:
        tokens = list(seq.token_ids)
        rng = random.Random(self.seed)
        first_row = [rng.choice(seq.prompt_ids) for _ in range(self.window)]
        pool = NgramPool(self.ngram, self.guess)
        pool.add_all(tokens)
        self._requests[seq.slot] = _Request([first_row], pool, tokens)

    def propose(self, seq: Seq, k: int) -> Proposal:
        state = self._requests[seq.slot]
        candidates = state.pool.candidates(seq.token_ids[-1])
        drafts = list(candidates[0][:k]) if candidates else []
        return Proposal(drafts, aux=window_branch(state.rows, len(drafts)))

    def feedback(self, seq: Seq, outcome: Outcome) -> None:
        state = self._requests[seq.slot]
        before = len(state.tokens)
        state.tokens.extend(outcome.committed)
        # n-grams of the request's own tokens that end in the committed run
        for end in range(max(before, self.ngram - 1), len(state.tokens)):
            state.pool.add(state.tokens[end - self.ngram + 1 : end + 1])
        if outcome.aux_logits is not None:
            self._jacobi_step(state, outcome.aux_logits)

    def _jacobi_step(self, state: _Request, aux_logits: torch.Tensor) -> None:
        guesses = aux_logits.argmax(-1).view(len(state.rows), self.window).tolist()  # [rows, W]
        new_row = guesses[-1]
        if len(state.rows) < self.ngram - 1:
            state.rows.append(new_row)
            return
        for j in range(self.window):
            state.pool.add([row[j] for row in state.rows] + [new_row[j]])
        state.rows = state.rows[1:] + [new_row]

    def finish(self, seq: Seq) -> None:
        self._requests.pop(seq.slot, None)


@register_drafter("lookahead")
def make_lookahead_drafter(config: SpeculativeConfig, context: DrafterContext) -> LookaheadDrafter:
    if context.target.model.config.sliding_window is not None:
        raise ValueError("lookahead decoding does not support sliding-window attention models")
    return LookaheadDrafter(config.lookahead_window_size, config.lookahead_ngram_size,
                            config.lookahead_guess_set_size)
