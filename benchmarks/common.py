"""Helpers shared by the benchmark scripts (run them as ``python benchmarks/<script>.py``)."""

from __future__ import annotations

import os
import sys


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def machine_load(threads: int) -> float:
    """The 1-minute load average; warns when other work is likely to disturb the timings."""
    load = os.getloadavg()[0]
    if load > 0.5:
        log(f"warning: 1-minute load average is {load:.2f} before the benchmark starts; other "
            f"processes compete for the {os.cpu_count()} CPUs and the timings ({threads} threads) "
            "will be noisy -- prefer a quiet machine")
    return load
