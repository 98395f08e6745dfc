"""``draft_model`` trees: the draft model expands a tree of guesses, depth by depth.

Two shapes:

* **dynamic** (EAGLE-2 style, deterministic top-k children): every expanded node gets the
  ``topk`` most likely draft tokens as children, scored by cumulative draft log-probability;
  the ``topk`` best new nodes of each depth are expanded next, and after ``depth`` levels the
  ``num_draft_tokens`` best nodes overall are kept (a node's score never exceeds its
  parent's, so the kept set contains every kept node's ancestors). The proposal numbers them
  best first and carries each one's path probability (``Proposal.values``), so the adaptive
  controller can verify fewer: the node budget it picks per round (see
  :meth:`verispec.speculative.controller.AdaptiveController.choose_nodes`).
* **static** (a choices list, :meth:`Tree.from_choices`): node shapes fixed in advance; a
  node of rank r is the parent's r-th top token (``topk``) or its r-th draw (sampled).

Sampled children (``iid`` / ``without_replacement``) must use a static shape, because the
exact rule needs each node's children to be the first m draws with m fixed before drawing
(see :mod:`verispec.speculative.tree_verify`); without a choices list the shape is the default
static tree of :func:`default_choices`. Deterministic top-k children are exact at any
temperature with either shape.

Draft cache per round: the committed tokens not yet seen are fed first (the cache then
holds every committed token, ``Lc`` entries); each depth's expanded nodes are fed in one
pass with a tree mask over the cache; afterwards the cache is rolled back to ``Lc`` and the
next round feeds the newly committed tokens.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch

from verispec.sequence import Sequence
from verispec.speculative.base import Outcome, Proposal
from verispec.speculative.draft_model import DraftModelDrafter
from verispec.speculative.tree import Tree
from verispec.sampling import logits_to_probs


def default_choices(depth: int, topk: int, budget: int) -> list[tuple[int, ...]]:
    """A static tree: the ``budget`` rank paths (ranks < topk, length <= depth) with the
    highest prior score, the product of 1 / (rank + 1) along the path (ties: shorter first).

    Example, depth 2, topk 2, budget 4: (0,) (0, 0) (1,) (0, 1).
    """
    heap = [(-1.0 / (r + 1), 1, (r,)) for r in range(topk)]
    heapq.heapify(heap)
    out: list[tuple[int, ...]] = []
    while heap and len(out) < budget:
        neg, _, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < depth:
            for r in range(topk):
                heapq.heappush(heap, (neg / (r + 1), len(path) + 1, path + (r,)))
    return out


@dataclass
class _Node:
    token: int
    parent: int  # index into the node list; 0 is the root
    score: float = 0.0  # cumulative draft log-probability
    q: torch.Tensor | None = None  # the parent's distribution this node was drawn from
    cache_path: list[int] = field(default_factory=list)  # draft cache indices of fed ancestors + self


class TreeDraftModelDrafter(DraftModelDrafter):
    stops_within_round = False  # a tree's breadth is priced by the node budget instead

    def __init__(self, draft, target_vocab: int, max_model_len: int, *, topk: int, budget: int,
                 children: str = "topk", choices: tuple[tuple[int, ...], ...] | None = None,
                 depth: int = 4, num_slots: int = 1, draft_vocab_size: int | None = None,
                 draft_head_quantization: str | None = None) -> None:
        super().__init__(draft, target_vocab, max_model_len, num_slots, draft_vocab_size, draft_head_quantization)
        if children != "topk" and choices is None:
            choices = tuple(default_choices(depth, topk, budget))
        self.topk, self.budget, self.children = topk, budget, children
        self.static = Tree.from_choices(choices) if choices is not None else None

    def propose(self, seq: Sequence, k: int) -> Proposal:
        self.catch_up(seq)
        ids = seq.token_ids
        root_logits = self._forward(seq.slot, ids[self.cache.length(seq.slot):])  # [V]
        start = self.cache.length(seq.slot)  # == len(ids): the root's K/V is cached
        self._round_start[seq.slot] = (start, 0)
        budget = min(self.budget, self.cache.max_len - start)
        nodes = [_Node(ids[-1], -1)]
        if self.static is None:
            self._expand_dynamic(seq, nodes, root_logits, k)
            # Numbered best first: a node never scores above its parent, so every prefix is a tree.
            keep = sorted(range(1, len(nodes)), key=lambda i: (-nodes[i].score, i))[:budget]
            values = tuple(math.exp(nodes[i].score) for i in keep)
        else:
            self._expand_static(seq, nodes, root_logits, k, budget)
            keep, values = list(range(1, len(nodes))), None
        return self._proposal(nodes, keep, values)

    def feedback(self, seq: Sequence, outcome: Outcome) -> None:
        round_start = self._round_start.pop(seq.slot, None)
        if round_start is not None:
            self.cache.truncate(seq.slot, round_start[0])

    # ---- expansion ---------------------------------------------------------------------------

    def _dist(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
        """The distribution children come from: q at T > 0; the draft's softmax at T = 0."""
        p = seq.params
        if p.greedy:
            return torch.softmax(logits.float(), dim=-1)
        return logits_to_probs(logits, p.temperature, p.top_k, p.top_p, p.min_p)

    def _expand_dynamic(self, seq: Sequence, nodes: list[_Node], root_logits: torch.Tensor, depth: int) -> None:
        frontier, logits = [0], root_logits[None]  # [F, V]
        for d in range(1, depth + 1):
            new: list[int] = []
            for parent, row in zip(frontier, logits):
                q = self._dist(seq, row)
                top = torch.topk(q, self.topk)
                for prob, tok in zip(top.values.tolist(), top.indices.tolist()):
                    if prob > 0:
                        nodes.append(_Node(tok, parent, nodes[parent].score + math.log(prob)))
                        new.append(len(nodes) - 1)
            frontier = sorted(new, key=lambda i: (-nodes[i].score, i))[: self.topk]
            if d == depth or not self._room(seq.slot, len(frontier)):
                return
            logits = self._feed(seq.slot, nodes, frontier)

    def _expand_static(self, seq: Sequence, nodes: list[_Node], root_logits: torch.Tensor, depth: int,
                       budget: int) -> None:
        tree = self.static
        allowed = [i for i in range(1, len(tree)) if tree.depths[i] <= depth][:budget]
        static_to_node = {0: 0}
        level, logits = [0], root_logits[None]
        while level:
            nxt = []
            for s, row in zip(level, logits):
                kids = [c for c in tree.children[s] if c in allowed]
                if not kids:
                    continue
                q = self._dist(seq, row)
                for c, tok in zip(kids, self._pick(seq, q, [tree.ranks[c] for c in kids])):
                    nodes.append(_Node(tok, static_to_node[s], q=q))
                    static_to_node[c] = len(nodes) - 1
                    nxt.append(c)
            level = [s for s in nxt if any(c in allowed for c in tree.children[s])]
            if not self._room(seq.slot, len(level)):  # near the end of the context: stop growing
                return
            if level:
                logits = self._feed(seq.slot, nodes, [static_to_node[s] for s in level])

    def _pick(self, seq: Sequence, q: torch.Tensor, ranks: list[int]) -> list[int]:
        """Child tokens for the given ranks: top-k ranks, or the rank-th draw from q."""
        m = max(ranks) + 1
        if self.children == "topk":
            order = torch.topk(q, m).indices
        elif self.children == "iid":
            order = torch.multinomial(q, m, replacement=True, generator=seq.generator)
        else:  # without replacement: sequential draws, via Gumbel top-k on the support
            u = torch.rand(q.shape, generator=seq.generator, device=q.device).clamp_min(1e-20)
            keys = torch.where(q > 0, q.log() - (-u.log()).log(), torch.full_like(q, -math.inf))
            order = torch.topk(keys, min(m, int((q > 0).sum()))).indices
        order = order.tolist()
        return [order[r] for r in ranks if r < len(order)]

    def _room(self, slot: int, n: int) -> bool:
        return self.cache.length(slot) + n <= self.cache.max_len

    def _feed(self, slot: int, nodes: list[_Node], feed: list[int]) -> torch.Tensor:
        """Run ``feed`` nodes through the draft with a tree mask; return their logits [F, V]."""
        start = self.cache.length(slot)
        device = self.model.device
        mask = torch.zeros(1, len(feed), start + len(feed), dtype=torch.bool, device=device)
        root_len = self._round_start[slot][0]
        mask[..., :root_len] = True
        positions = []
        for row, i in enumerate(feed):
            nodes[i].cache_path = nodes[nodes[i].parent].cache_path + [start + row]
            mask[0, row, nodes[i].cache_path] = True
            positions.append(root_len - 1 + len(nodes[i].cache_path))
        ids = torch.tensor([[nodes[i].token for i in feed]], device=device)
        logits = self.model(ids, torch.tensor([positions], device=device), self.cache, attn_mask=mask,
                            slots=[slot], head=self.vocab)[0]  # [F, V_draft] (or [F, V_kept])
        return self._align_vocab(logits)

    def _proposal(self, nodes: list[_Node], keep: list[int], values: tuple[float, ...] | None) -> Proposal:
        """The kept nodes, numbered in ``keep``'s order (every parent before its children)."""
        renumber = {0: 0, **{old: new for new, old in enumerate(keep, start=1)}}
        q = None if self.children == "topk" else torch.stack([nodes[i].q for i in keep])
        return Proposal([nodes[i].token for i in keep], q, tuple(renumber[nodes[i].parent] for i in keep),
                        self.children, values=values)
