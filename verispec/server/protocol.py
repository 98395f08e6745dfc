"""Request and response schemas of the OpenAI-compatible API (the subset verispec serves).

Requests are strict pydantic models: a wrong type (``"5"`` for an integer, ``1`` for a boolean)
is rejected before it reaches the engine, and the app answers 400 with an OpenAI-style error
body; as in JSON Schema, ``3.0`` is an integer. The models generate the OpenAPI document, so
every bound below is also published there:

* ``seed`` is an int64 and ``top_k`` at most 2**31 - 1 (torch overflows beyond; a ``top_k`` at
  or above the vocabulary keeps every token);
* at most ``MAX_STOP_STRINGS`` stop strings of 1 to ``MAX_STOP_CHARS`` characters each;
* a prompt (text or token ids) is not empty;
* every string is valid Unicode: a lone surrogate (JSON ``"\\ud800"``) is a 400, not a
  tokenizer crash.

* ``logprobs`` (chat: ``true`` and ``top_logprobs`` 0 to ``MAX_TOP_LOGPROBS``; completions: the
  number of top logprobs, 0 to ``MAX_TOP_LOGPROBS``), as vLLM defines them by default (see
  :mod:`verispec.logprobs`); ``top_logprobs`` without ``logprobs: true`` is a 400, as in OpenAI's API.

* ``presence_penalty`` and ``frequency_penalty`` in [-2, 2], ``logit_bias`` (token id strings to
  biases in [-100, 100]; an id outside the vocabulary is a 400) as OpenAI's, and vLLM's
  ``repetition_penalty`` (> 0) and ``min_tokens`` (at most the completion's max tokens): defined in
  :mod:`verispec.penalties`, and exact under speculation.
* ``n`` samples (1 to ``MAX_N``, at most the server's ``max_num_seqs``): choices 0..n-1, with one
  prefill, each with its own seed stream (:meth:`verispec.config.SamplingParams.for_choice`).
  ``usage`` counts the prompt once and every choice's tokens, as OpenAI's does.

Fields that OpenAI defines but verispec does not implement are accepted only at their neutral
value (``echo`` false, ``best_of`` 1), which the schema states; anything else
is a clear 400 (:meth:`SamplingRequest.refused`), never silently ignored. So is an unknown key,
at the top level or inside a chat message, and ``stream_options`` without ``stream: true`` (as
OpenAI answers). Each such 400 names the field in the error's ``param``.

vLLM's extras: ``top_k``, ``min_p``, ``ignore_eos`` and ``stop_token_ids`` (a listed id ends the
completion as EOS does, even with ``ignore_eos``; it is counted in ``completion_tokens`` and gives
no text).

verispec extras:

* request ``speculative``: ``{"enabled": false}`` turns drafting off for this request;
  ``{"num_speculative_tokens": k}`` caps its drafts per round (at most the server's k).
* response ``speculative_stats`` (and in the final stream chunk): drafted and accepted tokens,
  acceptance rate and mean acceptance length (bonus token included, as in
  :mod:`verispec.metrics`).
"""

from __future__ import annotations

from typing import Annotated, Literal, NamedTuple

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, WithJsonSchema

from verispec.config import LOGIT_BIAS_MAX, PENALTY_MAX, SEED_MAX, SEED_MIN, TOP_K_MAX
from verispec.metrics import SpecMetrics

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
MAX_TOP_LOGPROBS = 20  # as OpenAI's chat API and vLLM's default max_logprobs
MAX_N = 128  # choices per request, as OpenAI's API (the server's max_num_seqs bounds it too)
MAX_LOGIT_BIAS = 300  # logit_bias entries, as OpenAI's API
LOGPROB_FLOOR = -9999.0  # a logprob of -inf is sent as this (JSON has no infinity), as vLLM does


def _valid_unicode(value: object) -> object:
    # Before pydantic's own checks, which would reject a lone surrogate less clearly (or not at all).
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("the text is not valid Unicode (it holds a lone surrogate)") from None
    return value


def _integral(value: object) -> object:
    # JSON Schema counts 3.0 as an integer; strict pydantic would not.
    return int(value) if isinstance(value, float) and value.is_integer() else value


# The bounds go inside the validator: outside, pydantic publishes them as "ge"/"le", not JSON Schema.
Int = Annotated[int, BeforeValidator(_integral)]
PositiveInt = Annotated[int, Field(ge=1), BeforeValidator(_integral)]
NonNegativeInt = Annotated[int, Field(ge=0), BeforeValidator(_integral)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS), BeforeValidator(_integral)]
TopK = Annotated[int, Field(ge=-1, le=TOP_K_MAX), BeforeValidator(_integral)]
# OpenAPI's int64 format rather than the bounds: FastAPI writes bounds as floats, and 2**63 - 1
# as a float is 2**63.
Int64 = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX), BeforeValidator(_integral),
                  WithJsonSchema({"type": "integer", "format": "int64"})]
Text = Annotated[str, BeforeValidator(_valid_unicode)]
NonEmptyText = Annotated[str, StringConstraints(min_length=1), BeforeValidator(_valid_unicode)]
Penalty = Annotated[float, Field(ge=-PENALTY_MAX, le=PENALTY_MAX)]
Bias = Annotated[float, Field(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX)]
TokenIdText = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$"), BeforeValidator(_valid_unicode)]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_CHARS), BeforeValidator(_valid_unicode)]


class Refusal(NamedTuple):
    """Why a well-formed request is refused: the field (OpenAI's error ``param``) and a message."""

    param: str
    message: str


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True)


class SpeculativeOptions(_Strict):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    num_speculative_tokens: NonNegativeInt | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


_STREAM_OPTIONS_NEED_STREAM = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}
_TOP_LOGPROBS_NEED_LOGPROBS = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}


class SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    # The schema states what `refused` checks across fields: stream_options needs stream true.
    model_config = ConfigDict(extra="forbid", json_schema_extra=_STREAM_OPTIONS_NEED_STREAM)

    model: Text | None = None
    max_tokens: PositiveInt | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: TopK = 0
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    ignore_eos: bool = False
    stop_token_ids: list[NonNegativeInt] | None = None  # vLLM's: end like EOS, even with ignore_eos
    speculative: SpeculativeOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N), BeforeValidator(_integral)] | None = 1  # null means 1, as in OpenAI's API
    presence_penalty: Penalty | None = 0.0  # null means 0
    frequency_penalty: Penalty | None = 0.0
    logit_bias: Annotated[dict[TokenIdText, Bias], Field(max_length=MAX_LOGIT_BIAS, json_schema_extra={
        "additionalProperties": False})] | None = None  # keys: token ids, as strings
    repetition_penalty: Annotated[float, Field(gt=0.0)] = 1.0  # vLLM's; 1 disables
    min_tokens: NonNegativeInt = 0  # vLLM's

    def refused(self) -> Refusal | None:
        """The first option that was set but that verispec refuses (unsupported, or not allowed
        with the others), or None."""
        if self.stream_options is not None and not self.stream:
            return Refusal("stream_options", "stream_options is only allowed when stream is true")
        return None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def choices(self) -> int:
        return 1 if self.n is None else self.n

    def token_biases(self) -> dict[int, float]:
        """``logit_bias`` with token ids for keys (the schema checked that they are digits)."""
        return {int(token): bias for token, bias in (self.logit_bias or {}).items()}

    def requested_logprobs(self) -> int | None:
        """How many top logprobs each emitted token comes with (0: its own only); None: no
        logprobs."""
        return None


class CompletionRequest(SamplingRequest):
    prompt: NonEmptyText | Annotated[list[NonNegativeInt], Field(min_length=1)]
    echo: bool = Field(default=False, json_schema_extra={"const": False})
    suffix: Text | None = Field(default=None, json_schema_extra={"maxLength": 0})
    best_of: Int | None = Field(default=None, json_schema_extra={"enum": [1, None]})
    logprobs: TopLogprobs | None = None  # the number of top logprobs per token (the emitted one comes too)

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def refused(self) -> Refusal | None:
        for name in ("echo", "suffix"):
            if getattr(self, name):
                return Refusal(name, "echo, suffix and best_of are not supported by verispec")
        if self.best_of not in (None, 1):
            return Refusal("best_of", "echo, suffix and best_of are not supported by verispec")
        return super().refused()


class TextPart(_Strict):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer"]
    content: Text | list[TextPart]
    name: Text | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [_STREAM_OPTIONS_NEED_STREAM, _TOP_LOGPROBS_NEED_LOGPROBS]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = None  # needs logprobs true

    def refused(self) -> Refusal | None:
        if self.top_logprobs is not None and not self.logprobs:
            return Refusal("top_logprobs", "top_logprobs is only allowed when logprobs is true")
        return super().refused()

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- responses: they document the bodies the app builds (as dicts) in the OpenAPI document ----


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose K/V an earlier request left (prefix caching)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class SpeculativeStats(BaseModel):
    drafted: int
    accepted: int
    rounds: int
    acceptance_rate: float | None
    mean_acceptance_length: float | None


class CompletionLogprobs(BaseModel):
    """One entry per generated token (the stop token included, as ``completion_tokens`` counts
    it); ``top_logprobs`` maps the top tokens' text (and the emitted token's) to their logprob,
    ``text_offset`` is where each token's text starts in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    speculative_stats: SpeculativeStats


class CompletionChunk(CompletionResponse):
    """One server-sent event of a stream; the last one has ``usage`` and ``speculative_stats``."""

    usage: Usage | None = None
    speculative_stats: SpeculativeStats | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the token's text as UTF-8


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculative_stats: SpeculativeStats


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a stream; the last one has ``usage`` and ``speculative_stats``."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    speculative_stats: SpeculativeStats | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


def describe_errors(errors: list[dict]) -> str:
    """pydantic's errors as ``field.path: message; ...`` (``body`` for the body as a whole)."""
    return "; ".join(f"{path or 'body'}: {message}" for path, message in _problems(errors))


def error_param(errors: list[dict]) -> str | None:
    """The field of the first of pydantic's errors, as :func:`describe_errors` names it (OpenAI's
    error ``param``); None where the body as a whole is wrong (not JSON, not an object)."""
    problems = _problems(errors)
    return (problems[0][0] or None) if problems else None


def _problems(errors: list[dict]) -> list[tuple[str, str]]:
    """pydantic's errors as (field path, message), the path dotted (``messages.0.role``; empty
    for the body as a whole).

    A union (``prompt``: text or token ids) reports one error per member, labelled with the
    member's type; the labels are dropped, and so is a member's wrong-type error when another
    member's error says more (it is deeper in the value, or not about the type).
    """
    found = []
    for err in errors:
        path = tuple(p for p in err.get("loc", ()) if p != "body" and not _is_union_label(p))
        error = (err.get("ctx") or {}).get("error")
        message = str(error) if err.get("type") == "value_error" and error is not None else err.get("msg")
        if err.get("type") == "json_invalid":  # FastAPI puts the character's position where a field goes
            message = f"{message} at character {path[-1]}: {error}" if path and error else message
            path = ()
        found.append((path, err.get("type", ""), message))

    def explained_elsewhere(path: tuple, kind: str) -> bool:  # by a deeper or a non-type error
        return kind.endswith("_type") and any(
            p[:len(path)] == path and (len(p) > len(path) or not k.endswith("_type")) for p, k, _ in found)

    return [(".".join(str(p) for p in path), message) for path, kind, message in found
            if not explained_elsewhere(path, kind)]


def _is_union_label(part: object) -> bool:
    # pydantic names a union member by its type: "str", "list[int]", "function-after[...]", ...
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none")
                                      or any(c in part for c in "[(-"))


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The OpenAI error envelope. A lone surrogate (echoed from a request) is escaped, so the
    body always encodes as UTF-8."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def speculative_stats(m: SpecMetrics) -> dict:
    return {
        "drafted": m.num_draft_tokens,
        "accepted": m.num_accepted_tokens,
        "rounds": m.num_rounds,
        "acceptance_rate": m.acceptance_rate,
        "mean_acceptance_length": m.mean_acceptance_length,
    }
