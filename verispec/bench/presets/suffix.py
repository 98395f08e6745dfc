"""Suffix decoding, prompt lookup and lookahead against plain decoding on a repetitive workload.

The workload is code editing: each request asks the target to rewrite a short function (about
150 tokens of code) with one thing changed. Round 1 sends every code body once; round 2 sends the
same bodies again with a small variation of the instruction, which is where suffix decoding's
global cache of earlier outputs pays off. ``--questions N`` also runs the first N coding
questions of Spec-Bench (``question.jsonl``). ``--peers`` adds running OpenAI-compatible servers
(``openai:URL[@LABEL]``, e.g. llama-server with ``--spec-type ngram-mod``) to the rotation: each
request goes to them as its prompt ids, streamed, and their decode time is the time after the
first streamed token.

Every method has its own engine, built once, so each suffix drafter keeps its own global cache
across the run. For each request all methods run in turn, the first one rotating from request to
request, so machine drift hits them alike. Decoding is greedy (T = 0), batch 1.

Figures per method and group (round 1, round 2, repetitive = both rounds, coding questions):
decode tokens/s (output tokens after the first / (wall time - prefill)), speedup (plain's decode
time / the method's, over the same requests), mean acceptance length (counts the bonus token,
see :mod:`verispec.metrics`), acceptance rate, and whether outputs equal plain decoding's.
A Markdown table is printed, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from verispec.bench.machine import log, machine_load
from verispec.bench.goals import judged
from verispec.bench.methods import OpenAIRunner, parse_methods
from verispec.bench.presets.common import TARGET, PresetParser, first_divergence, run_one
from verispec.bench.workloads import CODE_BODIES
from verispec.config import SamplingParams, SpeculativeConfig
from verispec.metrics import SpecMetrics

METHODS = ("plain", "ngram", "suffix", "lookahead")
GROUPS = ("round1", "round2", "repetitive", "coding")


# (round 1 change, round 2 variation) for each code body
CHANGES = [
    ("the parameter `window` renamed to `size`", "the parameter `window` renamed to `width`"),
    ("the method `total` renamed to `count`", "the method `total` renamed to `size`"),
    ("the variable `section` renamed to `group`", "the variable `section` renamed to `block`"),
    ("the variable `items` renamed to `values`", "the variable `items` renamed to `data`"),
    ("the function `adults` renamed to `grown_ups`", "the function `adults` renamed to `majors`"),
    ("the function `top_words` renamed to `most_common`", "the function `top_words` renamed to `frequent`"),
    ("the attribute `data` renamed to `items`", "the attribute `data` renamed to `elements`"),
    ("the variable `merged` renamed to `result`", "the variable `merged` renamed to `joined`"),
]


def edit_request(code: str, change: str) -> str:
    return (f"Rewrite this code with {change}. Keep everything else exactly the same and reply "
            f"with the code only.\n\n```python\n{code}\n```")


def workload(num_prompts: int) -> list[tuple[str, str]]:
    """(group, request text): round 1 for every body, then round 2 with varied instructions."""
    bodies = list(zip(CODE_BODIES, CHANGES))[:num_prompts]
    return ([("round1", edit_request(code, first)) for code, (first, _) in bodies]
            + [("round2", edit_request(code, second)) for code, (_, second) in bodies])


def coding_questions(path: Path, n: int) -> list[tuple[str, str]]:
    questions = []
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if line.strip() and (q := json.loads(line)).get("category") == "coding":
                questions.append(("coding", q["turns"][0]))
    if len(questions) < n:
        raise SystemExit(f"{path} has {len(questions)} coding questions, fewer than --questions {n}")
    return questions[:n]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = PresetParser("suffix", "Suffix decoding, ngram and lookahead vs plain on a code-editing workload.",
                     target=TARGET, question_file=None, max_tokens=256, threads=2, quantization="auto", out=None)
    p.add_argument("--num-prompts", type=int, default=8, help=f"code bodies, 1..{len(CODE_BODIES)} (default: %(default)s)")
    p.add_argument("--questions", type=int, default=0, help="also run this many Spec-Bench coding questions")
    p.add_argument("--k", type=int, default=8, help="draft tokens per round for ngram, suffix and lookahead (default: %(default)s)")
    p.add_argument("--suffix-min-token-prob", type=float, default=0.1, help="suffix_decoding_min_token_prob")
    p.add_argument("--suffix-max-spec-factor", type=float, default=1.0, help="suffix_decoding_max_spec_factor")
    p.add_argument("--lookahead", default="2,3,2", metavar="W,N,G", help="lookahead window, n-gram and guess sizes")
    p.add_argument("--methods", default=",".join(METHODS), help="subset of %(default)s; plain is always run")
    p.add_argument("--peers", default="", metavar="openai:URL[@LABEL],...",
                   help="running OpenAI-compatible servers to time beside verispec (e.g. llama-server's n-gram modes)")
    p.add_goal("suffix", 2.5, "suffix's speedup on the repetitive workload")
    p.add_goal("lookahead", 1.1, "lookahead's speedup on the Spec-Bench coding questions")
    p.add_goal("vs-peers", 2.0, "the better of suffix and ngram over the fastest peer, repetitive workload")
    args = p.parse_args(argv)
    if not 1 <= args.num_prompts <= len(CODE_BODIES):
        p.error(f"--num-prompts must be in 1..{len(CODE_BODIES)}")
    if args.max_tokens < 2 or args.k < 1 or args.questions < 0:
        p.error("need --max-tokens >= 2, --k >= 1 and --questions >= 0")
    try:
        args.window, args.ngram, args.guess = (int(x) for x in args.lookahead.split(","))
    except ValueError:
        p.error(f"--lookahead must be W,N,G (three integers), got {args.lookahead!r}")
    args.method_list = ["plain"] + [m for m in args.methods.split(",") if m and m != "plain"]
    unknown = set(args.method_list) - set(METHODS)
    if unknown:
        p.error(f"--methods: unknown {', '.join(sorted(unknown))}; valid: {', '.join(METHODS)}")
    args.peer_specs = parse_peers(p, args.peers)
    return args


def parse_peers(p: argparse.ArgumentParser, text: str) -> list:
    """``--peers``: openai:URL[@LABEL] methods only, with distinct labels."""
    if not text:
        return []
    try:
        specs = [s for s in parse_methods(text) if not s.is_plain]
    except ValueError as e:
        p.error(f"--peers: {e}")
    given = [item for item in text.split(",") if item.strip()]  # parse_methods drops repeated labels
    if any(s.backend != "openai" for s in specs) or len(specs) < len(given):
        p.error(f"--peers takes openai:URL[@LABEL] methods with distinct labels, got {text!r}")
    return specs


def run_peer(runner: Any, prompt_ids: list[int], max_tokens: int) -> dict:
    """One request to a peer server, in :func:`run_one`'s form: decode time is the time after the
    first streamed token; the peer reports no acceptance."""
    r = runner.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return {"output_ids": list(r.output_ids), "metrics": None, "total_s": r.total_s, "prefill_s": r.prefill_s,
            "decode_s": r.total_s - r.prefill_s, "decode_tokens": max(len(r.output_ids) - 1, 0),
            "finish_reason": r.finish_reason}


def build_engines(args: argparse.Namespace, target: Any, max_model_len: int) -> dict[str, Any]:
    from verispec.engine.engine import Engine

    configs = {
        "ngram": dict(num_speculative_tokens=args.k),
        "suffix": dict(num_speculative_tokens=args.k,
                       suffix_decoding_min_token_prob=args.suffix_min_token_prob,
                       suffix_decoding_max_spec_factor=args.suffix_max_spec_factor),
        "lookahead": dict(num_speculative_tokens=args.k, lookahead_window_size=args.window,
                          lookahead_ngram_size=args.ngram, lookahead_guess_set_size=args.guess),
    }
    return {m: Engine(target, None if m == "plain" else SpeculativeConfig(method=m, **configs[m]),
                      max_model_len=max_model_len) for m in args.method_list}


def aggregate(runs: list[dict], methods: list[str]) -> dict:
    results: dict[str, dict] = {}
    for method in methods:
        results[method] = {}
        for group in GROUPS:
            sel = [r for r in runs if r["method"] == method
                   and (r["group"] == group or (group == "repetitive" and r["group"] != "coding"))]
            if not sel:
                continue
            plain_s = sum(r["decode_s"] for r in runs if r["method"] == "plain" and r["request"] in
                          {s["request"] for s in sel})
            metrics = SpecMetrics()
            for r in sel:
                if r["metrics"] is not None:  # a peer server reports none
                    metrics.merge(r["metrics"])
            decode_s, tokens = sum(r["decode_s"] for r in sel), sum(r["decode_tokens"] for r in sel)
            results[method][group] = {
                "requests": len(sel),
                "decode_tokens": tokens,
                "decode_tok_s": tokens / decode_s if decode_s > 0 else None,
                "speedup": plain_s / decode_s if decode_s > 0 else None,
                "mean_acceptance_length": metrics.mean_acceptance_length if metrics.num_rounds else None,
                "acceptance_rate": metrics.acceptance_rate if metrics.num_rounds else None,
                "identical": sum(r["divergence"] is None for r in sel),
            }
    return results


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "n/a" if v is None else format(v, spec)


def print_report(args: argparse.Namespace, results: dict, load: float) -> None:
    print(f"## Code-editing workload: {args.target}, greedy, {args.max_tokens} max tokens, k={args.k}, "
          f"lookahead W,N,G={args.lookahead}, {args.threads} threads, load average {load:.2f} at start\n")
    print("| method | group | decode tok/s | speedup | mean acc len | acc rate | identical to plain |")
    print("|---|---|---:|---:|---:|---:|---|")
    for method, by_group in results.items():
        for group, r in by_group.items():
            print(f"| {method} | {group} | {fmt(r['decode_tok_s'])} | {fmt(r['speedup'])}x | "
                  f"{fmt(r['mean_acceptance_length'])} | {fmt(r['acceptance_rate'])} | "
                  f"{r['identical']}/{r['requests']} |")
    print()


def goals(results: dict, args: argparse.Namespace, peers: tuple[str, ...] | list[str] = ()) -> dict:
    """The preset's figures held to its ``--goal-*`` options (``args``)."""
    def speedup(method: str, group: str) -> float | None:
        return results.get(method, {}).get(group, {}).get("speedup")

    def fastest(methods) -> tuple[float | None, str | None]:
        """(speedup, method) of the fastest of ``methods`` on the repetitive workload."""
        return max(((v, m) for m in methods if (v := speedup(m, "repetitive")) is not None), default=(None, None))

    suffix, lookahead = speedup("suffix", "repetitive"), speedup("lookahead", "coding")
    (ours, our_method), (theirs, peer) = fastest(("suffix", "ngram")), fastest(peers)
    ratio = ours / theirs if ours is not None and theirs else None
    return {
        "vs_fastest_peer": {"ours": our_method, "peer": peer, "ratio": ratio, **judged(ratio, args.goal_vs_peers)},
        "suffix_repetitive": {"speedup": suffix, **judged(suffix, args.goal_suffix)},
        "suffix_vs_ngram": {g: None if speedup("suffix", g) is None or speedup("ngram", g) is None
                            else speedup("suffix", g) >= speedup("ngram", g) for g in GROUPS},
        "lookahead_coding": {"speedup": lookahead, **judged(lookahead, args.goal_lookahead)},
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_start = machine_load(args.threads)
    from verispec.models.loader import load_model

    requests = workload(args.num_prompts)
    if args.questions:
        requests += coding_questions(args.question_file, args.questions)
    log(f"loading target {args.target} ...")
    target = load_model(args.target, progress=False, quantization=args.quantization)
    prompts = [target.tokenizer.apply_chat_template(text) for _, text in requests]
    max_model_len = max(len(p) for p in prompts) + args.max_tokens + args.k + 8
    engines = build_engines(args, target, max_model_len)
    peers = {spec.label: OpenAIRunner(spec.arg, target.tokenizer) for spec in args.peer_specs}
    methods = args.method_list + list(peers)

    runs: list[dict] = []
    for i, ((group, _), ids) in enumerate(zip(requests, prompts)):
        order = methods[i % len(methods):] + methods[:i % len(methods)]
        log(f"request {i + 1}/{len(requests)} ({group}, {len(ids)} prompt tokens)")
        by_method = {}
        for method in order:
            r = run_peer(peers[method], ids, args.max_tokens) if method in peers else \
                run_one(engines[method], ids, args.max_tokens)
            r.update(method=method, group=group, request=i)
            by_method[method] = r
            log(f"  {method:>10}: {r['decode_tokens'] + 1} tokens, decode {r['decode_s']:.2f} s, "
                f"mean acc len {fmt(r['metrics'] and r['metrics'].mean_acceptance_length)}")
        for method in methods:
            by_method[method]["divergence"] = first_divergence(by_method[method]["output_ids"],
                                                               by_method["plain"]["output_ids"])
            runs.append(by_method[method])

    results = aggregate(runs, methods)
    print_report(args, results, load_start)
    held = goals(results, args, list(peers))
    vs = held["vs_fastest_peer"]
    if vs["ratio"] is not None:
        print(f"{vs['ours']} over the fastest peer ({vs['peer']}), decode speed on the repetitive workload: "
              f"{vs['ratio']:.2f}x (goal >= {vs['goal']:g}x)\n")
    result = {"bench": "suffix", "target": args.target, "max_tokens": args.max_tokens, "k": args.k,
              "lookahead": [args.window, args.ngram, args.guess], "threads": args.threads,
              "requests": len(requests), "loadavg_start": load_start, "loadavg_end": os.getloadavg()[0],
              "peers": {spec.label: spec.arg for spec in args.peer_specs},
              "results": results, "goals": held}
    line = json.dumps(result)
    if args.out:
        args.out.write_text(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
