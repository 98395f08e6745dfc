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

A proposal is a chain unless it carries ``parents``: then its tokens are the nodes of a draft
tree (see :mod:`verispec.speculative.tree`) verified in one target pass. Chain drafters never set it.

A drafter that reads the target's hidden states declares ``hidden_layers`` (a tuple of layer
indices: 0 = embeddings, i = after layer i, -1 = the final normed state); the engine then puts
those layers, concatenated, in ``seq.target_hidden`` before ``start`` and every ``feedback``.
After prefill that is every prompt position the pass ran; a drafter that reads only the last one
declares ``last_prompt_state_only = True``, and prefix caching (which runs only the positions a
slot did not keep) stays on for it.

A drafter with costs of its own worth timing up front may also have
``calibrate(slot, token, reference) -> (a draft step, [(prompt length, time to read it)],
[(generated tokens, time to catch up on them)])``, every time in runs of ``reference()`` (the
target's decode step) timed just before it, which an engine with an adaptive controller calls
once, on an empty slot, when it is built (the draft model has it; prompt lookup's costs are too
small to need it).
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
class AuxBranch:
    """Extra positions a drafter asks the target to compute in the verify pass (lookahead).

    They go after the verify segment ``[t, d_1..d_n]`` (offsets ``0..n``), so the segment's own
    rows never see them and verification is unchanged; their logits come back in
    ``Outcome.aux_logits`` and their K/V is dropped with the rejected drafts. Every aux row
    attends to the whole cached prefix; ``mask`` says which rows of the segment and of the branch
    it also attends to. ``positions`` are RoPE positions relative to ``t``'s.
    """

    tokens: list[int]  # [m]
    positions: list[int]  # [m], offsets from t's position
    mask: Tensor  # [m, n + 1 + m] bool over (t, d_1..d_n, aux_1..aux_m)


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one sequence.

    ``probs`` is q, the distribution each token was sampled from, after the request's sampling
    transforms (the same :func:`verispec.sampling.logits_to_probs` as the target's p). ``None``
    means a deterministic drafter: q is one-hot at the proposed token.

    Tree proposals: ``parents[i]`` is the parent node of ``tokens[i]``, in a numbering where
    node 0 is the root (the last committed token) and ``tokens[i]`` is node ``i + 1``;
    ``probs[i]`` is the q at that parent which the token was drawn from (before removing
    earlier siblings), and ``children`` how siblings were chosen (see
    :mod:`verispec.speculative.tree_verify`).

    ``values`` (trees, optional): each node's draft estimate of the chance that verification
    accepts it, the product of the draft probabilities along its path. A drafter sets it only
    when its nodes are numbered by decreasing value, so that the first m nodes are the m most
    valued and form a tree; the controller then picks how many to verify (the node budget), and
    the engine keeps that prefix. Keeping a prefix chosen from draft values alone is exact, as
    the value is known before the target is run.
    """

    tokens: list[int]  # [n], n <= k for a chain; tree depth <= k for a tree
    probs: Tensor | None = None  # [n, vocab] float32
    parents: tuple[int, ...] | None = None  # [n] for a tree proposal
    children: str = "topk"  # tree proposals: "topk" | "iid" | "without_replacement"
    aux: AuxBranch | None = None
    values: tuple[float, ...] | None = None  # [n] trees: draft acceptance estimate, non-increasing

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
    aux_logits: Tensor | None = None  # [m, vocab] target logits of the proposal's aux branch


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
    from verispec.speculative import draft_model, eagle, lookahead, medusa, ngram, suffix  # noqa: F401
