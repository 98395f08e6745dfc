"""A decoder's LM head as dense weights, whatever layer runs it.

Speculative heads read the target's LM head: Medusa heads that share it multiply by its rows for
their draft vocabulary, and training initialises a head's own LM head from those rows. The
weights returned are the ones the target multiplies by, so a head sees the target's head exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from verispec import kernels
from verispec.models.native import NativeLinear


def lm_head_weight(decoder) -> Tensor:
    """The target's LM head as dense weights ``[V, H]``: the embedding table when they are tied,
    an ``nn.Linear``'s weight, or a native layer's GGUF blocks dequantized (the exact weights the
    kernels multiply by)."""
    head = decoder.lm_head
    if head is None:
        return decoder.embed.weight
    if isinstance(head, NativeLinear):
        return torch.cat([kernels.dequantize(p) for p in head.parts])
    weight = getattr(head, "weight", None)
    if not isinstance(weight, Tensor):
        raise ValueError(f"cannot read the target's LM head ({type(head).__name__}) as dense weights: "
                         "use --quantization none")
    return weight
