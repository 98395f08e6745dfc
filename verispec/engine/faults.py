"""What the engine does when something fails: one sequence fails, never the batch.

A failure that belongs to one sequence (its drafter's ``propose``, its verification and
sampling, its commit and stop check, the controller's bookkeeping for it) finishes that sequence
with ``finish_reason == "error"`` and the message in ``seq.error`` (:func:`fail`); the rest of
the batch goes on. A failure of the shared verify forward is retried once for the whole batch
without speculation (a plain step, which gives the same greedy tokens), and if that fails too,
each sequence runs its plain step alone, so only the sequences whose own pass fails are failed
(:func:`verify_retrying`). A retry first rolls every slot back to where the failed pass started
(a pass only appends past it). Errors never leave a slot taken: a failed sequence is released
like a finished one, and a drafter's ``finish`` that raises is logged, not propagated.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from verispec.speculative.base import EMPTY_PROPOSAL, Proposal

if TYPE_CHECKING:
    from verispec.models.kv_cache import KVCache
    from verispec.sequence import Sequence

log = logging.getLogger(__name__)

V = TypeVar("V")  # a verified result; None for a sequence that failed


def fail(seq: Sequence, phase: str, e: Exception) -> None:
    """Finish one sequence with an error (the engine frees its slot at the end of the step)."""
    log.error("request in slot %d failed while %s", seq.slot, phase, exc_info=e)
    seq.finish_reason = "error"
    seq.error = f"{phase} failed: {type(e).__name__}: {e}"


def roll_back(cache: KVCache, batch: list[Sequence], starts: list[int]) -> None:
    """Undo what a failed forward may have written (it only appends past ``starts``)."""
    for seq, start in zip(batch, starts):
        cache.truncate(seq.slot, start)


def as_plain(verified: list[V | None]) -> list[V | None]:
    """Mark results of a retry without drafts (their drafter's proposal was not verified)."""
    return [v if v is None else dataclasses.replace(v, proposal=EMPTY_PROPOSAL) for v in verified]


def verify_retrying(cache: KVCache, batch: list[Sequence], proposals: list[Proposal],
                    attempt: Callable[[list[Sequence], list[Proposal], list[int]], list[V | None]]
                    ) -> list[V | None]:
    """``attempt`` (one shared forward over ``batch``, then each row verified) with the retries
    of the module doc: the batch again without drafts, then each sequence alone without drafts;
    a sequence whose own pass still fails is failed, and its result is None."""
    starts = [cache.length(seq.slot) for seq in batch]
    try:
        return attempt(batch, proposals, starts)
    except Exception as e:
        error = e
    roll_back(cache, batch, starts)
    plain = [EMPTY_PROPOSAL] * len(batch)
    if any(len(p) for p in proposals):
        log.warning("verify pass of %d sequence(s) failed (%s: %s); retrying without speculation",
                    len(batch), type(error).__name__, error)
        try:
            return as_plain(attempt(batch, plain, starts))
        except Exception as e:
            error = e
        roll_back(cache, batch, starts)
    if len(batch) == 1:
        fail(batch[0], "its forward pass", error)
        return [None]
    # each alone: only a sequence whose own pass fails is failed
    return [as_plain(verify_retrying(cache, [seq], [EMPTY_PROPOSAL], attempt))[0] for seq in batch]


def verify_alone_retrying(cache: KVCache, seq: Sequence, proposal: Proposal,
                          single: Callable[[Sequence, Proposal], V],
                          attempt: Callable[[list[Sequence], list[Proposal], list[int]], list[V | None]]
                          ) -> V | None:
    """``single`` (a forward of its own: a tree, or a chain with an aux branch), retried as a
    plain step through ``attempt`` (see :func:`verify_retrying`) if it fails."""
    start = cache.length(seq.slot)
    try:
        return single(seq, proposal)
    except Exception as e:
        log.warning("verify pass of slot %d failed (%s: %s); retrying without speculation",
                    seq.slot, type(e).__name__, e)
    roll_back(cache, [seq], [start])
    return as_plain(verify_retrying(cache, [seq], [EMPTY_PROPOSAL], attempt))[0]
