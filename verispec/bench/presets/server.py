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

Goals (``--goal-*``; the defaults are those of the issue "Speculation that pays on a CPU"):
speculation's throughput over plain's at concurrency 1 and at concurrency 8, and plain
throughput at concurrency 8 over plain at concurrency 1 (the batching is real). A Markdown
table is printed, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import torch

from verispec.bench.goals import judged
from verispec.bench.machine import log, machine_load
from verispec.bench.presets.common import DRAFT, TARGET, PresetParser, chat_questions, emit_report, goal_status, number
from verispec.config import SpeculativeConfig

SPECULATIVE_CONFIG = json.dumps({"model": DRAFT, "num_speculative_tokens": 4})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = PresetParser("server", __doc__, target=TARGET, speculative_config=SPECULATIVE_CONFIG, requests=16,
                     max_tokens=64, max_num_seqs=8, max_model_len=2048, questions=None, threads=2, dtype="auto",
                     quantization="auto", out=None)
    p.add_argument("--concurrency", default="1,2,4,8", help="levels (default: %(default)s)")
    p.add_goal("spec-c1", 1.3, "the speculative server's throughput over the plain one's at concurrency 1")
    p.add_goal("spec-c8", 1.0, "the same at concurrency 8")
    p.add_goal("batching", 4.0, "the plain server's throughput at concurrency 8 over concurrency 1")
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
    questions = [q["turns"][0] for q in chat_questions(args.questions, args.requests)]
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
        goals["spec_speedup_c1"] = {"ratio": by_c[1]["speedup"], **judged(by_c[1]["speedup"], args.goal_spec_c1)}
    if 8 in by_c:
        goals["spec_speedup_c8"] = {"ratio": by_c[8]["speedup"], **judged(by_c[8]["speedup"], args.goal_spec_c8)}
    if 1 in by_c and 8 in by_c:
        batching = ratio(by_c[8]["plain"]["throughput_tok_s"], by_c[1]["plain"]["throughput_tok_s"])
        goals["plain_c8_over_c1"] = {"ratio": batching, **judged(batching, args.goal_batching)}
    return {"target": args.target, "speculative_config": json.loads(args.speculative_config),
            "max_tokens": args.max_tokens, "threads": args.threads, "load_before": load,
            "levels": rows, "goals": goals}


def print_table(report: dict) -> None:
    print(f"\ntarget {report['target']}, speculative {json.dumps(report['speculative_config'])}, "
          f"max_tokens {report['max_tokens']}, threads {report['threads']}\n")
    print("| concurrency | server | tokens/s | speedup | mean latency s | TTFT s | ITL ms | mean acc. len | identical |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in report["levels"]:
        for name in ("plain", "spec"):
            m = r[name]
            speedup = number(r["speedup"]) + "x" if name == "spec" else "1.00x"
            ident = (f"{r['identical']}/{r['requests']} (alone {r['identical_to_alone']})"
                     if name == "spec" else "")
            print(f"| {r['concurrency']} | {name} | {number(m['throughput_tok_s'])} | {speedup} | "
                  f"{number(m['mean_latency_s'])} | {number(m['mean_ttft_s'])} | {number(m['mean_itl_s'] and m['mean_itl_s'] * 1e3, '.1f')} | "
                  f"{number(m['mean_acceptance_length'])} | {ident} |")
    print("\ngoals: " + ", ".join(f"{k} {number(g['ratio'])}x (goal >= {g['goal']}x: {goal_status(g['met'])})"
                                  for k, g in report["goals"].items()) + "\n")


if __name__ == "__main__":
    sys.exit(main())
