"""The drafter interface, declared once, and the registry keyed by method name.

A drafter proposes up to k tokens for one sequence; the engine verifies them against the target
and reports back what happened. The engine only ever talks to this protocol: adding a drafter
means registering a factory under a method name, never adding a branch to the engine.

Life cycle of one request::

    drafter.start(seq)                       # after the target's prefill
    repeat:
        proposal = drafter.propose(seq, k)   # up to k tokens (+ their q, or None)
        ... the engine verifies and commits ...
        drafter.feedback(seq, outcome)       # what was accepted, what got committed
    drafter.finish(seq)                      # free per-sequence state

Proposals are chains today. A tree proposal will be a further field on :class:`Proposal`
(a parent array), so drafters that only make chains keep working unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from torch import Tensor

if TYPE_CHECKING:
    from verispec.config import SpeculativeConfig
    from verispec.engine.sequence import Sequence
    from verispec.models.loader import LoadedModel


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one sequence.

    ``probs`` is q, the distribution each token was sampled from, after the request's sampling
    transforms (the same :func:`verispec.sampling.logits_to_probs` as the target's p). ``None``
    means a deterministic drafter: q is one-hot at the proposed token.
    """

    tokens: list[int]  # [n], n <= k
    probs: Tensor | None = None  # [n, vocab] float32

    def __len__(self) -> int:
        return len(self.tokens)


EMPTY_PROPOSAL = Proposal(tokens=[])


@dataclass(frozen=True)
class Outcome:
    """What verification did with a proposal.

    ``num_accepted`` drafts were kept; ``committed`` are the tokens appended to the sequence this
    round: the accepted drafts plus the recovered or bonus token, cut short if a stop condition
    (EOS, a stop string, max_tokens) fired inside the run.
    """

    num_proposed: int
    num_accepted: int
    committed: list[int]


class Drafter(Protocol):
    """What every speculative method implements."""

    def start(self, seq: Sequence) -> None:
        """A new sequence: its prompt (and first output token) are known; build any state."""

    def propose(self, seq: Sequence, k: int) -> Proposal:
        """Return up to k draft tokens continuing ``seq.token_ids``; may return fewer or none."""

    def feedback(self, seq: Sequence, outcome: Outcome) -> None:
        """Learn the verification result; roll back any state past the committed tokens."""

    def finish(self, seq: Sequence) -> None:
        """The sequence is done; drop its state."""


@dataclass(frozen=True)
class DrafterContext:
    """What a drafter factory may use: the target (for its tokenizer, vocabulary and device).

    ``max_num_seqs`` is the number of sequence slots: a drafter keeps per-sequence state keyed
    by ``seq.slot``, which is in ``0 .. max_num_seqs - 1``.
    """

    target: LoadedModel
    max_model_len: int
    max_num_seqs: int = 1


DrafterFactory = Callable[["SpeculativeConfig", DrafterContext], Drafter]

_REGISTRY: dict[str, DrafterFactory] = {}


def register_drafter(method: str) -> Callable[[DrafterFactory], DrafterFactory]:
    def wrap(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[method] = factory
        return factory

    return wrap


def available_methods() -> list[str]:
    _load_builtin_drafters()
    return sorted(_REGISTRY)


def check_method(method: str) -> None:
    """Raise a clear error, listing the valid methods, if ``method`` is not registered."""
    if method not in available_methods():
        raise ValueError(
            f"unknown speculative method {method!r}; valid methods: {', '.join(available_methods())}"
        )


def build_drafter(config: SpeculativeConfig, context: DrafterContext) -> Drafter:
    check_method(config.method)
    return _REGISTRY[config.method](config, context)


def _load_builtin_drafters() -> None:
    # Importing the modules runs their @register_drafter decorators.
    from verispec.spec import draft_model, ngram  # noqa: F401
