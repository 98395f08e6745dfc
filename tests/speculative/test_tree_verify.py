"""Tree verification: literal greedy cases, and exactness of multi-draft sampling.

The statistical tests use a synthetic target whose distribution depends only on the depth
(p_d), so the tokens a lossless round emits, continued with fresh target samples, must be
independent draws from p_0, p_1, p_2. Each trial draws a depth-3 tree's children from a
mismatched q_d in the mode under test, verifies it, and records the first three tokens; a
chi-square test and a total-variation bound check the joint of the first two tokens and each
column. A negative control that never updates the residual between siblings must fail.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

import verispec.speculative.tree_verify as tree_verify
from verispec.speculative.tree import Tree
from verispec.speculative.tree_verify import verify_tree_greedy, verify_tree_stochastic

VOCAB = 5
TRIALS = 6000
DEPTH = 3


def onehot_logits(argmax: list[int], vocab: int = 8) -> torch.Tensor:
    return torch.zeros(len(argmax), vocab).scatter_(1, torch.tensor(argmax)[:, None], 1.0)


def test_greedy_follows_the_matching_child():
    tree = Tree((-1, 0, 0, 1, 2, 2))  # root -> 1 (a), 2 (b); 1 -> 3; 2 -> 4, 5
    tokens = [1, 2, 3, 4, 5]
    # target: after root 2 (node 2 matches), after node 2: 5 (node 5), after node 5: 7 (bonus)
    result = verify_tree_greedy(tree, tokens, onehot_logits([2, 0, 5, 0, 0, 7]))
    assert result.path == (2, 5)
    assert result.tokens == (2, 5, 7)


def test_greedy_rejects_at_root():
    tree = Tree((-1, 0, 0))
    result = verify_tree_greedy(tree, [1, 2], onehot_logits([6, 0, 0]))
    assert result.path == () and result.tokens == (6,)


def test_bad_inputs_are_clear_errors():
    tree = Tree((-1, 0))
    with pytest.raises(ValueError, match="needs 1 draft tokens"):
        verify_tree_greedy(tree, [1, 2], onehot_logits([0, 0]))
    with pytest.raises(ValueError, match="target must be"):
        verify_tree_greedy(tree, [1], onehot_logits([0]))
    with pytest.raises(ValueError, match="need draft_probs"):
        verify_tree_stochastic(tree, [1], None, torch.full((2, 8), 1 / 8), "iid")
    with pytest.raises(ValueError, match="children must be one of"):
        verify_tree_stochastic(tree, [1], None, torch.full((2, 8), 1 / 8), "beam")
    with pytest.raises(ValueError, match="zero probability"):
        q = torch.zeros(1, 8)
        q[0, 0] = 1.0
        verify_tree_stochastic(tree, [1], q, torch.full((2, 8), 1 / 8), "iid")


def p_and_q(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """p_d and a skewed q_d per depth ([DEPTH+1, V] and [DEPTH, V])."""
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(DEPTH + 1, VOCAB, generator=g) + 0.05
    q = torch.rand(DEPTH, VOCAB, generator=g) ** 3 + 0.01
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def draw_tree(shape: Tree, q: torch.Tensor, children: str, g: torch.Generator) -> tuple[list[int], torch.Tensor]:
    """Children tokens for a static shape: top-k of q_d, or draws from q_d per ``children``."""
    tokens = [0] * (len(shape) - 1)
    for node, kids in enumerate(shape.children):
        if not kids:
            continue
        qd = q[shape.depths[node]]
        if children == "topk":
            picks = torch.topk(qd, len(kids)).indices
        else:
            picks = torch.multinomial(qd, len(kids), replacement=children == "iid", generator=g)
        for c, tok in zip(kids, picks.tolist()):
            tokens[c - 1] = tok
    probs = torch.stack([q[shape.depths[c] - 1] for c in range(1, len(shape))])
    return tokens, probs


def first_three(shape: Tree, children: str, p: torch.Tensor, q: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(TRIALS, 3, dtype=torch.int64)
    for t in range(TRIALS):
        tokens, probs = draw_tree(shape, q, children, g)
        target = torch.stack([p[d] for d in shape.depths])  # [N, V]
        emitted = list(verify_tree_stochastic(shape, tokens, probs, target, children, g).tokens)
        while len(emitted) < 3:  # continue with plain target sampling
            emitted.append(int(torch.multinomial(p[len(emitted)], 1, generator=g)))
        out[t] = torch.tensor(emitted[:3])
    return out


def fit(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, float]:
    probs = probs.double().flatten()
    probs = probs / probs.sum()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs * samples.numel()
    tv = 0.5 * float((counts / samples.numel() - probs).abs().sum())
    return float(chisquare(counts.numpy(), expected.numpy()).pvalue), tv


def check(out: torch.Tensor, p: torch.Tensor) -> list[tuple[float, float]]:
    joint = (p[0][:, None] * p[1][None]).flatten()
    return [fit(out[:, 0] * VOCAB + out[:, 1], joint)] + [fit(out[:, j], p[j]) for j in range(3)]


# (branching at the root, then below): depths 2-3, branching 2-4, each child mode
SHAPES = {
    "topk b2 d3": (Tree.from_choices([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)]), "topk"),
    "iid b3 d2": (Tree.from_choices([(0,), (1,), (2,), (0, 0), (0, 1), (0, 2), (1, 0)]), "iid"),
    "without_replacement b4 d3": (
        Tree.from_choices([(0,), (1,), (2,), (3,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1)]),
        "without_replacement"),
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_multi_draft_sampling_is_exact(name):
    shape, children = SHAPES[name]
    p, q = p_and_q(1)
    results = check(first_three(shape, children, p, q, seed=2), p)
    print(name, results)
    for (pvalue, tv), tv_max in zip(results, (0.05, 0.03, 0.03, 0.03)):  # the joint has 25 cells
        assert pvalue > 1e-3 and tv < tv_max


def test_no_residual_update_between_siblings_fails(monkeypatch):
    monkeypatch.setattr(tree_verify, "_update_residual", lambda residual, q: residual)
    shape, children = SHAPES["iid b3 d2"]
    p, q = p_and_q(1)
    results = check(first_three(shape, children, p, q, seed=2), p)
    print("negative control", results)
    assert results[0][0] < 1e-6
