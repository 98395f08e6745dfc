"""Tree layout on small hand-built trees: masks, positions, paths, and Medusa choices."""

from __future__ import annotations

import pytest
import torch

from verispec.speculative.tree import Tree, tree_layout

# root -> 1, 2; 1 -> 3, 4 (the module docstring's example)
EXAMPLE = Tree((-1, 0, 0, 1, 1))


def test_layout_of_the_docstring_example():
    layout = tree_layout(EXAMPLE, cache_len=2)
    ancestors = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(layout.mask, torch.cat([torch.ones(5, 2, dtype=torch.bool), ancestors], dim=1))
    assert layout.positions.tolist() == [2, 3, 3, 4, 4]
    assert layout.paths.tolist() == [[0, 2, -1], [0, 1, 3], [0, 1, 4]]  # one per leaf, in leaf order


def test_chain_is_causal():
    layout = tree_layout(Tree.chain(3), cache_len=4)
    assert torch.equal(layout.mask, torch.ones(4, 8, dtype=torch.bool).tril(diagonal=4))
    assert layout.positions.tolist() == [4, 5, 6, 7]
    assert layout.paths.tolist() == [[0, 1, 2, 3]]


def test_root_only_and_empty_cache():
    layout = tree_layout(Tree((-1,)), cache_len=0)
    assert layout.mask.tolist() == [[True]]
    assert layout.positions.tolist() == [0]
    assert layout.paths.tolist() == [[0]]


def test_deep_branch_after_a_wide_one():
    # root -> 1, 2, 3; 3 -> 4 -> 5: the later sibling holds the deepest path
    tree = Tree((-1, 0, 0, 0, 3, 4))
    layout = tree_layout(tree, cache_len=1)
    assert layout.positions.tolist() == [1, 2, 2, 2, 3, 4]
    assert layout.paths.tolist() == [[0, 1, -1, -1], [0, 2, -1, -1], [0, 3, 4, 5]]
    assert layout.mask[5].tolist() == [True, True, False, False, True, True, True]
    assert tree.children == ((1, 2, 3), (), (), (4,), (5,), ())
    assert tree.depths == (0, 1, 1, 1, 2, 3)


def test_from_medusa_choices():
    tree = Tree.from_choices([(0, 1), (1,), (0,), (0, 0), (0, 0, 0)])
    # numbered by depth, then rank tuple: (0,) (1,) (0,0) (0,1) (0,0,0)
    assert tree.parents == (-1, 0, 0, 1, 1, 3)
    assert tree.ranks == (-1, 0, 1, 0, 1, 0)


@pytest.mark.parametrize(
    ("parents", "message"),
    [((), "parents\\[0\\] == -1"), ((0, 0), "parents\\[0\\] == -1"), ((-1, 1), "bad nodes: \\[1\\]"),
     ((-1, 0, 3, 0), "bad nodes: \\[2\\]")],
)
def test_bad_parent_arrays_are_clear_errors(parents, message):
    with pytest.raises(ValueError, match=message):
        Tree(parents)


@pytest.mark.parametrize(
    ("choices", "message"), [([(0, 0)], "no parent choice"), ([()], "non-empty"), ([(0,), (-1,)], "ranks >= 0")]
)
def test_bad_choices_are_clear_errors(choices, message):
    with pytest.raises(ValueError, match=message):
        Tree.from_choices(choices)
