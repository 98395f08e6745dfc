"""The two long reports under docs/benchmarks/, as settings of ``verispec bench``.

Each takes hours on a small CPU machine (docs/benchmarks/ gives the times). Ctrl-C writes a
partial report; the same preset with ``--resume`` continues it, running only the question blocks
it lacks. Any further option is passed on to
``verispec bench`` (e.g. ``--out DIR``, which then wins over the preset's).
"""

from __future__ import annotations

from verispec.bench import cli as bench_cli

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "draft_model:qwen2.5-coder-0.5b-instruct"
HF_DRAFT = "qwen2.5-coder-0.5b-instruct"
ALL_CATEGORIES = ("writing,roleplay,reasoning,math,coding,extraction,stem,humanities,translation,summarization,qa,"
                  "math_reasoning,rag")

REPORT_METHODS = ",".join([
    "plain", "ngram@k=4", "suffix@k=8", "lookahead@k=3", f"{DRAFT}@k=4,quantization=int4",
    f"{DRAFT}@k=5,draft_topk=2,num_draft_tokens=6,quantization=int4", "hf:plain", f"hf:assisted:{HF_DRAFT}",
    "hf:prompt_lookup", "llamacpp:plain", "llamacpp:prompt_lookup",
])
ADAPTIVE_METHODS = ",".join([
    "plain", "ngram@k=8",
    *(f"ngram@k={k},adaptive=false" for k in (1, 2, 4, 6, 8)),
    f"{DRAFT}@k=8,quantization=int4",
    *(f"{DRAFT}@k={k},adaptive=false,quantization=int4" for k in (1, 2, 4, 6, 8)),
])


def _run(name: str, out: str, settings: list[str], argv: list[str]) -> int:
    description = (f"verispec bench with the settings of docs/benchmarks/{out}: {' '.join(settings)}. "
                   "Options given here are added after them (a repeated option wins).")
    return bench_cli.main([*settings, *argv], prog=f"verispec bench {name}", description=description)


def spec_bench_report(argv: list[str]) -> int:
    """``make bench-report``: docs/benchmarks/spec-bench/."""
    return _run("report", "spec-bench", [
        "--model", TARGET, "--quantization", "int4", "--threads", "2", "--num-questions", "3",
        "--max-tokens", "128", "--out", "docs/benchmarks/spec-bench", "--no-progress",
        "--methods", REPORT_METHODS,
    ], argv)


def adaptive_report(argv: list[str]) -> int:
    """``make bench-adaptive``: docs/benchmarks/adaptive/."""
    return _run("adaptive", "adaptive", [
        "--model", TARGET, "--quantization", "int4", "--threads", "2", "--categories", ALL_CATEGORIES,
        "--num-questions", "3", "--max-tokens", "128", "--max-turns", "1", "--out", "docs/benchmarks/adaptive",
        "--no-progress", "--methods", ADAPTIVE_METHODS,
    ], argv)
