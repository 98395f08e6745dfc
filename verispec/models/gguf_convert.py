"""Read a GGUF file: its header, its model description, its tensors under Hugging Face names.

:func:`gguf_metadata` reads a file's configuration and tokenizer once into a small cache
directory, ``verispec_home()/gguf/<stem>-<fingerprint>/`` (:func:`metadata_dir`), and
:class:`GGUFTensors` hands out its tensors, dequantized from the memory-mapped file on each
read; :func:`verispec.models.loader.load_gguf` builds the model from those, with no checkpoint
in between. :func:`convert_gguf` writes a whole Hugging Face checkpoint
(``verispec_home()/converted/``, :func:`converted_dir`), which only transformers' baselines in
``verispec bench`` load. The fingerprint hashes the file's size, modification time and absolute
path (plus :data:`CONVERSION_VERSION`), so a changed file gets a fresh entry without hashing
gigabytes.

The header is parsed by a small reader in this module. It is cheap (well under a second even
with a 150k-token vocabulary, which ``gguf.GGUFReader`` takes many seconds to read), checks that every tensor
lies inside the file, so a truncated or corrupt file fails fast with a clear message, and lets an
unsupported architecture be rejected before any slow work. ``config.json`` is built from the
metadata the way llama.cpp reads it (:func:`gguf_hf_config`); tensors are dequantized with the
``gguf`` package, renamed with gguf-py's tensor-name tables and, for Llama, llama.cpp's Q/K row
interleave is undone; Gemma's norm weights, which llama.cpp stores as ``1 + w``, go back to HF's
``w``, and Llama 3's ``rope_freqs`` tensor becomes the ``llama3`` rope scaling it encodes. The tokenizer is the one
transformers builds for the file (``AutoTokenizer.from_pretrained(..., gguf_file=...)``): its
converters build it from the vocabulary, merges and token types this module reads
(:func:`read_gguf_array`), which spares the call's second, much slower reading of the whole
metadata with gguf-py; a file that path does not cover goes through the call itself.

Precision. :class:`GGUFTensors` gives each tensor's float32 dequantization exactly (what
transformers' own GGUF reader gives); a model loaded in bfloat16 rounds it once, as it is
copied in. A converted checkpoint stores matrices in bfloat16 and vectors (norm weights,
biases) in float32, so transformers' baselines run the file's weights rounded to bfloat16
(relative error <= 2^-8, far below the quantization error itself).

Read: the GGUF architectures in :data:`GGUF_ARCHITECTURES` (llama, qwen2, qwen3, gemma2,
gemma3, phi3, whose fused ``attn_qkv`` and gate-and-up ``ffn_up`` tensors map to HF's fused Phi3
weights); a llama file with ``llama.attention.sliding_window`` (Mistral) reads as HF's Mistral,
the window on every layer. Not read (clear errors, before any slow work): other architectures (mixture-of-experts,
state-space, multimodal), split GGUF files, RoPE scaling other than linear and ``rope_freqs``
factors that match no Llama 3 scaling.

Both caches are written into a temporary directory next to the entry and moved into place with
one :func:`os.replace`, under a per-entry file lock, so an interrupted build never leaves a
half-written cache and two processes never build the same entry twice.

Errors are :class:`~verispec.models.errors.ModelLoadError` and its subclasses
(:class:`~verispec.models.errors.CorruptGGUFError` for an unreadable file); an architecture
verispec cannot convert or run raises :class:`~verispec.models.errors.UnsupportedModelError`.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import shutil
import struct
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from verispec.files import file_lock, fsync_dir
from verispec.models.errors import (
    SUPPORTED_ARCHITECTURES, CorruptGGUFError, ModelFileNotFoundError, ModelLoadError, UnsupportedModelError,
)
from verispec.runtime import verispec_home
from verispec.models.tokenizer import collect_eos_ids, write_light_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerBase

__all__ = [
    "CONVERSION_VERSION",
    "CorruptGGUFError",
    "GGUF_ARCHITECTURES",
    "GGUFHeader",
    "GGUFTensorInfo",
    "converted_dir",
    "convert_gguf",
    "gguf_hf_config",
    "read_gguf_header",
]

# Bumped whenever the layout or content of a converted directory changes; part of the cache key.
CONVERSION_VERSION = 1

# GGUF ``general.architecture`` values verispec converts, and the HF architecture each becomes.
# Mistral models are stored as "llama" in GGUF; one whose metadata states a sliding window
# (``llama.attention.sliding_window``) becomes a MistralForCausalLM with that window on every layer.
GGUF_ARCHITECTURES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                      "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                                      "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM"}
# The HF model_type of each, where it differs from the GGUF name.
_HF_MODEL_TYPES = {"gemma3": "gemma3_text"}
# llama.cpp's converter stores Gemma's RMSNorm weights w as 1 + w (it computes x * w); HF keeps w.
_NORM_SHIFTED = ("gemma2", "gemma3")
# Gemma's layers: n - 1 sliding-window layers, then a global one (llama.cpp's swa patterns).
_GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}

_SHARD_BYTES = 2 * 1024**3  # converted weights are written in shards of at most this size
_INDEX_FILE = "model.safetensors.index.json"
_SOURCE_FILE = "verispec_source.json"  # records which GGUF a converted directory came from
TENSOR_MAP_FILE = "gguf_tensors.json"  # GGUF tensor name -> [Hugging Face name, shape]


# ---------------------------------------------------------------------------------------------
# GGUF header reader
# ---------------------------------------------------------------------------------------------

_GGUF_MAGIC = b"GGUF"
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_KEEP_ARRAY_MAX = 64  # longer arrays (vocabularies, merges) are skipped, not decoded
_MAX_DIMS = 4


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in a GGUF file."""

    name: str
    shape: tuple[int, ...]  # numpy order (slowest-varying dimension first)
    ggml_type: int
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    """Metadata and tensor directory of a GGUF file (large arrays are not decoded)."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensorInfo, ...]
    # metadata key -> byte offset of the value of each array left undecoded (:func:`read_gguf_array`)
    arrays: Mapping[str, int] = field(default_factory=dict)

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None


class _Truncated(Exception):
    pass


class _Cursor:
    """Sequential little-endian reads from a buffer, failing cleanly at its end."""

    def __init__(self, buf: mmap.mmap, size: int) -> None:
        self.buf, self.size, self.pos = buf, size, 0

    def take(self, n: int, what: str) -> int:
        start = self.pos
        if n < 0 or start + n > self.size:
            raise _Truncated(f"file ends at byte {self.size} while reading {what} at byte {start}")
        self.pos = start + n
        return start

    def scalar(self, fmt: str, what: str) -> Any:
        start = self.take(struct.calcsize(fmt), what)
        return struct.unpack_from("<" + fmt, self.buf, start)[0]

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        start = self.take(n, what)
        return self.buf[start : start + n].decode("utf-8")

    def value(self, vtype: int, what: str, keep: bool = True) -> Any:
        if vtype in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[vtype]
            if not keep:
                self.take(struct.calcsize(fmt), what)
                return None
            return self.scalar(fmt, what)
        if vtype == _STRING:
            if not keep:
                self.take(self.scalar("Q", what), what)
                return None
            return self.string(what)
        if vtype == _ARRAY:
            itype = self.scalar("I", what)
            count = self.scalar("Q", what)
            if count > self.size:
                raise ValueError(f"implausible array length {count} in {what}")
            keep_items = keep and count <= _KEEP_ARRAY_MAX
            if itype in _SCALAR_FORMATS and not keep_items:
                self.take(count * struct.calcsize(_SCALAR_FORMATS[itype]), what)
                return None
            if itype == _STRING and not keep_items:  # a vocabulary: skipped in one tight loop
                pos, size, read = self.pos, self.size, struct.Struct("<Q").unpack_from
                for _ in range(count):
                    if pos + 8 > size:
                        raise _Truncated(f"file ends at byte {size} while reading {what} at byte {pos}")
                    pos += 8 + read(self.buf, pos)[0]
                if pos > size:
                    raise _Truncated(f"file ends at byte {size} while reading {what}")
                self.pos = pos
                return None
            items = [self.value(itype, what, keep_items) for _ in range(count)]
            return items if keep_items else None
        raise ValueError(f"unknown value type {vtype} in {what}")


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse and sanity-check a GGUF file's header without reading tensor data.

    Raises :class:`CorruptGGUFError` for a file that is not GGUF, is truncated (including
    tensor data that would extend past the end of the file) or is internally inconsistent.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ModelFileNotFoundError(f"no such file: {path}") from None
    if size < 24:
        raise CorruptGGUFError(path, f"the file is only {size} bytes, too short for a GGUF header")
    try:
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            cur = _Cursor(buf, size)
            magic = bytes(buf[:4])
            if magic != _GGUF_MAGIC:
                raise CorruptGGUFError(path, f"bad magic {magic!r}, expected {_GGUF_MAGIC!r}")
            cur.take(4, "magic")
            version = cur.scalar("I", "version")
            if version & 0xFFFF == 0 and version != 0:
                raise ModelLoadError(f"{path}: big-endian GGUF files are not supported")
            if version in (1, 4, 5, 6, 7, 8):  # a real but unsupported format version
                raise ModelLoadError(f"{path}: GGUF version {version} is not supported (expected 2 or 3)")
            if version not in (2, 3):
                raise CorruptGGUFError(path, f"invalid GGUF version {version} (expected 2 or 3)")
            n_tensors = cur.scalar("Q", "tensor count")
            n_kv = cur.scalar("Q", "metadata count")
            if n_tensors > size or n_kv > size:
                raise CorruptGGUFError(path, f"implausible counts: {n_tensors} tensors, {n_kv} metadata entries")
            metadata: dict[str, Any] = {}
            arrays: dict[str, int] = {}
            for i in range(n_kv):
                key = cur.string(f"metadata key {i}")
                vtype = cur.scalar("I", f"type of metadata {key!r}")
                start = cur.pos
                metadata[key] = cur.value(vtype, f"metadata {key!r}")
                if vtype == _ARRAY and metadata[key] is None:
                    arrays[key] = start
            raw_tensors = []
            for i in range(n_tensors):
                name = cur.string(f"name of tensor {i}")
                n_dims = cur.scalar("I", f"tensor {name!r}")
                if not 1 <= n_dims <= _MAX_DIMS:
                    raise CorruptGGUFError(path, f"tensor {name!r} has {n_dims} dimensions")
                dims = [cur.scalar("Q", f"tensor {name!r}") for _ in range(n_dims)]
                ggml_type = cur.scalar("I", f"tensor {name!r}")
                offset = cur.scalar("Q", f"tensor {name!r}")
                raw_tensors.append((name, dims, ggml_type, offset))
            data_start = cur.pos
    except _Truncated as exc:
        raise CorruptGGUFError(path, str(exc)) from None
    except UnicodeDecodeError:
        raise CorruptGGUFError(path, "a key or string is not valid UTF-8") from None
    except (ValueError, struct.error, OverflowError) as exc:
        if isinstance(exc, ModelLoadError):
            raise
        raise CorruptGGUFError(path, str(exc)) from None

    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise CorruptGGUFError(path, f"invalid general.alignment {alignment!r}")
    data_start = -(-data_start // alignment) * alignment
    tensors = []
    seen: set[str] = set()
    for name, dims, ggml_type, offset in raw_tensors:
        if name in seen:
            raise CorruptGGUFError(path, f"duplicate tensor {name!r}")
        seen.add(name)
        try:
            block, type_size = _quant_size(ggml_type)
        except (ValueError, KeyError):
            raise CorruptGGUFError(path, f"tensor {name!r} has unknown type id {ggml_type}") from None
        if dims[0] % block:
            raise CorruptGGUFError(path, f"tensor {name!r}: row of {dims[0]} is not a multiple of block {block}")
        nbytes = math.prod(dims) // block * type_size
        start = data_start + offset
        if start + nbytes > size:
            raise CorruptGGUFError(
                path, f"tensor {name!r} needs bytes up to {start + nbytes} but the file has only {size}"
            )
        tensors.append(GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, start, nbytes))
    return GGUFHeader(path=path, version=version, metadata=metadata, tensors=tuple(tensors), arrays=arrays)


def read_gguf_array(header: GGUFHeader, key: str) -> list[Any]:
    """The items of a metadata array that :func:`read_gguf_header` left undecoded (a vocabulary,
    its merges, scores or token types): strings as ``str``, numbers as Python ints and floats.

    The header reader already checked that the array lies inside the file."""
    if key in header.metadata and header.metadata[key] is not None:
        value = header.metadata[key]
        if not isinstance(value, list):
            raise ModelLoadError(f"{header.path}: metadata {key!r} is not an array")
        return value
    if key not in header.arrays:
        raise KeyError(key)
    with open(header.path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        itype, count = struct.unpack_from("<IQ", buf, header.arrays[key])
        pos = header.arrays[key] + 12
        if itype in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[itype]
            return list(struct.unpack_from(f"<{count}{fmt}", buf, pos))
        if itype != _STRING:
            raise ModelLoadError(f"{header.path}: metadata {key!r} is an array of arrays, which verispec does not read")
        items: list[str] = []
        append, length = items.append, struct.Struct("<Q").unpack_from
        try:
            for _ in range(count):
                n = length(buf, pos)[0]
                append(buf[pos + 8 : pos + 8 + n].decode("utf-8"))
                pos += 8 + n
        except UnicodeDecodeError:
            raise CorruptGGUFError(header.path, f"a string of metadata {key!r} is not valid UTF-8") from None
        return items


def ggml_type_name(ggml_type: int) -> str:
    """The name of a ggml type id (``Q4_K``), or ``type N`` for an id gguf does not know."""
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def _quant_size(ggml_type: int) -> tuple[int, int]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]


# ---------------------------------------------------------------------------------------------
# GGUF conversion
# ---------------------------------------------------------------------------------------------


# the metadata entry's format: 3 adds the tokenizer a load reads without transformers
METADATA_VERSION = 3


def _cache_key(path: Path, kind: str) -> str:
    """The fingerprint of a ``converted`` or ``gguf`` (metadata) cache entry."""
    st = path.stat()
    tag = "" if kind == "converted" else f"{kind}{METADATA_VERSION}\0"
    key = f"{tag}v{CONVERSION_VERSION}\0{st.st_size}\0{st.st_mtime_ns}\0{path}"
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:12]


def converted_dir(gguf_path: str | Path) -> Path:
    """The cache directory a GGUF file converts into (it may not exist yet).

    ``verispec_home()/converted/<stem>-<12 hex>``, the hex being a SHA-256 over the conversion
    format version, the file's size, modification time (ns) and absolute path.
    """
    path = Path(gguf_path).expanduser().resolve()
    return verispec_home() / "converted" / f"{path.stem}-{_cache_key(path, 'converted')}"


def metadata_dir(gguf_path: str | Path) -> Path:
    """The cache directory of a GGUF file's metadata (:func:`gguf_metadata`; it may not exist yet):
    ``verispec_home()/gguf/<stem>-<12 hex>``, keyed as :func:`converted_dir`."""
    path = Path(gguf_path).expanduser().resolve()
    return verispec_home() / "gguf" / f"{path.stem}-{_cache_key(path, 'gguf')}"


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"verispec: {message}", file=sys.stderr, flush=True)


def convert_gguf(gguf_path: str | Path, *, progress: bool = True) -> Path:
    """Convert a GGUF file into a cached Hugging Face directory (once) and return that directory.

    The model loader reads GGUF files directly (:func:`verispec.models.loader.load_gguf`); a converted
    directory is what transformers' baselines in ``verispec bench`` load."""
    return _cached(gguf_path, converted_dir, weights=True, progress=progress)


def gguf_metadata(gguf_path: str | Path, *, progress: bool = True) -> Path:
    """A GGUF file's model description as a small cached directory, made once per file:
    ``config.json``, ``generation_config.json``, the tokenizer's files (transformers' GGUF
    tokenizer, the slow part of reading a GGUF) and ``gguf_tensors.json`` (each GGUF tensor's
    Hugging Face name and shape). No weights: :func:`verispec.models.loader.load_gguf` reads those
    from the file."""
    return _cached(gguf_path, metadata_dir, weights=False, progress=progress)


def _cached(gguf_path: str | Path, where: Callable[[Path], Path], *, weights: bool, progress: bool) -> Path:
    """Build the cache directory ``where(path)`` once (under a per-entry lock, written into a
    temporary directory and moved into place whole) and return it."""
    path = Path(gguf_path).expanduser().resolve()
    if not path.is_file():
        raise ModelFileNotFoundError(f"no such file: {gguf_path}")
    final = where(path)
    if (final / "config.json").is_file():
        return final
    header = read_gguf_header(path)  # fails fast on corrupt files and unsupported models
    rope_scaling = _check_gguf_supported(header)
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f"{final.name}.lock"):
        if (final / "config.json").is_file():  # made by another process while we waited
            return final
        partial_prefix = f".{final.name}.partial-"
        for stale in root.glob(f"{partial_prefix}*"):  # left by an interrupted build
            shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # not complete (no config.json): start over
            shutil.rmtree(final)
        tmp = Path(tempfile.mkdtemp(prefix=partial_prefix, dir=root))
        try:
            start = time.perf_counter()
            if weights:
                _say(progress, f"converting {path.name} to a Hugging Face checkpoint (one-time) in {final}")
            else:
                _say(progress, f"reading {path.name}'s tokenizer and configuration (one-time)")
            _convert_into(header, rope_scaling, tmp, progress, weights=weights)
            seconds = time.perf_counter() - start
            st = path.stat()
            if where(path) != final:
                raise ModelLoadError(f"{path} changed while it was being read; load it again")
            (tmp / _SOURCE_FILE).write_text(json.dumps({
                "gguf_path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "conversion_version": CONVERSION_VERSION, "seconds": round(seconds, 1),
            }, indent=2) + "\n", encoding="utf-8")  # fmt: skip
            _finish_tree(tmp)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(root)
        _remove_older_conversions(root, final, path)
    if weights:
        _say(progress, f"converted {path.name} in {seconds:.1f} s")
    return final


def _check_gguf_supported(header: GGUFHeader) -> dict[str, Any] | None:
    """Reject what verispec cannot convert; return the RoPE scaling to put in config.json."""
    arch = header.architecture
    md = header.metadata
    if arch is None:
        raise CorruptGGUFError(header.path, "no general.architecture in the metadata")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{header.path}: unsupported GGUF architecture {arch!r}; verispec converts GGUF "
            f"architectures {', '.join(GGUF_ARCHITECTURES)} (Mistral GGUFs use 'llama'; no "
            "mixture-of-experts, state-space or multimodal models) and runs "
            f"Hugging Face architectures {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    split_count = md.get("split.count")
    if isinstance(split_count, int) and split_count > 1:
        raise ModelLoadError(
            f"{header.path} is part of a split GGUF ({split_count} files); merge the parts into "
            "one file first (llama.cpp's gguf-split --merge)"
        )
    experts = md.get(f"{arch}.expert_count")
    if isinstance(experts, int) and experts > 0:
        raise UnsupportedModelError(
            f"{header.path}: mixture-of-experts models ({arch} with {experts} experts) are not supported"
        )
    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count"):
        if not isinstance(md.get(f"{arch}.{key}"), int):
            raise CorruptGGUFError(header.path, f"metadata {arch}.{key} is missing")
    names = {t.name for t in header.tensors}
    if "token_embd.weight" not in names:
        raise CorruptGGUFError(header.path, "there is no token_embd.weight tensor")
    if "rope_factors_long.weight" in names or "rope_factors_short.weight" in names:
        raise UnsupportedModelError(
            f"{header.path}: LongRoPE (the rope_factors_long/short tensors of Phi-3 128k models) is not supported"
        )
    if "rope_freqs.weight" in names:
        return _llama3_scaling(header)
    scaling = md.get(f"{arch}.rope.scaling.type")
    if scaling in (None, "none"):
        return None
    factor = md.get(f"{arch}.rope.scaling.factor")
    if scaling == "linear" and isinstance(factor, (int, float)) and factor > 0:
        return {"rope_type": "linear", "factor": float(factor)}
    raise UnsupportedModelError(
        f"{header.path}: RoPE scaling {scaling!r} (factor {factor!r}) is not supported for GGUF "
        "files; verispec converts unscaled and linear RoPE"
    )


def _llama3_scaling(header: GGUFHeader) -> dict[str, Any]:
    """The HF ``llama3`` RoPE scaling that llama.cpp's converter wrote as the ``rope_freqs``
    tensor (per-dimension divisors of the frequencies, Llama 3.1+).

    The tensor does not name its parameters, so the ones every Llama 3.x release uses (low and
    high frequency factors 1 and 4, an original context of 8192, or the one the metadata gives)
    are tried with the tensor's largest factor, and accepted where they reproduce the tensor as
    the converter computes it. transformers' own GGUF loader ignores the tensor (it runs such a
    file unscaled); llama.cpp and the HF checkpoint apply the scaling, as verispec does."""
    arch = header.architecture or ""
    if arch != "llama":
        raise UnsupportedModelError(f"{header.path}: a rope_freqs tensor in a {arch!r} model is not supported")
    md = header.metadata
    info = next(t for t in header.tensors if t.name == "rope_freqs.weight")
    factors = _dequantize(np.memmap(header.path, dtype=np.uint8, mode="r"), info, header.path).astype(np.float64)
    heads = md[f"{arch}.attention.head_count"]
    dim = md.get(f"{arch}.rope.dimension_count") or md[f"{arch}.embedding_length"] // heads
    theta = float(md.get(f"{arch}.rope.freq_base", 10000.0))
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old_lens = {8192, md.get(f"{arch}.rope.scaling.original_context_length") or 8192}
    for old_len in sorted(old_lens):
        scaling = {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": int(old_len)}
        wavelen = 2 * math.pi / freqs
        smooth = (old_len / wavelen - 1.0) / (4.0 - 1.0)
        expected = np.where(wavelen < old_len / 4.0, 1.0, np.where(
            wavelen > old_len / 1.0, scaling["factor"], 1 / ((1 - smooth) / scaling["factor"] + smooth)))
        if factors.shape == expected.shape and np.allclose(factors, expected, rtol=1e-5, atol=0):
            return scaling
    raise UnsupportedModelError(
        f"{header.path}: the rope_freqs tensor (per-dimension RoPE factors) matches no Llama 3 "
        "scaling verispec knows; load the original Hugging Face checkpoint instead"
    )


def gguf_hf_config(header: GGUFHeader, rope_scaling: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Hugging Face config fields a GGUF header describes (model_type included).

    Follows llama.cpp's reading of the metadata: ``head_count_kv`` defaults to ``head_count``,
    the head size to ``embedding_length / head_count``, and the embeddings are tied when there is
    no ``output.weight`` tensor. The vocabulary size is the embedding's row count.
    """
    arch = header.architecture or ""
    md = header.metadata

    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"{arch}.{key}")
        return default if value is None else value

    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", hidden // heads)
    rotary = get("rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise UnsupportedModelError(
            f"{header.path}: partial rotary embeddings ({rotary} of {head_dim} dims per head) are not supported"
        )
    tensors = {t.name: t for t in header.tensors}
    cfg: dict[str, Any] = {
        "model_type": arch,
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": get("context_length", 4096),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if arch in _GEMMA_SWA_PATTERN:
        # What llama.cpp reads (or fixes) for Gemma 2 and 3: a query scale of 1/sqrt(head_dim) but
        # for the 27B models (1/sqrt(hidden/heads)); Gemma 3's local layers' RoPE base 10000.
        cfg["model_type"] = _HF_MODEL_TYPES.get(arch, arch)
        cfg["hidden_activation"] = "gelu_pytorch_tanh"
        big = cfg["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
        cfg["query_pre_attn_scalar"] = hidden // heads if big else head_dim
        cfg["sliding_window"] = get("attention.sliding_window")
        cfg["layer_types"] = [
            "full_attention" if (i + 1) % _GEMMA_SWA_PATTERN[arch] == 0 else "sliding_attention"
            for i in range(cfg["num_hidden_layers"])
        ]
        for key, gemma2_default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)):
            cfg[key] = get(key, gemma2_default if arch == "gemma2" else None)  # llama.cpp's defaults
    if arch == "gemma3":
        local = {"rope_type": "default", "rope_theta": float(get("rope.freq_base_swa", 10000.0))}
        full = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta"), **(rope_scaling or {})}
        cfg["rope_parameters"] = {"full_attention": full, "sliding_attention": local}
        rope_scaling = None
    if arch not in _GEMMA_SWA_PATTERN:
        cfg["hidden_act"] = "silu"
    if arch == "phi3":  # HF's Phi3 applies its config's window to every layer, as verispec does
        cfg["sliding_window"] = get("attention.sliding_window")
    if arch == "qwen3":
        cfg["attention_bias"] = False
        cfg["use_sliding_window"] = False
    if arch == "llama":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in tensors
        window = get("attention.sliding_window")
        if isinstance(window, int) and window > 0:  # Mistral: Llama with a window on every layer
            if cfg.pop("attention_bias"):
                raise UnsupportedModelError(
                    f"{header.path}: a llama file with both a sliding window and q/k/v biases is not supported")
            cfg["model_type"] = "mistral"
            cfg["sliding_window"] = window
    if arch == "qwen2":
        cfg["use_sliding_window"] = False
        cfg["sliding_window"] = None
    if rope_scaling is not None:
        cfg["rope_scaling"] = rope_scaling
    for gguf_key, hf_key in (("bos", "bos"), ("eos", "eos"), ("padding", "pad")):
        value = md.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if isinstance(value, int):
            cfg[f"{hf_key}_token_id"] = value
    return cfg


def _convert_into(header: GGUFHeader, rope_scaling: dict[str, Any] | None, out: Path, progress: bool,
                  weights: bool = True) -> None:
    """Write config, generation config, tokenizer and the tensor map of a GGUF into ``out``, and
    with ``weights`` its dequantized tensors as safetensors shards."""
    from transformers import AutoConfig, GenerationConfig

    cfg = gguf_hf_config(header, rope_scaling)
    hf_tok = _gguf_tokenizer(header)
    eos = sorted(collect_eos_ids(hf_tok, cfg.get("eos_token_id")))
    cfg["eos_token_id"] = eos[0] if len(eos) == 1 else eos

    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    config.architectures = ["MistralForCausalLM" if model_type == "mistral" else GGUF_ARCHITECTURES[header.architecture]]
    hf_tok.save_pretrained(str(out))
    write_light_tokenizer(out)
    config.save_pretrained(str(out))
    generation = GenerationConfig(bos_token_id=cfg.get("bos_token_id"), eos_token_id=eos,
                                  pad_token_id=cfg.get("pad_token_id"))  # fmt: skip
    generation.save_pretrained(str(out))

    expected = hf_parameter_shapes(config)
    name_map = _gguf_to_hf_names(header, expected)
    tensor_map = {g: [h, list(expected[h])] for g, h in name_map.items() if g in {t.name for t in header.tensors}}
    (out / TENSOR_MAP_FILE).write_text(json.dumps(tensor_map, indent=1) + "\n", encoding="utf-8")
    if weights:
        _write_weights(header, cfg, name_map, expected, out, progress)


def hf_parameter_shapes(config: PreTrainedConfig) -> dict[str, tuple[int, ...]]:
    """The weights transformers' model for ``config`` holds, name -> shape, in its module order,
    without ``lm_head.weight`` where it is tied to the embedding.

    What a weightless (meta) build of the model lists, written out for the architectures in
    :data:`GGUF_ARCHITECTURES` (and Mistral): building one imports transformers' modeling code,
    seconds of a first load, for a table this regular (the tests hold the two equal)."""
    c = config
    hidden, ff, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    head_dim = getattr(c, "head_dim", None) or hidden // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    bias = c.model_type == "qwen2" or (c.model_type == "llama" and c.attention_bias)
    gemma = c.model_type in ("gemma2", "gemma3_text")
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, hidden)}
    for i in range(layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        if c.model_type == "phi3":  # transformers' Phi3 lists o_proj first
            shapes[attn + "o_proj.weight"] = (hidden, q)
            shapes[attn + "qkv_proj.weight"] = (q + 2 * kv, hidden)
        else:
            for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                shapes[f"{attn}{name}.weight"] = (rows, hidden)
                if bias:
                    shapes[f"{attn}{name}.bias"] = (rows,)
        shapes.setdefault(attn + "o_proj.weight", (hidden, q))
        if c.model_type == "llama" and c.attention_bias:
            shapes[attn + "o_proj.bias"] = (hidden,)
        if c.model_type in ("qwen3", "gemma3_text"):
            shapes[attn + "q_norm.weight"] = shapes[attn + "k_norm.weight"] = (head_dim,)
        if c.model_type == "phi3":
            shapes[mlp + "gate_up_proj.weight"] = (2 * ff, hidden)
        else:
            shapes[mlp + "gate_proj.weight"] = shapes[mlp + "up_proj.weight"] = (ff, hidden)
        shapes[mlp + "down_proj.weight"] = (hidden, ff)
        norms = ["input_layernorm", "post_attention_layernorm"]
        norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if gemma else []
        for norm in norms:
            shapes[f"model.layers.{i}.{norm}.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, hidden)
    return shapes


def _gguf_tokenizer(header: GGUFHeader) -> PreTrainedTokenizerBase:
    """transformers' tokenizer for a GGUF file, with the chat template from its metadata.

    The same tokenizer ``AutoTokenizer.from_pretrained(..., gguf_file=...)`` builds: from the
    metadata this module reads (:func:`_tokenizer_from_header`) where it covers the file, else
    through that call. The file is exposed through a symlink in an empty directory so that no
    unrelated tokenizer files next to it can leak in.
    """
    path = header.path
    try:
        with tempfile.TemporaryDirectory(prefix="verispec-gguf-") as tmp:
            link = Path(tmp) / path.name
            try:
                link.symlink_to(path)
                where = tmp
            except OSError:  # no symlinks here (e.g. Windows without privileges)
                where = str(path.parent)
            hf_tok = _tokenizer_from_header(header, where)
            if hf_tok is None:
                from transformers import AutoTokenizer

                hf_tok = AutoTokenizer.from_pretrained(where, gguf_file=path.name, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, NotImplementedError) as exc:
        raise ModelLoadError(f"could not build the tokenizer of GGUF file {path}: {exc}") from exc
    template = header.metadata.get("tokenizer.chat_template")
    if isinstance(template, str) and template and not getattr(hf_tok, "chat_template", None):
        hf_tok.chat_template = template
    hf_tok.name_or_path = path.stem
    return hf_tok


# The tokenizer models (``tokenizer.ggml.model``) :func:`_tokenizer_from_header` builds: byte-level
# BPE and sentencepiece. Others (t5's unigram, gemma4) go through transformers' own reading.
_TOKENIZER_MODELS = ("gpt2", "llama")


def _tokenizer_from_header(header: GGUFHeader, where: str) -> PreTrainedTokenizerBase | None:
    """What ``AutoTokenizer.from_pretrained(where, gguf_file=...)`` returns, built from this
    module's reading of the metadata, or None where this does not cover the file.

    transformers' call reads the whole file's metadata twice, once with gguf-py's reader (many
    seconds for a 150k-token vocabulary) only to learn the model type that picks the tokenizer
    class. Here the class comes from the architecture, the tokenizer's description is gathered
    under transformers' key table (``GGUF_TOKENIZER_MAPPING``, as its ``get_gguf_tokenizer``
    does), transformers' ``convert_gguf_tokenizer`` builds the Rust tokenizer, and the class's
    own ``from_pretrained`` gets it as ``tokenizer_object``, so every later step is
    transformers' own. Not covered: architectures outside :data:`GGUF_ARCHITECTURES`, a
    ``llama`` file named "mistral" (transformers then reads it as Mistral) and tokenizer models
    outside :data:`_TOKENIZER_MODELS`.
    """
    from transformers import CONFIG_MAPPING, TokenizersBackend
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    arch, md = header.architecture, header.metadata
    if arch not in GGUF_ARCHITECTURES or md.get("general.name") == "mistral":
        return None
    if md.get("tokenizer.ggml.model") not in _TOKENIZER_MODELS or "tokenizer.ggml.tokens" not in md:
        return None
    tokenizer_class = TOKENIZER_MAPPING.get(CONFIG_MAPPING[_HF_MODEL_TYPES.get(arch, arch)], TokenizersBackend)
    if tokenizer_class is None or tokenizer_class.__name__ == "MistralCommonBackend":
        return None

    def value(key: str) -> Any:
        return read_gguf_array(header, key) if key in header.arrays else md[key]

    groups = {group: {name: value(f"tokenizer.{key}") for key, name in renames.items() if f"tokenizer.{key}" in md}
              for group, renames in GGUF_TOKENIZER_MAPPING.items()}  # fmt: skip
    tokenizer, init = groups["tokenizer"], groups["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":  # llama.cpp adds BOS to sentencepiece unless told not to
        init.setdefault("add_bos_token", True)
    for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items():
        if name.endswith("_token_id"):  # bos, eos, unk, pad: the token's text, or None
            token_id = md.get(f"tokenizer.{key}")
            init[name.removesuffix("_id")] = tokenizer["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(arch, tokenizer)
    return tokenizer_class.from_pretrained(
        where, gguf_file=header.path.name, tokenizer_object=backend, local_files_only=True, **init, **extra
    )


def _gguf_to_hf_names(header: GGUFHeader, expected: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face parameter name, from gguf-py's name tables."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = header.architecture
    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    table = get_tensor_name_map(arch_id, int(header.metadata[f"{arch}.block_count"]))
    mapping: dict[str, str] = {}
    for hf_name in expected:
        base, _, suffix = hf_name.rpartition(".")
        gguf_base = table.get_name(base)
        if gguf_base is None:
            raise ModelLoadError(f"{header.path}: no GGUF tensor name is known for {hf_name}")
        mapping[f"{gguf_base}.{suffix}"] = hf_name
    return mapping


def _dequantize(data: np.ndarray, info: GGUFTensorInfo, path: Path) -> np.ndarray:
    """Float32 values of one tensor, in numpy (HF) shape."""
    from gguf import GGMLQuantizationType, dequantize
    from gguf.quants import quant_shape_to_byte_shape

    qtype = GGMLQuantizationType(info.ggml_type)
    raw = data[info.offset : info.offset + info.nbytes]
    try:
        return dequantize(raw.reshape(quant_shape_to_byte_shape(info.shape, qtype)), qtype)
    except NotImplementedError as exc:
        raise ModelLoadError(
            f"{path}: tensor {info.name!r} is stored as {qtype.name}, which cannot be dequantized ({exc})"
        ) from exc


def _unpermute_rotary(weights: np.ndarray, n_head: int) -> np.ndarray:
    """Undo the row interleave llama.cpp applies to Llama's q/k projections.

    llama.cpp's converter reorders each head's rows from HF's rotate-half layout into
    interleaved pairs: ``w.reshape(n_head, 2, d // 2, ...).swapaxes(1, 2)``. This is the inverse.
    """
    rows = weights.shape[0]
    return weights.reshape(n_head, rows // n_head // 2, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def rotary_permutation(header: GGUFHeader, cfg: Mapping[str, Any]) -> dict[str, int]:
    """The GGUF tensor kinds whose rows llama.cpp interleaved per head, with their head counts
    (Llama's q and k only; :func:`_unpermute_rotary` undoes it)."""
    if header.architecture != "llama":
        return {}
    return {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}


def rotary_heads(info: GGUFTensorInfo, permute_heads: Mapping[str, int]) -> int | None:
    """The head count of llama.cpp's rotary interleave of this tensor's rows (``permute_heads``
    from :func:`rotary_permutation`), or None where its rows are as transformers holds them."""
    kind = info.name.split(".")[-2] if info.name.count(".") >= 2 else ""
    return permute_heads.get(kind)


def hf_array(header: GGUFHeader, info: GGUFTensorInfo, data: np.ndarray,
             permute_heads: Mapping[str, int]) -> np.ndarray:
    """One tensor as transformers holds it: dequantized to float32 (an own, contiguous array, not
    a view of the file), with llama.cpp's rotary row interleave undone and Gemma's norm weights
    shifted back by one (llama.cpp's converter stores 1 + w) where those apply."""
    array = _dequantize(data, info, header.path)
    heads = rotary_heads(info, permute_heads)
    if heads:
        array = _unpermute_rotary(array, heads)
    if header.architecture in _NORM_SHIFTED and info.name.endswith("norm.weight"):
        array = array - np.float32(1.0)
    if array.dtype != np.float32 or not array.flags.c_contiguous or not array.flags.writeable:
        array = np.array(array, dtype=np.float32)
    return array


class GGUFTensors(Mapping[str, Tensor]):
    """A GGUF file's tensors under their Hugging Face names, each dequantized from the file when
    it is read (:func:`hf_array`) and never kept: what :meth:`Decoder.load_hf_weights` copies
    from, with no checkpoint in between. ``metadata`` is the file's :func:`gguf_metadata`
    directory, whose ``gguf_tensors.json`` names and shapes each tensor."""

    def __init__(self, header: GGUFHeader, metadata: Path) -> None:
        self.header = header
        table = json.loads((metadata / TENSOR_MAP_FILE).read_text(encoding="utf-8"))
        config = json.loads((metadata / "config.json").read_text(encoding="utf-8"))
        infos = {t.name: t for t in header.tensors}
        self._by_hf = {hf: (infos[g], tuple(shape)) for g, (hf, shape) in table.items() if g in infos}
        self._permute = rotary_permutation(header, config)
        self._data: np.ndarray | None = None

    def info(self, hf_name: str) -> GGUFTensorInfo | None:
        """The GGUF tensor behind a Hugging Face name (None if the file has none)."""
        entry = self._by_hf.get(hf_name)
        return None if entry is None else entry[0]

    def data(self) -> np.ndarray:
        """The file, memory-mapped (read-only, opened once)."""
        if self._data is None:
            self._data = np.memmap(self.header.path, dtype=np.uint8, mode="r")
        return self._data

    def blocks(self, info: GGUFTensorInfo) -> np.ndarray:
        """A 2-D tensor's raw blocks as the file holds them, ``[rows, bytes per row]``: a view of
        the memory map (rows in the file's order, see :meth:`rotary_heads`)."""
        return self.data()[info.offset : info.offset + info.nbytes].reshape(info.shape[0], -1)

    def rotary_heads(self, info: GGUFTensorInfo) -> int | None:
        """The head count of llama.cpp's rotary interleave of the tensor's rows, or None."""
        return rotary_heads(info, self._permute)

    def release_pages(self, start: int = 0, length: int | None = None) -> None:
        """Drop the file's pages in ``[start, start + length)`` (default: all) that reading
        touched from this process's resident memory; they stay in the page cache, and a later
        read maps them again. The first load of a file repacks every block: released tensor by
        tensor, the file's bytes never add to the repacked copy's in resident memory."""
        buf = getattr(self._data, "_mmap", None)
        if buf is None or not hasattr(buf, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        end = len(buf) if length is None else min(len(buf), start + length)
        start -= start % mmap.PAGESIZE
        try:
            buf.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):  # advice only
            pass

    def __getitem__(self, hf_name: str) -> Tensor:
        info, shape = self._by_hf[hf_name]
        array = hf_array(self.header, info, self.data(), self._permute)
        if tuple(array.shape) != shape:
            raise ModelLoadError(f"{self.header.path}: tensor {info.name!r} ({hf_name}) has shape "
                                 f"{tuple(array.shape)}, the model config implies {shape}")
        return torch.from_numpy(array)

    def __contains__(self, key: object) -> bool:  # Mapping's default would read the tensor
        return key in self._by_hf

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_hf)

    def __len__(self) -> int:
        return len(self._by_hf)


def _write_weights(
    header: GGUFHeader,
    cfg: Mapping[str, Any],
    name_map: Mapping[str, str],
    expected: Mapping[str, tuple[int, ...]],
    out: Path,
    progress: bool,
) -> None:
    """Dequantize every tensor and write HF-named safetensors shards into ``out``."""
    from safetensors.torch import save_file

    permute_heads = rotary_permutation(header, cfg)
    data = np.memmap(header.path, dtype=np.uint8, mode="r")
    shards: list[list[str]] = []
    current: dict[str, Tensor] = {}
    current_bytes = total_bytes = 0
    unmapped: list[str] = []

    def flush() -> None:
        nonlocal current, current_bytes
        save_file(current, str(out / f"shard-{len(shards):05d}.partial"), metadata={"format": "pt"})
        shards.append(list(current))
        current, current_bytes = {}, 0

    bar = tqdm(total=sum(t.nbytes for t in header.tensors), desc=f"dequantizing {header.path.name}",
               unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, disable=not progress,
               dynamic_ncols=True)  # fmt: skip
    with bar:
        for info in header.tensors:
            hf_name = name_map.get(info.name)
            if hf_name is None:
                if info.name != "rope_freqs.weight":  # in config.json as rope_scaling
                    unmapped.append(info.name)
                bar.update(info.nbytes)
                continue
            array = hf_array(header, info, data, permute_heads)
            storage = torch.bfloat16 if array.ndim >= 2 else torch.float32
            tensor = torch.from_numpy(array).to(storage)
            if tuple(tensor.shape) != expected[hf_name]:
                raise ModelLoadError(
                    f"{header.path}: tensor {info.name!r} ({hf_name}) has shape {tuple(tensor.shape)}, "
                    f"the model config implies {expected[hf_name]}"
                )
            nbytes = tensor.numel() * tensor.element_size()
            if current and current_bytes + nbytes > _SHARD_BYTES:
                flush()
            current[hf_name] = tensor
            current_bytes += nbytes
            total_bytes += nbytes
            bar.update(info.nbytes)
        if current:
            flush()
    del data

    written = {name for shard in shards for name in shard}
    missing = sorted(set(expected) - written)
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise ModelLoadError(f"{header.path}: the GGUF has no tensor for {shown}")
    if unmapped:
        warnings.warn(
            f"{header.path.name}: ignored {len(unmapped)} GGUF tensor(s) with no Hugging Face "
            f"counterpart: {', '.join(unmapped[:5])}",
            stacklevel=3,
        )
    if len(shards) == 1:
        os.replace(out / "shard-00000.partial", out / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        final_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(out / f"shard-{i:05d}.partial", out / final_name)
        weight_map.update({name: final_name for name in names})
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out / _INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def _finish_tree(directory: Path) -> None:
    """Give a freshly written directory ordinary permissions and flush it to disk.

    ``mkdtemp`` (and safetensors) create private files; the cache is an ordinary directory
    (``rwxr-xr-x`` / ``rw-r--r--``, like other download caches).
    """
    directory.chmod(0o755)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o644)
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    fsync_dir(directory)


def _remove_older_conversions(root: Path, keep: Path, gguf_path: Path) -> None:
    """Delete earlier conversions of the same GGUF path (made before the file last changed)."""
    for other in root.glob(f"{gguf_path.stem}-*"):
        if other == keep or not other.is_dir():
            continue
        try:
            source = json.loads((other / _SOURCE_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(source, dict) and source.get("gguf_path") == str(gguf_path):
            shutil.rmtree(other, ignore_errors=True)
