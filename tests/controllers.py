"""Controllers for tests: choices no real controller would make, to show that none of them can
change what verification outputs."""

from __future__ import annotations

import random

from verispec.speculative.controller import AdaptiveController, FixedK


class RandomBudget(FixedK):
    """Drafts the deepest tree allowed, then verifies a random number of its best nodes
    (``kept`` records each choice as (kept, drafted))."""

    def __init__(self, seed: int) -> None:
        self.rng, self.kept = random.Random(seed), []

    def choose_nodes(self, seq, values, draft_s) -> int:
        m = self.rng.randint(1, len(values))
        self.kept.append((m, len(values)))
        return m


class AlwaysDrafts(AdaptiveController):
    """An adaptive controller (so the engine hands a drafter its cost model) that drafts the
    most allowed every round, whatever the costs say."""

    def choose_k(self, seq, k_max: int) -> int:
        return k_max
