"""Logging and machine-load helpers for the benchmark scripts (they live in :mod:`verispec.bench.machine`)."""

from verispec.bench.machine import log, machine_load  # noqa: F401  (re-exported for the scripts)
__all__ = ["log", "machine_load"]
