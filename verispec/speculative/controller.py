"""Choosing k, the number of drafts per round: the policy over :mod:`~verispec.speculative.cost_model`.

The engine talks to a controller through three calls, for every drafter::

    k = controller.choose_k(seq, k_max)                # before the round, 0 <= k <= k_max
    more = controller.keep_drafting(seq, n, value)      # a chain drafter after n drafts: one more?
    m = controller.choose_nodes(seq, values, draft_s)  # a drafted tree with values: its node budget
    controller.observe(seq, report)                    # after it: proposed, accepted, draft and verify time

:class:`FixedK` always answers k_max (``"adaptive": false``). :class:`AdaptiveController` picks
the k that maximises :func:`~verispec.speculative.cost_model.speedups` from the engine-wide
:class:`~verispec.speculative.cost_model.CostModel` and each request's own per-position
acceptance (an EMA that starts from the engine-wide prior and soon trusts the request's own
rounds over it).

Invariants of the policy, each guarding against paying for an estimate nobody has checked:

* k reaches at most ``ramp`` positions past the deepest one the request has tested, and
  starting to draft needs a predicted gain of ``margin``; once drafting, a request goes on
  while the predicted loss is at most ``stay``. Rounds whose drafter had nothing to propose do
  not end drafting.
* While speculation does not pay, probes are paid from an exploration budget (``explore`` of
  each plain round's time), and a probe waits until that budget covers the drafter's measured
  catch-up cost (a draft model must first read what it has not seen). A new request's first
  probe is funded by an engine-wide pool, only when the catch-up is at most ``first_probe`` of
  the best-case saving over the tokens it has left; before any round has tested a draft the
  prior is a guess and the pool need not hold the catch-up.
* A request does not stop on thin evidence: until ``settle`` rounds have tested its first
  position it drafts on while in sync and the predicted loss stays within ``first_probe`` of
  the best-case saving.
* For a tree drafter k is the depth; :meth:`AdaptiveController.choose_nodes` then keeps the m
  best nodes (by calibrated draft path probability) that maximise tokens per second.
* A chain drafter that knows how sure it is (a draft model: the draft's probability of its
  drafts, ``value``) stops on its own within k (:meth:`AdaptiveController.keep_drafting`): one
  more draft is worth drafting while ``value`` times the request's acceptance estimate at that
  position, the tokens it is expected to add, covers what it costs, a draft step and one more
  verified position (c + v(n + 2) - v(n + 1)). k is then only a cap, so the controller asks such
  a drafter for the most its ramp allows (``value_stops``). Replayed on a draft model's
  teacher-forced confidences on chat answers, at k <= 4 the rule came within 2% of the best
  fixed threshold and 7-8% above the best fixed k at c = 0.25-0.45
  (docs/benchmarks/per-token-costs.md).

Why each rule exists, and the runs that showed it, are in docs/design.md (the controller).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from verispec.speculative.cost_model import CostModel, ema, speedups

if TYPE_CHECKING:
    from verispec.config import SpeculativeConfig
    from verispec.sequence import Sequence as Seq


# ---- the interface -------------------------------------------------------------------------


@dataclass(frozen=True)
class RoundReport:
    """What one round did and cost, as the engine measured it."""

    num_proposed: int
    num_accepted: int
    num_committed: int
    draft_s: float  # the drafting phase
    verify_s: float  # the verify phase over ``positions`` positions
    num_positions: int = 0  # positions the verify pass computed; 0: num_proposed + 1
    depth: int = 0  # a tree round: the tree's depth; 0 for a chain

    @property
    def positions(self) -> int:
        """The last token, the drafts, and any aux branch the drafter added (lookahead's window)."""
        return self.num_positions or self.num_proposed + 1

    @property
    def length(self) -> int:
        """Draft positions along the longest path: a chain's drafts, a tree's depth."""
        return self.depth or self.num_proposed


class Controller(Protocol):
    def choose_k(self, seq: Seq, k_max: int) -> int:
        """How many tokens to draft this round, 0..k_max (0 = a plain decoding round)."""

    def choose_nodes(self, seq: Seq, values: Sequence[float], draft_s: float) -> int:
        """How many of a drafted tree's nodes to verify, 1..len(values) (the node budget).

        ``values`` are the nodes' draft acceptance estimates, best first (``Proposal.values``);
        ``draft_s`` is what drafting the tree took.
        """

    def keep_drafting(self, seq: Seq, drafted: int, value: float) -> bool:
        """A chain drafter has ``drafted`` drafts (fewer than it was asked for), which the draft
        gives probability ``value`` together: draft one more?"""

    def observe(self, seq: Seq, report: RoundReport) -> None:
        """Learn from the round just finished."""


class FixedK:
    """Always draft the most allowed: ``num_speculative_tokens``, capped by the room left, and
    verify every tree node drafted."""

    def choose_k(self, seq: Seq, k_max: int) -> int:
        return k_max

    def choose_nodes(self, seq: Seq, values: Sequence[float], draft_s: float) -> int:
        return len(values)

    def keep_drafting(self, seq: Seq, drafted: int, value: float) -> bool:
        return True

    def observe(self, seq: Seq, report: RoundReport) -> None:
        pass


def build_controller(config: SpeculativeConfig | None) -> Controller:
    return AdaptiveController() if config is not None and config.adaptive else FixedK()


# ---- the adaptive controller ---------------------------------------------------------------


@dataclass
class _Request:
    acceptance: list[float]  # [k] per-position conditional acceptance estimates
    trials: list[int] = field(default_factory=list)  # [k] how often this request tested position k
    drafted_last: bool = False  # the drafter is in sync (it drafted last round)
    drafting: bool = False  # the request speculates: its last round with drafts, or a later one asking for some
    balance: float = 0.0  # exploration budget in seconds; a probe is allowed when >= 0
    depth: int = 0  # the deepest draft position this request has tested (accepted, or the first rejected)
    seen: int = 0  # tokens of the request the drafter had read by its last drafting round
    asked: int = 0  # the k chosen for the round under way
    speculated: bool = False  # some round of this request has verified more than its last token
    pool_probe: bool = False  # this round is a probe paid from the engine-wide pool
    missed: int = 0  # tokens the drafter has not read when this round starts
    missed_prompt: int = 0  # how many of them are the prompt (the drafter has read nothing yet)
    predicted: float = 0.0  # a tree round: the summed draft values of the nodes kept (0: none)
    accepted_ema: float | None = None  # tree calibration: accepted nodes per round (EMA) ...
    predicted_ema: float | None = None  # ... over the summed draft values (EMA)
    tree_rounds: int = 0


class AdaptiveController:
    """Pick, per request and round, the k that maximises expected tokens per second.

    Args:
        prior_acceptance: the starting per-position acceptance of the engine-wide prior.
        request_weight: EMA weight of one observation in a request's own estimates, once it
            has a few; the first ones weigh more (1/2, 1/3, ... with the prior counted as
            ``prior_trials`` = 1 observation), so a request soon stops trusting a prior that others
            shaped, and is not thrown off by one unlucky draft later.
        prior_trials: how many observations of its own the engine-wide prior is worth to a request.
        prior_weight: EMA weight of one observation in the engine-wide prior (slow).
        explore: the fraction of plain-round time that probes may cost (see the module doc).
        ramp: how far past the deepest position a request has tested its k may reach.
        margin: the predicted gain over plain decoding that speculation must beat (a fraction).
        stay: the predicted loss a drafting request tolerates before it stops (a fraction).
        first_probe: the largest catch-up the engine-wide pool pays for a new request's first
            probe, as a share of what speculation would save at best over the tokens the
            request may still take (at the measured costs, with every draft surviving with
            probability ``predictable``).
        predictable: the per-position acceptance that stands for "predictable content" in that
            best case.
        settle: how many rounds of its own a request drafts (its drafter in sync, and the
            predicted loss of the rounds left at most ``first_probe`` of that best-case saving)
            before its estimates may stop it; 1 stops it on the first failed round.
        costs: the cost model; a fresh one by default.
    """

    def __init__(self, *, prior_acceptance: float = 0.5, request_weight: float = 0.15, prior_trials: int = 1,
                 prior_weight: float = 0.05, explore: float = 0.03, ramp: int = 2, margin: float = 0.02,
                 stay: float = 0.05, first_probe: float = 0.25, predictable: float = 0.9, settle: int = 3,
                 costs: CostModel | None = None) -> None:
        if not 0.0 <= prior_acceptance <= 1.0:
            raise ValueError(f"prior_acceptance must be in [0, 1], got {prior_acceptance}")
        if not (0 < prior_weight <= 1 and 0 < request_weight <= 1):
            raise ValueError("EMA weights must be in (0, 1]")
        if not 0 < explore < 1:
            raise ValueError(f"explore must be in (0, 1), got {explore}")
        self.costs = costs or CostModel()
        self.prior: list[float] = []  # engine-wide per-position acceptance, grown on demand
        self.prior_acceptance = prior_acceptance
        self.request_weight, self.prior_weight = request_weight, prior_weight
        if prior_trials < 0:
            raise ValueError(f"prior_trials must be >= 0, got {prior_trials}")
        self.prior_trials = prior_trials
        self.explore = explore
        if ramp < 1:
            raise ValueError(f"ramp must be >= 1, got {ramp}")
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        if not 0 <= stay < 1:
            raise ValueError(f"stay must be in [0, 1), got {stay}")
        if not 0 <= first_probe < 1:
            raise ValueError(f"first_probe must be in [0, 1), got {first_probe}")
        if not 0 < predictable <= 1:
            raise ValueError(f"predictable must be in (0, 1], got {predictable}")
        self.predictable = predictable
        if settle < 1:
            raise ValueError(f"settle must be >= 1, got {settle}")
        self.settle = settle
        self.ramp, self.margin, self.stay, self.first_probe = ramp, margin, stay, first_probe
        self.pool = 0.0  # engine-wide budget for new requests' first probes (seconds): plain rounds, surpluses
        self.prior_rounds = 0  # rounds that taught the engine-wide prior (0: it is only a guess)
        self.prior_calibration: tuple[float, float] | None = None  # (accepted, predicted) EMAs, engine-wide
        # The drafter stops within k by keep_drafting (set by the engine): k is then a cap.
        self.value_stops = False
        # Per-request state lives as long as its sequence does.
        self._requests: weakref.WeakKeyDictionary[Seq, _Request] = weakref.WeakKeyDictionary()

    def choose_k(self, seq: Seq, k_max: int) -> int:
        req = self._request(seq)
        req.missed = seq.num_tokens - req.seen
        req.asked, req.pool_probe, req.predicted = 0, False, 0.0
        if k_max <= 0:
            return 0
        costs = self.costs.relative(k_max)
        if costs is None:
            return 0  # a plain round measures T_target(1) first
        gains = speedups(self._estimates(req, k_max), *costs)
        best = max(range(1, min(k_max, req.depth + self.ramp) + 1), key=gains.__getitem__)
        req.missed_prompt = seq.num_prompt_tokens if req.seen == 0 else 0
        catch_up = 0.0 if req.drafted_last else self.costs.catch_up_time(req.missed, req.missed_prompt)
        # Hysteresis: a request that is drafting goes on while speculation is predicted to lose
        # at most ``stay`` (and less than half of what one extra verified position costs, so
        # that failing drafts always stop it); one that is not needs a gain of ``margin``.
        stay = max(min(self.stay, (costs[1][1] - 1.0) / 2), 0.0)
        threshold = gains[0] * ((1 - stay) if req.drafting else (1 + self.margin))
        if gains[best] > threshold and (catch_up == 0 or catch_up <= self._saving(seq, gains[best])):
            req.asked = best
        # A probe: only once the budget covers what catching the drafter up is known to cost.
        elif req.balance >= catch_up:
            req.asked = best
        # Too little evidence of its own to stop (see the module doc): drafts on while in sync.
        elif req.drafted_last and req.trials[0] < self.settle and \
                (self.settle - req.trials[0]) * self._round_loss(gains[best], best, costs) <= \
                self.first_probe * self._saving(seq, self._best_case(k_max, costs)) / self.costs.t1():
            req.asked = best
        elif not req.speculated and (self.pool >= catch_up or not self.prior_rounds) and \
                catch_up <= self.first_probe * self._saving(seq, self._best_case(k_max, costs)):
            req.pool_probe = True  # a new request's first probe, paid from the engine-wide pool
            req.asked = best
        if req.asked and self.value_stops:
            req.asked = min(k_max, req.depth + self.ramp)  # the drafter stops where its drafts stop paying
        return req.asked

    def keep_drafting(self, seq: Seq, drafted: int, value: float) -> bool:
        """One more draft while its expected tokens, ``value`` (the draft's probability of the
        drafts so far) times the request's acceptance estimate at the next position, cover its
        cost in decode steps: a draft step (c) and one more verified position. Drafts on while
        the costs are unmeasured."""
        costs = self.costs.relative(drafted + 1)
        if costs is None:
            return True
        c, verify = costs
        rate = self._estimates(self._request(seq), drafted + 1)[drafted]
        return value * rate >= c + verify[drafted + 1] - verify[drafted]

    def choose_nodes(self, seq: Seq, values: Sequence[float], draft_s: float) -> int:
        """The node budget: the m best nodes whose round commits the most tokens per second.

        Verification commits 1 + (accepted nodes) tokens, and a node is accepted only on the
        accepted path, so E[tokens](m) = 1 + sum of the m nodes' acceptance chances. The chance
        is the node's draft value (its path's draft probability) times this request's
        calibration: accepted nodes per round over the values predicted, an EMA weighted like
        the acceptance estimates and starting from the engine-wide one (1 until measured). The
        round costs the drafting already done plus T_target(m + 1), so

            m* = argmax_m (1 + sum_{i<=m} min(1, s * value_i)) / (draft_s / T1 + v(m + 1)).
        """
        req = self._request(seq)
        t1 = self.costs.t1()
        best = len(values)
        if t1 is not None and t1 > 0 and len(values) > 1:
            scale = self._calibration(req)
            drafted, expected, rate = draft_s / t1, 1.0, 0.0
            for m, value in enumerate(values, start=1):
                expected += min(1.0, scale * value)
                r = expected / (drafted + self.costs.target_time(m + 1) / t1)
                if r > rate:
                    best, rate = m, r
        req.predicted = sum(values[:best])
        return best

    def observe(self, seq: Seq, report: RoundReport) -> None:
        req = self._request(seq)
        n, a, width = report.length, report.num_accepted, report.positions
        self.costs.observe_target(width, report.verify_s)
        if width > 1:
            self.costs.extra_positions = width - n - 1
            req.speculated = True
        if n > 0 and req.drafted_last:
            self.costs.observe_draft(n, report.draft_s)
        elif n > 0:
            self.costs.observe_catch_up(req.missed, n, report.draft_s, req.missed_prompt)
        if n > 0:
            req.seen = seq.num_tokens
        req.drafted_last = n > 0
        # A round whose drafter had nothing to propose (prompt lookup without a match) does not
        # end drafting; a round that asked for no drafts does.
        req.drafting = n > 0 or (req.drafting and req.asked > 0)
        tested = min(a + 1, n)  # drafts 1..a were accepted, draft a+1 (if proposed) rejected
        short = n < req.asked and width > n + 1 and not report.depth
        if short:
            # The drafter had fewer drafts than asked but the round still paid for its extra
            # positions (lookahead's window with an empty pool): the missing draft counts as a miss.
            tested = n + 1
        req.depth = max(req.depth, tested)
        self._grow(self.prior, tested)
        self.prior_rounds += tested > 0
        req.acceptance.extend(self.prior[len(req.acceptance):tested])
        req.trials.extend([0] * (len(req.acceptance) - len(req.trials)))
        for i in range(tested):
            hit = 1.0 if i < a else 0.0
            req.acceptance[i] = ema(req.acceptance[i], hit, self._weight(req, i))
            req.trials[i] += 1
            self.prior[i] = ema(self.prior[i], hit, self.prior_weight)
        if 0 < n == a < len(req.acceptance) and not short:
            # Every draft survived, so draft n + 1 was never tried: pull its estimate toward
            # draft n's. Without this, one unlucky rejection deep in the chain would cap k for
            # good, because positions beyond the chosen k are never tested again.
            req.acceptance[n] = ema(req.acceptance[n], req.acceptance[n - 1], self._weight(req, n))
        if req.predicted > 0:
            self._calibrate(req, a, req.predicted)
            req.predicted = 0.0
        t1 = self.costs.t1()
        if width == 1:
            req.balance += self.explore * report.verify_s
            self.pool += self.explore * report.verify_s
        elif t1 is not None:  # (a pinned-k request may draft before any plain round)
            # What the round lost against plain decoding (negative: it gained), catch-up included.
            loss = report.draft_s + report.verify_s - report.num_committed * t1
            if req.pool_probe:
                self.pool -= loss
                req.pool_probe = False
            else:
                # A gain first repays what the request owes; the surplus is the engine's, to fund
                # other requests' first probes (see the module doc).
                balance = req.balance - loss
                req.balance = min(balance, 0.0)
                self.pool += max(balance, 0.0)

    # ---- helpers -----------------------------------------------------------------------

    def _request(self, seq: Seq) -> _Request:
        req = self._requests.get(seq)
        if req is None:
            req = self._requests[seq] = _Request(acceptance=list(self.prior))
        return req

    def _weight(self, req: _Request, i: int) -> float:
        """EMA weight of the request's next observation at position i (see ``request_weight``)."""
        return max(1.0 / (self.prior_trials + req.trials[i] + 1), self.request_weight)

    def _calibration(self, req: _Request) -> float:
        """Accepted tree nodes per unit of draft value: the request's, else the engine's, else 1."""
        accepted, predicted = (req.accepted_ema, req.predicted_ema) if req.tree_rounds else \
            (self.prior_calibration or (1.0, 1.0))
        return accepted / predicted if predicted > 0 else 1.0

    def _calibrate(self, req: _Request, accepted: int, predicted: float) -> None:
        if not req.tree_rounds and self.prior_calibration is not None:
            req.accepted_ema, req.predicted_ema = self.prior_calibration
        weight = 1.0 if req.accepted_ema is None else \
            max(1.0 / (self.prior_trials + req.tree_rounds + 1), self.request_weight)
        req.accepted_ema = ema(req.accepted_ema, accepted, weight)
        req.predicted_ema = ema(req.predicted_ema, predicted, weight)
        req.tree_rounds += 1
        prior = self.prior_calibration or (accepted, predicted)
        self.prior_calibration = (ema(prior[0], accepted, self.prior_weight),
                                  ema(prior[1], predicted, self.prior_weight))

    def _best_case(self, k_max: int, costs: tuple[float, list[float]]) -> float:
        """The speedup the measured costs allow on predictable content (every draft surviving
        with probability ``predictable``): what a probe could find at best."""
        return max(speedups([self.predictable], *costs))

    @staticmethod
    def _round_loss(gain: float, k: int, costs: tuple[float, list[float]]) -> float:
        """What a round drafting k at a predicted ``gain`` is expected to lose against plain
        decoding, in plain steps (negative: it gains): its cost, k * c + v(k + 1), minus the
        tokens it commits, cost * gain."""
        c, verify = costs
        cost = k * c + verify[k]
        return cost - cost * gain

    def _plain_time(self, seq: Seq) -> float:
        """Seconds plain decoding needs for the tokens the request may still generate."""
        return seq.tokens_left * self.costs.t1()

    def _saving(self, seq: Seq, gain: float) -> float:
        """Seconds that speculating at a predicted ``gain`` would save over the rest of the
        request: a drafter's catch-up must be worth paying."""
        return self._plain_time(seq) * (1.0 - 1.0 / gain)

    def _estimates(self, req: _Request, k: int) -> list[float]:
        """The request's own rates where it has some, the engine-wide prior beyond, and the
        deepest measured rate for positions nobody has tried yet (so deeper k gets explored)."""
        rates = req.acceptance[:k] + self.prior[len(req.acceptance):k]
        self._grow(rates, k)
        return rates

    def _grow(self, rates: list[float], length: int) -> None:
        rates.extend([rates[-1] if rates else self.prior_acceptance] * (length - len(rates)))
