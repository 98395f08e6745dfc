"""Decoder and KV cache invariants on tiny random models."""

from __future__ import annotations

import pytest
import torch

from tiny import tiny_model
from verispec import kernels
from verispec.models import decoder
from verispec.models.decoder import DecoderConfig, DecoderLayer, UnsupportedModelError
from verispec.models.kv_cache import KVCache


def full_logits(model, ids):
    cache = model.new_cache(64, num_slots=ids.shape[0])
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    return model(ids, positions, cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_incremental_decoding_equals_full_forward_at_every_step(dtype):
    model = tiny_model(seed=3, dtype=dtype)
    ids = torch.randint(0, 48, (2, 24), generator=torch.Generator().manual_seed(0))
    full = full_logits(model, ids)
    cache = model.new_cache(64, num_slots=2)
    steps = [model(ids[:, :8], torch.arange(8).expand(2, -1), cache)]
    for i in range(8, 24):
        steps.append(model(ids[:, i : i + 1], torch.full((2, 1), i), cache))
    incremental = torch.cat(steps, dim=1)
    # fp32: one-row matmuls take a different (GEMV) path than many-row ones, ~1e-6 relative
    # per op. bf16: 8-bit mantissa, so compare loosely; bitwise identity is tested below.
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(incremental, full, atol=tol, rtol=tol)
    assert cache.lengths == [24, 24]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # float32: native models' activations
def test_rows_are_batch_invariant(dtype):
    """k+1 rows in one pass give bitwise the same logits as one row at a time."""
    model = tiny_model(seed=4, dtype=dtype)
    ids = torch.randint(0, 48, (1, 40), generator=torch.Generator().manual_seed(1))
    one, many = model.new_cache(128, block=16), model.new_cache(128, block=16)
    prefix = torch.arange(20)[None]
    model(ids[:, :20], prefix, one)
    model(ids[:, :20], prefix, many)
    rows = torch.cat([model(ids[:, i : i + 1], torch.tensor([[i]]), one) for i in range(20, 29)], dim=1)
    # 9 rows crossing a 16-entry attention block boundary (20..28 -> attend lengths 32).
    block = model(ids[:, 20:29], torch.arange(20, 29)[None], many)
    assert torch.equal(rows, block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_prefill_runs_its_mlp_in_equal_row_blocks_with_the_same_result(dtype, monkeypatch):
    """Over PREFILL_ROW_BLOCK rows, a prefill's output half runs in equal blocks of at most that
    many rows (a speed measure, see the constant): same logits as one block, up to the GEMMs'
    own rounding."""
    model = tiny_model(seed=6, dtype=dtype)
    ids = torch.randint(0, 48, (2, 300), generator=torch.Generator().manual_seed(2))  # 600 rows
    positions = torch.arange(300).expand(2, -1)
    blocks = []
    real = DecoderLayer._output
    monkeypatch.setattr(DecoderLayer, "_output", lambda self, x, a, p: blocks.append(x.shape[:2]) or real(self, x, a, p))
    out = model(ids, positions, model.new_cache(320, num_slots=2), prefill=True)
    assert blocks == [(1, 200)] * 3 * len(model.layers)  # 600 rows: three blocks of 200, per layer
    blocks.clear()
    monkeypatch.setattr(decoder, "PREFILL_ROW_BLOCK", 10_000)
    whole = model(ids, positions, model.new_cache(320, num_slots=2), prefill=True)
    assert blocks == [(2, 300)] * len(model.layers)
    tol = 1e-4 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(out, whole, atol=tol, rtol=tol)
    blocks.clear()
    model(ids, positions, model.new_cache(320, num_slots=2))  # not a prefill: never in blocks
    assert blocks == [(2, 300)] * len(model.layers)


@pytest.mark.parametrize("case", ["packed", "upcast"])
def test_a_long_prefill_stays_whole_where_blocks_would_repeat_weight_work(case, monkeypatch):
    """A packed layer without a dense copy runs its own kernel on a prefill, and a bf16 layer on
    a CPU without native bf16 casts its weight to float32 for it: in blocks, each block would
    pay that again, so their prefill keeps all rows in one block."""
    from verispec.models.quant import quantize_

    model = tiny_model(seed=6)
    if case == "packed":
        quantize_(model, "int8", dense_prefill=False, native=False)
    else:
        monkeypatch.setattr(kernels, "cpu_has_native_bf16", lambda: False)
    blocks = []
    real = DecoderLayer._output
    monkeypatch.setattr(DecoderLayer, "_output", lambda self, x, a, p: blocks.append(x.shape[:2]) or real(self, x, a, p))
    ids = torch.randint(0, 48, (1, 300), generator=torch.Generator().manual_seed(2))
    model(ids, torch.arange(300)[None], model.new_cache(320), prefill=True)
    assert blocks == [(1, 300)] * len(model.layers)


def test_rollback_then_redecode_equals_never_having_decoded():
    model = tiny_model(seed=5, dtype=torch.float32)
    ids = torch.randint(0, 48, (1, 20), generator=torch.Generator().manual_seed(2))
    wrong = torch.randint(0, 48, (1, 5), generator=torch.Generator().manual_seed(3))
    clean, dirty = model.new_cache(64), model.new_cache(64)
    model(ids[:, :12], torch.arange(12)[None], clean)
    model(ids[:, :12], torch.arange(12)[None], dirty)
    model(wrong, torch.arange(12, 17)[None], dirty)  # speculative garbage ...
    dirty.truncate(0, 12)  # ... rolled back
    a = model(ids[:, 12:], torch.arange(12, 20)[None], clean)
    b = model(ids[:, 12:], torch.arange(12, 20)[None], dirty)
    assert torch.equal(a, b)


def test_keep_compacts_a_tree_path():
    """Write 3 candidate tokens as siblings, keep one: the cache equals decoding that one alone."""
    model = tiny_model(seed=6, dtype=torch.float32)
    ids = torch.randint(0, 48, (1, 10), generator=torch.Generator().manual_seed(4))
    cands = torch.tensor([[7, 11, 13]])
    tree, chain = model.new_cache(64), model.new_cache(64)
    for c in (tree, chain):
        model(ids, torch.arange(10)[None], c)
    # Siblings: each candidate sees the prefix and itself only; all sit at position 10.
    mask = torch.zeros(1, 3, 13, dtype=torch.bool)
    mask[..., :10] = True
    mask[0, torch.arange(3), 10 + torch.arange(3)] = True
    tree_logits = model(cands, torch.full((1, 3), 10), tree, attn_mask=mask)
    chain_logits = model(cands[:, 1:2], torch.tensor([[10]]), chain)
    torch.testing.assert_close(tree_logits[:, 1], chain_logits[:, 0], atol=1e-5, rtol=0)
    tree.keep(0, 10, [1])
    assert tree.lengths[0] == 11
    nxt = torch.tensor([[5]])
    torch.testing.assert_close(
        model(nxt, torch.tensor([[11]]), tree), model(nxt, torch.tensor([[11]]), chain), atol=1e-5, rtol=0
    )


def test_slots_are_independent():
    model = tiny_model(seed=7, dtype=torch.float32)
    ids = torch.randint(0, 48, (2, 12), generator=torch.Generator().manual_seed(5))
    shared = model.new_cache(64, num_slots=3)
    model(ids[:1], torch.arange(12)[None], shared, slots=[2])
    model(ids[1:], torch.arange(12)[None], shared, slots=[0])
    alone = full_logits(model, ids[:1])
    nxt = torch.tensor([[3]])
    a = model(nxt, torch.tensor([[12]]), shared, slots=[2])
    ref_cache = model.new_cache(64)
    model(ids[:1], torch.arange(12)[None], ref_cache)
    torch.testing.assert_close(a, model(nxt, torch.tensor([[12]]), ref_cache), atol=1e-6, rtol=0)
    assert shared.lengths == [12, 0, 13]
    assert alone.shape == (1, 12, 48)


def test_cache_overflow_is_a_clear_error():
    model = tiny_model(seed=8, dtype=torch.float32)
    cache = model.new_cache(8)
    with pytest.raises(ValueError, match="beyond the cache's max_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long), torch.arange(9)[None], cache)


def test_truncate_past_length_is_rejected():
    cache = KVCache(1, 1, 1, 4, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(0, 3)


def test_unsupported_architecture_names_it_and_lists_supported():
    with pytest.raises(UnsupportedModelError, match="'GPT2LMHeadModel'.*LlamaForCausalLM, Qwen2ForCausalLM"):
        DecoderConfig.from_hf({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_invariant_linear_rows_equal_one_row_products_at_every_width(dtype):
    """A wide output (the gate/up projection, the LM head) is where CPU GEMMs change blocking
    with the row count: torch 2.13 on an AMX CPU changes a [1, T, 1536] x [17920, 1536] product's
    rows from T = 13. Verify passes of any width must compute each row as a decode step does."""
    from verispec.models.decoder import invariant_linear

    torch.manual_seed(0)
    weight = (torch.randn(17920, 1536) * 0.02).to(dtype)
    bias = torch.randn(17920).to(dtype)
    x = torch.randn(1, 40, 1536).to(dtype)
    one = torch.cat([invariant_linear(x[:, i:i + 1], weight, bias) for i in range(40)], dim=1)
    for t in (2, 9, 13, 16, 17, 33, 40):
        assert torch.equal(invariant_linear(x[:, :t], weight, bias), one[:, :t]), t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # float32: native models' activations
@pytest.mark.parametrize("heads, kv_heads", [(12, 2), (14, 2)])  # Qwen2.5 1.5B, 0.5B
def test_attention_rows_equal_decode_steps_over_long_caches(heads, kv_heads, dtype):
    """A verify pass's attention rows must equal decode steps bitwise, for the chain
    (:func:`grouped_attention`) and the tree form (:func:`row_attention`). On an AMX CPU the
    probs @ V product of 7 tokens x 6 query heads rounded differently from one token's 6 rows
    over 512-1024 keys (in 1-3 of 4 random draws), and a Qwen 1.5B answer diverged at k = 6."""
    from verispec.models.decoder import RowKeys, grouped_attention, row_attention

    gen = torch.Generator().manual_seed(0)
    for s in (512, 768, 1024):
        for t in (2, 5, 7, 9, 12, 17):
            for _ in range(3):
                q = torch.randn(1, heads, t, 128, generator=gen).to(dtype)
                k = torch.randn(1, kv_heads, s, 128, generator=gen).to(dtype)
                v = torch.randn(1, kv_heads, s, 128, generator=gen).to(dtype)
                mask = torch.zeros(1, 1, t, s, dtype=torch.bool)
                for i in range(t):
                    mask[..., i, : s - t - 1 + i] = True
                steps = torch.cat(
                    [grouped_attention(q[:, :, i : i + 1], k, v, mask[:, :, i : i + 1]) for i in range(t)], dim=2
                )
                assert torch.equal(grouped_attention(q, k, v, mask), steps), (s, t)
                assert torch.equal(row_attention(q, k, v, RowKeys.from_mask(mask[:, 0])), steps), (s, t)
