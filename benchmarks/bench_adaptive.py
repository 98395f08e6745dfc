"""The adaptive speculation controller against every fixed k, per Spec-Bench category.

For each drafter (``draft_model``, ``ngram``) the adaptive controller (k chosen each round, at
most ``--k-max``) runs next to fixed k in {1, 2, 4, 6, 8} and plain decoding, in one process:
for each question every method runs in turn, the starting method rotating from question to
question so that machine drift hits all methods alike. Decoding is greedy (T = 0), batch 1, on
the first turn of each question through the target's chat template.

Methods are ``plain``, ``NAME:K`` (fixed k) and ``NAME:adaptive``. ``draft_model`` methods share
one loaded draft model. Each adaptive engine keeps its own controller for the whole run (its
cost model learns during the warm-up and carries over between questions, as in a server).

Figures per method and category: decode tokens/s (output tokens after the first over generate's
wall time minus prefill) and the speedup over plain (plain's decode time / the method's, over
the same questions). The summary checks the issue's goals for each drafter: adaptive within 5%
of the best fixed k in every category, at least 5% better than the best fixed k overall, and
never below 0.97x plain. A Markdown table is printed, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from spec_runs import first_divergence, run_one  # benchmarks/spec_runs.py
from common import log, machine_load  # benchmarks/common.py

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_QUESTIONS = REPO_ROOT.parent / "shared/data/spec_bench/question.jsonl"
FIXED_K = (1, 2, 4, 6, 8)
DRAFTERS = ("draft_model", "ngram")
DEFAULT_METHODS = ",".join(["plain"] + [f"{d}:{k}" for d in DRAFTERS for k in ("adaptive", *FIXED_K)])
WITHIN_BEST = 0.95  # adaptive >= 95% of the best fixed k in every category
OVERALL_GAIN = 1.05  # adaptive >= 105% of the best fixed k overall
PLAIN_FLOOR = 0.97  # adaptive >= 97% of plain in every category


@dataclass(frozen=True)
class Method:
    name: str  # registry method name, or "plain"
    k: int | None  # fixed k; None for adaptive (and plain)

    @property
    def label(self) -> str:
        if self.name == "plain":
            return "plain"
        return f"{self.name}:{'adaptive' if self.k is None else self.k}"


def parse_methods(text: str) -> list[Method]:
    """``plain,ngram:adaptive,ngram:4``; plain is always included and put first."""
    methods = [Method("plain", None)]
    for raw in text.split(","):
        item = raw.strip()
        if not item or item == "plain":
            continue
        name, sep, k_text = item.partition(":")
        if not sep:
            raise ValueError(f"method {item!r} needs a k: NAME:K or NAME:adaptive")
        if k_text == "adaptive":
            method = Method(name, None)
        else:
            try:
                method = Method(name, int(k_text))
            except ValueError:
                raise ValueError(f"bad k in {item!r}: an integer or 'adaptive'") from None
            if method.k < 1:
                raise ValueError(f"k must be >= 1 in {item!r}")
        if method not in methods:
            methods.append(method)
    return methods


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Adaptive speculation vs fixed k vs plain, per Spec-Bench category.")
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="target model (default: %(default)s)")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct",
                   help="draft for draft_model (default: %(default)s)")
    p.add_argument("--questions", type=Path, default=DEFAULT_QUESTIONS,
                   help="Spec-Bench question.jsonl (default: shared/data/spec_bench/question.jsonl next to "
                        "the repository)")
    p.add_argument("--categories", default=None, help="comma-separated categories (default: all, in file order)")
    p.add_argument("--num-questions", type=int, default=3, help="questions per category (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="max generated tokens per question (default: %(default)s)")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated; plain is always run (default: all)")
    p.add_argument("--k-max", type=int, default=max(FIXED_K), help="most drafts the adaptive controller may choose")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype of both models (default: %(default)s)")
    p.add_argument("--quantization", default="none", choices=("none", "int8", "int4"),
                   help="pack the target's and the draft's linear layers alike (default: %(default)s)")
    p.add_argument("--no-warmup", action="store_true", help="skip the short untimed warm-up of each engine")
    p.add_argument("--out", type=Path, help="also write the JSON result to this file")
    args = p.parse_args(argv)
    for name in ("num_questions", "max_tokens", "k_max", "threads"):
        if getattr(args, name) < (2 if name == "max_tokens" else 1):
            p.error(f"--{name.replace('_', '-')} is too small")
    try:
        args.method_list = parse_methods(args.methods)
    except ValueError as exc:
        p.error(f"--methods: {exc}")
    from verispec.spec.base import available_methods

    unknown = sorted({m.name for m in args.method_list} - {"plain", *available_methods()})
    if unknown:
        p.error(f"--methods: unknown method(s) {', '.join(unknown)}; valid: plain, {', '.join(available_methods())}")
    if not args.questions.is_file():
        p.error(f"question file not found: {args.questions}. Pass --questions PATH to Spec-Bench's question.jsonl")
    return args


def select_questions(path: Path, categories: str | None, per_category: int) -> list[dict]:
    """The first ``per_category`` questions of each category, in file order."""
    by_cat: dict[str, list[dict]] = {}
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if line.strip():
                try:
                    q = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise SystemExit(f"{path}:{lineno}: not valid JSON ({exc})") from None
                by_cat.setdefault(q.get("category", ""), []).append(q)
    wanted = [c.strip() for c in categories.split(",") if c.strip()] if categories else list(by_cat)
    missing = [c for c in wanted if c not in by_cat]
    if missing:
        raise SystemExit(f"unknown categories {', '.join(missing)}; {path} has {', '.join(by_cat)}")
    return [q for c in wanted for q in by_cat[c][:per_category]]


def build_engines(args: argparse.Namespace, target: Any, max_model_len: int, dtype: torch.dtype) -> dict[str, Any]:
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
        config = SpeculativeConfig(method=m.name, num_speculative_tokens=m.k or args.k_max,
                                   model=args.draft if m.name == "draft_model" else None, adaptive=m.k is None)
        if m.name == "draft_model" and shared_drafter is None:
            log(f"loading draft {args.draft} ...")
            draft = load_model(args.draft, device=target.model.device, dtype=dtype, quantization=args.quantization)
            check_vocab_compatible(target, draft)
            shared_drafter = DraftModelDrafter(draft, target.model.config.vocab_size, max_model_len)
        drafter = shared_drafter if m.name == "draft_model" else None
        engines[m.label] = Engine(target, config, max_model_len=max_model_len, drafter=drafter)
    return engines


def aggregate(runs: list[dict], categories: list[str], labels: list[str]) -> dict[str, dict[str, dict]]:
    """results[category or "overall"][label] = figures over that category's questions."""
    results: dict[str, dict[str, dict]] = {}
    for cat in [*categories, "overall"]:
        results[cat] = {}
        for label in labels:
            sel = [r for r in runs if r["method"] == label and cat in (r["category"], "overall")]
            decode_s = sum(r["decode_s"] for r in sel)
            tokens = sum(r["decode_tokens"] for r in sel)
            rounds = sum(r["metrics"].num_rounds for r in sel)
            drafts = sum(r["metrics"].num_drafts for r in sel)
            draft_tokens = sum(r["metrics"].num_draft_tokens for r in sel)
            committed = sum(r["metrics"].num_committed_tokens for r in sel)
            accepted = sum(r["metrics"].num_accepted_tokens for r in sel)
            results[cat][label] = {
                "questions": len(sel),
                "decode_tokens": tokens,
                "decode_s": decode_s,
                "decode_tok_s": tokens / decode_s if decode_s > 0 else None,
                "speculating_rounds": drafts / rounds if rounds else None,
                "mean_k": draft_tokens / drafts if drafts else None,
                "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
                "mean_acceptance_length": committed / rounds if rounds else None,
                "identical": sum(r["divergence"] is None for r in sel),
            }
        plain_s = results[cat]["plain"]["decode_s"]
        for fig in results[cat].values():
            fig["speedup"] = plain_s / fig["decode_s"] if fig["decode_s"] > 0 else None
    return results


def goals(results: dict, methods: list[Method]) -> dict[str, dict]:
    out = {}
    for drafter in DRAFTERS:
        fixed = [m.label for m in methods if m.name == drafter and m.k is not None]
        adaptive = f"{drafter}:adaptive"
        if adaptive not in results["overall"] or not fixed:
            continue
        per_cat = {}
        for cat, figs in results.items():
            best = max(fixed, key=lambda label: figs[label]["speedup"] or 0.0)
            a = figs[adaptive]["speedup"] or 0.0
            per_cat[cat] = {"adaptive": a, "best_fixed": best, "best_fixed_speedup": figs[best]["speedup"],
                            "vs_best": a / figs[best]["speedup"] if figs[best]["speedup"] else None}
        cats = [c for c in per_cat if c != "overall"]
        out[drafter] = {
            "per_category": per_cat,
            "within_5pct_of_best_everywhere": all((per_cat[c]["vs_best"] or 0) >= WITHIN_BEST for c in cats),
            "overall_gain_over_best_fixed": per_cat["overall"]["vs_best"],
            "overall_5pct_better": (per_cat["overall"]["vs_best"] or 0) >= OVERALL_GAIN,
            "min_vs_plain": min(per_cat[c]["adaptive"] for c in cats),
            "never_below_0.97_plain": all(per_cat[c]["adaptive"] >= PLAIN_FLOOR for c in cats),
        }
    return out


def f(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def print_report(args: argparse.Namespace, results: dict, goal: dict, labels: list[str]) -> None:
    print(f"\n## Adaptive vs fixed k: {args.target} (draft {args.draft}), T=0, batch 1, "
          f"{args.num_questions} question(s) per category, <= {args.max_tokens} tokens\n")
    print("Speedup over plain decoding (plain column: decode tokens/s); adaptive: share of rounds "
          "that drafted / mean k.\n")
    print("| category | " + " | ".join(labels) + " |")
    print("|---" * (len(labels) + 1) + "|")
    for cat, figs in results.items():
        cells = []
        for label in labels:
            fig = figs[label]
            if label == "plain":
                cells.append(f"{f(fig['decode_tok_s'])} tok/s")
                continue
            cell = f"{f(fig['speedup'])}x"
            if label.endswith(":adaptive"):
                cell += f" ({f(fig['speculating_rounds'], '.0%')} / {f(fig['mean_k'], '.1f')})"
            if fig["identical"] < fig["questions"]:
                cell += " DIFFERS"
            cells.append(cell)
        print(f"| {cat} | " + " | ".join(cells) + " |")
    print()
    for drafter, g in goal.items():
        print(f"- {drafter}: adaptive within 5% of the best fixed k in every category: "
              f"{'met' if g['within_5pct_of_best_everywhere'] else 'NOT met'}; overall vs best fixed "
              f"{f(g['overall_gain_over_best_fixed'])}x ({'met' if g['overall_5pct_better'] else 'NOT met'}, "
              f"goal >= {OVERALL_GAIN}); lowest vs plain {f(g['min_vs_plain'])}x "
              f"({'met' if g['never_below_0.97_plain'] else 'NOT met'}, goal >= {PLAIN_FLOOR})")
    print()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_start = machine_load(args.threads)

    from verispec.models.loader import load_model, resolve_dtype

    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    questions = select_questions(args.questions, args.categories, args.num_questions)
    categories = list(dict.fromkeys(q["category"] for q in questions))
    log(f"loading target {args.target} ...")
    target = load_model(args.target, dtype=dtype, quantization=args.quantization)
    prompts = {q["question_id"]: target.tokenizer.apply_chat_template(q["turns"][0]) for q in questions}
    max_k = max([args.k_max] + [m.k or 0 for m in args.method_list])
    max_model_len = max(len(p) for p in prompts.values()) + args.max_tokens + max_k + 8
    engines = build_engines(args, target, max_model_len, dtype)
    labels = [m.label for m in args.method_list]

    if not args.no_warmup:
        log("warm-up ...")
        warm_ids = target.tokenizer.apply_chat_template("Say hello.")
        for engine in engines.values():
            run_one(engine, warm_ids, min(16, args.max_tokens))

    runs: list[dict] = []
    for qi, q in enumerate(questions):
        qid = q["question_id"]
        order = labels[qi % len(labels):] + labels[:qi % len(labels)]
        log(f"question {qi + 1}/{len(questions)} (id {qid}, {q['category']}, {len(prompts[qid])} prompt tokens)")
        by_label = {}
        for label in order:
            r = run_one(engines[label], prompts[qid], args.max_tokens)
            r.update(method=label, qid=qid, category=q["category"])
            by_label[label] = r
            log(f"  {label:>20}: {r['decode_tokens'] + 1} tokens, decode {r['decode_s']:.2f} s")
        for label in labels:
            plain_ids = by_label["plain"]["output_ids"]
            by_label[label]["divergence"] = first_divergence(by_label[label]["output_ids"], plain_ids)
            runs.append(by_label[label])

    results = aggregate(runs, categories, labels)
    goal = goals(results, args.method_list)
    print_report(args, results, goal, labels)
    line = json.dumps({
        "bench": "adaptive", "target": args.target, "draft": args.draft, "max_tokens": args.max_tokens,
        "num_questions_per_category": args.num_questions, "k_max": args.k_max, "threads": args.threads,
        "dtype": args.dtype, "quantization": args.quantization, "methods": labels, "loadavg_start": load_start, "loadavg_end": os.getloadavg()[0],
        "results": results, "goals": goal,
        "per_question": [{"question_id": r["qid"], "category": r["category"], "method": r["method"],
                          "decode_tokens": r["decode_tokens"], "decode_s": r["decode_s"],
                          "first_divergence": r["divergence"]} for r in runs],
    })
    if args.out:
        args.out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
