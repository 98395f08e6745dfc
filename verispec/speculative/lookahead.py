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
token, then the most recent continuation of that continuation's last token, and so on up to
``k`` drafts (the paper stops at ``N - 1``; on text that repeats its prompt, a code edit, the
chain is what makes long drafts). Verifying up to ``G`` candidates at once comes with tree
proposals.

The window is not free: its ``W * (N - 1)`` tokens ride in every verify pass, and where an extra
verified position costs a tenth of a decode step (a CPU) they cost more than the n-grams only the
window finds bring in. So with the adaptive controller the drafter prices the window with the
controller's cost model (:class:`WindowGate`): the window runs for ``probe`` rounds, and stays on
while the draft tokens accepted from n-grams that came from the window alone, per round, are
worth at least the extra positions it adds (in decode steps, the cost model's ``T(n + 1 + m) -
T(n + 1)`` over ``T(1)``); otherwise it is off for ``rest`` rounds, then probed again. Without
the adaptive controller (``"adaptive": false``) the window always runs, as configured. In the
measurements of docs/benchmarks/suffix.md, the window never paid on code edits or coding
questions.

Exactness: the draft of a round is fixed before the round's verification, from tokens that are
already committed and from logits of earlier passes, so it is a deterministic draft (q one-hot)
and the standard verification rule is exact at every temperature. The window's own guesses use
the target's argmax whatever the temperature, and whether the window runs depends on timings;
both only affect how often drafts are accepted.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from verispec.config import SpeculativeConfig
from verispec.speculative.base import AuxBranch, Drafter, DrafterContext, Outcome, Proposal

if TYPE_CHECKING:
    from verispec.sequence import Sequence as Seq
    from verispec.speculative.cost_model import CostModel

__all__ = ["NgramPool", "LookaheadDrafter", "WindowGate", "window_branch"]


class NgramPool:
    """Continuations (``n - 1`` tokens) keyed by their preceding token, ``guess`` per key, LRU.

    Each continuation remembers whether only the Jacobi window has produced it (``guessed``):
    the window's worth is the accepted drafts it alone supplied.
    """

    def __init__(self, n: int, guess: int) -> None:
        self.n, self.guess = n, guess
        self._pool: dict[int, OrderedDict[tuple[int, ...], bool]] = {}  # token -> {continuation: guessed}

    def add(self, gram: Sequence[int], guessed: bool = False) -> None:
        if len(gram) != self.n:
            raise ValueError(f"expected a {self.n}-gram, got {len(gram)} tokens")
        entries = self._pool.setdefault(int(gram[0]), OrderedDict())
        key = tuple(int(x) for x in gram[1:])
        entries[key] = guessed and entries.get(key, True)
        entries.move_to_end(key)
        if len(entries) > self.guess:
            entries.popitem(last=False)

    def chain(self, token: int, k: int) -> tuple[list[int], list[bool]]:
        """Up to ``k`` drafts after ``token``: its most recent continuation, then that one's last
        token's, and so on; with, per draft, whether its continuation was a window guess."""
        drafts: list[int] = []
        guessed: list[bool] = []
        while len(drafts) < k:
            entries = self._pool.get(token)
            if not entries:
                break
            continuation = next(reversed(entries))
            taken = continuation[: k - len(drafts)]
            drafts.extend(taken)
            guessed.extend([entries[continuation]] * len(taken))
            token = drafts[-1]
        return drafts, guessed

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


class WindowGate:
    """Whether the Jacobi window pays for its verify positions; one per drafter (engine-wide).

    Args:
        probe: window rounds that measure its yield before it may be switched off.
        rest: rounds without the window before it is probed again.

    Until :meth:`bind` hands it a cost model (the adaptive controller's), the window always runs.
    """

    def __init__(self, probe: int = 16, rest: int = 256) -> None:
        if probe < 1 or rest < 1:
            raise ValueError(f"probe and rest must be >= 1, got {probe} and {rest}")
        self.probe, self.rest = probe, rest
        self.costs: CostModel | None = None
        self.on = True
        self.rounds = 0  # rounds in the current phase (on: windowed rounds; off: rounds without)
        self.tokens = 0.0  # on: accepted drafts from window-only n-grams per windowed round (mean, then EMA)

    def bind(self, costs: CostModel) -> None:
        self.costs = costs

    def use(self) -> bool:
        """Whether this round carries the window; counts a round of rest when it does not."""
        if self.costs is None or self.on:
            return True
        self.rounds += 1
        if self.rounds >= self.rest:
            self.on, self.rounds, self.tokens = True, 0, 0.0
        return False

    def record(self, accepted_guesses: int, num_drafts: int, window_tokens: int) -> None:
        """A windowed round: ``accepted_guesses`` drafts from window-only n-grams were accepted;
        the pass held ``num_drafts`` drafts and ``window_tokens`` window tokens."""
        if self.costs is None or not self.on:
            return
        self.rounds += 1
        weight = 1.0 / min(self.rounds, self.probe)
        self.tokens += weight * (accepted_guesses - self.tokens)
        if self.rounds >= self.probe and self.tokens < self.cost(num_drafts, window_tokens):
            self.on, self.rounds = False, 0

    def cost(self, num_drafts: int, window_tokens: int) -> float:
        """The window's extra positions in decode steps; 0 until the cost model has timings."""
        t1 = self.costs.t1() if self.costs is not None else None
        if not t1:
            return 0.0
        width = num_drafts + 1
        full, bare = self.costs.target_time(width + window_tokens), self.costs.target_time(width)
        if full is None or bare is None:
            return 0.0
        return max(full - bare, 0.0) / t1


class _Request:
    def __init__(self, rows: list[list[int]], pool: NgramPool, tokens: list[int]) -> None:
        self.rows, self.pool, self.tokens = rows, pool, tokens
        self.guessed: list[bool] = []  # per draft of the round under way: from a window-only n-gram


class LookaheadDrafter(Drafter):
    """``lookahead``: Jacobi window of ``window`` columns, ``ngram``-grams, ``guess`` per key."""

    def __init__(self, window: int, ngram: int, guess: int, seed: int = 0) -> None:
        self.window, self.ngram, self.guess, self.seed = window, ngram, guess, seed
        self._requests: dict[int, _Request] = {}  # slot -> state
        self.gate = WindowGate()

    def bind_costs(self, costs: CostModel) -> None:
        """The engine's adaptive controller's cost model: from now on the window must pay."""
        self.gate.bind(costs)

    def start(self, seq: Seq) -> None:
        tokens = list(seq.token_ids)
        rng = random.Random(self.seed)
        first_row = [rng.choice(seq.prompt_ids) for _ in range(self.window)]
        pool = NgramPool(self.ngram, self.guess)
        pool.add_all(tokens)
        self._requests[seq.slot] = _Request([first_row], pool, tokens)

    def propose(self, seq: Seq, k: int) -> Proposal:
        state = self._requests[seq.slot]
        drafts, state.guessed = state.pool.chain(seq.token_ids[-1], k)
        return Proposal(drafts, aux=window_branch(state.rows, len(drafts)) if self.gate.use() else None)

    def feedback(self, seq: Seq, outcome: Outcome) -> None:
        state = self._requests[seq.slot]
        before = len(state.tokens)
        state.tokens.extend(outcome.committed)
        # n-grams of the request's own tokens that end in the committed run
        for end in range(max(before, self.ngram - 1), len(state.tokens)):
            state.pool.add(state.tokens[end - self.ngram + 1 : end + 1])
        if outcome.aux_logits is not None:
            self.gate.record(sum(state.guessed[: outcome.num_accepted]), outcome.num_proposed,
                             outcome.aux_logits.shape[0])
            self._jacobi_step(state, outcome.aux_logits)
        state.guessed = []

    def _jacobi_step(self, state: _Request, aux_logits: torch.Tensor) -> None:
        guesses = aux_logits.argmax(-1).view(len(state.rows), self.window).tolist()  # [rows, W]
        new_row = guesses[-1]
        if len(state.rows) < self.ngram - 1:
            state.rows.append(new_row)
            return
        for j in range(self.window):
            state.pool.add([row[j] for row in state.rows] + [new_row[j]], guessed=True)
        state.rows = state.rows[1:] + [new_row]

    def finish(self, seq: Seq) -> None:
        self._requests.pop(seq.slot, None)


def make_lookahead_drafter(config: SpeculativeConfig, context: DrafterContext) -> LookaheadDrafter:
    if context.target.model.config.sliding_window is not None:
        raise ValueError("lookahead decoding does not support sliding-window attention models")
    return LookaheadDrafter(config.lookahead_window_size, config.lookahead_ngram_size,
                            config.lookahead_guess_set_size)
