"""Speedups counted in each run's own decode steps, and the drift figure, on made-up runs.

A plain run at 100 ms a step and a prompt-lookup run of the same question while the machine ran
1.4x slower: end to end the lookup run looks 0.79x plain; in its own steps it took 90 where
plain took 100 (1.11x). A draft model drafting every round measures no one-position step, so it
gets no adjusted figure rather than a wrong one.
"""

from __future__ import annotations

import pytest

from verispec.bench.methods import TurnResult
from verispec.bench.report import aggregate, drift
from verispec.bench.runner import Run
from verispec.metrics import SpecMetrics


def run(method: str, total_s: float, one_position_rounds: int, t1: float, question: str = "1") -> Run:
    metrics = SpecMetrics()
    if one_position_rounds:
        metrics.target_time_by_n[1] = [one_position_rounds, one_position_rounds * t1]
    metrics.target_time_by_n[3] = [20, 20 * 1.3 * t1]
    return Run(method, question, "writing", 0, 0, 0, 10, TurnResult(list(range(100)), total_s, 0.5, "length", metrics))


def test_speed_adjusted_speedup_counts_each_run_in_its_own_decode_steps():
    runs = [run("plain", 10.0, 99, 0.1), run("ngram", 12.6, 60, 0.14), run("draft", 9.0, 0, 0.1)]
    results = aggregate(runs, [None, None, None], ["plain", "ngram", "draft"], ["writing"])
    ngram, draft = results["ngram"]["writing"], results["draft"]["writing"]
    assert ngram["speedup"] == pytest.approx(10.0 / 12.6)
    assert ngram["speed_adjusted_speedup"] == pytest.approx(100 / 90)
    assert results["plain"]["writing"]["speed_adjusted_speedup"] == 1.0
    assert draft["speedup"] == pytest.approx(10.0 / 9.0) and draft["speed_adjusted_speedup"] is None
    assert drift(runs) == {"blocks": 1, "t1_spread_median": pytest.approx(1.4), "t1_spread_max": pytest.approx(1.4)}


def test_drift_needs_enough_one_position_rounds_and_two_runs_per_block():
    runs = [run("plain", 10.0, 99, 0.1), run("ngram", 12.0, 4, 0.2), run("plain", 10.0, 99, 0.1, question="2")]
    assert drift(runs) == {"blocks": 0, "t1_spread_median": None, "t1_spread_max": None}
