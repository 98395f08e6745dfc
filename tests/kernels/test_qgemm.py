"""The native kernels' contract: gguf-exact weights, and rows bit-identical for every row count,
thread count and ISA path.

Weights here are random GGUF blocks (every byte random, the fp16 scales made finite), or for the
float formats (F32, F16, BF16) random normal values in the file's type, repacked by the kernels;
the real models' tensors are checked in ``test_gguf_models.py``.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from gguf.constants import GGML_QUANT_SIZES

from verispec import kernels
from verispec.kernels import FLOAT_FORMATS, FORMATS, KernelError

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable (no compiler)")


def test_kernels_build_wherever_a_compiler_is():
    """The suite must exercise the native path: a failed build would otherwise skip every test
    below and leave GGUF models on the slow dense path unnoticed."""
    if shutil.which(os.environ.get("CXX", "c++")) is None or os.environ.get("VERISPEC_NATIVE") == "0":
        pytest.skip("no C++ compiler here (or the kernels are switched off)")
    assert kernels.available()



# byte offsets of the fp16 scale fields in one GGUF block, per format
_FP16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q2_K": (80, 82), "Q6_K": (208,), "Q3_K": (108,), "IQ4_XS": (0,),
                "Q5_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q8_0": (0,), "IQ4_NL": (0,)}


QUANT_FORMATS = [f for f in FORMATS if f not in FLOAT_FORMATS]


def float_rows(fmt: str, values: np.ndarray) -> np.ndarray:
    """Raw GGUF data [n, bytes per row] of float32 ``values`` [n, k] stored as ``fmt`` (F32, F16, BF16)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if fmt == "BF16":
        raw = quants.quantize(values, GGMLQuantizationType.BF16)
    else:
        raw = values.astype(np.float16) if fmt == "F16" else values
    return raw.view(np.uint8).reshape(values.shape[0], -1)


def random_blocks(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Raw GGUF data [n, bytes per row] for a random [n, k] weight of type ``fmt``."""
    rng = np.random.default_rng(seed)
    if fmt in FLOAT_FORMATS:
        return float_rows(fmt, rng.standard_normal((n, k)) * 0.5)
    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]]
    raw = rng.integers(0, 256, size=(n, k // block, nbytes), dtype=np.uint8)
    for off in _FP16_FIELDS[fmt]:
        scales = (rng.standard_normal((n, k // block)) * 0.02).astype(np.float16)
        raw[:, :, off : off + 2] = scales.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


def gguf_weight(fmt: str, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    return quants.dequantize(raw, GGMLQuantizationType[fmt]).reshape(n, k)


def with_threads(n: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("fmt", list(FORMATS))
@needs_kernels
def test_repacked_weight_equals_gguf_dequantization(fmt):
    n, k = 48, 512
    raw = random_blocks(fmt, n, k)
    w = kernels.repack(FORMATS[fmt], raw, n, k)
    ours = kernels.dequantize(w).numpy()
    assert ours.view(np.uint32).tobytes() == gguf_weight(fmt, raw, n, k).view(np.uint32).tobytes()


@pytest.mark.parametrize("fmt", list(FORMATS))
@needs_kernels
def test_rows_are_bit_identical_for_every_row_count_thread_count_and_isa(fmt):
    # 32-wide formats run 8 superblocks per kernel call: 19 of them leave a group of 3. The float
    # formats run two tiles a step where a thread's chunk has them: 11 tiles make chunks of 1 to 3
    # on 1 and 2 threads, so pairs and single tiles; K past their runs of 128 k
    n, k = 64, (512 if GGML_QUANT_SIZES[GGMLQuantizationType[fmt]][0] == 256 else 19 * 32)
    if fmt in FLOAT_FORMATS:
        n = 11 * 16
    w = kernels.repack(FORMATS[fmt], random_blocks(fmt, n, k, seed=1), n, k)
    x = torch.randn(33, k, generator=torch.Generator().manual_seed(2)) * 3
    # the definition: each row alone, through the scalar reference, on one thread
    alone = with_threads(1, lambda: torch.cat([kernels.matmul(x[i : i + 1], [w], "scalar") for i in range(33)]))
    for isa in kernels.supported_isas():
        for threads in (1, 2):
            # past 12 rows AVX512 splits a call into even blocks (13: 7 + 6, 25: 9 + 8 + 8), and
            # past 16 AMX runs blocks of 16 rows
            for m in [*range(1, 26), 33]:
                got = with_threads(threads, lambda: kernels.matmul(x[:m], [w], isa))
                assert torch.equal(got, alone[:m]), f"{fmt} {isa} threads={threads} M={m}"


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@needs_kernels
def test_extreme_weights_and_activations_give_the_scalar_bits(fmt):
    """The integer sums' worst cases: every stored weight at its largest or smallest (all bits
    set, or none) against activations all at +127 or -127, or alternating. The AVX2 path sums
    products in int16 lanes that may wrap on the way (ymm_kernel.h), so these must still end on
    the scalar reference's int32 sums. 16 rows (the four patterns four times) take the 256-bit
    paths' other form, with the weights made once for all the row blocks."""
    n, k = 32, 512
    x = torch.ones(4, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3, 1::2] = -1.0
    x = x.repeat(4, 1)
    for fill in (0xFF, 0x00):
        raw = random_blocks(fmt, n, k, seed=3)
        fp16 = set()
        for off in _FP16_FIELDS[fmt]:
            fp16 |= set(range(off, off + 2))
        block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[fmt]][1]
        blocks = raw.reshape(n, -1, block_bytes)
        for b in range(block_bytes):
            if b not in fp16:
                blocks[:, :, b] = fill
        w = kernels.repack(FORMATS[fmt], blocks.reshape(n, -1), n, k)
        alone = torch.cat([kernels.matmul(x[i : i + 1], [w], "scalar") for i in range(16)])
        for isa in kernels.supported_isas():
            for m in (1, 2, 3, 4, 16):
                assert torch.equal(kernels.matmul(x[:m], [w], isa), alone[:m]), f"{fmt} {isa} fill={fill:#x} M={m}"


@pytest.mark.parametrize("fmt", list(FORMATS))
@needs_kernels
def test_matmul_approximates_the_float_product(fmt):
    """Per-row int8 activations cost well under 2% of the product's norm."""
    n, k = 64, 512
    raw = random_blocks(fmt, n, k, seed=3)
    w = kernels.repack(FORMATS[fmt], raw, n, k)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(4))
    exact = x.double() @ torch.from_numpy(gguf_weight(fmt, raw, n, k)).double().T
    got = kernels.matmul(x, [w]).double()
    assert ((got - exact).norm() / exact.norm()).item() < 0.02


@pytest.mark.parametrize("fmt", list(FLOAT_FORMATS))
@needs_kernels
def test_float_weights_extremes_give_the_scalar_bits(fmt):
    """Float weights at the type's extremes (its largest finite values, subnormals, signed zeros)
    against activations whose products underflow to subnormals or round at float32's top: every
    path equals the scalar reference bit for bit, for a pass of 1, 2, 3 and 16 rows (the SIMD
    paths' row blocks and tile pairs)."""
    n, k = 144, 256
    info = np.finfo(np.float16) if fmt == "F16" else np.finfo(np.float32)
    big = float(info.max) if fmt != "BF16" else 3.3e38  # BF16 rounds to 3.3895e38, finite
    tiny = float(info.smallest_subnormal)
    rng = np.random.default_rng(9)
    values = rng.choice(np.array([big, -big, tiny, -tiny, 0.0, -0.0, 1.0, -1.5], dtype=np.float32), size=(n, k))
    values[::3] = rng.standard_normal((len(values[::3]), k))
    w = kernels.repack(FORMATS[fmt], float_rows(fmt, values), n, k)
    x = torch.from_numpy(rng.choice(np.array([1e-30, -1e-30, 1e-3, 0.7, -2.0], dtype=np.float32), size=(16, k)))
    x[:, ::7] = 0.0
    alone = torch.cat([kernels.matmul(x[i : i + 1], [w], "scalar") for i in range(16)])
    assert (alone == 0).logical_not().any()
    for isa in kernels.supported_isas():
        for m in (1, 2, 3, 16):
            got = with_threads(1, lambda: kernels.matmul(x[:m], [w], isa))  # chunks of 2 and 3 tiles
            assert torch.equal(got.view(torch.int32), alone[:m].view(torch.int32)), f"{fmt} {isa} M={m}"


@pytest.mark.parametrize("fmt", list(FLOAT_FORMATS))
@needs_kernels
def test_float_weights_match_the_float64_product(fmt):
    """Float weights multiply float32 activations with no quantization: one float32 chain per
    output over k = 2,048, a relative error in the float32 rounding range."""
    n, k = 64, 2048
    raw = random_blocks(fmt, n, k, seed=10)
    w = kernels.repack(FORMATS[fmt], raw, n, k)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(11))
    exact = x.double() @ torch.from_numpy(gguf_weight(fmt, raw, n, k)).double().T
    got = kernels.matmul(x, [w]).double()
    assert ((got - exact).norm() / exact.norm()).item() < 1e-5


@needs_kernels
def test_float_parts_beside_quantized_parts_equal_their_separate_products():
    """A layer may hold float tensors beside quantized ones (a quantized file's F16 tensor in a fused
    q/k/v): one call quantizes the input for the quantized parts and gives the float parts its
    float32 rows, fused inputs (glu, norm) included, and writes each part's columns as its own
    call would, on every path."""
    k = 256
    parts = [kernels.repack(FORMATS[f], random_blocks(f, n, k, seed=i), n, k)
             for i, (f, n) in enumerate([("F16", 48), ("Q4_K", 32), ("BF16", 16), ("F32", 32), ("Q8_0", 16)])]
    gen = torch.Generator().manual_seed(12)
    x, x2 = torch.randn(9, k, generator=gen), torch.randn(9, 2 * k, generator=gen)
    norm = (torch.rand(k, generator=gen) + 0.5, 1e-6)
    for isa in kernels.supported_isas():
        for inp, kw in ((x, {}), (x2, {"glu": True}), (x, {"norm": norm})):
            fused = kernels.matmul(inp, parts, isa, **kw)
            assert torch.equal(fused, torch.cat([kernels.matmul(inp, [p], isa, **kw) for p in parts], dim=1)), (isa, kw)
    half = x.to(torch.bfloat16)  # read as its exact float32 values, by the float parts too
    assert torch.equal(kernels.matmul(half, parts), kernels.matmul(half.float(), parts))


@needs_kernels
def test_fused_parts_equal_their_separate_products():
    """q and k in Q4_K beside v in Q6_K (a Q4_K_M qkv) quantize x once and write side by side."""
    k = 512
    parts = [kernels.repack(FORMATS[f], random_blocks(f, n, k, seed=i), n, k)
             for i, (f, n) in enumerate([("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32)])]
    x = torch.randn(3, k)
    fused = kernels.matmul(x, parts)
    assert torch.equal(fused, torch.cat([kernels.matmul(x, [p]) for p in parts], dim=1))


@needs_kernels
def test_bias_bf16_input_and_bf16_output_are_the_float32_path_rounded():
    """The fused epilogue adds the bias in float32 and rounds once, as torch's casts would."""
    n, k = 48, 256
    parts = [kernels.repack(FORMATS[f], random_blocks(f, 16 * i, k, seed=i), 16 * i, k)
             for i, f in ((1, "Q4_K"), (2, "Q6_K"))]
    x = torch.randn(5, k).to(torch.bfloat16)
    bias = torch.randn(n)
    plain = kernels.matmul(x.float(), parts)
    assert torch.equal(kernels.matmul(x, parts), plain)
    got = kernels.matmul(x, parts, bias=bias, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (plain + bias).to(torch.bfloat16))


@needs_kernels
def test_zero_and_tiny_rows():
    n, k = 16, 256
    w = kernels.repack(FORMATS["Q4_K"], random_blocks("Q4_K", n, k), n, k)
    x = torch.zeros(2, k)
    x[1, 7] = 1e-30
    y = kernels.matmul(x, [w])
    assert torch.equal(y[0], torch.zeros(n))
    assert torch.isfinite(y).all()


@needs_kernels
def test_bad_input_is_a_clear_error():
    w = kernels.repack(FORMATS["Q8_0"], random_blocks("Q8_0", 16, 64), 16, 64)
    with pytest.raises(KernelError, match="features"):
        kernels.matmul(torch.randn(2, 32), [w])
    with pytest.raises(KernelError, match="not run by the native kernels"):
        kernels.check_format(16, 16, 64)  # IQ2_XXS
    with pytest.raises(KernelError, match="multiples of 32"):
        kernels.check_format(FORMATS["F16"], 16, 48)
    with pytest.raises(KernelError, match="multiples of 16"):
        kernels.check_format(FORMATS["Q8_0"], 20, 64)
    with pytest.raises(KernelError, match="multiples of 256"):
        kernels.check_format(FORMATS["Q4_K"], 16, 96)


@needs_kernels
def test_fused_inputs_and_residual():
    """glu makes silu(gate) * up, norm makes RMSNorm(x) * w, each row alone in fixed float32 steps
    (so rows stay bit-identical for every row count); residual is added like a separate add."""
    n, k = 32, 256
    w = kernels.repack(FORMATS["Q4_K"], random_blocks("Q4_K", n, k, seed=5), n, k)
    gen = torch.Generator().manual_seed(6)
    x2 = torch.randn(16, 2 * k, generator=gen)
    x = torch.randn(16, k, generator=gen)
    nw, eps = torch.rand(k, generator=gen) + 0.5, 1e-6
    res = torch.randn(16, n, generator=gen)

    gated = kernels.matmul(x2, [w], glu=True)
    normed = kernels.matmul(x, [w], norm=(nw, eps))
    for m in range(1, 17):
        assert torch.equal(kernels.matmul(x2[:m], [w], glu=True), gated[:m]), m
        assert torch.equal(kernels.matmul(x[:m], [w], norm=(nw, eps)), normed[:m]), m
    # the same products as the unfused inputs, up to the rounding of the input's last bits
    g, u = x2.double().chunk(2, dim=-1)
    for got, h in ((gated, (g * torch.sigmoid(g) * u).float()),
                   (normed, (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + eps) * nw.double()).float())):
        want = kernels.matmul(h, [w]).double()
        assert ((got.double() - want).norm() / want.norm()).item() < 1e-2
    assert torch.equal(kernels.matmul(x, [w], residual=res), kernels.matmul(x, [w]) + res)
    with pytest.raises(KernelError, match="not both"):
        kernels.matmul(x2, [w], glu=True, norm=(nw, eps))


@pytest.mark.parametrize("fmt", ["Q4_K", "F16"])
@pytest.mark.parametrize("fused", ["plain", "glu", "norm"])
@needs_kernels
def test_layer_inputs_are_bit_identical_for_every_isa_thread_count_and_row_count(fused, fmt):
    """The input blocks are made (and for a quantized weight quantized) in parallel, by the AVX2
    code on every path but the scalar one: each row must still be the scalar path's row made alone
    on one thread, also where the gate's exp clamps (|x| > 87), a block is all zeros, or a value
    is NaN or infinite."""
    n, k = 32, 2048
    w = kernels.repack(FORMATS[fmt], random_blocks(fmt, n, k, seed=7), n, k)
    gen = torch.Generator().manual_seed(8)
    width = 2 * k if fused == "glu" else k
    x = torch.randn(33, width, generator=gen) * 4
    x[:, 5::97] *= 40  # past exp's clamps for the gate
    x[3, : 2 * 32] = 0  # zero blocks
    x[4, 100] = float("nan")
    x[5, 200] = float("inf")
    x[6, 300] = -float("inf")
    kw = {"glu": True} if fused == "glu" else {"norm": (torch.rand(k, generator=gen) + 0.5, 1e-6)} if fused == "norm" else {}

    def bits(t):
        return t.view(torch.int32)

    alone = with_threads(1, lambda: torch.cat([kernels.matmul(x[i : i + 1], [w], "scalar", **kw) for i in range(33)]))
    assert torch.isfinite(alone[:3]).all() and torch.isfinite(alone[7:]).all()
    for isa in kernels.supported_isas():
        for threads in (1, 2):
            for m in (1, 2, 7, 9, 16, 33):
                got = with_threads(threads, lambda: kernels.matmul(x[:m], [w], isa, **kw))
                assert torch.equal(bits(got), bits(alone[:m])), f"{fused} {isa} threads={threads} M={m}"


def _reference_attention(q, k, v, mask, scale):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1).double(), v.repeat_interleave(g, dim=1).double()
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).float()


def _every_path_gives(want, attend, case):
    """attend(isa) on every ISA path and on 1 and 2 threads equals want bit for bit."""
    for isa in kernels.supported_isas():
        for threads in (1, 2):
            got = with_threads(threads, lambda: attend(isa))
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (*case, isa, threads)


@needs_kernels
def test_attention_rows_depend_only_on_their_own_keys():
    """A row's bits do not change with the rows beside it, with the number of cache entries the
    pass spans past its keys (torch's float32 matmuls did, from 512 keys on), with the thread
    count, or when its keys are scattered in the cache (a tree pass) rather than contiguous."""
    gen = torch.Generator().manual_seed(7)
    b, h, hkv, t, d, n0 = 1, 12, 2, 9, 128, 500
    q = torch.randn(b, h, t, d, generator=gen)
    k = torch.randn(b, hkv, 560, d, generator=gen)
    v = torch.randn(b, hkv, 560, d, generator=gen)
    scale = d**-0.5
    span = 528  # a verify pass's attend length; a decode step at row i spans its own round-up
    mask = torch.zeros(b, t, span, dtype=torch.bool)
    for i in range(t):
        mask[:, i, : n0 + i + 1] = True
    whole = kernels.attention(q, k[:, :, :span], v[:, :, :span], mask, scale)
    for i in range(t):
        own = -(-(n0 + i + 1) // 16) * 16
        step = kernels.attention(q[:, :, i : i + 1], k[:, :, :own], v[:, :, :own], mask[:, i : i + 1, :own], scale)
        assert torch.equal(whole[:, :, i : i + 1], step), i
    assert torch.equal(with_threads(1, lambda: kernels.attention(q, k[:, :, :span], v[:, :, :span], mask, scale)), whole)
    want = _reference_attention(q, k[:, :, :span], v[:, :, :span], mask, scale)
    assert ((whole - want).norm() / want.norm()).item() < 1e-5

    # a tree row: the cached prefix and ancestors 500, 502, 505 (of draft entries 500..508)
    tree = torch.zeros(b, 1, span, dtype=torch.bool)
    tree[..., :n0] = True
    tree[..., [500, 502, 505]] = True
    keep = tree[0, 0].nonzero().flatten()
    packed_k, packed_v = k[:, :, keep], v[:, :, keep]  # the same keys, contiguous, as after acceptance
    step_mask = torch.ones(b, 1, len(keep), dtype=torch.bool)
    assert torch.equal(kernels.attention(q[:, :, :1], k[:, :, :span], v[:, :, :span], tree, scale),
                       kernels.attention(q[:, :, :1], packed_k, packed_v, step_mask, scale))


@needs_kernels
def test_attention_paths_give_the_scalar_bits():
    """The AVX2 and AVX512 row kernels equal the scalar definition bit for bit: query heads per
    KV head from 1 to past the 8 a unit takes (the SIMD kernels run a KV head's query heads
    together), head dims that leave a partial register block of outputs, key counts that leave
    partial blocks of keys and of 16 (the score and exp/sum loops), scattered keys, and rows with
    no key at all."""
    gen = torch.Generator().manual_seed(11)
    cases = [(d, s, 4, 2) for d in (16, 48, 64, 128, 256) for s in (1, 3, 5, 17, 40, 129, 530)]
    cases += [(d, s, h, 1) for d in (48, 128) for s in (7, 130) for h in (1, 3, 5, 6, 7, 9, 12)]
    for d, s, h, hkv in cases:
        q = torch.randn(2, h, 5, d, generator=gen) * 3
        k = torch.randn(2, hkv, s, d, generator=gen)
        v = torch.randn(2, hkv, s, d, generator=gen)
        mask = torch.rand(2, 5, s, generator=gen) < 0.7
        mask[0, 0] = False
        want = kernels.attention(q, k, v, mask, d**-0.5, "scalar")
        assert torch.equal(want[0, :, 0], torch.zeros(h, d))
        _every_path_gives(want, lambda isa: kernels.attention(q, k, v, mask, d**-0.5, isa), (d, s, h))


@needs_kernels
def test_attention_passes_of_many_positions_give_the_scalar_bits():
    """The SIMD kernels run the positions of a pass together over blocks of keys (up to 16
    positions a unit). Verify and prefill shapes: a cached prefix every position attends, then
    causal rows, more positions than one unit holds, a position with no keys between others, a
    tree row with scattered ancestors, and a batch of two."""
    gen = torch.Generator().manual_seed(12)
    for b, h, hkv, t, n0, d in ((1, 12, 2, 9, 200, 128), (1, 6, 2, 40, 100, 64), (2, 4, 1, 23, 130, 32), (1, 2, 1, 70, 0, 16)):
        s = n0 + t
        q = torch.randn(b, h, t, d, generator=gen) * 2
        k = torch.randn(b, hkv, s, d, generator=gen)
        v = torch.randn(b, hkv, s, d, generator=gen)
        mask = torch.zeros(b, t, s, dtype=torch.bool)
        for i in range(t):
            mask[:, i, : n0 + i + 1] = True
        mask[0, t // 2] = False
        mask[-1, t - 1, n0:] = False
        mask[-1, t - 1, [n0, n0 + 2, n0 + t - 1]] = True
        want = kernels.attention(q, k, v, mask, d**-0.5, "scalar")
        assert torch.equal(want[0, :, t // 2], torch.zeros(h, d))
        ref = _reference_attention(q, k, v, mask, d**-0.5).nan_to_num()  # the row with no keys: 0
        assert ((want - ref).norm() / ref.norm()).item() < 1e-5
        _every_path_gives(want, lambda isa: kernels.attention(q, k, v, mask, d**-0.5, isa), (b, h, t))


@needs_kernels
def test_attention_over_a_float16_cache_is_the_float32_one_on_its_values():
    """A float16 cache is read as its exact floats: every path gives the bits that the scalar
    definition gives over a float32 cache holding the same values (decode, verify and prefill
    shapes, a tree row, half's extremes and subnormals among the values)."""
    gen = torch.Generator().manual_seed(13)
    for b, h, hkv, t, n0, d in ((1, 12, 2, 1, 300, 128), (1, 12, 2, 9, 200, 128), (2, 4, 1, 23, 130, 32)):
        s = n0 + t
        q = torch.randn(b, h, t, d, generator=gen)
        k = (torch.randn(b, hkv, s, d, generator=gen) * 4).half()
        v = torch.randn(b, hkv, s, d, generator=gen).half()
        k[0, 0, 0, :3] = torch.tensor([65504.0, -6e-8, 1e-5]).half()  # half's largest, a subnormal
        v[0, 0, 1, :2] = torch.tensor([-65504.0, 3e-6]).half()
        mask = torch.zeros(b, t, s, dtype=torch.bool)
        for i in range(t):
            mask[:, i, : n0 + i + 1] = True
        mask[-1, t - 1, n0:] = False
        mask[-1, t - 1, [n0, n0 + t - 1]] = True
        want = kernels.attention(q, k.float(), v.float(), mask, d**-0.5, "scalar")
        assert torch.equal(kernels.attention(q, k, v, mask, d**-0.5, "scalar").view(torch.int32), want.view(torch.int32))
        _every_path_gives(want, lambda isa: kernels.attention(q, k, v, mask, d**-0.5, isa), (b, h, t, "float16"))


@needs_kernels
def test_attention_without_rows_is_empty():
    k, v = torch.randn(1, 2, 5, 32), torch.randn(1, 2, 5, 32)
    for isa in kernels.supported_isas():
        assert kernels.attention(torch.randn(1, 4, 0, 32), k, v, torch.ones(1, 0, 5, dtype=torch.bool), 1.0, isa).shape == (1, 4, 0, 32)
        got = kernels.attention(torch.randn(0, 4, 3, 32), k[:0], v[:0], torch.ones(0, 3, 5, dtype=torch.bool), 1.0, isa)
        assert got.shape == (0, 4, 3, 32)


@needs_kernels
def test_attention_bad_input_is_a_clear_error():
    q = torch.randn(1, 2, 1, 24)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.attention(q, torch.randn(1, 1, 4, 24), torch.randn(1, 1, 4, 24), torch.ones(1, 1, 4, dtype=torch.bool), 1.0)
    q = torch.randn(1, 2, 1, 16)
    with pytest.raises(RuntimeError, match="k and v must both be float32 or both float16"):
        kernels.attention(q, torch.randn(1, 1, 4, 16).half(), torch.randn(1, 1, 4, 16), torch.ones(1, 1, 4, dtype=torch.bool), 1.0)
    with pytest.raises(RuntimeError, match="k and v must both be float32 or both float16"):
        kernels.attention(q, torch.randn(1, 1, 4, 16).bfloat16(), torch.randn(1, 1, 4, 16).bfloat16(),
                          torch.ones(1, 1, 4, dtype=torch.bool), 1.0)
    with pytest.raises(kernels.KernelError, match="this CPU runs the kernel paths"):
        kernels.attention(q, torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16), torch.ones(1, 1, 4, dtype=torch.bool), 1.0,
                          "sse9")


@needs_kernels
def test_qkv_rope_equals_the_decoders_pytorch_form():
    """Split into heads and rotate q and k: bit for bit the decoder's PyTorch ops."""
    from verispec.models.decoder import _rotate_half

    gen = torch.Generator().manual_seed(8)
    b, t, h, hkv, d = 2, 5, 6, 2, 64
    qkv = torch.randn(b, t, (h + 2 * hkv) * d, generator=gen)
    angles = torch.randn(b, 1, t, d // 2, generator=gen) * 3
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    q, k, v = kernels.qkv_rope(qkv, cos, sin, h, hkv)
    tq, tk, tv = qkv.split((h * d, hkv * d, hkv * d), dim=-1)
    tq = tq.view(b, t, h, d).transpose(1, 2)
    tk = tk.view(b, t, hkv, d).transpose(1, 2)
    tv = tv.view(b, t, hkv, d).transpose(1, 2)
    assert torch.equal(q, tq * cos + _rotate_half(tq) * sin)
    assert torch.equal(k, tk * cos + _rotate_half(tk) * sin)
    assert torch.equal(v, tv)


@needs_kernels
def test_max_isa_caps_the_default_path_without_changing_bits():
    """``set_max_isa`` (``VERISPEC_ISA``) stops the default choice at a slower path: the same
    bits; an unknown or unsupported name is a clear error."""
    n, k = 32, 512
    w = kernels.repack(FORMATS["Q4_K"], random_blocks("Q4_K", n, k, seed=5), n, k)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(6))
    fast = kernels.matmul(x, [w])
    try:
        for isa in kernels.supported_isas():
            kernels.set_max_isa(isa)
            assert torch.equal(kernels.matmul(x, [w]), fast), isa
    finally:
        kernels.set_max_isa(None)
    with pytest.raises(KernelError, match="this CPU runs the kernel paths"):
        kernels.set_max_isa("avx1024")


# ---- the GIL -----------------------------------------------------------------------------------

def _longest_stall(call) -> tuple[float, float]:
    """(seconds ``call`` took, the longest stretch of it in which another Python thread, ticking
    every millisecond, did not run). A call that holds the GIL stalls the ticker throughout."""
    stamps, stop = [], threading.Event()

    def tick():
        while not stop.is_set():
            stamps.append(time.monotonic())
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        time.sleep(0.02)  # the ticker is running
        t0 = time.monotonic()
        call()
        t1 = time.monotonic()
    finally:
        stop.set()
        ticker.join()
    inside = [t for t in stamps if t0 < t < t1]
    return t1 - t0, max(np.diff([t0, *inside, t1]))


def _native_layer_pass():
    """A whole decoder layer of the 1.5B models' shape (hidden 1536, 12 heads and 2 KV heads of
    128, MLP 8960, Q4_K weights) over a 512-token prompt, as one native call."""
    c, h, hkv, d, f, t = 1536, 12, 2, 128, 8960, 512

    def proj(n, k, seed):
        w = kernels.repack(FORMATS["Q4_K"], random_blocks("Q4_K", n, k, seed), n, k)
        return ([w.fmt], [w.data], [w.n], None)

    layer = kernels.native().NativeLayer(proj((h + 2 * hkv) * d, c, 1), proj(c, h * d, 2), proj(2 * f, c, 3),
                                         proj(c, f, 4), torch.ones(c), 1e-6, torch.ones(c), 1e-6, h, hkv, d**-0.5)
    x = torch.randn(1, t, c)
    angles = torch.arange(t)[:, None] * torch.rand(d // 2)
    cos, sin = torch.cat((angles, angles), -1).cos()[None, None], torch.cat((angles, angles), -1).sin()[None, None]
    cache = [torch.zeros(1, hkv, t, d) for _ in range(2)]
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None]
    return lambda: layer.forward(x, cos, sin, *cache, [0], [0], t, causal)


def _native_call(name: str):
    """A native call of a few hundred milliseconds, on weights of a real model's size (the 1.5B
    models' MLP is [8960, 1536]; Q4_K)."""
    n, k = 8960, 1536
    if name == "repack":  # a tensor, not a numpy array (which repack copies first, in Python)
        raw = torch.from_numpy(random_blocks("Q4_K", n, 8 * k, seed=1))
        return lambda: kernels.repack(FORMATS["Q4_K"], raw, n, 8 * k)
    if name == "dequantize":
        w = kernels.repack(FORMATS["Q4_K"], random_blocks("Q4_K", n, 2 * k, seed=1), n, 2 * k)
        return lambda: kernels.dequantize(w)
    if name == "matmul":
        w = kernels.repack(FORMATS["Q4_K"], random_blocks("Q4_K", n, k, seed=1), n, k)
        x = torch.randn(8, k)
        return lambda: kernels.matmul(x, [w], "scalar")
    if name == "attention":  # a 1024-token pass over a 4096-token cache
        q, kv = torch.randn(1, 12, 1024, 128), torch.randn(1, 2, 4096, 128)
        return lambda: kernels.attention(q, kv, kv, torch.ones(1, 1024, 4096, dtype=torch.bool), 128**-0.5)
    return _native_layer_pass()


@pytest.mark.parametrize("name", ["matmul", "attention", "layer", "repack", "dequantize"])
@needs_kernels
def test_native_calls_release_the_gil(name):
    """While a kernel computes, other Python threads run (a server's event loop answers /health
    and streams during a forward pass): the bindings release the GIL once their arguments are
    converted. Held, the ticker would stall for the whole call."""
    call = _native_call(name)
    took, stall = with_threads(1, lambda: _longest_stall(call))
    assert took > 0.05, f"{name} took {took:.3f} s: too short to show anything"
    assert stall < took / 2, f"another thread stalled {stall:.3f} s of a {took:.3f} s {name} call"
