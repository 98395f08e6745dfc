"""Speculative decoding on Spec-Bench questions: every method against plain decoding.

Questions come from Spec-Bench's ``question.jsonl``: half ``coding`` and half alternating
``summarization`` / ``rag`` (the first ones of each category in file order). Each question's
first turn goes through the target's chat template; decoding is greedy (T = 0), batch 1, and
stops at EOS or ``--max-tokens``.

Methods are ``name:k`` (k draft tokens per round); ``plain`` is the baseline and is always run.
``draft_model`` methods share one loaded draft model (one :class:`DraftModelDrafter`, whose
cache is reset per request); every other method is built from the drafter registry through
:class:`~verispec.config.SpeculativeConfig`. All engines are built once. For each question every
method runs in turn (the starting method rotates from question to question), so machine drift
hits all methods alike.

Figures per method and per group (coding, summarization+rag, overall):

* decode tokens/s -- output tokens after the first / (wall time of ``generate`` - prefill);
* speedup -- plain's total decode time / the method's, over the same questions (equal to the
  ratio of decode tokens/s when the outputs are token-identical, which greedy decoding should
  guarantee; the "identical" column says whether they are);
* mean acceptance length, acceptance rate, per-position acceptance (see
  :mod:`verispec.spec.metrics`);
* c and alpha from :meth:`SpecMetrics.cost_model` with T_target(1) taken from plain decoding's
  measured single-position step time in the same group.

The target's prefill is excluded from decode time for every method. A ``draft_model`` drafter
reads the prompt in its first ``propose`` call, after the target's prefill, so the draft model's
own prefill counts as drafting time: it is part of what the method costs, and it raises c
(noticeably for long summarization / rag prompts with few output tokens).

The output is a Markdown table followed by one JSON line with every figure (``--out`` also
writes that JSON to a file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import log, machine_load  # benchmarks/common.py

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_QUESTIONS = REPO_ROOT.parent / "shared/data/spec_bench/question.jsonl"
DEFAULT_METHODS = "plain,draft_model:2,draft_model:4,ngram:4"
DEFAULT_K = 4
GROUPS = ("coding", "summarization+rag", "overall")
GOAL_NGRAM = 1.4  # best ngram speedup on summarization+rag
GOAL_DRAFT = 1.2  # best draft_model speedup on coding


@dataclass(frozen=True)
class Method:
    name: str  # registry method name, or "plain"
    k: int  # draft tokens per round (0 for plain)

    @property
    def label(self) -> str:
        return "plain" if self.name == "plain" else f"{self.name}:{self.k}"


def parse_methods(text: str) -> list[Method]:
    """Parse ``plain,draft_model:2,ngram:4`` (k defaults to 4); plain is put first."""
    methods: list[Method] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        name, sep, k_text = item.partition(":")
        name = name.strip()
        if name == "plain":
            if sep:
                raise ValueError(f"method 'plain' takes no k, got {item!r}")
            method = Method("plain", 0)
        else:
            try:
                k = int(k_text) if sep else DEFAULT_K
            except ValueError:
                raise ValueError(f"bad k in method {item!r}: expected name:k with an integer k") from None
            if k < 1:
                raise ValueError(f"k must be >= 1 in method {item!r}")
            method = Method(name, k)
        if method not in methods:
            methods.append(method)
    if not any(m.name != "plain" for m in methods):
        raise ValueError(f"no speculative method in {text!r}; give e.g. {DEFAULT_METHODS}")
    plain = Method("plain", 0)
    return [plain] + [m for m in methods if m != plain]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Benchmark speculative decoding methods against plain decoding on Spec-Bench questions.",
    )
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="target model (default: %(default)s)")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct",
                   help="draft model for draft_model methods (default: %(default)s)")
    p.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS,
                   help="Spec-Bench question.jsonl (default: shared/data/spec_bench/question.jsonl "
                        "next to the repository)")
    p.add_argument("--num-questions", type=int, default=10,
                   help="questions: half coding, half alternating summarization/rag (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="max generated tokens per question (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype of both models (default: %(default)s)")
    p.add_argument("--quantization", default="none", choices=("none", "int8", "int4"),
                   help="packed weights for both models (default: %(default)s)")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma-separated name:k list; plain is always included (default: %(default)s)")
    p.add_argument("--no-warmup", action="store_true", help="skip the short untimed warm-up run of each engine")
    p.add_argument("--out", type=Path, help="also write the JSON result to this file")
    args = p.parse_args(argv)
    if args.num_questions < 1:
        p.error("--num-questions must be at least 1")
    if args.max_tokens < 2:
        p.error("--max-tokens must be at least 2")
    if args.threads < 1:
        p.error("--threads must be at least 1")
    try:
        args.method_list = parse_methods(args.methods)
    except ValueError as exc:
        p.error(f"--methods: {exc}")
    from verispec.spec.base import available_methods

    unknown = sorted({m.name for m in args.method_list if m.name != "plain"} - set(available_methods()))
    if unknown:
        p.error(f"--methods: unknown method(s) {', '.join(unknown)}; valid: plain, {', '.join(available_methods())}")
    if not args.questions.is_file():
        p.error(f"question file not found: {args.questions}. Pass --questions PATH to Spec-Bench's question.jsonl")
    return args


# ---------------------------------------------------------------------------------------------
# questions
# ---------------------------------------------------------------------------------------------


def select_questions(path: Path, n: int) -> list[dict]:
    """First ceil(n/2) coding questions, then floor(n/2) alternating summarization / rag."""
    by_cat: dict[str, list[dict]] = {}
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                q = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SystemExit(f"{path}:{lineno}: not valid JSON ({exc})") from None
            if not q.get("turns"):
                raise SystemExit(f"{path}:{lineno}: question has no turns")
            by_cat.setdefault(q.get("category", ""), []).append(q)
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


def group_of(question: dict) -> str:
    return "coding" if question["category"] == "coding" else "summarization+rag"


# ---------------------------------------------------------------------------------------------
# engines
# ---------------------------------------------------------------------------------------------


def build_engines(args: argparse.Namespace, target: Any, max_model_len: int, dtype: torch.dtype) -> dict:
    from verispec.config import SpeculativeConfig
    from verispec.engine.engine import Engine
    from verispec.models.loader import load_model
    from verispec.spec.draft_model import DraftModelDrafter, check_vocab_compatible

    engines: dict[str, Any] = {}
    shared_drafter = None
    for m in args.method_list:
        if m.name == "plain":
            engines[m.label] = Engine(target, None, max_model_len=max_model_len)
            continue
        if m.name == "draft_model":
            if shared_drafter is None:
                log(f"loading draft {args.draft} ...")
                draft = load_model(args.draft, device=target.model.device, dtype=dtype,
                                   quantization=args.quantization)
                check_vocab_compatible(target, draft)
                shared_drafter = DraftModelDrafter(draft, target.model.config.vocab_size, max_model_len)
            config = SpeculativeConfig(method="draft_model", num_speculative_tokens=m.k, model=args.draft)
            engines[m.label] = Engine(target, config, max_model_len=max_model_len, drafter=shared_drafter)
        else:
            config = SpeculativeConfig(method=m.name, num_speculative_tokens=m.k)
            engines[m.label] = Engine(target, config, max_model_len=max_model_len)
    return engines


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


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---------------------------------------------------------------------------------------------
# aggregation and report
# ---------------------------------------------------------------------------------------------


def aggregate(runs: list[dict], questions: list[dict], methods: list[Method]) -> dict:
    from verispec.spec.metrics import SpecMetrics

    qgroup = {q["question_id"]: group_of(q) for q in questions}
    results: dict[str, dict[str, dict]] = {}
    plain_t1: dict[str, float | None] = {}
    plain_decode_s: dict[str, float] = {}
    for m in methods:  # plain first, so its T_target(1) and decode time are known for the rest
        results[m.label] = {}
        for group in GROUPS:
            sel = [r for r in runs if r["method"] == m.label and (group == "overall" or qgroup[r["qid"]] == group)]
            if not sel:
                continue
            metrics = SpecMetrics()
            for r in sel:
                metrics.merge(r["metrics"])
            decode_s = sum(r["decode_s"] for r in sel)
            tokens = sum(r["decode_tokens"] for r in sel)
            if m.name == "plain":
                plain_t1[group] = metrics.target_step_time(1)
                plain_decode_s[group] = decode_s
            summary = metrics.summary(plain_t1.get(group))
            diverged = [r for r in sel if r["divergence"] is not None]
            results[m.label][group] = {
                "questions": len(sel),
                "decode_tokens": tokens,
                "decode_s": decode_s,
                "prefill_s": sum(r["prefill_s"] for r in sel),
                "decode_tok_s": tokens / decode_s if decode_s > 0 else None,
                "speedup": plain_decode_s[group] / decode_s if decode_s > 0 else None,
                "mean_acceptance_length": summary["mean_acceptance_length"],
                "acceptance_rate": summary["acceptance_rate"],
                "per_position_acceptance": summary["per_position_acceptance"],
                "target_step_time_s": summary["target_step_time_s"],
                "c": summary["c"],
                "alpha": summary["alpha"],
                "identical": len(sel) - len(diverged),
                "first_divergence": (
                    {"question_id": diverged[0]["qid"], "index": diverged[0]["divergence"]} if diverged else None
                ),
                "draft_time_s": summary["draft_time_s"],
                "verify_time_s": summary["verify_time_s"],
                "other_time_s": summary["other_time_s"],
            }
    return results


def goals(results: dict, methods: list[Method]) -> dict:
    def best(name: str, group: str) -> tuple[str | None, float | None]:
        cands = [(results[m.label][group]["speedup"], m.label) for m in methods
                 if m.name == name and group in results[m.label] and results[m.label][group]["speedup"]]
        if not cands:
            return None, None
        speedup, label = max(cands)
        return label, speedup

    out = {}
    for key, name, group, goal in (("ngram_summarization_rag", "ngram", "summarization+rag", GOAL_NGRAM),
                                   ("draft_model_coding", "draft_model", "coding", GOAL_DRAFT)):
        label, speedup = best(name, group)
        out[key] = {"method": label, "group": group, "speedup": speedup, "goal": goal,
                    "met": None if speedup is None else speedup >= goal}
    return out


def f(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def print_report(args: argparse.Namespace, questions: list[dict], results: dict, goal: dict, load: float) -> None:
    counts = {g: sum(1 for q in questions if group_of(q) == g) for g in GROUPS[:2]}
    print(f"## Speculative decoding: target {args.target}, draft {args.draft}, greedy, "
          f"{args.max_tokens} max tokens, {args.threads} threads, {args.dtype}, "
          f"load average {load:.2f} at start\n")
    print(f"Questions: {counts['coding']} coding, {counts['summarization+rag']} summarization+rag "
          f"({', '.join(str(q['question_id']) for q in questions)})\n")
    print("| method | group | decode tok/s | speedup | mean acc len | acc rate | per-position acc | c | alpha "
          "| identical to plain |")
    print("|---|---|---:|---:|---:|---:|---|---:|---:|---|")
    for label, by_group in results.items():
        for group in GROUPS:
            r = by_group.get(group)
            if r is None:
                continue
            pos = " ".join(f"{a:.2f}" for a in r["per_position_acceptance"]) or "-"
            ident = f"{r['identical']}/{r['questions']}"
            if r["first_divergence"]:
                d = r["first_divergence"]
                ident += f" (q{d['question_id']} @ {d['index']})"
            print(f"| {label} | {group} | {f(r['decode_tok_s'])} | {f(r['speedup'])}x | "
                  f"{f(r['mean_acceptance_length'])} | {f(r['acceptance_rate'])} | {pos} | "
                  f"{f(r['c'], '.3f')} | {f(r['alpha'], '.3f')} | {ident} |")
    print()
    for g in goal.values():
        status = "n/a" if g["met"] is None else ("met" if g["met"] else "NOT met")
        print(f"- goal: best {g['method'] or '(none run)'} on {g['group']}: {f(g['speedup'])}x "
              f"(goal >= {g['goal']}x, {status})")
    print()


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_start = machine_load(args.threads)

    from verispec.models.loader import load_model, resolve_dtype

    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    methods: list[Method] = args.method_list
    questions = select_questions(args.questions, args.num_questions)

    log(f"loading target {args.target} ...")
    target = load_model(args.target, dtype=dtype, quantization=args.quantization)
    prompts = {q["question_id"]: target.tokenizer.apply_chat_template(q["turns"][0]) for q in questions}
    max_k = max(m.k for m in methods)
    max_model_len = max(len(p) for p in prompts.values()) + args.max_tokens + max_k + 8
    engines = build_engines(args, target, max_model_len, dtype)

    if not args.no_warmup:
        log("warm-up ...")
        warm_ids = target.tokenizer.apply_chat_template("Say hello.")
        for engine in engines.values():
            run_one(engine, warm_ids, min(8, args.max_tokens))

    runs: list[dict] = []
    labels = [m.label for m in methods]
    for qi, q in enumerate(questions):
        qid = q["question_id"]
        order = labels[qi % len(labels):] + labels[:qi % len(labels)]
        log(f"question {qi + 1}/{len(questions)} (id {qid}, {q['category']}, {len(prompts[qid])} prompt tokens)")
        by_label: dict[str, dict] = {}
        for label in order:
            r = run_one(engines[label], prompts[qid], args.max_tokens)
            r.update(method=label, qid=qid)
            by_label[label] = r
            log(f"  {label:>16}: {r['decode_tokens'] + 1} tokens, decode {r['decode_s']:.2f} s, "
                f"mean acc len {f(r['metrics'].mean_acceptance_length)}")
        plain_ids = by_label["plain"]["output_ids"]
        for label in labels:
            by_label[label]["divergence"] = first_divergence(by_label[label]["output_ids"], plain_ids)
            runs.append(by_label[label])

    results = aggregate(runs, questions, methods)
    goal = goals(results, methods)
    print_report(args, questions, results, goal, load_start)

    result = {
        "bench": "spec",
        "target": args.target,
        "draft": args.draft,
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "dtype": args.dtype,
        "methods": labels,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg()[0],
        "questions": [
            {"question_id": q["question_id"], "category": q["category"], "prompt_tokens": len(prompts[q["question_id"]])}
            for q in questions
        ],
        "results": results,
        "goals": goal,
        "per_question": [
            {
                "question_id": r["qid"],
                "method": r["method"],
                "output_tokens": len(r["output_ids"]),
                "finish_reason": r["finish_reason"],
                "prefill_s": r["prefill_s"],
                "decode_s": r["decode_s"],
                "mean_acceptance_length": r["metrics"].mean_acceptance_length,
                "first_divergence": r["divergence"],
            }
            for r in runs
        ],
    }
    line = json.dumps(result)
    if args.out:
        args.out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
