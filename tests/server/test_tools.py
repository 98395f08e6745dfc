"""Tools through the server: the request fields and messages of a tool-calling conversation,
checked as OpenAI checks them, and tools rendered by the model's template (the tiny models
write no calls; what calls are read from text is tested in tests/test_tools.py, and a real
model's calls in the real-model tests)."""

from __future__ import annotations

import json

import openai
import pytest

from liveserver import API_KEY, TOOLS_CHAT_TEMPLATE, make_server, raw

WEATHER = {"type": "function", "function": {"name": "wx", "description": "weather in a city",
                                            "parameters": {"type": "object", "properties": {"x": {"type": "string"}},
                                                           "required": ["x"]}}}
CALLED = [{"role": "user", "content": "rome?"},
          {"role": "assistant", "content": None,
           "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "wx", "arguments": '{"x": "rome"}'}}]},
          {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


@pytest.fixture(scope="module")
def tools_server(one_torch_thread):
    with make_server(chat_template=TOOLS_CHAT_TEMPLATE) as live:
        yield live


def post(server, body: dict):
    return raw(server, "POST", "/v1/chat/completions", json.dumps({"max_tokens": 2, **body}))


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
      "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "a b"}}]},
     "tools.0.function.name"),
    ({"messages": [{"role": "tool", "content": "2"}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "c"}]}, "messages.0"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages.0"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": CALLED[1]["tool_calls"]}]}, "messages.0"),
    ({"messages": [{**CALLED[1], "tool_calls": [{**CALLED[1]["tool_calls"][0],
                                                 "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
])
def test_a_malformed_tool_request_is_a_400_naming_the_field(tools_server, body, param):
    status, _, data = post(tools_server, body)
    assert status == 400 and data["error"]["param"] == param, data


def test_tools_on_a_model_whose_template_renders_none_are_a_400(server):
    status, _, data = post(server, {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]})
    assert status == 400 and data["error"]["param"] == "tools" and "does not render tools" in data["error"]["message"]
    # tool_choice "none" sends no tools to the template: nothing to refuse
    status, _, data = post(server, {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
                                    "tool_choice": "none"})
    assert status == 200, data


def test_a_conversation_with_calls_and_their_results_is_answered(server, tools_server):
    for live in (server, tools_server):
        status, _, data = post(live, {"messages": CALLED})
        assert status == 200 and data["choices"][0]["message"]["role"] == "assistant", data


def test_tools_go_to_the_template_unless_tool_choice_is_none(tools_server):
    client = openai.OpenAI(base_url=tools_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "paris?"}]

    def prompt_tokens(**kwargs) -> int:
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0, **kwargs)
        assert r.choices[0].message.tool_calls is None  # the tiny model writes no call
        return r.usage.prompt_tokens

    bare = prompt_tokens()
    tokenizer = tools_server.runner.engine.target.tokenizer
    rendered = tokenizer.apply_chat_template(messages, tools=[WEATHER])
    assert prompt_tokens(tools=[WEATHER]) == len(rendered) > bare
    assert prompt_tokens(tools=[WEATHER], tool_choice="none") == bare
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0,
                                            tools=[WEATHER], stream=True)
    chunks = list(stream)
    assert all(c.choices[0].delta.tool_calls is None for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"
