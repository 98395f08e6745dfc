"""What the preset benchmarks share: Spec-Bench question selection and one timed greedy run.

``verispec bench`` with ``--methods`` is the general harness; the presets that need their own
side-by-side tables (suffix, tree, batch, server) use these few pieces.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verispec.bench.report import first_divergence
from verispec.bench.workloads import read_jsonl, spec_bench_path

__all__ = ["chat_questions", "first_divergence", "run_one", "select_questions", "spec_bench_path"]


def _by_category(path: Path) -> dict[str, list[dict]]:
    """The question file's questions per category, in file order."""
    try:
        rows = read_jsonl(path.read_text(encoding="utf-8"), str(path))
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    by_cat: dict[str, list[dict]] = {}
    for q in rows:
        by_cat.setdefault(q["category"], []).append(q)
    return by_cat


def select_questions(path: Path, n: int) -> list[dict]:
    """First ceil(n/2) coding questions, then floor(n/2) alternating summarization / rag."""
    by_cat = _by_category(path)
    n_coding, n_other = (n + 1) // 2, n // 2
    coding = by_cat.get("coding", [])[:n_coding]
    summ, rag = by_cat.get("summarization", []), by_cat.get("rag", [])
    other: list[dict] = []
    for i in range(n_other):
        src = summ if i % 2 == 0 else rag
        if i // 2 < len(src):
            other.append(src[i // 2])
    if len(coding) < n_coding or len(other) < n_other:
        raise SystemExit(
            f"{path} has too few questions for --num-questions {n}: need {n_coding} coding "
            f"(found {len(by_cat.get('coding', []))}) and {n_other} summarization/rag "
            f"(found {len(summ)} + {len(rag)})"
        )
    return coding + other


LONG_PROMPT_CATEGORIES = ("summarization", "rag")  # 700-2,000-token documents


def chat_questions(path: Path, n: int) -> list[dict]:
    """``n`` short chat questions: one from each category in turn (Spec-Bench file order),
    skipping the long-document categories, so any prefix mixes the task kinds evenly."""
    by_cat = {c: qs for c, qs in _by_category(path).items() if c not in LONG_PROMPT_CATEGORIES}
    picked: list[dict] = []
    for i in range(n):
        for questions in by_cat.values():
            if i < len(questions) and len(picked) < n:
                picked.append(questions[i])
    if len(picked) < n:
        raise SystemExit(f"{path} has only {len(picked)} short chat questions, {n} asked for")
    return picked


def run_one(engine: Any, prompt_ids: list[int], max_tokens: int) -> dict:
    from verispec.config import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    seq = engine.generate(prompt_ids, params)
    total = time.perf_counter() - t0
    prefill = seq.metrics.prefill_time_s
    return {
        "output_ids": list(seq.output_ids),
        "metrics": seq.metrics,
        "total_s": total,
        "prefill_s": prefill,
        "decode_s": total - prefill,
        "decode_tokens": max(len(seq.output_ids) - 1, 0),
        "finish_reason": seq.finish_reason,
    }


def emit_report(report: dict, print_table: Callable[[dict], None], out: Path | None) -> int:
    """A preset's ending: its Markdown table, then the report as one JSON line (also written to
    ``out`` when given). Returns the exit code 0."""
    print_table(report)
    line = json.dumps(report)
    print(line)
    if out:
        out.write_text(line + "\n")
    return 0
