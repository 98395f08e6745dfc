"""Tree against chain speculation at equal target cost, on Spec-Bench questions.

The same questions as ``verispec bench spec`` (half ``coding``, half alternating ``summarization`` /
``rag``; chat template; batch 1). For each drafter (``draft_model``, ``ngram``) two shapes
verify the same number of positions per round, ``--budget`` drafts + the last committed token:

* chain: ``num_speculative_tokens = budget``;
* tree: depth ``--depth``, branching ``--topk``, ``num_draft_tokens = budget`` (EAGLE-2
  dynamic tree for ``draft_model``, a trie of earlier continuations for ``ngram``).

Every engine runs on every question at every temperature in turn (the starting engine
rotates), so machine drift hits all alike. T > 0 runs use one seed per question; their
outputs differ between engines (only their distribution is the same), so tokens/s compares
decode speed, not identical work. T = 0 outputs must be identical across engines.

Plain decoding runs in the T = 0 rotation too: T = 0 outputs must equal its outputs, and its
one-position steps give T_target(1), which c and alpha are measured against. (The speculative
engines verify a fixed width, almost always budget + 1, so a line through their own verify
times extrapolates T_target(1) from one point and puts c and alpha far off.)

Figures per (drafter, shape, temperature): mean acceptance length (bonus included), decode
tokens/s (output tokens after the first / (generate time - prefill)), at T = 0 against plain
decoding's, mean tree size, and the measured c and alpha (``SpecMetrics.cost_model`` with plain
decoding's T_target(1)). The goal (``--goal-length``, ``--goal-speed``; the defaults are the
issue's): the tree raises mean acceptance length and tokens/s over the chain's by those ratios.
Prints a Markdown table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from verispec.bench.machine import log, machine_load
from verispec.bench.presets.common import DRAFT, TARGET, PresetParser, number, select_questions
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.metrics import SpecMetrics

PLAIN = ("plain", "-")  # the plain engine's key, next to the (drafter, shape) ones


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = PresetParser("tree", "Tree vs chain speculation at equal target cost.", target=TARGET, draft=DRAFT,
                     questions=None, num_questions=10, max_tokens=128, threads=2, quantization="auto", out=None)
    p.add_argument("--temperatures", default="0,1", help="comma-separated (default: %(default)s)")
    p.add_argument("--drafters", default="draft_model,ngram", help="comma-separated (default: %(default)s)")
    p.add_argument("--budget", type=int, default=6, help="draft tokens verified per round (default: %(default)s)")
    p.add_argument("--depth", type=int, default=3, help="tree depth (default: %(default)s)")
    p.add_argument("--topk", type=int, default=2, help="tree branching (default: %(default)s)")
    p.add_goal("length", 1.2, "the tree's mean acceptance length over the chain's")
    p.add_goal("speed", 1.1, "the tree's tokens/s over the chain's")
    args = p.parse_args(argv)
    args.temps = [float(t) for t in args.temperatures.split(",") if t.strip()]
    args.drafter_list = [d.strip() for d in args.drafters.split(",") if d.strip()]
    if not set(args.drafter_list) <= {"draft_model", "ngram"}:
        p.error("--drafters: choose from draft_model, ngram")
    if args.budget < args.depth or args.depth < 1 or args.topk < 2:
        p.error("need budget >= depth >= 1 and topk >= 2")
    return args


def build_engines(args: argparse.Namespace, target: Any, max_len: int) -> dict[tuple[str, str], Any]:
    from verispec.engine.engine import Engine
    from verispec.models.loader import load_model
    from verispec.speculative.draft_model import DraftModelDrafter
    from verispec.speculative.draft_tree import TreeDraftModelDrafter

    # Fixed shapes (no adaptive controller): every round verifies budget + 1 positions either way.
    chain = dict(num_speculative_tokens=args.budget, adaptive=False)
    tree = dict(num_speculative_tokens=args.depth, speculative_eagle_topk=args.topk, num_draft_tokens=args.budget,
                adaptive=False)
    engines = {PLAIN: Engine(target, max_model_len=max_len)}
    for name in args.drafter_list:
        if name == "ngram":
            for shape, kw in (("chain", chain), ("tree", tree)):
                engines[(name, shape)] = Engine(target, SpeculativeConfig(method="ngram", **kw), max_model_len=max_len)
            continue
        draft = load_model(args.draft, device=target.model.device, dtype=target.model.dtype,
                           quantization=args.quantization)
        vocab = target.model.config.vocab_size
        drafters = {"chain": DraftModelDrafter(draft, vocab, max_len),
                    "tree": TreeDraftModelDrafter(draft, vocab, max_len, topk=args.topk, budget=args.budget,
                                                  depth=args.depth)}
        for shape, kw in (("chain", chain), ("tree", tree)):
            config = SpeculativeConfig(method="draft_model", model=args.draft, **kw)
            engines[(name, shape)] = Engine(target, config, max_model_len=max_len, drafter=drafters[shape])
    return engines


def run(engines: dict, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    stats = {(k, t): {"metrics": SpecMetrics(), "tokens": 0, "seconds": 0.0, "outputs": []}
             for k in engines for t in args.temps if k != PLAIN or t == 0}
    for qi, ids in enumerate(prompts):
        for temp in args.temps:
            params = SamplingParams(temperature=temp, max_tokens=args.max_tokens, seed=qi)
            keys = [k for k in engines if (k, temp) in stats]
            for j in range(len(keys)):
                key = keys[(qi + j) % len(keys)]
                engine = engines[key]
                t0 = time.perf_counter()
                seq = engine.generate(ids, params)
                wall = time.perf_counter() - t0
                s = stats[(key, temp)]
                s["metrics"].merge(seq.metrics)
                s["tokens"] += len(seq.output_ids) - 1
                s["seconds"] += wall - seq.metrics.prefill_time_s
                s["outputs"].append(seq.output_ids)
                log(f"q{qi} T={temp} {key[0]} {key[1]}: {len(seq.output_ids)} tokens, "
                    f"mal {seq.metrics.mean_acceptance_length:.2f}")
    return stats


def summarize(stats: dict, args: argparse.Namespace) -> dict:
    plain = stats.get((PLAIN, 0.0))
    t1 = plain["metrics"].target_step_time(1) if plain else None
    rows = {}
    if plain:
        rows["plain/T=0"] = {"drafter": "plain", "shape": "-", "temperature": 0.0, "mean_acceptance_length": 1.0,
                             "tokens_per_s": _ratio(plain["tokens"], plain["seconds"]), "t1_s": t1}
    for ((name, shape), temp), s in stats.items():
        if (name, shape) == PLAIN:
            continue
        m = s["metrics"]
        _, c, alpha = m.cost_model(t1)
        row = rows[f"{name}/{shape}/T={temp:g}"] = {
            "drafter": name, "shape": shape, "temperature": temp,
            "mean_acceptance_length": m.mean_acceptance_length,
            "tokens_per_s": s["tokens"] / s["seconds"] if s["seconds"] else None,
            "mean_tree_size": m.summary()["mean_tree_size"], "accepted_depth_counts": m.accepted_depth_counts,
            "c": c, "alpha": alpha,
        }
        if plain and temp == 0:
            row["speed_vs_plain"] = _ratio(row["tokens_per_s"], rows["plain/T=0"]["tokens_per_s"])
            row["identical_to_plain"] = s["outputs"] == plain["outputs"]
    for name in args.drafter_list:
        for temp in args.temps:
            ch, tr = rows[f"{name}/chain/T={temp:g}"], rows[f"{name}/tree/T={temp:g}"]
            tr["length_vs_chain"] = _ratio(tr["mean_acceptance_length"], ch["mean_acceptance_length"])
            tr["speed_vs_chain"] = _ratio(tr["tokens_per_s"], ch["tokens_per_s"])
            if temp == 0:
                tr["identical_to_chain"] = stats[((name, "tree"), temp)]["outputs"] == \
                    stats[((name, "chain"), temp)]["outputs"]
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def print_report(rows: dict, args: argparse.Namespace, load: float) -> None:
    print(f"\nTree ({args.depth} deep, top-{args.topk}, {args.budget} nodes) vs chain ({args.budget} drafts), "
          f"{args.num_questions} questions, <= {args.max_tokens} tokens, load before start {load:.2f}\n")
    print("| run | mean acceptance length | tokens/s | vs plain | tree size | c | alpha | length vs chain "
          "| speed vs chain |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for key, r in rows.items():
        print(f"| {key} | {number(r['mean_acceptance_length'])} | {number(r['tokens_per_s'])} | {number(r.get('speed_vs_plain'))} "
              f"| {number(r.get('mean_tree_size'), '.1f')} | {number(r.get('c'))} | {number(r.get('alpha'))} "
              f"| {number(r.get('length_vs_chain'))} | {number(r.get('speed_vs_chain'))} |")
    same = [k for k, r in rows.items() if "identical_to_plain" in r]
    print(f"T = 0 outputs identical to plain decoding: {sum(rows[k]['identical_to_plain'] for k in same)}/{len(same)} runs")
    met = [k for k, r in rows.items() if (r.get("length_vs_chain") or 0) >= args.goal_length
           and (r.get("speed_vs_chain") or 0) >= args.goal_speed]
    print(f"\ngoal (length >= {args.goal_length}x and tokens/s >= {args.goal_speed}x the chain) met by: "
          f"{', '.join(met) or 'none'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load = machine_load(args.threads)
    from verispec.models.loader import load_model

    target = load_model(args.target, quantization=args.quantization)
    questions = select_questions(args.questions, args.num_questions)
    prompts = [target.tokenizer.apply_chat_template(q["turns"][0]) for q in questions]
    max_len = max(len(p) for p in prompts) + args.max_tokens + args.budget + 2
    engines = build_engines(args, target, max_len)
    rows = summarize(run(engines, args, prompts), args)
    print_report(rows, args, load)
    result = {"args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list))},
              "load": load, "rows": rows}
    line = json.dumps(result)
    print(line)
    if args.out:
        args.out.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
