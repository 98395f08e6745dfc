"""``verispec bench``: the general harness (:mod:`verispec.bench.harness`) and its presets.

``verispec bench [options]`` runs the harness; ``verispec bench NAME [options]`` runs a preset
instead (:mod:`verispec.bench.presets`); ``verispec bench --help`` lists them. Imports run one
way: this module uses the presets' registry and the harness, the presets use the harness, and
the harness uses neither.
"""

from __future__ import annotations

import argparse

from verispec.bench.harness import DESCRIPTION, METHODS_HELP, add_arguments, cmd_bench
from verispec.bench.presets import PRESETS, presets_help

__all__ = ["add_parser", "cmd_bench"]

USAGE = (f"verispec bench [-h] [--model MODEL] [--methods METHODS] [options]\n"
         f"       verispec bench {{{','.join(PRESETS)}}} [options]")
def add_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser(
        "bench", help="benchmark decoding methods on Spec-Bench-style questions (report with plots), or run a preset",
        usage=USAGE, description=DESCRIPTION, epilog=presets_help() + "\n" + METHODS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(b)
