"""Batch-aware choice of k, the number of drafts per sequence in one verify pass.

Speculation trades target compute for fewer target passes. At batch size 1 a verify pass over
k + 1 positions costs little more than one position when the target is memory bound; as the
batch grows the pass turns compute bound and each extra row costs close to a full row, so
drafting pays less. The engine therefore asks :func:`choose_k` every step, with costs it has
measured itself. The rule lives in this one function so that a smarter controller can replace
it without touching the engine.

The rule: pick k' in 0..k that maximises the expected committed tokens per second of the
whole batch,

    throughput(k') = B * E(k') / (T(B * (k' + 1)) + B * k' * d)

where ``E(k') = (1 - a^(k'+1)) / (1 - a)`` is the expected tokens a sequence commits per round
with per-draft acceptance rate ``a`` (independent acceptances, bonus included), ``T(M)`` the
measured target forward time over ``M`` rows (a least-squares line through the per-``M``
means), and ``d`` the measured drafting time per draft token. Until two different row counts
have been measured the line is unknown and the full k is used, which also gathers the data.

At batch size 1 the configured k stands: choosing k for a single sequence is the adaptive
controller's job, and ``verispec generate`` keeps doing exactly what its flags say.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from verispec.speculative.cost_model import expected_tokens, fit_line

# Acceptance rate assumed before any draft has been verified.
PRIOR_ACCEPTANCE = 0.7


@dataclass
class StepCosts:
    """Measured costs of the engine's steps, fed by the engine after every round."""

    # rows M in a target forward -> [count, total seconds]
    forward_by_rows: dict[int, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0, 0.0]))
    draft_tokens: int = 0
    draft_time_s: float = 0.0
    accepted_tokens: int = 0

    def record_forward(self, rows: int, seconds: float) -> None:
        entry = self.forward_by_rows[rows]
        entry[0] += 1
        entry[1] += seconds

    def record_proposal(self, num_drafted: int, seconds: float) -> None:
        self.draft_tokens += num_drafted
        self.draft_time_s += seconds

    def record_acceptance(self, num_accepted: int) -> None:
        self.accepted_tokens += num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else PRIOR_ACCEPTANCE

    @property
    def draft_time_per_token(self) -> float:
        return self.draft_time_s / self.draft_tokens if self.draft_tokens else 0.0

    def forward_line(self) -> tuple[float, float] | None:
        """(intercept, slope) of T(M) = intercept + slope * M, or None with < 2 row counts."""
        points = [(m, total / count) for m, (count, total) in self.forward_by_rows.items() if count]
        if len(points) < 2:
            return None
        intercept, slope = fit_line(points)
        return intercept, max(slope, 0.0)


def choose_k(k: int, batch_size: int, costs: StepCosts) -> int:
    """The per-sequence number of drafts for a batch of ``batch_size`` (see the module doc)."""
    line = costs.forward_line()
    if k <= 0 or batch_size == 1 or line is None:
        return k
    intercept, slope = line
    a, d = costs.acceptance_rate, costs.draft_time_per_token

    def throughput(kk: int) -> float:
        step = intercept + slope * batch_size * (kk + 1) + batch_size * kk * d
        return batch_size * expected_tokens([a], kk) / max(step, 1e-9)

    return max(range(k + 1), key=throughput)
