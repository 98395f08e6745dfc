"""Choosing k, the number of drafts per round, from measured costs and acceptance.

The arithmetic (all times relative to one plain decode step, T_target(1)). A round that drafts
k tokens commits on average, for a chain whose i-th draft survives with conditional probability
p_i (given that drafts 1..i-1 survived),

    E[tokens](k) = 1 + sum_{i=1..k} prod_{j<=i} p_j          (the 1 is the recovered/bonus token)

and costs k * c + v(k + 1), where c is the cost of drafting one token and v(n) = T_target(n) /
T_target(1) is the cost of a verify pass over n positions (v(1) = 1; a linear fit is
v(n) = 1 + alpha * (n - 1)). The speedup over plain decoding is

    speedup(k) = E[tokens](k) / (k * c + v(k + 1)),     speedup(0) = 1.

:func:`speedups` is that formula, the one place it is written; ``verispec plan`` prints it and
:class:`AdaptiveController` maximises it every round.

The controller is behind a small interface the engine uses for every drafter::

    k = controller.choose_k(seq, k_max)     # before the round, 0 <= k <= k_max
    m = controller.choose_nodes(seq, values, draft_s)  # a drafted tree with values: its node budget
    controller.observe(seq, report)         # after it: proposed, accepted, draft and verify time

:class:`FixedK` always answers k_max (``"adaptive": false``). :class:`AdaptiveController`
measures instead of assuming:

* engine-wide costs (:class:`CostModel`): an exponential moving average (EMA) of the verify
  phase time per number of positions n, a least-squares line through them for the n not seen
  yet, and an EMA of the drafting time per draft token, all kept at a reference speed while one
  EMA follows the machine's speed, so that costs measured minutes apart stay comparable;
* per-request, per-position acceptance: each request starts from the engine-wide estimate (its
  prior) and follows its own content with an EMA whose first observations weigh most (1/2,
  1/3, ... down to ``request_weight``, 0.15), so within a few rounds it trusts what it has seen
  over what other requests taught the prior, and later adapts as the text turns from prose to
  code to copied passages without being thrown off by one unlucky draft.

Two guards keep a request from paying for estimates it has not checked itself. A new request
starts from the engine-wide prior, which the previous requests shaped; after a run of easily
predicted code, that prior says "draft 8" even to a prose request, and with a draft model one
such round costs several decode steps. So k may reach at most ``ramp`` (2) positions past the
deepest one this request has tested (2, 4, 6, ... while every draft survives), and
speculation must beat plain decoding by a ``margin`` (2%) in prediction, not merely tie with it,
since at break-even the estimation noise alone makes it lose. Once drafting, it goes on while
speculation is predicted to lose at most ``stay`` (5%, and under half of one extra verified
position's cost, so failing drafts always stop it): stopping has a price, the probes it takes to
come back, and a noisy estimate dipping below break-even should not pay it. A request stays
"drafting" through rounds whose drafter had nothing to propose (prompt lookup finds no match in
about half the rounds of a typical answer); otherwise each such round would reset it to needing
the margin, and a prompt-lookup request whose drafts survive 25% of the time would draft in only
about half the rounds where it could.

When no k > 0 beats plain decoding the request runs plain rounds, but probes now and then with
the best k, so speculation returns once the content becomes predictable again. Probes are paid
from an exploration budget: every plain round earns ``explore`` (3%) of its time, and every
drafting round, probe or not, spends what it actually lost against plain decoding (its round
time minus T_target(1) per token it committed); the balance never rises above zero while
drafting, so gains are not saved up to pay for later losses. A probe is made when the balance is
not negative and covers the probe's known catch-up cost: a draft model must first read every
token it has not seen (the prompt of a new request, whatever plain rounds committed), and the
cost model learns that time from the first drafting rounds after idling, as a line in the tokens
missed (a short prompt costs a draft model more per token than a long one; prompt lookup's is
~0), with one line for reading a request's prompt and another for catching up on tokens
generated while the drafter idled (a draft model reads those in decode-sized passes, at several
times a long prompt's price per token). The round that showed speculation stopped paying has
already charged its loss, so the first probe waits for it to be earned back. Nor does a
predicted gain start drafting by itself when the catch-up costs more than that gain can save
over the tokens the request has left (``max_tokens`` minus those generated): a draft model does
not read a 1,000-token document to speed up a 100-token answer by 10%. Probing thus costs about
that fraction of the plain-round time however expensive it is: a failed prompt-lookup probe
(~alpha lost) waits ~alpha / 0.03 rounds, while a draft model waits in proportion to its
catch-up, and a new request whose prior says speculation does not pay pays a draft model's
prompt prefill for a probe only from what the engine has earned: an engine-wide pool, filled by
every plain round like the request budgets and by what drafting rounds gain beyond what their
request owed (gains that the capped request budget would drop), funds a new request's first
probe when it holds the catch-up and the catch-up is at most ``first_probe`` (a quarter) of what
speculation could save at best over the tokens the request may still take: the measured costs
with every draft surviving 90% of the time. Where a draft model cannot pay much even on
predictable content (on a 2-core CPU a 0.5B draft costs half a 1.5B target step per token and
gains under 10% at best), reading a new request's prompt for a probe is a loss however full the
pool, and it is not made. Without the pool, a prior shaped by unpredictable requests would keep
a draft model off for good, since a request's own budget grows more slowly than the catch-up it
would need. Until some round has tested a draft, though, the prior is a guess
(``prior_acceptance``), not evidence that speculation does not pay, and an empty pool would keep
a fresh engine's draft model off for its first request's whole answer (~100 plain rounds to earn
a 60-token prompt read): so the pool's balance is not required then, only the
quarter-of-the-saving bound. A probe that gains earns credit, so a recovering request probes
again at once.

A request does not stop on thin evidence, though: a draft model's catch-up grows with every
plain round faster than the budget, so in practice a stop is for the rest of the answer, and an
answer's opening words are often unpredictable while the rest is not (on this CPU one failed
first probe, 0 of 2 drafts, stopped a draft model for a whole coding answer that fixed k = 2 sped
up 8%). Until ``settle`` (3) rounds have tested its first draft position, a request whose
drafter is in sync (it drafted last round, so there is nothing to catch up) drafts on while the
predicted loss of the rounds still to make is at most ``first_probe`` of what speculation could
save at best over the tokens it has left; a short answer, or costs where speculation cannot save
much, stop it at once.

Trees. For a tree drafter k is the tree's depth: acceptance is learned per depth (a round that
accepted a path of length a tested depths 1..a+1), the draft cost per depth level, and the
tree's breadth (the positions past its longest path) is priced into the verify cost like
lookahead's window. A tree whose nodes carry draft values (a dynamic top-k tree, numbered best
first) then gets a node budget after drafting: :meth:`AdaptiveController.choose_nodes` keeps
the m best nodes that maximise tokens per second, with each node's acceptance chance taken as
its path's draft probability times a calibration the request measures (accepted nodes per round
over the draft values it predicted). Low-confidence nodes are dropped when a verify position
costs more than they are likely to return, and the whole budget is used when they are cheap.

Costs are measured with the phases the engine already times: the drafting phase and the verify
phase (target forward plus verification). The first drafting round after plain rounds also
feeds the drafter the tokens it missed, so its time is not used as a per-token cost sample.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from verispec.config import SpeculativeConfig
    from verispec.engine.sequence import Sequence as Seq


# ---- the formula ---------------------------------------------------------------------------


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """E[tokens committed by a round with k drafts]; ``acceptance[i]`` is p_{i+1}.

    A list shorter than k repeats its last rate. Example: p = [0.8, 0.5], k = 3 gives
    1 + 0.8 + 0.8*0.5 + 0.8*0.5*0.5 = 2.4.
    """
    if k > 0 and not acceptance:
        raise ValueError("acceptance needs at least one rate")
    total, survive = 1.0, 1.0
    for i in range(k):
        survive *= acceptance[min(i, len(acceptance) - 1)]
        total += survive
    return total


def speedups(acceptance: Sequence[float], draft_cost: float, verify_cost: Sequence[float]) -> list[float]:
    """Expected speedup over plain decoding for k = 0 .. len(verify_cost) - 1 drafts.

    Args:
        acceptance: per-position conditional acceptance rates p_1, p_2, ... (see
            :func:`expected_tokens`).
        draft_cost: c, the time to draft one token over T_target(1).
        verify_cost: ``verify_cost[k]`` = T_target(k + 1) / T_target(1); ``verify_cost[0]`` is 1.
    """
    for p in acceptance:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"acceptance rates must be in [0, 1], got {p}")
    if draft_cost < 0:
        raise ValueError(f"the draft cost must be >= 0, got {draft_cost}")
    return [expected_tokens(acceptance, k) / (k * draft_cost + v) for k, v in enumerate(verify_cost)]


def fit_line(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) through at least two points with distinct x."""
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return mean_y - slope * mean_x, slope


def linear_verify_cost(alpha: float, k_max: int) -> list[float]:
    """v(k + 1) = 1 + alpha * k for k = 0..k_max."""
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    return [1.0 + alpha * k for k in range(k_max + 1)]


def alpha_at_batch(alpha: float, batch_size: int) -> float:
    """Per-position verify overhead at batch size B, from alpha measured at batch 1.

    Model: a forward over m tokens costs 1 + alpha * (m - 1). Plain decoding runs B tokens per
    step and a verify pass B * (k + 1), so relative to the plain step each extra position costs
    alpha * B / (1 + alpha * (B - 1)), which tends to 1 (compute-bound) as B grows.
    """
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    return alpha * batch_size / (1.0 + alpha * (batch_size - 1))


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

    def observe(self, seq: Seq, report: RoundReport) -> None:
        """Learn from the round just finished."""


class FixedK:
    """Always draft the most allowed: ``num_speculative_tokens``, capped by the room left, and
    verify every tree node drafted."""

    def choose_k(self, seq: Seq, k_max: int) -> int:
        return k_max

    def choose_nodes(self, seq: Seq, values: Sequence[float], draft_s: float) -> int:
        return len(values)

    def observe(self, seq: Seq, report: RoundReport) -> None:
        pass


def build_controller(config: SpeculativeConfig | None) -> Controller:
    return AdaptiveController() if config is not None and config.adaptive else FixedK()


# ---- the adaptive controller ---------------------------------------------------------------


def _ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else old + weight * (new - old)


def warm_seconds(run: Callable[[], object], runs: int = 3) -> float:
    """Seconds ``run()`` takes warm: one untimed cold run (a shape's first run pays one-time
    set-up), then the median of ``runs`` timed ones. For calibrating a :class:`CostModel`."""
    run()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def relative_time(run: Callable[[], object], reference: Callable[[], object], runs: int = 3) -> float:
    """How long ``run()`` takes warm, in runs of ``reference()``: one untimed cold run of each,
    then the median of ``runs`` ratios, each of a timed ``run()`` over a timed ``reference()``
    run just before it. On a shared host whose speed drifts by 20-60% within minutes, timings
    taken seconds apart (a draft step against a decode step) gave cost ratios off by as much;
    timed in pairs the drift cancels. For calibrating a :class:`CostModel`."""
    reference()
    run()
    ratios = []
    for _ in range(runs):
        t0 = time.perf_counter()
        reference()
        t1 = time.perf_counter()
        run()
        ratios.append((time.perf_counter() - t1) / (t1 - t0))
    return statistics.median(ratios)


def _read_time(points: Sequence[tuple[int, float]], n: int) -> float | None:
    """Seconds to read ``n`` tokens by the samples ``points`` of (tokens, seconds): the
    least-squares line once they hold two different lengths (its intercept at least 0, its
    slope positive), else the mean seconds per token; None without samples."""
    if not points:
        return None
    if len({m for m, _ in points}) > 1:
        intercept, slope = fit_line(points)
        if slope > 0:
            return max(intercept, 0.0) + slope * n
    return n * sum(t for _, t in points) / sum(m for m, _ in points)


@dataclass
class CostModel:
    """Measured round costs: T_target(n) per n, the draft time per draft token (EMAs) and the
    drafter's catch-up time for the tokens it missed while idle (lines through samples).

    The machine's speed drifts (on a shared 2-vCPU host a decode step took 96 ms, then 140 ms
    for a minute, then 110), and a cost is measured only when a round of its kind runs: T(3) by a
    round that drafts 2, T(1) by a plain one. Ratios of times taken minutes apart (v(3) = T(3) /
    T(1), the draft cost over T(1)) swung with the drift, by 30% there, and so did the choice of
    k. So the model keeps one speed, learned from every verify pass (its time over what that
    width costs at the reference speed, an EMA), apart from the shape of the costs: each width's
    time, the draft time and the catch-up reads in reference seconds (a time divided by the
    speed when it was taken), with the first T(1) measured as the reference. A prediction is a
    reference time times the current speed, so v(n) and c change only when the costs' shape
    does, and the shape is learned more slowly (``shape_weight``) than the speed.
    """

    weight: float = 0.2  # EMA weight of a new sample (the speed, the draft time)
    # EMA weight of a new sample of T(n) for n > 1, in reference seconds: while the speed lags a
    # change, a width's samples also move its shape (2.5% after a 40% change, at 0.02)
    shape_weight: float = 0.02
    prior_alpha: float = 0.1  # v(n) slope used until two different n have been measured
    target_s: dict[int, float] = field(default_factory=dict)  # n -> EMA of the verify time, as measured
    extra_positions: int = 0  # what the drafter adds to a verify pass besides its drafts (last seen)
    # Recent catch-up reads as (tokens, reference seconds without the round's own drafts), of two
    # kinds. A draft model reads a request's prompt in one pass, as the target's prefill did: 32
    # tokens in ~4.4 ms each, 256 in ~1.5 (a 0.5B int4 draft on an AMX Xeon; from 64 tokens a pass
    # takes the prefill path), so its cost is a line, as T_target(n) is. Tokens generated while it
    # idled it reads in decode-sized passes (at most 63 tokens each) at ~5 ms a token, several
    # times a long prompt's price: priced like a prompt, a return to drafting looks cheaper than
    # it is.
    prompt_reads: list[tuple[int, float]] = field(default_factory=list)
    resume_reads: list[tuple[int, float]] = field(default_factory=list)
    max_catch_up_samples: int = 8  # per kind
    _t1_ref: float | None = None  # the first T(1) measured: T(1) at the reference speed
    speed: float = 1.0  # how much slower than the reference the machine runs now (EMA)
    _target_ref: dict[int, float] = field(default_factory=dict)  # n >= 2 -> T(n) in reference seconds
    _draft_ref: float | None = None  # EMA of the draft time per token, reference seconds
    # A catch-up round seen before any draft step was timed: (its samples, missed, drafted,
    # reference seconds, the resume part's predicted reference seconds). Its sample counts the
    # round's drafts as catch-up until the first drafting round times a draft.
    _unsettled: tuple[list[tuple[int, float]], int, int, float, float] | None = None

    @property
    def draft_s_per_token(self) -> float | None:
        return None if self._draft_ref is None else self._draft_ref * self.speed

    def observe_target(self, n: int, seconds: float) -> None:
        self.target_s[n] = _ema(self.target_s.get(n), seconds, self.weight)
        if n == 1 and self._t1_ref is None:
            self._t1_ref = seconds  # the reference: times before it count as taken at its speed
            return
        ref = self._t1_ref if n == 1 else self._target_ref.get(n)
        if ref is None:  # a width's first time is its shape, at the speed of the moment
            self._target_ref[n] = seconds / self.speed
            return
        self.speed = _ema(self.speed, seconds / ref, self.weight)
        if n > 1:
            self._target_ref[n] = _ema(ref, seconds / self.speed, self.shape_weight)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        self._draft_ref = _ema(self._draft_ref, seconds / tokens / self.speed, self.weight)
        if self._unsettled is not None:  # the latest catch-up sample is provisional: settle it
            points, missed, drafted, round_ref, other = self._unsettled
            self._unsettled = None
            points[-1] = (missed, max(round_ref - drafted * self._draft_ref - other, 0.0))

    def observe_catch_up(self, missed: int, drafted: int, seconds: float, prompt: int = 0) -> None:
        """A first drafting round after ``missed`` unseen tokens, of which the first ``prompt``
        are a request's prompt read in one pass and the rest were generated while it idled. A
        round that read a prompt is a prompt sample, less what its generated tokens should have
        cost."""
        if missed <= 0:
            return
        ref = seconds / self.speed
        if prompt > 0:  # a prompt sample: the generated tokens read after the prompt are priced out
            points, tokens = self.prompt_reads, prompt
            other = self._time(self.resume_reads, self.prompt_reads, missed - prompt)
        else:
            points, tokens, other = self.resume_reads, missed, 0.0
        # Until the per-draft cost is known, all of the round's drafting counts.
        if self._draft_ref is None:
            self._unsettled = (points, tokens, drafted, ref, other)
        points.append((tokens, max(ref - drafted * (self._draft_ref or 0.0) - other, 0.0)))
        del points[:-self.max_catch_up_samples]

    def catch_up_time(self, missed: int, prompt: int = 0) -> float:
        """Predicted seconds to catch a drafter up on ``missed`` tokens whose first ``prompt``
        are a request's prompt; 0 until measured. Each kind by its own samples
        (:func:`_read_time`), or by the other kind's while it has none."""
        if missed <= 0:
            return 0.0
        ref = self._time(self.prompt_reads, self.resume_reads, min(prompt, missed)) + \
            self._time(self.resume_reads, self.prompt_reads, missed - min(prompt, missed))
        return ref * self.speed

    @staticmethod
    def _time(points: list[tuple[int, float]], fallback: list[tuple[int, float]], n: int) -> float:
        if n <= 0:
            return 0.0
        t = _read_time(points, n)
        if t is None:
            t = _read_time(fallback, n)
        return t or 0.0

    def target_time(self, n: int) -> float | None:
        """T(n) at the current speed: the reference time of n if measured, else the
        least-squares line through all measured n; None before any verify pass was timed."""
        times = dict(self._target_ref)
        if self._t1_ref is not None:
            times[1] = self._t1_ref
        if n in times:
            return times[n] * self.speed
        points = sorted(times.items())
        if not points:
            return None
        if len(points) == 1:
            (n0, t0), = points
            return t0 * self.speed * (1 + self.prior_alpha * (n - 1)) / (1 + self.prior_alpha * (n0 - 1))
        intercept, slope = fit_line(points)
        if slope <= 0:  # more positions never cost less; noise can say otherwise
            return max(t for _, t in points) * self.speed
        return max(intercept + slope * n, min(t for _, t in points)) * self.speed

    def t1(self) -> float | None:
        """T_target(1) now, or None until a plain round has been timed."""
        return None if self._t1_ref is None else self._t1_ref * self.speed

    def relative(self, k_max: int) -> tuple[float, list[float]] | None:
        """(c, v) for :func:`speedups`, or None until T_target(1) has been measured."""
        t1 = self.t1()
        if t1 is None or t1 <= 0:
            return None
        verify = [1.0] + [self.target_time(k + 1 + self.extra_positions) / t1 for k in range(1, k_max + 1)]
        # An unmeasured drafter is taken to be free; its first drafting round measures it.
        c = (self.draft_s_per_token or 0.0) / t1
        return c, verify


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
        return req.asked

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
            req.acceptance[i] = _ema(req.acceptance[i], hit, self._weight(req, i))
            req.trials[i] += 1
            self.prior[i] = _ema(self.prior[i], hit, self.prior_weight)
        if 0 < n == a < len(req.acceptance) and not short:
            # Every draft survived, so draft n + 1 was never tried: pull its estimate toward
            # draft n's. Without this, one unlucky rejection deep in the chain would cap k for
            # good, because positions beyond the chosen k are never tested again.
            req.acceptance[n] = _ema(req.acceptance[n], req.acceptance[n - 1], self._weight(req, n))
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
        req.accepted_ema = _ema(req.accepted_ema, accepted, weight)
        req.predicted_ema = _ema(req.predicted_ema, predicted, weight)
        req.tree_rounds += 1
        prior = self.prior_calibration or (accepted, predicted)
        self.prior_calibration = (_ema(prior[0], accepted, self.prior_weight),
                                  _ema(prior[1], predicted, self.prior_weight))

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
