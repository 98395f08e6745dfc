"""Speculative decoding metrics: one owner, per request and aggregated.

Conventions (the same as vLLM and llama.cpp):

* **acceptance rate** = accepted draft tokens / proposed draft tokens.
* **mean acceptance length** = tokens committed per verification round, *including* the
  recovered-or-bonus token the target always contributes. Plain decoding scores exactly 1.0;
  k drafts can score at most k + 1.
* **per-position acceptance** [i] = P(draft i accepted | draft i was proposed), i = 0..k-1.
* **c** = (drafting time per round / tokens proposed that round) / T_target(1): the cost of one
  draft token in units of one plain target decode step. A draft model's catching up (reading
  the prompt in its first round, or tokens committed while it did not draft) is left out of c
  and counted apart in ``catch_up_time_s``: it grows with the prompt, not with the drafts, and
  the adaptive controller prices it apart too.
* **tree rounds**: for a tree proposal, "proposed" counts every tree node (so per-position
  acceptance [i] is the fraction of tree rounds that accepted more than i tokens);
  ``accepted_depth_counts[d]`` counts tree rounds whose accepted path had depth d, and
  ``tree_nodes`` sums the trees' draft nodes.
* **alpha** = (T_target(n) - T_target(1)) / ((n - 1) * T_target(1)): the extra cost of each
  additional position in a verify pass, from a least-squares line through the measured
  T_target(n) for all n seen.

The CLI's ``--stats``, the benchmarks and (later) the server's ``/metrics`` read this object.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, fields


@dataclass
class SpecMetrics:
    num_rounds: int = 0  # verification rounds (a plain decode step is a round with 0 drafts)
    num_drafts: int = 0  # rounds that proposed at least one token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_committed_tokens: int = 0  # tokens emitted by rounds (accepted + recovered/bonus)
    proposed_at: list[int] = field(default_factory=list)  # [k_max] drafts proposed at position i
    accepted_at: list[int] = field(default_factory=list)  # [k_max] drafts accepted at position i
    draft_time_s: float = 0.0
    catch_up_time_s: float = 0.0  # of draft_time_s: a draft model reading what it had not seen, its prompt included
    verify_time_s: float = 0.0
    other_time_s: float = 0.0
    prefill_time_s: float = 0.0
    cached_prompt_tokens: int = 0  # prompt positions whose K/V an earlier request left (prefix caching)
    tree_rounds: int = 0
    tree_nodes: int = 0
    accepted_depth_counts: list[int] = field(default_factory=list)  # [max depth + 1]
    # n new positions -> [count, total seconds] of target forwards
    target_time_by_n: dict[int, list[float]] = field(default_factory=lambda: defaultdict(lambda: [0, 0.0]))

    def record_round(self, num_proposed: int, num_accepted: int, num_committed: int) -> None:
        self.num_rounds += 1
        self.num_committed_tokens += num_committed
        if num_proposed == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        grow = num_proposed - len(self.proposed_at)
        if grow > 0:
            self.proposed_at.extend([0] * grow)
            self.accepted_at.extend([0] * grow)
        for i in range(num_proposed):
            self.proposed_at[i] += 1
            if i < num_accepted:
                self.accepted_at[i] += 1

    def record_tree(self, num_nodes: int, accepted_depth: int) -> None:
        self.tree_rounds += 1
        self.tree_nodes += num_nodes
        self.accepted_depth_counts.extend([0] * (accepted_depth + 1 - len(self.accepted_depth_counts)))
        self.accepted_depth_counts[accepted_depth] += 1

    def record_target(self, num_positions: int, seconds: float) -> None:
        slot = self.target_time_by_n[num_positions]
        slot[0] += 1
        slot[1] += seconds

    def merge(self, other: SpecMetrics) -> None:
        """Add another request's counters into this (aggregate) object."""
        for name in ("num_rounds", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
                     "num_committed_tokens", "draft_time_s", "catch_up_time_s", "verify_time_s", "other_time_s",
                     "prefill_time_s", "cached_prompt_tokens", "tree_rounds", "tree_nodes"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.proposed_at, other.proposed_at), (self.accepted_at, other.accepted_at),
                             (self.accepted_depth_counts, other.accepted_depth_counts)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v
        for n, (count, total) in other.target_time_by_n.items():
            self.target_time_by_n[n][0] += count
            self.target_time_by_n[n][1] += total

    def to_dict(self) -> dict:
        """The counters as JSON-ready data (:meth:`from_dict` reads them back)."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["target_time_by_n"] = {str(n): list(v) for n, v in self.target_time_by_n.items()}
        return data

    @classmethod
    def from_dict(cls, data: dict) -> SpecMetrics:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown metrics fields: {sorted(unknown)}")
        metrics = cls(**{k: v for k, v in data.items() if k != "target_time_by_n"})
        for n, (count, total) in data.get("target_time_by_n", {}).items():
            metrics.target_time_by_n[int(n)] = [count, total]
        return metrics

    # ---- derived figures -------------------------------------------------------------------

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return self.num_committed_tokens / self.num_rounds if self.num_rounds else None

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted_at, self.proposed_at)]

    def target_step_time(self, n: int) -> float | None:
        count, total = self.target_time_by_n.get(n, (0, 0.0))
        return total / count if count else None

    def cost_model(self, t1: float | None = None) -> tuple[float | None, float | None, float | None]:
        """Return (T_target(1), c, alpha), or None where the data cannot tell.

        ``t1`` overrides T_target(1) with a measurement from elsewhere (a plain-decoding run in
        the same process); otherwise it comes from a least-squares line through T_target(n).
        """
        points = [(n, total / count) for n, (count, total) in self.target_time_by_n.items() if count]
        slope = intercept = None
        if len(points) >= 2:
            mean_n = sum(n for n, _ in points) / len(points)
            mean_t = sum(t for _, t in points) / len(points)
            var = sum((n - mean_n) ** 2 for n, _ in points)
            slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / var
            intercept = mean_t - slope * mean_n
        if t1 is None:
            t1 = self.target_step_time(1) or (intercept + slope if slope is not None else None)
        if t1 is None or t1 <= 0:
            return None, None, None
        drafting = self.draft_time_s - self.catch_up_time_s  # catching up is a cost of its own
        c = drafting / self.num_draft_tokens / t1 if self.num_draft_tokens else None
        if slope is None:
            # One verify width n plus the given t1: alpha from the two points.
            wide = [(n, t) for n, t in points if n > 1]
            slope = (wide[0][1] - t1) / (wide[0][0] - 1) if wide else None
        alpha = slope / t1 if slope is not None else None
        return t1, c, alpha

    def summary(self, t1: float | None = None) -> dict:
        t1_, c, alpha = self.cost_model(t1)
        return {
            "rounds": self.num_rounds,
            "drafts": self.num_drafts,
            "draft_tokens": self.num_draft_tokens,
            "accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "per_position_acceptance": self.per_position_acceptance,
            "mean_tree_size": self.tree_nodes / self.tree_rounds if self.tree_rounds else None,
            "accepted_depth_counts": self.accepted_depth_counts,
            "prefill_time_s": self.prefill_time_s,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "draft_time_s": self.draft_time_s,
            "catch_up_time_s": self.catch_up_time_s,
            "verify_time_s": self.verify_time_s,
            "other_time_s": self.other_time_s,
            "target_step_time_s": t1_,
            "c": c,
            "alpha": alpha,
        }

    def format(self, t1: float | None = None) -> str:
        s = self.summary(t1)

        def f(v: float | None, spec: str = ".3f") -> str:
            return "n/a" if v is None else format(v, spec)

        pos = " ".join(f"{a:.2f}" for a in s["per_position_acceptance"]) or "n/a"
        tree = [] if not self.tree_rounds else [
            f"tree: {self.tree_rounds} rounds, mean size {s['mean_tree_size']:.1f} nodes, "
            f"accepted depth counts {self.accepted_depth_counts}"
        ]
        return "\n".join([
            f"rounds {s['rounds']}, drafts {s['drafts']}, draft tokens {s['draft_tokens']}, "
            f"accepted {s['accepted_tokens']}",
            f"acceptance rate {f(s['acceptance_rate'])}, mean acceptance length "
            f"{f(s['mean_acceptance_length'], '.2f')} (bonus included)",
            f"per-position acceptance: {pos}",
            f"time: prefill {s['prefill_time_s']:.2f}s"
            f"{f' ({self.cached_prompt_tokens} prompt tokens cached)' if self.cached_prompt_tokens else ''}, "
            f"draft {s['draft_time_s']:.2f}s "
            f"(catching up {s['catch_up_time_s']:.2f}s), "
            f"verify {s['verify_time_s']:.2f}s, other {s['other_time_s']:.2f}s",
            f"cost model: T_target(1) {f(s['target_step_time_s'] and s['target_step_time_s'] * 1e3, '.1f')} ms, "
            f"c {f(s['c'])}, alpha {f(s['alpha'])}",
        ] + tree)
