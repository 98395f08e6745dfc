"""Small file-system helpers shared by the model fetcher, loader and GGUF converter."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from verispec.models.errors import ModelLoadError

try:  # POSIX only; elsewhere concurrent writers of one cache entry are not serialised.
    import fcntl
except ImportError:  # pragma: no cover - exercised on Windows only
    fcntl = None  # type: ignore[assignment]


@contextlib.contextmanager
def file_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` across processes (no-op without ``fcntl``)."""
    if fcntl is None:  # pragma: no cover - non-POSIX
        yield
        return
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def fsync_dir(directory: Path) -> None:
    """Make renames in ``directory`` durable where the platform allows it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; a clear :class:`ModelLoadError` if it is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} should hold a JSON object, found {type(data).__name__}")
    return data
