"""Verification of a draft tree against the target: greedy, and exact multi-draft sampling.

Inputs describe one tree (see :mod:`verispec.speculative.tree`; node 0 is the root, the last
committed token): ``draft_tokens[i-1]`` is node i's token, ``target[i]`` the target's scores
for the token after node i, and, for sampled children, ``draft_probs[i-1]`` the draft
distribution q at node i's parent that node i was drawn from. p = target, q = draft.

Greedy: from the root, follow the first child whose token is the target's argmax; the
argmax at the last node reached is the final (recovered or bonus) token.

Stochastic (multi-draft recursive rejection sampling, SpecInfer, Miao et al. 2024): at a
node with target distribution p, set the residual p' = p and try the children in order.
Child j, token x_j, was drawn from a proposal q_j given its earlier siblings; accept it with
probability min(1, p'(x_j) / q_j(x_j)) and continue at that child; on rejection set
p' <- normalize(max(p' - q_j, 0)). If every child is rejected, sample the final token from
p'. If a child is accepted and has no children, the final token is sampled from its p.

q_j depends on how the drafter chose the children (``children=``):

* ``"iid"``: each child drawn from q independently (with replacement): q_j = q.
* ``"without_replacement"``: child j drawn from q with the earlier siblings' tokens
  removed: q_j = q restricted to tokens not in {x_1..x_{j-1}}, renormalised.
* ``"topk"``: children chosen deterministically (top-k of the draft, a trie of n-gram
  continuations, any rule that does not look at the target): q_j = one-hot at x_j, so the
  test is "accept with probability p'(x_j)" and rejection removes x_j from p'.

Why this is exact. Let F(p', h) be the distribution of the token emitted at a node from the
point where the residual is p' and the earlier siblings are h. If no child is left, F = p'.
Otherwise x_j ~ q_j (q_j is a function of h, and x_j is independent of the verifier's coins),
and the rejection residual R = normalize(max(p' - q_j, 0)) does not depend on x_j, so by
induction on the number of children left, F(R, h + x_j) = R and::

    F(p', h)(t) = q_j(t) min(1, p'(t)/q_j(t)) + (1 - sum_v min(p'(v), q_j(v))) R(t)
                = min(p'(t), q_j(t)) + max(p'(t) - q_j(t), 0) = p'(t).

So the first token is distributed as p. The children of an accepted node were drawn given
its path only, independently of this node's coins, so the same argument applies at the next
depth with that node's p: every emitted token follows the target given the tokens before it.
(With one-hot q_j the middle line reads p'(x_j) [t = x_j] + (1 - p'(x_j)) p'(t)[t != x_j] /
(1 - p'(x_j)) = p'(t) for any x_j, which is why deterministic children are exact whatever
rule picked them.) A rejected token always leaves p'(x) = 0 (it was rejected, so p'(x) <
q_j(x)), hence a later duplicate sibling is never accepted: i.i.d. children may repeat tokens.

What the proof needs from the drafter: sampled children at a node must be the first m draws
of that node's sequence, with m not depending on the draws themselves (a static tree shape
does this). Keeping the "best" draws by their own probability would bias them; deterministic
children have no such restriction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.sampling import sample
from verispec.speculative.tree import Tree
from verispec.speculative.verify import _recovery_distribution

CHILD_MODES = ("topk", "iid", "without_replacement")


@dataclass(frozen=True)
class TreeVerifyResult:
    """``path``: accepted nodes, root excluded, in root-to-leaf order; ``tokens``: the tokens
    to commit, i.e. the accepted nodes' tokens followed by the recovered-or-bonus token."""

    path: tuple[int, ...]
    tokens: tuple[int, ...]

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def verify_tree_greedy(tree: Tree, draft_tokens: list[int], target: Tensor) -> TreeVerifyResult:
    """Greedy tree verification; ``target`` is ``[N, vocab]`` logits or probabilities."""
    _check(tree, draft_tokens, target)
    argmax = target.argmax(dim=-1).tolist()  # [N]
    node, path = 0, []
    while True:
        nxt = next((c for c in tree.children[node] if draft_tokens[c - 1] == argmax[node]), None)
        if nxt is None:
            return TreeVerifyResult(tuple(path), tuple(draft_tokens[c - 1] for c in path) + (argmax[node],))
        path.append(nxt)
        node = nxt


def verify_tree_stochastic(
    tree: Tree,
    draft_tokens: list[int],
    draft_probs: Tensor | None,
    target_probs: Tensor,
    children: str,
    generator: torch.Generator | None = None,
) -> TreeVerifyResult:
    """Exact multi-draft verification (see the module docstring).

    Args:
        tree: N nodes, node 0 the root.
        draft_tokens: ``[N-1]`` tokens of nodes 1..N-1.
        draft_probs: ``[N-1, vocab]`` q that node i was drawn from (its parent's draft
            distribution, before removing earlier siblings); ``None`` only with ``"topk"``.
        target_probs: ``[N, vocab]`` p after the request's sampling transforms.
        children: ``"topk"``, ``"iid"`` or ``"without_replacement"``.
        generator: random source on the tensors' device.
    """
    _check(tree, draft_tokens, target_probs)
    if children not in CHILD_MODES:
        raise ValueError(f"children must be one of {', '.join(CHILD_MODES)}; got {children!r}")
    if children != "topk" and draft_probs is None:
        raise ValueError(f'sampled children ("{children}") need draft_probs, the q they were drawn from')
    if draft_probs is not None and tuple(draft_probs.shape) != (len(tree) - 1, target_probs.shape[-1]):
        raise ValueError(f"draft_probs must be [N-1, vocab]; got {tuple(draft_probs.shape)}")
    p = target_probs.to(torch.float64)  # [N, V]
    node, path = 0, []
    while True:
        accepted, residual = _try_children(tree, node, draft_tokens, draft_probs, p[node], children, generator)
        if accepted is None:
            final = int(sample(residual, generator))
            return TreeVerifyResult(tuple(path), tuple(draft_tokens[c - 1] for c in path) + (final,))
        path.append(accepted)
        node = accepted


def _try_children(tree, node, draft_tokens, draft_probs, p_node, children, generator):
    """Try ``node``'s children in order; return (accepted child or None, final residual)."""
    residual = p_node  # [V] float64, normalised
    drawn = torch.zeros_like(p_node, dtype=torch.bool)  # [V] tokens of earlier siblings
    for c in tree.children[node]:
        x = draft_tokens[c - 1]
        q = _proposal(draft_probs, c, x, drawn, children, p_node)  # [V] float64
        u = torch.rand((), generator=generator, dtype=torch.float64, device=p_node.device)
        if u * q[x] < residual[x]:
            return c, residual
        residual = _update_residual(residual, q)
        drawn[x] = True
    return None, residual


def _proposal(draft_probs, c, x, drawn, children, like) -> Tensor:
    """q_j, the distribution child ``c`` (token ``x``) was drawn from given its earlier siblings."""
    if children == "topk":
        return torch.zeros_like(like).index_fill_(0, torch.tensor([x], device=like.device), 1.0)
    q = draft_probs[c - 1].to(torch.float64)  # [V]
    if children == "without_replacement":
        q = q.masked_fill(drawn, 0.0)
    total = q.sum()
    if not total > 0 or q[x] <= 0:
        raise ValueError(f"node {c}'s token {x} has zero probability under the q it was drawn from")
    return q / total


def _update_residual(residual: Tensor, q: Tensor) -> Tensor:
    """normalize(max(p' - q, 0)), or p' itself where that has no mass (rejection was impossible)."""
    weights = _recovery_distribution(residual[None], q[None])[0]  # [V]
    return weights / weights.sum()


def _check(tree: Tree, draft_tokens: list[int], target: Tensor) -> None:
    if len(draft_tokens) != len(tree) - 1:
        raise ValueError(f"a tree of {len(tree)} nodes needs {len(tree) - 1} draft tokens, got {len(draft_tokens)}")
    if target.dim() != 2 or target.shape[0] != len(tree):
        raise ValueError(f"target must be [N={len(tree)}, vocab]; got {tuple(target.shape)}")
