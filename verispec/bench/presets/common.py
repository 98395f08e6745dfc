"""What the preset benchmarks share: their command line, Spec-Bench question selection, one
timed greedy run and the report's ending.

The command line. The options several presets take (target, threads, max tokens, questions,
...) are declared once, in :data:`OPTIONS`; a preset names the ones it takes with their
defaults in one call, ``PresetParser("tree", __doc__, target=TARGET, threads=2, ...)``, then adds
only its own options, goals included (:meth:`PresetParser.add_goal`). Parsing checks the common
options (counts at least 1, a question file that exists; ``--questions`` unset is Spec-Bench's
file, :func:`~verispec.bench.workloads.spec_bench_path`).

``verispec bench`` with ``--methods`` is the general harness; the presets that need their own
side-by-side tables (suffix, tree, batch, server) use the other pieces.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verispec.bench.report import first_divergence
from verispec.bench.workloads import SPEC_BENCH_ENV, read_jsonl, spec_bench_path
from verispec.config import SamplingParams

__all__ = ["DRAFT", "OPTIONS", "TARGET", "PresetParser", "chat_questions", "emit_report", "first_divergence",
           "goal_status", "number", "run_one", "select_questions", "spec_bench_path"]

TARGET = "qwen2.5-coder-1.5b-instruct"  # the presets' default target
DRAFT = "qwen2.5-coder-0.5b-instruct"  # ... and draft model
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4")


@dataclass(frozen=True)
class Option:
    """One option several presets take; each preset gives its own default."""

    flag: str
    help: str
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    minimum: int | None = None  # checked after parsing (None: unchecked)
    unset: str = ""  # what a default of None means, for --help


_QUESTION_FILE = dict(help="Spec-Bench's question.jsonl", type=Path,
                      unset=f"${SPEC_BENCH_ENV}, else the copy shipped with verispec")

OPTIONS: dict[str, Option] = {
    "target": Option("--target", "target model: a bundled name, HF model directory or GGUF file"),
    "model": Option("--model", "model: a bundled name or GGUF file"),
    "draft": Option("--draft", "draft model"),
    "threads": Option("--threads", "torch intra-op threads", int, minimum=1, unset="the physical cores"),
    "max_tokens": Option("--max-tokens", "most tokens generated per request", int, minimum=1),
    "repeats": Option("--repeats", "timed rounds over everything compared, interleaved", int, minimum=1),
    "num_questions": Option("--num-questions", "questions per category", int, minimum=1),
    "questions": Option("--questions", **_QUESTION_FILE),
    "question_file": Option("--question-file", **_QUESTION_FILE),
    "dtype": Option("--dtype", "compute dtype: auto (float32 activations on the native kernels), bfloat16, "
                               "float32 or float16"),
    "quantization": Option("--quantization", "the linear layers of the models it loads; auto: a GGUF file's own "
                                             "weights on the native kernels", choices=QUANTIZATIONS),
    "speculative_config": Option("--speculative-config", "the drafter, as verispec serve takes it (JSON)",
                                 unset="none, plain decoding"),
    "requests": Option("--requests", "requests per server and round, the same questions every round", int,
                       minimum=1),
    "max_num_seqs": Option("--max-num-seqs", "engine slots", int, minimum=1),
    "max_model_len": Option("--max-model-len", "the longest sequence an engine holds", int, minimum=1),
    "out": Option("--out", "also write the JSON result to this file", Path, unset="none"),
}
QUESTION_FILES = ("questions", "question_file")  # resolved and checked after parsing


class PresetParser(argparse.ArgumentParser):
    """``verispec bench NAME``'s options: the common ones it names, with their defaults, and its own."""

    def __init__(self, name: str, description: str | None, **defaults: Any) -> None:
        super().__init__(prog=f"verispec bench {name}", description=description,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
        self.common = {key: OPTIONS[key] for key in defaults}
        for key, default in defaults.items():
            o = self.common[key]
            shown = o.unset if default is None else "%(default)s"
            self.add_argument(o.flag, type=o.type, choices=o.choices, default=default,
                              help=f"{o.help} (default: {shown})")

    def add_goal(self, name: str, default: float, what: str) -> None:
        """``--goal-NAME X``: the least ``what`` the preset's report calls met."""
        self.add_argument(f"--goal-{name}", type=float, default=default, metavar="X",
                          help=f"goal: {what} (default: %(default)s)")

    def parse_known_args(self, args=None, namespace=None):  # parse_args comes here too
        parsed, rest = super().parse_known_args(args, namespace)
        for key, o in self.common.items():
            value = getattr(parsed, key)
            if o.minimum is not None and value is not None and value < o.minimum:
                self.error(f"{o.flag} must be at least {o.minimum}, got {value}")
            if key in QUESTION_FILES:
                setattr(parsed, key, self._question_file(value))
        return parsed, rest

    def _question_file(self, path: Path | None) -> Path:
        if path is None:
            try:
                path = spec_bench_path()
            except FileNotFoundError as exc:
                self.error(str(exc))
        if not path.is_file():
            self.error(f"question file not found: {path}")
        return path


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


def number(v: float | None, spec: str = ".2f") -> str:
    """``v`` in a report's table, formatted with ``spec``; "n/a" where it was not measured."""
    return "n/a" if v is None else format(v, spec)


def goal_status(met: bool | None) -> str:
    """Whether a goal was met, in a report's words ("n/a": not judged)."""
    return "n/a" if met is None else "met" if met else "NOT met"


def emit_report(report: dict, print_table: Callable[[dict], None], out: Path | None) -> int:
    """A preset's ending: its Markdown table, then the report as one JSON line (also written to
    ``out`` when given). Returns the exit code 0."""
    print_table(report)
    line = json.dumps(report)
    print(line)
    if out:
        out.write_text(line + "\n")
    return 0
