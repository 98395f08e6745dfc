"""Process-wide CPU settings: how many threads torch uses, and the environment of other programs.

Decoding one token is a chain of matrix-vector products, each split across threads. Threads on
SMT siblings share a core's load ports and vector units, so they add scheduling cost without
adding bandwidth; the default is therefore one thread per *physical* core that this process may
run on (its CPU affinity mask, which also honours ``taskset`` and container CPU sets).
Placement is left to the OS: with one thread per core and nothing pinned, the kernels' OpenMP
threads already spread one per core.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

_TOPOLOGY = Path("/sys/devices/system/cpu")


def foreign_env() -> dict[str, str]:
    """The environment for another program's process: this one's, less what importing verispec
    set for itself (its OpenMP wait policy, under which llama.cpp's threads run slower)."""
    import verispec

    return {k: v for k, v in os.environ.items() if k not in verispec.OWN_ENVIRONMENT}


def physical_cores() -> int:
    """Distinct physical cores among the CPUs this process may use (at least 1).

    Reads the Linux topology files; where they are missing (other systems), every usable
    logical CPU counts as a core.
    """
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topo = _TOPOLOGY / f"cpu{cpu}" / "topology"
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(len(cores), 1)


def set_threads(threads: int | None = None) -> int:
    """Set torch's intra-op thread count (default: :func:`physical_cores`) and return it."""
    if threads is None:
        threads = physical_cores()
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    torch.set_num_threads(threads)
    return threads


def verispec_home() -> Path:
    """Return the cache directory: ``$VERISPEC_HOME`` if set, else ``~/.cache/verispec``."""
    env = os.environ.get("VERISPEC_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "verispec"
