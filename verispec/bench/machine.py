"""What a benchmark records about the machine it ran on, and its warnings about a busy one."""

from __future__ import annotations

import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

BUSY_LOAD = 0.5  # a 1-minute load average above this before a run means other work competes


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def machine_load(threads: int | None) -> float:
    """The 1-minute load average; warns when other work is likely to disturb the timings."""
    load = os.getloadavg()[0]
    if load > BUSY_LOAD:
        log(f"warning: 1-minute load average is {load:.2f} before the benchmark starts; other "
            f"processes compete for the {os.cpu_count()} CPUs and the timings ({threads or 'default'} "
            "threads) will be noisy -- prefer a quiet machine")
    return load


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def source_revision() -> str | None:
    """The git commit verispec runs from (``+dirty`` with uncommitted changes); None outside a checkout."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "verispec"],
                               cwd=root, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("+dirty" if dirty else "") if rev else None


def machine_info() -> dict:
    import torch
    import transformers

    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "loadavg_start": os.getloadavg()[0],
        "revision": source_revision(),
    }
