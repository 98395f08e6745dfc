"""A native model's layers in one native call each (``csrc/layer.cpp``).

Invariant: the one-call layer computes bit for bit what the Python layer computes (the same
kernel calls on the same inputs), for every kind of pass a decode, verify or tree round makes, and
writes the same cache entries. It is used where it applies (float32 on the native kernels) and
made again when a layer's modules change.
"""

from __future__ import annotations

import pytest
import torch

from verispec import kernels
from verispec.models import decoder as decoder_module
from verispec.models.quant import quantize_

from tiny import tiny_model, torch_threads

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the native kernels")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    with torch_threads(1):
        yield


def native_model(scheme: str):
    return quantize_(tiny_model(seed=4, layers=3, dtype=torch.float32), scheme, dense_prefill=False, native=True)


def passes(model, one_call: bool):
    """Every kind of pass, on one cache: a prompt (decode path), a 9-row chain, two rows in
    slots out of order, a tree, and a step returning hidden states. Returns the outputs and the
    cache."""
    model.native_layers = one_call
    cache = model.new_cache(64, num_slots=3)
    prompt = torch.tensor([[(5 * i + 3) % 48 for i in range(20)]])
    out = [model(prompt, torch.arange(20)[None], cache, slots=[1])]
    out.append(model(torch.tensor([[7, 1, 30, 2, 2, 9, 41, 0, 17]]), torch.arange(20, 29)[None], cache, slots=[1]))
    out.append(model(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.arange(3)[None].expand(2, -1), cache, slots=[2, 0]))
    n = cache.lengths[1]
    # a tree of 4 nodes after the 29 cached entries: a root, its two children, a grandchild
    mask = torch.zeros(1, 4, n + 4, dtype=torch.bool)
    mask[:, :, :n] = True
    for row, path in enumerate([[0], [0, 1], [0, 2], [0, 1, 3]]):
        mask[0, row, [n + p for p in path]] = True
    out.append(model(torch.tensor([[11, 12, 13, 14]]), torch.tensor([[n, n + 1, n + 1, n + 2]]), cache, mask, slots=[1]))
    step = model(torch.tensor([[3], [8]]), torch.tensor([[n + 4], [3]]), cache, slots=[1, 2], output_hidden_states=True)
    out += [step.logits, *step.hidden_states]
    entries = [t.clone() for t in cache.k + cache.v]
    model.native_layers = True
    return out, entries


@pytest.mark.parametrize("scheme,kv_dtype", [("int8", torch.float32), ("int4", torch.float32), ("int4", torch.float16)])
def test_one_call_layers_give_the_python_layers_bits(scheme, kv_dtype):
    """Also over a float16 cache (a native model's default): the one-call layer rounds the
    entries it writes as the Python layer's cache assignment does."""
    model = native_model(scheme)
    model.kv_cache_dtype = kv_dtype
    one, one_cache = passes(model, True)
    assert one_cache[0].dtype == kv_dtype
    assert decoder_module._NATIVE_LAYERS[model][1] is not None  # the passes ran the one-call layers
    python, python_cache = passes(model, False)
    assert len(one) == len(python) == 9
    for a, b in zip(one, python):
        assert torch.equal(a, b)
    for a, b in zip(one_cache, python_cache):
        assert torch.equal(a, b)


def test_one_call_layers_follow_replaced_modules():
    model = native_model("int8")
    ids, pos = torch.tensor([[1, 2, 3]]), torch.arange(3)[None]
    model(ids, pos, model.new_cache(16))
    first = decoder_module._NATIVE_LAYERS[model][1]
    other = native_model("int4")
    model.layers[1].gate_up = other.layers[1].gate_up  # another weight: the layers are made again
    got = model(ids, pos, model.new_cache(16))
    assert decoder_module._NATIVE_LAYERS[model][1] is not first
    model.native_layers = False
    assert torch.equal(got, model(ids, pos, model.new_cache(16)))


def test_dense_and_bf16_models_keep_the_python_layers():
    dense = tiny_model(seed=4, dtype=torch.float32)
    dense(torch.tensor([[1, 2]]), torch.arange(2)[None], dense.new_cache(8))
    assert decoder_module._NATIVE_LAYERS[dense][1] is None  # nn.Linear projections
    bf16 = quantize_(tiny_model(seed=4, dtype=torch.bfloat16), "int8", dense_prefill=False, native=True)
    bf16(torch.tensor([[1, 2]]), torch.arange(2)[None], bf16.new_cache(8))
    assert bf16 not in decoder_module._NATIVE_LAYERS  # bf16 activations: not asked for at all


def test_a_key_past_float16s_range_is_a_clear_error_not_nan():
    """A float16 cache cannot hold a key of 1e5: the one-call layer and the Python layer's
    cache write both refuse it, where rounding would have made it infinite and attention NaN; a
    float32 cache takes it."""
    model = native_model("int4")
    c = model.config
    with torch.no_grad():
        model.layers[0].qkv.bias[c.num_heads * c.head_dim] = 1e5  # the first key's first element
    ids, pos = torch.tensor([[1, 2]]), torch.arange(2)[None]
    model.kv_cache_dtype = torch.float16
    for one_call, error in ((True, RuntimeError), (False, ValueError)):
        model.native_layers = one_call
        with pytest.raises(error, match="does not fit the float16 KV cache; load the model with kv_cache_dtype='float32'"):
            model(ids, pos, model.new_cache(8))
    model.native_layers = True
    model.kv_cache_dtype = torch.float32
    assert torch.isfinite(model(ids, pos, model.new_cache(8))).all()


def test_a_bad_slot_is_a_clear_error():
    model = native_model("int8")
    layer = model._native_layers(torch.zeros(1, 1, model.config.hidden_size))[0]
    cache = model.new_cache(8)
    x = torch.zeros(1, 1, model.config.hidden_size)
    cos = sin = torch.ones(1, 1, 1, model.config.head_dim)
    with pytest.raises(RuntimeError, match="cannot take"):
        layer.forward(x, cos, sin, cache.k[0], cache.v[0], [5], [0], 8, torch.ones(1, 1, 8, dtype=torch.bool))
    wide = torch.zeros(1, model.config.num_kv_heads, 8, 2 * model.config.head_dim)
    with pytest.raises(RuntimeError, match="the cache holds"):
        layer.forward(x, cos, sin, wide, wide.clone(), [0], [0], 8, torch.ones(1, 1, 8, dtype=torch.bool))


@pytest.mark.slow
def test_the_real_draft_models_layers_agree(qwen_draft):
    """Qwen2.5-Coder-0.5B's Q4_K_M file mixes Q4_K, Q6_K, Q5_0 and Q8_0 tensors, within a layer
    too: the one-call layers give its Python layers' bits on every kind of pass."""
    model = qwen_draft.model
    one, one_cache = passes(model, True)
    assert decoder_module._NATIVE_LAYERS[model][1] is not None
    python, python_cache = passes(model, False)
    for a, b in zip(one + one_cache, python + python_cache):
        assert torch.equal(a, b)
