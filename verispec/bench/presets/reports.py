"""The two long reports under docs/benchmarks/, as settings of ``verispec bench``.

Each takes hours on a small CPU machine (docs/benchmarks/ gives the times). Ctrl-C writes a
partial report; the same preset with ``--resume`` continues it, running only the question blocks
it lacks. Any further option is passed on to
``verispec bench`` (e.g. ``--out DIR``, which then wins over the preset's).
"""

from __future__ import annotations

import argparse

from verispec.bench import harness
from verispec.bench.presets.common import DRAFT, TARGET

DRAFT_METHOD = f"draft_model:{DRAFT}"
ALL_CATEGORIES = ("writing,roleplay,reasoning,math,coding,extraction,stem,humanities,translation,summarization,qa,"
                  "math_reasoning,rag")

REPORT_METHODS = ",".join([
    "plain", "ngram@k=4", "suffix@k=8", "lookahead@k=3", f"{DRAFT_METHOD}@k=4",
    f"{DRAFT_METHOD}@k=5,draft_topk=2,num_draft_tokens=6",
])
# The other engines the report runs beside verispec, unless --peers names others (e.g. llama-server
# in its speculative modes, as openai:URL@LABEL methods).
REPORT_PEERS = ",".join([
    "hf:plain", f"hf:assisted:{DRAFT}", "hf:prompt_lookup", "llamacpp:plain", "llamacpp:prompt_lookup",
])
ADAPTIVE_METHODS = ",".join([
    "plain", "ngram@k=8",
    *(f"ngram@k={k},adaptive=false" for k in (1, 2, 4, 6, 8)),
    f"{DRAFT_METHOD}@k=8,quantization=int4",
    *(f"{DRAFT_METHOD}@k={k},adaptive=false,quantization=int4" for k in (1, 2, 4, 6, 8)),
])


def _run(name: str, out: str, settings: list[str], argv: list[str], extra: str = "") -> int:
    description = (f"verispec bench with the settings of docs/benchmarks/{out}: {' '.join(settings)}. "
                   "Options given here are added after them (a repeated option wins)." + (" " + extra if extra else ""))
    return harness.main([*settings, *argv], prog=f"verispec bench {name}", description=description)


def split_method_options(argv: list[str]) -> tuple[str | None, str | None, list[str]]:
    """``--peers LIST`` and ``--methods LIST`` taken out of ``argv`` (None where not given), and
    the rest."""
    parser = argparse.ArgumentParser(prog="verispec bench report", add_help=False, allow_abbrev=False)
    parser.add_argument("--peers")
    parser.add_argument("--methods")
    known, rest = parser.parse_known_args(argv)
    return known.peers, known.methods, rest


def spec_bench_report(argv: list[str]) -> int:
    """``make bench-report``: docs/benchmarks/spec-bench/. The target and its drafts run on the GGUF
    files' own weights (the native kernels on a CPU). ``--methods`` replaces the verispec methods;
    the peers run beside them: ``--peers``, or without it the default peers unless ``--methods``
    was given (a run of a few chosen methods stays that)."""
    peers, ours, argv = split_method_options(argv)
    if peers is None:
        peers = REPORT_PEERS if ours is None else ""
    methods = ",".join(m for m in (REPORT_METHODS if ours is None else ours, peers) if m)
    return _run("report", "spec-bench", [
        "--model", TARGET, "--threads", "2", "--num-questions", "3",
        "--max-tokens", "128", "--out", "docs/benchmarks/spec-bench", "--no-progress",
        "--methods", methods,
    ], argv, extra=(f"--peers LIST replaces the other engines run beside verispec (default: {REPORT_PEERS}, "
                    "or none with --methods; empty: none), e.g. llama-server in its speculative modes as "
                    "openai:URL@LABEL methods; they run beside the verispec methods, --methods included."))


def adaptive_report(argv: list[str]) -> int:
    """``make bench-adaptive``: docs/benchmarks/adaptive/."""
    return _run("adaptive", "adaptive", [
        "--model", TARGET, "--quantization", "int4", "--threads", "2", "--categories", ALL_CATEGORIES,
        "--num-questions", "3", "--max-tokens", "128", "--max-turns", "1", "--out", "docs/benchmarks/adaptive",
        "--no-progress", "--methods", ADAPTIVE_METHODS,
    ], argv)
