"""Any GGUF file against llama.cpp on the same file: decode speed, exactness and footprint.

``--files`` names the GGUF files (or bundled names), ``--synthetic`` shapes of real models to
write as random-weight Q4_K_M files (``llama-8b``: a model past these machines' usual size;
values do not change speed or memory); ``--llama-bin`` the directory holding
llama.cpp's ``llama-bench`` and ``llama-completion`` (or ``llama-cli``), built from the sources
in the llama-cpp-python source distribution as the README shows for ``llama-server``.
Sections (``--sections``):

* ``speed`` -- per file, in rounds that alternate the two engines (so drift hits both alike):
  verispec's plain greedy decode rate (``--max-tokens`` tokens from a chat prompt, ignoring EOS;
  decode tokens/s after the first token, on the native kernels) against ``llama-bench -p 0 -n
  N -t T`` (its token-generation rate). The ratio is reported per round, with its median and
  spread. Exactness on the same file: greedy output with the suffix drafter under the adaptive
  controller (the default speculative set-up) must be token-identical to plain decoding.
* ``footprint`` -- per file, whole commands in fresh processes, generating one token from the
  same prompt at ``--context`` tokens of context: peak resident memory (the child's
  ``ru_maxrss``), a first load (verispec with an empty ``$VERISPEC_HOME``, so every cache it
  writes is new; the compiled kernels are shared, as after an install) and a warm start (the
  same command again), against ``llama-completion`` on the same file, context and threads; and
  the disk a first load wrote beside the file, against the file's size.

A file whose architecture or types verispec does not run is reported as such (the reason
``verispec models inspect`` gives), not skipped silently.

    verispec bench gguf --files q4_0.gguf,q5_k_m.gguf --llama-bin llama-build/bin --out gguf.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from verispec.bench.machine import log, machine_info, machine_load
from verispec.bench.presets.common import PresetParser, emit_report

SECTIONS = ("speed", "footprint")
PROMPT = "Write a Python function that checks whether a string is a palindrome, with tests."
_LLAMA_GENERATORS = ("llama-completion", "llama-cli")


def parse_args(argv: list[str] | None) -> Any:
    p = PresetParser("gguf", __doc__.splitlines()[0], threads=2, max_tokens=64, repeats=3, out=None)
    p.add_argument("--files", default="", help="comma list of GGUF files or bundled model names")
    p.add_argument("--synthetic", default="", metavar="SHAPES",
                   help=f"also write and run random-weight Q4_K_M files of these shapes ({', '.join(SHAPES)}), "
                        "into --synthetic-dir (once)")
    p.add_argument("--synthetic-dir", type=Path, default=Path("bench-out/synthetic"),
                   help="where synthetic files are written (default: bench-out/synthetic)")
    p.add_argument("--llama-bin", type=Path, required=True, help="directory of llama.cpp's built binaries")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list from {', '.join(SECTIONS)}")
    p.add_argument("--context", type=int, default=4096, help="context length of the footprint runs (default 4096)")
    args = p.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    bad = sorted(set(args.sections) - set(SECTIONS))
    if bad:
        p.error(f"unknown section(s) {', '.join(bad)}; choose from {', '.join(SECTIONS)}")
    args.synthetic = [x for x in args.synthetic.split(",") if x]
    bad = sorted(set(args.synthetic) - set(SHAPES))
    if bad:
        p.error(f"unknown synthetic shape(s) {', '.join(bad)}; choose from {', '.join(SHAPES)}")
    if not args.files and not args.synthetic:
        p.error("name --files, --synthetic or both")
    if args.context < 16:
        p.error(f"--context must be at least 16, got {args.context}")
    if not (args.llama_bin / "llama-bench").is_file():
        p.error(f"{args.llama_bin} holds no llama-bench binary")
    return args


def _llama_generator(bin_dir: Path) -> Path:
    for name in _LLAMA_GENERATORS:
        if (bin_dir / name).is_file():
            return bin_dir / name
    raise SystemExit(f"{bin_dir} holds none of {', '.join(_LLAMA_GENERATORS)} (the footprint section runs one)")


def _run(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 1800) -> dict:
    """Run ``cmd`` to its end: wall seconds, the child's peak resident memory, its output. The
    environment is ``env``, else the user's (:func:`foreign_env`: llama.cpp's OpenMP threads
    would run slower under the wait policy verispec sets for itself)."""
    from verispec.runtime import foreign_env

    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=foreign_env() if env is None else env)
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        out.seek(0)
        text = out.read().decode("utf-8", "replace")
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} ... exited with {proc.returncode}:\n{text[-2000:]}")
    return {"wall_s": wall, "max_rss_bytes": usage.ru_maxrss * 1024, "output": text}


# -------------------------------------------------------------------------------------- synthetic


# Shapes of real models for files with random weights (the speed and memory of a model depend on
# its shapes and types, not on its values): llama's layout, Q4_K_M's mix of types.
SHAPES = {
    "llama-8b": dict(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256, context=131072),
    "llama-3b": dict(layers=28, hidden=3072, ffn=8192, heads=24, kv_heads=8, vocab=128256, context=131072),
}


def _random_blocks(rng: Any, qtype: Any, rows: int, cols: int) -> Any:
    """Random blocks of ``qtype`` (Q4_K or Q6_K) with small finite fp16 scales: valid data."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    if qtype == GGMLQuantizationType.Q4_K:  # d, dmin at the block's start
        data[:, :, 0:4] = np.array([0.002, 0.001], dtype=np.float16).view(np.uint8)
    else:  # Q6_K: d at its end
        data[:, :, size - 2 : size] = np.array([0.0005], dtype=np.float16).view(np.uint8)
    return data.reshape(rows, -1)


def write_synthetic(path: Path, shape: str, seed: int = 0) -> Path:
    """A random-weight GGUF of ``SHAPES[shape]`` as llama.cpp's Q4_K_M writes it (Q4_K matrices;
    Q6_K for the output layer and, as in Q4_K_M, half the layers' attn_v and ffn_down), streamed
    to disk tensor by tensor. The vocabulary is byte-level tokens and fillers, so both engines
    tokenize and decode it."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
    from tokenizers.pre_tokenizers import ByteLevel

    if path.is_file():
        return path
    d = SHAPES[shape]
    head_dim = d["hidden"] // d["heads"]
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(ByteLevel.alphabet())
    tokens = specials + alphabet + ["Ġt"] + [f"x{i}" for i in range(d["vocab"] - len(specials) - len(alphabet) - 1)]
    q4, q6 = GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K
    tensors = [("token_embd.weight", q4, d["vocab"], d["hidden"]), ("output.weight", q6, d["vocab"], d["hidden"])]
    for i in range(d["layers"]):
        sensitive = q6 if i % 2 == 0 else q4
        tensors += [(f"blk.{i}.attn_q.weight", q4, d["hidden"], d["hidden"]),
                    (f"blk.{i}.attn_k.weight", q4, d["kv_heads"] * head_dim, d["hidden"]),
                    (f"blk.{i}.attn_v.weight", sensitive, d["kv_heads"] * head_dim, d["hidden"]),
                    (f"blk.{i}.attn_output.weight", q4, d["hidden"], d["hidden"]),
                    (f"blk.{i}.ffn_gate.weight", q4, d["ffn"], d["hidden"]),
                    (f"blk.{i}.ffn_up.weight", q4, d["ffn"], d["hidden"]),
                    (f"blk.{i}.ffn_down.weight", sensitive, d["hidden"], d["ffn"])]  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    writer = GGUFWriter(str(tmp), "llama")
    writer.add_name(f"synthetic {shape} (random weights)")
    writer.add_block_count(d["layers"])
    writer.add_context_length(d["context"])
    writer.add_embedding_length(d["hidden"])
    writer.add_feed_forward_length(d["ffn"])
    writer.add_head_count(d["heads"])
    writer.add_head_count_kv(d["kv_heads"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(15)  # MOSTLY_Q4_K_M
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(3)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    norms = [(f"blk.{i}.{n}.weight", d["hidden"]) for i in range(d["layers"]) for n in ("attn_norm", "ffn_norm")]
    norms.append(("output_norm.weight", d["hidden"]))
    for name, qtype, rows, cols in tensors:
        block, size = GGML_QUANT_SIZES[qtype]
        writer.add_tensor_info(name, (rows, cols // block * size), np.dtype(np.uint8), rows * cols // block * size,
                               raw_dtype=qtype)
    for name, n in norms:
        writer.add_tensor_info(name, (n,), np.dtype(np.float32), 4 * n)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, qtype, rows, cols in tensors:
        writer.write_tensor_data(_random_blocks(rng, qtype, rows, cols))
    for name, n in norms:
        writer.write_tensor_data(np.ones(n, dtype=np.float32))
    writer.close()
    tmp.replace(path)
    return path


# ---------------------------------------------------------------------------------------------- speed


def _llama_bench(bin_dir: Path, path: Path, n: int, threads: int) -> float:
    res = _run([str(bin_dir / "llama-bench"), "-m", str(path), "-p", "0", "-n", str(n), "-t", str(threads),
                "-r", "1", "-o", "json"])
    rows = json.loads(res["output"][res["output"].index("["):])
    return float(rows[0]["avg_ts"])


def speed(args: Any, path: Path) -> dict:
    import torch

    from verispec.bench.presets.decode import run_ours
    from verispec.config import SamplingParams, SpeculativeConfig
    from verispec.engine.engine import Engine
    from verispec.models.loader import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(str(path))
    prompt_ids = loaded.tokenizer.apply_chat_template(PROMPT)
    max_len = len(prompt_ids) + args.max_tokens + 8
    plain = Engine(loaded, None, max_model_len=max_len, prefix_caching=False)
    run_ours(plain, prompt_ids, 4)  # warm-up
    rounds = []
    for r in range(args.repeats):
        ours = run_ours(plain, prompt_ids, args.max_tokens)["decode_tok_s"]
        theirs = _llama_bench(args.llama_bin, path, args.max_tokens, args.threads)
        rounds.append({"verispec_tok_s": ours, "llama_tok_s": theirs, "ratio": ours / theirs})
        log(f"  round {r + 1}: verispec {ours:.2f} tok/s, llama.cpp {theirs:.2f} tok/s, {ours / theirs:.3f}x")
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    reference = list(plain.generate(prompt_ids, greedy).output_ids)
    spec = Engine(loaded, SpeculativeConfig(method="suffix", num_speculative_tokens=4), max_model_len=max_len,
                  prefix_caching=False)
    drafted = list(spec.generate(prompt_ids, greedy).output_ids)
    ratios = [r["ratio"] for r in rounds]
    return {"rounds": rounds, "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "speculative_identical": drafted == reference}


# ------------------------------------------------------------------------------------------ footprint


def _du(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def footprint(args: Any, path: Path) -> dict:
    from verispec.runtime import verispec_home

    llama = [str(_llama_generator(args.llama_bin)), "-m", str(path), "-p", PROMPT, "-n", "1", "-c",
             str(args.context), "-t", str(args.threads), "-no-cnv", "--temp", "0"]
    # plain decoding, as llama-completion's: a load is what is timed, not the speculative
    # controller's cost measurements at start
    ours = [sys.executable, "-m", "verispec.cli", "generate", str(path), PROMPT, "--max-tokens", "1",
            "--threads", str(args.threads), "--max-model-len", str(args.context), "--no-speculation"]
    kernels_dir = verispec_home() / "kernels"
    with tempfile.TemporaryDirectory(prefix="verispec-footprint-") as tmp:
        home = Path(tmp)
        if kernels_dir.is_dir():  # the compiled kernels, as after an install: not part of a load
            (home / "kernels").symlink_to(kernels_dir, target_is_directory=True)
        env = dict(os.environ, VERISPEC_HOME=str(home))
        first = _run(ours, env)
        disk = _du(home)
        warm = _run(ours, env)
    llama_runs = [_run(llama) for _ in range(2)]
    llama_warm = min(llama_runs, key=lambda r: r["wall_s"])
    file_bytes = path.stat().st_size
    rss = max(first["max_rss_bytes"], warm["max_rss_bytes"])
    return {
        "file_bytes": file_bytes, "context": args.context,
        "verispec": {"first_load_s": first["wall_s"], "warm_start_s": warm["wall_s"], "max_rss_bytes": rss,
                     "disk_bytes": disk},
        "llama": {"first_load_s": llama_runs[0]["wall_s"], "warm_start_s": llama_warm["wall_s"],
                  "max_rss_bytes": max(r["max_rss_bytes"] for r in llama_runs)},
        "rss_ratio": rss / max(r["max_rss_bytes"] for r in llama_runs),
        "disk_ratio": disk / file_bytes,
        "warm_ratio": warm["wall_s"] / llama_warm["wall_s"],
        "first_ratio": first["wall_s"] / llama_runs[0]["wall_s"],
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------- report


def print_table(report: dict) -> None:
    print(f"\nGGUF files against llama.cpp, {report['threads']} threads, CPU {report['machine'].get('cpu')}")
    for name, r in report["files"].items():
        print(f"\n{name} ({r['type_summary']})")
        if r.get("not_run"):
            print(f"  verispec does not run it: {r['not_run']}")
            continue
        s = r.get("speed")
        if s:
            rounds = ", ".join(f"{x['ratio']:.3f}" for x in s["rounds"])
            print(f"  decode: verispec / llama.cpp {s['ratio_median']:.3f}x (rounds {rounds}; "
                  f"{s['rounds'][-1]['verispec_tok_s']:.1f} vs {s['rounds'][-1]['llama_tok_s']:.1f} tok/s in the last)")
            print(f"  greedy speculative output identical to plain: {s['speculative_identical']}")
        f = r.get("footprint")
        if f:
            v, lc = f["verispec"], f["llama"]
            print(f"  peak RSS {v['max_rss_bytes'] / 1e9:.2f} GB vs {lc['max_rss_bytes'] / 1e9:.2f} GB "
                  f"({f['rss_ratio']:.2f}x) at {f['context']} tokens of context")
            print(f"  disk beside the file {v['disk_bytes'] / 1e9:.2f} GB, {f['disk_ratio']:.2f}x the file")
            print(f"  warm start {v['warm_start_s']:.2f} s vs {lc['warm_start_s']:.2f} s ({f['warm_ratio']:.2f}x); "
                  f"first load {v['first_load_s']:.2f} s vs {lc['first_load_s']:.2f} s ({f['first_ratio']:.2f}x)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from verispec.models.inspect import inspect_gguf
    from verispec.models.registry import resolve_model

    report: dict[str, Any] = {"threads": args.threads, "machine": machine_info(),
                              "load_at_start": machine_load(args.threads), "files": {}}
    files = [resolve_model(spec) for spec in args.files.split(",") if spec]
    for shape in args.synthetic:
        log(f"writing the synthetic {shape} file (once) ...")
        files.append(write_synthetic(args.synthetic_dir / f"synthetic-{shape}-q4_k_m.gguf", shape))
    for path in files:
        if not (path.is_file() and path.suffix.lower() == ".gguf"):
            raise SystemExit(f"--files takes GGUF files; {path} is not one")
        facts = inspect_gguf(path)
        entry: dict[str, Any] = {"path": str(path), "not_run": facts.runs, "dense_layers": facts.dense_layers,
                                 "type_summary": ", ".join(f"{t.type_name} x{t.tensors}" for t in facts.types)}
        report["files"][path.name] = entry
        if facts.runs is not None:
            log(f"{path.name}: verispec does not run it ({facts.runs})")
            continue
        if "speed" in args.sections:
            log(f"{path.name}: decode speed against llama-bench, {args.repeats} rounds ...")
            entry["speed"] = speed(args, path)
        if "footprint" in args.sections:
            log(f"{path.name}: footprint (first load, warm start, peak memory, disk) ...")
            entry["footprint"] = footprint(args, path)
    return emit_report(report, print_table, args.out)
