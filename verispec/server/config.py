"""The server's settings, one typed pydantic model: :class:`ServerConfig`.

It holds everything one server needs: the model and how it loads (device, dtype, quantization,
KV cache dtype, threads), the engine (speculative config, batch, context length, prefix
caching), the app's limits and deadlines, and the address it listens on. ``verispec serve``
fills it from its flags, one flag per field (``--max-num-seqs`` is ``max_num_seqs``;
``--request-timeout`` is ``request_timeout_s``), and :func:`verispec.server.serve.serve` runs
it. Ray Serve's :class:`~verispec.server.ray_serve.ScaleOutConfig` is this model with the
replicas' placement and routing added, so every server setting is declared and checked once,
and each replica runs exactly the server that ``verispec serve`` would.

A bad value fails validation with pydantic's ``ValidationError``, which names the field, before
any model loads. Unknown fields are refused too, so a misspelt setting cannot pass unnoticed.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from verispec.config import MAX_REQUEST_BYTES, SpeculativeConfig


class ServerConfig(BaseModel):
    """One verispec server: its model, engine, limits and address (module doc)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # the model and how it loads
    model: str = Field(description="bundled model name, HF model directory or .gguf file")
    speculative_config: dict[str, Any] | None = Field(
        None, description="vLLM's --speculative-config (a SpeculativeConfig is accepted too); None: plain decoding")
    device: str = "cpu"
    dtype: str = "auto"
    quantization: Literal["auto", "none", "gguf", "int8", "int4"] = Field(
        "auto", description="the target's linear layers, as for `verispec generate`")
    quantization_group_size: Literal[32, 64, 128] = Field(32, description="int4 group size")
    kv_cache_dtype: Literal["auto", "float32", "float16"] = "auto"
    threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's choice; "
                                "on a Ray Serve replica, its num_cpus)")
    # the engine
    max_num_seqs: int = Field(8, ge=1, description="sequences decoded together")
    max_model_len: int = Field(4096, ge=1, description="prompt + output tokens per sequence")
    enable_prefix_caching: bool | None = Field(None, description="default: on where exact and free (see Engine)")
    # the app: name, key, limits, deadlines
    served_model_name: str | None = Field(None, description="the model id clients use (default: model)")
    api_key: str | None = Field(None, min_length=1, description="required as a bearer token on /v1 routes "
                                "(default: $VERISPEC_API_KEY, where set and not empty; else none)")
    api_key_for_metrics_and_docs: bool = Field(
        False, description="require the key on /metrics, /docs, /redoc and /openapi.json too (/health stays "
        "open); default: only /v1 routes, as vLLM")
    max_queue: int = Field(64, ge=1, description="waiting requests before answering 429")
    max_request_bytes: int = Field(MAX_REQUEST_BYTES, ge=1, description="larger /v1 bodies get 413")
    request_timeout_s: float | None = Field(600.0, gt=0, description="arrival to last token; None: no limit")
    max_step_s: float | None = Field(120.0, gt=0, description="/health is 503 while one engine step (a prompt's "
                                     "prefill included) has run longer; None: never")
    header_timeout_s: float = Field(10.0, gt=0, description="a connection whose request headers have not all "
                                    "arrived this long after it opened (or after its last response) is closed")
    body_timeout_s: float = Field(30.0, gt=0, description="a /v1 request body not all arrived this long after "
                                  "its headers gets 408")
    limit_concurrency: int | None = Field(512, ge=1, description="open connections and requests past which new "
                                          "ones get 503; None: no limit")
    exit_on_fatal: bool = Field(False, description="exit with status 1 if the engine thread dies")
    # where it listens
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _spec_as_dict(cls, value: object) -> object:
        return dataclasses.asdict(value) if isinstance(value, SpeculativeConfig) else value

    @field_validator("speculative_config")
    @classmethod
    def _check_spec(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        parse_spec(value)  # a bad speculative config fails here, before any model loads
        return value

    @property
    def name(self) -> str:
        return self.served_model_name or self.model

    def spec(self) -> SpeculativeConfig | None:
        """The speculative config, parsed; None for plain decoding."""
        return parse_spec(self.speculative_config)

    def resolved_api_key(self, environ: Mapping[str, str] = os.environ) -> str | None:
        """The key /v1 routes require: ``api_key``, else ``$VERISPEC_API_KEY`` (unset or empty: none).
        Raises ValueError where ``api_key_for_metrics_and_docs`` asks for a key and there is none."""
        key = self.api_key or environ.get("VERISPEC_API_KEY") or None
        if key is None and self.api_key_for_metrics_and_docs:
            raise ValueError("api_key_for_metrics_and_docs needs an API key "
                             "(--api-key-file, VERISPEC_API_KEY or --api-key)")
        return key


def parse_spec(data: Mapping[str, Any] | None) -> SpeculativeConfig | None:
    """``--speculative-config`` as a :class:`SpeculativeConfig` with a registered method; None
    (plain decoding) for None or an empty dict."""
    if not data:
        return None
    from verispec.speculative.registry import check_method  # imports every drafter: only when asked

    spec = SpeculativeConfig.from_dict(dict(data))
    check_method(spec.method)
    return spec


def describe(error: ValidationError, names: Mapping[str, str] | None = None) -> str:
    """``error``'s problems as ``setting: message; ...``, each setting by its name in ``names``
    (e.g. its command-line flag) where given, else by its field name."""
    names = names or {}
    problems = []
    for err in error.errors():
        field = ".".join(map(str, err["loc"]))
        cause = (err.get("ctx") or {}).get("error")
        message = str(cause) if err["type"] == "value_error" and cause is not None else err["msg"]
        problems.append(f"{names.get(field, field)}: {message}" if field else message)
    return "; ".join(problems)
