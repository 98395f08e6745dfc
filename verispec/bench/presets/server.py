"""Load test of ``verispec serve``: concurrent requests, speculation on against off.

One process loads the target once and serves it twice, from two engines on two local ports:
one with the drafter, one without (both with ``--max-num-seqs`` slots). For each concurrency
level (default 1, 2, 4, 8) the same requests go to both servers, streamed through the real
``openai`` client, with ``concurrency`` requests in flight at a time; which server goes first
alternates from level to level, so machine drift hits both alike. Every level sends the same
``--requests`` Spec-Bench chat questions (one per category in turn, the long-document
summarization and RAG categories left out), greedy, up to ``--max-tokens`` each, so levels differ
only in how many are in flight.

Figures per level and server:

* throughput -- completion tokens of all requests / wall time of the level;
* latency -- mean request time, mean time to first token, mean inter-token latency
  ((last token - first token) / (tokens - 1)), all seen by the client;
* mean acceptance length -- from the servers' per-request ``speculative_stats``;
* identical -- how many greedy texts equal the plain server's for the same request at the same
  level, and (``alone``) how many of the speculative server's equal what the plain server gave
  at the lowest level (one request at a time when that level is 1).

Goals (issue "Speculation that pays on a CPU", which raised those of the first server issue):
speculation >= 1.3x plain throughput at concurrency 1 and >= 1.0x at concurrency 8; plain
throughput at concurrency 8 >= 4x plain at concurrency 1 (the batching is real). A Markdown
table is printed, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import torch

from verispec.bench.machine import log, machine_load
from verispec.bench.presets.common import chat_questions, emit_report, spec_bench_path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="verispec bench server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="target model (default: %(default)s)")
    p.add_argument("--speculative-config", default='{"model": "qwen2.5-coder-0.5b-instruct", '
                   '"num_speculative_tokens": 4}', help="drafter of the speculative server (default: %(default)s)")
    p.add_argument("--concurrency", default="1,2,4,8", help="levels (default: %(default)s)")
    p.add_argument("--requests", type=int, default=16,
                   help="requests per level, the same at every level (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="max tokens per request (default: %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="engine slots (default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=2048, help="(default: %(default)s)")
    p.add_argument("--questions", type=Path, default=None,
                   help="Spec-Bench question.jsonl (default: $VERISPEC_SPEC_BENCH or ../shared/data/spec_bench/)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default: %(default)s)")
    p.add_argument("--dtype", default="auto", help="(default: %(default)s: float32 activations on the native kernels)")
    p.add_argument("--quantization", default="auto", choices=("auto", "none", "gguf", "int8", "int4"),
                   help="the target's linear layers (auto: a GGUF file's own weights on the native kernels); the draft's: the config's 'quantization' (default: %(default)s)")
    p.add_argument("--out", type=Path, help="also write the JSON result to this file")
    return p.parse_args(argv)


async def one_request(client, question: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    first = None
    pieces: list[str] = []
    final = None
    stream = await client.chat.completions.create(
        model="bench", messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
        temperature=0.0, stream=True)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            final = chunk
    end = time.perf_counter()
    tokens = final.usage.completion_tokens
    first = first or end
    return {"text": "".join(pieces), "tokens": tokens, "latency_s": end - start, "ttft_s": first - start,
            "itl_s": (end - first) / (tokens - 1) if tokens > 1 else None,
            "mean_acceptance_length": final.model_extra["speculative_stats"]["mean_acceptance_length"]}


async def run_level(url: str, questions: list[str], concurrency: int, max_tokens: int) -> dict:
    import openai

    gate = asyncio.Semaphore(concurrency)
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600) as client:

        async def gated(q: str) -> dict:
            async with gate:
                return await one_request(client, q, max_tokens)

        start = time.perf_counter()
        runs = await asyncio.gather(*(gated(q) for q in questions))
        wall = time.perf_counter() - start
    itls = [r["itl_s"] for r in runs if r["itl_s"] is not None]
    mals = [r["mean_acceptance_length"] for r in runs if r["mean_acceptance_length"] is not None]
    return {
        "throughput_tok_s": sum(r["tokens"] for r in runs) / wall,
        "wall_s": wall,
        "tokens": sum(r["tokens"] for r in runs),
        "mean_latency_s": sum(r["latency_s"] for r in runs) / len(runs),
        "mean_ttft_s": sum(r["ttft_s"] for r in runs) / len(runs),
        "mean_itl_s": sum(itls) / len(itls) if itls else None,
        "mean_acceptance_length": sum(mals) / len(mals) if mals else None,
        "texts": [r["text"] for r in runs],
    }


def build_servers(args: argparse.Namespace):
    from verispec.config import SpeculativeConfig
    from verispec.engine.engine import Engine
    from verispec.models.loader import load_model
    from verispec.server.app import build_app
    from verispec.server.serve import BackgroundServer

    target = load_model(args.target, dtype=args.dtype, quantization=args.quantization)
    spec = SpeculativeConfig.from_json(args.speculative_config)
    engines = {
        "plain": Engine(target, None, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs),
        "spec": Engine(target, spec, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs),
    }
    return {name: BackgroundServer(build_app(e, "bench", max_queue=1024)) for name, e in engines.items()}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load = machine_load(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.requests < max(levels):
        raise SystemExit(f"--requests {args.requests} is fewer than the highest concurrency {max(levels)}")
    questions = [q["turns"][0] for q in chat_questions(args.questions or spec_bench_path(), args.requests)]
    servers = build_servers(args)
    results: dict[str, dict] = {"plain": {}, "spec": {}}
    with servers["plain"], servers["spec"]:
        for name, server in servers.items():  # warm-up, untimed
            asyncio.run(run_level(server.url, questions[:1], 1, 4))
        for i, c in enumerate(levels):
            order = ["plain", "spec"] if i % 2 == 0 else ["spec", "plain"]
            for name in order:
                log(f"concurrency {c}: {len(questions)} requests to the {name} server")
                results[name][c] = asyncio.run(run_level(servers[name].url, questions, c, args.max_tokens))
    return emit_report(summarise(args, levels, results, load), print_table, args.out)


def summarise(args: argparse.Namespace, levels: list[int], results: dict, load: float) -> dict:
    rows = []
    alone = results["plain"][levels[0]]["texts"]
    for c in levels:
        plain, spec = results["plain"][c], results["spec"][c]
        rows.append({
            "concurrency": c,
            "plain": {k: v for k, v in plain.items() if k != "texts"},
            "spec": {k: v for k, v in spec.items() if k != "texts"},
            "speedup": ratio(spec["throughput_tok_s"], plain["throughput_tok_s"]),
            "identical": sum(a == b for a, b in zip(plain["texts"], spec["texts"])),
            "identical_to_alone": sum(a == b for a, b in zip(alone, spec["texts"])),
            "requests": len(plain["texts"]),
        })
    by_c = {r["concurrency"]: r for r in rows}
    goals = {}
    if 1 in by_c:
        goals["spec_speedup_c1>=1.3"] = by_c[1]["speedup"]
    if 8 in by_c:
        goals["spec_speedup_c8>=1.0"] = by_c[8]["speedup"]
    if 1 in by_c and 8 in by_c:
        goals["plain_c8_over_c1>=4"] = ratio(by_c[8]["plain"]["throughput_tok_s"], by_c[1]["plain"]["throughput_tok_s"])
    return {"target": args.target, "speculative_config": json.loads(args.speculative_config),
            "max_tokens": args.max_tokens, "threads": args.threads, "load_before": load,
            "levels": rows, "goals": goals}


def print_table(report: dict) -> None:
    def f(v: float | None, spec: str = ".2f") -> str:
        return "n/a" if v is None else format(v, spec)

    print(f"\ntarget {report['target']}, speculative {json.dumps(report['speculative_config'])}, "
          f"max_tokens {report['max_tokens']}, threads {report['threads']}\n")
    print("| concurrency | server | tokens/s | speedup | mean latency s | TTFT s | ITL ms | mean acc. len | identical |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in report["levels"]:
        for name in ("plain", "spec"):
            m = r[name]
            speedup = f(r["speedup"]) + "x" if name == "spec" else "1.00x"
            ident = (f"{r['identical']}/{r['requests']} (alone {r['identical_to_alone']})"
                     if name == "spec" else "")
            print(f"| {r['concurrency']} | {name} | {f(m['throughput_tok_s'])} | {speedup} | "
                  f"{f(m['mean_latency_s'])} | {f(m['mean_ttft_s'])} | {f(m['mean_itl_s'] and m['mean_itl_s'] * 1e3, '.1f')} | "
                  f"{f(m['mean_acceptance_length'])} | {ident} |")
    print("\ngoals: " + ", ".join(f"{k}: {f(v)}" for k, v in report["goals"].items()) + "\n")


if __name__ == "__main__":
    sys.exit(main())
