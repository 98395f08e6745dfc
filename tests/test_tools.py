"""Tool calls read out of generated text: each family's parser, whole and streamed in pieces of
every size, and conversations' calls handed to chat templates."""

from __future__ import annotations

import json

import pytest

from verispec.tools import PARSERS, ToolCall, parser_for, template_messages

QWEN_LIKE = "{% if tools %}... within <tool_call></tool_call> XML tags ...{% endif %}"

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>')
MISTRAL = 'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ' \
          '{"name": "add", "arguments": {"a": 17, "b": 25}}]'
LLAMA3 = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
EXPECTED = [("get_weather", {"city": "Paris"}), ("add", {"a": 17, "b": 25})]


def calls(found: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in found]


def streamed(parser, text: str, size: int, parallel: bool = True) -> list:
    stream = parser.stream(parallel)
    items = []
    for i in range(0, len(text), size):
        items += stream.feed(text[i:i + size])
    return items + stream.finish()


@pytest.mark.parametrize(("family", "text", "content", "expected"), [
    ("hermes", HERMES, "Let me check.\n", EXPECTED),
    ("mistral", MISTRAL, "Checking. ", EXPECTED),
    ("llama3_json", LLAMA3, None, EXPECTED[:1]),
])
def test_each_family_reads_its_calls_and_the_text_around_them(family, text, content, expected):
    parser = PARSERS[family]()
    got_content, got = parser.parse(text)
    assert got_content == content and calls(got) == expected
    assert len({c.id for c in got}) == len(got) and all(c.id.startswith("call_") for c in got)


@pytest.mark.parametrize("family", ["hermes", "mistral", "llama3_json"])
@pytest.mark.parametrize("text", [HERMES, MISTRAL, LLAMA3, "plain text, no call < here", "a <tool", "{not json"])
def test_a_stream_in_pieces_of_any_size_settles_as_the_whole_text_does(family, text):
    parser = PARSERS[family]()
    content, whole = parser.parse(text)
    for size in range(1, 12):
        items = streamed(parser, text, size)
        assert calls([i for i in items if isinstance(i, ToolCall)]) == calls(whole), size
        text_out = "".join(i for i in items if isinstance(i, str))
        assert text_out == (content or "") or (content is None and not text_out.strip()), size


def test_text_that_is_not_a_valid_call_stays_content_as_written():
    parser = PARSERS["hermes"]()
    for text in ["<tool_call>\n{broken\n</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                 '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "<tool_call>{\"name\": \"f\""]:
        assert parser.parse(text) == (text, [])


def test_a_call_cut_off_before_its_closing_tag_is_still_read_when_its_json_is_whole():
    content, got = PARSERS["hermes"]().parse('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n')
    assert content is None and calls(got) == [("f", {"x": 1})]


def test_a_stream_holds_back_only_what_may_begin_a_call():
    stream = PARSERS["hermes"]().stream()
    assert stream.feed("The answer: a <tool") == ["The answer: a "]
    assert stream.feed("box> b") == ["<toolbox> b"]


def test_without_parallel_calls_only_the_first_call_is_kept():
    parser = PARSERS["hermes"]()
    _, got = parser.parse(HERMES, parallel=False)
    assert calls(got) == EXPECTED[:1]
    assert calls([i for i in streamed(parser, HERMES, 5, parallel=False) if isinstance(i, ToolCall)]) == EXPECTED[:1]


def test_arguments_written_as_a_json_string_are_read_as_the_object():
    _, got = PARSERS["hermes"]().parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>')
    assert calls(got) == [("f", {"x": 2})]


def test_the_parser_follows_the_template_family():
    assert parser_for(QWEN_LIKE).name == "hermes"
    assert parser_for("{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]{% endif %}").name == "mistral"
    assert parser_for('{% if tools %}{"name": function name, "parameters": ...}<|python_tag|>{% endif %}').name \
        == "llama3_json"
    assert parser_for("{% for m in messages %}{{ m.content }}{% endfor %}") is None  # renders no tools
    assert parser_for("{% if tools %}<function=...>{% endif %}") is None  # a format not known here
    assert parser_for(None) is None


def test_an_assistant_calls_arguments_reach_the_template_as_an_object():
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                      "function": {"name": "f", "arguments": '{"x": 1}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    out = template_messages(messages)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # the input is left as it was
    assert out[0] == messages[0] and out[2] == messages[2]
    bad = [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                 "function": {"name": "f", "arguments": "[1, 2]"}}]}]
    with pytest.raises(ValueError, match=r"messages\.0\.tool_calls\.0\.function\.arguments"):
        template_messages(bad)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"]}}}]


@pytest.fixture(scope="module")
def matcher_for(smollm):
    """An llguidance matcher on SmolLM2's real vocabulary for a Lark grammar."""
    import llguidance.hf
    from llguidance import LLMatcher

    tokenizer = llguidance.hf.from_tokenizer(smollm.tokenizer.hf)

    def build(grammar: str):
        matcher = LLMatcher(tokenizer, LLMatcher.grammar_from_lark(grammar), log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher
    return build


def accepts(matcher, ids: list[int]) -> bool:
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


@pytest.mark.parametrize(("family", "text"), [("hermes", HERMES[len("Let me check.\n"):]),
                                               ("mistral", MISTRAL[len("Checking. "):]),
                                               ("llama3_json", LLAMA3[len("<|python_tag|>"):])])
def test_the_grammar_of_a_required_call_accepts_what_its_parser_reads_as_calls(smollm, matcher_for, family, text):
    """What a family's grammar lets a model write parses back into calls with valid arguments,
    and a call to a function that is not offered, or with arguments off their schema, is
    refused."""
    parser = PARSERS[family]()
    parallel = family != "llama3_json"
    encode = smollm.tokenizer.encode
    assert accepts(matcher_for(parser.grammar(TOOLS, parallel)), encode(text, add_special_tokens=False))
    content, got = parser.parse(text)
    assert content is None and calls(got) == (EXPECTED if parallel else EXPECTED[:1])
    wrong_name = text.replace("get_weather", "get_time")
    assert not accepts(matcher_for(parser.grammar(TOOLS, parallel)), encode(wrong_name, add_special_tokens=False))
    wrong_args = text.replace('"Paris"', "12")
    assert not accepts(matcher_for(parser.grammar(TOOLS, parallel)), encode(wrong_args, add_special_tokens=False))
    if family == "hermes":  # one call only without parallel calls
        assert not accepts(matcher_for(parser.grammar(TOOLS, False)), encode(text, add_special_tokens=False))
