"""A GGUF model's own weights, quantized or float, run by the native kernels (:mod:`verispec.kernels`).

:func:`install_gguf_layers_` puts :class:`NativeLinear` layers built from the GGUF file's
blocks in place of a decoder's linear layers (the fused q/k/v and gate/up projections, the
output and down projections, and the LM head). The loader does it on the weightless model, so
those layers' dense weights never exist (:meth:`Decoder.empty`'s ``build``);
:func:`use_gguf_weights_` does it to a model already loaded. Blocks are repacked once and never
requantized: the weight a kernel multiplies by is the file's, as gguf dequantizes it. F32, F16
and BF16 matrices (a float GGUF, or a quantized file's float tensors) run on the kernels too, in
float32 with no activation quantization. A fused layer keeps one packed part per GGUF tensor, so
q and k in Q4_K can sit beside v in Q6_K, as Q4_K_M files mix them, or an F16 tensor beside
quantized ones. A layer whose tensors the kernels cannot run (other types, widths off the
kernels' grid) runs dense, with a warning that names the types and the cost. The
embedding table stays in the file's own blocks too (:class:`GGUFEmbedding`): a lookup
dequantizes the rows it reads.

Repacking happens once per GGUF file: the packed parts are written to
``$VERISPEC_HOME/repacked/<key>/`` (the key hashes the file's path, size and modification time
and the kernels' layout) and later loads map them from there (copy-on-write, so the pages are
shared between processes and nothing is copied). Repacking is about a third of a first load's
time. A cache that cannot be written only costs the repacking.

Exactness. Each output row of a native layer is bit-identical whatever the number of rows and
threads (the kernels' contract), so decode, verify and tree passes agree bit for bit, as
speculative decoding needs. Prompt prefill (``PREFILL_MIN_TOKENS`` rows or more) on a CPU with
native bf16 arithmetic may multiply by a dense bf16 copy instead (``dense``: the file's values
rounded to bf16, stored in oneDNN's blocked layout where
PyTorch has oneDNN, see :func:`onednn_weight`); plain and speculative decoding prefill alike, so
outputs agree.

Whether to keep those copies is measured, once per machine (:func:`dense_prefill_pays`). They
cost a second copy of every layer's weights and prefix caching (the engine reuses cached K/V
only where every prompt is prefilled through the decode kernels), so they are kept only where a
bf16 GEMM prefills clearly faster than the kernels: with AMX the copies were more than twice as
fast, while on a CPU with AVX512-BF16 but no AMX the kernels were faster (docs/kernels.md,
Prompts' prefill).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import platform
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from verispec import kernels
from verispec.kernels import KernelError, PackedWeight
from verispec.models.gguf_convert import _unpermute_rotary, ggml_type_name, read_gguf_header
from verispec.runtime import verispec_home

__all__ = ["NativeLinear", "GGUFEmbedding", "install_gguf_layers_", "use_gguf_weights_", "is_native",
           "float_activations_", "RepackCache", "NATIVE_FORMATS", "native_unfit", "quantize_native_", "gguf_quantized",
           "native_layer", "dense_prefill_pays"]

# --quantization int8 / int4 of a dense checkpoint on the kernels: GGUF's Q8_0 (one fp16 scale
# per 32 weights) and Q4_1 (a scale and a minimum per 32), quantized by gguf's own reference code.
NATIVE_FORMATS = {"int8": "Q8_0", "int4": "Q4_1"}
NATIVE_INT4_GROUP = 32

_ALIGN = 64  # bytes: each cached part starts on a cache line


class RepackCache:
    """Packed parts of one GGUF file on disk: ``parts.bin`` (every part's bytes, aligned) and
    ``index.json`` (per layer: the parts' format, shape, offset). Written once, whole, by
    :meth:`save` (to a temporary directory that is then renamed), so a reader never sees half."""

    def __init__(self, gguf_path: str | Path, root: Path | None = None) -> None:
        path = Path(gguf_path).resolve()
        st = path.stat()
        key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}|{kernels.layout_key()}".encode()).hexdigest()[:16]
        self.dir = (root if root is not None else verispec_home() / "repacked") / f"{path.stem}-{key}"
        self.entries: dict[str, list[PackedWeight]] = {}
        self.loaded = False
        index = self.dir / "index.json"
        if index.is_file():
            try:
                self._read(json.loads(index.read_text()))
                self.loaded = True
            except (OSError, ValueError, KeyError, TypeError) as exc:
                warnings.warn(f"ignoring the unreadable repacked-weight cache {self.dir} ({exc}); "
                              "it is written again", stacklevel=3)
                self.entries = {}
                shutil.rmtree(self.dir, ignore_errors=True)

    def _read(self, index: dict) -> None:
        blob = np.memmap(self.dir / "parts.bin", dtype=np.uint8, mode="c")  # copy-on-write: writable, shared
        data = torch.from_numpy(blob)
        for layer, parts in index.items():
            self.entries[layer] = [
                PackedWeight(int(fmt), int(n), int(k), data[off : off + size])
                for fmt, n, k, off, size in parts
            ]
            for p in self.entries[layer]:
                kernels.check_format(p.fmt, p.n, p.k)
                if p.nbytes != kernels.packed_nbytes(p.fmt, p.n, p.k):
                    raise ValueError(f"{layer}: {p.nbytes} bytes for a [{p.n}, {p.k}] part")

    def get(self, layer: str) -> list[PackedWeight] | None:
        return self.entries.get(layer)

    def put(self, layer: str, parts: list[PackedWeight]) -> None:
        self.entries[layer] = parts

    def save(self) -> None:
        """Write every entry; on failure (a full disk, no permission) warn and carry on."""
        tmp = None
        try:
            self.dir.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=self.dir.parent, prefix=".tmp-"))
            index, off = {}, 0
            with open(tmp / "parts.bin", "wb") as f:
                for layer, parts in self.entries.items():
                    index[layer] = []
                    for p in parts:
                        pad = -off % _ALIGN
                        f.write(b"\0" * pad)
                        off += pad
                        f.write(memoryview(p.data.numpy()))  # no copy of the part
                        index[layer].append([p.fmt, p.n, p.k, off, p.nbytes])
                        off += p.nbytes
            (tmp / "index.json").write_text(json.dumps(index))
            try:
                os.replace(tmp, self.dir)
            except OSError:  # another process wrote it first: keep theirs
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError as exc:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            warnings.warn(f"could not cache the repacked weights in {self.dir} ({exc}); "
                          "the next load repacks them again", stacklevel=3)


class NativeLinear(nn.Module):
    """``y = x @ W.T + bias`` with W given as packed GGUF parts stacked along the output dim."""

    def __init__(self, parts: list[PackedWeight], bias: Tensor | None, dense: Tensor | None,
                 float_output: bool = False, join: bool = True) -> None:
        """``join=False`` keeps the parts as given (views into another layer's weights stay
        views) instead of joining adjacent ones of a format into one copy."""
        super().__init__()
        parts = kernels.concat(parts) if join else parts
        self.parts = parts
        self.float_output = float_output  # the LM head: logits stay float32, never rounded to bf16
        self.in_features = parts[0].k
        self.out_features = sum(p.n for p in parts)
        for i, p in enumerate(parts):  # buffers, so the module's memory shows in its state
            self.register_buffer(f"packed{i}", p.data, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.register_buffer("dense", onednn_weight(dense), persistent=False)
        # the arguments of the kernels' call, made once: a decode step makes a hundred calls, and
        # kernels.matmul's checks, which these layers pass by construction, add up over a step
        # (the packed buffers are uint8, which no dtype cast touches, and the layer is CPU-only)
        self._call = (kernels.native().linear, [p.fmt for p in parts], [p.data for p in parts],
                      [p.n for p in parts])

    def forward(self, x: Tensor, *, glu: bool = False, norm: nn.Module | None = None,
                residual: Tensor | None = None) -> Tensor:
        """``self(x)``, or with ``glu`` ``self(silu(gate) * up)`` for ``x = [gate | up]``, or with
        ``norm`` (an RMSNorm) ``self(norm(x))``, plus ``residual`` if given: the kernels make the
        layer's input and add the residual themselves (see :func:`verispec.kernels.matmul`)."""
        out_dtype = torch.float32 if self.float_output or x.dtype != torch.bfloat16 else torch.bfloat16
        rows = x.reshape(-1, x.shape[-1])
        res = None if residual is None else residual.reshape(-1, self.out_features)
        if res is not None and res.dtype != out_dtype:
            res = res.to(out_dtype)
        if x.dtype == torch.float32 and (norm is None or norm.weight.dtype == torch.float32):
            linear, fmts, data, ns = self._call  # the float32 model's path, as kernels.matmul calls it
            y = linear(rows, fmts, data, ns, self.bias, False, -1, glu,
                       None if norm is None else norm.weight, 0.0 if norm is None else float(norm.eps), res)
        else:
            y = kernels.matmul(rows, self.parts, bias=self.bias, out_dtype=out_dtype, glu=glu,
                               norm=None if norm is None else (norm.weight, norm.eps), residual=res)
        if not self.float_output and y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def dense_forward(self, x: Tensor) -> Tensor:
        """A prefill pass through the dense bf16 copy (see the module docstring)."""
        bias = None if self.bias is None else self.bias.to(self.dense.dtype)
        y = dense_linear(x.reshape(-1, self.in_features).to(self.dense.dtype), self.dense, bias)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def __deepcopy__(self, memo: dict) -> NativeLinear:
        """A copy with copies of its weights; a oneDNN-layout copy has no storage that
        ``copy.deepcopy`` can read, so it is copied as a plain tensor and reordered again."""
        dense = self._buffers["dense"]
        self._buffers["dense"] = self.dense_weight()
        try:
            new = type(self).__new__(type(self))
            memo[id(self)] = new
            new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        finally:
            self._buffers["dense"] = dense
        new._buffers["dense"] = onednn_weight(new._buffers["dense"])
        return new

    def dense_weight(self) -> Tensor | None:
        """The dense bf16 prefill copy as a plain [N, K] tensor (None if the layer keeps none)."""
        if self.dense is None:
            return None
        return self.dense.to_dense() if self.dense.is_mkldnn else self.dense

    def dequantize(self) -> Tensor:
        """The float32 weight [N, K] the kernels multiply by."""
        return torch.cat([kernels.dequantize(p) for p in self.parts])

    def extra_repr(self) -> str:
        kinds = ", ".join(f"{kernels.format_name(p.fmt)}[{p.n}]" for p in self.parts)
        return f"in_features={self.in_features}, out_features={self.out_features}, parts=({kinds})"


# The dense copies are stored in oneDNN's own blocked layout where PyTorch has oneDNN: F.linear
# on a plain bf16 weight reorders the weight for oneDNN on every call, which made a layer's
# projections up to a third slower on prompts of 64 to 700 rows (docs/kernels.md, Prompts'
# prefill). The layout is chosen for a batch size (this hint); other row counts run on it as fast
# (64 and 256 measured alike).
_ONEDNN_ROWS_HINT = 128


def onednn_weight(weight: Tensor | None) -> Tensor | None:
    """``weight`` ([N, K] bf16) reordered once into oneDNN's layout for :func:`dense_linear`, or
    ``weight`` itself where that is not available (no oneDNN, another dtype, not on the CPU)."""
    if weight is None or weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return weight
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if not torch.backends.mkldnn.is_available() or reorder is None:
        return weight
    try:
        return reorder(weight.contiguous(), _ONEDNN_ROWS_HINT)
    except RuntimeError:  # this PyTorch's oneDNN cannot take the weight: keep F.linear's form
        return weight


def dense_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ weight.T + bias`` for 2-D ``x``, with ``weight`` as :func:`onednn_weight` made it."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return nn.functional.linear(x, weight, bias)


def float_activations_(model: nn.Module) -> None:
    """Run a native model's activations (norms, attention, the embedding table) in float32, with
    its KV cache in float16 (``Decoder.kv_cache_dtype``, where the native attention kernel runs);
    the native layers' packed weights and dense bf16 prefill copies stay as they are.

    The loader's default for a native model on CPU. The kernels read float32 activations as they
    read bf16 ones (both are quantized per row), so float32 costs no weight bandwidth, and it
    removes the bf16 conversions around every elementwise op, which made decode steps and verify
    passes about a tenth faster (docs/kernels.md, Float32 activations)."""
    natives = [m for m in model.modules() if isinstance(m, NativeLinear)]
    dense = [m.dense for m in natives]
    for m in natives:  # kept in bf16: not cast by .float()
        m.dense = None
    model.float()
    for m, d in zip(natives, dense):
        m.dense = d
    if hasattr(model, "kv_cache_dtype") and kernels.available():
        # The KV cache in float16, read by the native attention kernel as its exact floats: a
        # decode step's attention over a long cache is bound by the cache's bytes, so it halves
        # that time, and half the memory per token.
        model.kv_cache_dtype = torch.float16


def native_layer(qkv: nn.Module, o_proj: nn.Module, gate_up: nn.Module, down: nn.Module, input_norm: nn.Module,
                 post_norm: nn.Module, heads: int, kv_heads: int, scale: float):
    """A decoder layer whose four projections are :class:`NativeLinear` and whose norms are float32
    RMSNorms, as one native object (``csrc/layer.cpp``) that runs its decode, verify and tree
    passes in one call, with the kernel calls of the Python layer and the same bits; None if the
    layer does not qualify."""
    projections = (qkv, o_proj, gate_up, down)
    if not all(isinstance(m, NativeLinear) for m in projections):
        return None
    if any(n.weight.dtype != torch.float32 for n in (input_norm, post_norm)):
        return None
    parts = [(*m._call[1:], m.bias) for m in projections]
    return kernels.native().NativeLayer(*parts, input_norm.weight, float(input_norm.eps), post_norm.weight,
                                        float(post_norm.eps), heads, kv_heads, scale)


# A dense bf16 prefill copy is kept only where a prefill-shaped product through it runs at least
# this many times as fast as through the kernels: it costs prefix caching and memory.
DENSE_PREFILL_MIN_GAIN = 1.25
DENSE_PREFILL_ENV = "VERISPEC_DENSE_PREFILL"


@functools.cache
def dense_prefill_pays() -> bool:
    """Whether native layers keep dense bf16 copies of their weights for prompt prefill.

    Never on a CPU without native bf16 arithmetic (its bf16 GEMM is slower than the kernels).
    Elsewhere ``$VERISPEC_DENSE_PREFILL`` (``1`` or ``0``) decides if set; otherwise the answer
    is measured once per CPU, kernel build and torch version and kept in
    ``$VERISPEC_HOME/kernels/<build>/prefill-<cpu>.json``: a Q4_K product of 256 rows through
    the kernels against the same product through torch's bf16 GEMM, alternated, the best of
    each (a fraction of a second). The copies are kept when the GEMM is at least
    ``DENSE_PREFILL_MIN_GAIN`` times as fast."""

    if not kernels.available():
        return False
    known = dense_prefill_choice()
    if known is not None:
        return known
    path = _prefill_choice_path()
    native_s, dense_s = measure_prefill_paths()
    choice = {"dense": native_s >= DENSE_PREFILL_MIN_GAIN * dense_s, "native_s": native_s, "dense_s": dense_s,
              "rows": _PREFILL_PROBE[0], "threads": torch.get_num_threads()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(choice))
        os.replace(tmp, path)
    except OSError as exc:
        warnings.warn(f"could not keep the prefill measurement in {path} ({exc}); it is taken again "
                      "by the next process", stacklevel=2)
    return choice["dense"]


def dense_prefill_choice() -> bool | None:
    """:func:`dense_prefill_pays`'s answer where it is known without measuring (the CPU, the
    environment variable or an earlier measurement decide it), else None."""
    if not kernels.cpu_has_native_bf16():
        return False
    env = os.environ.get(DENSE_PREFILL_ENV, "").strip()
    if env:
        if env not in ("0", "1"):
            raise ValueError(f"{DENSE_PREFILL_ENV} must be 0 or 1, got {env!r}")
        return env == "1"
    try:
        return bool(json.loads(_prefill_choice_path().read_text())["dense"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _prefill_choice_path() -> Path:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                cpu += line
            if line.startswith("flags"):
                break
    except OSError:
        cpu = platform.processor()
    key = hashlib.sha256(f"{cpu}|{torch.__version__}".encode()).hexdigest()[:16]
    return verispec_home() / "kernels" / kernels.build_key() / f"prefill-{key}.json"


_PREFILL_PROBE = (256, 4096, 1536)  # rows, output and input features (about a 1.5B model's q/k/v + o)


def measure_prefill_paths(repeats: int = 3) -> tuple[float, float]:
    """Seconds for one prefill-shaped product (``_PREFILL_PROBE``, a random Q4_K weight, float32
    activations as the loader's default) through the kernels and through a dense bf16 copy with
    :func:`dense_linear`, as :meth:`NativeLinear.dense_forward` runs it: the best of ``repeats``
    alternated timings each, after one warm-up of each."""
    import time

    m, n, k = _PREFILL_PROBE
    gen = np.random.default_rng(0)
    blocks = gen.integers(0, 256, size=(n, k // 256, 144), dtype=np.uint8)
    blocks[:, :, 0:4] = np.array([0.01, 0.002], dtype=np.float16).view(np.uint8)  # d and dmin: finite
    weight = kernels.repack(kernels.FORMATS["Q4_K"], blocks.reshape(n, -1), n, k)
    dense = onednn_weight(kernels.dequantize(weight).to(torch.bfloat16))
    x = torch.from_numpy(gen.standard_normal((m, k), dtype=np.float32))

    def through_kernels() -> None:
        kernels.matmul(x, [weight])

    def through_dense() -> None:
        dense_linear(x.to(torch.bfloat16), dense, None).to(torch.float32)

    best = [float("inf"), float("inf")]
    for rep in range(repeats + 1):
        for i, f in enumerate((through_kernels, through_dense)):
            t = time.perf_counter()
            f()
            if rep:
                best[i] = min(best[i], time.perf_counter() - t)
    return best[0], best[1]


def is_native(model: nn.Module) -> bool:
    return any(isinstance(m, NativeLinear) for m in model.modules())


def use_gguf_weights_(model: nn.Module, gguf_path: str | Path, *, keep_dense: bool | None = None,
                      cache: bool | Path = True) -> int:
    """Replace the linear layers of ``model`` (the :class:`~verispec.models.decoder.Decoder` of
    the same GGUF file, loaded dense) by native layers on the file's own blocks; returns how many
    layers stayed dense. The loader builds GGUF models with native layers from the start
    (:func:`install_gguf_layers_`); this is that for a model already loaded. ``keep_dense``,
    ``cache``: as there."""
    from verispec.models.gguf_convert import GGUFTensors, gguf_metadata

    tensors = GGUFTensors(read_gguf_header(gguf_path), gguf_metadata(gguf_path, progress=False))
    return install_gguf_layers_(model, tensors, keep_dense=keep_dense, cache=cache)


class GGUFEmbedding(nn.Module):
    """An embedding table left in the GGUF file's own blocks, as llama.cpp leaves it: a lookup
    dequantizes only the rows it reads (gguf's dequantization, so each row is the file's values
    exactly), from the memory-mapped file. The model's largest tensor then costs no memory beyond
    the file's pages that lookups touch. The output takes the module's dtype (it follows
    ``.float()`` and ``.to()`` like a weight would). :attr:`weight`, the whole table dequantized
    on each read, is for the few readers of a dense table (EAGLE training, a dense tied head)."""

    def __init__(self, rows: np.ndarray, ggml_type: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.rows = rows  # [vocab, bytes per row], a view of the file's memory map
        self.ggml_type = ggml_type
        self.num_embeddings, self.embedding_dim = rows.shape[0], dim
        self.register_buffer("like", torch.empty(0, dtype=dtype), persistent=False)  # the output's dtype

    @classmethod
    def from_tensors(cls, tensors, hf_name: str, dtype: torch.dtype) -> GGUFEmbedding | None:
        """The table ``hf_name`` of a :class:`~verispec.models.gguf_convert.GGUFTensors`, or None
        where the file's table needs a transform on reading (none of the supported ones does)."""
        info = tensors.info(hf_name)
        if info is None or len(info.shape) != 2 or tensors.rotary_heads(info):
            return None
        return cls(tensors.blocks(info), info.ggml_type, info.shape[1], dtype)

    def _rows(self, ids: np.ndarray) -> Tensor:
        from gguf import GGMLQuantizationType, dequantize

        values = dequantize(self.rows[ids], GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def forward(self, ids: Tensor) -> Tensor:
        flat = ids.reshape(-1).cpu().numpy()
        if flat.size and (flat.min() < 0 or flat.max() >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        out = self._rows(flat).to(device=self.like.device, dtype=self.like.dtype)
        return out.view(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> Tensor:
        return self._rows(np.arange(self.num_embeddings)).to(device=self.like.device, dtype=self.like.dtype)

    def __deepcopy__(self, memo: dict) -> GGUFEmbedding:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        rows = self.rows
        self.rows = None
        try:
            new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        finally:
            self.rows = rows
        new.rows = rows  # the file's map is shared, read-only
        return new

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {ggml_type_name(self.ggml_type)} blocks"


def kernels_refusal(info) -> str | None:
    """Why the kernels cannot run a 2-D GGUF tensor (a :class:`GGUFTensorInfo`), or None."""
    try:
        kernels.check_format(info.ggml_type, *info.shape)
    except KernelError as exc:
        if info.ggml_type in kernels.FORMATS.values():
            return str(exc)  # a type they run, in a shape off their grid
        return f"{ggml_type_name(info.ggml_type)} is not run by the kernels"
    return None


# Each fused projection of a decoder layer and the Hugging Face names of its parts (stacked along
# the output dimension in this order), under ``model.layers.<i>.``.
_FUSED_PARTS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o_proj": ("self_attn.o_proj",),
                "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
_FUSED_TENSORS = {"qkv": "self_attn.qkv_proj", "gate_up": "mlp.gate_up_proj"}  # the one-tensor forms


def install_gguf_layers_(model: nn.Module, tensors, *, keep_dense: bool | None = None,
                         cache: bool | Path = True) -> int:
    """Put native layers on the GGUF's own blocks in place of ``model``'s linear layers (the
    fused q/k/v and gate/up, the output and down projections, the LM head) wherever the kernels
    run every tensor of the layer; returns how many layers stay dense (with a warning naming the
    types and the cost). ``model`` may be weightless (on the meta device, as the loader builds it):
    a layer's shape and whether it has a bias come from the model, its blocks, bias and dense
    prefill copy from ``tensors`` (:class:`~verispec.models.gguf_convert.GGUFTensors`).

    ``keep_dense``: keep the dense bf16 weights for prompt prefill (default: where that measures
    faster, :func:`dense_prefill_pays`). ``cache``: read and write the repacked weights in the
    default cache (True), in a directory (a path), or not at all (False). Raises
    :class:`KernelError` if the kernels are unavailable."""
    if not kernels.available():
        raise KernelError("the native CPU kernels are not available on this machine (see the warning above)")
    if model.device.type not in ("cpu", "meta"):
        raise KernelError(f"the native kernels run on the CPU, not on {model.device.type}")
    header = tensors.header
    keep = dense_prefill_pays() if keep_dense is None else keep_dense
    store = None if cache is False else RepackCache(header.path, None if cache is True else Path(cache))
    unrun: dict[str, int] = {}  # why a tensor stays dense -> how many

    def packed(hf_name: str) -> PackedWeight | None:
        info = tensors.info(hf_name)
        if info is None or len(info.shape) != 2:
            return None
        n, k = info.shape
        why = kernels_refusal(info)
        if why is not None:
            unrun[why] = unrun.get(why, 0) + 1
            return None
        raw = tensors.blocks(info)
        heads = tensors.rotary_heads(info)
        if heads:  # rows are whole blocks, so the raw rows permute like the weights
            raw = _unpermute_rotary(raw, heads)
        weight = kernels.repack(info.ggml_type, raw, n, k)
        tensors.release_pages(info.offset, info.nbytes)
        return weight

    def native(layer: nn.Linear, bases: list[str], head: bool = False) -> nn.Module:
        key = "+".join(getattr(tensors.info(b + ".weight"), "name", b) for b in bases)  # the GGUF names
        parts = None if store is None else store.get(key)
        if parts is None:
            parts = [packed(b + ".weight") for b in bases]
            if any(p is None for p in parts):
                return layer
            parts = kernels.concat(parts)
            if store is not None and not store.loaded:
                store.put(key, parts)
        if sum(p.n for p in parts) != layer.out_features or parts[0].k != layer.in_features:
            return layer
        bias = None if layer.bias is None else torch.cat([tensors[b + ".bias"] for b in bases]).float()
        dense_copy = None
        if keep and not head:
            dense_copy = torch.cat([tensors[b + ".weight"].to(torch.bfloat16) for b in bases])
        return NativeLinear(parts, bias, dense_copy, float_output=head)

    dense = 0
    for i, layer in enumerate(model.layers):
        for attr, names in _FUSED_PARTS.items():
            fused = _FUSED_TENSORS.get(attr)  # Phi-3's files hold q/k/v as one tensor, gate and up as one
            if fused and tensors.info(f"model.layers.{i}.{fused}.weight") is not None:
                names = (fused,)
            old = getattr(layer, attr)
            new = native(old, [f"model.layers.{i}.{n}" for n in names])
            dense += new is old
            setattr(layer, attr, new)
    tied = model.lm_head is None
    head = as_linear(model.embed.weight) if tied else model.lm_head
    new_head = native(head, ["model.embed_tokens" if tied else "lm_head"], head=True)
    if new_head is head:
        dense += 1
    else:
        model.lm_head = new_head
    if store is not None and not store.loaded:
        store.save()
    if dense:
        why = ", ".join(f"{reason} ({n})" for reason, n in unrun.items()) or "shapes off the kernels' grid"
        warnings.warn(
            f"{header.path.name}: {dense} linear layer(s) hold tensors the native kernels do not run "
            f"({why}) and run on dense weights instead: 4 bytes a weight in a float32 model (2 in "
            "bfloat16), several times the file's bytes, through a path many times slower per token "
            "than the kernels. `verispec models inspect FILE` lists what runs where",
            stacklevel=2,
        )
    return dense


def _projections(model: nn.Module) -> list[tuple[nn.Module, str]]:
    return [(layer, attr) for layer in model.layers for attr in ("qkv", "o_proj", "gate_up", "down")]


def native_unfit(model: nn.Module, scheme: str, group_size: int) -> str | None:
    """Why the kernels cannot run ``scheme`` on every linear layer of ``model``, or None."""

    if scheme not in NATIVE_FORMATS:
        return f"the native kernels run {', '.join(NATIVE_FORMATS)}, not {scheme!r}"
    if scheme == "int4" and group_size != NATIVE_INT4_GROUP:
        return f"int4 runs on the native kernels with groups of {NATIVE_INT4_GROUP} (Q4_1), not {group_size}"
    if not kernels.available():
        return "the native CPU kernels are not available on this machine (see the warning above)"
    head = model.lm_head if model.lm_head is not None else as_linear(model.embed.weight)
    for lin in [getattr(layer, attr) for layer, attr in _projections(model)] + [head]:
        if not isinstance(lin, nn.Linear):
            return f"a layer is already {type(lin).__name__}"
        fmt = kernels.FORMATS["Q8_0" if lin is head else NATIVE_FORMATS[scheme]]
        try:
            kernels.check_format(fmt, lin.out_features, lin.in_features)
        except KernelError as exc:
            return str(exc)
    return None


def gguf_quantized(weight: Tensor, bias: Tensor | None, fmt_name: str, *, keep_dense: bool = False,
                   head: bool = False) -> NativeLinear:
    """A layer on the kernels multiplying by ``weight`` [N, K] quantized to ``fmt_name`` (a
    32-wide format: Q8_0, Q4_1, Q5_0) with gguf's reference quantizer. ``keep_dense``: with a
    bf16 copy of the quantized weight for prompt prefill; ``head``: float32 logits out."""
    from gguf import GGMLQuantizationType, quants

    fmt = kernels.FORMATS[fmt_name]
    n, k = weight.shape
    part = kernels.repack(fmt, quants.quantize(weight.float().numpy(), GGMLQuantizationType(fmt)), n, k)
    dense = kernels.dequantize(part).to(torch.bfloat16) if keep_dense else None
    return NativeLinear([part], bias, dense, float_output=head)


def quantize_native_(model: nn.Module, scheme: str, keep_dense: bool) -> None:
    """Quantize ``model``'s projections to ``NATIVE_FORMATS[scheme]`` and its LM head to Q8_0 with
    gguf's reference quantizers, and run them on the kernels (call :func:`native_unfit` first).
    ``keep_dense``: keep a bf16 copy of each projection's dequantized weight for prompt prefill."""

    def make(lin: nn.Linear, fmt_name: str, head: bool = False) -> NativeLinear:
        bias = None if lin.bias is None else lin.bias.detach().float()
        return gguf_quantized(lin.weight.detach(), bias, fmt_name, keep_dense=keep_dense and not head, head=head)

    for layer, attr in _projections(model):
        setattr(layer, attr, make(getattr(layer, attr), NATIVE_FORMATS[scheme]))
    head = model.lm_head if model.lm_head is not None else as_linear(model.embed.weight)
    model.lm_head = make(head, "Q8_0", head=True)


def as_linear(weight: Tensor) -> nn.Linear:
    """A bias-free ``nn.Linear`` view of a [N, K] weight (for a tied embedding table)."""
    with torch.device("meta"):
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    lin.weight = nn.Parameter(weight, requires_grad=False)
    return lin
