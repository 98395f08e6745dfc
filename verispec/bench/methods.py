"""Benchmark methods: parse ``--methods`` and build one runner per method.

Syntax, one method per comma-separated item::

    NAME[:ARG][@KEY=VALUE[,KEY=VALUE...]]

* verispec methods -- ``plain`` or any registered drafter (:func:`verispec.speculative.registry.available_methods`).
  ``ARG`` is the ``model`` field (``draft_model:qwen2.5-coder-0.5b-instruct``); each option is
  a :class:`~verispec.config.SpeculativeConfig` field, with ``k`` short for
  ``num_speculative_tokens`` (``ngram@k=6,prompt_lookup_max=3``). Nothing here names a
  drafter: a new drafter, or a new config field (e.g. ``adaptive=true``), works as soon as
  it is registered.
* ``hf:plain``, ``hf:assisted:DRAFT``, ``hf:prompt_lookup`` -- transformers ``generate`` on the
  same weights (the target's converted Hugging Face directory), with an assistant model or
  prompt lookup. Options are ``GenerationConfig`` fields; ``k`` is short for
  ``num_assistant_tokens`` / ``prompt_lookup_num_tokens``. Unset, transformers' defaults apply.
* ``llamacpp:plain``, ``llamacpp:prompt_lookup`` -- llama.cpp through llama-cpp-python (an
  optional package) on the GGUF file itself; ``k`` is short for ``num_pred_tokens``, and
  ``max_ngram_size`` is also accepted.
* ``openai:URL[@LABEL]`` -- a running OpenAI-compatible server (``llama-server`` with any
  ``--spec-type``, vLLM, another verispec) at ``URL`` (``http://host:port``), reported as
  ``openai:LABEL`` (default: the URL's host and port). Each turn is one streamed
  ``/v1/completions`` request whose prompt is the same token ids every other method gets (so
  the server's own chat template plays no part), at the same temperature, top-p and
  ``max_tokens``, with every other sampler off; the model is the first one the server lists. Prefill is the
  time to the first streamed text (TTFT). The server returns text, not ids: the output ids are
  the text re-tokenized by the target's tokenizer (plus its EOS when the server stopped there),
  which equals the generated ids wherever the text round-trips. The usage of the last chunk
  (``stream_options.include_usage``) gives the prompt tokens the server had cached, which the
  report checks against what the run itself sent (:func:`verispec.bench.report.stale_caches`).
  ``OPENAI_API_KEY`` is sent as the key if set.

Options continue after a comma until the next item that is not ``KEY=VALUE``; values are read
as JSON when they parse (``4``, ``true``) and as strings otherwise. ``plain`` is always run,
first: it is the baseline every speedup and equality check refers to.

Every runner returns a :class:`TurnResult` with the same timing split: *prefill* runs from the
call until the first generated token exists, the rest is decode.
"""

from __future__ import annotations

import importlib.util
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from verispec.config import SamplingParams, SpeculativeConfig
from verispec.metrics import SpecMetrics
from verispec.models.registry import resolve_model
from verispec.speculative.base import DrafterContext

PLAIN = "plain"
HF_METHODS = ("plain", "assisted", "prompt_lookup")
HF_K = {"assisted": "num_assistant_tokens", "prompt_lookup": "prompt_lookup_num_tokens"}
LLAMACPP_METHODS = ("plain", "prompt_lookup")
LLAMACPP_OPTIONS = {"k": "num_pred_tokens", "num_pred_tokens": "num_pred_tokens", "max_ngram_size": "max_ngram_size"}
PROMPT_LOOKUP_TOKENS = 10  # hf:prompt_lookup's k unless given: the value transformers' docs use
_OPTION = re.compile(r"^[A-Za-z_]\w*=")


@dataclass(frozen=True)
class MethodSpec:
    backend: str  # "verispec" | "hf" | "llamacpp" | "openai"
    name: str  # "plain", a drafter name, "assisted", "prompt_lookup"; openai: the label
    arg: str | None = None  # a draft model; openai: the server's URL
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.backend == "openai":
            return f"openai:{self.name}"
        text = self.name if self.backend == "verispec" else f"{self.backend}:{self.name}"
        if self.arg is not None:
            text += f":{self.arg}"
        if self.options:
            text += "@" + ",".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}"
                                   for k, v in self.options.items())
        return text

    @property
    def is_plain(self) -> bool:
        return self.backend == "verispec" and self.name == PLAIN


def valid_methods_text() -> str:
    from verispec.speculative.registry import available_methods  # imports every drafter: only when asked

    return (f"plain, {', '.join(available_methods())} (verispec drafters), hf:plain, hf:assisted:DRAFT, "
            f"hf:prompt_lookup, llamacpp:plain, llamacpp:prompt_lookup, openai:URL[@LABEL]")


def parse_methods(text: str) -> list[MethodSpec]:
    """Parse ``--methods``; plain comes first, duplicates are dropped, every spec is checked."""
    items: list[tuple[str, list[str]]] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        if _OPTION.match(item):
            if not items or "@" not in items[-1][0]:
                raise ValueError(f"option {item!r} follows no method@...; write e.g. ngram@k=4,prompt_lookup_max=3")
            items[-1][1].append(item)
        else:
            items.append((item, []))
    if not items:
        raise ValueError(f"no methods given; valid methods: {valid_methods_text()}")
    specs: list[MethodSpec] = [MethodSpec("verispec", PLAIN)]
    for head, more in items:
        spec = _parse_one(head, more)
        if spec.label not in {s.label for s in specs}:
            specs.append(spec)
    return specs


def _parse_one(head: str, more: list[str]) -> MethodSpec:
    if head.startswith("openai:"):
        return _parse_openai(head, more)
    body, _, first_option = head.partition("@")
    options = _parse_options([first_option, *more] if first_option else more, head)
    backend = "verispec"
    if body.startswith(("hf:", "llamacpp:")):
        backend, _, body = body.partition(":")
    name, sep, arg = body.partition(":")
    if sep and not arg:
        raise ValueError(f"method {head!r}: empty argument after ':'")
    spec = MethodSpec(backend, name, arg or None, options)
    {"verispec": _check_verispec, "hf": _check_hf, "llamacpp": _check_llamacpp}[backend](spec)
    return spec


def _parse_openai(head: str, more: list[str]) -> MethodSpec:
    """``openai:URL[@LABEL]``: the label is what follows the last ``@`` when it holds no ``/``
    or ``:`` (a URL may carry ``user@host``)."""
    from urllib.parse import urlsplit

    rest = head[len("openai:"):]
    url, sep, label = rest.rpartition("@")
    if not sep or "/" in label or ":" in label:
        url, label = rest, ""
    if more:
        raise ValueError(f"method {head!r}: openai:URL[@LABEL] takes no KEY=VALUE options")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"method {head!r}: expected openai:http://HOST:PORT[@LABEL], got URL {url!r}")
    return MethodSpec("openai", label or parts.netloc, url.rstrip("/"))


def _parse_options(pairs: list[str], head: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"method {head!r}: option {pair!r} is not KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def _check_verispec(spec: MethodSpec) -> None:
    from verispec.speculative.registry import available_methods  # imports every drafter: only when asked

    if spec.name == PLAIN:
        if spec.arg or spec.options:
            raise ValueError("method 'plain' takes no argument or options")
        return
    if spec.name not in available_methods():
        raise ValueError(f"unknown method {spec.name!r}; valid methods: {valid_methods_text()}")
    speculative_config(spec)  # checks the options now, before any model loads


def speculative_config(spec: MethodSpec) -> SpeculativeConfig | None:
    """The engine config of a verispec method (``None`` for plain)."""
    if spec.is_plain:
        return None
    data: dict[str, Any] = {"method": spec.name}
    if spec.arg is not None:
        data["model"] = spec.arg
    for key, value in spec.options.items():
        data["num_speculative_tokens" if key == "k" else key] = value
    try:
        return SpeculativeConfig.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"method {spec.label!r}: {exc} (option k means num_speculative_tokens)") from None


def _check_hf(spec: MethodSpec) -> None:
    if spec.name not in HF_METHODS:
        raise ValueError(f"unknown transformers method 'hf:{spec.name}'; valid: hf:plain, hf:assisted:DRAFT, "
                         "hf:prompt_lookup")
    if spec.name == "assisted" and spec.arg is None:
        raise ValueError("'hf:assisted' needs an assistant model: hf:assisted:DRAFT")
    if spec.name != "assisted" and spec.arg is not None:
        raise ValueError(f"'hf:{spec.name}' takes no argument")
    hf_generation_options(spec)


def hf_generation_options(spec: MethodSpec) -> dict[str, Any]:
    """``GenerationConfig`` fields set by the method's options (``k`` resolved)."""
    from transformers import GenerationConfig

    defaults = GenerationConfig()
    out: dict[str, Any] = {}
    if spec.name == "prompt_lookup":
        out["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    for key, value in spec.options.items():
        if key == "k":
            if spec.name not in HF_K:
                raise ValueError(f"method {spec.label!r}: option k needs hf:assisted or hf:prompt_lookup")
            key = HF_K[spec.name]
        if not hasattr(defaults, key):
            raise ValueError(f"method {spec.label!r}: {key!r} is not a transformers GenerationConfig field")
        out[key] = value
    return out


def _check_llamacpp(spec: MethodSpec) -> None:
    if spec.name not in LLAMACPP_METHODS:
        raise ValueError(f"unknown llama.cpp method 'llamacpp:{spec.name}'; valid: llamacpp:plain, llamacpp:prompt_lookup")
    if spec.arg is not None:
        raise ValueError(f"'llamacpp:{spec.name}' takes no argument")
    bad = sorted(set(spec.options) - set(LLAMACPP_OPTIONS)) if spec.name == "prompt_lookup" else sorted(spec.options)
    if bad:
        raise ValueError(f"method {spec.label!r}: unknown option(s) {', '.join(bad)}; "
                         f"llamacpp:prompt_lookup accepts {', '.join(LLAMACPP_OPTIONS)}")
    if importlib.util.find_spec("llama_cpp") is None:
        raise ValueError(f"method {spec.label!r} needs llama-cpp-python, which is not installed "
                         "(pip install llama-cpp-python); leave llamacpp:* methods out to run without it")


# ---------------------------------------------------------------------------------------------
# runners
# ---------------------------------------------------------------------------------------------


@dataclass
class TurnResult:
    output_ids: list[int]
    total_s: float
    prefill_s: float  # call start until the first generated token exists
    finish_reason: str | None
    metrics: SpecMetrics | None = None  # verispec methods only
    first_tokens: int = 1  # tokens that exist when prefill ends (assisted generation emits a round at once)
    # prompt tokens whose K/V the engine or server took from its cache (None: it does not say)
    cached_prompt_tokens: int | None = None


class Runner(Protocol):
    def generate(self, prompt_ids: list[int], params: SamplingParams) -> TurnResult: ...


class EngineRunner:
    """A verispec :class:`~verispec.engine.engine.Engine` (plain or speculative)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> TurnResult:
        t0 = time.perf_counter()
        seq = self.engine.generate(prompt_ids, params)
        total = time.perf_counter() - t0
        return TurnResult(list(seq.output_ids), total, seq.metrics.prefill_time_s, seq.finish_reason, seq.metrics,
                          cached_prompt_tokens=seq.metrics.cached_prompt_tokens)


class _PushTimer:
    """A transformers streamer that notes when each push arrives and its size (the first is the prompt)."""

    def __init__(self) -> None:
        self.pushes: list[tuple[float, int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.pushes.append((time.perf_counter(), value.numel()))

    def end(self) -> None:
        pass


def hf_generate(model: Any, prompt_ids: list[int], **generate_kwargs: Any) -> TurnResult:
    """Time one transformers ``generate`` call; prefill ends with the first push of new tokens.

    Plain ``generate`` pushes one token at a time; assisted generation pushes each round's
    tokens together, so its first push holds the first round too (``first_tokens``).
    """
    ids = torch.tensor([prompt_ids], device=model.device)
    timer = _PushTimer()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), streamer=timer, **generate_kwargs)
    total = time.perf_counter() - t0
    if len(timer.pushes) < 2:
        raise RuntimeError("transformers generated no token (its streamer saw only the prompt)")
    first_at, first_tokens = timer.pushes[1]
    return TurnResult([int(t) for t in out[0, len(prompt_ids):]], total, first_at - t0, None,
                      first_tokens=first_tokens)


class HFRunner:
    """transformers ``generate``: greedy at temperature 0, else sampling at that temperature and
    top-p (no other filter)."""

    def __init__(self, model: Any, eos_token_ids: frozenset[int], options: dict[str, Any],
                 assistant: Any | None = None) -> None:
        self.model, self.eos, self.options, self.assistant = model, sorted(eos_token_ids), options, assistant

    def generation_config(self, params: SamplingParams) -> Any:
        from transformers import GenerationConfig

        # A fresh config, so no sampling default of the checkpoint (repetition penalty, top-k)
        # slips in; stops on the same EOS ids as verispec.
        sampling = {} if params.greedy else {"temperature": params.temperature, "top_k": 0, "top_p": params.top_p}
        return GenerationConfig(
            max_new_tokens=params.max_tokens, do_sample=not params.greedy, num_beams=1,
            eos_token_id=self.eos or None, pad_token_id=self.eos[0] if self.eos else 0,
            **sampling, **self.options,
        )

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> TurnResult:
        if params.seed is not None:
            torch.manual_seed(params.seed)
        extra = {} if self.assistant is None else {"assistant_model": self.assistant}
        result = hf_generate(self.model, prompt_ids, generation_config=self.generation_config(params), **extra)
        result.finish_reason = "stop" if result.output_ids and result.output_ids[-1] in self.eos else "length"
        return result


class LlamaCppRunner:
    """llama.cpp's own sampling loop (``Llama.generate``) fed with verispec's prompt ids."""

    def __init__(self, llm: Any, eos_token_ids: frozenset[int]) -> None:
        self.llm, self.eos = llm, eos_token_ids

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> TurnResult:
        if params.seed is not None:
            self.llm.set_seed(params.seed)
        out: list[int] = []
        first = None
        t0 = time.perf_counter()
        # temp 0 is greedy in llama.cpp; otherwise sampling at the request's top-p (no top-k/min-p/penalty).
        for token in self.llm.generate(prompt_ids, temp=params.temperature, top_k=0, top_p=params.top_p, min_p=0.0,
                                       repeat_penalty=1.0, reset=True):
            first = first or time.perf_counter()
            out.append(int(token))
            if token in self.eos or len(out) >= params.max_tokens:
                break
        total = time.perf_counter() - t0
        reason = "stop" if out and out[-1] in self.eos else "length"
        return TurnResult(out, total, (first or t0 + total) - t0, reason)


class OpenAIRunner:
    """A running OpenAI-compatible server, one streamed ``/v1/completions`` request per turn
    (see the module doc)."""

    def __init__(self, url: str, tokenizer: Any, timeout_s: float = 3600.0) -> None:
        import os

        import openai

        self.client = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get("OPENAI_API_KEY") or "none",
                                    max_retries=0, timeout=timeout_s)
        self.tokenizer = tokenizer
        try:
            models = self.client.models.list().data
        except openai.APIError as e:
            raise ValueError(f"no OpenAI-compatible server answered at {url}: {e}") from None
        if not models:
            raise ValueError(f"the server at {url} lists no model")
        self.model = models[0].id
        eos = getattr(tokenizer.hf, "eos_token_id", None)
        self.eos = eos if eos is not None else min(tokenizer.eos_token_ids, default=None)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> TurnResult:
        # Greedy at T = 0; otherwise sampling at T and the request's top-p (top_k / min_p off:
        # llama-server turns them on by default; vLLM and verispec accept both fields).
        sampling: dict[str, Any] = {"temperature": params.temperature}
        if not params.greedy:
            sampling.update(top_p=params.top_p, extra_body={"top_k": 0, "min_p": 0.0})
        if params.seed is not None:
            sampling["seed"] = params.seed
        pieces: list[str] = []
        first = None
        finish = None
        cached = None
        t0 = time.perf_counter()
        # include_usage: the last chunk carries the usage, whose prompt_tokens_details.cached_tokens
        # (llama-server, vLLM, verispec) says how much of the prompt the server had cached
        stream = self.client.completions.create(model=self.model, prompt=prompt_ids, max_tokens=params.max_tokens,
                                                stream=True, stream_options={"include_usage": True}, **sampling)
        for chunk in stream:
            for choice in chunk.choices:
                if choice.text:
                    first = first or time.perf_counter()
                    pieces.append(choice.text)
                finish = choice.finish_reason or finish
            details = getattr(getattr(chunk, "usage", None), "prompt_tokens_details", None)
            if getattr(details, "cached_tokens", None) is not None:
                cached = int(details.cached_tokens)
        total = time.perf_counter() - t0
        ids = self.tokenizer.encode("".join(pieces), add_special_tokens=False)
        if finish == "stop" and self.eos is not None and len(ids) < params.max_tokens:
            ids.append(int(self.eos))
        return TurnResult(ids, total, (first or t0 + total) - t0, finish, cached_prompt_tokens=cached)


# ---------------------------------------------------------------------------------------------
# building
# ---------------------------------------------------------------------------------------------


def hf_directory(model: str | Path) -> Path:
    """A Hugging Face directory transformers loads ``model`` from: the model's own, or a GGUF's
    converted checkpoint (made once, for transformers' baselines)."""
    from verispec.models.loader import convert_gguf  # the loader: only for transformers' baselines

    path = resolve_model(str(model))
    return path if path.is_dir() else convert_gguf(path)


def load_hf_model(directory: Path, dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype).to(device)
    return model.eval()


@dataclass
class Builder:
    """Builds runners on one loaded target; shares loaded draft / transformers models between them.

    ``load(name, quantization)`` loads a verispec model by name (the CLI passes :func:`load_model`
    with the target's device and dtype; tests pass preloaded tiny models).
    """

    target: Any  # LoadedModel
    max_model_len: int
    load: Callable[[str, str], Any]
    threads: int | None = None
    gguf: Path | None = None  # the target's GGUF file, for llama.cpp
    _drafts: dict[tuple[str, str], Any] = field(default_factory=dict, init=False)  # (name, quantization) -> LoadedModel
    _hf: dict[str, Any] = field(default_factory=dict, init=False)  # name ("" = target) -> transformers model

    def build(self, spec: MethodSpec) -> Runner:
        if spec.backend == "openai":
            return OpenAIRunner(spec.arg, self.target.tokenizer)
        return {"verispec": self._verispec, "hf": self._hf_runner, "llamacpp": self._llamacpp}[spec.backend](spec)

    def _verispec(self, spec: MethodSpec) -> Runner:
        # The engine and the registry (every drafter) load when a verispec method is built,
        # not for `verispec bench --compare` or a preset's --help, which import this module.
        from verispec.engine.engine import Engine
        from verispec.speculative.registry import draft_model_drafter

        config = speculative_config(spec)
        drafter = None
        if config is not None and config.method == "draft_model" and config.model:
            # One loaded draft model (per quantization) serves every draft_model method; each
            # method gets its own drafter, chain or tree, with its own cache.
            key = (config.model, config.quantization)
            if key not in self._drafts:
                self._drafts[key] = self.load(config.model, config.quantization)
            drafter = draft_model_drafter(self._drafts[key], config, DrafterContext(self.target, self.max_model_len))
        return EngineRunner(Engine(self.target, config, max_model_len=self.max_model_len, drafter=drafter))

    def _hf_model(self, name: str, directory: Path) -> Any:
        if name not in self._hf:
            model = self.target.model
            self._hf[name] = load_hf_model(directory, model.dtype, model.device)
        return self._hf[name]

    def _hf_runner(self, spec: MethodSpec) -> Runner:
        target = self._hf_model("", hf_directory(self.target.source))
        assistant = self._hf_model(spec.arg, hf_directory(spec.arg)) if spec.arg else None
        return HFRunner(target, self.target.tokenizer.eos_token_ids, hf_generation_options(spec), assistant)

    def _llamacpp(self, spec: MethodSpec) -> Runner:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        if self.gguf is None:
            raise ValueError(f"{spec.label} needs a GGUF model; {self.target.name!r} was not loaded from a GGUF file")
        draft = None
        if spec.name == "prompt_lookup":
            draft = LlamaPromptLookupDecoding(**{LLAMACPP_OPTIONS[k]: v for k, v in spec.options.items()})
        # With a draft model llama-cpp-python keeps every position's logits, but it sizes that
        # buffer by the logits_all argument: without it, a context past n_batch (512) tokens
        # overflows the buffer (a numpy broadcast error mid-run).
        llm = llama_cpp.Llama(model_path=str(self.gguf), n_ctx=self.max_model_len, n_threads=self.threads,
                              draft_model=draft, logits_all=draft is not None, verbose=False)
        return LlamaCppRunner(llm, self.target.tokenizer.eos_token_ids)

