"""The cost model of speculation: the speedup formula and the measured costs it is fed.

All times are relative to one plain decode step, T_target(1). A round that drafts k tokens
commits on average, for a chain whose i-th draft survives with conditional probability p_i
(given that drafts 1..i-1 survived),

    E[tokens](k) = 1 + sum_{i=1..k} prod_{j<=i} p_j          (the 1 is the recovered/bonus token)

and costs k * c + v(k + 1), where c is the cost of drafting one token and v(n) = T_target(n) /
T_target(1) is the cost of a verify pass over n positions (v(1) = 1; a linear fit is
v(n) = 1 + alpha * (n - 1)). The speedup over plain decoding is

    speedup(k) = E[tokens](k) / (k * c + v(k + 1)),     speedup(0) = 1.

:func:`speedups` is that formula, the one place it is written; ``verispec plan`` prints it and
the adaptive controller (:mod:`verispec.speculative.controller`) maximises it every round.

:class:`CostModel` holds the engine-wide measured costs: an exponential moving average (EMA) of
the verify time per number of positions n, a least-squares line through them for the n not
seen yet, an EMA of the drafting time per draft token, and lines for a draft model's catch-up
reads (prompt and resumed tokens) in the tokens missed. Every cost is kept at a reference speed
while one EMA follows the machine's speed, so costs measured minutes apart on a drifting host
stay comparable. Calibration times each cost as a ratio to a decode step run just before it
(:func:`relative_time`). The measurements behind these choices are in docs/design.md.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


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


# ---- the measured costs --------------------------------------------------------------------


def ema(old: float | None, new: float, weight: float) -> float:
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

    The machine's speed drifts (on a shared host, by 40% within minutes), and a cost is measured
    only when a round of its kind runs: T(3) by a round that drafts 2, T(1) by a plain one.
    Ratios of times taken minutes apart (v(3) = T(3) / T(1), the draft cost over T(1)) would
    swing with the drift, and so would the choice of k (docs/design.md). So the model keeps one speed, learned from every verify pass (its time over what that
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
    # kinds. A draft model reads a request's prompt in one pass, as the target's prefill did, and
    # a short prompt costs more per token than a long one, so its cost is a line, as T_target(n)
    # is. Tokens generated while it idled it reads in decode-sized passes (at most 63 tokens
    # each), at several times a long prompt's price per token: priced like a prompt, a return to
    # drafting looks cheaper than it is (figures in docs/design.md).
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
        self.target_s[n] = ema(self.target_s.get(n), seconds, self.weight)
        if n == 1 and self._t1_ref is None:
            self._t1_ref = seconds  # the reference: times before it count as taken at its speed
            return
        ref = self._t1_ref if n == 1 else self._target_ref.get(n)
        if ref is None:  # a width's first time is its shape, at the speed of the moment
            self._target_ref[n] = seconds / self.speed
            return
        self.speed = ema(self.speed, seconds / ref, self.weight)
        if n > 1:
            self._target_ref[n] = ema(ref, seconds / self.speed, self.shape_weight)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        self._draft_ref = ema(self._draft_ref, seconds / tokens / self.speed, self.weight)
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
