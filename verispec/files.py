"""File-system helpers for every floor: an exclusive lock across processes, and durable renames.

A lock is the operating system's (``flock``), so it is released when its holder exits, however
it exits: a process killed while holding one never leaves the next waiting.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

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
