"""The general ``verispec bench`` harness: its options, and a run from loading the target to the report.

:func:`main` runs it on a list of options, which is how the presets that are only settings of it
(:mod:`verispec.bench.presets.reports`, :mod:`~verispec.bench.presets.spec`) call it. The CLI
validates everything cheap (methods, workload, settings) before loading a model, loads the
target, then hands over to :func:`run_and_report`, which tests call directly with tiny
preloaded models. This module knows nothing of the presets; :mod:`verispec.bench.cli` puts the
two together under ``verispec bench``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verispec.bench.machine import log, machine_info, machine_load
from verispec.bench.goals import Goals
from verispec.bench.workloads import (
    MT_BENCH, SPEC_BENCH_ENV, ChatFormat, PromptFormat, Workload, load_workload,
)

if TYPE_CHECKING:
    from verispec.bench.methods import MethodSpec
    from verispec.bench.runner import Settings

METHODS_HELP = f"""\
methods (--methods, comma-separated; plain is always run first, as the baseline):
  NAME[:ARG][@KEY=VALUE[,KEY=VALUE...]]
  plain, ngram, draft_model:MODEL, ...  verispec: every registered drafter; ARG is the "model"
                                        field; options are --speculative-config fields, and
                                        k means num_speculative_tokens
  hf:plain                              transformers generate on the same weights
  hf:assisted:DRAFT                     ... with DRAFT as assistant_model (k: num_assistant_tokens)
  hf:prompt_lookup                      ... with prompt lookup (k: prompt_lookup_num_tokens, default 10)
  llamacpp:plain, llamacpp:prompt_lookup  llama.cpp on the GGUF (needs llama-cpp-python;
                                        k: num_pred_tokens, max_ngram_size)
  example: plain,ngram@k=4,prompt_lookup_max=3,draft_model:qwen2.5-coder-0.5b-instruct@k=4,hf:plain
  verispec drafters are adaptive unless adaptive=false; a drafter given both ways
  (ngram@k=8,ngram@k=2,adaptive=false,...) also gets a table of the adaptive one against its
  best fixed k per category

questions (--questions): spec-bench (shipped with verispec; ${SPEC_BENCH_ENV} names another copy),
  code-edit (built in), or a JSONL file with question_id, category and turns per line. --categories picks categories
  ({MT_BENCH} = the eight MT-bench categories); spec-bench defaults to its six task groups.
"""


# The goals of the project's reports (docs/benchmarks/), the defaults of the --goal-* options.
GOALS = Goals(vs_hf_assisted=2.0, plain_vs_hf_plain=1.5, adaptive_within_best=0.95, adaptive_over_best=1.05,
              adaptive_vs_plain=0.97)

DESCRIPTION = ("Run several decoding methods on the same questions in one process, interleaved, and report "
               "tokens/s, speedup over plain decoding, acceptance statistics, c and alpha, and whether T=0 "
               "outputs are identical to plain decoding. Writes report.json, report.md and PNG plots to "
               "--out; prints the Markdown and one JSON line. A preset runs one of the benchmarks behind "
               "the reports in docs/benchmarks/ with its settings.")


def main(argv: list[str], prog: str = "verispec bench", description: str = DESCRIPTION) -> int:
    """``verispec bench`` with these options (no preset): how presets run the general harness."""
    b = argparse.ArgumentParser(prog=prog, description=description, epilog=METHODS_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(b)
    return cmd_bench(b.parse_args(argv))


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument("--model", help="target: bundled name, HF model directory or .gguf file")
    b.add_argument("--methods", default="plain,ngram", help="see below (default: %(default)s)")
    b.add_argument("--questions", default="spec-bench", help="spec-bench, code-edit or a JSONL file (default: %(default)s)")
    b.add_argument("--categories", default=None, help="comma-separated categories (default: see below)")
    b.add_argument("--num-questions", type=int, default=1, help="questions per category (default: %(default)s)")
    b.add_argument("--max-tokens", type=int, default=128, help="most tokens per turn (default: %(default)s)")
    b.add_argument("--max-turns", type=int, default=None,
                   help="run only the first N turns of each question (default: all, as Spec-Bench does)")
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy, checked for identity (default: 0)")
    b.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling for T > 0, as chat clients often ask (default: 1, off)")
    b.add_argument("--repeats", type=int, default=1, help="runs of every question per method (default: %(default)s)")
    b.add_argument("--seed", type=int, default=0, help="base seed for T > 0 (default: %(default)s)")
    b.add_argument("--threads", type=int, default=None, help="torch (and llama.cpp) CPU threads")
    b.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    b.add_argument("--dtype", default="auto", help="auto, bfloat16, float32 or float16 (default: auto)")
    b.add_argument("--quantization", default="auto", choices=("auto", "none", "gguf", "int8", "int4"),
                   help="the target's linear layers (see verispec generate --help; default auto: a "
                   "GGUF file's own weights on the native CPU kernels); a draft model's is the "
                   "method's quantization option, e.g. draft_model:M@quantization=int8")
    b.add_argument("--quantization-group-size", type=int, default=32, choices=(32, 64, 128),
                   help="int4 group size (default 32)")
    b.add_argument("--out", type=Path, default=Path("bench-report"), help="report directory (default: %(default)s)")
    b.add_argument("--resume", action="store_true",
                   help="continue the interrupted run whose report is in --out: keep its finished "
                   "question blocks, run the rest (model, methods, settings and questions must match)")
    b.add_argument("--no-warmup", action="store_true", help="skip the short untimed warm-up run of each method")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.add_argument("--compare", nargs=2, type=Path, metavar=("A.json", "B.json"),
                   help="print the difference of two report.json files and exit")
    goals = b.add_argument_group("goals", "the least ratio the report holds each comparison to")
    for f in fields(Goals):
        goals.add_argument("--goal-" + f.name.replace("_", "-"), type=float, default=getattr(GOALS, f.name),
                           metavar="X", help=f"{f.metadata['help']} (default: %(default)s)")


def goals_of(args: argparse.Namespace) -> Goals:
    """The ``--goal-*`` options as :class:`~verispec.bench.report.Goals`."""
    return Goals(**{f.name: getattr(args, "goal_" + f.name) for f in fields(Goals)})


def cmd_bench(args: argparse.Namespace) -> int:
    # torch and transformers load only once a run is really starting (keeps --help fast).
    from verispec.bench.methods import parse_methods
    from verispec.bench.report import compare_reports, load_report
    from verispec.bench.runner import Settings

    if args.compare:
        a, b = (load_report(p) for p in args.compare)
        print(compare_reports(a, b, str(args.compare[0]), str(args.compare[1])), end="")
        return 0
    if not args.model:
        raise ValueError("--model is required (or --compare A.json B.json)")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    specs = parse_methods(args.methods)
    settings = Settings(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                        repeats=args.repeats,
                        seed=args.seed, warmup=not args.no_warmup, progress=not args.no_progress)
    categories = [c.strip() for c in args.categories.split(",") if c.strip()] if args.categories else None
    workload = load_workload(args.questions, categories, args.num_questions, args.max_turns)
    previous = None
    if args.resume:
        previous = load_report(args.out / "report.json")
        if not previous.get("partial"):
            raise ValueError(f"{args.out / 'report.json'} is a finished report: nothing to resume")

    import torch

    from verispec.models.loader import load_model
    from verispec.models.registry import resolve_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    machine_load(args.threads)
    meta = {"command": shlex.join(["verispec", *sys.argv[1:]]), "machine": machine_info()}
    log(f"loading {args.model} ...")
    target = load_model(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
                        group_size=args.quantization_group_size)
    path = resolve_model(args.model, progress=False)
    meta.update(model=args.model, dtype=str(target.model.dtype).removeprefix("torch."),
                quantization=args.quantization)

    def load(name: str, quantization: str) -> Any:
        log(f"loading {name} ...")
        return load_model(name, device=target.model.device, dtype=target.model.dtype, quantization=quantization,
                          group_size=args.quantization_group_size)

    report = run_and_report(target, ChatFormat(target.tokenizer), specs, workload, settings, args.out, load,
                            meta, threads=args.threads, gguf=path if path.suffix.lower() == ".gguf" else None,
                            previous=previous, goals=goals_of(args))
    return 130 if report["partial"] else 0


def run_and_report(target: Any, fmt: PromptFormat, specs: list[MethodSpec], workload: Workload,
                   settings: Settings, out: Path, load: Callable[[str, str], Any], meta: dict,
                   threads: int | None = None, gguf: Path | None = None, previous: dict | None = None,
                   goals: Goals = Goals()) -> dict:
    """Build every method on ``target``, run the workload, write and print the report.

    ``previous``: an interrupted report of the same benchmark to continue (``--resume``);
    ``goals``: what the report holds its ratios to (none: it shows them only).
    """
    from verispec.bench.methods import Builder  # torch: as in cmd_bench, not at --help
    from verispec.bench.report import (
        build_report, render_markdown, report_header, resume_runs, summary_json, write_report,
    )
    from verispec.bench.runner import BenchResult, max_model_len, run_bench

    done = []
    segment = {"loadavg_start": meta["machine"].get("loadavg_start"), "revision": meta["machine"].get("revision")}
    if previous is not None:
        done = resume_runs(previous, {**meta, **report_header(specs, workload, settings)})
        log(f"resuming: {len({(r.question_id, r.repeat) for r in done})} question blocks already done")

    builder = Builder(target, max_model_len(workload.questions, fmt, settings.max_tokens), load, threads, gguf)
    runners = {}
    for spec in specs:
        log(f"building {spec.label} ...")
        runners[spec.label] = builder.build(spec)

    def make_report(result: BenchResult) -> dict:
        load_end = os.getloadavg()[0]
        sitting = {**segment, "blocks": len({(r.question_id, r.repeat) for r in result.runs[len(done):]}),
                   "wall_s": result.wall_s, "loadavg_end": load_end}
        so_far = {**meta, "machine": {**meta["machine"], "loadavg_end": load_end},
                  "segments": [*(previous or {}).get("segments", []), sitting]}
        total = BenchResult(result.runs, result.partial, result.wall_s + (previous["wall_s"] if previous else 0.0))
        return build_report(total, specs, workload, settings, so_far, goals)

    def checkpoint(result: BenchResult) -> None:
        """After every block: the report so far, so that even a killed run can be resumed."""
        report = make_report(result)
        write_report(report, out, plots=False)
        if not settings.progress:  # (the progress bar shows it otherwise)
            log(f"{report['blocks_done']} of {report['blocks_planned']} question blocks done; "
                f"report so far in {out}")

    report = make_report(run_bench(runners, workload.questions, fmt, settings, done=done, on_block=checkpoint))
    files = write_report(report, out)
    print(render_markdown(report))
    print(summary_json(report), flush=True)
    log(f"wrote {', '.join(str(f) for f in files)}")
    if report["partial"]:
        log("interrupted: the report above and in --out is PARTIAL "
            f"({report['blocks_done']} of {report['blocks_planned']} question blocks)")
    return report
