"""What a GGUF file holds and how verispec runs it, read from its header alone.

:func:`inspect_gguf` reads the header (no tensor data, no conversion, no kernel build) and
says, before any slow work:

* the model: architecture, name, layers, widths, heads, vocabulary, context length, and
  whether verispec runs the architecture (or the error a load would raise);
* every tensor type in the file, and which part of verispec runs each tensor: the native
  kernels (the file's own blocks), a dense float32 fallback (a linear layer in a type or shape the
  kernels do not run, named with what it costs), the embedding table, or float32 vectors (norms
  and biases);
* the memory a load takes, by the loader's rules: native layers hold the file's blocks in the
  kernels' tile layout (about the file's bytes), dense layers float32 weights, the embedding table
  stays in the file (a lookup reads its rows) unless a tied head the kernels do not run needs it
  dense, float32 vectors, the KV cache float16 K and V per token and layer; and the disk a
  first load writes beside the file (the repacked blocks; the tokenizer's files are small).

Figures of memory are estimates from shapes and types, not measurements; the dense bf16
prefill copies some CPUs keep (:func:`verispec.models.native.dense_prefill_pays`) are shown
apart, since whether they pay is measured on the machine that loads the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from verispec.models.errors import ModelLoadError, UnsupportedModelError
from verispec.models.gguf_convert import (
    GGUF_ARCHITECTURES, GGUFHeader, GGUFTensorInfo, ggml_type_name, read_gguf_header,
)
from verispec.models.native import dense_prefill_choice, kernels_refusal

__all__ = ["GGUFInspection", "TypeRow", "inspect_gguf", "format_inspection"]

# The linear layers verispec runs on the kernels, by GGUF tensor name (``blk.N.<kind>.weight``).
_LINEAR_KINDS = ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_KV_BYTES = 2  # float16 K and V, the native models' cache dtype


@dataclass
class TypeRow:
    """The tensors of one GGUF type and what runs them."""

    type_name: str
    tensors: int = 0
    params: int = 0
    file_bytes: int = 0
    routes: dict[str, int] = field(default_factory=dict)  # route -> tensor count

    def add(self, info: GGUFTensorInfo, route: str) -> None:
        self.tensors += 1
        self.params += math.prod(info.shape)
        self.file_bytes += info.nbytes
        self.routes[route] = self.routes.get(route, 0) + 1


@dataclass
class GGUFInspection:
    """The facts :func:`inspect_gguf` reports (see the module docstring)."""

    path: Path
    file_bytes: int
    version: int
    architecture: str | None
    name: str | None
    runs: str | None  # None when verispec runs the model; else why not
    layers: int | None
    hidden: int | None
    ffn: int | None
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    vocab: int | None
    context_length: int | None
    types: list[TypeRow]
    dense_layers: int  # linear tensors the kernels do not run
    dense_reasons: dict[str, int]  # why, -> tensor count
    weights_bytes: int  # in memory after a load
    prefill_copy_bytes: int  # the dense bf16 prefill copies, where a CPU keeps them
    kv_bytes_per_token: int | None
    repacked_bytes: int  # the repacked blocks' cache

    def kv_bytes(self, context: int) -> int | None:
        return None if self.kv_bytes_per_token is None else self.kv_bytes_per_token * context


def _kind(name: str) -> str:
    parts = name.split(".")
    return parts[2] if len(parts) >= 4 and parts[0] == "blk" else parts[0]


def _runs(header: GGUFHeader) -> str | None:
    """None if verispec loads this file's architecture, else the reason a load would give."""
    from verispec.models.gguf_convert import _check_gguf_supported, gguf_hf_config

    try:
        scaling = _check_gguf_supported(header)
        gguf_hf_config(header, scaling)
    except (UnsupportedModelError, ModelLoadError) as exc:
        return str(exc)
    return None


def inspect_gguf(path: str | Path) -> GGUFInspection:
    """Inspect the GGUF file at ``path`` (see the module docstring); raises
    :class:`~verispec.models.errors.CorruptGGUFError` for an unreadable file."""
    header = read_gguf_header(path)
    md, arch = header.metadata, header.architecture or ""

    def meta(key: str) -> int | None:
        value = md.get(f"{arch}.{key}")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    names = {t.name for t in header.tensors}
    tied = "output.weight" not in names
    types: dict[str, TypeRow] = {}
    dense_reasons: dict[str, int] = {}
    weights = prefill = repacked = 0
    for info in header.tensors:
        numel = math.prod(info.shape)
        kind = _kind(info.name)
        type_name = ggml_type_name(info.ggml_type)
        is_head = info.name == "output.weight"
        linear = len(info.shape) == 2 and (kind in _LINEAR_KINDS or is_head)
        if info.name == "token_embd.weight":
            route = "embedding table (read from the file)" + (" and LM head" if tied else "")
            linear = tied and len(info.shape) == 2
        elif not linear:
            route = "float32 vector" if len(info.shape) == 1 else "dense (not a linear layer)"
            weights += numel * 4
        if linear:
            reason = kernels_refusal(info)
            if reason is not None:
                dense_reasons[reason] = dense_reasons.get(reason, 0) + 1
                # float32, as the native model's activations; a tied head multiplies by the table
                route = ("dense float32 (fallback)" if info.name != "token_embd.weight"
                         else "embedding table and LM head, dense float32 (fallback)")
                weights += numel * 4
            else:
                repacked += info.nbytes
                weights += info.nbytes
                if info.name != "token_embd.weight":
                    route = "native kernels"
                    if not is_head:
                        prefill += numel * 2
        types.setdefault(type_name, TypeRow(type_name)).add(info, route)
    embd = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    layers, heads = meta("block_count"), meta("attention.head_count")
    hidden = meta("embedding_length")
    head_dim = meta("attention.key_length") or (hidden // heads if hidden and heads else None)
    kv_heads = meta("attention.head_count_kv") or heads
    kv_per_token = 2 * layers * kv_heads * head_dim * _KV_BYTES if layers and kv_heads and head_dim else None
    name = md.get("general.name")
    return GGUFInspection(
        path=header.path, file_bytes=header.path.stat().st_size, version=header.version,
        architecture=header.architecture, name=name if isinstance(name, str) else None,
        runs=_runs(header), layers=layers, hidden=hidden, ffn=meta("feed_forward_length"), heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, vocab=embd.shape[0] if embd is not None else None,
        context_length=meta("context_length"), types=sorted(types.values(), key=lambda r: -r.file_bytes),
        dense_layers=sum(dense_reasons.values()), dense_reasons=dense_reasons, weights_bytes=weights,
        prefill_copy_bytes=prefill, kv_bytes_per_token=kv_per_token, repacked_bytes=repacked,
    )  # fmt: skip


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def format_inspection(r: GGUFInspection, context: int | None = None) -> str:
    """The report ``verispec models inspect`` prints; the KV cache at ``context`` tokens (default:
    the file's context length, capped at 4096, the engine's default)."""
    lines = [f"file          {r.path} ({_gb(r.file_bytes)}, GGUF v{r.version})"]
    if r.name:
        lines.append(f"model         {r.name}")
    hf = GGUF_ARCHITECTURES.get(r.architecture or "")
    lines.append(f"architecture  {r.architecture}: " + ("runs" + (f" (as {hf})" if hf else "") if r.runs is None
                                                       else f"NOT RUN: {r.runs}"))
    shape = [text for value, text in ((r.layers, f"{r.layers} layers"), (r.hidden, f"hidden {r.hidden}"),
                                      (r.ffn, f"FFN {r.ffn}"),
                                      (r.heads, f"{r.heads} heads, {r.kv_heads} KV heads of {r.head_dim}"),
                                      (r.vocab, f"vocabulary {r.vocab}"), (r.context_length, f"context {r.context_length}"))
             if value]  # fmt: skip
    lines.append("shape         " + ", ".join(shape))
    lines.append("tensors       type      count      params       bytes  run by")
    for t in r.types:
        routes = "; ".join(f"{route} ({n})" if len(t.routes) > 1 else route for route, n in t.routes.items())
        lines.append(f"              {t.type_name:8s} {t.tensors:6d} {t.params:11,d} {_gb(t.file_bytes):>11s}  {routes}")
    if r.dense_layers:
        why = "; ".join(f"{reason} ({n})" for reason, n in r.dense_reasons.items())
        lines.append(f"fallback      {r.dense_layers} linear tensor(s) run dense: {why}. A dense layer reads float32 "
                     "weights (4 bytes a weight, several times the file's) through a slower path than the kernels")
    else:
        lines.append("fallback      none: every linear layer runs on the native kernels")
    ctx = context or min(r.context_length or 4096, 4096)
    kv = r.kv_bytes(ctx)
    total = r.weights_bytes + (kv or 0)
    kept = dense_prefill_choice()
    copies = {True: "kept on this CPU", False: "not kept on this CPU",
              None: "kept where they measure faster (not yet measured on this CPU)"}[kept]
    lines.append(f"memory        weights {_gb(r.weights_bytes)}" + (
        f" + KV cache {_gb(kv)} at {ctx} tokens ({r.kv_bytes_per_token // 1024} KiB a token)" if kv else "")
        + f" = {_gb(total)} (estimate), plus {_gb(r.prefill_copy_bytes)} of dense bf16 prefill copies if "
        f"kept ({copies})")
    lines.append(f"disk          a first load writes {_gb(r.repacked_bytes)} of repacked blocks, and the "
                 "tokenizer's files, under $VERISPEC_HOME")
    return "\n".join(lines)
