"""``verispec`` command line: generate text, manage bundled models.

    verispec generate MODEL "prompt" [sampling flags] [speculative flags] [--stats]
    verispec plan --acceptance P --alpha A [--draft-cost C] [--measure MODEL [--draft MODEL]]
    verispec serve MODEL [speculative flags] [--host H] [--port P] [--api-key-file PATH] ...
    verispec models list | fetch NAME | inspect MODEL [--context N]
    verispec train-drafter --target MODEL --method medusa|eagle --data FILE --out DIR [--resume]
    verispec bench --model MODEL --methods plain,ngram,... [--questions spec-bench|code-edit|FILE]
    verispec bench PRESET [options]      (verispec bench --help lists the presets)

MODEL is a bundled name (``verispec models list``), a local Hugging Face directory or a
``.gguf`` file. Speculative flags follow vLLM: ``--speculative-config JSON`` or the shorthands
``--speculative-model``, ``--num-speculative-tokens`` and ``--speculative-method``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from verispec.bench import cli as bench_cli
from verispec.bench.presets import PRESETS, run_preset
from verispec.config import DEFAULT_SPECULATIVE, MAX_REQUEST_BYTES, SamplingParams, SpeculativeConfig, TrainSettings

# The commands import what they run (torch, the models, the server) inside their functions, so
# that ``verispec --help`` and argument errors answer without loading any of it.

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
    g.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2] (OpenAI's)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2] (OpenAI's)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0, 1 disables (vLLM's)")
    g.add_argument("--min-tokens", type=int, default=0, help="hold EOS back until this many tokens (vLLM's)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    g.add_argument("--dtype", default="auto", help="auto, bfloat16, float32 or float16 (default auto)")
    g.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: the physical cores this process may use)")
    g.add_argument("--quantization", default="auto", choices=("auto", "none", "gguf", "int8", "int4"),
                   help="the target's linear layers: gguf runs a GGUF file's own quantized weights on "
                   "the native CPU kernels, none dequantizes them, int8/int4 quantize dense weights to "
                   "GGUF's Q8_0/Q4_1 on the same kernels (int4 groups of 64 or 128, or no compiler: "
                   "PyTorch's packed kernels); auto (default) is gguf for a GGUF file on the CPU, else "
                   "none. The draft's is set by the speculative config's 'quantization'")
    g.add_argument("--quantization-group-size", type=int, default=32, choices=(32, 64, 128),
                   help="int4 group size (default 32)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float32", "float16"),
                   help="the KV cache's dtype: auto (default) is float16 for a model on the native CPU "
                   "kernels with float32 activations, else the model's dtype")
    g.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="torch.compile the target's decode/verify steps (default off: on CPUs "
                   "without native bf16 it is slower and each shape bucket compiles for tens of seconds)")
    g.add_argument("--max-model-len", type=int, default=4096, help="KV cache length in tokens (default 4096)")
    _add_speculative_flags(g)
    g.add_argument("--stats", action="store_true", help="print acceptance statistics and timings (stderr)")
    g.add_argument("--compare-plain", action="store_true",
                   help="also run plain decoding on the same prompt and report the speedup and "
                   "whether the outputs are identical")


def speculative_config_from_args(args: argparse.Namespace) -> SpeculativeConfig | None:
    """Merge ``--speculative-config`` with the shorthand flags (the shorthands win). Where nothing
    names a method or a draft model, :data:`DEFAULT_SPECULATIVE` fills in (so no flag at all
    means suffix decoding); with ``--no-speculation``, None (plain). A
    draft model given without a method runs with suffix decoding first (the hybrid,
    :mod:`verispec.speculative.hybrid`) unless the config says ``enable_suffix_decoding``."""
    given = [flag for flag, value in (("--speculative-config", args.speculative_config),
                                      ("--speculative-model", args.speculative_model),
                                      ("--num-speculative-tokens", args.num_speculative_tokens),
                                      ("--speculative-method", args.speculative_method),
                                      ("--adaptive/--no-adaptive", args.adaptive)) if value is not None]
    if args.no_speculation:
        if given:
            raise ValueError(f"--no-speculation cannot be combined with {', '.join(given)}")
        return None
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
    if args.adaptive is not None:
        data["adaptive"] = args.adaptive
    if "method" not in data and not data.get("model"):  # nothing says what drafts: the default does
        data = {**DEFAULT_SPECULATIVE, **data}
    if data.get("model") is not None and data.get("method", "draft_model") == "draft_model":
        data.setdefault("enable_suffix_decoding", True)
    return SpeculativeConfig.from_dict(data)


def cmd_generate(args: argparse.Namespace) -> int:
    from verispec.engine.engine import Engine
    from verispec.models.compile import compile_decoder
    from verispec.models.loader import load_model
    from verispec.runtime import set_threads
    from verispec.speculative.registry import check_method

    # Validate everything cheap before loading gigabytes.
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        max_tokens=args.max_tokens, stop=tuple(args.stop), ignore_eos=args.ignore_eos, seed=args.seed,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, min_tokens=args.min_tokens,
    )
    spec = speculative_config_from_args(args)
    if spec is not None:
        check_method(spec.method)
    if not args.prompt:
        raise ValueError("the prompt is empty")
    set_threads(args.threads)

    target = load_model(args.model, device=args.device, dtype=args.dtype, quantization=args.quantization,
                        group_size=args.quantization_group_size, kv_cache_dtype=args.kv_cache_dtype)
    if args.compile:
        compile_decoder(target.model)
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


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="expected speculative speedup for each number of drafts N",
        description="Tabulate E[tokens per round] / (N*c + 1 + alpha*N) for N = 0..--max-n, name "
        "the best N and the 1/alpha ceiling. --measure times this machine for alpha and c.",
    )
    rates = p.add_mutually_exclusive_group()
    rates.add_argument("--acceptance", type=float, default=None, help="acceptance rate p of every draft")
    rates.add_argument("--per-position", default=None, metavar="P1,P2,...",
                       help="conditional acceptance of draft 1, 2, ... (the last repeats)")
    p.add_argument("--draft-cost", type=float, default=None,
                   help="c: cost of drafting one token over one target decode step (default 0)")
    p.add_argument("--alpha", type=float, default=None, help="verify overhead per extra position")
    p.add_argument("--batch-size", type=int, default=1, help="requests decoded together (default 1)")
    p.add_argument("--max-n", type=int, default=12, help="largest N to tabulate (default 12)")
    p.add_argument("--measure", default=None, metavar="MODEL", help="time this target to fill --alpha")
    p.add_argument("--draft", default=None, metavar="MODEL", help="with --measure: time this draft for c")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="draw speedup against N for several p")


def _plan_acceptance(args: argparse.Namespace) -> list[float]:
    if args.per_position is not None:
        try:
            return [float(x) for x in args.per_position.split(",")]
        except ValueError:
            raise ValueError(f"--per-position must be comma-separated numbers, got {args.per_position!r}") from None
    if args.acceptance is None:
        raise ValueError("give --acceptance P or --per-position P1,P2,...")
    return [args.acceptance]


def cmd_plan(args: argparse.Namespace) -> int:
    from pathlib import Path

    from verispec.plan import format_plan, make_plan, measure, plot_plan

    acceptance = _plan_acceptance(args)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.draft and not args.measure:
        raise ValueError("--draft needs --measure MODEL")
    alpha, c, batch = args.alpha, args.draft_cost, args.batch_size
    if args.measure:
        import torch

        from verispec.models.loader import load_model

        if args.threads is not None:
            torch.set_num_threads(args.threads)
        target = load_model(args.measure, device=args.device, dtype=args.dtype)
        draft = load_model(args.draft, device=args.device, dtype=args.dtype) if args.draft else None
        alpha, measured_c, raw = measure(target.model, draft.model if draft else None, batch)
        c = measured_c if measured_c is not None else c
        times = ", ".join(f"{n}: {t * 1e3:.1f}" for n, t in raw["target_s"].items())
        print(f"measured {args.measure} at batch {batch}: T_target(n) ms {{{times}}}; alpha = {alpha:.3f}")
        if raw["draft_s"] is not None:
            print(f"measured {args.draft}: T_draft(1) {raw['draft_s'] * 1e3:.1f} ms; c = {c:.3f}")
        batch = 1  # the measured figures already are those of the batch
    if alpha is None:
        raise ValueError("give --alpha A or --measure MODEL")
    plan = make_plan(acceptance, c or 0.0, alpha, args.max_n, batch)
    print(format_plan(plan))
    if args.plot:
        plot_plan(plan, Path(args.plot))
        print(f"plot written to {args.plot}")
    return 0


def _add_speculative_flags(parser: argparse.ArgumentParser) -> None:
    spec = parser.add_argument_group("speculative decoding (vLLM-compatible)")
    spec.add_argument("--speculative-config", default=None, metavar="JSON",
                      help='e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'')
    spec.add_argument("--speculative-model", default=None, help="draft model (implies method draft_model)")
    spec.add_argument("--num-speculative-tokens", type=int, default=None, help="k, drafts per round")
    spec.add_argument("--speculative-method", default=None, help="draft_model, ngram, suffix or lookahead")
    spec.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=None,
                      help="choose k each round from measured costs, up to --num-speculative-tokens "
                      "(default on); --no-adaptive drafts exactly that many every round")
    spec.add_argument("--no-speculation", action="store_true",
                      help="plain decoding (default without other speculative flags: suffix decoding under "
                      "the adaptive controller, which drafts only where it pays; outputs are identical "
                      "either way)")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible API with continuous batching",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics.",
    )
    s.add_argument("model", help="bundled model name, HF model directory or .gguf file")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, local only)")
    s.add_argument("--port", type=int, default=8000)
    key = s.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1 routes (visible to other users in "
                     "the process list: prefer --api-key-file or the VERISPEC_API_KEY variable)")
    key.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="read the API key from this file (surrounding whitespace is dropped)")
    s.add_argument("--api-key-for-metrics-and-docs", action="store_true",
                   help="require the API key on /metrics, /docs, /redoc and /openapi.json too (default: "
                   "only on /v1 routes, as vLLM; /health is always open, for liveness probes)")
    s.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                   help="largest request body accepted on /v1 routes; larger ones get 413 (default 4 MiB)")
    s.add_argument("--served-model-name", default=None, help="model id clients use (default: MODEL)")
    s.add_argument("--max-num-seqs", type=int, default=8, help="sequences decoded together (default 8)")
    s.add_argument("--max-model-len", type=int, default=4096, help="prompt + output tokens per sequence")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse a finished request's K/V for the next prompt that starts with the same tokens "
                   "(exact; default: on where that costs nothing, a model on the native CPU kernels without "
                   "dense bf16 prefill copies)")
    s.add_argument("--max-queue", type=int, default=64, help="waiting requests before answering 429")
    s.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds from a request's arrival to its last token; past it the request ends "
                   "with 504 (0: no limit; default 600)")
    s.add_argument("--max-step-time", type=float, default=120.0,
                   help="seconds one engine step (a whole prompt's prefill included) may run before /health "
                   "answers 503 (0: never; default 120)")
    s.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request's headers, from its opening or its "
                   "last response; then it is closed (default 10)")
    s.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a /v1 request's body may take to arrive after its headers; then 408 (default 30)")
    s.add_argument("--limit-concurrency", type=int, default=512,
                   help="open connections and requests past which new ones get 503 (0: no limit; default 512)")
    s.add_argument("--exit-on-fatal", action="store_true",
                   help="exit with status 1 if the engine thread dies, for a supervisor to restart the "
                   "process (default: stay up, answer 503 and report it on /health)")
    s.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    s.add_argument("--dtype", default="auto", help="auto, bfloat16, float32 or float16 (default auto)")
    s.add_argument("--quantization", default="auto", choices=("auto", "none", "gguf", "int8", "int4"),
                   help="the target's linear layers, as for generate (default auto: a GGUF file's own "
                   "quantized weights on the native CPU kernels, anything else dense)")
    s.add_argument("--quantization-group-size", type=int, default=32, choices=(32, 64, 128),
                   help="int4 group size (default 32)")
    s.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float32", "float16"),
                   help="the KV cache's dtype: auto (default) is float16 for a model on the native CPU "
                   "kernels with float32 activations, else the model's dtype")
    s.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; with --replicas, per replica: "
                   "--replica-cpus)")
    scale = s.add_argument_group("scaling out on Ray Serve (needs verispec[ray]; docs/scaling.md)")
    scale.add_argument("--replicas", type=int, default=None,
                       help="run N engine replicas behind one endpoint on Ray Serve (a local Ray "
                       "instance unless --ray-address)")
    scale.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas (default 1)")
    scale.add_argument("--max-replicas", type=int, default=None,
                       help="autoscaling: most replicas; turns autoscaling on")
    scale.add_argument("--target-ongoing-requests", type=float, default=4.0,
                       help="autoscaling: requests per replica it aims for (default 4)")
    scale.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs each replica reserves (default 1)")
    scale.add_argument("--replica-gpus", type=float, default=None,
                       help="GPUs each replica reserves (default: 1 with a cuda --device, else 0)")
    scale.add_argument("--ray-address", default=None,
                       help="join this Ray cluster (e.g. auto, or ray://HEAD:10001) instead of starting one")
    _add_speculative_flags(s)


def api_key_from_args(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> str | None:
    """The serve key: ``--api-key``, else ``--api-key-file``'s content, else ``$VERISPEC_API_KEY``
    (unset or empty: no key)."""
    if args.api_key is not None:
        key = args.api_key
    elif args.api_key_file is not None:
        key = Path(args.api_key_file).read_text().strip()
        if not key:
            raise ValueError(f"--api-key-file {args.api_key_file} is empty")
    else:
        return environ.get("VERISPEC_API_KEY") or None
    if not key:
        raise ValueError("--api-key is empty")
    return key


# The serve flags not named after their ServerConfig / ScaleOutConfig field.
_SERVE_FLAGS = {"model": "MODEL", "request_timeout_s": "--request-timeout", "num_replicas": "--replicas",
                "num_cpus": "--replica-cpus", "num_gpus": "--replica-gpus", "max_step_s": "--max-step-time",
                "header_timeout_s": "--header-timeout", "body_timeout_s": "--body-timeout"}


def server_settings_from_args(args: argparse.Namespace) -> dict:
    """The :class:`~verispec.server.config.ServerConfig` fields that ``verispec serve``'s flags set,
    one field a flag (the API key as :func:`api_key_from_args` finds it)."""
    for flag, value in (("--request-timeout", args.request_timeout), ("--max-step-time", args.max_step_time),
                        ("--limit-concurrency", args.limit_concurrency)):
        if value < 0:
            raise ValueError(f"{flag} must be >= 0 (0: no limit)")
    return dict(
        model=args.model, speculative_config=speculative_config_from_args(args), device=args.device,
        dtype=args.dtype, quantization=args.quantization, quantization_group_size=args.quantization_group_size,
        kv_cache_dtype=args.kv_cache_dtype, threads=args.threads, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
        served_model_name=args.served_model_name, api_key=api_key_from_args(args),
        api_key_for_metrics_and_docs=args.api_key_for_metrics_and_docs, max_queue=args.max_queue,
        max_request_bytes=args.max_request_bytes, request_timeout_s=args.request_timeout or None,
        max_step_s=args.max_step_time or None, header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout, limit_concurrency=args.limit_concurrency or None,
        exit_on_fatal=args.exit_on_fatal, host=args.host, port=args.port)


def _serve_config(cls: type, settings: dict):
    """``cls(**settings)``; a bad setting is a ValueError that names its flag."""
    from pydantic import ValidationError

    from verispec.server.config import describe

    try:
        return cls(**settings)
    except ValidationError as e:
        flags = {name: _SERVE_FLAGS.get(name, "--" + name.replace("_", "-")) for name in cls.model_fields}
        raise ValueError(f"invalid serve settings: {describe(e, flags)}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    from verispec.server.config import ServerConfig
    from verispec.server.serve import serve

    settings = server_settings_from_args(args)
    if args.replicas is not None or args.max_replicas is not None or args.ray_address is not None:
        return _serve_replicated(args, settings)
    serve(_serve_config(ServerConfig, settings))
    return 0


def _serve_replicated(args: argparse.Namespace, settings: dict) -> int:
    """``verispec serve --replicas``: the same server as N replicas on Ray Serve."""
    if args.exit_on_fatal:
        raise ValueError("--exit-on-fatal is for a single server: with --replicas, Serve replaces a "
                         "replica whose engine died")
    try:
        from verispec.server import ray_serve
    except ImportError as e:
        raise ValueError(f"--replicas needs Ray Serve, which is not installed ({e}): "
                         "pip install 'verispec[ray]'") from None
    from verispec.models.registry import resolve_model
    from verispec.server.serve import warn_if_exposed

    if args.replicas is not None and args.replicas < 1:
        raise ValueError("--replicas must be >= 1")

    gpus = args.replica_gpus if args.replica_gpus is not None else float(args.device.startswith("cuda"))
    config = _serve_config(ray_serve.ScaleOutConfig, {
        **settings, "num_replicas": args.replicas or 1, "min_replicas": args.min_replicas,
        "max_replicas": args.max_replicas, "target_ongoing_requests": args.target_ongoing_requests,
        "num_cpus": args.replica_cpus, "num_gpus": gpus})
    if args.ray_address is None:  # local replicas: fetch a bundled model once, before they start
        resolve_model(args.model)
    warn_if_exposed(config.host, config.resolved_api_key())
    ray_serve.run(config, ray_address=args.ray_address)
    return 0


def _add_train_drafter(sub: argparse._SubParsersAction) -> None:
    d = TrainSettings()
    t = sub.add_parser(
        "train-drafter",
        help="train speculative heads (Medusa, EAGLE-3) on a target's own answers and features",
        description="Train Medusa heads or an EAGLE-3 head for a target (the target frozen). --data is JSONL of "
        '{"prompt": ...}, {"messages": [...]} (answered by the target itself) or {"text": ...}, or a '
        "plain text or code file. Rows and features are cached in --out; checkpoints go there "
        "every --save-every steps, and the heads (Medusa: FasterDecoding layout; EAGLE-3: vLLM's "
        'speculators layout), for --speculative-config \'{"method": "medusa" or "eagle", "model": OUT}\'. Held-out acceptance is printed '
        "every --eval-every steps.",
    )
    t.add_argument("--target", required=True, help="bundled model name, HF model directory or .gguf file")
    t.add_argument("--method", required=True, choices=("medusa", "eagle"), help="the kind of heads")
    t.add_argument("--data", required=True, type=Path, help="training data (see above)")
    t.add_argument("--out", required=True, type=Path, help="directory for caches, checkpoints and the heads")
    t.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    for name, help_text in (("num_heads", "heads, each one token further ahead"),
                            ("num_layers", "ResBlocks per head"), ("steps", "optimizer steps"),
                            ("batch_size", "rows per step"), ("seq_len", "tokens per row"),
                            ("max_new_tokens", "tokens of the target's answer per prompt"),
                            ("eval_every", "steps between held-out reports"),
                            ("save_every", "steps between checkpoints"), ("seed", "random seed"),
                            ("ttt_steps", "eagle: steps the training-time test unrolls"),
                            ("draft_vocab_size", "draft vocabulary: the data's most frequent tokens"),
                            ("intermediate_size", "eagle: the head's MLP width, 0 for the target's")):
        t.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name),
                       help=f"{help_text} (default {getattr(d, name)})")
    t.add_argument("--lr", type=float, default=d.lr, help=f"learning rate (default {d.lr})")
    t.add_argument("--warmup-steps", type=int, default=d.warmup_steps,
                   help=f"steps over which the learning rate rises linearly to --lr (default {d.warmup_steps})")
    t.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm,
                   help=f"clip gradients to this norm, 0 for no clipping (default {d.max_grad_norm})")
    t.add_argument("--train-rows", type=int, default=d.train_rows,
                   help="train on this many rows of the training split only, the held-out rows unchanged "
                   "(a learning curve against the data; default all)")
    t.add_argument("--held-out", type=float, default=d.held_out,
                   help=f"fraction of rows never trained on, for the acceptance reports (default {d.held_out})")
    t.add_argument("--own-lm-heads", action="store_true",
                   help="give each head its own LM head (vocab x hidden each) instead of the target's")
    t.add_argument("--quantization", default="auto", choices=("auto", "none", "gguf", "int8", "int4"),
                   help="the target's weights, as for generate (default auto: a GGUF's own on the native "
                   "kernels); heads are trained on the features the target computes this way")
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the physical cores)")


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from verispec.runtime import set_threads
    from verispec.train.drafter import run

    settings = TrainSettings(num_heads=args.num_heads, num_layers=args.num_layers, steps=args.steps,
                             batch_size=args.batch_size, lr=args.lr, seq_len=args.seq_len,
                             max_new_tokens=args.max_new_tokens, held_out=args.held_out,
                             eval_every=args.eval_every, save_every=args.save_every, seed=args.seed,
                             own_lm_heads=args.own_lm_heads, ttt_steps=args.ttt_steps,
                             draft_vocab_size=args.draft_vocab_size, intermediate_size=args.intermediate_size,
                             warmup_steps=args.warmup_steps, max_grad_norm=args.max_grad_norm,
                             train_rows=args.train_rows)
    set_threads(args.threads)
    reports = run(args.target, args.method, args.data, args.out, settings, resume=args.resume,
                  quantization=args.quantization)
    print(f"heads written to {args.out}; held-out mean acceptance length {reports[0].mean_acceptance_length:.2f} "
          f"untrained -> {reports[-1].mean_acceptance_length:.2f} at step {reports[-1].step}")
    return 0


def _add_models(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("models", help="list, fetch or inspect models")
    msub = m.add_subparsers(dest="models_cmd", required=True)
    msub.add_parser("list", help="list bundled models and whether they are fetched")
    f = msub.add_parser("fetch", help="download, verify and cache a bundled model")
    f.add_argument("name")
    f.add_argument("--force", action="store_true", help="fetch again even if cached")
    i = msub.add_parser("inspect", help="a GGUF file's architecture, tensor types, which kernels run each "
                        "and the memory a load takes (from the header; nothing is converted)")
    i.add_argument("model", help="a .gguf file or a bundled model name (fetched if needed)")
    i.add_argument("--context", type=int, default=None,
                   help="tokens of KV cache to count (default: the file's context, at most 4096)")


def cmd_models(args: argparse.Namespace) -> int:
    from verispec.models.registry import BUNDLED_MODELS, bundled_path, fetch, is_fetched

    if args.models_cmd == "list":
        for name, m in BUNDLED_MODELS.items():
            state = f"fetched: {bundled_path(name)}" if is_fetched(name) else "not fetched"
            print(f"{name:32s} {m.size_hint:>8s}  {m.description}  [{state}]")
        return 0
    if args.models_cmd == "inspect":
        from verispec.models.inspect import format_inspection, inspect_gguf
        from verispec.models.registry import resolve_model

        if args.context is not None and args.context <= 0:
            raise ValueError(f"--context must be a positive number of tokens, got {args.context}")
        path = resolve_model(args.model)
        if path.is_dir():
            raise ValueError(f"{path} is a Hugging Face directory; `models inspect` reads GGUF files")
        print(format_inspection(inspect_gguf(path), args.context))
        return 0
    print(fetch(args.name, force=args.force))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verispec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_plan(sub)
    _add_serve(sub)
    _add_models(sub)
    _add_train_drafter(sub)
    bench_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in PRESETS:
        # a preset parses its own options: verispec bench NAME [options]
        def handler(_: argparse.Namespace) -> int:
            return run_preset(argv[1], argv[2:])
        args = None
    else:
        args = build_parser().parse_args(argv)
        handlers = {"generate": cmd_generate, "serve": cmd_serve, "plan": cmd_plan, "models": cmd_models,
                    "bench": bench_cli.cmd_bench, "train-drafter": cmd_train_drafter}
        handler = handlers[args.command]
    try:
        return handler(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"verispec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nverispec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
