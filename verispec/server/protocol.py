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
  ``repetition_penalty`` (0.01 to 100) and ``min_tokens`` (at most the completion's max tokens): defined in
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

Structured outputs (:mod:`verispec.constraints`): ``response_format`` (``text``, ``json_object``,
``json_schema``) and vLLM's ``guided_json``, ``guided_regex``, ``guided_grammar`` (Lark, as
llguidance reads it, or GBNF) and ``guided_choice``; at most one of them per request, and none
with ``ignore_eos``. A grammar the engine cannot compile is a 400 naming the field, with
llguidance's message, before anything is generated.

verispec extras:

* request ``speculative``: ``{"enabled": false}`` turns drafting off for this request;
  ``{"num_speculative_tokens": k}`` caps its drafts per round (at most the server's k).
* response ``speculative_stats`` (and in the final stream chunk): drafted and accepted tokens,
  acceptance rate and mean acceptance length (bonus token included, as in
  :mod:`verispec.metrics`).
"""

from __future__ import annotations

import itertools
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, WithJsonSchema, model_validator

from verispec.config import LOGIT_BIAS_MAX, PENALTY_MAX, REPETITION_PENALTY_RANGE, SEED_MAX, SEED_MIN, TOP_K_MAX
from verispec.constraints import Grammar
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
FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]  # as OpenAI's


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


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: Text
    description: Text | None = None
    schema_: dict | None = Field(default=None, alias="schema")  # None: any JSON value
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(_Strict):
    model_config = ConfigDict(extra="forbid", json_schema_extra={  # json_schema exactly with its type
        "if": {"properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}},
        "else": {"properties": {"json_schema": {"type": "null"}}}})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None  # required with type json_schema


# the fields that ask for a grammar, in the order they are looked at
GRAMMAR_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice")


def _asks(name: str) -> dict:
    """JSON Schema: the request sets ``name`` (a grammar field: not null, not response_format's
    "text"; ignore_eos: true)."""
    if name == "ignore_eos":
        value: dict = {"const": True}
    elif name == "response_format":
        value = {"type": "object", "required": ["type"], "properties": {"type": {"not": {"const": "text"}}}}
    else:
        value = {"not": {"type": "null"}}
    return {"required": [name], "properties": {name: value}}


# what `refused` checks across fields: at most one grammar, and none with ignore_eos
_ONE_GRAMMAR = {"not": {"anyOf": [{"allOf": [_asks(a), _asks(b)]}
                                  for a, b in itertools.combinations(("ignore_eos", *GRAMMAR_FIELDS), 2)]}}


_STREAM_OPTIONS_NEED_STREAM = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}
_TOP_LOGPROBS_NEED_LOGPROBS = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}


class SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    # The schema states what `refused` checks across fields: stream_options needs stream true, at
    # most one grammar, none with ignore_eos.
    model_config = ConfigDict(extra="forbid", json_schema_extra={"allOf": [_STREAM_OPTIONS_NEED_STREAM, _ONE_GRAMMAR]})

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
    response_format: ResponseFormat | None = None
    guided_json: dict | Text | None = None  # vLLM's: a JSON schema (an object or its JSON text)
    guided_regex: Text | None = None
    guided_grammar: Text | None = None  # a Lark grammar as llguidance reads it, or GBNF
    guided_choice: Annotated[list[NonEmptyText], Field(min_length=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N), BeforeValidator(_integral)] | None = 1  # null means 1, as in OpenAI's API
    presence_penalty: Penalty | None = 0.0  # null means 0
    frequency_penalty: Penalty | None = 0.0
    logit_bias: Annotated[dict[TokenIdText, Bias], Field(max_length=MAX_LOGIT_BIAS, json_schema_extra={
        "additionalProperties": False})] | None = None  # keys: token ids, as strings
    repetition_penalty: Annotated[float, Field(ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])] = 1.0  # vLLM's; 1 disables
    min_tokens: NonNegativeInt = 0  # vLLM's

    def refused(self) -> Refusal | None:
        """The first option that was set but that verispec refuses (unsupported, or not allowed
        with the others), or None."""
        if self.stream_options is not None and not self.stream:
            return Refusal("stream_options", "stream_options is only allowed when stream is true")
        asked = [name for name in GRAMMAR_FIELDS if self._grammar_field(name) is not None]  # at most one
        if len(asked) > 1:
            return Refusal(asked[1], f"{' and '.join(asked)} each ask for a grammar; give at most one")
        fmt = self.response_format
        if fmt is not None and (fmt.type == "json_schema") != (fmt.json_schema is not None):
            return Refusal("response_format",
                           'response_format needs json_schema exactly when its type is "json_schema"')
        if asked and self.ignore_eos:
            return Refusal("ignore_eos",
                           f"ignore_eos cannot be combined with {asked[0]}: a complete grammar ends with EOS")
        if asked and self.min_tokens:  # (not stated in the schema: see ChatCompletionRequest)
            return Refusal("min_tokens",
                           f"min_tokens cannot be combined with {asked[0]}: a complete grammar ends with EOS")
        return None

    def _grammar_field(self, name: str) -> object:
        value = getattr(self, name)
        return None if name == "response_format" and value is not None and value.type == "text" else value

    def grammar_field(self) -> str | None:
        """The field that asks for a grammar (:attr:`refused` allows at most one), or None."""
        return next((name for name in GRAMMAR_FIELDS if self._grammar_field(name) is not None), None)

    def grammar(self) -> Grammar | None:
        """The grammar the request asks for, or None. Raises ``ValueError`` (with llguidance's
        message) when it does not compile."""
        name = self.grammar_field()
        if name is None:
            return None
        value = self._grammar_field(name)
        if name == "response_format":
            if value.type == "json_object":
                return Grammar.json_object()
            schema = value.json_schema.schema_
            return Grammar.json_schema(schema if schema is not None else {})
        build = {"guided_json": Grammar.json_schema, "guided_regex": Grammar.regex,
                 "guided_grammar": Grammar.lark, "guided_choice": Grammar.choice}[name]
        return build(value)

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


class FunctionCall(_Strict):
    model_config = ConfigDict(extra="forbid")

    name: FunctionName
    arguments: Text  # a JSON object, as a string


class ToolCallMessage(_Strict):
    """A call an assistant turn made, as a client sends the conversation back."""

    model_config = ConfigDict(extra="forbid")

    id: Text
    type: Literal["function"]
    function: FunctionCall


# Which fields a message needs, by role (checked in ChatMessage, stated in the schema): text for
# system, user, developer and tool messages; text or calls for an assistant's; calls only from an
# assistant, a tool_call_id only on a tool result.
_TEXT = {"required": ["content"], "properties": {"content": {"type": ["string", "array"]}}}
_CALLS = {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}
_CALL_ID = {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}}
_MESSAGE_RULES = {"allOf": [
    {"if": {"properties": {"role": {"const": "assistant"}}},
     "then": {"anyOf": [_TEXT, _CALLS]},
     "else": {**_TEXT, "not": {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array"}}}}},
    {"if": {"properties": {"role": {"const": "tool"}}}, "then": _CALL_ID, "else": {"not": _CALL_ID}},
]}


class ChatMessage(_Strict):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_MESSAGE_RULES)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's
    tool_call_id: Text | None = None  # a tool result's: the call it answers

    @model_validator(mode="after")
    def _fields_of_role(self) -> ChatMessage:
        if self.role == "assistant":
            if self.content is None and not self.tool_calls:
                raise ValueError("an assistant message needs content or tool_calls")
        elif self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        elif self.tool_calls is not None:
            raise ValueError("only an assistant message has tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        return self

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template reads it (None-valued keys are dropped later)."""
        calls = None if self.tool_calls is None else [c.model_dump() for c in self.tool_calls]
        return {"role": self.role, "content": self.text(), "tool_calls": calls, "tool_call_id": self.tool_call_id,
                "name": self.name}


class FunctionDefinition(_Strict):
    model_config = ConfigDict(extra="forbid")

    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None


class Tool(_Strict):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Strict):
    model_config = ConfigDict(extra="forbid")

    name: FunctionName


class NamedToolChoice(_Strict):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(SamplingRequest):
    # (tool_choice needs tools too, checked in `refused` but not stated here: with that rule the
    # request's schema is past what JSON Schema tools expand, and none could generate from it)
    model_config = ConfigDict(json_schema_extra={"allOf": [_STREAM_OPTIONS_NEED_STREAM, _TOP_LOGPROBS_NEED_LOGPROBS,
                                                           _ONE_GRAMMAR]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = None  # needs logprobs true
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # needs tools
    parallel_tool_calls: bool | None = None  # null: true

    def refused(self) -> Refusal | None:
        if self.top_logprobs is not None and not self.logprobs:
            return Refusal("top_logprobs", "top_logprobs is only allowed when logprobs is true")
        if self.tool_choice is not None and not self.tools:
            return Refusal("tool_choice", "tool_choice is only allowed when tools are given")
        if isinstance(self.tool_choice, NamedToolChoice) and \
                self.tool_choice.function.name not in {t.function.name for t in self.tools}:
            return Refusal("tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, "
                                          "which is not one of the tools")
        if self.forces_calls() and self.grammar_field() is not None:
            return Refusal("tool_choice", f"a tool_choice that forces calls cannot be combined with "
                                          f"{self.grammar_field()}: the answer is calls")
        return super().refused()

    def uses_tools(self) -> bool:
        """Whether the tools go to the template and the answer is read for calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def forces_calls(self) -> bool:
        """Whether the answer must be calls (``required``, or a named function): decoded under
        the grammar of the template's call format."""
        return self.uses_tools() and self.tool_choice not in (None, "auto")

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


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCallResponse(BaseModel):
    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ToolCallDelta(ToolCallResponse):
    index: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallResponse] | None = None  # present when the model called tools


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
    tool_calls: list[ToolCallDelta] | None = None  # each call whole, in the chunk where it completes


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
