"""``verispec`` command line: generate text, manage bundled models.

    verispec generate MODEL "prompt" [sampling flags] [speculative flags] [--stats]
    verispec serve MODEL [speculative flags] [--host H] [--port P] [--api-key KEY] ...
    verispec models list | fetch NAME

MODEL is a bundled name (``verispec models list``), a local Hugging Face directory or a
``.gguf`` file. Speculative flags follow vLLM: ``--speculative-config JSON`` or the shorthands
``--speculative-model``, ``--num-speculative-tokens`` and ``--speculative-method``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from verispec.config import SamplingParams, SpeculativeConfig

DEFAULT_DEMO_DRAFT = "qwen2.5-coder-0.5b-instruct"


def _add_generate(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser(
        "generate",
        help="generate text from a prompt (streams to stdout)",
        description="Generate text from a prompt, optionally with speculative decoding. Text "
        "streams to stdout; throughput and statistics go to stderr.",
    )
    g.add_argument("model", help="bundled model name, HF model directory or .gguf file")
    g.add_argument("prompt", help="the prompt (a user message when --chat is on)")
    chat = g.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="apply the model's chat template (default: on when the model has one)")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="use the prompt as raw text")
    g.add_argument("--system", default=None, help="system message for --chat")
    g.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 disables")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    g.add_argument("--dtype", default="auto", help="auto, bfloat16, float32 or float16 (default auto)")
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--max-model-len", type=int, default=4096, help="KV cache length in tokens (default 4096)")
    _add_speculative_flags(g)
    g.add_argument("--stats", action="store_true", help="print acceptance statistics and timings (stderr)")
    g.add_argument("--compare-plain", action="store_true",
                   help="also run plain decoding on the same prompt and report the speedup and "
                   "whether the outputs are identical")


def speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    """Merge ``--speculative-config`` with the shorthand flags (the shorthands win)."""
    data: dict = {}
    if args.speculative_config:
        try:
            data = json.loads(args.speculative_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("--speculative-config must be a JSON object")
    if args.speculative_model is not None:
        data["model"] = args.speculative_model
    if args.num_speculative_tokens is not None:
        data["num_speculative_tokens"] = args.num_speculative_tokens
    if args.speculative_method is not None:
        data["method"] = args.speculative_method
    if not data:
        return None
    return SpeculativeConfig.from_dict(data)


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from verispec.engine.engine import Engine
    from verispec.models.loader import load_model
    from verispec.spec.base import check_method

    # Validate everything cheap before loading gigabytes.
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        max_tokens=args.max_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos, seed=args.seed,
    )
    spec = speculative_config_from_args(args)
    if spec is not None:
        check_method(spec.method)
    if not args.prompt:
        raise ValueError("the prompt is empty")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    target = load_model(args.model, device=args.device, dtype=args.dtype)
    use_chat = target.tokenizer.has_chat_template if args.chat is None else args.chat
    if use_chat:
        prompt_ids = target.tokenizer.apply_chat_template(args.prompt, system=args.system)
    else:
        prompt_ids = target.tokenizer.encode(args.prompt)
    engine = Engine(target, spec, max_model_len=args.max_model_len)

    def stream(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    t0 = time.perf_counter()
    seq = engine.generate(prompt_ids, params, on_text=stream)
    elapsed = time.perf_counter() - t0
    sys.stdout.write("\n")
    n = len(seq.output_ids)
    decode_s = elapsed - seq.metrics.prefill_time_s
    print(
        f"[{n} tokens in {elapsed:.2f}s: {n / elapsed:.2f} tokens/s overall, "
        f"{max(n - 1, 0) / max(decode_s, 1e-9):.2f} tokens/s after prefill; finish: {seq.finish_reason}]",
        file=sys.stderr,
    )
    t1 = None
    if args.compare_plain:
        plain_engine = Engine(target, None, max_model_len=args.max_model_len)
        t_start = time.perf_counter()
        plain = plain_engine.generate(prompt_ids, params)
        plain_s = time.perf_counter() - t_start
        t1 = plain.metrics.target_step_time(1)
        plain_decode_s = plain_s - plain.metrics.prefill_time_s
        speedup = (plain_decode_s / max(len(plain.output_ids) - 1, 1)) / (decode_s / max(n - 1, 1))
        same = "identical to" if plain.output_ids == seq.output_ids else "DIFFERENT from"
        print(
            f"[plain decoding: {len(plain.output_ids)} tokens in {plain_s:.2f}s; speedup after "
            f"prefill {speedup:.2f}x; output {same} plain decoding]",
            file=sys.stderr,
        )
    if args.stats or args.compare_plain:
        print(seq.metrics.format(t1), file=sys.stderr)
    return 0


def _add_speculative_flags(parser: argparse.ArgumentParser) -> None:
    spec = parser.add_argument_group("speculative decoding (vLLM-compatible)")
    spec.add_argument("--speculative-config", default=None, metavar="JSON",
                      help='e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'')
    spec.add_argument("--speculative-model", default=None, help="draft model (implies method draft_model)")
    spec.add_argument("--num-speculative-tokens", type=int, default=None, help="k, drafts per round")
    spec.add_argument("--speculative-method", default=None, help="draft_model or ngram")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible API with continuous batching",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics.",
    )
    s.add_argument("model", help="bundled model name, HF model directory or .gguf file")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, local only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    s.add_argument("--served-model-name", default=None, help="model id clients use (default: MODEL)")
    s.add_argument("--max-num-seqs", type=int, default=8, help="sequences decoded together (default 8)")
    s.add_argument("--max-model-len", type=int, default=4096, help="prompt + output tokens per sequence")
    s.add_argument("--max-queue", type=int, default=64, help="waiting requests before answering 429")
    s.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    s.add_argument("--dtype", default="auto", help="auto, bfloat16, float32 or float16 (default auto)")
    s.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    _add_speculative_flags(s)


def cmd_serve(args: argparse.Namespace) -> int:
    import torch

    from verispec.server.serve import serve
    from verispec.spec.base import check_method

    spec = speculative_config_from_args(args)
    if spec is not None:
        check_method(spec.method)
    for name in ("max_num_seqs", "max_model_len", "max_queue"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    serve(args.model, spec, host=args.host, port=args.port, api_key=args.api_key,
          served_model_name=args.served_model_name, max_num_seqs=args.max_num_seqs,
          max_model_len=args.max_model_len, max_queue=args.max_queue, device=args.device, dtype=args.dtype)
    return 0


def _add_models(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("models", help="list or fetch the bundled models")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    msub.add_parser("list", help="list bundled models and whether they are fetched")
    f = msub.add_parser("fetch", help="download, verify and cache a bundled model")
    f.add_argument("name")
    f.add_argument("--force", action="store_true", help="fetch again even if cached")


def cmd_models(args: argparse.Namespace) -> int:
    from verispec.models.registry import BUNDLED_MODELS, bundled_path, fetch, is_fetched

    if args.models_cmd == "list":
        for name, m in BUNDLED_MODELS.items():
            state = f"fetched: {bundled_path(name)}" if is_fetched(name) else "not fetched"
            print(f"{name:32s} {m.size_hint:>8s}  {m.description}  [{state}]")
        return 0
    print(fetch(args.name, force=args.force))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verispec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_models(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"generate": cmd_generate, "serve": cmd_serve, "models": cmd_models}
    try:
        return handlers[args.command](args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"verispec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nverispec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
