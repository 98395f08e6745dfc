"""The native kernels' benchmark: what a verify pass costs against a decode step.

Everything runs in one process and interleaved: each repeat times every configuration once, in
the same order, and the report gives medians with their spread (min-max over repeats), so a
ratio compares runs made under the same machine load. It prints the CPU model and ISA flags.

Sections:

* ``bandwidth``: the memory read bandwidth with the benchmark's threads (a sum over 1 GiB), the
  roofline for M = 1.
* ``shapes``: every linear layer shape of the model, on the file's own weights, at M rows:
  time(M) / time(1), and at M = 1 the weight bytes read per second and their share of the
  bandwidth.
* ``paths``: every ISA path the CPU has (``avx2``, ``avxvnni``, ``avx512``, ``amx``; not the
  scalar reference), forced on each layer shape at 1 and 9 rows: milliseconds per call, and each
  path's time against the default path's in the same repeat. It shows what a machine with only
  the smaller instruction sets gets (all paths give the same bits).
* ``model``: the whole model on a short chat prompt: a pass of T positions against a decode
  step (T = 1), the same for T = 9 after 512 cached tokens (a prompt and answer of Spec-Bench's
  size), batch-8 decode throughput against batch 1, and a 700-token prompt's prefill
  (each pass timed right after an untimed one of its own, see ``interleaved``).
* ``bounds``: passes of T = 1..17 positions against a decode step, each beside its floor (see
  ``pass_bound``): the measured pass/step, the bound over the step, and measured/bound. It needs
  the AVX512 path, whose row loop's instructions it counts.
* ``calls``: a decode step and a 9-position pass with each decoder layer in one native call
  (the default, ``csrc/layer.cpp``) against the Python layer making the same kernel calls one by
  one (``Decoder.native_layers = False``): what the Python around the kernels costs.
* ``attention``: one layer's attention (the model's heads and head dim) on every SIMD path over a
  float32 cache and on the default path over a float16 one, for T positions after S - T cached
  entries with causal rows (``ATTENTION_SHAPES``: decode steps and 9-position passes at 512 and
  2,048 cached tokens, a 700-token prompt): milliseconds per call, and the whole model's share
  (times its layers) on the default path over the model's cache dtype.
* ``llama``: the same GGUF file through llama.cpp (the ``llama-cpp-python`` package, if it is
  installed; the section says so and is skipped if not), with the same threads, interleaved
  with verispec: a decode step, a 9-position pass, a 700-token prefill, and greedy generation
  of 64 tokens from the chat prompt (plain decoding end to end: llama.cpp's own sampling loop
  against verispec's engine). Each timed call first sleeps ``SETTLE`` seconds, so that neither
  runtime's worker threads are still spinning from the other's previous call; steps and passes
  then run once untimed, so each is timed after a pass of its own runtime, as in a generation
  loop (see ``interleaved``). One OpenMP runtime serves both runtimes in the process, and
  llama.cpp runs slower under verispec's passive wait policy (see ``verispec/__init__.py``):
  ``GOMP_SPINCOUNT=300000`` times both with the spinning default, and the section says which.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from verispec import kernels
from verispec.bench.presets.common import TARGET, PresetParser
from verispec.config import SamplingParams

ROWS = (1, 2, 4, 8, 9, 16)
SETTLE = 0.2  # seconds before each timed call of the llama section
POSITIONS = (1, 2, 4, 9, 16)
LONG_CONTEXT = 512  # cached tokens of the model section's long-context passes
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8")


def cpu_description() -> str:
    model, flags = platform.processor() or "unknown CPU", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name") and model in ("", "unknown CPU", platform.processor()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    return f"{model} ({' '.join(f for f in FLAGS if f in flags) or 'flags unknown'})"


def interleaved(configs: dict[str, Callable[[], object]], repeats: int, settle: float = 0.0,
                warm: tuple[str, ...] = ()) -> dict[str, list[float]]:
    """Seconds per call of each configuration, timed round-robin ``repeats`` times after a
    warm-up, each call after ``settle`` seconds of sleep. A configuration named in ``warm`` runs
    once more, untimed, right before each timed call: a decode step or verify pass is timed as
    it runs in a generation loop, after another pass, not after whatever the round-robin ran
    before it: a step right after a long prefill runs measurably slower than the next one, with
    its caches full of the prefill's data, whichever threads ran the kernels (docs/kernels.md)."""
    for fn in configs.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(repeats):
        for name, fn in configs.items():
            time.sleep(settle)
            if name in warm:
                fn()
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return times


def ratio(times: dict[str, list[float]], num: str, den: str) -> tuple[float, float, float]:
    """Median of per-repeat ratios, and their min and max."""
    r = [a / b for a, b in zip(times[num], times[den])]
    return statistics.median(r), min(r), max(r)


def read_bandwidth(repeats: int) -> float:
    """Bytes per second that a sum over 1 GiB reads, with the current torch threads (median)."""
    big = torch.ones(2**28, dtype=torch.float32)
    t = interleaved({"sum": lambda: big.sum()}, repeats)["sum"]
    return big.numel() * 4 / statistics.median(t)


def _layer_groups(model) -> dict:
    """The model's native linear layers by kind and formats, in layer order."""
    from verispec.models.native import NativeLinear

    # Every layer of a kind, grouped by its formats (Q4_K_M alternates the down projection's):
    # each timed call runs the next layer of its group, so the weights come from memory, as in a
    # decode step, not from a cache still holding the previous call's.
    groups: dict[tuple[str, str], list[NativeLinear]] = {}
    for layer in model.layers:
        for name in ("qkv", "o_proj", "gate_up", "down"):
            lin = getattr(layer, name)
            if isinstance(lin, NativeLinear):
                key = (name, "+".join(kernels.format_name(p.fmt) for p in lin.parts))
                groups.setdefault(key, []).append(lin)
    if isinstance(model.lm_head, NativeLinear):
        groups[("lm_head", kernels.format_name(model.lm_head.parts[0].fmt))] = [model.lm_head]
    return groups


def _page_in(layers: list) -> None:
    """One untimed call per layer, so that no timed call pages its weights in from the file: a
    call that does is several times slower than one on resident weights."""
    x = torch.randn(1, layers[0].in_features)
    for layer in layers:
        kernels.matmul(x, layer.parts)


def bench_shapes(model, repeats: int, bandwidth: float) -> list[dict]:
    rows = []
    for (name, types), layers in _layer_groups(model).items():
        lin = layers[0]
        turn = iter(range(10**9))
        xs = {m: torch.randn(m, lin.in_features) for m in ROWS}
        _page_in(layers)

        def call(m: int) -> None:
            kernels.matmul(xs[m], layers[next(turn) % len(layers)].parts)

        times = interleaved({str(m): (lambda m=m: call(m)) for m in ROWS}, repeats)
        t1 = statistics.median(times["1"])
        nbytes = sum(p.nbytes for p in lin.parts)
        rows.append({
            "layer": name, "shape": f"{lin.out_features}x{lin.in_features}", "types": types,
            "t1_ms": t1 * 1e3, "gbps": nbytes / t1 / 1e9, "bw_share": nbytes / t1 / bandwidth,
            "ratios": {m: ratio(times, str(m), "1") for m in ROWS[1:]},
        })
    return rows


def _pass_of(model, context: torch.Tensor, t: int, batch: int = 1) -> Callable[[], object]:
    """A pass of ``t`` positions per slot after ``context`` ([1, c0] token ids), rolled back after
    each call so that every timed pass sees the same cache."""
    c0 = context.shape[1]
    cache = model.new_cache(c0 + 64, num_slots=batch)
    model(context.expand(batch, -1), torch.arange(c0)[None].expand(batch, -1), cache)
    toks = torch.full((batch, t), 42)
    pos = torch.arange(c0, c0 + t)[None].expand(batch, -1)

    def run():
        model(toks, pos, cache)
        for slot in range(batch):
            cache.truncate(slot, c0)
    return run


def bench_model(loaded, repeats: int) -> dict:
    model = loaded.model
    prompt = loaded.tokenizer.apply_chat_template("Write a Python function that checks whether a string is a palindrome.")
    n0 = len(prompt)
    ids = torch.tensor([prompt])

    long_ids = torch.tensor([(prompt * (700 // n0 + 1))[:700]])

    def pass_of(t: int, batch: int = 1, context: torch.Tensor = ids) -> Callable[[], object]:
        return _pass_of(model, context, t, batch)

    configs = {f"T={t}": pass_of(t) for t in POSITIONS}
    configs["batch=8"] = pass_of(1, 8)
    # the same passes after LONG_CONTEXT cached tokens, where attention is no longer small
    for t in (1, 9):
        configs[f"long T={t}"] = pass_of(t, context=long_ids[:, :LONG_CONTEXT])

    def prefill():
        cache = model.new_cache(768)
        model(long_ids, torch.arange(700)[None], cache, num_logits=1, prefill=True)

    configs["prefill 700"] = prefill
    times = interleaved(configs, repeats, warm=tuple(name for name in configs if name != "prefill 700"))
    step = statistics.median(times["T=1"])
    return {
        "decode_ms": step * 1e3, "decode_tok_s": 1 / step,
        "verify": {t: ratio(times, f"T={t}", "T=1") for t in POSITIONS[1:]},
        # throughput ratio = 8 / (time ratio): the median, then the min and max over repeats
        "long_decode_ms": statistics.median(times["long T=1"]) * 1e3,
        "long_verify9": ratio(times, "long T=9", "long T=1"),
        "batch8_throughput": (lambda r: (8 / r[0], 8 / r[2], 8 / r[1]))(ratio(times, "batch=8", "T=1")),
        "prefill_700_s": statistics.median(times["prefill 700"]),
    }


# Vector instructions of the AVX512 row loop (csrc/avx512.cpp) per tile superblock (16 columns,
# KB k), as GCC compiles it, counted in the loop bodies' disassembly: those that issue on the
# SIMD ports (dot products, fp32 steps, the weights' unpacking), not loads, stores or register
# moves. A block of R rows costs WEIGHTS once (the weights' bits split) and PER_ROW for each row;
# a superblock's fp32 scales cost SCALES, once for all its blocks (per block for the 32-wide
# formats, whose calls take several superblocks). Q4_K, per sub of 32: 8 vpandd and 4 vpsrlw
# split the nibbles, and a row takes 8 vpdpbusd plus its fp32 steps (a convert, a multiply, an
# fma, the offset's fnmadd); the scales take 3 instructions per sub and dl or ml, and 2 fp16
# converts. Q6_K, per sub of 16: about 13 instructions join the nibbles to their high bits
# (vpandd, vpsrlw, vpsllw, vpternlogd), and a row takes 4 vpdpbusd and 3 fp32 steps. Q4_1 as one
# Q4_K sub (its scales: 2 fp16 converts and a sign flip); Q8_0 flips each group's top bit (8
# vpxord) and takes no offset's step. Below 4 rows each row's sums run in P partial chains, P - 1
# adds per row and sub. Formats not here have no bound.
AVX512_OPS = {"Q4_K": {"kb": 256, "weights": 8 * 12, "scales": 8 * 2 * 3 + 2, "per_row": 8 * (8 + 4), "subs": 8},
              "Q6_K": {"kb": 256, "weights": 16 * 13, "scales": 16 * 3 + 1, "per_row": 16 * (4 + 3), "subs": 16},
              "Q4_1": {"kb": 32, "weights": 12, "scales": 3, "per_row": 8 + 4, "subs": 1},
              "Q8_0": {"kb": 32, "weights": 8, "scales": 1, "per_row": 8 + 3, "subs": 1}}
MAX_BLOCK = 12  # rows per AVX512 block (csrc/avx512.cpp, rows)
BOUND_POSITIONS = tuple(range(1, 18))


def avx512_row_blocks(m: int) -> list[int]:
    """The row blocks the AVX512 path runs a call of ``m`` rows in: the fewest blocks of at most
    ``MAX_BLOCK`` rows, of sizes that differ by at most one (as ``rows`` in csrc/avx512.cpp)."""
    blocks, out = -(-m // MAX_BLOCK), []
    while blocks:
        r = -(-m // blocks)
        out.append(r)
        m, blocks = m - r, blocks - 1
    return out


def avx512_superblock_ops(fmt: str, m: int) -> int:
    """Vector instructions of one tile superblock of ``fmt`` against ``m`` rows (``AVX512_OPS``)."""
    c, blocks = AVX512_OPS[fmt], avx512_row_blocks(m)
    partial = {1: 3, 2: 1, 3: 1}
    scales = c["scales"] * (1 if c["kb"] == 256 else len(blocks))
    return scales + sum(c["weights"] + r * c["per_row"] + r * partial.get(r, 0) * c["subs"] for r in blocks)


def zmm_per_cycle() -> int:
    """512-bit vector instructions a core issues per cycle on the ports the row loop uses: an AMD
    family 25 core with AVX512 runs each as two 256-bit halves on its two multiply pipes, one per
    cycle; full-width AVX512 cores two."""
    vendor = family = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    vendor = line.split(":", 1)[1].strip()
                elif line.startswith("cpu family"):
                    family = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return 1 if vendor == "AuthenticAMD" and family == "25" else 2


def pass_bound(model, t: int, clock_hz: float, threads: int) -> float | None:
    """Seconds that the matmuls of a pass of ``t`` positions need on the vector ports at least:
    every native layer's tile superblocks times ``avx512_superblock_ops``, at ``zmm_per_cycle``
    and the measured clock, on ``threads`` cores. None if a layer's format has no count."""
    total = 0
    for layers in _layer_groups(model).values():
        for lin in layers:
            for p in lin.parts:
                name = kernels.format_name(p.fmt)
                if name not in AVX512_OPS:
                    return None
                total += p.n // kernels.TILE * (p.k // AVX512_OPS[name]["kb"]) * avx512_superblock_ops(name, t)
    return total / (zmm_per_cycle() * clock_hz * threads)


def bench_bounds(loaded, repeats: int, threads: int) -> dict:
    """Passes of ``BOUND_POSITIONS`` against a decode step, interleaved, each beside its bound:
    the larger of the step (memory: a pass reads the weights a step reads) and ``pass_bound``."""
    model = loaded.model
    prompt = loaded.tokenizer.apply_chat_template("Write a Python function that checks whether a string is a palindrome.")
    configs = {f"T={t}": _pass_of(model, torch.tensor([prompt]), t) for t in BOUND_POSITIONS}
    times = interleaved(configs, repeats, warm=tuple(configs))
    step = statistics.median(times["T=1"])
    clock = kernels.core_clock_hz()
    out = {"step_ms": step * 1e3, "clock_ghz": clock / 1e9, "zmm_per_cycle": zmm_per_cycle(), "passes": {}}
    for t in BOUND_POSITIONS:
        compute = pass_bound(model, t, clock, threads)
        measured = ratio(times, f"T={t}", "T=1")
        bound = None if compute is None else max(1.0, compute / step)
        out["passes"][t] = {"blocks": avx512_row_blocks(t), "measured": measured, "bound": bound,
                            "compute_ms": None if compute is None else compute * 1e3,
                            "measured_over_bound": None if bound is None else measured[0] / bound}
    return out


def bench_calls(loaded, repeats: int) -> dict:
    """Passes of 1 and 9 positions with the layers in one native call each and as Python layers,
    interleaved; both compute the same bits."""
    model = loaded.model
    prompt = loaded.tokenizer.apply_chat_template("Write a Python function that checks whether a string is a palindrome.")
    n0 = len(prompt)
    cache = model.new_cache(n0 + 16)
    model(torch.tensor([prompt]), torch.arange(n0)[None], cache)

    def pass_of(t: int, one_call: bool) -> Callable[[], object]:
        toks, pos = torch.full((1, t), 42), torch.arange(n0, n0 + t)[None]

        def run():
            model.native_layers = one_call
            try:
                model(toks, pos, cache)
            finally:
                model.native_layers = True
                cache.truncate(0, n0)
        return run

    configs = {f"{kind} T={t}": pass_of(t, kind == "one call") for t in (1, 9) for kind in ("one call", "python")}
    times = interleaved(configs, repeats, warm=tuple(configs))
    return {f"T={t}": {"one_call_ms": statistics.median(times[f"one call T={t}"]) * 1e3,
                       "python_ms": statistics.median(times[f"python T={t}"]) * 1e3,
                       "ratio": ratio(times, f"one call T={t}", f"python T={t}")} for t in (1, 9)}


def bench_llama(loaded, gguf_path, threads: int, repeats: int) -> dict | None:
    """verispec against llama.cpp on the same file and threads (see the module docstring); None
    when llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    from verispec.engine.engine import Engine

    model = loaded.model
    prompt = loaded.tokenizer.apply_chat_template("Write a Python function that checks whether a string is a palindrome.")
    n0 = len(prompt)
    long_ids = (prompt * (700 // n0 + 1))[:700]
    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=1024, n_batch=1024, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    llm.eval(prompt)
    cache = model.new_cache(1024)
    model(torch.tensor([prompt]), torch.arange(n0)[None], cache)

    def llama_pass(t: int) -> Callable[[], object]:
        def run():
            llm.n_tokens = n0  # eval() drops the cache past n_tokens first
            llm.eval([42] * t)
        return run

    def ours_pass(t: int) -> Callable[[], object]:
        toks, pos = torch.full((1, t), 42), torch.arange(n0, n0 + t)[None]

        def run():
            model(toks, pos, cache)
            cache.truncate(0, n0)
        return run

    def llama_prefill():
        llm.reset()
        llm.eval(long_ids)

    def ours_prefill():
        model(torch.tensor([long_ids]), torch.arange(700)[None], model.new_cache(768), num_logits=1, prefill=True)

    # no prefix caching: every timed generation reads its whole prompt, as llama.cpp's does after reset()
    engine = Engine(loaded, max_model_len=1024, prefix_caching=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    generated = {}

    def llama_generate():
        llm.reset()
        out = []
        for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            if tok == llm.token_eos():
                break
            out.append(tok)
            if len(out) == 64:
                break
        generated["llama.cpp"] = out

    def ours_generate():
        generated["verispec"] = engine.generate(prompt, greedy).output_ids

    configs = {}
    for what, ours, theirs in (("step", ours_pass(1), llama_pass(1)), ("pass 9", ours_pass(9), llama_pass(9)),
                               ("prefill 700", ours_prefill, llama_prefill),
                               ("generate 64", ours_generate, llama_generate)):
        configs[f"verispec {what}"] = ours
        configs[f"llama.cpp {what}"] = theirs
    times = interleaved(configs, repeats, settle=SETTLE,
                        warm=tuple(f"{who} {what}" for who in ("verispec", "llama.cpp") for what in ("step", "pass 9")))
    same = 0
    for a, b in zip(generated["verispec"], generated["llama.cpp"]):
        if a != b:
            break
        same += 1
    out = {"llama_cpp_python": llama_cpp.__version__, "same_greedy_tokens": same}
    for what in ("step", "pass 9", "prefill 700", "generate 64"):
        out[what] = {
            "verispec_s": statistics.median(times[f"verispec {what}"]),
            "llama_s": statistics.median(times[f"llama.cpp {what}"]),
            # speed of verispec relative to llama.cpp: > 1 is faster
            "speed_vs_llama": ratio(times, f"llama.cpp {what}", f"verispec {what}"),
        }
    out["llama_pass9_over_step"] = ratio(times, "llama.cpp pass 9", "llama.cpp step")
    return out


def prefill_path() -> dict:
    """Which path long prompts take here and why: the kernels, or dense bf16 copies where a
    prefill-shaped product measures faster through torch's bf16 GEMM (measured again here)."""
    from verispec.models.native import dense_prefill_pays, measure_prefill_paths

    dense = dense_prefill_pays()
    out: dict = {"dense_copies": dense}
    if not kernels.cpu_has_native_bf16():
        out["text"] = "the kernels (no native bf16 arithmetic here)"
        return out
    out["kernels_s"], out["bf16_gemm_s"] = measure_prefill_paths()
    out["text"] = (f"{'dense bf16 copies' if dense else 'the kernels'} (a 256-row probe now: "
                   f"{out['kernels_s'] * 1e3:.1f} ms through the kernels, {out['bf16_gemm_s'] * 1e3:.1f} ms "
                   "through the bf16 GEMM)")
    return out


def omp_policy() -> str:
    """The OpenMP wait policy in effect, and what it means for the llama section."""
    policy, spin = os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT")
    if spin is not None:
        return f"GOMP_SPINCOUNT={spin}, idle threads spin; verispec's own default is the passive policy)"
    if policy and policy.upper() == "PASSIVE":
        return ("OMP_WAIT_POLICY=PASSIVE, verispec's default, under which llama.cpp runs slower; "
                "GOMP_SPINCOUNT=300000 times both with the spinning default)")
    return f"OMP_WAIT_POLICY={policy or 'unset'})"


def _fmt(r: tuple[float, float, float]) -> str:
    return f"{r[0]:.2f} ({r[1]:.2f}-{r[2]:.2f})"


PATH_ROWS = (1, 9)
ATTENTION_SHAPES = ((512, 1), (512, 9), (2048, 1), (2048, 9), (700, 700))  # (S, T)


HALF_CACHE = "default, float16 cache"


def bench_attention(config, repeats: int, cache_dtype: torch.dtype = torch.float32) -> list[dict]:
    """One layer's attention on every SIMD path and the default one over a float32 cache, and on
    the default path over a float16 copy of it (``HALF_CACHE``), at ``ATTENTION_SHAPES``,
    interleaved: ms per call (median, min-max), and the model's layers' worth on the default
    path over a ``cache_dtype`` cache (the model's)."""
    isas = [i for i in kernels.supported_isas() if i != "scalar"]
    h, hkv, d, layers = config.num_heads, config.num_kv_heads, config.head_dim, config.num_layers
    gen = torch.Generator().manual_seed(0)
    configs, turn = {}, iter(range(10**9))
    for s, t in ATTENTION_SHAPES:
        q = torch.randn(1, h, t, d, generator=gen)
        # a cache per layer, and each call reads the next one, so keys and values come from
        # memory as in a pass through the model, not from the cache the previous call left warm
        kv = [(torch.randn(1, hkv, s, d, generator=gen), torch.randn(1, hkv, s, d, generator=gen)) for _ in range(layers)]
        half = [(k.half(), v.half()) for k, v in kv]
        mask = torch.ones(t, s, dtype=torch.bool).tril(s - t)[None]  # position i attends to 0 .. s - t + i
        for isa in [None, *isas]:
            configs[(s, t, str(isa or "default"))] = lambda q=q, kv=kv, mask=mask, isa=isa: kernels.attention(
                q, *kv[next(turn) % len(kv)], mask, d**-0.5, isa)
        configs[(s, t, HALF_CACHE)] = lambda q=q, half=half, mask=mask: kernels.attention(
            q, *half[next(turn) % len(half)], mask, d**-0.5)
    times = interleaved({f"{s} {t} {name}": fn for (s, t, name), fn in configs.items()}, repeats)
    out = []
    model_path = HALF_CACHE if cache_dtype == torch.float16 else "default"
    for s, t in ATTENTION_SHAPES:
        ms = {name: [statistics.median(times[f"{s} {t} {name}"]) * 1e3,
                     min(times[f"{s} {t} {name}"]) * 1e3, max(times[f"{s} {t} {name}"]) * 1e3]
              for name in ["default", *isas, HALF_CACHE]}
        out.append({"cached": s - t, "positions": t, "ms": ms, "model_ms": ms[model_path][0] * config.num_layers})
    return out


def bench_paths(model, repeats: int) -> list[dict]:
    """Each layer shape on every SIMD path at ``PATH_ROWS`` rows, interleaved (see
    ``bench_shapes`` for how layers take turns)."""
    isas = [i for i in kernels.supported_isas() if i != "scalar"]
    out = []
    for (name, types), layers in _layer_groups(model).items():
        lin = layers[0]
        turn = iter(range(10**9))
        xs = {m: torch.randn(m, lin.in_features) for m in PATH_ROWS}
        _page_in(layers)
        configs = {}
        for m in PATH_ROWS:
            configs[f"default {m}"] = lambda m=m: kernels.matmul(xs[m], layers[next(turn) % len(layers)].parts)
            for isa in isas:
                configs[f"{isa} {m}"] = lambda m=m, isa=isa: kernels.matmul(
                    xs[m], layers[next(turn) % len(layers)].parts, isa)
        times = interleaved(configs, repeats)
        out.append({
            "layer": name, "shape": f"{lin.out_features}x{lin.in_features}", "types": types,
            "ms": {f"{isa} {m}": statistics.median(times[f"{isa} {m}"]) * 1e3 for isa in isas for m in PATH_ROWS},
            "vs_default": {f"{isa} {m}": ratio(times, f"{isa} {m}", f"default {m}") for isa in isas for m in PATH_ROWS},
        })
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = PresetParser("kernels", __doc__, model=TARGET, threads=2, repeats=7)
    p.add_argument("--sections", default="bandwidth,shapes,paths,model,calls,attention,llama", help="comma-separated subset")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from verispec.models.loader import load_model
    from verispec.models.native import is_native

    torch.set_num_threads(args.threads)
    sections = set(args.sections.split(","))
    print(f"CPU: {cpu_description()}; threads {args.threads}; kernel paths {', '.join(kernels.supported_isas())}")
    loaded = load_model(args.model, quantization="gguf", progress=False)
    assert is_native(loaded.model)
    result: dict = {"cpu": cpu_description(), "threads": args.threads, "isa": kernels.best_isa(), "model": args.model}
    bandwidth = read_bandwidth(args.repeats)
    result["read_gbps"] = bandwidth / 1e9
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s")
    if "shapes" in sections:
        rows = bench_shapes(loaded.model, args.repeats, bandwidth)
        result["shapes"] = rows
        print("\n| layer | shape | types | M=1 ms | GB/s | of bandwidth | " + " | ".join(f"M={m}/M=1" for m in ROWS[1:]) + " |")
        print("|---" * (6 + len(ROWS) - 1) + "|")
        for r in rows:
            print(f"| {r['layer']} | {r['shape']} | {r['types']} | {r['t1_ms']:.3f} | {r['gbps']:.1f} | "
                  f"{r['bw_share']:.0%} | " + " | ".join(_fmt(r["ratios"][m]) for m in ROWS[1:]) + " |")
    if "paths" in sections:
        prow = bench_paths(loaded.model, args.repeats)
        result["paths"] = prow
        keys = list(prow[0]["ms"]) if prow else []
        print("\nms per call on each ISA path, and (its time / the default path's) in the same repeats:")
        print("| layer | types | " + " | ".join(keys) + " |")
        print("|---" * (2 + len(keys)) + "|")
        for r in prow:
            print(f"| {r['layer']} | {r['types']} | "
                  + " | ".join(f"{r['ms'][k]:.3f} ({r['vs_default'][k][0]:.2f})" for k in keys) + " |")
    if "model" in sections:
        m = bench_model(loaded, args.repeats)
        result["model_passes"] = m
        print(f"\ndecode step {m['decode_ms']:.1f} ms ({m['decode_tok_s']:.1f} tok/s); pass of T positions / decode step: "
              + ", ".join(f"T={t}: {_fmt(r)}" for t, r in m["verify"].items()))
        print(f"after {LONG_CONTEXT} cached tokens: decode step {m['long_decode_ms']:.1f} ms, pass of 9 / decode step "
              f"{_fmt(m['long_verify9'])}")
        print(f"batch-8 decode throughput / batch 1: {_fmt(tuple(m['batch8_throughput']))}; "
              f"prefill of 700 tokens: {m['prefill_700_s']:.2f} s")
        result["prefill_path"] = prefill_path()
        print(f"prefill path: {result['prefill_path']['text']}")
    if "bounds" in sections:
        if kernels.best_isa() not in ("avx512", "amx"):
            print(f"\nbounds: skipped (they count the AVX512 row loop's instructions; this CPU runs {kernels.best_isa()})")
        else:
            b = bench_bounds(loaded, args.repeats, args.threads)
            result["bounds"] = b
            print(f"\npasses against their bounds (step {b['step_ms']:.1f} ms; clock {b['clock_ghz']:.2f} GHz, "
                  f"{b['zmm_per_cycle']} zmm instructions per cycle; bound = max(step, the matmuls' vector instructions)):")
            print("| T | row blocks | matmuls' instructions, ms | pass / step | bound / step | measured / bound |")
            print("|---|---|---|---|---|---|")
            for t, r in b["passes"].items():
                compute = "-" if r["compute_ms"] is None else f"{r['compute_ms']:.1f}"
                bound = "-" if r["bound"] is None else f"{r['bound']:.2f}"
                over = "-" if r["measured_over_bound"] is None else f"{r['measured_over_bound']:.2f}"
                print(f"| {t} | {'+'.join(map(str, r['blocks']))} | {compute} | {_fmt(r['measured'])} | {bound} | {over} |")
    if "calls" in sections:
        c = bench_calls(loaded, args.repeats)
        result["calls"] = c
        print("\ndecoder layers in one native call each / the Python layers (the same kernel calls): "
              + "; ".join(f"{t}: {r['one_call_ms']:.1f} against {r['python_ms']:.1f} ms, {_fmt(r['ratio'])}"
                          for t, r in c.items()))
    if "attention" in sections:
        cache_dtype = loaded.model.kv_cache_dtype or loaded.model.dtype
        att = bench_attention(loaded.model.config, args.repeats, cache_dtype)
        result["attention"] = att
        keys = list(att[0]["ms"]) if att else []
        print(f"\nattention, one layer ({loaded.model.config.num_heads} heads, {loaded.model.config.num_kv_heads} KV heads, "
              f"head dim {loaded.model.config.head_dim}): ms per call on each path, median (min-max):")
        print("| cached | positions | " + " | ".join(keys) + f" | x {loaded.model.config.num_layers} layers "
              f"({str(cache_dtype).removeprefix('torch.')} cache) |")
        print("|---" * (3 + len(keys)) + "|")
        for r in att:
            print(f"| {r['cached']} | {r['positions']} | " + " | ".join(
                f"{r['ms'][k][0]:.3f} ({r['ms'][k][1]:.3f}-{r['ms'][k][2]:.3f})" for k in keys) + f" | {r['model_ms']:.1f} |")
    if "llama" in sections:
        from verispec.models.registry import fetch

        path = args.model if str(args.model).endswith(".gguf") else fetch(args.model, progress=False)
        lm = bench_llama(loaded, path, args.threads, args.repeats)
        result["llama"] = lm
        if lm is None:
            print("\nllama.cpp: skipped (pip install llama-cpp-python to compare)")
        else:
            print(f"\nllama.cpp (llama-cpp-python {lm['llama_cpp_python']}), same file and threads; "
                  "verispec speed relative to llama.cpp (> 1 is faster):")
            print(f"  (one OpenMP runtime serves both here: {omp_policy()}")
            for what in ("step", "pass 9", "prefill 700", "generate 64"):
                r = lm[what]
                print(f"  {what}: verispec {r['verispec_s'] * 1e3:.1f} ms, llama.cpp {r['llama_s'] * 1e3:.1f} ms, "
                      f"speed {_fmt(r['speed_vs_llama'])}")
            print(f"  llama.cpp's own 9-position pass / decode step: {_fmt(lm['llama_pass9_over_step'])}; "
                  f"greedy outputs agree on their first {lm['same_greedy_tokens']} tokens")
    print(json.dumps(result, default=str))
    return 0


