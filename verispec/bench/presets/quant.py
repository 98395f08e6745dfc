"""Plain greedy decode speed of one model in several weight formats, and llama.cpp on its GGUF.

Variants (``--variants``, run in turn, round after round, so machine drift hits all alike):

* ``gguf``          -- the file's own quantized weights on the native kernels (the default);
* ``bf16``          -- the dense bf16 decoder, eager;
* ``bf16-compiled`` -- the same with ``torch.compile`` on the decode/verify steps;
* ``int8`` / ``int4`` -- packed weight-only layers (:mod:`verispec.models.quant`);
* ``llama.cpp``     -- ``llama-cpp-python`` on the model's own GGUF file (optional: skipped with
  a message when the package is not installed), same thread count, greedy (top-k 1).

Each decodes ``--max-tokens`` tokens from the same chat-templated prompt ids, ignoring EOS;
decode tokens/s = (N - 1) / (time after the first token).

Roofline: weight bytes read per token / decode time per token / measured read bandwidth (best
full ``sum`` over a large tensor, as in ``verispec bench decode``). Bytes per token count every
parameter and buffer once, except the input embedding table, of which a lookup reads one row
(with tied embeddings the dense LM head reads it in full; quantized models read a packed copy).
For llama.cpp the bytes are the GGUF's tensor data without ``token_embd``, except where the
output layer is tied to it.

``--pair`` also measures, for each verispec variant, the draft cost ratio c = T_draft(1) /
T_target(1) and the verify cost alpha = (T_target(k+1) / T_target(1) - 1) / k of the draft
model quantized the same way, by timing single forwards at a fixed context.

    verispec bench quant --max-tokens 64 --repeats 2 --pair qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from verispec.bench.machine import log, machine_load
from verispec.bench.presets.common import TARGET, PresetParser
from verispec.bench.presets.decode import read_bandwidth, run_ours, timing
from verispec.engine.engine import Engine
from verispec.models.compile import compile_decoder
from verispec.models.loader import load_model, read_gguf_header
from verispec.models.registry import resolve_model
from verispec.runtime import set_threads

DEFAULT_PROMPT = "Write a Python function that checks whether a string is a palindrome, with tests."
VARIANTS = ("gguf", "bf16", "bf16-compiled", "int8", "int4", "llama.cpp")
QUANT = {"gguf": "gguf", "bf16": "none", "bf16-compiled": "none", "int8": "int8", "int4": "int4"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = PresetParser("quant", __doc__.splitlines()[0], model=TARGET, max_tokens=64, repeats=2, threads=None)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list from {', '.join(VARIANTS)}")
    p.add_argument("--bandwidth-gib", type=float, default=2.0)
    p.add_argument("--pair", default=None, metavar="DRAFT", help="also measure c and alpha with this draft model")
    p.add_argument("--k", type=int, default=4, help="verify width for alpha (default 4)")
    args = p.parse_args(argv)
    args.variants = args.variants.split(",")
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variant(s) {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    return args


def model_bytes_per_token(model: Any) -> int:
    # a layer's `dense` copy serves prompt prefill only; a decode step does not read it
    named = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if not n.endswith("dense")]
    unique = {t.data_ptr(): t for _, t in named}
    total = sum(t.numel() * t.element_size() for t in unique.values())
    table = model.embed.weight
    return total - (table.shape[0] - 1) * table.shape[1] * table.element_size()


def gguf_bytes_per_token(path: Any) -> int:
    infos = read_gguf_header(path).tensors
    names = {t.name for t in infos}
    tied = "output.weight" not in names
    return sum(t.nbytes for t in infos if t.name != "token_embd.weight" or tied)


class LlamaCpp:
    """Greedy decoding with llama-cpp-python, timed like ``run_ours``."""

    def __init__(self, gguf: Any, threads: int, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                         verbose=False)  # fmt: skip

    def run(self, prompt_ids: list[int], n: int) -> dict:
        self.llm.reset()
        out: list[int] = []
        t0 = time.perf_counter()
        prefill = 0.0
        for tok in self.llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True):
            if not out:
                prefill = time.perf_counter() - t0
            out.append(int(tok))
            if len(out) == n:
                break
        return timing(out, time.perf_counter() - t0, prefill, n)


def forward_ms(model: Any, ctx: int, t: int, repeats: int = 5) -> float:
    """Median time of one forward of ``t`` new positions after ``ctx`` cached ones."""
    cache = model.new_cache(ctx + t + 8)
    model(torch.zeros(1, ctx, dtype=torch.long), torch.arange(ctx)[None], cache, num_logits=1)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(torch.zeros(1, t, dtype=torch.long), torch.arange(ctx, ctx + t)[None], cache)
        times.append(time.perf_counter() - t0)
        cache.truncate(0, ctx)
    return 1e3 * statistics.median(times)


def pair_costs(target: Any, draft: Any, k: int, ctx: int = 128) -> dict:
    t1, tk, d1 = forward_ms(target, ctx, 1), forward_ms(target, ctx, k + 1), forward_ms(draft, ctx, 1)
    return {"target_ms": t1, "verify_ms": tk, "draft_ms": d1, "c": d1 / t1, "alpha": (tk / t1 - 1) / k}


def load_variant(name: str, spec: str) -> Any:
    loaded = load_model(spec, progress=False, quantization=QUANT[name])
    if name == "bf16-compiled":
        compile_decoder(loaded.model)
    return loaded


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = set_threads(args.threads)
    load = machine_load(threads)
    bw = read_bandwidth(args.bandwidth_gib, trials=3)["gb_s"]
    log(f"read bandwidth {bw:.1f} GB/s")
    gguf = resolve_model(args.model, progress=False)
    runners: dict[str, Any] = {}
    bytes_per_token: dict[str, int] = {}
    prompt_ids: list[int] = []
    costs: dict[str, dict] = {}
    compile_s: dict[str, float] = {}
    for name in args.variants:
        if name == "llama.cpp":
            try:
                llama = LlamaCpp(gguf, threads, n_ctx=512)
            except ImportError:
                log("llama.cpp: skipped, llama-cpp-python is not installed (pip install llama-cpp-python)")
                continue
            runners[name] = llama.run
            bytes_per_token[name] = gguf_bytes_per_token(gguf)
            continue
        loaded = load_variant(name, args.model)
        if not prompt_ids:
            prompt_ids = loaded.tokenizer.apply_chat_template(DEFAULT_PROMPT)
        # no prefix caching: each timed run reads its whole prompt, as llama.cpp's does after reset()
        engine = Engine(loaded, None, max_model_len=len(prompt_ids) + args.max_tokens + 8, prefix_caching=False)
        runners[name] = lambda ids, n, engine=engine: run_ours(engine, ids, n)
        if name == "bf16-compiled":  # compile the buckets a decode touches, outside the timed runs
            t0 = time.perf_counter()
            runners[name](prompt_ids, 4)
            compile_s[name] = time.perf_counter() - t0
            log(f"{name}: first run of 4 tokens (compiling) took {compile_s[name]:.0f} s")
        bytes_per_token[name] = model_bytes_per_token(loaded.model)
        if args.pair and name != "bf16-compiled":
            draft = load_model(args.pair, progress=False, quantization=QUANT[name]).model
            costs[name] = pair_costs(loaded.model, draft, args.k)
            log(f"{name}: c={costs[name]['c']:.3f} alpha={costs[name]['alpha']:.3f}")
            del draft
    runs: dict[str, list[dict]] = {name: [] for name in runners}
    for _ in range(args.repeats):
        for name, run in runners.items():
            runs[name].append(run(prompt_ids, args.max_tokens))
            log(f"{name}: {runs[name][-1]['decode_tok_s']:.2f} tok/s")
    print_report(args, threads, load, bw, runs, bytes_per_token, costs, compile_s)
    return 0


def print_report(args, threads, load, bw, runs, bytes_per_token, costs, compile_s) -> None:
    rows = {}
    for name, rs in runs.items():
        tok_s = statistics.median(r["decode_tok_s"] for r in rs)
        rows[name] = {"decode_tok_s": tok_s, "gb_per_token": bytes_per_token[name] / 1e9,
                      "roofline": bytes_per_token[name] * tok_s / 1e9 / bw,
                      "output_ids": rs[0]["output_ids"], "first_run_s": compile_s.get(name),
                      **costs.get(name, {})}  # fmt: skip
    ref = rows.get("llama.cpp")
    print(f"{args.model}, {args.max_tokens} tokens, {args.repeats} rounds, {threads} threads, "
          f"load before start {load:.2f}, read bandwidth {bw:.1f} GB/s\n")
    print("| variant | decode tok/s | GB read / token | roofline | vs llama.cpp | same output as bf16 | c | alpha |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = rows.get("bf16", {}).get("output_ids")
    for name, r in rows.items():
        vs = f"{r['decode_tok_s'] / ref['decode_tok_s']:.2f}x" if ref else "n/a"
        same = "" if base is None else str(r["output_ids"] == base)
        c = f"{r['c']:.3f}" if "c" in r else ""
        alpha = f"{r['alpha']:.3f}" if "alpha" in r else ""
        print(f"| {name} | {r['decode_tok_s']:.2f} | {r['gb_per_token']:.2f} | {100 * r['roofline']:.0f}% | "
              f"{vs} | {same} | {c} | {alpha} |")
    for name, seconds in compile_s.items():
        print(f"\n{name}: the first (compiling) run of 4 tokens took {seconds:.0f} s")
    print(json.dumps({"model": args.model, "threads": threads, "load": load, "bandwidth_gb_s": bw,
                      "rows": {n: {k: v for k, v in r.items() if k != "output_ids"} for n, r in rows.items()}}))


