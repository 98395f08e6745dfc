"""``verispec bench spec``: speculation in bf16 on Spec-Bench, a preset of ``verispec bench``.

Runs Qwen2.5-Coder-1.5B-Instruct drafted by Qwen2.5-Coder-0.5B-Instruct (``draft_model`` with
k = 2 and 4) and ``ngram`` (k = 4) against plain decoding on Spec-Bench's ``coding``,
``summarization`` and ``rag`` questions, greedy, through :mod:`verispec.bench` (interleaved
methods, equality check, report files in ``--out``), then states this benchmark's two goals:

* ``ngram`` at least 1.4x on summarization and rag, their runs pooled;
* ``draft_model`` at least 1.2x on coding.

Any further argument is passed on to ``verispec bench`` (e.g. ``--repeats 2``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from verispec.bench import cli as bench_cli
from verispec.bench.report import load_report

GOAL_NGRAM = 1.4
GOAL_DRAFT = 1.2


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="verispec bench spec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="(default: %(default)s)")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct", help="(default: %(default)s)")
    p.add_argument("--num-questions", type=int, default=5, help="questions per category (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path("bench-spec-report"), help="(default: %(default)s)")
    return p.parse_known_args(argv)


def speedup_of(report: dict, name: str, categories: list[str]) -> tuple[str | None, float | None]:
    """Best method called ``name``: its speedup pooled over ``categories`` (tokens / time)."""
    best: tuple[str | None, float | None] = (None, None)
    plain = [r for r in report["runs"] if r["method"] == "plain" and r["category"] in categories]
    plain_tok_s = sum(r["output_tokens"] for r in plain) / sum(r["total_s"] for r in plain)
    for m in report["methods"]:
        runs = [r for r in report["runs"] if r["method"] == m["label"] and r["category"] in categories]
        if m["name"] == name and runs:
            speedup = sum(r["output_tokens"] for r in runs) / sum(r["total_s"] for r in runs) / plain_tok_s
            if best[1] is None or speedup > best[1]:
                best = (m["label"], speedup)
    return best


def main(argv: list[str] | None = None) -> int:
    args, rest = parse_args(argv)
    d = args.draft
    code = bench_cli.main([
        "--model", args.target, "--questions", "spec-bench", "--categories", "coding,summarization,rag",
        "--methods", f"plain,draft_model:{d}@k=2,draft_model:{d}@k=4,ngram@k=4",
        "--num-questions", str(args.num_questions), "--max-tokens", str(args.max_tokens),
        "--threads", str(args.threads), "--dtype", "bfloat16", "--out", str(args.out), *rest,
    ])
    if code not in (0, 130):
        return code
    report = load_report(args.out / "report.json")
    for name, cats, goal in (("ngram", ["summarization", "rag"], GOAL_NGRAM), ("draft_model", ["coding"], GOAL_DRAFT)):
        label, speedup = speedup_of(report, name, cats)
        status = "n/a" if speedup is None else ("met" if speedup >= goal else "NOT met")
        shown = "n/a" if speedup is None else f"{speedup:.2f}"
        print(f"- goal: best {label or name} on {'+'.join(cats)}: {shown}x (goal >= {goal}x, {status})")
    return code


if __name__ == "__main__":
    sys.exit(main())
