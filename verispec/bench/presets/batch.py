"""Batched plain decoding without prefill: decode tokens/s against batch size, in one process.

The server load test (``verispec bench server``) measures what clients see, prefill included; on a
small CPU a prompt's prefill is compute-bound and takes as long as tens of decode steps, so it
hides how well the decode steps themselves batch. This preset isolates them: for each batch
size B it admits B requests at once (prefill, untimed), then times the engine's steps until all
finish, with every request forced to ``--max-tokens`` (EOS ignored). Same short Spec-Bench chat
questions as the load test; greedy; the batch sizes alternate over ``--repeats`` so drift hits
all alike.

Figures: decode tokens/s of the batch (tokens after the first / step time), its ratio to batch
1, and the step time per batch against batch 1's (docs/benchmarks/server.md holds them against
the batching goal). A Markdown table is printed, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from verispec.bench.machine import log, machine_load
from verispec.bench.presets.common import TARGET, PresetParser, chat_questions, spec_bench_path
from verispec.config import SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = PresetParser("batch", __doc__, target=TARGET, max_tokens=32, repeats=2, threads=2, dtype="auto",
                     quantization="auto")
    p.add_argument("--batch-sizes", default="1,2,4,8", help="(default: %(default)s)")
    args = p.parse_args(argv)
    args.sizes = [int(b) for b in args.batch_sizes.split(",")]
    if min(args.sizes) < 1 or args.max_tokens < 2:
        p.error("batch sizes >= 1 and --max-tokens >= 2 (every request is forced to --max-tokens)")
    return args


def run_batch(engine, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """Admit every prompt, then time the steps until all finish: (decode tokens, seconds)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    seqs = [engine.add_request(ids, params) for ids in prompts]
    t0 = time.perf_counter()
    while engine.running:
        engine.step()
    return sum(len(s.output_ids) - 1 for s in seqs), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load = machine_load(args.threads)
    from verispec.engine.engine import Engine
    from verispec.models.loader import load_model

    target = load_model(args.target, dtype=args.dtype, quantization=args.quantization)
    tok = target.tokenizer
    questions = chat_questions(spec_bench_path(), max(args.sizes))
    prompts = [tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}]) for q in questions]
    longest = max(len(p) for p in prompts)
    engine = Engine(target, None, max_model_len=longest + args.max_tokens + 8, max_num_seqs=max(args.sizes))
    run_batch(engine, prompts[:1], 4)  # warm-up
    totals = {b: [0, 0.0] for b in args.sizes}
    for r in range(args.repeats):
        for b in args.sizes if r % 2 == 0 else reversed(args.sizes):
            tokens, seconds = run_batch(engine, prompts[:b], args.max_tokens)
            log(f"repeat {r + 1}, batch {b}: {tokens} decode tokens in {seconds:.2f}s")
            totals[b][0] += tokens
            totals[b][1] += seconds
    base = totals[args.sizes[0]][0] / totals[args.sizes[0]][1]
    rows = [{"batch": b, "decode_tok_s": t / s, "vs_first": t / s / base,
             "step_ms": s / (t / b) * 1e3} for b, (t, s) in totals.items()]
    print(f"\n{args.target} ({args.quantization}), plain decoding, {args.max_tokens} tokens per request, "
          f"threads {args.threads}, load before {load:.2f}\n")
    print(f"| batch | decode tok/s | vs batch {args.sizes[0]} | ms per step |")
    print("|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['batch']} | {row['decode_tok_s']:.2f} | {row['vs_first']:.2f}x | {row['step_ms']:.0f} |")
    print(json.dumps({"target": args.target, "quantization": args.quantization, "max_tokens": args.max_tokens,
                      "threads": args.threads, "load_before": load, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
