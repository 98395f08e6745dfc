"""A tree verify pass computes every row bitwise like plain decoding, and keeps one path.

Rows of a tree attend to scattered cache entries. The decoder gathers each row's keys into a
decode step's layout (:func:`verispec.models.decoder.row_attention`); without that, CPU
softmax and probs @ V reductions group terms by absolute index and rows drift in the last
bit at real head sizes (head_dim 128), which would break greedy identity.
"""

from __future__ import annotations

import random

import pytest
import torch

from verispec.models.decoder import Decoder, DecoderConfig
from verispec.speculative.tree import Tree, tree_layout


@pytest.fixture(scope="module")
def qwen_shaped():
    """One layer with Qwen2.5's attention shape (head_dim 128, 6 query heads per KV head)."""
    cfg = DecoderConfig(architecture="Qwen2ForCausalLM", vocab_size=64, hidden_size=768, intermediate_size=256,
                        num_layers=1, num_heads=6, num_kv_heads=1, head_dim=128, qkv_bias=True)
    model = Decoder.empty(cfg, dtype=torch.bfloat16, device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=gen) * 0.05)
    return model


def random_tree(rnd: random.Random, n: int) -> Tree:
    return Tree(tuple([-1] + [rnd.randrange(i) for i in range(1, n)]))


@pytest.mark.parametrize("cache_len", [30, 250])  # 250: the tree crosses a 256-entry block
def test_tree_rows_equal_chain_rows_bitwise(qwen_shaped, cache_len):
    model, rnd = qwen_shaped, random.Random(cache_len)
    prefix = torch.tensor([[rnd.randrange(64) for _ in range(cache_len)]])
    checked = 0
    for n in (9, 24):
        tree = random_tree(rnd, n)
        tokens = [rnd.randrange(64) for _ in range(n)]
        cache = model.new_cache(512)
        model(prefix, torch.arange(cache_len)[None], cache)
        layout = tree_layout(tree, cache_len)
        tree_logits = model(torch.tensor([tokens]), layout.positions[None], cache, attn_mask=layout.mask[None])[0]
        for path in layout.paths.tolist():
            path = [i for i in path if i >= 0]
            cache.truncate(0, cache_len)
            ids = torch.tensor([[tokens[i] for i in path]])
            chain = model(ids, torch.arange(cache_len, cache_len + len(path))[None], cache)[0]  # [len, V]
            assert torch.equal(tree_logits[path], chain), (n, path)
            checked += len(path)
    assert checked > 40


def test_keep_compacts_the_accepted_path():
    model = Decoder.empty(
        DecoderConfig(architecture="LlamaForCausalLM", vocab_size=8, hidden_size=8, intermediate_size=8,
                      num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4), dtype=torch.float32, device="cpu")
    cache = model.new_cache(16)
    for layer in range(2):
        cache.k[layer][0, 0, :, 0] = torch.arange(16.0) + 100 * layer
        cache.v[layer][0, 0, :, 0] = -torch.arange(16.0)
    cache.lengths[0] = 10  # a tree of 5 nodes written at 5..9
    cache.keep(0, 5, [0, 2, 3])
    assert cache.length(0) == 8
    for layer in range(2):
        assert cache.k[layer][0, 0, :8, 0].tolist() == [100 * layer + i for i in (0, 1, 2, 3, 4, 5, 7, 8)]
        assert cache.v[layer][0, 0, :8, 0].tolist() == [-i for i in (0, 1, 2, 3, 4, 5, 7, 8)]


def test_decoding_after_keep_equals_decoding_the_path(qwen_shaped):
    """Keep the path (0, 2, 3) of a tree, then decode on: same logits as never branching."""
    model, rnd = qwen_shaped, random.Random(7)
    prefix = torch.tensor([[rnd.randrange(64) for _ in range(20)]])
    tree, tokens = Tree((-1, 0, 0, 2, 1)), [5, 9, 11, 13, 17]
    layout = tree_layout(tree, 20)
    branched, straight = model.new_cache(64), model.new_cache(64)
    for cache in (branched, straight):
        model(prefix, torch.arange(20)[None], cache)
    model(torch.tensor([tokens]), layout.positions[None], branched, attn_mask=layout.mask[None])
    branched.keep(0, 20, [0, 2, 3])
    model(torch.tensor([[5, 11, 13]]), torch.arange(20, 23)[None], straight)
    nxt = torch.tensor([[21]]), torch.tensor([[23]])
    assert torch.equal(model(*nxt, branched), model(*nxt, straight))
