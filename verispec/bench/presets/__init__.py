"""Preset benchmarks: ``verispec bench NAME [options]``, one module per preset.

Each preset reproduces one report under docs/benchmarks/ with its settings written down. A
preset is a function ``main(argv: list[str]) -> int`` that parses its options (``verispec bench
NAME --help``) and prints a readable table followed by one JSON line. Its options are the common
ones it names, with its defaults, from :class:`~verispec.bench.presets.common.PresetParser`, and
its own, goals included (``--goal-*``, defaulting to the goals of its report). Presets that are
only settings of the general harness (``report``, ``adaptive``, ``spec``) call
:func:`verispec.bench.harness.main` with them; the others have their own loop and share the rest
of :mod:`verispec.bench.presets.common` (question selection, one timed run).

To add a preset: write its module with a ``main(argv)``, add one line to :data:`PRESETS`, and
(optionally) a ``bench-NAME`` target in the Makefile that runs ``verispec bench NAME``.
Modules are imported only when their preset runs, so ``verispec bench --help`` stays fast; most
presets also import the engine, the models and the servers inside the functions that use
them, so that ``verispec bench NAME --help`` does not load those either.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    entry: str  # "module:function", the function taking the preset's argv and returning an exit code
    summary: str  # one line for ``verispec bench --help``


PRESETS: dict[str, Preset] = {
    "report": Preset("verispec.bench.presets.reports:spec_bench_report",
                     "every drafter and peer engines on Spec-Bench (docs/benchmarks/spec-bench.md)"),
    "adaptive": Preset("verispec.bench.presets.reports:adaptive_report",
                       "the adaptive controller against every fixed k (docs/benchmarks/adaptive.md)"),
    "spec": Preset("verispec.bench.presets.spec:main",
                   "draft model and n-grams in bf16 on Spec-Bench, with goals (docs/benchmarks/spec.md)"),
    "suffix": Preset("verispec.bench.presets.suffix:main",
                     "suffix, prompt lookup and lookahead on code edits (docs/benchmarks/suffix.md)"),
    "tree": Preset("verispec.bench.presets.tree:main",
                   "tree against chain at equal verify width (docs/benchmarks/tree.md)"),
    "batch": Preset("verispec.bench.presets.batch:main",
                    "batched plain decode steps, no prefill, per batch size (docs/benchmarks/server.md)"),
    "server": Preset("verispec.bench.presets.server:main",
                     "load test of verispec serve, speculation on against off (docs/benchmarks/server.md)"),
    "scale": Preset("verispec.bench.presets.scale:main",
                    "throughput with 1 and 2 Ray Serve replicas against one server (docs/scaling.md)"),
    "kernels": Preset("verispec.bench.presets.kernels:main",
                      "native kernels: verify pass against decode step, per shape and model (docs/kernels.md)"),
    "decode": Preset("verispec.bench.presets.decode:main",
                     "plain greedy decoding against transformers on the same GGUF (docs/benchmarks/decode.md)"),
    "quant": Preset("verispec.bench.presets.quant:main",
                    "packed weights' decode speed and verify cost, llama.cpp beside (docs/benchmarks/quant.md)"),
    "gguf": Preset("verispec.bench.presets.gguf:main",
                   "any GGUF file against llama.cpp: decode speed, exactness, memory, disk, load times"),
    "agent": Preset("verispec.bench.presets.agent:main",
                    "multi-turn tool calling end to end, llama-server --jinja beside (docs/benchmarks/agent.md)"),
    "quant-accuracy": Preset("verispec.bench.presets.quant_accuracy:main",
                             "int8/int4 agreement with the bf16 model (docs/benchmarks/quant.md)"),
}


def run_preset(name: str, argv: list[str]) -> int:
    """Run preset ``name`` with its own options ``argv``."""
    module, _, function = PRESETS[name].entry.partition(":")
    return getattr(importlib.import_module(module), function)(argv)


def presets_help() -> str:
    width = max(len(name) for name in PRESETS)
    lines = [f"  {name:<{width}}  {preset.summary}" for name, preset in PRESETS.items()]
    return ("presets (verispec bench NAME [options]; verispec bench NAME --help for its options):\n"
            + "\n".join(lines) + "\n")
