"""Suffix decoding first, a model-based drafter otherwise (``enable_suffix_decoding``).

A suffix draft (:mod:`verispec.speculative.suffix`) costs a trie walk; a draft model's costs a
forward pass per token. Where the text repeats what came before (summaries and answers that
quote their document, code edits, agentic loops), the suffix trie drafts long runs that the
target accepts; elsewhere it drafts little, and a draft model does better. So each round this
drafter asks the suffix drafter first and proposes its draft when the draft's score (its
expected number of accepted tokens under the trie's counts) is at least
``suffix_decoding_min_score``; otherwise it asks the model-based drafter. (Arctic Inference's
Arctic Speculator also pairs suffix decoding with a model-based speculator.)

Contracts:

* Both drafters see every request: ``start``, ``feedback`` and ``finish`` go to both, so the
  suffix trie holds every committed token, and a draft model that sat out some rounds reads what
  it missed when it next drafts (its catch-up, see :mod:`verispec.speculative.draft_model`).
  A draft model that did not draft in a round ignores its feedback.
* A suffix proposal is deterministic (``probs`` None: q one-hot), a model's carries its q; each
  round's proposal is verified by the rule that fits it, so the output is the target's either
  way, greedy or sampled.
* The optional capabilities of :class:`~verispec.speculative.base.Drafter` (``calibrate``,
  ``reads_prompts_as``, ``hidden_layers``, ...) are the model-based drafter's: its costs are the ones worth measuring.
  The controller sees one drafter, so the per-draft cost it learns from the rounds is an average
  over both kinds, which is what a round costs in expectation while the mix holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from verispec.speculative.base import DraftCalibration, Drafter, Outcome, Proposal
from verispec.speculative.cost_model import CostModel, ema
from verispec.speculative.suffix import SuffixDrafter

if TYPE_CHECKING:
    from verispec.sequence import Sequence


# EMA weight of one suffix round in a request's calibration (accepted tokens over the score).
CALIBRATION_WEIGHT = 0.3


class SuffixFirstDrafter(Drafter):
    """Propose the suffix draft when its calibrated score is at least ``min_score``, else
    ``fallback``'s.

    A trie's score trusts its counts, and a continuation seen once counts as certain, so on text
    that shares short phrases with the prompt without copying it (a RAG answer) only 0.2-0.4 of
    the tokens of drafts scoring 2 or more were accepted, where the draft model keeps about 0.75
    a position (docs/benchmarks/per-token-costs.md). So each request keeps a calibration, an EMA
    of the tokens its suffix rounds had accepted over the scores they predicted (starting at 1
    in ``start``), and the score is multiplied by it before the comparison: a request whose
    suffix drafts fail hands its rounds to the draft model.
    """

    def __init__(self, suffix: SuffixDrafter, fallback: Drafter, min_score: float) -> None:
        self.suffix, self.fallback, self.min_score = suffix, fallback, min_score
        self.suffix_rounds = 0  # rounds that proposed the suffix draft
        self.fallback_rounds = 0  # rounds that asked the fallback
        self._calibration: dict[int, float] = {}  # slot -> accepted / predicted, EMA
        self._predicted: dict[int, float] = {}  # slot -> the score of the suffix draft under way

    # The optional capabilities are the fallback's (see the module doc).

    @property
    def hidden_layers(self) -> tuple[int, ...] | None:  # type: ignore[override]
        return self.fallback.hidden_layers

    @property
    def last_prompt_state_only(self) -> bool:  # type: ignore[override]
        return self.fallback.last_prompt_state_only

    @property
    def stops_within_round(self) -> bool:  # type: ignore[override]
        return self.fallback.stops_within_round

    def bind_costs(self, costs: CostModel) -> None:
        self.fallback.bind_costs(costs)

    def bind_stop(self, keep: Callable[[Sequence, int, float], bool] | None) -> None:
        self.fallback.bind_stop(keep)

    def reads_prompts_as(self, prefill: bool) -> None:
        self.fallback.reads_prompts_as(prefill)

    def calibrate(self, slot: int, token: int, reference: Callable[[], object]) -> DraftCalibration | None:
        return self.fallback.calibrate(slot, token, reference)

    def start(self, seq: Sequence) -> None:
        self._calibration[seq.slot] = 1.0
        self._predicted.pop(seq.slot, None)
        self.suffix.start(seq)
        self.fallback.start(seq)

    def propose(self, seq: Sequence, k: int) -> Proposal:
        draft = self.suffix.draft(seq, k)
        if draft.tokens and draft.score * self._calibration[seq.slot] >= self.min_score:
            self.suffix_rounds += 1
            self._predicted[seq.slot] = draft.score
            return Proposal(draft.tokens)
        self.fallback_rounds += 1
        return self.fallback.propose(seq, k)

    def feedback(self, seq: Sequence, outcome: Outcome) -> None:
        predicted = self._predicted.pop(seq.slot, None)
        if predicted is not None:
            ratio = min(outcome.num_accepted / predicted, 1.0)
            self._calibration[seq.slot] = ema(self._calibration[seq.slot], ratio, CALIBRATION_WEIGHT)
        self.suffix.feedback(seq, outcome)
        self.fallback.feedback(seq, outcome)

    def finish(self, seq: Sequence) -> None:
        self._calibration.pop(seq.slot, None)
        self._predicted.pop(seq.slot, None)
        try:
            self.fallback.finish(seq)
        finally:
            self.suffix.finish(seq)
