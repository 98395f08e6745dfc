"""Plain (non-speculative) greedy decoding: verispec's engine against transformers.

Both sides load the SAME GGUF file (verispec through its converter, transformers through
``from_pretrained(..., gguf_file=...)``), run in the same process with the same thread count and
dtype, and decode exactly ``--max-tokens`` tokens greedily from the same chat-templated prompt
ids. Runs alternate (ours, transformers, ours, ...) so machine drift shows up in both columns.

Time is split the same way for both: *prefill* runs from the call until the first generated
token exists, *decode* covers the remaining N - 1 tokens, so

    decode tokens/s = (N - 1) / (total - prefill)        overall tokens/s = N / total

For transformers the first-token time is taken by a streamer: ``generate`` pushes the prompt
once, then each new token right after it is selected.

End-of-sequence handling matches on both sides: verispec runs with ``ignore_eos`` (an EOS token
is emitted like any other token and decoding goes on), and transformers runs with no EOS id at
all, so it neither stops on nor suppresses EOS. The first N token ids can therefore be compared
one for one; bf16 kernels differ, so a late divergence is possible and is only reported.

Roofline: a decode step of a batch-1 dense decoder reads every weight once, except an untied
input embedding table, of which the lookup reads one row (a tied table is read in full by the
LM head), so

    achieved GB/s = weight bytes read per token / (decode time per token)

and it is compared with the best read bandwidth of a full ``sum`` over a large bf16 tensor
(bigger than any cache), with the same thread count (see :func:`read_bandwidth`). KV-cache bytes read per token are
reported separately (verispec attends over a cache length rounded up to the cache block, so
both the logical and the padded figure are given).

The output is a Markdown table followed by one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from verispec.bench.goals import judged
from verispec.bench.machine import log, machine_load
from verispec.bench.methods import hf_generate
from verispec.bench.presets.common import TARGET, PresetParser
from verispec.bench.report import first_divergence
from verispec.config import SamplingParams

DEFAULT_PROMPT = (
    "Write a Python function that returns the n-th Fibonacci number using memoization, "
    "and explain its time complexity."
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = PresetParser("decode", "Benchmark plain greedy decoding: verispec's engine vs transformers on the same GGUF.",
                     model=TARGET, max_tokens=128, threads=2, dtype="bfloat16", repeats=2, out=None)
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="user message, sent through the chat template")
    p.add_argument("--bandwidth-gib", type=float, default=2.0,
                   help="size of the bf16 tensor for the read-bandwidth probe, GiB (default: %(default)s)")
    p.add_argument("--bandwidth-trials", type=int, default=7,
                   help="timed sums in the bandwidth probe; the best counts (default: %(default)s)")
    p.add_argument("--no-warmup", action="store_true", help="skip the short untimed warm-up run of each side")
    p.add_goal("ratio", 1.5, "verispec's decode tokens/s over transformers'")
    p.add_goal("roofline", 0.75, "achieved over measured read bandwidth")
    args = p.parse_args(argv)
    if args.max_tokens < 2:
        p.error("--max-tokens must be at least 2 (decode speed needs tokens after the first)")
    if args.bandwidth_gib <= 0 or args.bandwidth_trials < 1:
        p.error("--bandwidth-gib must be > 0 and --bandwidth-trials >= 1")
    return args


# ---------------------------------------------------------------------------------------------
# the two decoders
# ---------------------------------------------------------------------------------------------


def run_ours(engine: Any, prompt_ids: list[int], n: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    seq = engine.generate(prompt_ids, params)
    total = time.perf_counter() - t0
    return timing(list(seq.output_ids), total, seq.metrics.prefill_time_s, n)


def run_hf(model: Any, gen_config: Any, prompt_ids: list[int], n: int) -> dict:
    r = hf_generate(model, prompt_ids, generation_config=gen_config)
    return timing(r.output_ids, r.total_s, r.prefill_s, n)


def timing(output_ids: list[int], total: float, prefill: float, n: int) -> dict:
    if len(output_ids) != n:
        raise RuntimeError(f"expected {n} generated tokens, got {len(output_ids)}")
    decode = total - prefill
    return {
        "output_ids": output_ids,
        "total_s": total,
        "prefill_s": prefill,
        "decode_s": decode,
        "decode_tok_s": (n - 1) / decode if decode > 0 else float("inf"),
        "overall_tok_s": n / total,
    }


def load_hf(gguf: Path, dtype: torch.dtype, n: int) -> tuple[Any, Any, dict]:
    import importlib.util

    from transformers import AutoModelForCausalLM, GenerationConfig

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if importlib.util.find_spec("accelerate") is None:
        raise SystemExit("transformers needs the 'accelerate' package to load a GGUF file: pip install accelerate")
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
    model.eval()
    load_s = time.perf_counter() - t0
    # transformers keeps GGUF blocks packed (its own kernels) only when the optional `kernels`
    # package is present; otherwise every weight is dequantized to `dtype`, like verispec's.
    packed = sorted({type(m).__name__ for m in model.modules() if "gguf" in type(m).__name__.lower()})
    info = {
        "load_s": load_s,
        "weights": f"packed GGUF ({', '.join(packed)})" if packed else f"dequantized {str(dtype).removeprefix('torch.')}",
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "attn_implementation": model.config._attn_implementation,
    }
    # A fresh config: greedy, exactly n tokens, no sampling defaults (repetition penalty, ...)
    # inherited from the checkpoint. No EOS id, so EOS neither stops nor gets suppressed,
    # which is what verispec's ignore_eos does.
    model.generation_config.eos_token_id = None
    gen_config = GenerationConfig(
        max_new_tokens=n, min_new_tokens=n, do_sample=False, num_beams=1,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return model, gen_config, info


# ---------------------------------------------------------------------------------------------
# roofline
# ---------------------------------------------------------------------------------------------


def read_bandwidth(gib: float, trials: int) -> dict:
    """Best read bandwidth (bytes/s) of a full reduction over a bf16 tensor of ``gib`` GiB.

    Two reductions read the same bytes: ``x.sum()`` and the same storage viewed as float32.
    ``x.sum(dtype=torch.float32)`` is not used: on CPUs without native bf16 it takes a slow
    convert-per-element path that is compute bound (an order of magnitude below memory speed).
    """
    numel = int(gib * 1024**3) // 4 * 2  # even, so the float32 view exists
    x = torch.ones(numel, dtype=torch.bfloat16)  # touches every page, so none is lazily mapped
    nbytes = x.numel() * x.element_size()
    probes = {"sum_bf16": x.sum, "sum_as_float32": x.view(torch.float32).sum}
    best_s: dict[str, float] = {}
    for name, fn in probes.items():
        fn()  # warm-up
        best = float("inf")
        for _ in range(trials):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        best_s[name] = best
    del x, probes
    per_probe = {name: nbytes / s / 1e9 for name, s in best_s.items()}
    return {"tensor_bytes": nbytes, "gb_s_by_probe": per_probe, "gb_s": max(per_probe.values())}


def weight_bytes_read_per_token(model: Any) -> int:
    """All parameter bytes, less an untied embedding table (its lookup reads one row)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        table = model.embed.weight
        total -= (table.shape[0] - 1) * table.shape[1] * table.element_size()
    return total


def kv_bytes_per_token(model: Any, prompt_len: int, n: int, block: int) -> dict:
    """Mean KV-cache bytes a decode step reads, logically and as padded to the cache block."""
    c = model.config
    per_pos = 2 * c.num_layers * c.num_kv_heads * c.head_dim * model.embed.weight.element_size()
    # Decode step j (j = 1..n-1) feeds token P + j - 1 and attends over P + j positions.
    lengths = [prompt_len + j for j in range(1, n)]
    padded = [-(-ln // block) * block for ln in lengths]
    return {
        "bytes_per_position": per_pos,
        "logical": per_pos * statistics.fmean(lengths),
        "padded": per_pos * statistics.fmean(padded),
    }


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_start = machine_load(args.threads)

    from verispec.engine.engine import Engine
    from verispec.models.loader import load_model, resolve_dtype
    from verispec.models.registry import resolve_model

    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    n = args.max_tokens
    gguf = resolve_model(args.model)
    if not (gguf.is_file() and gguf.suffix.lower() == ".gguf"):
        raise SystemExit(f"--model must name a GGUF (bundled name or .gguf path); {gguf} is not one")

    log(f"loading {args.model} in verispec ...")
    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype=dtype, quantization="none")  # transformers' weights: dense
    ours_load_s = time.perf_counter() - t0
    prompt_ids = loaded.tokenizer.apply_chat_template(args.prompt)
    engine = Engine(loaded, None, max_model_len=len(prompt_ids) + n + 8)

    log(f"loading {gguf.name} in transformers (dequantizes the GGUF; can be slow) ...")
    hf_model, gen_config, hf_info = load_hf(gguf, dtype, n)
    hf_load_s = hf_info["load_s"]

    if not args.no_warmup:
        log("warm-up ...")
        warm = min(n, 4)
        run_ours(engine, prompt_ids, warm)
        gen_config.max_new_tokens = gen_config.min_new_tokens = warm
        run_hf(hf_model, gen_config, prompt_ids, warm)
        gen_config.max_new_tokens = gen_config.min_new_tokens = n

    runs: list[dict] = []
    for r in range(args.repeats):
        for side in ("ours", "hf"):
            log(f"repeat {r + 1}/{args.repeats}: {side} ...")
            res = run_ours(engine, prompt_ids, n) if side == "ours" else run_hf(hf_model, gen_config, prompt_ids, n)
            res.update(side=side, repeat=r + 1)
            runs.append(res)
            log(f"  decode {res['decode_tok_s']:.2f} tok/s, prefill {res['prefill_s']:.3f} s")

    ours = [r for r in runs if r["side"] == "ours"]
    hf = [r for r in runs if r["side"] == "hf"]
    med = {
        side: {key: statistics.median(r[key] for r in rs)
               for key in ("decode_tok_s", "overall_tok_s", "prefill_s", "decode_s", "total_s")}
        for side, rs in (("ours", ours), ("hf", hf))
    }  # fmt: skip
    ratio_decode = med["ours"]["decode_tok_s"] / med["hf"]["decode_tok_s"]
    ratio_overall = med["ours"]["overall_tok_s"] / med["hf"]["overall_tok_s"]

    # Token identity: every run of one side should agree with itself; compare run 1 of each.
    self_consistent = {
        side: all(r["output_ids"] == rs[0]["output_ids"] for r in rs) for side, rs in (("ours", ours), ("hf", hf))
    }
    div = first_divergence(ours[0]["output_ids"], hf[0]["output_ids"])

    # Roofline.
    model = loaded.model
    param_bytes = weight_bytes_read_per_token(model)
    log(f"measuring read bandwidth over a {args.bandwidth_gib:g} GiB bf16 tensor ...")
    del hf_model  # free its weights before allocating the probe tensor
    bw = read_bandwidth(args.bandwidth_gib, args.bandwidth_trials)
    step_s = 1.0 / med["ours"]["decode_tok_s"]
    achieved = param_bytes / step_s / 1e9
    kv = kv_bytes_per_token(model, len(prompt_ids), n, engine.cache.block)
    achieved_with_kv = (param_bytes + kv["padded"]) / step_s / 1e9
    fraction = achieved / bw["gb_s"]

    # ---- report -------------------------------------------------------------------------------
    print(f"## Plain greedy decoding: {args.model}, {n} tokens, prompt {len(prompt_ids)} tokens, "
          f"{args.threads} threads, {args.dtype}, load average {load_start:.2f} at start\n")
    print("| run | side | prefill s | decode tok/s | overall tok/s |")
    print("|---|---|---:|---:|---:|")
    for r in runs:
        print(f"| {r['repeat']} | {'verispec' if r['side'] == 'ours' else 'transformers'} | "
              f"{r['prefill_s']:.3f} | {r['decode_tok_s']:.2f} | {r['overall_tok_s']:.2f} |")
    for side, name in (("ours", "verispec"), ("hf", "transformers")):
        m = med[side]
        print(f"| median | {name} | {m['prefill_s']:.3f} | {m['decode_tok_s']:.2f} | {m['overall_tok_s']:.2f} |")
    goal_ratio, goal_roofline = judged(ratio_decode, args.goal_ratio), judged(fraction, args.goal_roofline)
    print()
    print("| figure | value | goal |")
    print("|---|---:|---|")
    print(f"| decode speed ratio verispec / transformers | {ratio_decode:.2f}x | >= {args.goal_ratio}x "
          f"({'met' if goal_ratio['met'] else 'NOT met'}) |")
    print(f"| overall speed ratio verispec / transformers | {ratio_overall:.2f}x | |")
    ident = "identical" if div is None else f"diverge at token {div}"
    print(f"| greedy ids, first {n} tokens | {ident} | |")
    print(f"| load time verispec / transformers | {ours_load_s:.1f} s / {hf_load_s:.1f} s | |")
    print(f"| transformers weights / attention | {hf_info['weights']} / {hf_info['attn_implementation']} | |")
    print(f"| weight bytes read per token (verispec; transformers holds {hf_info['param_bytes'] / 1e6:.1f} MB) | "
          f"{param_bytes / 1e6:.1f} MB | |")
    print(f"| KV-cache bytes per token (logical / padded) | {kv['logical'] / 1e6:.2f} / {kv['padded'] / 1e6:.2f} MB | |")
    print(f"| achieved bandwidth (weights only) | {achieved:.2f} GB/s | |")
    probes = ", ".join(f"{k} {v:.2f}" for k, v in bw["gb_s_by_probe"].items())
    print(f"| measured read bandwidth (best of {args.bandwidth_trials}; {probes}) | {bw['gb_s']:.2f} GB/s | |")
    print(f"| roofline fraction | {fraction:.1%} | >= {args.goal_roofline:.0%} "
          f"({'met' if goal_roofline['met'] else 'NOT met'}) |")
    print()

    result = {
        "bench": "decode",
        "model": args.model,
        "gguf": gguf.name,
        "max_tokens": n,
        "prompt_tokens": len(prompt_ids),
        "threads": args.threads,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg()[0],
        "runs": [{k: v for k, v in r.items() if k != "output_ids"} for r in runs],
        "median": med,
        "ratio_decode": ratio_decode,
        "ratio_overall": ratio_overall,
        "goal_ratio": goal_ratio["goal"],
        "goal_ratio_met": goal_ratio["met"],
        "ids_identical": div is None,
        "first_divergence": div,
        "self_consistent": self_consistent,
        "load_s": {"ours": ours_load_s, "hf": hf_load_s},
        "hf": {k: v for k, v in hf_info.items() if k != "load_s"},
        "roofline": {
            "param_bytes": param_bytes,
            "kv_bytes_per_token_logical": kv["logical"],
            "kv_bytes_per_token_padded": kv["padded"],
            "decode_step_s": step_s,
            "achieved_gb_s": achieved,
            "achieved_gb_s_with_kv": achieved_with_kv,
            "measured_gb_s": bw["gb_s"],
            "measured_gb_s_by_probe": bw["gb_s_by_probe"],
            "probe_bytes": bw["tensor_bytes"],
            "fraction": fraction,
            "goal_fraction": goal_roofline["goal"],
            "goal_fraction_met": goal_roofline["met"],
        },
    }
    line = json.dumps(result)
    if args.out:
        args.out.write_text(line + "\n")
    print(line)
    return 0


