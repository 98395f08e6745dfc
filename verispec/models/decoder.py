"""One decoder for the Llama family and its relatives: Llama, Qwen2, Qwen3, Mistral, SmolLM2, Phi-3,
Gemma 2 and Gemma 3.

The architectures differ only by configuration (qkv bias, tied embeddings, RoPE base and
scaling, grouped-query attention, RMSNorm epsilon, sliding window), so one implementation serves
them all. Qwen3 and Gemma 3 add per-head RMSNorms on q and k; Gemma 3 also scales the embedding
by sqrt(hidden), stores its norms as ``w`` applied as ``1 + w`` (folded into the weight on load),
wraps attention and MLP in norms on both sides, uses GeGLU (tanh GELU), a query scale of
``query_pre_attn_scalar ** -0.5``, and alternates sliding-window layers (their own RoPE base)
with global ones (``layer_types``). Gemma 2 has no q/k norms and no local RoPE base but caps its
attention scores and final logits (``cap * tanh(x / cap)``); capped attention runs in PyTorch,
as the native attention kernel has no cap. Weights arrive under Hugging Face names and are fused on
load: q/k/v into one projection and gate/up into another, which halves the matmul calls per
layer (Phi-3 stores them fused already). Layers of the plain Llama form may run as one native
call (:func:`verispec.models.native.native_layer`); the others run this module's Python layer,
with native projections where the GGUF's blocks allow.

A sliding window is applied by RoPE position: a row at position p attends to keys at positions
> p - window, where an entry cached by an earlier pass sits at its position (committed entries
form a chain) and the pass's own entries have the positions it gives them (a tree's depths), so
decode, verify and tree passes mask a row alike.

Numerics are designed for *batch invariance*: a token's logits do not depend on how many other
rows share the pass. Every reduction runs over the same length whatever T is (linear layers in
bf16 are row-invariant on CPU; attention reduces over a cache length padded to a block, see
:mod:`verispec.models.kv_cache`). That is what lets greedy speculative decoding reproduce plain
greedy decoding token for token.
"""

from __future__ import annotations

import contextlib
import math
import operator
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from verispec.models.errors import SUPPORTED_ARCHITECTURES, UnsupportedModelError
from verispec.models.kv_cache import KVCache
from verispec import kernels
from verispec.models.native import NativeLinear, native_layer

@dataclass(frozen=True)
class DecoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    qkv_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None  # applies to every layer unless layer_types says which
    max_position_embeddings: int = 4096
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms on attention's and the MLP's outputs too (Gemma 2/3)
    norm_offset: float = 0.0  # checkpoint norm weights w scale by norm_offset + w (Gemma: 1)
    hidden_act: str = "silu"  # the gated MLP's activation: silu or gelu_pytorch_tanh
    embed_scale: bool = False  # multiply embeddings by sqrt(hidden_size) (Gemma)
    layer_types: tuple[str, ...] | None = None  # per layer: sliding_attention or full_attention
    rope_local_theta: float | None = None  # RoPE base of sliding_attention layers (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale is its ** -0.5 (default head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    attn_logit_softcapping: float | None = None  # the same on attention scores (Gemma 2)

    @property
    def llama_layers(self) -> bool:
        """Whether every layer has the plain Llama form that the native one-call layer runs."""
        return (not self.qk_norm and not self.sandwich_norms and self.hidden_act == "silu"
                and self.layer_types is None and self.attn_scale == self.head_dim**-0.5
                and self.attn_logit_softcapping is None)

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: it attends to every earlier position)."""
        if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window

    @classmethod
    def from_hf(cls, cfg: Mapping) -> DecoderConfig:
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x layout)."""
        archs = list(cfg.get("architectures") or [])
        arch = archs[0] if archs else _arch_from_model_type(cfg.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {arch!r} (model_type={cfg.get('model_type')!r}); "
                f"verispec supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        rope_params = dict(cfg.get("rope_parameters") or {})
        local_params = {}
        if "full_attention" in rope_params:  # transformers 5: one set per layer type (Gemma 3)
            local_params = dict(rope_params.get("sliding_attention") or {})
            rope_params = dict(rope_params["full_attention"] or {})
        rope_scaling = cfg.get("rope_scaling") or None
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        rope_theta = cfg.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
        num_heads = cfg["num_attention_heads"]
        sliding = cfg.get("sliding_window")
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not cfg.get("use_sliding_window", False):
            sliding = None
        gemma = arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModelError(f"partial rotary embeddings (factor {cfg['partial_rotary_factor']}) are not supported")
        layer_types = None
        if gemma:
            pattern = cfg.get("sliding_window_pattern", 6 if arch == "Gemma3ForCausalLM" else 2)
            layer_types = tuple(cfg.get("layer_types") or (
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(cfg["num_hidden_layers"])))
            if local_params.get("rope_type", "default") != "default":
                raise UnsupportedModelError(f"unsupported rope scaling {local_params['rope_type']!r} on sliding layers")
        local_theta = local_params.get("rope_theta") or cfg.get("rope_local_base_freq")
        if arch == "Gemma3ForCausalLM" and not local_theta:
            local_theta = 10000.0
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=_check_rope_scaling(rope_scaling),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=sliding,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            sandwich_norms=gemma,
            norm_offset=1.0 if gemma else 0.0,
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            embed_scale=gemma,
            layer_types=layer_types,
            rope_local_theta=float(local_theta) if local_theta else None,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma else None,
            final_logit_softcapping=cfg.get("final_logit_softcapping") or None,
            attn_logit_softcapping=cfg.get("attn_logit_softcapping") or None,
        )


def _arch_from_model_type(model_type: str | None) -> str:
    return {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
            "phi3": "Phi3ForCausalLM"}.get(
        model_type or "", f"<model_type {model_type!r}>"
    )


def _check_rope_scaling(scaling: dict | None) -> dict | None:
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind not in ("default", "linear", "llama3"):
        raise UnsupportedModelError(
            f"unsupported rope scaling {kind!r}; verispec supports: default, linear, llama3"
        )
    return None if kind == "default" else {**scaling, "rope_type": kind}


def rope_inv_freq(config: DecoderConfig, local: bool = False) -> Tensor:
    """RoPE inverse frequencies [head_dim/2], with linear or llama3 scaling applied; ``local``:
    those of sliding-window layers (their own base, unscaled) where the config has them."""
    d = config.head_dim
    theta = config.rope_local_theta if local and config.rope_local_theta else config.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = config.rope_scaling
    if s is None or (local and config.rope_local_theta):
        return inv
    if s["rope_type"] == "linear":
        return inv / s["factor"]
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(medium, blended, scaled)


@dataclass
class DecoderOutput:
    logits: Tensor  # [batch, n_logits, vocab] float32
    # HF convention: [embeddings, layer_1, ..., layer_L normed], each [batch, T, hidden]
    hidden_states: list[Tensor] | None = None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# A prompt's prefill (the engine's first pass over a prompt, and a draft model's first read of
# it) with at least this many tokens may take a faster path than decode steps: on CPUs without
# native bf16 arithmetic it computes in float32, where a bf16 GEMM is several times slower than
# upcasting the weight and running an fp32 GEMM (measured 5.5x at 800 rows on an AVX2 machine);
# on CPUs with it (AVX512-BF16, AMX), packed quantized layers may multiply by a dense bf16 copy
# of their weight instead of running their packed kernel (PyTorch's int4 kernel was about eight
# times slower than a bf16 GEMM on a long prompt with AMX; the native kernels keep such copies
# only where they measure faster, see verispec.models.native.dense_prefill_pays); dense
# layers run one GEMM over all rows instead of row-invariant chunks
# (:func:`invariant_linear`). Only a pass the caller marks as a prefill takes it, so decode and
# verify passes, however wide, keep the batch-invariant path; a prompt is prefilled the same way
# by plain and speculative decoding, so exactness is unaffected.
PREFILL_MIN_TOKENS = 64

# A prefill pass's output projection and MLP run on at most this many rows at a time (in equal
# blocks): over all rows at once, the MLP's float32 intermediates (8960 x 2 wide for the 1.5B
# model: 70 KB a row) leave the caches, and torch's elementwise ops between the GEMMs become
# bound by memory. With the dense bf16 copies, blocks of 256 took about a fifth off prompts of
# 500 to 1,000 tokens; blocks of 64 or 128 rows were slower, 384 and 512 no faster
# (docs/kernels.md, Prompts' prefill).
PREFILL_ROW_BLOCK = 256


def _upcast(x: Tensor) -> bool:
    """Whether a prefill pass computes in float32: half-precision activations on a CPU without
    native bf16 arithmetic."""
    return x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and not kernels.cpu_has_native_bf16()


# Dense matmuls of decode and verify passes run on at most this many rows at a time.
ROW_CHUNK = 16


def invariant_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` with every output row computed as it would be alone.

    CPU GEMM libraries pick their kernel and blocking from the problem shape, so a row's last
    bits can change with the number of rows beside it. Measured with torch 2.13 on a CPU with AMX
    (native bf16): a one-row bf16 product takes another kernel than a multi-row one, and with the
    1.5B model's real weights the 8960-wide down projection already differs at 2-4 rows; a
    ``[1, T, K]`` input with a wide output (gate/up, LM head) changes from T = 13. So the input is
    flattened to 2-D and multiplied ``ROW_CHUNK`` rows at a time, and on such CPUs each chunk of
    bf16 rows is padded with zero rows to ``ROW_CHUNK``: every pass, a one-token decode step
    included, then runs the same kernel on the same shape, and a row's result depends only on that
    row. Padding costs little there (the product is bound by reading the weight, and AMX computes 16
    rows in about the time of one: a few per cent per layer, about half again for the 151936-wide
    tied LM head of a bf16 model); without native bf16 a multi-row bf16 product is compute bound,
    the kernels there keep rows invariant unpadded (tested), and none is added. float32 rows are
    padded on every CPU: torch 2.13's float32 GEMM with AMX changed rows with the row count in all
    three of the linear, attention and whole-model tests, and native models run their activations
    (attention included) in float32.
    """
    if torch.compiler.is_compiling():
        # The compiled steps pad rows to their own buckets, and inductor's code for the plain
        # product keeps rows invariant across buckets; chunking or padding here broke that
        # (tests/models/test_compile.py).
        return F.linear(x, weight, bias)
    y = _by_row_chunks(x.reshape(-1, x.shape[-1]), lambda rows: F.linear(rows, weight, bias))
    return y.view(*x.shape[:-1], y.shape[-1])


def invariant_matmul(a: Tensor, b: Tensor) -> Tensor:
    """``torch.matmul(a, b)`` for ``a [..., M, K]``, with every row of ``a`` computed as it
    would be alone (see :func:`invariant_linear`). Attention needs it too: with AMX the
    probs @ V product of 42 rows (7 tokens x 6 query heads per KV head) and of 6 rows (one
    decode step) round differently over 768 keys, which made a Qwen 1.5B verify pass of 7
    tokens disagree with plain decoding."""
    return _by_row_chunks(a, lambda rows: torch.matmul(rows, b))


def _by_row_chunks(x: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """``fn`` applied to ``x [..., M, K]`` ``ROW_CHUNK`` rows (dim -2) at a time, each chunk of
    float32 rows, and of bf16 rows on CPUs with native bf16, zero-padded to ``ROW_CHUNK``; ``fn``
    must be row-wise."""
    pad = x.device.type == "cpu" and (x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and kernels.cpu_has_native_bf16()))
    outs = []
    for rows in x.split(ROW_CHUNK, dim=-2):
        n = rows.shape[-2]
        if pad and n < ROW_CHUNK:
            rows = F.pad(rows, (0, 0, 0, ROW_CHUNK - n))  # zero rows below
        out = fn(rows)
        outs.append(out if out.shape[-2] == n else out[..., :n, :])
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


def linear(layer: nn.Module, x: Tensor, prefill: bool) -> Tensor:
    """``layer(x)`` with dense layers made row invariant (:func:`invariant_linear`), or on a
    prefill pass its faster prefill form (see ``PREFILL_MIN_TOKENS``): a packed quantized
    layer's dense bf16 copy where it keeps one, a dense ``nn.Linear`` in one GEMM, in float32
    where :func:`_upcast` says so."""
    if prefill:
        if getattr(layer, "dense", None) is not None:
            return layer.dense_forward(x)
        if isinstance(layer, nn.Linear) and _upcast(x):
            bias = None if layer.bias is None else layer.bias.float()
            return F.linear(x.float(), layer.weight.float(), bias).to(x.dtype)
        return layer(x)
    if isinstance(layer, nn.Linear):
        return invariant_linear(x, layer.weight, layer.bias)
    return layer(x)


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None,
                      softcap: float | None = None) -> Tensor:
    """Masked attention with grouped-query heads, written to be batch invariant.

    q: [B, H, T, D]; k, v: [B, Hkv, S, D]; mask: [B, 1, T, S] bool (True = attend); ``scale``
    multiplies the scores (default ``D ** -0.5``), then ``softcap``, if any, caps them
    (``cap * tanh(s / cap)``, Gemma 2).
    The G = H / Hkv query heads that share a KV head are folded into the rows of one matmul, so
    K and V are never repeated. Scores and softmax run in float32. Each output row reduces over
    exactly S keys whatever T is; ``F.scaled_dot_product_attention`` on CPU does not guarantee
    that (its output rows change with T for long caches), so it is not used here.
    """
    b, h, t, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    qg = q.reshape(b, hkv, g * t, d)  # rows ordered (head-in-group, token)
    scores = _cap(invariant_matmul(qg, k.transpose(-1, -2)).float() * (scale or d**-0.5), softcap)  # [B, Hkv, G*T, S]
    scores = scores.view(b, hkv, g, t, -1).masked_fill(~mask[:, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, hkv, g * t, -1)
    return invariant_matmul(probs, v).reshape(b, h, t, d)


@dataclass(frozen=True)
class RowKeys:
    """The keys of a masked pass, listed per row: what a tree verify pass attends to.

    ``index[b, i]`` lists the cache indices row ``i`` attends to, in cache order, followed by
    the others; ``mask[b, i]`` is True on the first ``n_i`` entries (a causal row's layout).
    Worked example, a row attending to cached 0..9 and tree entries 10 and 13 of 16::

        index = [0..9, 10, 13, 11, 12, 14, 15]    mask = [True * 12, False * 4]
    """

    index: Tensor  # [B, T, S] int64
    mask: Tensor  # [B, T, S] bool
    attend: Tensor | None = None  # [B, T, S] bool: the mask in cache order, True = attend

    @classmethod
    def from_mask(cls, mask: Tensor) -> RowKeys:
        """From a ``[B, T, S]`` bool mask (True = attend)."""
        index = torch.sort((~mask).to(torch.uint8), dim=-1, stable=True).indices  # [B, T, S]
        return cls(index, mask.gather(-1, index), mask)


def native_attention(q: Tensor) -> bool:
    """Whether a pass's attention runs on :func:`verispec.kernels.attention`: float32 passes on
    a CPU with the native kernels, long prompts' prefill included. torch's float32 matmuls
    change a row's bits with the number of keys a pass attends over (see
    ``csrc/attention.cpp``); the native kernel's rows depend only on their own keys. For a
    prompt it is also the faster one: it runs a pass's positions together over each block of
    keys, and measured faster than torch's fused ``scaled_dot_product_attention`` from 64 to
    700 positions (docs/kernels.md)."""
    return q.device.type == "cpu" and q.dtype == torch.float32 and q.shape[-1] % 16 == 0 and kernels.available()


def _cap(scores: Tensor, softcap: float | None) -> Tensor:
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def row_attention(q: Tensor, k: Tensor, v: Tensor, rows: RowKeys, scale: float | None = None,
                  softcap: float | None = None) -> Tensor:
    """Attention in which every row reduces over its own keys packed to the front.

    q: [B, H, T, D]; k, v: [B, Hkv, S, D]. Each row gathers its keys and values into the
    layout a plain decode step at the same position has (its attended keys at indices
    0 .. n-1, in cache order), and runs the same matmuls as :func:`grouped_attention` with
    T = 1. A tree's rows attend to scattered entries; the CPU kernels' softmax and
    probs @ V reductions group terms by absolute index, so attending in place would not be
    bitwise equal to a decode step. The gather costs T copies of the attended K/V.
    """
    b, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = h // hkv
    idx = rows.index[:, None, :, :, None].expand(b, hkv, t, s, d)  # [B, Hkv, T, S, D]
    keys = k[:, :, None].expand(b, hkv, t, s, d).gather(3, idx)  # [B, Hkv, T, S, D]
    values = v[:, :, None].expand(b, hkv, t, s, d).gather(3, idx)
    qg = q.reshape(b, hkv, g, t, d).transpose(2, 3)  # [B, Hkv, T, G, D]
    scores = _cap(invariant_matmul(qg, keys.transpose(-1, -2)).float() * (scale or d**-0.5), softcap)  # [B, Hkv, T, G, S]
    scores = scores.masked_fill(~rows.mask[:, None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = invariant_matmul(probs, values)  # [B, Hkv, T, G, D]
    return out.transpose(2, 3).reshape(b, h, t, d)


class DecoderLayer(nn.Module):
    """One layer. ``input_norm`` feeds attention and ``post_attn_norm`` feeds the MLP (HF's
    ``post_attention_layernorm`` in Llama, ``pre_feedforward_layernorm`` in Gemma); with sandwich
    norms ``attn_out_norm`` and ``mlp_out_norm`` norm each branch's output before its residual."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale, self.softcap = c.attn_scale, c.attn_logit_softcapping
        self.gelu = c.hidden_act == "gelu_pytorch_tanh"
        if c.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise UnsupportedModelError(f"unsupported MLP activation {c.hidden_act!r}; verispec runs silu and gelu_pytorch_tanh")
        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.split = (q_out, kv_out, kv_out)
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.attn_out_norm = RMSNorm(c.hidden_size, c.rms_norm_eps) if c.sandwich_norms else None
        self.mlp_out_norm = RMSNorm(c.hidden_size, c.rms_norm_eps) if c.sandwich_norms else None
        self.qkv = nn.Linear(c.hidden_size, q_out + 2 * kv_out, bias=c.qkv_bias)
        self.o_proj = nn.Linear(q_out, c.hidden_size, bias=False)
        self.gate_up = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(
        self,
        x: Tensor,  # [B, T, hidden]
        cos: Tensor,  # [B, 1, T, head_dim]
        sin: Tensor,  # [B, 1, T, head_dim]
        cache: KVCache,
        layer: int,
        slots: list[int],
        mask: Tensor | RowKeys,  # [B, 1, T, S] bool, True = attend; RowKeys for masked passes
        attend_len: int,
        prefill: bool,  # a long prompt's prefill: its faster path (see PREFILL_MIN_TOKENS)
        steps: LayerSteps,  # runs the two dense halves (eager or compiled)
    ) -> Tensor:
        b, t, _ = x.shape
        q, k, v = steps.attention_inputs(self, x, cos, sin, prefill)
        cache.write(layer, slots, k, v)
        keys, values = cache.view(layer, slots, attend_len)  # [B, Hkv, S, D]
        if native_attention(q) and self.softcap is None:  # reads a float16 cache as it is
            rows = mask.attend if isinstance(mask, RowKeys) else mask[:, 0]
            attn = kernels.attention(q, keys, values, rows, self.scale)
            return steps.output(self, x, attn.transpose(1, 2).reshape(b, t, -1), prefill)
        if keys.dtype != q.dtype:  # a cache kept in another dtype (Decoder.kv_cache_dtype)
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        if isinstance(mask, RowKeys):
            attn = row_attention(q, keys, values, mask, self.scale, self.softcap)  # [B, H, T, D]
        elif prefill and _upcast(x):
            attn = grouped_attention(q.float(), keys.float(), values.float(), mask, self.scale, self.softcap).to(x.dtype)
        elif prefill and x.dtype == torch.float32 and self.softcap is None:
            # a long prompt in float32 without the native kernels: one fused attention call. Its
            # rows need not match decode steps (plain and speculative decoding prefill alike),
            # and the row-chunked form made a long prompt's prefill measurably slower.
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True, scale=self.scale)
        else:
            attn = grouped_attention(q, keys, values, mask, self.scale, self.softcap)  # [B, H, T, D]
        return steps.output(self, x, attn.transpose(1, 2).reshape(b, t, -1), prefill)

    def attention_inputs(self, x: Tensor, cos: Tensor, sin: Tensor, prefill: bool) -> tuple[Tensor, Tensor, Tensor]:
        """Norm, fused q/k/v projection and RoPE: q [B, H, T, D], k and v [B, Hkv, T, D]. Row-wise."""
        b, t, _ = x.shape
        if not prefill and isinstance(self.qkv, NativeLinear):  # the kernels apply the norm
            qkv = self.qkv(x, norm=self.input_norm)
            if qkv.dtype == torch.float32 and cos.dtype == torch.float32 and self.q_norm is None:  # split and RoPE too
                return kernels.qkv_rope(qkv, cos, sin, self.num_heads, self.num_kv_heads)
        else:
            qkv = linear(self.qkv, self.input_norm(x), prefill)
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def output(self, x: Tensor, attn: Tensor, prefill: bool) -> Tensor:
        """Output projection and MLP, each with its residual; attn is [B, T, H*D]. Row-wise, so a
        long prefill on the CPU runs it in balanced blocks of at most ``PREFILL_ROW_BLOCK`` rows."""
        b, t, hidden = x.shape
        if prefill and b * t > PREFILL_ROW_BLOCK and x.device.type == "cpu" and self._prefills_in_blocks(x):
            blocks = -(-b * t // PREFILL_ROW_BLOCK)
            rows = zip(x.reshape(b * t, hidden).tensor_split(blocks), attn.reshape(b * t, -1).tensor_split(blocks))
            return torch.cat([self._output(xs[None], a[None], prefill)[0] for xs, a in rows]).view(b, t, hidden)
        return self._output(x, attn, prefill)

    def _prefills_in_blocks(self, x: Tensor) -> bool:
        """Only where the prefill's products are GEMMs on dense weights as they are: a packed
        layer's own kernel, or a product that casts its weight to float32 first (_upcast),
        would pay that work again per block."""
        return not _upcast(x) and all(isinstance(m, nn.Linear) or getattr(m, "dense", None) is not None
                                      for m in (self.o_proj, self.gate_up, self.down))

    def _output(self, x: Tensor, attn: Tensor, prefill: bool) -> Tensor:
        if self.gelu or self.attn_out_norm is not None:
            return self._sandwich_output(x, attn, prefill)
        if not prefill and all(isinstance(m, NativeLinear) for m in (self.o_proj, self.gate_up, self.down)):
            # the kernels add the residuals, apply the norm and make silu(gate) * up themselves
            x = self.o_proj(attn, residual=x)
            return self.down(self.gate_up(x, norm=self.post_attn_norm), glu=True, residual=x)
        x = x + linear(self.o_proj, attn, prefill)
        gate, up = linear(self.gate_up, self.post_attn_norm(x), prefill).chunk(2, dim=-1)
        return x + linear(self.down, F.silu(gate) * up, prefill)

    def _sandwich_output(self, x: Tensor, attn: Tensor, prefill: bool) -> Tensor:
        """:meth:`_output` with norms on the branches' outputs (if any) and the configured
        activation; a native layer still applies the MLP's input norm itself."""
        a = linear(self.o_proj, attn, prefill)
        x = x + (a if self.attn_out_norm is None else self.attn_out_norm(a))
        if not prefill and isinstance(self.gate_up, NativeLinear):
            gate, up = self.gate_up(x, norm=self.post_attn_norm).chunk(2, dim=-1)
        else:
            gate, up = linear(self.gate_up, self.post_attn_norm(x), prefill).chunk(2, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        m = linear(self.down, act * up, prefill)
        return x + (m if self.mlp_out_norm is None else self.mlp_out_norm(m))


class LayerSteps:
    """Runs a layer's two dense, row-wise halves; this one eagerly.

    :mod:`verispec.models.compile` provides a compiled replacement. Everything touching the
    KV cache stays outside these calls, so they see fixed shapes.
    """

    def attention_inputs(self, layer: DecoderLayer, x: Tensor, cos: Tensor, sin: Tensor,
                         prefill: bool) -> tuple[Tensor, Tensor, Tensor]:
        return layer.attention_inputs(x, cos, sin, prefill)

    def output(self, layer: DecoderLayer, x: Tensor, attn: Tensor, prefill: bool) -> Tensor:
        return layer.output(x, attn, prefill)


EAGER_STEPS = LayerSteps()


# Decoder -> (the modules its native layers were made from, the layers or None): outside the
# module, so that copying or pickling a model never meets the C++ objects.
_NATIVE_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_INIT_LOCK = threading.Lock()
_INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "xavier_uniform_", "trunc_normal_", "zeros_", "ones_")


@contextlib.contextmanager
def _no_random_init():
    """Module constructors skip their weights' random initialisation (``torch.nn.init``), as
    transformers' ``no_init_weights`` does: every weight of :meth:`Decoder.empty` is loaded
    afterwards, and on the meta device the first such call alone costs more than a second (it
    loads torch's meta kernels)."""
    with _INIT_LOCK:
        saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}
        for name in saved:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        try:
            yield
        finally:
            for name, function in saved.items():
                setattr(nn.init, name, function)


def _retype_meta_(model: nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` for the floating tensors of a model built on the meta device, by making
    new meta tensors: a conversion on the meta device would load torch's meta kernels (and sympy),
    a second or more of a load. Tensors already on a real device (RoPE's frequencies) stay."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta and p.is_floating_point() and p.dtype != dtype:
                module._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=dtype, device="meta"),
                                                        requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None and b.is_meta and b.is_floating_point() and b.dtype != dtype:
                module._buffers[name] = torch.empty(b.shape, dtype=dtype, device="meta")


class Decoder(nn.Module):
    """Causal LM (the Llama family, Qwen3, Phi-3, Gemma 2 and 3) over a :class:`KVCache`."""

    # Run each layer of a float32 pass on the native kernels as one native call
    # (:func:`verispec.models.native.native_layer`; the same bits as the Python layer, which
    # tests and benchmarks compare by setting this False on a model).
    native_layers = True

    # The KV cache's dtype (None: the model's). A native float32 model on the CPU keeps float16
    # (:func:`verispec.models.native.float_activations_`): a decode step's attention reads every
    # cached key and value once and is bound by their bytes, and each entry is rounded once, as
    # it is written, so every pass reads the same values and rows stay invariant.
    kv_cache_dtype: torch.dtype | None = None

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False
        )
        with torch.device("cpu"):  # computed, even where the model is built weightless (meta)
            inv_freq, inv_freq_local = rope_inv_freq(config), rope_inv_freq(config, local=True)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("inv_freq_local", inv_freq_local, persistent=False)
        # each layer's window and whether it takes the local RoPE base (the config is frozen)
        self._windows = tuple(config.window(i) for i in range(config.num_layers))
        self._local = tuple(w is not None and config.rope_local_theta is not None for w in self._windows)
        self.steps = EAGER_STEPS  # verispec.models.compile.compile_decoder swaps in compiled steps
        self.requires_grad_(False)

    @classmethod
    def empty(cls, config: DecoderConfig, *, dtype: torch.dtype, device: torch.device | str,
              build: Callable[[Decoder], object] | None = None) -> Decoder:
        """Allocate without initialising (weights come from :meth:`load_hf_weights`).

        ``build(model)``, if given, runs first on the weightless model (every tensor on the meta
        device) and may put finished layers in: a GGUF file's native layers, made from its
        blocks (:func:`verispec.models.native.install_gguf_layers_`). Only what is still
        weightless is then allocated, so the dense weights of those layers never exist."""
        with torch.device("meta"), _no_random_init():
            model = cls(config)
        _retype_meta_(model, dtype)
        if build is not None:
            build(model)
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None and p.is_meta:
                    # torch.empty, not empty_like: an op on a meta tensor would load the meta kernels
                    module._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                            requires_grad=False)
            for name, b in module._buffers.items():
                if b is not None and b.is_meta:
                    module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
        model.inv_freq = model.inv_freq.to(device)  # float32, computed on the CPU in __init__
        model.inv_freq_local = model.inv_freq_local.to(device)
        return model

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def rows_are_pass_invariant(self) -> bool:
        """Whether each row of a pass other than a long prompt's prefill depends only on its token,
        its position and the cache entries it attends to, bitwise, whatever else the pass holds:
        its row count, its length in the cache, where it starts. True where attention runs on the
        native kernel (:func:`native_attention`: float32 on the CPU), whose rows depend only on
        their own keys, and every linear layer is native or :func:`invariant_linear`. Then a
        prompt prefilled through the decode path leaves exactly the K/V that decode steps would,
        which prefix caching relies on (:mod:`verispec.engine.engine`). Elsewhere torch's
        attention matmuls change a row's last bits with the number of keys a pass spans."""
        return (self.device.type == "cpu" and self.dtype == torch.float32 and self.config.head_dim % 16 == 0
                and self.config.attn_logit_softcapping is None and kernels.available())

    def prefills_on_the_decode_kernels(self) -> bool:
        """Whether a long prompt's prefill runs the same linear kernels as the decode path: a
        native model whose layers keep no dense bf16 copies for prefill (those are kept where they
        measure faster, :func:`~verispec.models.native.dense_prefill_pays`). A dense model's
        prefill runs one GEMM per layer instead."""
        natives = [m for m in self.modules() if isinstance(m, NativeLinear)]
        return bool(natives) and all(m.dense is None for m in natives)


    def new_cache(self, max_len: int, num_slots: int = 1, block: int = 256) -> KVCache:
        c = self.config
        return KVCache(
            c.num_layers, num_slots, c.num_kv_heads, c.head_dim, max_len,
            dtype=self.kv_cache_dtype or self.dtype, device=self.device, block=block,
        )

    @torch.inference_mode()
    def forward(
        self,
        token_ids: Tensor,  # [B, T] int64
        positions: Tensor,  # [B, T] int64 (RoPE positions; for a chain, the cache indices)
        kv_cache: KVCache,
        attn_mask: Tensor | None = None,  # [B, T, K] bool over cache indices [0, K)
        *,
        slots: list[int] | None = None,
        num_logits: int | None = None,
        output_hidden_states: bool = False,
        prefill: bool = False,
        head: Callable[[Tensor], Tensor] | None = None,
    ) -> Tensor | DecoderOutput:
        """Run T new tokens per row, append their K/V to the cache and return logits.

        ``attn_mask`` (True = attend) covers cache indices; row b's new tokens sit at indices
        ``kv_cache.lengths[slots[b]] + [0, T)``. Without it the mask is causal. A layer's sliding
        window, if any, cuts either mask by position (see the module docstring). ``num_logits`` computes logits for the last n rows only (prefill needs
        just the last; 0 computes none). A masked pass computes every row as a decode step would (see
        :func:`row_attention`), so tree rows are bitwise equal to plain decoding. ``prefill``
        marks a prompt's first pass, which may take the faster path of ``PREFILL_MIN_TOKENS``;
        no other pass does. ``head`` replaces the model's LM head (normed hidden states
        ``[B, n, hidden]`` -> float32 ``[B, n, V']``; a draft model scoring part of its vocabulary
        passes one). Returns float32 logits ``[B, n, vocab]``, or a :class:`DecoderOutput` with
        hidden states when ``output_hidden_states``.
        """
        b, t = token_ids.shape
        slots = list(range(b)) if slots is None else slots
        if len(slots) != b:
            raise ValueError(f"got {b} rows but {len(slots)} slots")
        kv_cache.check_room(slots, t)
        starts = [kv_cache.lengths[s] for s in slots]
        attend_len = kv_cache.attend_len(max(starts) + t)
        c = self.config
        windows, local = self._windows, self._local  # per layer
        masks = {w: self._mask(starts, t, attend_len, attn_mask, positions, w) for w in set(windows)}
        ropes = {False: self._rope(positions, self.inv_freq)}  # cos, sin: [B, 1, T, D] each
        if any(local):
            ropes[True] = self._rope(positions, self.inv_freq_local)

        fast = prefill and attn_mask is None and t >= PREFILL_MIN_TOKENS
        x = self.embed_tokens(token_ids)  # [B, T, hidden]
        hidden = [x] if output_hidden_states else None
        # A native model without dense prefill copies prefills through its one-call layers: the
        # same kernels as the layer-by-layer path, without torch's elementwise ops between them,
        # which measured a little faster on long prompts.
        natives = self._native_layers(x) if not fast or self.prefills_on_the_decode_kernels() else None
        fast = fast and natives is None
        steps = EAGER_STEPS if fast else self.steps
        if natives is not None:  # native attention reads the mask in cache order (RowKeys.attend)
            rows = masks[windows[0]][:, 0]  # one window for all layers (DecoderConfig.llama_layers)
            cos, sin = ropes[False]
            for i, layer in enumerate(natives):
                x = layer.forward(x, cos, sin, kv_cache.k[i], kv_cache.v[i], slots, starts, attend_len, rows)
                if hidden is not None and i < len(natives) - 1:
                    hidden.append(x)
        else:
            # A masked pass (a draft tree) verifies drafts: its rows must compute like decode steps.
            keys = {w: m if attn_mask is None else RowKeys.from_mask(m[:, 0]) for w, m in masks.items()}
            for i, layer in enumerate(self.layers):
                x = layer(x, *ropes[local[i]], kv_cache, i, slots, keys[windows[i]], attend_len, fast, steps)
                if hidden is not None and i < len(self.layers) - 1:
                    hidden.append(x)
        kv_cache.advance(slots, t)
        x = self.norm(x)
        if hidden is not None:
            hidden.append(x)
        if num_logits == 0:  # a prompt's chunk before its last: only its K/V were wanted
            logits = x.new_zeros(x.shape[0], 0, c.vocab_size, dtype=torch.float32)
            return DecoderOutput(logits, hidden) if output_hidden_states else logits
        if num_logits is not None:
            x = x[:, -num_logits:]
        logits = self.logits(x) if head is None else head(x)
        if c.final_logit_softcapping:
            logits = c.final_logit_softcapping * torch.tanh(logits / c.final_logit_softcapping)
        return DecoderOutput(logits, hidden) if output_hidden_states else logits

    def _native_layers(self, x: Tensor) -> list | None:
        """The layers as native one-call objects for a float32 pass whose attention runs on the
        native kernel (see :func:`native_attention`), or None unless every layer qualifies.
        Made again when a layer's projections or norm weights are replaced."""
        if not (self.native_layers and self.config.llama_layers and x.dtype == torch.float32 and x.device.type == "cpu"
                and self.config.head_dim % 16 == 0 and kernels.available()):
            return None
        # what the layers are made from, read from the modules' own dicts (nn.Module's attribute
        # lookup made this check cost over ten times as much, a visible part of a pass)
        key = []
        for layer in self.layers:
            mods = layer._modules
            key += (mods["qkv"], mods["o_proj"], mods["gate_up"], mods["down"],
                    mods["input_norm"]._parameters["weight"], mods["post_attn_norm"]._parameters["weight"])
        made = _NATIVE_LAYERS.get(self)
        if made is None or len(made[0]) != len(key) or not all(map(operator.is_, made[0], key)):
            layers = [native_layer(layer.qkv, layer.o_proj, layer.gate_up, layer.down, layer.input_norm,
                                   layer.post_attn_norm, layer.num_heads, layer.num_kv_heads, layer.head_dim**-0.5)
                      for layer in self.layers]
            made = _NATIVE_LAYERS[self] = (key, None if any(m is None for m in layers) else layers)
        return made[1]

    def logits(self, x: Tensor) -> Tensor:
        """The LM head on final (normed) hidden states ``[..., hidden]``: float32 ``[..., vocab]``.
        Speculative heads that share the target's head (Medusa) call it too."""
        head = self.lm_head  # None: tied to the embedding table; else nn.Linear or a quantized layer
        if head is None or isinstance(head, nn.Linear):
            weight, bias = (self.embed.weight, None) if head is None else (head.weight, head.bias)
            return invariant_linear(x, weight, bias).float()
        return head(x).float()

    def embed_tokens(self, token_ids: Tensor) -> Tensor:
        """The input embeddings ``[..., hidden]`` of ``token_ids``, scaled where the model scales
        them (Gemma: by sqrt(hidden), rounded to float32 and then to the table's dtype, as HF
        does); what EAGLE heads read as the target's embeddings."""
        x = self.embed(token_ids)
        if self.config.embed_scale:
            x = x * torch.tensor(self.config.hidden_size**0.5).to(x.dtype)
        return x

    def _rope(self, positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
        freqs = positions.to(torch.float32)[..., None] * inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, D]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _mask(
        self, starts: list[int], t: int, attend_len: int, attn_mask: Tensor | None, positions: Tensor,
        window: int | None,
    ) -> Tensor:
        """Boolean attention mask [B, 1, T, attend_len] over cache indices: causal, or
        ``attn_mask``; with a ``window``, only keys at positions > position - window (see the
        module docstring)."""
        device = positions.device
        kv_idx = torch.arange(attend_len, device=device)  # [S]
        q_idx = torch.tensor(starts, device=device)[:, None] + torch.arange(t, device=device)  # [B, T]
        if attn_mask is None:
            mask = kv_idx[None, None, :] <= q_idx[:, :, None]  # [B, T, S]
        else:
            if attn_mask.dim() != 3 or attn_mask.shape[:2] != (len(starts), t):
                raise ValueError(f"attn_mask must be [batch, T, K]; got {tuple(attn_mask.shape)}")
            k = min(attn_mask.shape[-1], attend_len)
            mask = torch.zeros(len(starts), t, attend_len, dtype=torch.bool, device=device)
            mask[..., :k] = attn_mask[..., :k].to(device=device, dtype=torch.bool)
        if window is not None:
            key_pos = kv_idx.expand(len(starts), -1).scatter(1, q_idx, positions.to(kv_idx.dtype))  # [B, S]
            mask &= key_pos[:, None, :] > positions[:, :, None] - window
        return mask[:, None]

    def load_hf_weights(self, tensors: Mapping[str, Tensor]) -> None:
        """Copy weights given under Hugging Face names, fusing q/k/v and gate/up; norm weights
        ``w`` are stored as ``norm_offset + w`` (computed in float32, as HF's Gemma norms do)."""
        missing: list[str] = []

        def get(name: str) -> Tensor:
            if name not in tensors:
                missing.append(name)
                return torch.empty(0)
            return tensors[name]

        def put(dst: Tensor, *names: str) -> None:
            """Copy the named tensors, stacked along dim 0, into ``dst`` (a fused weight)."""
            parts = [get(n) for n in names]
            if missing:
                return
            rows = sum(p.shape[0] for p in parts)
            if rows != dst.shape[0] or any(p.shape[1:] != dst.shape[1:] for p in parts):
                shapes = ", ".join(str(tuple(p.shape)) for p in parts)
                raise ValueError(f"weight {names[0]} has shape {shapes}, expected {tuple(dst.shape)} in all")
            row = 0
            for part in parts:
                dst[row : row + part.shape[0]].copy_(part)
                row += part.shape[0]

        with torch.no_grad():
            if isinstance(self.embed, nn.Embedding):  # else the file's own table (GGUFEmbedding)
                put(self.embed.weight, "model.embed_tokens.weight")
            norms = [(self.norm, "model.norm.weight")]
            # layers built finished (native layers on a GGUF's blocks, Decoder.empty's build)
            # hold their weights already
            dense = lambda m: isinstance(m, nn.Linear)  # noqa: E731
            if dense(self.lm_head):
                put(self.lm_head.weight, "lm_head.weight")
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                attn = [p + f"self_attn.{n}_proj" for n in "qkv"]
                if p + "self_attn.qkv_proj.weight" in tensors:  # Phi3 stores the fused weights
                    attn = [p + "self_attn.qkv_proj"]
                if dense(layer.qkv):
                    put(layer.qkv.weight, *(n + ".weight" for n in attn))
                    if layer.qkv.bias is not None:
                        put(layer.qkv.bias, *(n + ".bias" for n in attn))
                if dense(layer.o_proj):
                    put(layer.o_proj.weight, p + "self_attn.o_proj.weight")
                gate_up = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
                if p + "mlp.gate_up_proj.weight" in tensors:  # [gate | up], as fused here
                    gate_up = [p + "mlp.gate_up_proj.weight"]
                if dense(layer.gate_up):
                    put(layer.gate_up.weight, *gate_up)
                if dense(layer.down):
                    put(layer.down.weight, p + "mlp.down_proj.weight")
                norms.append((layer.input_norm, p + "input_layernorm.weight"))
                if layer.attn_out_norm is None:
                    norms.append((layer.post_attn_norm, p + "post_attention_layernorm.weight"))
                else:  # Gemma's names: the MLP's input norm is its pre_feedforward_layernorm
                    norms += [(layer.attn_out_norm, p + "post_attention_layernorm.weight"),
                              (layer.post_attn_norm, p + "pre_feedforward_layernorm.weight"),
                              (layer.mlp_out_norm, p + "post_feedforward_layernorm.weight")]
                if layer.q_norm is not None:
                    norms += [(layer.q_norm, p + "self_attn.q_norm.weight"), (layer.k_norm, p + "self_attn.k_norm.weight")]
            for norm, name in norms:
                put(norm.weight, name)
                if self.config.norm_offset and not missing:
                    norm.weight.copy_(self.config.norm_offset + get(name).float())
        if missing:
            shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing weights: {shown}")
