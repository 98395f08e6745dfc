"""``verispec bench spec``: speculation in bf16 on Spec-Bench, a preset of ``verispec bench``.

Runs Qwen2.5-Coder-1.5B-Instruct drafted by Qwen2.5-Coder-0.5B-Instruct (``draft_model`` with
k = 2 and 4) and ``ngram`` (k = 4) against plain decoding on Spec-Bench's ``coding``,
``summarization`` and ``rag`` questions, greedy, through :mod:`verispec.bench` (interleaved
methods, equality check, report files in ``--out``), then holds it to this benchmark's two goals:

* ``ngram``'s speedup on summarization and rag, their runs pooled (``--goal-ngram``);
* ``draft_model``'s speedup on coding (``--goal-draft``).

Any further argument is passed on to ``verispec bench`` (e.g. ``--repeats 2``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from verispec.bench import harness
from verispec.bench.goals import judged
from verispec.bench.presets.common import DRAFT, TARGET, PresetParser
from verispec.bench.report import load_report


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = PresetParser("spec", __doc__, target=TARGET, draft=DRAFT, num_questions=5, max_tokens=128, threads=2)
    p.add_argument("--out", type=Path, default=Path("bench-spec-report"),
                   help="the report directory (default: %(default)s)")
    p.add_goal("ngram", 1.4, "ngram's speedup on summarization and rag")
    p.add_goal("draft", 1.2, "draft_model's speedup on coding")
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
    code = harness.main([
        "--model", args.target, "--questions", "spec-bench", "--categories", "coding,summarization,rag",
        "--methods", f"plain,draft_model:{d}@k=2,draft_model:{d}@k=4,ngram@k=4",
        "--num-questions", str(args.num_questions), "--max-tokens", str(args.max_tokens),
        "--threads", str(args.threads), "--dtype", "bfloat16", "--out", str(args.out), *rest,
    ])
    if code not in (0, 130):
        return code
    report = load_report(args.out / "report.json")
    for name, cats, goal in (("ngram", ["summarization", "rag"], args.goal_ngram),
                             ("draft_model", ["coding"], args.goal_draft)):
        label, speedup = speedup_of(report, name, cats)
        met = judged(speedup, goal)["met"]
        status = "n/a" if met is None else ("met" if met else "NOT met")
        shown = "n/a" if speedup is None else f"{speedup:.2f}"
        print(f"- goal: best {label or name} on {'+'.join(cats)}: {shown}x (goal >= {goal}x, {status})")
    return code


if __name__ == "__main__":
    sys.exit(main())
