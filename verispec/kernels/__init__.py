"""Native CPU kernels: matmuls on GGUF's own quantized weights, batch invariant by construction.

The C++ sources in ``csrc/`` are compiled on first use into a PyTorch extension cached under
``$VERISPEC_HOME/kernels/<key>/`` (the key hashes the sources, the compiler, torch and Python),
with a one-line message on stderr while it compiles. Every ISA path is compiled into the one
library and picked at run time from the CPU's flags, so a cached build serves any x86-64 CPU.
Without a working compiler :func:`native` returns None after a warning, and GGUF models load
dense; ``VERISPEC_NATIVE=0`` asks for that without trying.

Contract (stated in full in ``csrc/qgemm.h``): activations are quantized per row in blocks, dot
products are exact int32 sums, and every output is one fp32 accumulation in a fixed order, with
threads splitting output columns only. So a row's result is bit-identical whatever the number of
rows beside it, the thread count and the ISA path (``scalar``, ``avx2``, ``avxvnni`` (AVX2 with
the 256-bit VNNI dot product), ``avx512`` with VNNI, ``amx`` with AMX-INT8 tiles); the tests
check every path the CPU has against the scalar one for M = 1..16 (and 23 and 33) rows and 1 or
2 threads. By default a call takes the fastest path for its row count (AMX only for wide passes,
see ``csrc/ops.cpp``), up to the cap that ``VERISPEC_ISA`` or :func:`set_max_isa` sets. The weights are the file's
own: :func:`dequantize` of a packed weight equals ``gguf.quants.dequantize`` of its blocks bit
for bit.

Float weights (F32, F16, BF16; ``csrc/floats.h``) take the same guarantee another way: their
activations stay float32, and each output is one chain of float32 fused multiply-adds over k in
order, one output per SIMD lane, which the scalar reference and every path run alike.

Every call that computes (a product, attention, a native layer, repacking, dequantizing)
releases the GIL once its arguments are converted, so other Python threads, such as a server's
event loop, run while it works (``csrc/ops.cpp``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from verispec.files import file_lock
from verispec.runtime import verispec_home

CSRC = Path(__file__).parent / "csrc"
SOURCES = ("ref.cpp", "avx2.cpp", "avxvnni.cpp", "avx512.cpp", "amx.cpp", "floats.cpp", "floats_avx2.cpp",
           "floats_avx512.cpp", "attention.cpp", "attention_avx2.cpp", "attention_avx512.cpp", "pool.cpp", "layer.cpp",
           "ops.cpp")
# -fopenmp: at::parallel_for is a header template that is serial unless compiled with OpenMP; it
# then runs on torch's own OpenMP threads. -ffp-contract=off: the scalar reference's multiplies
# and adds stay as written, so the SIMD paths can match it bit for bit.
CFLAGS = ("-O3", "-ffp-contract=off", "-std=c++17", "-fopenmp")
HEADERS = ("qgemm.h", "floats.h", "ymm_kernel.h", "scales512.h", "pool.h", "attention.h", "attention_simd.h")
ISAS = {"scalar": 0, "avx2": 1, "avxvnni": 4, "avx512": 2, "amx": 3}
# ggml type ids of the formats the kernels run (GGMLQuantizationType values): the quantized ones
# (csrc/qgemm.h) and the float ones (csrc/floats.h), whose activations stay float32
FORMATS = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13,
           "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "F32": 0, "F16": 1, "BF16": 30}
FLOAT_FORMATS = {"F32": 0, "F16": 1, "BF16": 30}
# input features come in multiples of this per format: the GGUF block (the quantized formats'
# superblock), or for the float formats the activation block of 32 (a fused input is made in them)
_SUPERBLOCK = {fmt: 256 if name.endswith("_K") or name == "IQ4_XS" else 32 for name, fmt in FORMATS.items()}
TILE = 16  # output columns per packed tile


class KernelError(RuntimeError):
    """The native kernels cannot run this weight or input."""


@functools.cache
def build_key() -> str:
    """The key of this build's cache directory (``$VERISPEC_HOME/kernels/<key>/``)."""
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    cxx = os.environ.get("CXX", "c++")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = "unknown"
    h.update(f"{version}|{CFLAGS}|{torch.__version__}|{sys.version_info[:2]}|{platform.machine()}".encode())
    return h.hexdigest()[:16]


def layout_key() -> str:
    """A hash of the packed layouts' definitions (``qgemm.h`` and ``ref.cpp``, ``floats.h`` and
    ``floats.cpp``, where tiles are written): repacked weights cached on disk are valid while it stays the same."""
    h = hashlib.sha256()
    for name in ("qgemm.h", "ref.cpp", "floats.h", "floats.cpp"):
        h.update((CSRC / name).read_bytes())
    return h.hexdigest()[:16]


@functools.cache
def native():
    """The compiled extension module, building it on first use; None where it cannot be built."""
    if os.environ.get("VERISPEC_NATIVE", "1") == "0":
        return None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        warnings.warn(
            f"verispec's native kernels are written for x86-64, not {platform.machine()}; "
            "GGUF models load with dense bf16 weights instead (about half the decode speed)",
            stacklevel=2,
        )
        return None
    build = verispec_home() / "kernels" / build_key()
    lib = _import_finished(build)
    if lib is None:
        lib = _build(build)
    if lib is None:
        return None
    cap = os.environ.get("VERISPEC_ISA", "").strip().lower()
    if cap:
        _set_max_isa(lib, cap, "VERISPEC_ISA")
    return lib


_FINISHED = "finished"  # written into a build directory once its library has loaded


def _import_finished(build: Path):
    """The library of a finished build in ``build``, imported directly; None without one.

    The directory's key hashes every source, header, flag and the compiler, so a finished build
    there is current: torch's loader would only confirm that through ninja, after importing its
    compiler support, which is most of a warm start's kernel time. A library that fails to import
    sends the caller to a full build."""
    library = build / "verispec_kernels.so"
    if not (build / _FINISHED).is_file() or not library.is_file():
        return None
    import importlib.util

    try:
        spec = importlib.util.spec_from_file_location("verispec_kernels", library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError:
        return None
    return module


def _build(build: Path):
    """Compile (or let ninja confirm) the library in ``build`` and import it; None, after a
    warning, where it cannot be built."""
    from torch.utils import cpp_extension

    build.mkdir(parents=True, exist_ok=True)
    fresh = not any(build.glob("*.so"))
    if fresh:
        print("verispec: compiling the native CPU kernels (once, about a minute)...", file=sys.stderr, flush=True)
    try:
        with file_lock(build / "build.lock"):
            # torch's own baton ("lock") is a plain file: a build killed part-way leaves it, and
            # every later load would wait on it forever. This lock is the OS's, released with its
            # holder, so a baton found while holding it is a dead build's.
            (build / "lock").unlink(missing_ok=True)
            lib = cpp_extension.load(
                name="verispec_kernels",
                sources=[str(CSRC / s) for s in SOURCES],
                extra_cflags=list(CFLAGS),
                extra_ldflags=["-fopenmp"],
                build_directory=str(build),
                verbose=False,
            )
            (build / _FINISHED).write_text(build.name + "\n")
    except (OSError, RuntimeError, subprocess.SubprocessError, ImportError) as exc:
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            why = "no C++ compiler was found"
        else:
            why = f"the build failed ({str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r})"
        warnings.warn(
            f"verispec's native CPU kernels are unavailable: {why}. GGUF models load with dense bf16 "
            "weights instead: about half the decode speed, and each verified draft token costs more.",
            stacklevel=2,
        )
        return None
    return lib


def _set_max_isa(lib, name: str | None, what: str) -> None:
    if name is None:
        lib.set_max_isa(-1)
        return
    have = [n for n, i in ISAS.items() if i in lib.supported_isas()]
    if name not in have:
        raise KernelError(f"{what}={name!r}: this CPU runs the kernel paths {', '.join(have)}")
    lib.set_max_isa(ISAS[name])


def set_max_isa(name: str | None) -> None:
    """Make the kernels' default choice stop at path ``name`` (``scalar``, ``avx2``,
    ``avxvnni``, ``avx512``, ``amx``), as on a CPU without the faster ones; None lifts the cap.
    The environment variable ``VERISPEC_ISA`` sets it for a process. Results are the same bits on
    every path; only the speed changes."""
    _set_max_isa(_lib(), None if name is None else name.strip().lower(), "max ISA")


def _isa_id(isa: str | None) -> int:
    """The C++ id of a forced path (-1: the default), or a clear error for a name this CPU lacks."""
    if isa is None:
        return -1
    if isa not in ISAS or ISAS[isa] not in _lib().supported_isas():
        raise KernelError(f"ISA path {isa!r}: this CPU runs the kernel paths {', '.join(supported_isas())}")
    return ISAS[isa]


def available() -> bool:
    return native() is not None


def _lib():
    lib = native()
    if lib is None:
        raise KernelError("the native CPU kernels are not available on this machine (see the warning above)")
    return lib


def supported_isas() -> list[str]:
    """The ISA paths this CPU can run, slowest first (``scalar`` always)."""
    names = {v: k for k, v in ISAS.items()}
    return [names[i] for i in _lib().supported_isas()]


def core_clock_hz() -> float:
    """The calling core's clock in cycles per second, from a timed chain of dependent integer adds
    (``csrc/ops.cpp``): what the verify-pass bounds of ``verispec bench kernels`` turn instruction
    counts into time with."""
    return float(_lib().core_clock_hz())


def best_isa() -> str:
    """The most capable path this CPU runs (a call picks per row count among those, see
    :func:`matmul`)."""
    return supported_isas()[-1]


@dataclass(frozen=True)
class PackedWeight:
    """One GGUF weight [n, k] (n output features) repacked into the kernels' tile layout."""

    fmt: int  # ggml type id
    n: int
    k: int
    data: Tensor  # uint8, the layout of csrc/qgemm.h

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def format_name(fmt: int) -> str:
    return next((k for k, v in FORMATS.items() if v == fmt), f"type {fmt}")


def check_format(fmt: int, n: int, k: int) -> None:
    """Raise :class:`KernelError` unless the kernels can run a [n, k] weight of type ``fmt``."""
    if fmt not in FORMATS.values():
        raise KernelError(f"GGUF type {fmt} is not run by the native kernels (they run {', '.join(FORMATS)})")
    kb = _SUPERBLOCK[fmt]
    if n % TILE or k % kb:
        raise KernelError(
            f"a {format_name(fmt)} weight of shape [{n}, {k}] cannot be run: the kernels need output "
            f"features in multiples of {TILE} and input features in multiples of {kb}"
        )


def repack(fmt: int, raw: np.ndarray | Tensor, n: int, k: int) -> PackedWeight:
    """Repack a GGUF tensor's raw blocks (``n`` rows of ``k`` weights each) into the tile layout."""
    check_format(fmt, n, k)
    if isinstance(raw, np.ndarray):
        # Usually a read-only memory map of the file: viewed, not copied, as repacking only reads
        # it (torch warns about any tensor over read-only memory, since it could be written).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable", UserWarning)
            data = torch.from_numpy(np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1))
    else:
        data = raw.contiguous().view(torch.uint8).reshape(-1)
    return PackedWeight(fmt, n, k, _lib().repack(fmt, data, n, k))


def packed_nbytes(fmt: int, n: int, k: int) -> int:
    """Bytes of a [n, k] weight of type ``fmt`` in the tile layout."""
    check_format(fmt, n, k)
    return int(_lib().packed_nbytes(fmt, n, k))


def concat(weights: list[PackedWeight]) -> list[PackedWeight]:
    """The same product with adjacent weights of one format joined into one (tiles are
    independent, so joining is concatenating): fewer calls for a fused q/k/v or gate/up."""
    out: list[PackedWeight] = []
    for w in weights:
        if out and out[-1].fmt == w.fmt and out[-1].k == w.k:
            last = out.pop()
            w = PackedWeight(w.fmt, last.n + w.n, w.k, torch.cat((last.data, w.data)))
        out.append(w)
    return out


def dequantize(w: PackedWeight) -> Tensor:
    """The float32 weight [n, k] the kernels multiply by (equal to gguf's dequantization)."""
    return _lib().dequantize(w.fmt, w.data, w.n, w.k)


def matmul(x: Tensor, weights: list[PackedWeight], isa: str | None = None, *, bias: Tensor | None = None,
           out_dtype: torch.dtype = torch.float32, glu: bool = False, norm: tuple[Tensor, float] | None = None,
           residual: Tensor | None = None) -> Tensor:
    """``x [M, K]`` (float32 or bfloat16) times the weights stacked along the output dim, plus
    ``bias`` (float32) and ``residual`` (``[M, sum n]`` in ``out_dtype``) if given, added in
    float32 and rounded once: ``[M, sum n]`` in ``out_dtype`` (float32 or bfloat16).

    The layer's input can be made from ``x`` row by row before it is quantized, in fixed float32
    steps (so rows stay invariant): ``glu`` takes ``x [M, 2K]`` and multiplies
    ``silu(x[:, :K]) * x[:, K:]`` (a SwiGLU MLP's down projection); ``norm = (weight, eps)``
    multiplies ``RMSNorm(x) * weight``. Fusing them saves the separate PyTorch ops and their
    memory traffic in a decode step.

    Activations are quantized once, for all the quantized weights (float weights, F32, F16 and
    BF16, read them in float32), and one parallel region covers all their tiles. ``isa`` forces
    a path (``scalar``, ``avx2``, ``avxvnni``, ``avx512``, ``amx``; tests use it); None picks the
    fastest this CPU runs for the row count.
    """
    if x.dim() != 2:
        raise KernelError(f"matmul takes x [M, K], got shape {tuple(x.shape)}")
    k = x.shape[1] // 2 if glu else x.shape[1]
    if any(w.k != k for w in weights):
        raise KernelError(f"input has {k} features but a weight takes {[w.k for w in weights]}")
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise KernelError(f"the kernels write float32 or bfloat16, not {out_dtype}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        x = x.float()
    if glu and norm is not None:
        raise KernelError("a layer's input is gated (glu) or normed, not both")
    norm_w, eps = (None, 0.0) if norm is None else (norm[0].float().contiguous(), float(norm[1]))
    return _lib().linear(x, [w.fmt for w in weights], [w.data for w in weights], [w.n for w in weights],
                         bias, out_dtype == torch.bfloat16, _isa_id(isa),
                         glu, norm_w, eps, residual)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, isa: str | None = None) -> Tensor:
    """Attention of ``q [B, H, T, D]`` over ``k, v [B, Hkv, S, D]`` where ``mask [B, T, S]``
    (bool) is True: ``[B, H, T, D]``, float32. ``q`` is float32, ``k`` and ``v`` both float32 or
    both float16 (a float16 cache: each element read as its exact float, so the result equals the
    float32 one on the same values). Each row reduces over its own attended keys in
    cache order, in fixed float32 steps (``csrc/attention.cpp``), so its bits depend only on the
    row, its keys and its values: not on the rows beside it, on S, on the thread count or on the
    ISA path. ``isa`` forces a path as in :func:`matmul` (``avx512`` and ``amx`` run the AVX512
    row kernel, ``avxvnni`` and ``avx2`` the AVX2 one); None takes the default."""
    return _lib().attention(q, k, v, mask, float(scale), _isa_id(isa))


def qkv_rope(qkv: Tensor, cos: Tensor, sin: Tensor, heads: int, kv_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """``qkv [B, T, (H + 2 Hkv) D]`` split into ``q [B, H, T, D]``, ``k, v [B, Hkv, T, D]``
    (contiguous) with RoPE on q and k (``cos, sin [B, 1, T, D]``), all float32: one call for
    what takes about twenty PyTorch ops, with the same bits as the decoder's PyTorch form."""
    q, k, v = _lib().qkv_rope(qkv, cos, sin, heads, kv_heads)
    return q, k, v


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX)."""
    # torch.cpu carries the probes in current releases; torch._C._cpu held them in older ones.
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    for module in (torch.cpu, getattr(torch._C, "_cpu", None)):
        if module is not None and any(hasattr(module, name) for name in checks):
            return any(getattr(module, name, lambda: False)() for name in checks)
    return False
