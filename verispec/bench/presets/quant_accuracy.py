"""How far int8 / int4 weights move a model from its bf16 self: top-1 agreement and perplexity.

The text is fixed and teacher-forced: prose (the first turns of Spec-Bench's ``summarization``
questions, in file order) followed by code (the source of ``torch.nn.modules.linear`` from the
installed torch), cut to ``--tokens`` tokens of each model's tokenizer, half prose and half code.
Each variant runs the same tokens through one KV cache in chunks of ``--chunk`` positions (one
forward per chunk, all logits kept), so every position is scored with its full left context.

* **top-1 agreement**: the fraction of positions where the quantized model's argmax equals the
  bf16 model's (what greedy decoding would pick);
* **perplexity**: exp of the mean negative log-likelihood of the actual next token.

The bf16 model's chunks are run as prefill passes, so on CPUs without native bf16 their dense
matmuls compute in float32 (see ``PREFILL_MIN_TOKENS``); the quantized models' chunks run as
decode passes, through their packed kernels, so what is scored is the model that decodes.

    verispec bench quant-accuracy --models smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.nn.modules.linear

from verispec.bench.machine import log, machine_load
from verispec.bench.presets.common import PresetParser
from verispec.models.loader import load_model
from verispec.models.quant import is_quantized
from verispec.runtime import set_threads

SCHEMES = ("gguf", "int8", "int4")


def fixed_text(questions: Path) -> tuple[str, str]:
    prose = [json.loads(line) for line in questions.read_text().splitlines() if line.strip()]
    prose_text = "\n\n".join(q["turns"][0] for q in prose if q["category"] == "summarization")
    return prose_text, inspect.getsource(torch.nn.modules.linear)


def token_ids(loaded, prose: str, code: str, n: int) -> list[int]:
    enc = loaded.tokenizer.encode
    return enc(prose)[: n // 2] + enc(code)[: n - n // 2]


def score(model, ids: list[int], chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Argmax [n-1] and next-token NLL [n-1] of every position but the last."""
    cache = model.new_cache(len(ids) + chunk)
    quantized = is_quantized(model)
    tokens = torch.tensor([ids])  # [1, n]
    top, nll = [], []
    for start in range(0, len(ids) - 1, chunk):
        stop = min(start + chunk, len(ids) - 1)
        logits = model(tokens[:, start:stop], torch.arange(start, stop)[None], cache, prefill=not quantized)[0]  # [T, V]
        top.append(logits.argmax(-1))
        nll.append(F.cross_entropy(logits, tokens[0, start + 1 : stop + 1], reduction="none"))
    return torch.cat(top), torch.cat(nll)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = PresetParser("quant-accuracy", __doc__.splitlines()[0], questions=None, threads=None)
    p.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct,qwen2.5-coder-1.5b-instruct")
    p.add_argument("--tokens", type=int, default=2000, help="teacher-forced tokens per model (default 2000)")
    p.add_argument("--chunk", type=int, default=500, help="positions per forward (default 500)")
    p.add_argument("--group-size", type=int, default=32, help="int4 group size (default 32)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = set_threads(args.threads)
    load = machine_load(threads)
    prose, code = fixed_text(args.questions)
    rows = []
    for name in args.models.split(","):
        ref_model = load_model(name, quantization="none", progress=False)
        ids = token_ids(ref_model, prose, code, args.tokens)
        t0 = time.perf_counter()
        ref_top, ref_nll = score(ref_model.model, ids, args.chunk)
        rows.append({"model": name, "scheme": "bf16", "tokens": len(ids), "agreement": 1.0,
                     "ppl": math.exp(ref_nll.mean().item()), "seconds": time.perf_counter() - t0})
        del ref_model
        for scheme in SCHEMES:
            model = load_model(name, progress=False, quantization=scheme, group_size=args.group_size).model
            t0 = time.perf_counter()
            top, nll = score(model, ids, args.chunk)
            rows.append({"model": name, "scheme": scheme, "tokens": len(ids),
                         "agreement": (top == ref_top).double().mean().item(),
                         "ppl": math.exp(nll.mean().item()), "seconds": time.perf_counter() - t0})
            del model
        for r in rows[-3:]:
            log(f"{r['model']} {r['scheme']}: agreement {r['agreement']:.4f} ppl {r['ppl']:.3f} ({r['seconds']:.0f} s)")
    print(f"threads {threads}, load before start {load:.2f}, int4 group {args.group_size}\n")
    print("| model | weights | tokens | top-1 agreement with bf16 | perplexity |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['scheme']} | {r['tokens']} | {r['agreement']:.4f} | {r['ppl']:.3f} |")
    print(json.dumps({"threads": threads, "load": load, "group_size": args.group_size, "rows": rows}))
    return 0


