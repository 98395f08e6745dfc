"""One linear layer, four ways: bf16 ``F.linear`` against the packed int8 and int4 layers.

For each weight shape of Qwen2.5-Coder-1.5B (o_proj 1536x1536, gate/up 8960x1536, down
1536x8960) and each row count M (1 = a decode step, k + 1 = a verify pass), it reports the time
per call, the weight bytes streamed per second at M = 1, the verify cost per extra row
(alpha_M = (t(M) / t(1) - 1) / (M - 1)), and whether every row of the M-row product is bitwise
equal to the same row computed alone (batch invariance, which greedy speculative identity needs).
It also times the kernels with float32 activations, to justify running them in bf16.

Methods are timed interleaved, best of ``--repeats`` rounds, so background load hits all alike.

    python benchmarks/bench_qlinear.py [--rows 1,2,3,5,9] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from common import log, machine_load  # benchmarks/common.py
from torch import nn

from verispec.models.quant import Int4Linear, Int8Linear
from verispec.runtime import set_threads

SHAPES = {"o_proj": (1536, 1536), "gate_up/2": (8960, 1536), "down": (1536, 8960)}


def layers(weight: torch.Tensor) -> dict:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    lin.weight = nn.Parameter(weight, requires_grad=False)
    return {
        "bf16": (lambda x: F.linear(x, weight), weight.numel() * 2),
        "int8": (Int8Linear(lin), weight.numel()),
        "int4-g32": (Int4Linear(lin, 32), weight.numel() // 2),
        "int4-g128": (Int4Linear(lin, 128), weight.numel() // 2),
    }


def best_time(fn, x: torch.Tensor, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(x)
    return (time.perf_counter() - t0) / calls


def row_invariant(fn, x: torch.Tensor) -> bool:
    alone = torch.cat([fn(x[i : i + 1]) for i in range(x.shape[0])])
    return all(torch.equal(fn(x[:m]), alone[:m]) for m in range(2, x.shape[0] + 1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,3,5,9", help="row counts M to time (default 1,2,3,5,9)")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds; the best counts (default 5)")
    p.add_argument("--threads", type=int, default=None, help="default: physical cores")
    args = p.parse_args()
    threads = set_threads(args.threads)
    load = machine_load(threads)
    rows = [int(m) for m in args.rows.split(",")]
    torch.manual_seed(0)
    results = []
    for shape_name, (n, k) in SHAPES.items():
        methods = layers(torch.randn(n, k, dtype=torch.bfloat16) * 0.02)
        x = torch.randn(max(rows), k, dtype=torch.bfloat16)
        best = {(name, m): float("inf") for name in methods for m in rows}
        calls = max(3, int(2e8 // (n * k)))
        for _ in range(args.repeats):
            for m in rows:
                for name, (fn, _) in methods.items():
                    fn(x[:m])  # warm-up
                    best[name, m] = min(best[name, m], best_time(fn, x[:m], calls))
        for name, (fn, nbytes) in methods.items():
            t1 = best[name, 1]
            fp32_ms = None if name == "bf16" else 1e3 * best_time(fn, x[:1].float(), 3)
            results.append({
                "shape": shape_name, "n": n, "k": k, "method": name,
                "ms": {m: 1e3 * best[name, m] for m in rows},
                "gb_s_at_m1": nbytes / t1 / 1e9,
                "alpha": {m: (best[name, m] / t1 - 1) / (m - 1) for m in rows if m > 1},
                "row_invariant": row_invariant(fn, x[:9]),
                "fp32_activation_ms_m1": fp32_ms,
            })  # fmt: skip
            log(f"done {shape_name} {name}")
    print(f"threads {threads}, load before start {load:.2f}\n")
    print("| shape | method | " + " | ".join(f"ms M={m}" for m in rows)
          + " | GB/s at M=1 | alpha M=5 | rows invariant (M=1..9) | fp32 act. ms M=1 |")
    print("|---|---|" + "---:|" * (len(rows) + 4))
    for r in results:
        alpha5 = r["alpha"].get(5)
        fp32 = "" if r["fp32_activation_ms_m1"] is None else f"{r['fp32_activation_ms_m1']:.2f}"
        print(f"| {r['shape']} {r['n']}x{r['k']} | {r['method']} | "
              + " | ".join(f"{r['ms'][m]:.3f}" for m in rows)
              + f" | {r['gb_s_at_m1']:.1f} | {'' if alpha5 is None else f'{alpha5:.2f}'} | "
              f"{r['row_invariant']} | {fp32} |")
    print(json.dumps({"threads": threads, "load": load, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
