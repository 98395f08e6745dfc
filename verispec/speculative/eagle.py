"""``eagle`` (alias ``eagle3``): an EAGLE-3 head drafts from the target's own features.

The head (:mod:`verispec.speculative.eagle_head`) is one decoder layer that pairs the target's
hidden states at position t with the token x_{t+1} and predicts x_{t+2}; to draft further, its
output state stands in for the target features it does not have. Here it runs over its own KV
cache: one entry per committed position, computed from the target's real features, then the
round's drafts, which are dropped afterwards (a length move, as in the target's cache).

**Proposals.** Chain: token j is q_j's argmax at T = 0, else a draw from q_j after the
request's sampling transforms over the target vocabulary (``Proposal.probs``). Dynamic tree
(EAGLE-2; ``speculative_eagle_topk`` > 1): every expanded node gets the top-k tokens of its q as
children, the ``topk`` best nodes of each depth (by path probability) are expanded next, each
fed with its parent's output state under a tree mask, and the ``num_draft_tokens`` best nodes
overall are kept, best first, with their values. Children are deterministic top-k, which is
exact at any temperature.

**Per-sequence state.** After the target's prefill the head reads every prompt pair
(``seq.target_hidden`` row i with token i + 1); after each round, the pairs of the committed
tokens (the features of their inputs come with the verify pass: no extra target pass). Those
pairs are fed at the start of the next ``propose``, so their cost counts as drafting.

A head comes from a checkpoint in either public layout (SpecForge, vLLM ``speculators``); with
``quantization`` auto or int8 its linear layers run on the native kernels as Q8_0.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.sequence import Sequence
from verispec.models.decoder import grouped_attention
from verispec.models.kv_cache import KVCache
from verispec.sampling import logits_to_probs
from verispec.speculative.base import Drafter, DrafterContext, Outcome, Proposal
from verispec.speculative.eagle_head import Eagle3Head, load_eagle, quantize_head_


@dataclass
class _Node:
    token: int
    parent: int
    score: float = 0.0  # log path probability
    out: Tensor | None = None  # the head's output state after this node was fed [H]
    cache_path: tuple[int, ...] = ()  # cache indices of the fed ancestors and self


class EagleDrafter(Drafter):
    """Chain or dynamic-tree proposals from an :class:`Eagle3Head` (module doc)."""

    def __init__(self, head: Eagle3Head, target_embed: Callable[[Tensor], Tensor], max_len: int,
                 num_slots: int = 1, *, topk: int = 1, budget: int | None = None) -> None:
        self.head = head.eval().requires_grad_(False)
        self.hidden_layers = head.config.aux_layers
        self.embed = head.embed if head.embed is not None else target_embed
        self.topk, self.budget = topk, budget
        c = head.config
        self.cache = KVCache(1, num_slots, c.num_kv_heads, c.head_dim, max_len + 64, dtype=torch.float32,
                             device=head.norm.weight.device)
        self._pending: dict[int, tuple[Tensor, list[int]]] = {}  # slot -> target features [n, F], tokens
        self._committed: dict[int, int] = {}  # slot -> cache entries from target features
        self._last: dict[int, tuple[Tensor, Tensor]] = {}  # slot -> (draft logits [Vd], output state [H])

    # ---- the drafter protocol ----------------------------------------------------------------

    def start(self, seq: Sequence) -> None:
        self.cache.reset(seq.slot)
        self._committed[seq.slot] = 0
        self._pending.pop(seq.slot, None)
        self._stash(seq)

    def feedback(self, seq: Sequence, outcome: Outcome) -> None:
        self.cache.truncate(seq.slot, self._committed[seq.slot])
        self._stash(seq)

    def finish(self, seq: Sequence) -> None:
        for state in (self._pending, self._committed, self._last):
            state.pop(seq.slot, None)

    def _stash(self, seq: Sequence) -> None:
        """Queue the new pairs; a round without drafts (the controller's plain rounds) adds to
        the queue rather than replacing it, so no committed position is ever skipped."""
        feats = seq.target_hidden  # [n, F]: row i is the input whose logits gave the i-th new token
        tokens = seq.token_ids[-len(feats):]
        queued = self._pending.get(seq.slot)
        if queued is not None:
            feats, tokens = torch.cat([queued[0], feats]), queued[1] + tokens
        self._pending[seq.slot] = (feats, tokens)

    @torch.inference_mode()
    def propose(self, seq: Sequence, k: int) -> Proposal:
        slot = seq.slot
        pending = self._pending.pop(slot, None)
        if pending is not None:
            feats, tokens = pending
            start = self._committed[slot]
            hidden = self.head.fc(feats.float())[None]  # [1, n, H]
            out = self._feed(slot, tokens, hidden, list(range(start, start + len(tokens))))
            self._committed[slot] = self.cache.length(slot)
            self._last[slot] = (self.head.logits(out[0, -1]), out[0, -1])
        k = min(k, self.cache.max_len - self.cache.length(slot))
        if k < 1:
            return Proposal([])
        if self.topk > 1:
            return self._tree(seq, k)
        return self._chain(seq, k)

    # ---- the head over its cache ------------------------------------------------------------

    def _feed(self, slot: int, tokens: list[int], hidden: Tensor, positions: list[int],
              mask: Tensor | None = None) -> Tensor:
        """Run the head on ``tokens`` with ``hidden`` ``[1, T, H]`` at ``positions``, appending to
        the slot's cache; ``mask`` ``[T, S]`` over cache indices (default causal). Returns the
        output states ``[1, T, H]``."""
        device = hidden.device
        ids = torch.tensor([tokens], device=device)
        q, k, v, residual = self.head.qkv(self.embed(ids).float(), hidden,
                                          torch.tensor([positions], device=device))
        start, t = self.cache.length(slot), len(tokens)
        self.cache.check_room([slot], t)
        self.cache.write(0, [slot], k, v)
        self.cache.advance([slot], t)
        keys, values = self.cache.view(0, [slot], start + t)
        if mask is None:
            mask = torch.arange(start + t, device=device)[None] <= torch.arange(start, start + t, device=device)[:, None]
        attn = grouped_attention(q, keys, values, mask[None, None])
        return self.head.finish(attn, residual)

    def _dist(self, seq: Sequence, draft_logits: Tensor) -> Tensor:
        """q over the target vocabulary: the request's sampling transform; at T = 0 the softmax
        (for tree values)."""
        logits = self.head.target_logits(draft_logits)
        p = seq.params
        if p.greedy:
            return torch.softmax(logits.float(), dim=-1)
        return logits_to_probs(logits[None], p.temperature, p.top_k, p.top_p, p.min_p)[0]

    def _chain(self, seq: Sequence, k: int) -> Proposal:
        slot = seq.slot
        logits, out = self._last[slot]
        base = self._committed[slot]
        tokens: list[int] = []
        qs: list[Tensor] = []
        for j in range(k):
            if seq.params.greedy:
                token = int(self.head.target_ids(logits.argmax()))
            else:
                q = self._dist(seq, logits)
                qs.append(q)
                token = int(torch.multinomial(q, 1, generator=seq.generator))
            tokens.append(token)
            if j + 1 < k:
                out = self._feed(slot, [token], out[None, None], [base + j])[0, 0]
                logits = self.head.logits(out)
        return Proposal(tokens, torch.stack(qs) if qs else None)

    def _tree(self, seq: Sequence, depth: int) -> Proposal:
        slot = seq.slot
        root_logits, root_out = self._last[slot]
        base = self._committed[slot]
        nodes = [_Node(seq.token_ids[-1], -1, out=root_out)]
        frontier, rows = [0], [root_logits]
        for d in range(1, depth + 1):
            new: list[int] = []
            for parent, row in zip(frontier, rows):
                top = torch.topk(self._dist(seq, row), self.topk)
                for prob, tok in zip(top.values.tolist(), top.indices.tolist()):
                    if prob > 0:
                        nodes.append(_Node(tok, parent, nodes[parent].score + math.log(prob)))
                        new.append(len(nodes) - 1)
            frontier = heapq.nsmallest(self.topk, new, key=lambda i: (-nodes[i].score, i))
            if d == depth or self.cache.length(slot) + len(frontier) > self.cache.max_len:
                break
            rows = self._feed_nodes(slot, nodes, frontier, base + d - 1)
        budget = self.budget or depth * self.topk
        keep = sorted(range(1, len(nodes)), key=lambda i: (-nodes[i].score, i))[:budget]
        renumber = {0: 0, **{old: new for new, old in enumerate(keep, start=1)}}
        return Proposal([nodes[i].token for i in keep], None, tuple(renumber[nodes[i].parent] for i in keep),
                        "topk", values=tuple(math.exp(nodes[i].score) for i in keep))

    def _feed_nodes(self, slot: int, nodes: list[_Node], feed: list[int], position: int) -> list[Tensor]:
        """Feed one depth's expanded nodes, each with its parent's output state, each attending
        to the committed cache and its own ancestors; returns their draft logits."""
        start = self.cache.length(slot)
        mask = torch.zeros(len(feed), start + len(feed), dtype=torch.bool, device=self.cache.device)
        mask[:, : self._committed[slot]] = True
        for row, i in enumerate(feed):
            nodes[i].cache_path = nodes[nodes[i].parent].cache_path + (start + row,)
            mask[row, list(nodes[i].cache_path)] = True
        hidden = torch.stack([nodes[nodes[i].parent].out for i in feed])[None]  # [1, F, H]
        out = self._feed(slot, [nodes[i].token for i in feed], hidden, [position] * len(feed), mask)[0]
        for row, i in enumerate(feed):
            nodes[i].out = out[row]
        return list(self.head.logits(out))


def _untrained_message(target: str) -> str:
    return (f'method "eagle" needs "model": a directory with an EAGLE-3 head (config.json and safetensors, '
            f"SpecForge or speculators layout). Train one for this target with `verispec train-drafter "
            f"--target {target or 'MODEL'} --method eagle --data PROMPTS.jsonl --out DIR`. Training "
            "a head that drafts well takes hours on a CPU and far more data than a first run "
            "(docs/learned-drafters.md has the measurements).")


def make_eagle_drafter(config, context: DrafterContext) -> EagleDrafter:
    if not config.model:
        raise ValueError(_untrained_message(getattr(context.target, "name", "")))
    if config.speculative_token_tree is not None or config.tree_children != "topk":
        raise ValueError("eagle trees are dynamic EAGLE-2 trees: set speculative_eagle_topk (and "
                         "num_draft_tokens), not speculative_token_tree or sampled tree_children")
    decoder = context.target.model
    head = load_eagle(config.model, decoder.config).to(decoder.device)
    if config.quantization in ("auto", "int8"):
        quantize_head_(head)
    elif config.quantization != "none":
        raise ValueError(f"an EAGLE-3 head runs in float32 (quantization none) or Q8_0 (auto, int8), "
                         f"not {config.quantization!r}")
    budget = config.tree_budget if config.is_tree else None

    def target_embed(ids: Tensor) -> Tensor:
        return decoder.embed_tokens(ids)

    return EagleDrafter(head, target_embed, context.max_model_len, context.max_num_seqs,
                        topk=config.speculative_eagle_topk, budget=budget)
