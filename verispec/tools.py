"""Tool calling: a conversation's tools rendered by the model's own chat template, and the calls
read back out of the text the model writes.

A tool call is text in the format the model was trained to write, so decoding does not change:
the engine samples tokens as for any answer, and speculation stays exact. What this module adds
is on either side of it:

* **Rendering.** The tools (OpenAI's ``{"type": "function", "function": {...}}``) go to the chat
  template as its ``tools`` variable, and earlier turns' assistant ``tool_calls`` and ``tool``
  messages go in as messages (:func:`template_messages`; a call's JSON ``arguments`` string is
  given to the template as an object, as the templates expect).
* **Parsing.** A :class:`ToolParser` per template family (as vLLM keeps one per family) reads
  the generated text as content and calls. :meth:`ToolParser.stream` does it incrementally for
  a stream: content flows out as it comes, except text that may be the start of a call, which
  is held until it is known; a call is sent whole once its text is complete. Parsing the whole
  text at once (:meth:`ToolParser.parse`) is the same parser fed once, so a stream and a whole
  answer agree.

Families (:func:`parser_for` picks one from the template's text):

* ``hermes`` (Qwen 2.5 and 3, Hermes): each call is ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, with any text around the blocks as content.
* ``mistral``: ``[TOOL_CALLS]`` followed by a JSON list of ``{"name", "arguments"}``.
* ``llama3_json`` (Llama 3.1 and later): an answer that is one JSON object ``{"name": ...,
  "parameters": {...}}`` (optionally after ``<|python_tag|>``) is a call.

Text that looks like a call but is not valid JSON with a string ``name`` and an object of
arguments stays content, unchanged: the client sees what the model wrote.

``tool_choice: "required"`` or a named function constrains the answer to calls in the family's
format (:meth:`ToolParser.grammar`: a Lark grammar, each call's JSON under a schema that allows
the chosen functions' names, each with its own arguments' schema). Decoding under a grammar
stays exact (:mod:`verispec.constraints`), so such an answer is the target's distribution
conditioned on being a valid call.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ToolCall", "ToolParser", "ToolCallStream", "PARSERS", "call_schema", "parser_for", "template_messages"]


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict:
        """OpenAI's shape of the call (a message's ``tool_calls`` entry; with ``index``, a
        stream delta's)."""
        body = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return body if index is None else {"index": index, **body}


def _call(obj: object, arguments_key: str = "arguments") -> ToolCall | None:
    """The call a decoded JSON value stands for, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that begins ``marker``: text a stream must hold
    back until the next piece shows whether the marker follows."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# The JSON of a constrained call: the separators the templates write, no free whitespace.
CALL_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def call_schema(tools: Sequence[Mapping[str, Any]], arguments_key: str = "arguments") -> dict:
    """JSON schema of one call to any of ``tools`` (OpenAI's function tools): its ``name`` one
    of theirs, its arguments under that function's ``parameters`` (any object where none)."""
    options = []
    for tool in tools:
        function = tool["function"]
        options.append({"type": "object",
                        "properties": {"name": {"const": function["name"]},
                                       arguments_key: function.get("parameters") or {"type": "object"}},
                        "required": ["name", arguments_key], "additionalProperties": False})
    return {"anyOf": options, "x-guidance": CALL_JSON_OPTIONS}


class ToolParser:
    """Reads one template family's calls out of generated text (see the module doc)."""

    name = ""

    def grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool = True) -> str:
        """A Lark grammar (llguidance's dialect) of an answer that is only calls to ``tools``:
        one, or with ``parallel`` one or more."""
        raise NotImplementedError

    def split(self, buffer: str, final: bool) -> tuple[list[str | ToolCall], str]:
        """The content pieces and calls at the start of ``buffer`` that are settled, in order,
        and the rest, which must wait for more text (``final``: there is none; settle all)."""
        raise NotImplementedError

    def stream(self, parallel: bool = True) -> ToolCallStream:
        return ToolCallStream(self, parallel)

    def parse(self, text: str, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer; content is None where the answer is only calls."""
        stream = self.stream(parallel)
        items = stream.feed(text) + stream.finish()
        content = "".join(i for i in items if isinstance(i, str))
        calls = [i for i in items if isinstance(i, ToolCall)]
        if calls and not content.strip():
            return None, calls
        return content, calls


class ToolCallStream:
    """A parser's incremental state for one answer: :meth:`feed` each new piece of text, then
    :meth:`finish`. Each returns the content pieces and complete calls settled so far, in order.
    Once a call has been made, whitespace between calls is not sent as content; without
    ``parallel`` only the first call is kept."""

    def __init__(self, parser: ToolParser, parallel: bool = True) -> None:
        self.parser, self.parallel = parser, parallel
        self.buffer = ""
        self.calls = 0
        self._space = ""  # whitespace held after a call: content only if other text follows

    def feed(self, text: str) -> list[str | ToolCall]:
        self.buffer += text
        items, self.buffer = self.parser.split(self.buffer, final=False)
        return self._settle(items)

    def finish(self) -> list[str | ToolCall]:
        items, self.buffer = self.parser.split(self.buffer, final=True)
        return self._settle(items)

    def _settle(self, items: list[str | ToolCall]) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        for item in items:
            if isinstance(item, ToolCall):
                self._space = ""
                if self.parallel or self.calls == 0:
                    out.append(item)
                self.calls += 1
            elif self.calls and not item.strip():
                self._space += item
            elif item:
                out.append(self._space + item)
                self._space = ""
        return out


class HermesParser(ToolParser):
    name = "hermes"
    start, end = "<tool_call>", "</tool_call>"

    def grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool = True) -> str:
        more = ' ("\\n" call)*' if parallel else ""
        return (f"start: call{more}\n"
                f"call: {json.dumps(self.start + chr(10))} body {json.dumps(chr(10) + self.end)}\n"
                f"body: %json {json.dumps(call_schema(tools))}")

    def split(self, buffer: str, final: bool) -> tuple[list[str | ToolCall], str]:
        items: list[str | ToolCall] = []
        while buffer:
            at = buffer.find(self.start)
            if at < 0:
                keep = 0 if final else _held_prefix(buffer, self.start)
                items.append(buffer[:len(buffer) - keep])
                return items, buffer[len(buffer) - keep:]
            if at:
                items.append(buffer[:at])
            close = buffer.find(self.end, at)
            if close < 0 and not final:
                return items, buffer[at:]
            stop = len(buffer) if close < 0 else close + len(self.end)
            body = buffer[at + len(self.start):close if close >= 0 else len(buffer)]
            try:
                call = _call(json.loads(body))
            except ValueError:
                call = None
            items.append(call or buffer[at:stop])
            buffer = buffer[stop:]
        return items, ""


class MistralParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool = True) -> str:
        one = call_schema(tools)
        schema = {"type": "array", "items": {"anyOf": one["anyOf"]}, "minItems": 1,
                  "x-guidance": CALL_JSON_OPTIONS}
        if not parallel:
            schema["maxItems"] = 1
        return f"start: {json.dumps(self.marker)} body\nbody: %json {json.dumps(schema)}"

    def split(self, buffer: str, final: bool) -> tuple[list[str | ToolCall], str]:
        at = buffer.find(self.marker)
        if at < 0:
            keep = 0 if final else _held_prefix(buffer, self.marker)
            return [buffer[:len(buffer) - keep]], buffer[len(buffer) - keep:]
        if not final:  # the list is complete only at the end of the answer
            return [buffer[:at]], buffer[at:]
        try:
            value = json.loads(buffer[at + len(self.marker):])
        except ValueError:
            value = None
        calls = [_call(v) for v in value] if isinstance(value, list) else [None]
        if not calls or None in calls:
            return [buffer], ""
        return [buffer[:at], *calls], ""


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    tag = "<|python_tag|>"

    def grammar(self, tools: Sequence[Mapping[str, Any]], parallel: bool = True) -> str:
        return f"start: body\nbody: %json {json.dumps(call_schema(tools, 'parameters'))}"  # one call a turn

    def split(self, buffer: str, final: bool) -> tuple[list[str | ToolCall], str]:
        head = buffer.lstrip()
        maybe_call = head.startswith(("{", self.tag)) or (not head) or self.tag.startswith(head)
        if not maybe_call:
            return [buffer], ""
        if not final:
            return [], buffer
        body = head[len(self.tag):] if head.startswith(self.tag) else head
        try:
            call = _call(json.loads(body), arguments_key="parameters")
        except ValueError:
            call = None
        return [call or buffer], ""


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, MistralParser, Llama3JsonParser)}


def parser_for(chat_template: str | None) -> ToolParser | None:
    """The parser for the calls a chat template's model writes, or None if the template does
    not render tools or is of no family known here."""
    if not chat_template or "tools" not in chat_template:
        return None
    if HermesParser.start in chat_template:
        return HermesParser()
    if MistralParser.marker in chat_template:
        return MistralParser()
    if Llama3JsonParser.tag in chat_template or '"parameters"' in chat_template:
        return Llama3JsonParser()
    return None


def template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: an assistant call's ``arguments`` JSON string
    becomes an object (templates write it with ``tojson``). Raises ValueError, naming the
    message, where the arguments are not a JSON object."""
    out = []
    for i, message in enumerate(messages):
        message = dict(message)
        if message.get("tool_calls"):
            calls = []
            for j, call in enumerate(message["tool_calls"]):
                function = dict(call["function"])
                try:
                    args = json.loads(function["arguments"])
                except ValueError:
                    args = None
                if not isinstance(args, dict):
                    raise ValueError(f"messages.{i}.tool_calls.{j}.function.arguments is not a JSON object")
                function["arguments"] = args
                calls.append({**call, "function": function})
            message["tool_calls"] = calls
        out.append(message)
    return out
