"""Draft trees as data: a parent-index array, and the one function that lays a tree out.

A tree of ``N`` nodes is the tuple ``parents`` with ``parents[0] == -1`` and
``parents[i] < i`` for every other node. **Node 0 is the root: the last committed token**
(the token the engine feeds first in every round, whose K/V the target has not cached yet);
nodes ``1 .. N-1`` are draft tokens. Children keep the order of their node indices, which is
the order verification tries them in.

Worked example, a root with two children, the first of which has two children::

    node       0   1   2   3   4
    parent    -1   0   0   1   1          tokens of nodes 1..4: [a, b, c, d]
    depth      0   1   1   2   2          candidate sequences: a c | a d | b

:func:`tree_layout` derives everything the verify pass needs for a tree written at cache
indices ``L .. L+N-1`` (``L`` = the target cache length before the pass):

* ``mask`` ``[N, L+N]`` bool: node ``i`` attends to every cached entry and to its own
  ancestors (itself included) inside the tree;
* ``positions`` ``[N]``: the RoPE position of node ``i`` is ``L + depth[i]``, the position its
  token will have once its path is committed (cache indices stay ``L + i``);
* ``paths`` ``[num_leaves, max_depth+1]``: the nodes on each root-to-leaf path, root first,
  padded with -1, one per leaf in leaf order; the accepted path is a prefix of one of them.

Static trees come from Medusa-style "choices": each choice is the tuple of top-k ranks along
a path from the root, e.g. ``[(0,), (1,), (0, 0), (0, 1)]`` is the tree above, with node 1 the
root's most likely child and node 4 the second most likely child of node 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from verispec.config import tree_choices


@dataclass(frozen=True)
class Tree:
    """A rooted tree over nodes ``0 .. N-1``; see the module docstring.

    ``ranks`` (optional) gives each node's top-k rank among its parent's candidates, for
    static trees built by :meth:`from_choices` (the root's rank is -1).
    """

    parents: tuple[int, ...]
    ranks: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        p = self.parents
        if not p or p[0] != -1:
            raise ValueError(f"a tree needs parents[0] == -1 (node 0 is the root), got {p[:1]}")
        bad = [i for i in range(1, len(p)) if not 0 <= p[i] < i]
        if bad:
            raise ValueError(f"parents[i] must be in 0..i-1 for every node i >= 1; bad nodes: {bad[:5]}")
        if self.ranks is not None and len(self.ranks) != len(p):
            raise ValueError(f"ranks has {len(self.ranks)} entries for a tree of {len(p)} nodes")

    @classmethod
    def chain(cls, num_drafts: int) -> Tree:
        return cls(tuple(range(-1, num_drafts)))

    @classmethod
    def from_choices(cls, choices: Iterable[Sequence[int]]) -> Tree:
        """Build a static tree from Medusa-style choices (tuples of top-k ranks).

        Every proper prefix of a choice must itself be a choice. Nodes are numbered by depth,
        then by rank tuple, so parents always come before their children.
        """
        index = {(): 0}
        parents, ranks = [-1], [-1]
        for path in tree_choices(choices):
            index[path] = len(parents)
            parents.append(index[path[:-1]])
            ranks.append(path[-1])
        return cls(tuple(parents), tuple(ranks))

    def __len__(self) -> int:
        return len(self.parents)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """``children[i]``: the children of node ``i``, in node order."""
        kids: list[list[int]] = [[] for _ in self.parents]
        for i, parent in enumerate(self.parents[1:], start=1):
            kids[parent].append(i)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        d = [0] * len(self.parents)
        for i in range(1, len(d)):
            d[i] = d[self.parents[i]] + 1
        return tuple(d)


@dataclass(frozen=True)
class TreeLayout:
    """What a verify pass over a tree needs; built by :func:`tree_layout`."""

    mask: Tensor  # [N, L+N] bool, True = attend
    positions: Tensor  # [N] int64 RoPE positions, L + depth
    paths: Tensor  # [num_leaves, max_depth+1] int64 node ids, root first, -1 padded


def tree_layout(tree: Tree, cache_len: int, device: torch.device | str = "cpu") -> TreeLayout:
    """Attention mask, position ids and root-to-leaf paths of ``tree`` written after
    ``cache_len`` cached entries.

    Worked example for the module docstring's tree, ``cache_len = 2``::

        ancestors (rows: node, cols: node)     mask = [ones(5, 2) | ancestors]
            1 0 0 0 0                          positions = [2, 3, 3, 4, 4]
            1 1 0 0 0                          paths = [[0, 2, -1],   (leaf 2)
            1 0 1 0 0                                   [0, 1, 3],    (leaf 3)
            1 1 0 1 0                                   [0, 1, 4]]    (leaf 4)
            1 1 0 0 1
    """
    n = len(tree)
    parents = torch.tensor(tree.parents, device=device)  # [N]
    ancestors = torch.eye(n, dtype=torch.bool, device=device)  # [N, N], ancestor-or-self
    for i in range(1, n):  # parents come first, so row parents[i] is already complete
        ancestors[i] |= ancestors[parents[i]]
    depth = ancestors.sum(dim=1) - 1  # [N]
    mask = torch.ones(n, cache_len + n, dtype=torch.bool, device=device)  # [N, L+N]
    mask[:, cache_len:] = ancestors
    is_leaf = torch.ones(n, dtype=torch.bool, device=device)
    is_leaf[parents[1:]] = False
    leaves = is_leaf.nonzero().squeeze(1)  # [num_leaves]
    # Ancestors of a node have smaller indices and smaller depths, so listing a leaf's
    # ancestor columns in index order lists its path root first.
    node_ids = torch.arange(n, device=device).expand(len(leaves), n)  # [num_leaves, N]
    on_path = ancestors[leaves]  # [num_leaves, N]
    order = torch.sort((~on_path).to(torch.int64) * n + node_ids, dim=1).values  # path nodes first
    paths = torch.where(order < n, order, torch.full_like(order, -1))[:, : int(depth.max()) + 1]
    return TreeLayout(mask=mask, positions=cache_len + depth, paths=paths)
