"""``verispec plan``: the speedup arithmetic of :mod:`verispec.speculative.cost_model` as a tool.

Given an acceptance rate (or per-position rates), the draft cost ratio c and the verify overhead
alpha, it tabulates for every number of drafts N the expected tokens per round, the round cost
and the speedup over plain decoding, and names the best N. With perfect acceptance and a free
drafter the speedup tends to 1/alpha; with a drafter of cost c, to 1/(alpha + c).

``--measure`` fills alpha and c by timing this machine instead: the target's forward pass over
n = 1..9 new positions after a fixed context (alpha from a least-squares line through the
times), and the draft model's single-position step (c = T_draft(1) / T_target(1)). At batch size
B every forward runs B rows, so the figures are those of a B-request batch; without
``--measure``, B rescales alpha by :func:`~verispec.speculative.cost_model.alpha_at_batch`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from verispec.speculative.cost_model import alpha_at_batch, expected_tokens, fit_line, linear_verify_cost, speedups

if TYPE_CHECKING:
    from verispec.models.decoder import Decoder

PLOT_RATES = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
MEASURE_CONTEXT = 128  # positions already in the cache when timing a step
MEASURE_WIDTHS = range(1, 10)  # n = 1..9 new positions: enough to draw the line for k <= 8


@dataclass(frozen=True)
class Plan:
    acceptance: list[float]
    draft_cost: float  # c
    alpha: float  # at the planned batch size
    rows: list[tuple[int, float, float, float]]  # (N, E[tokens], round cost, speedup)

    @property
    def best(self) -> tuple[int, float, float, float]:
        return max(self.rows, key=lambda r: r[3])

    @property
    def ceiling(self) -> float:
        return 1.0 / self.alpha if self.alpha > 0 else float("inf")


def make_plan(acceptance: list[float], draft_cost: float, alpha: float, max_n: int, batch_size: int = 1) -> Plan:
    if max_n < 1:
        raise ValueError(f"max N must be >= 1, got {max_n}")
    alpha_b = alpha_at_batch(alpha, batch_size)
    verify = linear_verify_cost(alpha_b, max_n)
    gains = speedups(acceptance, draft_cost, verify)
    rows = [(n, expected_tokens(acceptance, n), n * draft_cost + verify[n], gains[n]) for n in range(max_n + 1)]
    return Plan(list(acceptance), draft_cost, alpha_b, rows)


def format_plan(plan: Plan) -> str:
    rates = ", ".join(f"{p:g}" for p in plan.acceptance)
    lines = [f"acceptance {rates}; draft cost c = {plan.draft_cost:.3f}; alpha = {plan.alpha:.3f}",
             "", "  N   E[tokens/round]   round cost   speedup"]
    for n, tokens, cost, gain in plan.rows:
        lines.append(f"{n:3d}   {tokens:15.3f}   {cost:10.3f}   {gain:6.3f}x")
    n, _, _, gain = plan.best
    verdict = "speculation does not pay: decode plainly" if n == 0 else f"draft {n} tokens per round"
    limit = 1.0 / (plan.alpha + plan.draft_cost) if plan.alpha + plan.draft_cost > 0 else float("inf")
    lines += ["", f"optimal N = {n} ({gain:.3f}x): {verdict}",
              f"ceiling as acceptance -> 1: 1/alpha = {plan.ceiling:.2f}x "
              f"(1/(alpha + c) = {limit:.2f}x with this drafter)"]
    return "\n".join(lines)


def plot_plan(plan: Plan, path: Path) -> None:
    """Speedup against N for several acceptance rates (and the planned one)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    max_n = plan.rows[-1][0]
    rates = sorted(set(PLOT_RATES) | ({plan.acceptance[0]} if len(plan.acceptance) == 1 else set()))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in rates:
        curve = make_plan([p], plan.draft_cost, plan.alpha, max_n).rows
        ax.plot([r[0] for r in curve], [r[3] for r in curve], marker="o", markersize=3, label=f"p = {p:g}")
    if len(plan.acceptance) > 1:
        ax.plot([r[0] for r in plan.rows], [r[3] for r in plan.rows], "k--", label="given per-position p")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("N, drafts per round")
    ax.set_ylabel("expected speedup over plain decoding")
    ax.set_title(f"c = {plan.draft_cost:.2f}, alpha = {plan.alpha:.2f} (ceiling {plan.ceiling:.1f}x)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- measuring this machine ----------------------------------------------------------------


def step_times(model: Decoder, widths: range, batch_size: int, repeats: int) -> dict[int, float]:
    """Median seconds of a forward over n new positions per row, for each n in ``widths``."""
    device = model.device
    context = MEASURE_CONTEXT
    cache = model.new_cache(context + max(widths), num_slots=batch_size)
    slots = list(range(batch_size))
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = torch.randint(vocab, (batch_size, context), generator=gen).to(device)  # [B, context]
    positions = torch.arange(context, device=device).expand(batch_size, -1)  # [B, context]
    with torch.inference_mode():
        model(ids, positions, cache, slots=slots, num_logits=1, prefill=True)  # the context, as the engine reads a prompt
        times: dict[int, float] = {}
        for n in widths:
            new = torch.randint(vocab, (batch_size, n), generator=gen).to(device)  # [B, n]
            pos = torch.arange(context, context + n, device=device).expand(batch_size, -1)  # [B, n]
            samples = []
            for _ in range(repeats + 1):  # the first run warms up
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                model(new, pos, cache, slots=slots)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                samples.append(time.perf_counter() - t0)
                for slot in slots:
                    cache.truncate(slot, context)
            times[n] = statistics.median(samples[1:])
    return times


def fit_alpha(times: dict[int, float]) -> float:
    """Slope of the least-squares line through T(n), over T(1)."""
    _, slope = fit_line(sorted(times.items()))
    return max(slope, 0.0) / times[1]


def measure(target: Decoder, draft: Decoder | None, batch_size: int,
            repeats: int = 5) -> tuple[float, float | None, dict]:
    """(alpha, c or None without a draft, the raw step times in seconds)."""
    target_times = step_times(target, MEASURE_WIDTHS, batch_size, repeats)
    alpha = fit_alpha(target_times)
    c = None
    draft_t1 = None
    if draft is not None:
        draft_t1 = step_times(draft, range(1, 2), batch_size, repeats)[1]
        c = draft_t1 / target_times[1]
    return alpha, c, {"target_s": target_times, "draft_s": draft_t1}
