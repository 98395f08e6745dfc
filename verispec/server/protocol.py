"""Request and response schemas of the OpenAI-compatible API (the subset verispec serves).

Requests are pydantic models, so a wrong type is rejected before it reaches the engine (the app
answers 400 with an OpenAI-style error body). Fields that OpenAI defines but verispec does not
implement are accepted only at their neutral value (``n=1``, no ``logprobs``, zero penalties);
anything else is a clear 400, never silently ignored.

verispec extras:

* request ``speculative``: ``{"enabled": false}`` turns drafting off for this request;
  ``{"num_speculative_tokens": k}`` caps its drafts per round (at most the server's k).
* response ``speculative_stats`` (and in the final stream chunk): drafted and accepted tokens,
  acceptance rate and mean acceptance length (bonus token included, as in
  :mod:`verispec.speculative.metrics`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from verispec.speculative.metrics import SpecMetrics


class SpeculativeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    num_speculative_tokens: int | None = Field(default=None, ge=0)


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False
    speculative: SpeculativeOptions | None = None

    def unsupported(self) -> str | None:
        """A message naming the first unsupported option that was set, or None."""
        if self.n != 1:
            return f"n={self.n} is not supported: verispec returns one choice per request (n=1)"
        if self.logprobs not in (None, False, 0) or self.top_logprobs:
            return "logprobs are not supported by verispec"
        if self.presence_penalty or self.frequency_penalty or self.logit_bias:
            return "presence_penalty, frequency_penalty and logit_bias are not supported by verispec"
        return None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(SamplingRequest):
    prompt: str | list[int]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> str | None:
        if self.echo or self.suffix or (self.best_of not in (None, 1)):
            return "echo, suffix and best_of are not supported by verispec"
        return super().unsupported()


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def speculative_stats(m: SpecMetrics) -> dict:
    return {
        "drafted": m.num_draft_tokens,
        "accepted": m.num_accepted_tokens,
        "rounds": m.num_rounds,
        "acceptance_rate": m.acceptance_rate,
        "mean_acceptance_length": m.mean_acceptance_length,
    }
