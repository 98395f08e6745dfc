"""The drafter interface, declared once: what a drafter must do and what the engine may ask.

A drafter proposes up to k tokens for one sequence; the engine verifies them against the target
and reports back what happened. The engine talks to drafters only through :class:`Drafter`:
the four required methods, and the optional capabilities declared on it with their defaults (a
test walks the engine's reads of a drafter and checks that it reads nothing else). Adding a
drafter means subclassing :class:`Drafter` and naming its factory in
:mod:`verispec.speculative.registry`, never adding a branch to the engine.

Life cycle of one request::

    drafter.start(seq)                       # after the target's prefill
    repeat:
        proposal = drafter.propose(seq, k)   # up to k tokens (+ their q, or None)
        ... the engine verifies and commits ...
        drafter.feedback(seq, outcome)       # what was accepted, what got committed
    drafter.finish(seq)                      # free per-sequence state

A proposal is a chain unless it carries ``parents``: then its tokens are the nodes of a draft
tree (see :mod:`verispec.speculative.tree`) verified in one target pass. Chain drafters never set it.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from verispec.speculative.tree import Tree

if TYPE_CHECKING:
    from verispec.models.loader import LoadedModel
    from verispec.sequence import Sequence
    from verispec.speculative.cost_model import CostModel


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

    def attention_mask(self, start: int, n1: int, device: torch.device | str) -> Tensor:
        """The pass's mask [n1+m, start+n1+m] for a verify segment of ``n1`` rows after
        ``start`` cached positions, followed by this branch.

        Worked example, cache length 3, segment [t, d1] (n1 = 2) and 2 aux rows::

            row   cache 0 1 2 | t d1 | a1 a2
            t           1 1 1 | 1 0  | 0  0     (causal, as without the branch)
            d1          1 1 1 | 1 1  | 0  0
            a1          1 1 1 | mask[0]
            a2          1 1 1 | mask[1]
        """
        m = len(self.tokens)
        if len(self.positions) != m or tuple(self.mask.shape) != (m, n1 + m):
            raise ValueError(f"aux branch of {m} tokens needs {m} positions and a [{m}, {n1 + m}] mask; got "
                             f"{len(self.positions)} positions and a {list(self.mask.shape)} mask")
        mask = torch.ones(n1 + m, start + n1 + m, dtype=torch.bool, device=device)
        mask[:n1, start:] = torch.ones(n1, n1 + m, dtype=torch.bool, device=device).tril()
        mask[n1:, start:] = self.mask.to(device)
        return mask


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

    def depth(self) -> int:
        """Tokens the proposal can commit before the bonus: its length, or a tree's depth."""
        if self.parents is None:
            return len(self)
        return max(Tree((-1, *self.parents)).depths)

    def first_nodes(self, n: int) -> Proposal:
        """A tree's first ``n`` nodes (what fits in the cache, or the node budget).

        Exact for every child mode: dropping the last nodes drops, at each node, a suffix of its
        children (and their subtrees), chosen by count alone, never by the drawn tokens. (A node
        budget is chosen from draft values, which only top-k trees carry: their children are not
        drawn, and any subtree picked before the target runs keeps verification exact.)
        """
        if len(self) <= n:
            return self
        probs = None if self.probs is None else self.probs[:n]
        values = None if self.values is None else self.values[:n]
        return Proposal(self.tokens[:n], probs, self.parents[:n], self.children, values=values)


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


# (a prompt length or a count of generated tokens, its time in units of the reference step)
CatchUpTimes = list[tuple[int, float]]


@dataclass(frozen=True)
class DraftCalibration:
    """A drafter's warm costs, each in units of the target's decode step (see
    :meth:`Drafter.calibrate`): one draft step, reading prompts of some lengths, and catching up
    on some numbers of generated tokens it did not draft for."""

    draft_step: float
    reads: CatchUpTimes
    resumes: CatchUpTimes


class Drafter(abc.ABC):
    """What every speculative method implements (the four abstract methods), and the optional
    capabilities the engine may use, each declared here with the default that means "not used".

    Capabilities:

    * ``hidden_layers``: the target hidden-state layers the drafter reads (0 = embeddings,
      i = after layer i, -1 = the final normed state). When set, the engine puts those layers,
      concatenated, in ``seq.target_hidden`` before ``start`` and every ``feedback``: after
      prefill every prompt position the pass ran, after a round the rows of the committed
      tokens' inputs. ``None``: the drafter reads none, and the engine asks for none.
    * ``last_prompt_state_only``: with ``hidden_layers``, ``start`` reads only the last prompt
      position's state, so prefix caching (which runs only the positions a slot did not keep)
      stays on for it.
    * ``stops_within_round``: the drafter can stop a round's chain before k drafts on a rule the
      engine binds with :meth:`bind_stop` (an adaptive controller's ``keep_drafting``).
    * :meth:`bind_costs`: an adaptive engine hands over its measured cost model (lookahead
      prices its window with it).
    * :meth:`reads_prompts_as`: how the target reads prompts, for a drafter that reads them too.
    * :meth:`calibrate`: warm timings of the drafter's own costs, which an adaptive engine takes
      once, on an empty slot, when it is built.
    """

    hidden_layers: tuple[int, ...] | None = None
    last_prompt_state_only: bool = False
    stops_within_round: bool = False

    @abc.abstractmethod
    def start(self, seq: Sequence) -> None:
        """A new sequence: its prompt (and first output token) are known; build any state."""

    @abc.abstractmethod
    def propose(self, seq: Sequence, k: int) -> Proposal:
        """Return up to k draft tokens continuing ``seq.token_ids``; may return fewer or none."""

    @abc.abstractmethod
    def feedback(self, seq: Sequence, outcome: Outcome) -> None:
        """Learn the verification result; roll back any state past the committed tokens."""

    @abc.abstractmethod
    def finish(self, seq: Sequence) -> None:
        """The sequence is done; drop its state."""

    def bind_costs(self, costs: CostModel) -> None:
        """Keep the engine's measured cost model (called once, by an adaptive engine)."""

    def bind_stop(self, keep: Callable[[Sequence, int, float], bool] | None) -> None:
        """Stop a round's chain early where ``keep(seq, n, value)`` says no more drafts pay
        (called once, by an adaptive engine, on a drafter with ``stops_within_round``)."""
        raise NotImplementedError(f"{type(self).__name__} declares stops_within_round but has no bind_stop")

    def reads_prompts_as(self, prefill: bool) -> None:
        """The target reads prompts in one prefill pass (``prefill=True``) or through the decode
        path (``False``, an engine with prefix caching); called once, when the engine is built."""

    def calibrate(self, slot: int, token: int, reference: Callable[[], object]) -> DraftCalibration | None:
        """Warm timings of the drafter's costs, each in runs of ``reference()`` (the target's
        decode step) timed just before it, taken in the drafter's own cache ``slot`` (left
        empty) with any ``token``; ``None`` when its costs are too small to be worth timing."""
        return None


@dataclass(frozen=True)
class DrafterContext:
    """What a drafter factory may use: the target (for its tokenizer, vocabulary and device).

    ``max_num_seqs`` is the number of sequence slots: a drafter keeps per-sequence state keyed
    by ``seq.slot``, which is in ``0 .. max_num_seqs - 1``.
    """

    target: LoadedModel
    max_model_len: int
    max_num_seqs: int = 1
