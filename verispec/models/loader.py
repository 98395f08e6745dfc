"""Turn a model spec (bundled name, Hugging Face directory or GGUF file) into a ready decoder.

:func:`load_model` is the one entry point. Every spec goes through
:func:`verispec.models.registry.resolve_model`, which yields either a Hugging Face model
directory or a ``.gguf`` file:

* **Hugging Face directory** -- ``config.json`` describes the model, the weights are read from
  ``model.safetensors`` (or the shards listed in ``model.safetensors.index.json``) through
  memory-mapped :func:`safetensors.safe_open` handles and copied straight into the native
  :class:`~verispec.models.decoder.Decoder`; the tokenizer comes from ``tokenizer.json`` /
  ``tokenizer_config.json`` (plus ``chat_template.jinja`` if present). Nothing is fetched from
  a hub.
* **GGUF file** -- converted once (:mod:`verispec.models.gguf_convert`) into a Hugging Face
  directory under ``verispec_home()/converted/<stem>-<fingerprint>/`` and then loaded as above.
  The fingerprint hashes the file's size, modification time and absolute path (plus a
  conversion format version), so a changed file gets a fresh conversion without hashing
  gigabytes.

Errors are :class:`ModelLoadError` (a :class:`ValueError`) with a message naming the path and
the problem; missing files raise :class:`ModelFileNotFoundError`, which is also a
:class:`FileNotFoundError`. An architecture verispec cannot run raises
:class:`~verispec.models.decoder.UnsupportedModelError`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from verispec.models.decoder import Decoder, DecoderConfig, UnsupportedModelError
from verispec.models.files import read_json_object
from verispec.models.errors import CorruptGGUFError, ModelFileNotFoundError, ModelLoadError
from verispec.models.gguf_convert import (
    _INDEX_FILE,
    CONVERSION_VERSION,
    GGUF_ARCHITECTURES,
    GGUFHeader,
    GGUFTensorInfo,
    GGUFTensors,
    convert_gguf,
    converted_dir,
    gguf_hf_config,
    gguf_metadata,
    metadata_dir,
    read_gguf_header,
)
from verispec import kernels
from verispec.kernels import KernelError
from verispec.models.native import GGUFEmbedding, float_activations_, install_gguf_layers_, is_native
from verispec.models.quant import DEFAULT_INT4_GROUP_SIZE, check_scheme, quantize_
from verispec.models.registry import BUNDLED_MODELS, resolve_model
from verispec.models.tokenizer import Tokenizer

__all__ = [
    "CONVERSION_VERSION",
    "CorruptGGUFError",
    "GGUF_ARCHITECTURES",
    "GGUFHeader",
    "GGUFTensorInfo",
    "LoadedModel",
    "ModelFileNotFoundError",
    "ModelLoadError",
    "converted_dir",
    "convert_gguf",
    "gguf_hf_config",
    "load_gguf",
    "load_hf_dir",
    "load_model",
    "metadata_dir",
    "read_gguf_header",
    "resolve_device",
    "resolve_dtype",
]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")



@dataclass
class LoadedModel:
    """A decoder ready to run plus everything needed to talk to it."""

    model: Decoder
    tokenizer: Tokenizer
    source: Path  # the Hugging Face directory or the GGUF file loaded
    hf_config: dict  # its config.json
    name: str  # short display name


# ---------------------------------------------------------------------------------------------
# device and dtype
# ---------------------------------------------------------------------------------------------

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_VALID_DTYPES = "auto, float32 (fp32), bfloat16 (bf16), float16 (fp16)"


def resolve_device(device: str | torch.device) -> torch.device:
    """Parse and check a device: ``cpu``, ``cuda``/``cuda:N`` (if CUDA is usable) or ``mps``."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"invalid device {device!r} ({exc}); use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ModelLoadError(
                f"device {str(device)!r} was requested but CUDA is not available "
                f"(torch {torch.__version__}, built with CUDA: {torch.version.cuda or 'no'}); "
                "use device='cpu'"
            )
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ModelLoadError(f"device {str(device)!r} does not exist: {count} CUDA device(s) visible")
        return dev
    if dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ModelLoadError(f"device {str(device)!r} was requested but MPS is not available; use device='cpu'")
        return dev
    raise ModelLoadError(f"unsupported device {str(device)!r}; use 'cpu', 'cuda', 'cuda:N' or 'mps'")


def _cuda_bf16_supported(device: torch.device) -> bool:
    """Native bfloat16 on this CUDA device (compute capability 8.0+; emulation does not count)."""
    if torch.version.hip:  # ROCm: torch knows best
        return bool(torch.cuda.is_bf16_supported())
    major, _minor = torch.cuda.get_device_capability(device)
    return major >= 8


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """Turn a dtype name (or torch dtype) into a torch dtype the device can run.

    ``"auto"`` is bfloat16 on CPU and on CUDA devices with native bfloat16, float16 on other
    CUDA devices and on MPS. bfloat16 on a CUDA device without it is an error.
    """
    if isinstance(dtype, torch.dtype):
        resolved = dtype
        if resolved not in _DTYPES.values():
            raise ModelLoadError(f"unsupported dtype {dtype}; valid dtypes are: {_VALID_DTYPES}")
    elif isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key == "auto":
            if device.type == "cuda":
                return torch.bfloat16 if _cuda_bf16_supported(device) else torch.float16
            return torch.float16 if device.type == "mps" else torch.bfloat16
        if key not in _DTYPES:
            raise ModelLoadError(f"unknown dtype {dtype!r}; valid dtypes are: {_VALID_DTYPES}")
        resolved = _DTYPES[key]
    else:
        raise ModelLoadError(f"dtype must be a string or a torch.dtype, got {type(dtype).__name__}")
    if resolved == torch.bfloat16 and device.type == "cuda" and not _cuda_bf16_supported(device):
        raise ModelLoadError(
            f"bfloat16 is not supported natively on {device} ({torch.cuda.get_device_name(device)}); "
            "use dtype='float16' (or 'float32')"
        )
    return resolved


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------


KV_CACHE_DTYPES = {"auto": None, "float32": torch.float32, "float16": torch.float16}


def load_model(
    spec: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "auto",
    progress: bool = True,
    quantization: str = "auto",
    group_size: int = DEFAULT_INT4_GROUP_SIZE,
    kv_cache_dtype: str = "auto",
) -> LoadedModel:
    """Load a bundled model name, a Hugging Face model directory or a ``.gguf`` file.

    The device, dtype and quantization are checked first, so a bad argument fails before any
    download or conversion. A bundled model is fetched if needed; a GGUF file is converted on
    first use (``progress`` shows a progress bar on stderr for both). ``quantization``:
    ``auto`` runs a GGUF file's own quantized weights on the native CPU kernels where they are
    available (``gguf``, see :mod:`verispec.models.native`; with ``dtype="auto"`` its
    activations are then float32) and loads anything else dense (``none``); ``int8`` or ``int4`` (with ``group_size``) pack the linear layers after loading,
    see :func:`verispec.models.quant.quantize_`. ``kv_cache_dtype``: ``auto`` keeps the KV cache
    in float16 for a native model with float32 activations (the default on CPU, see
    :func:`~verispec.models.native.float_activations_`) and in the model's dtype otherwise;
    ``float32`` or ``float16`` set it.
    """
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    check_scheme(quantization, group_size)
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ModelLoadError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if quantization not in ("none", "auto") and dev.type != "cpu":
        raise ModelLoadError(f"quantization {quantization!r} runs on the CPU only; use quantization='none' on {dev}")
    spec_str = os.fspath(spec)
    try:
        path = resolve_model(spec_str, progress=progress)
    except FileNotFoundError as exc:
        raise ModelFileNotFoundError(str(exc)) from None
    if path.is_dir():
        if quantization == "gguf":
            raise ModelLoadError(f"quantization 'gguf' runs a GGUF file's own weights, and {spec!s} is not a GGUF file")
        loaded = load_hf_dir(path, device=dev, dtype=torch_dtype, name=path.resolve().name)
    else:
        # a GGUF's own blocks on the kernels: asked for, or the default on a CPU that has them
        native = quantization == "gguf" or (quantization == "auto" and dev.type == "cpu" and kernels.available())
        name = spec_str if spec_str in BUNDLED_MODELS else path.stem
        float_activations = native and isinstance(dtype, str) and dtype.strip().lower() == "auto"
        # float32 activations: the tensors left dense (norms, biases) are built in float32 from
        # the file, not rounded to bf16 first and widened after
        loaded = load_gguf(path, device=dev, dtype=torch.float32 if float_activations else torch_dtype,
                           native=native, name=name, progress=progress)
        if float_activations:
            float_activations_(loaded.model)
    quantize_(loaded.model, quantization, group_size)
    if quantization in ("int8", "int4") and isinstance(dtype, str) and dtype.strip().lower() == "auto":
        if is_native(loaded.model):  # as for a GGUF model on the kernels
            float_activations_(loaded.model)
    if kv_cache_dtype != "auto":
        loaded.model.kv_cache_dtype = KV_CACHE_DTYPES[kv_cache_dtype]
    return loaded


def load_gguf(path: str | Path, *, device: torch.device, dtype: torch.dtype, native: bool, name: str | None = None,
              progress: bool = True) -> LoadedModel:
    """Load a GGUF file straight into a :class:`Decoder`, as llama.cpp does: the configuration and
    tokenizer from its metadata (read once into a small cache, :func:`gguf_metadata`), and every
    tensor from the memory-mapped file. With ``native`` the linear layers are built on the file's
    own blocks (:func:`install_gguf_layers_`, on the weightless model, so their dense weights
    never exist), the embedding table stays in the file's blocks (:class:`GGUFEmbedding`), and
    only the rest (norms, biases, layers the kernels do not run) is dequantized; without it
    every tensor is dequantized into dense layers."""
    path = Path(path)
    header = read_gguf_header(path)
    meta = gguf_metadata(path, progress=progress)
    hf_config = read_json_object(meta / "config.json")
    try:
        config = DecoderConfig.from_hf(hf_config)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{path}: {exc}") from None
    tokenizer = _load_tokenizer(meta, hf_config)
    tensors = GGUFTensors(header, meta)

    def build(model: Decoder) -> None:
        try:
            install_gguf_layers_(model, tensors)
        except KernelError as exc:
            raise ModelLoadError(str(exc)) from None
        # the table stays in the file's blocks, unless a tied head that the kernels do not run
        # multiplies by it as a dense weight
        embed = GGUFEmbedding.from_tensors(tensors, "model.embed_tokens.weight", dtype)
        if embed is not None and not (config.tie_word_embeddings and model.lm_head is None):
            model.embed = embed

    model = Decoder.empty(config, dtype=dtype, device=device, build=build if native else None)
    try:
        model.load_hf_weights(tensors)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    tensors.release_pages()
    return LoadedModel(model=model, tokenizer=tokenizer, source=path, hf_config=hf_config,
                       name=name or path.stem)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Hugging Face directories
# ---------------------------------------------------------------------------------------------


def load_hf_dir(
    directory: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "auto",
    name: str | None = None,
) -> LoadedModel:
    """Load a local Hugging Face model directory (safetensors weights) into a :class:`Decoder`."""
    directory = Path(directory)
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, dev)
    if not directory.is_dir():
        raise ModelFileNotFoundError(f"no such model directory: {directory}")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelFileNotFoundError(
            f"{directory} is not a Hugging Face model directory: config.json is missing"
        )
    hf_config = read_json_object(config_path)
    try:
        config = DecoderConfig.from_hf(hf_config)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{config_path}: {exc}") from None
    except KeyError as exc:
        raise ModelLoadError(f"{config_path}: required field {exc} is missing") from None
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{config_path}: invalid model configuration ({exc})") from exc
    files = _weight_files(directory)
    tokenizer = _load_tokenizer(directory, hf_config)
    model = Decoder.empty(config, dtype=torch_dtype, device=dev)
    with _open_safetensors(files) as weights:
        try:
            model.load_hf_weights(weights)
        except ValueError as exc:
            raise ModelLoadError(f"{directory}: {exc}") from exc
    return LoadedModel(model=model, tokenizer=tokenizer, source=directory, hf_config=hf_config,
                       name=name or directory.resolve().name)  # fmt: skip


def _weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a model directory, single-file or sharded."""
    index = directory / _INDEX_FILE
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no 'weight_map'")
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelFileNotFoundError(
                f"{directory}: shard(s) listed in {_INDEX_FILE} are missing: {', '.join(missing)}"
            )
        return files
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(directory.glob("*.safetensors"))
    if others:
        return others
    hint = ""
    if any(directory.glob("*.bin")) or any(directory.glob("*.pt")) or any(directory.glob("*.pth")):
        hint = " (found PyTorch .bin/.pt weights; only safetensors checkpoints are supported)"
    raise ModelFileNotFoundError(
        f"no weights in {directory}: model.safetensors (or {_INDEX_FILE} with its shards) is missing{hint}"
    )


def _load_tokenizer(directory: Path, hf_config: Mapping[str, Any]) -> Tokenizer:
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelFileNotFoundError(f"no tokenizer in {directory}: tokenizer.json is missing")
    try:
        return Tokenizer.from_pretrained(directory, hf_config)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"could not load the tokenizer of {directory}: {exc}") from exc


class _LazyTensors(Mapping[str, Tensor]):
    """HF-named tensors read on access from open safetensors handles (memory-mapped)."""

    def __init__(self, where: dict[str, tuple[Any, Path]]) -> None:
        self._where = where

    def __getitem__(self, key: str) -> Tensor:
        from safetensors import SafetensorError

        handle, path = self._where[key]
        try:
            return handle.get_tensor(key)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"corrupt safetensors file: {path} (reading {key!r}: {exc})") from exc

    def __contains__(self, key: object) -> bool:  # Mapping's default would read the tensor
        return key in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


@contextlib.contextmanager
def _open_safetensors(files: list[Path]) -> Iterator[_LazyTensors]:
    from safetensors import SafetensorError, safe_open

    with contextlib.ExitStack() as stack:
        where: dict[str, tuple[Any, Path]] = {}
        for path in files:
            try:
                handle = stack.enter_context(safe_open(str(path), framework="pt", device="cpu"))
                keys = list(handle.keys())
            except (SafetensorError, OSError) as exc:
                raise ModelLoadError(f"corrupt or unreadable safetensors file: {path} ({exc})") from exc
            for key in keys:
                where[key] = (handle, path)
        yield _LazyTensors(where)
