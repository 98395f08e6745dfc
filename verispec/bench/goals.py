"""Goals: the least ratio a benchmark holds a comparison to, given by its caller.

A goal is a setting of the run, not a property of the code: the general harness takes one
``--goal-*`` option per field of :class:`Goals` and the presets take their own ``--goal-*``
options, each defaulting to the goal of the report it reproduces (docs/benchmarks/). A report
records each goal beside its ratio with whether it was met; with no goal it shows the ratio only.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Goals:
    """The least ratio a report holds each comparison to; None: the ratio is shown, not judged."""

    vs_hf_assisted: float | None = field(
        default=None, metadata={"help": "verispec's best speculative method over the best hf:assisted, tok/s"})
    plain_vs_hf_plain: float | None = field(
        default=None, metadata={"help": "verispec plain over hf:plain, tok/s"})
    adaptive_within_best: float | None = field(
        default=None, metadata={"help": "an adaptive drafter's speedup over its family's best fixed k, "
                                        "in every category"})
    adaptive_over_best: float | None = field(
        default=None, metadata={"help": "the same, overall"})
    adaptive_vs_plain: float | None = field(
        default=None, metadata={"help": "an adaptive drafter's speedup over plain, in every category"})


def judged(value: float | None, goal: float | None) -> dict:
    """``goal`` and whether ``value`` meets it (None when either is missing)."""
    return {"goal": goal, "met": None if value is None or goal is None else value >= goal}
