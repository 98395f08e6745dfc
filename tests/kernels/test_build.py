"""Building and loading the native kernels: a build killed part-way must not hang the next one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import verispec
from verispec import kernels
from verispec.runtime import verispec_home


@pytest.mark.skipif(not kernels.available(), reason="needs the native kernels")
def test_a_baton_left_by_a_killed_build_does_not_hang_the_next_load():
    # torch's build baton is a plain file named "lock" in the build directory; a process killed
    # while it builds leaves it, and torch waits for it to go away, forever.
    baton = verispec_home() / "kernels" / kernels.build_key() / "lock"
    baton.touch()
    try:
        done = subprocess.run([sys.executable, "-c", "import verispec.kernels as k; print(k.available())"],
                              cwd=Path(verispec.__file__).resolve().parents[1], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]
        assert not baton.exists()
    finally:
        baton.unlink(missing_ok=True)
