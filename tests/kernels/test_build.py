"""Building and loading the native kernels: a build killed part-way must not hang the next one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import verispec
from verispec import kernels
from verispec.runtime import verispec_home


def _probe(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=Path(verispec.__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(not kernels.available(), reason="needs the native kernels")
def test_a_baton_left_by_a_killed_build_does_not_hang_the_next_load():
    # torch's build baton is a plain file named "lock" in the build directory; a process killed
    # while it builds leaves it, and torch waits for it to go away, forever. Such a build never
    # marked itself finished.
    build = verispec_home() / "kernels" / kernels.build_key()
    baton, finished = build / "lock", build / kernels._FINISHED
    marker = finished.read_text()
    finished.unlink()
    baton.touch()
    try:
        done = _probe("import verispec.kernels as k; print(k.available())")
        assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]
        assert not baton.exists()
        assert finished.is_file()  # the build that went through marked itself finished again
    finally:
        baton.unlink(missing_ok=True)
        if not finished.exists():
            finished.write_text(marker)


@pytest.mark.skipif(not kernels.available(), reason="needs the native kernels")
def test_a_finished_build_is_imported_without_torchs_compiler_support():
    done = _probe("import sys, verispec.kernels as k; print(k.available(), 'torch.utils.cpp_extension' in sys.modules)")
    assert done.returncode == 0 and done.stdout.split() == ["True", "False"], done.stderr[-2000:]
