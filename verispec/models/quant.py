"""Weight-only int8/int4 for dense checkpoints.

A GGUF model needs none of this: on the CPU it runs its own quantized weights on the native
kernels (:mod:`verispec.models.native`). :func:`quantize_` serves Hugging Face checkpoints (and
``--quantization int8|int4`` on a GGUF's dequantized weights).

**On the native kernels** (the default where they are available and every layer fits them):
``int8`` becomes GGUF's Q8_0 and ``int4`` (groups of 32) its Q4_1, quantized by gguf's reference
code, and the layers run exactly as a GGUF model's do (row-invariant, several times faster than
the PyTorch kernels below; :func:`verispec.models.native.quantize_native_`).

**On PyTorch's kernels** (``native=False``, int4 groups of 64 or 128, or no native kernels), the
decoder's ``nn.Linear`` layers become modules that keep their weights packed:

* ``int8`` -- symmetric, one scale per output channel: ``w ~= q * scale``, ``q`` in [-127, 127];
  ``aten._weight_int8pack_mm``.
* ``int4`` -- asymmetric, one (scale, zero) pair per group of ``group_size`` input channels,
  ``w ~= (q - 8) * scale + zero``, ``q`` in [0, 15]; ``aten._weight_int4pack_mm_for_cpu``.
  Group 32 matches the sub-blocks of the bundled Q4_K files.

Activations enter the kernels in bfloat16 (their float32 path is many times slower) and the
output is cast back to the input's dtype.

**Prefill.** The packed kernels are built for a few rows. Where the CPU has native bf16
arithmetic (AVX512-BF16, AMX), a layer also keeps ``dense``, its dequantized weight in bf16, and a
prompt's prefill pass multiplies by it (the decoder decides, see ``PREFILL_MIN_TOKENS``). Decode
and verify passes never do, so their rows stay batch invariant; plain and speculative decoding
prefill alike.

**Exactness.** Both kernels compute each output row the same way whatever the number of rows M
(tested bitwise), so speculative decoding stays lossless with respect to the model actually run.

**What is quantized.** Every decoder-layer projection gets the chosen scheme; the LM head gets
int8 under both (it is the most precision-sensitive product and 15-30% of a small model's
bytes), a packed copy of the embedding table when they are tied. The embedding lookup itself
stays in its dtype. Other devices raise :class:`QuantizationError`.

Measurements behind these choices: ``docs/benchmarks/quant.md``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from verispec import kernels
from verispec.models import native as native_layers

# "auto": a GGUF file on the CPU runs its own quantized weights on the native kernels ("gguf",
# see verispec.models.native) where they are available, anything else is "none" (dense weights).
SCHEMES = ("auto", "none", "gguf", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP_SIZE = 32
_COMPUTE_DTYPE = torch.bfloat16  # activations, scales and zeros


class QuantizationError(ValueError):
    """The requested quantization cannot be applied to this model or device."""


class Int8Linear(nn.Module):
    """``y = x @ (q * scale).T + bias`` with int8 ``q`` [N, K] and one bf16 scale per row."""

    def __init__(self, linear: nn.Linear, keep_dense: bool = False) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # [N, K]
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
        scale = scale.to(_COMPUTE_DTYPE)  # round first, so q is fitted to the scale actually used
        q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("qweight", q)  # [N, K] int8
        self.register_buffer("scale", scale)  # [N] bf16
        self.register_buffer("bias", _bias(linear))
        self.register_buffer("dense", self.dequantize().to(_COMPUTE_DTYPE) if keep_dense else None)

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features).to(_COMPUTE_DTYPE)  # [M, K]
        y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.scale)  # [M, N]
        return _finish(y, self.bias, x)

    def dequantize(self) -> Tensor:
        """The weight this layer multiplies by, as float32 [N, K]."""
        return self.qweight.float() * self.scale.float()[:, None]

    def dense_forward(self, x: Tensor) -> Tensor:
        return _dense_forward(self, x)


class Int4Linear(nn.Module):
    """Group-wise asymmetric int4: ``w[n, k] ~= (q - 8) * scale[g, n] + zero[g, n]``, g = k // group."""

    def __init__(self, linear: nn.Linear, group_size: int = DEFAULT_INT4_GROUP_SIZE, keep_dense: bool = False) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # [N, K]
        n, k = w.shape
        _check_int4_shape(n, k, group_size)
        self.in_features, self.out_features, self.group_size = k, n, group_size
        groups = w.view(n, k // group_size, group_size)  # [N, G, group]
        lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)  # [N, G]
        scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny).to(_COMPUTE_DTYPE).float()
        zero = (lo + 8 * scale).to(_COMPUTE_DTYPE).float()
        q = torch.round((groups - zero[..., None]) / scale[..., None] + 8).clamp(0, 15)
        q = q.to(torch.int32).view(n, k)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))  # [N, K/2] uint8
        # [G, N, 2]: the kernel's layout, (scale, zero) per group and output channel
        self.register_buffer("scales_zeros", torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous()
                             .to(_COMPUTE_DTYPE))  # fmt: skip
        self.register_buffer("bias", _bias(linear))
        # (q - 8) * scale + zero, the weight the kernel unpacks, rounded to bf16
        dense = ((q.view(n, k // group_size, group_size).float() - 8) * scale[..., None] + zero[..., None]).view(n, k)
        self.register_buffer("dense", dense.to(_COMPUTE_DTYPE) if keep_dense else None)

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features).to(_COMPUTE_DTYPE)  # [M, K]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_zeros)
        return _finish(y, self.bias, x)

    def dequantize(self) -> Tensor:
        """The weight this layer multiplies by, as float32 [N, K] (the kernel applied to an identity)."""
        eye = torch.eye(self.in_features, dtype=torch.float32)  # float32 in, so the output is exact
        cols = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group_size, self.scales_zeros.float())
        return cols.t().contiguous()


    def dense_forward(self, x: Tensor) -> Tensor:
        return _dense_forward(self, x)


def _dense_forward(layer: Int8Linear | Int4Linear, x: Tensor) -> Tensor:
    """``x`` times the layer's dense bf16 weight (a prefill pass; see the module docstring)."""
    y = F.linear(x.reshape(-1, layer.in_features).to(_COMPUTE_DTYPE), layer.dense)
    return _finish(y, layer.bias, x)


def _bias(linear: nn.Linear) -> Tensor | None:
    return None if linear.bias is None else linear.bias.detach().clone()


def _finish(y: Tensor, bias: Tensor | None, x: Tensor) -> Tensor:
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*x.shape[:-1], y.shape[-1])


def _check_int4_shape(n: int, k: int, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise QuantizationError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if k % group_size:
        fits = [g for g in INT4_GROUP_SIZES if k % g == 0] or "none"
        raise QuantizationError(
            f"int4 group size {group_size} does not divide a layer's input width {k}; "
            f"group sizes that do: {fits}"
        )
    if n % 16:  # the CPU packing works on blocks of 16 output channels
        raise QuantizationError(f"int4 needs a multiple of 16 output channels, got a layer with {n}")


def check_scheme(scheme: str, group_size: int = DEFAULT_INT4_GROUP_SIZE) -> str:
    """Validate a scheme name (and the int4 group size) before any model is loaded."""
    if scheme not in SCHEMES:
        raise QuantizationError(f"unknown quantization {scheme!r}; valid: {', '.join(SCHEMES)}")
    if scheme == "int4" and group_size not in INT4_GROUP_SIZES:
        raise QuantizationError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    return scheme


def quantize_(model: nn.Module, scheme: str, group_size: int = DEFAULT_INT4_GROUP_SIZE,
              dense_prefill: bool | None = None, native: bool | None = None) -> nn.Module:
    """Replace ``model``'s linear layers in place (policy in the module docstring); returns it.

    ``model`` is a :class:`~verispec.models.decoder.Decoder`. ``scheme`` is ``"none"`` (a no-op),
    ``"int8"`` or ``"int4"``. Every shape is checked before any layer is replaced, so a failure
    leaves the model as it was. ``dense_prefill``: keep dense bf16 copies of the decoder layers'
    weights for prompt prefill; by default where the CPU has native bf16 arithmetic (on the
    native kernels: where that measures faster, :func:`~verispec.models.native.dense_prefill_pays`).
    ``native``: run on the native kernels (True: or fail saying why), on PyTorch's (False), or
    on the native ones where they can (None).
    """
    check_scheme(scheme, group_size)
    if scheme not in ("int8", "int4"):  # auto and gguf are the loader's (verispec.models.native)
        return model
    if model.device.type != "cpu":
        raise QuantizationError(
            f"--quantization {scheme} uses PyTorch's CPU kernels; it is not implemented on "
            f"{model.device.type} (use --quantization none there)"
        )
    packed = [m for layer in model.layers for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
              if not isinstance(m, nn.Linear)]
    if packed:
        raise QuantizationError(
            f"--quantization {scheme} packs dense weights, and this model's layers are already quantized "
            f"({type(packed[0]).__name__}); load it with quantization='none' first"
        )
    if native is not False:
        why = native_layers.native_unfit(model, scheme, group_size)
        if why is None:
            prefill_copies = native_layers.dense_prefill_pays() if dense_prefill is None else bool(dense_prefill)
            native_layers.quantize_native_(model, scheme, prefill_copies)
            return model
        if native:
            raise QuantizationError(f"--quantization {scheme} cannot run on the native kernels: {why}")
    if dense_prefill is None:
        dense_prefill = kernels.cpu_has_native_bf16()
    keep = bool(dense_prefill)
    make = (lambda lin: Int8Linear(lin, keep)) if scheme == "int8" else (lambda lin: Int4Linear(lin, group_size, keep))
    if scheme == "int4":
        for layer in model.layers:
            for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
                _check_int4_shape(lin.out_features, lin.in_features, group_size)
    for layer in model.layers:
        layer.qkv, layer.o_proj = make(layer.qkv), make(layer.o_proj)
        layer.gate_up, layer.down = make(layer.gate_up), make(layer.down)
    head = model.lm_head if model.lm_head is not None else native_layers.as_linear(model.embed.weight)
    model.lm_head = Int8Linear(head)
    return model


def is_quantized(model: nn.Module) -> bool:
    """Whether any layer runs packed weights (PyTorch's kernels or the native ones)."""
    return any(isinstance(m, (Int8Linear, Int4Linear, native_layers.NativeLinear)) for m in model.modules())
