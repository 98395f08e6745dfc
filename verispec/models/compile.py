"""``torch.compile`` for the decode and verify steps, with shapes bucketed so nothing recompiles per step.

Only the two dense, row-wise halves of each layer are compiled (norm + q/k/v projection + RoPE,
and output projection + MLP with their residuals; see
:class:`~verispec.models.decoder.LayerSteps`). The KV-cache writes and the attention stay eager:
they depend on the cache length, which changes every step.

**Buckets.** A pass with T new positions is padded with zero rows to the next bucket in
:data:`BUCKETS` (1, 2, 4, ..., 64) and compiled with static shapes, so a model compiles at most
``len(BUCKETS)`` graphs per half, each once per process (the compiled code is also cached on
disk by inductor). The padding rows are sliced off before anything reads them; every op inside
is row-wise, so they cannot change the real rows. Passes longer than the last bucket, and the
float32 long-prefill passes, run eagerly. Compiling the whole model forward instead would guard
on the cache length and recompile every step.

**Exactness.** Compiled kernels need not round like eager ones, so a compiled model is a
(slightly) different model from the eager one. Speculation stays lossless with respect to the
compiled model as long as a row's result does not depend on the bucket it was computed in;
``tests/models/test_compile.py`` checks that bitwise, and greedy identity with plain decoding of
the same compiled model.

**When it pays.** On CPUs without native bf16 arithmetic, inductor replaces the bf16
matrix-vector products with slower generated code, so compiled decode can be slower there, and
the first compile of each bucket takes tens of seconds (docs/benchmarks/quant.md). It is therefore off by
default (``--compile`` turns it on). CUDA graphs are not used: a compiled half's output feeds the
next layer's call of the same graph, which graph replay would overwrite.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from verispec.models.decoder import Decoder, DecoderLayer, LayerSteps

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket(t: int) -> int | None:
    """The smallest bucket holding ``t`` positions, or None when ``t`` exceeds every bucket."""
    return next((b for b in BUCKETS if b >= t), None)


def _pad(x: Tensor, rows: int, dim: int) -> Tensor:
    """Append ``rows`` zero rows along ``dim`` (counted from the end: -2 for [..., T, C])."""
    pad = [0, 0] * (-dim - 1) + [0, rows]
    return F.pad(x, pad) if rows else x


class CompiledSteps(LayerSteps):
    """Compiled, bucket-padded versions of the layer halves (one compiled function each)."""

    def __init__(self) -> None:
        self._attention_inputs = torch.compile(DecoderLayer.attention_inputs, dynamic=False)
        self._output = torch.compile(DecoderLayer.output, dynamic=False)

    def attention_inputs(self, layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor,
                         prefill: bool) -> tuple[Tensor, Tensor, Tensor]:
        t = x.shape[1]  # x: [B, T, hidden]; cos, sin: [B, 1, T, D]
        size = bucket(t)
        if size is None:
            return layer.attention_inputs(x, cos, sin, prefill)
        extra = size - t
        q, k, v = self._attention_inputs(layer, _pad(x, extra, -2), _pad(cos, extra, -2), _pad(sin, extra, -2), prefill)
        return q[:, :, :t], k[:, :, :t], v[:, :, :t]  # [B, heads, T, D]

    def output(self, layer: DecoderLayer, x: Tensor, attn: Tensor, prefill: bool) -> Tensor:
        t = x.shape[1]  # x: [B, T, hidden]; attn: [B, T, H*D]
        size = bucket(t)
        if size is None:
            return layer.output(x, attn, prefill)
        return self._output(layer, _pad(x, size - t, -2), _pad(attn, size - t, -2), prefill)[:, :t]


def compile_decoder(model: Decoder) -> Decoder:
    """Make ``model`` run its decode and verify steps compiled (in place); returns it.

    Compilation itself happens lazily, on the first pass of each bucket. Verify passes are
    compiled, and so exact, up to the last bucket: k + 1 <= 64 draft positions.
    """
    model.steps = CompiledSteps()
    return model
