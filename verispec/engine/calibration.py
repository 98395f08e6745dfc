"""Warm cost measurements that seed an adaptive controller when its engine is built.

An adaptive controller decides from measured costs, and the first run of each shape pays
one-time set-up (kernel primitives, allocation), often half as much again as a warm run; a
controller that learned those first samples would price drafting out and, never drafting again,
never measure it anew. So an engine that builds an
:class:`~verispec.speculative.controller.AdaptiveController` runs each verify width 1..k+1 on a
scratch slot (one cold run, then the median of three), and the drafter's own
:meth:`~verispec.speculative.base.Drafter.calibrate`, and seeds the cost model with the warm
timings. Each time but the decode step's own is taken as a ratio to a decode step run just
before it (:func:`~verispec.speculative.cost_model.relative_time`), since a machine's speed
drifts within seconds and the controller decides on ratios (v(n), the draft cost c). Rounds then
refine them as usual. The measurements behind this are in docs/design.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from verispec.speculative.cost_model import CostModel, relative_time, warm_seconds

if TYPE_CHECKING:
    from verispec.models.decoder import Decoder
    from verispec.models.kv_cache import KVCache
    from verispec.speculative.base import Drafter

CALIBRATION_CONTEXT = 32  # dummy tokens in the scratch slot's cache before the timed passes


def calibrate(model: Decoder, cache: KVCache, slot: int, k: int, max_model_len: int,
              drafter: Drafter | None, costs: CostModel) -> None:
    """Seed ``costs`` with warm timings of every verify width 1..k+1 of ``model`` and the
    drafter's costs, on the free cache ``slot``, which is left empty."""
    device = model.device
    context = min(CALIBRATION_CONTEXT, max_model_len - k - 2)
    token = 0  # any id: only the time matters
    if context < 1:
        return  # no room for a scratch context: the rounds measure everything
    cache.reset(slot)
    ids = torch.full((1, context), token, device=device)
    model(ids, torch.arange(context, device=device)[None], cache, slots=[slot], num_logits=1, prefill=True)

    def verify(n: int) -> None:
        model(torch.full((1, n), token, device=device),
              torch.arange(context, context + n, device=device)[None], cache, slots=[slot])
        cache.truncate(slot, context)

    def step() -> None:
        verify(1)

    t1 = warm_seconds(step)
    costs.observe_target(1, t1)
    for n in range(2, k + 2):
        costs.observe_target(n, t1 * relative_time(lambda: verify(n), step))
    drafted = None if drafter is None else drafter.calibrate(slot, token, step)  # in decode steps
    if drafted is not None:
        costs.observe_draft(1, drafted.draft_step * t1)
        for missed, steps in drafted.resumes:
            costs.observe_catch_up(missed, 0, steps * t1)
        for missed, steps in drafted.reads:
            costs.observe_catch_up(missed, 0, steps * t1, prompt=missed)
    cache.reset(slot)
