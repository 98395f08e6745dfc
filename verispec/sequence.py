"""One request's state as the engine sees it.

Invariant kept by the engine: the target's KV cache slot holds every committed token except the
last one (``len(token_ids) - 1`` entries). The last committed token is fed at the start of the
next round, followed by that round's drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from verispec.config import SamplingParams
from verispec.detokenize import IncrementalDetokenizer, StopChecker
from verispec.logprobs import TokenLogprob
from verispec.metrics import SpecMetrics

if TYPE_CHECKING:
    from verispec.constraints import Constraint


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (prefix caching: what a slot's kept K/V
    gives a new prompt)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    eos_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer | None
    slot: int = 0
    num_speculative_tokens: int | None = None  # this request's cap on drafts per round
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (EOS or stop string) | "length" | "abort" | "error"
    error: str | None = None  # what failed, when finish_reason is "error"
    metrics: SpecMetrics = field(default_factory=SpecMetrics)
    # One per output token when ``params.logprobs`` is set (the engine fills it), else empty.
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # The target's features (the hidden-state layers a drafter declares in ``hidden_layers``,
    # concatenated) at the input rows of the last pass, one row per token committed by it:
    # row i is the input whose logits gave the i-th committed token. After prefill, every
    # prompt position (the last one gave the first output token). None when the drafter reads
    # no hidden states. [n, F]
    target_hidden: torch.Tensor | None = None
    # The grammar's state after the committed tokens, for a request with a grammar
    # (:mod:`verispec.constraints`).
    constraint: Constraint | None = None
    stop_checker: StopChecker = field(init=False)

    def __post_init__(self) -> None:
        self.stop_checker = StopChecker(self.params.stop)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def tokens_left(self) -> int:
        """Tokens ``max_tokens`` still allows (an upper bound: EOS or a stop string may come first)."""
        return max(self.params.max_tokens - len(self.output_ids), 0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, tokens: list[int]) -> tuple[list[int], str]:
        """Commit tokens one at a time until a stop condition fires.

        Returns the tokens actually committed (a prefix of ``tokens``) and the new text that is
        safe to emit. EOS (unless ``ignore_eos``) and a stop token id end the sequence (the id is
        kept in ``output_ids`` but produces no text); a stop string ends it with the text cut
        before the stop string; reaching ``max_tokens`` ends it with reason "length".
        """
        committed: list[int] = []
        pieces: list[str] = []
        for tok in tokens:
            committed.append(tok)
            self.output_ids.append(tok)
            if (tok in self.eos_token_ids and not self.params.ignore_eos) or tok in self.params.stop_token_ids:
                self.finish_reason = "stop"
            elif self.detokenizer is not None:
                piece, stopped = self.stop_checker.feed(self.detokenizer.push(tok))
                pieces.append(piece)
                if stopped:
                    self.finish_reason = "stop"
            if self.finish_reason is None and len(self.output_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
            if self.finish_reason is not None:
                break
        if self.finish_reason is not None and not self.stop_checker.stopped and self.detokenizer is not None:
            pieces.append(self.stop_checker.feed(self.detokenizer.flush())[0])
            pieces.append(self.stop_checker.flush())
        new_text = "".join(pieces)
        self.text += new_text
        return committed, new_text
