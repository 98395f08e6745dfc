"""Scale-out on Ray Serve: throughput at one concurrency level with one and with two replicas.

Three endpoints serve the same target on the same CPUs, each as a user would run it:

* ``single`` -- the plain ``verispec serve`` app (no Ray), ``--threads`` threads;
* ``ray-1`` -- Ray Serve with 1 replica of ``--threads`` threads;
* ``ray-2`` -- Ray Serve with 2 replicas of ``--threads / 2`` threads each.

All three are up at once (the two Ray applications under route prefixes ``/r1`` and ``/r2``);
an idle engine thread sleeps, so only the endpoint being measured computes. Each repeat sends
the same ``--requests`` Spec-Bench chat questions (greedy, streamed through the ``openai``
client, ``--concurrency`` in flight) to each endpoint in turn, the order rotating from repeat
to repeat so drift hits all alike. Reported per endpoint: the median throughput (completion
tokens / wall time) over repeats with its min and max, and how many texts equal the single
server's; then ray-2 / ray-1 (what the second replica brings) and ray-1 / single (what Ray's
hops cost). A Markdown table is printed, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import torch

from verispec.bench.machine import cpu_model, log, machine_load
from verispec.bench.presets.common import TARGET, PresetParser, chat_questions, emit_report
from verispec.bench.presets.server import run_level
from verispec.config import SpeculativeConfig

ENDPOINTS = ("single", "ray-1", "ray-2")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = PresetParser("scale", __doc__, target=TARGET, speculative_config=None, requests=16, max_tokens=64,
                     repeats=3, threads=2, max_num_seqs=8, max_model_len=2048, questions=None, out=None)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default: %(default)s)")
    args = p.parse_args(argv)
    if args.threads < 2 or args.threads % 2:
        p.error("--threads must be even: two replicas share them")
    return args


def start_endpoints(args: argparse.Namespace) -> tuple[dict[str, str], object]:
    """URLs of the three endpoints, and the single server (a context manager) to enter."""
    import ray
    from ray import serve

    from verispec.engine.engine import Engine
    from verispec.models.loader import load_model
    from verispec.server.app import build_app
    from verispec.server.ray_serve import ScaleOutConfig, build_application
    from verispec.server.serve import BackgroundServer, free_port

    spec_dict = json.loads(args.speculative_config) if args.speculative_config else None
    target = load_model(args.target, progress=False)
    engine = Engine(target, SpeculativeConfig.from_dict(spec_dict) if spec_dict else None,
                    max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs)
    single = BackgroundServer(build_app(engine, "bench", max_queue=1024))

    ray.init(num_cpus=2 * args.threads, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    for name, replicas in (("r1", 1), ("r2", 2)):
        threads = args.threads // replicas
        config = ScaleOutConfig(model=args.target, speculative_config=spec_dict, served_model_name="bench",
                                num_replicas=replicas, threads=threads, num_cpus=threads,
                                max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, max_queue=1024)
        log(f"starting Ray Serve application {name}: {replicas} replica(s) of {threads} thread(s)")
        serve.run(build_application(config), name=name, route_prefix=f"/{name}")
    base = f"http://127.0.0.1:{port}"
    return {"single": None, "ray-1": base + "/r1", "ray-2": base + "/r2"}, single


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load = machine_load(args.threads)
    questions = [q["turns"][0] for q in chat_questions(args.questions, args.requests)]
    urls, single = start_endpoints(args)
    runs: dict[str, list[dict]] = {name: [] for name in ENDPOINTS}
    try:
        with single:
            urls["single"] = single.url
            for name in ENDPOINTS:  # warm-up, untimed
                asyncio.run(run_level(urls[name], questions[:2], 2, 4))
            for r in range(args.repeats):
                order = ENDPOINTS[r % 3:] + ENDPOINTS[:r % 3]
                for name in order:
                    log(f"repeat {r + 1}/{args.repeats}: {len(questions)} requests to {name}, "
                        f"{args.concurrency} in flight")
                    runs[name].append(asyncio.run(run_level(urls[name], questions, args.concurrency,
                                                            args.max_tokens)))
    finally:
        from ray import serve

        serve.shutdown()
    return emit_report(summarise(args, runs, load), print_table, args.out)


def summarise(args: argparse.Namespace, runs: dict[str, list[dict]], load: float) -> dict:
    reference = runs["single"][0]["texts"]
    rows = {}
    for name in ENDPOINTS:
        tput = [r["throughput_tok_s"] for r in runs[name]]
        rows[name] = {"throughput_tok_s": tput, "median": statistics.median(tput), "min": min(tput),
                      "max": max(tput), "mean_ttft_s": statistics.median(r["mean_ttft_s"] for r in runs[name]),
                      "identical": [sum(a == b for a, b in zip(reference, r["texts"])) for r in runs[name]]}
    return {"cpu": cpu_model(), "target": args.target, "speculative_config": args.speculative_config,
            "concurrency": args.concurrency, "requests": args.requests, "max_tokens": args.max_tokens,
            "threads": args.threads, "repeats": args.repeats, "load_before": load, "endpoints": rows,
            "ray2_over_ray1": rows["ray-2"]["median"] / rows["ray-1"]["median"],
            "ray1_over_single": rows["ray-1"]["median"] / rows["single"]["median"]}


def print_table(report: dict) -> None:
    print(f"\n{report['cpu']}; target {report['target']}, speculative {report['speculative_config']}, "
          f"concurrency {report['concurrency']}, {report['requests']} requests of up to {report['max_tokens']} "
          f"tokens, {report['repeats']} repeats\n")
    print("| endpoint | tokens/s median | min-max | TTFT s | identical to single |")
    print("|---|---:|---:|---:|---:|")
    for name, row in report["endpoints"].items():
        print(f"| {name} | {row['median']:.2f} | {row['min']:.2f}-{row['max']:.2f} | {row['mean_ttft_s']:.2f} | "
              f"{min(row['identical'])}/{report['requests']} |")
    print(f"\nray-2 / ray-1: {report['ray2_over_ray1']:.2f}x; ray-1 / single: {report['ray1_over_single']:.2f}x\n")


if __name__ == "__main__":
    sys.exit(main())
