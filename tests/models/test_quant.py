"""Weight-only quantized linears: shapes, error against their own dequantized weight, row invariance."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from torch import nn

from tiny import tiny_model
from verispec import kernels
from verispec.models.decoder import PREFILL_MIN_TOKENS
from verispec.models.native import NativeLinear
from verispec.models.quant import Int4Linear, Int8Linear, QuantizationError, is_quantized, quantize_
from verispec.runtime import physical_cores, set_threads


def dense(n: int = 96, k: int = 128, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias).to(torch.bfloat16)


LAYERS = {
    "int8": lambda lin: Int8Linear(lin),
    "int4-g32": lambda lin: Int4Linear(lin, 32),
    "int4-g64": lambda lin: Int4Linear(lin, 64),
    "int4-g128": lambda lin: Int4Linear(lin, 128),
}
# Largest |w - dequantized w| allowed, as a fraction of the row's (int8) or group's (int4) range.
STEP = {"int8": 1 / 254, "int4-g32": 1 / 30, "int4-g64": 1 / 30, "int4-g128": 1 / 30}


@pytest.mark.parametrize("name", list(LAYERS))
def test_output_matches_dequantized_reference(name):
    lin = dense()
    q = LAYERS[name](lin)
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)  # [B, T, K]
    y = q(x)
    assert y.shape == (2, 3, 96) and y.dtype == torch.bfloat16
    ref = x.float() @ q.dequantize().t() + lin.bias.float()
    assert torch.allclose(y.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("name", list(LAYERS))
def test_dequantized_weight_is_within_half_a_step(name):
    lin = dense(bias=False)
    w = lin.weight.float()
    err = (LAYERS[name](lin).dequantize() - w).abs()
    span = 2 * w.abs().amax() if name == "int8" else w.max() - w.min()
    assert 0 < err.max() <= STEP[name] * span * 1.05  # bf16-rounded scales allow a little slack


@pytest.mark.parametrize("name", list(LAYERS))
def test_rows_are_batch_invariant(name):
    """Row i of a 5-row product equals the same row computed alone, bit for bit."""
    q = LAYERS[name](dense(n=1536 if name == "int8" else 256, k=512))
    x = torch.randn(5, 512, dtype=torch.bfloat16)
    together = q(x)
    alone = torch.cat([q(x[i : i + 1]) for i in range(5)])
    assert torch.equal(together, alone)


native_kernels = pytest.mark.skipif(not kernels.available(), reason="native kernels unavailable (no compiler)")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantize_replaces_every_projection_and_packs_the_head(scheme):
    model = tiny_model(seed=3)
    embed = model.embed.weight.clone()
    quantize_(model, scheme, native=False)
    assert is_quantized(model)
    kind = Int4Linear if scheme == "int4" else Int8Linear
    for layer in model.layers:
        assert all(isinstance(m, kind) for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    assert isinstance(model.lm_head, Int8Linear)
    assert torch.equal(model.embed.weight, embed)  # the lookup table stays as it was
    assert not any(isinstance(m, nn.Linear) for m in model.modules())


@native_kernels
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_on_the_native_kernels_int8_is_q8_0_and_int4_is_q4_1_as_gguf_quantizes_them(scheme):
    """The default where the kernels run: GGUF's formats, from gguf's own quantizer, so the
    weight multiplied is gguf's dequantization of gguf's quantization; the head is Q8_0."""
    from gguf import GGMLQuantizationType, quants

    model = tiny_model(seed=3)
    weights = {id(layer): layer.gate_up.weight.detach().float().clone() for layer in model.layers}
    head = model.lm_head.weight.detach().float().clone()
    quantize_(model, scheme)
    fmt = {"int8": "Q8_0", "int4": "Q4_1"}[scheme]
    for layer in model.layers:
        assert all(isinstance(m, NativeLinear) and [kernels.format_name(p.fmt) for p in m.parts] == [fmt]
                   for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
        w = weights[id(layer)].numpy()
        t = GGMLQuantizationType[fmt]
        assert torch.equal(layer.gate_up.dequantize(), torch.from_numpy(quants.dequantize(quants.quantize(w, t), t)))
    assert [kernels.format_name(p.fmt) for p in model.lm_head.parts] == ["Q8_0"] and model.lm_head.float_output
    t = GGMLQuantizationType.Q8_0
    assert torch.equal(model.lm_head.dequantize(), torch.from_numpy(quants.dequantize(quants.quantize(head.numpy(), t), t)))
    with pytest.raises(QuantizationError, match="groups of 32"):
        quantize_(tiny_model(seed=3), "int4", group_size=64, native=True)


NATIVE = [False, pytest.param(True, marks=native_kernels)]


@pytest.mark.parametrize("native", NATIVE)
def test_quantized_logits_stay_close_to_bf16_in_decode_and_long_prefill(native):
    model = tiny_model(seed=4)
    ids = torch.randint(0, 48, (1, 70))  # 70 tokens: a prefill of PREFILL_MIN_TOKENS or more
    ref = model(ids, torch.arange(70)[None], model.new_cache(128), prefill=True)
    quantize_(model, "int8", native=native)
    for prefill in (False, True):
        out = model(ids, torch.arange(70)[None], model.new_cache(128), prefill=prefill)
        assert out.shape == ref.shape and out.dtype == torch.float32
        assert (out - ref).norm() < 0.15 * ref.norm()  # random weights amplify the error


@pytest.mark.parametrize("native", NATIVE)
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_only_a_marked_long_prefill_multiplies_by_the_dense_copy(scheme, native, monkeypatch):
    """The dense bf16 copy serves a prompt's prefill of PREFILL_MIN_TOKENS or more; decode and
    verify passes, however wide, keep the packed kernels (their rows are batch invariant)."""
    model = quantize_(tiny_model(seed=7), scheme, dense_prefill=True, native=native)
    layer_type = type(model.layers[0].qkv)
    calls = []
    real = layer_type.dense_forward
    monkeypatch.setattr(layer_type, "dense_forward", lambda self, x: calls.append(x.shape[1]) or real(self, x))
    ids = torch.randint(0, 48, (1, PREFILL_MIN_TOKENS + 6), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(ids.shape[1])[None]
    dense = model(ids, positions, model.new_cache(128), prefill=True)
    assert len(calls) == 4 * len(model.layers) and set(calls) == {ids.shape[1]}  # qkv, o, gate_up, down
    calls.clear()
    packed = model(ids, positions, model.new_cache(128))  # as wide, but not a prefill
    model(ids[:, :PREFILL_MIN_TOKENS - 1], positions[:, :PREFILL_MIN_TOKENS - 1], model.new_cache(128), prefill=True)
    assert calls == []
    # The same quantized model, rounded once more: close, and not computed the same way.
    assert not torch.equal(dense, packed)
    # Over 8 random prompts the relative difference was 0.044-0.060 on PyTorch's kernels and
    # 0.068-0.097 on the native ones (they round activations to int8, not bf16, and the random
    # weights amplify it). The prompt is fixed: a bound of 0.05 had sat at the median of that
    # spread, so the test passed or failed with the random state the tests before it left.
    assert (dense - packed).norm() < (0.12 if native else 0.07) * packed.norm()


@pytest.mark.parametrize("native", NATIVE)
def test_dense_copies_are_bf16_dequantized_weights_and_optional(native):
    base = tiny_model(seed=8)
    for scheme in ("int8", "int4"):
        kept = quantize_(copy.deepcopy(base), scheme, dense_prefill=True, native=native)
        layer = kept.layers[0].gate_up
        # a native layer keeps its copy in oneDNN's layout where PyTorch has oneDNN
        dense = layer.dense_weight() if native else layer.dense
        assert dense.dtype == torch.bfloat16 and dense.shape == (layer.out_features, layer.in_features)
        # the dequantized weight, rounded to bf16 (relative error at most 2^-8)
        assert torch.allclose(dense.float(), layer.dequantize(), rtol=2 ** -8, atol=1e-6)
        lean = quantize_(copy.deepcopy(base), scheme, dense_prefill=False, native=native)
        assert all(getattr(m, "dense", None) is None for m in lean.modules())
    assert kept.lm_head.dense is None  # the head only ever sees the last prompt row


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=native_kernels)])
def test_tied_embeddings_get_a_packed_head_copy(native):
    model = tiny_model(seed=5)
    model.lm_head = None  # tie the head to the embedding table
    ids = torch.randint(0, 48, (1, 6))
    ref = model(ids, torch.arange(6)[None], model.new_cache(64))
    quantize_(model, "int8", native=native)
    assert isinstance(model.lm_head, NativeLinear if native else Int8Linear)
    out = model(ids, torch.arange(6)[None], model.new_cache(64))
    assert (out - ref).norm() < 0.15 * ref.norm()  # random weights amplify the error


def test_bad_requests_raise_clear_errors_and_leave_the_model_alone():
    model = tiny_model(seed=6)
    with pytest.raises(QuantizationError, match="unknown quantization"):
        quantize_(model, "int3")
    with pytest.raises(QuantizationError, match="group size"):
        quantize_(model, "int4", group_size=48)
    with pytest.raises(QuantizationError, match="does not divide"):
        quantize_(tiny_model(seed=6), "int4", group_size=128)  # hidden size 64
    assert not is_quantized(model)
    with pytest.raises(QuantizationError, match="multiple of 16"):
        Int4Linear(dense(n=40), 32)
    with pytest.raises(QuantizationError, match="CPU kernels"):
        quantize_(model.to("meta"), "int8")  # any non-CPU device


def test_default_threads_are_the_usable_physical_cores():
    assert 1 <= physical_cores() <= os.cpu_count()
    before = torch.get_num_threads()
    try:
        assert set_threads() == physical_cores() == torch.get_num_threads()
        with pytest.raises(ValueError, match="positive integer"):
            set_threads(0)
    finally:
        torch.set_num_threads(before)


def test_cli_flags_reach_the_parser():
    from verispec.cli import build_parser

    args = build_parser().parse_args(["generate", "m", "p", "--quantization", "int4", "--quantization-group-size",
                                      "64", "--compile", "--threads", "1"])
    assert (args.quantization, args.quantization_group_size, args.compile, args.threads) == ("int4", 64, True, 1)
    defaults = build_parser().parse_args(["generate", "m", "p"])
    assert (defaults.quantization, defaults.compile, defaults.threads) == ("auto", False, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "m", "p", "--quantization", "int3"])


@pytest.mark.skipif(not os.path.isfile("/proc/cpuinfo"), reason="needs /proc/cpuinfo (Linux)")
def test_native_bf16_probe_agrees_with_the_cpu_flags():
    """The probe that picks the prefill path (and whether quantized layers keep dense copies)
    must see what the kernel reports: a wrong answer silently costs a 5x slower prefill."""

    flags = set()
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    assert kernels.cpu_has_native_bf16() == bool(flags & {"avx512_bf16", "amx_bf16", "amx_tile"})


def test_dense_prefill_copies_follow_the_override_and_never_come_without_native_bf16(monkeypatch):
    from verispec.models import native

    decide = native.dense_prefill_pays.__wrapped__  # the uncached decision
    monkeypatch.setattr(native, "measure_prefill_paths", lambda: pytest.fail("measured despite the override"))
    monkeypatch.setenv(native.DENSE_PREFILL_ENV, "1")
    monkeypatch.setattr(kernels, "cpu_has_native_bf16", lambda: False)
    assert decide() is False  # a bf16 GEMM without bf16 arithmetic is never the faster prefill
    monkeypatch.setattr(kernels, "cpu_has_native_bf16", lambda: True)
    if not kernels.available():
        assert decide() is False
        return
    assert decide() is True
    monkeypatch.setenv(native.DENSE_PREFILL_ENV, "0")
    assert decide() is False
    monkeypatch.setenv(native.DENSE_PREFILL_ENV, "yes")
    with pytest.raises(ValueError, match="VERISPEC_DENSE_PREFILL must be 0 or 1"):
        decide()


@pytest.mark.skipif(not kernels.available(), reason="needs the native kernels")
def test_the_measured_prefill_choice_is_taken_once_and_kept(monkeypatch, tmp_path):
    from verispec.models import native

    decide = native.dense_prefill_pays.__wrapped__
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    monkeypatch.delenv(native.DENSE_PREFILL_ENV, raising=False)
    monkeypatch.setattr(kernels, "cpu_has_native_bf16", lambda: True)
    native_s, dense_s = native.measure_prefill_paths(repeats=1)  # the real probe runs and times both
    assert 0 < native_s < 10 and 0 < dense_s < 10
    monkeypatch.setattr(native, "measure_prefill_paths", lambda: (2.0, 1.0))  # the GEMM twice as fast
    assert decide() is True
    kept = native._prefill_choice_path()
    assert kept.is_relative_to(tmp_path) and json.loads(kept.read_text())["dense"] is True
    monkeypatch.setattr(native, "measure_prefill_paths", lambda: pytest.fail("measured again"))
    assert decide() is True  # read back, not measured
    kept.write_text("{not json")
    monkeypatch.setattr(native, "measure_prefill_paths", lambda: (1.2, 1.0))  # below the minimum gain
    assert decide() is False
    assert json.loads(kept.read_text())["dense"] is False


@pytest.mark.skipif(not kernels.available(), reason="needs the native kernels")
@pytest.mark.parametrize("pays", [True, False])
def test_native_layers_keep_dense_copies_where_the_measurement_says(monkeypatch, pays):
    from verispec.models import native

    monkeypatch.setattr(native, "dense_prefill_pays", lambda: pays)
    model = quantize_(tiny_model(seed=3, dtype=torch.float32), "int8", native=True)
    layers = [m for m in model.modules() if isinstance(m, NativeLinear) and m is not model.lm_head]
    assert layers and all((m.dense is not None) == pays for m in layers)
    assert model.prefills_on_the_decode_kernels() is not pays


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch without oneDNN")
def test_dense_copies_in_onednn_layout_multiply_as_the_plain_weight():
    """The prefill copies are kept reordered for oneDNN (no reorder per call); a product through
    one is F.linear's on the plain weight up to the bf16 rounding of the output."""
    from verispec.models.native import dense_linear, onednn_weight

    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(96, 64, generator=gen).to(torch.bfloat16)
    bias = torch.randn(96, generator=gen).to(torch.bfloat16)
    packed = onednn_weight(weight)
    assert packed.is_mkldnn and packed.dtype == torch.bfloat16
    assert torch.equal(packed.to_dense(), weight)
    for rows in (1, 7, 64, 130):
        x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
        got, want = dense_linear(x, packed, bias), nn.functional.linear(x, weight, bias)
        assert got.shape == want.shape == (rows, 96) and got.dtype == torch.bfloat16
        # both accumulate in float32 and round once to bf16 (relative step 2^-8)
        assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7)
    # what oneDNN cannot take stays as it is, for F.linear
    f32 = torch.randn(8, 4, generator=gen)
    assert onednn_weight(f32) is f32 and onednn_weight(None) is None


@pytest.mark.skipif(not kernels.available(), reason="needs the native kernels")
def test_a_native_model_with_dense_copies_deep_copies():
    """oneDNN-layout copies have no storage for copy.deepcopy; the layer copies them as plain
    tensors and reorders again, so the copy prefills as the original does."""
    model = quantize_(tiny_model(seed=4, dtype=torch.float32), "int8", dense_prefill=True, native=True)
    twin = copy.deepcopy(model)
    layer, other = model.layers[0].gate_up, twin.layers[0].gate_up
    assert other.dense is not layer.dense and torch.equal(other.dense_weight(), layer.dense_weight())
    assert other.dense.is_mkldnn == layer.dense.is_mkldnn == torch.backends.mkldnn.is_available()
    ids = torch.randint(0, 48, (1, PREFILL_MIN_TOKENS + 3), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(ids.shape[1])[None]
    want = model(ids, positions, model.new_cache(128), prefill=True)
    assert torch.equal(twin(ids, positions, twin.new_cache(128), prefill=True), want)
