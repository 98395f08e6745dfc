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
* What the engine asks of a drafter beyond the protocol (``calibrate``, ``reads_prompts_as``,
  ``hidden_layers``, ...) is the model-based drafter's: its costs are the ones worth measuring.
  The controller sees one drafter, so the per-draft cost it learns from the rounds is an average
  over both kinds, which is what a round costs in expectation while the mix holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from verispec.speculative.base import Drafter, Outcome, Proposal
from verispec.speculative.suffix import SuffixDrafter

if TYPE_CHECKING:
    from verispec.engine.sequence import Sequence


class SuffixFirstDrafter:
    """Propose the suffix draft when it scores at least ``min_score``, else ``fallback``'s."""

    def __init__(self, suffix: SuffixDrafter, fallback: Drafter, min_score: float) -> None:
        self.suffix, self.fallback, self.min_score = suffix, fallback, min_score
        self.suffix_rounds = 0  # rounds that proposed the suffix draft
        self.fallback_rounds = 0  # rounds that asked the fallback

    def __getattr__(self, name: str) -> Any:
        # only reached for what this class does not define: the fallback's optional interface
        if name in ("suffix", "fallback"):
            raise AttributeError(name)
        return getattr(self.fallback, name)

    def start(self, seq: Sequence) -> None:
        self.suffix.start(seq)
        self.fallback.start(seq)

    def propose(self, seq: Sequence, k: int) -> Proposal:
        draft = self.suffix.draft(seq, k)
        if draft.tokens and draft.score >= self.min_score:
            self.suffix_rounds += 1
            return Proposal(draft.tokens)
        self.fallback_rounds += 1
        return self.fallback.propose(seq, k)

    def feedback(self, seq: Sequence, outcome: Outcome) -> None:
        self.suffix.feedback(seq, outcome)
        self.fallback.feedback(seq, outcome)

    def finish(self, seq: Sequence) -> None:
        try:
            self.fallback.finish(seq)
        finally:
            self.suffix.finish(seq)
