"""Tool calling end to end on a real model (Qwen2.5-Coder-0.5B, whose template writes hermes
calls), through the official ``openai`` client and an agent framework (pydantic-ai): a call
forced by ``tool_choice``, the tool's result sent back, and the model's final answer; streamed
and not; the same tokens with speculation on and off."""

from __future__ import annotations

import json

import openai
import pytest

from verispec.config import SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.server.app import build_app
from verispec.server.serve import BackgroundServer

pytestmark = pytest.mark.slow

KEY = "tools-key"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]
GREEDY = dict(temperature=0.0, max_tokens=48)
PLAIN = {"speculative": {"enabled": False}}


@pytest.fixture(scope="module")
def live(qwen_draft, one_torch_thread):
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=4, adaptive=False)
    engine = Engine(qwen_draft, spec, max_model_len=1024, max_num_seqs=2)
    with BackgroundServer(build_app(engine, "qwen", api_key=KEY)) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def streamed(client, **kwargs):
    """(content, tool calls as dicts, finish reason) of a streamed chat answer, assembled as the
    openai client's users do: calls by their index, arguments concatenated."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="qwen", stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_a_forced_call_its_result_and_the_final_answer(client):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        first = client.chat.completions.create(model="qwen", messages=QUESTION, tools=[WEATHER, ADD],
                                               tool_choice=choice, **GREEDY)
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and message.content is None
        (call,) = message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        plain = client.chat.completions.create(model="qwen", messages=QUESTION, tools=[WEATHER, ADD],
                                               tool_choice=choice, extra_body=PLAIN, **GREEDY)
        assert plain.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
        assert first.model_extra["speculative_stats"]["drafted"] > 0  # n-grams drafted under the grammar

    content, calls, finish = streamed(client, messages=QUESTION, tools=[WEATHER, ADD], tool_choice="required",
                                      **GREEDY)
    assert finish == "tool_calls" and not content.strip()
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]

    turns = QUESTION + [message.model_dump(exclude_none=True),
                        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18, "sky": "cloudy"})}]
    final = client.chat.completions.create(model="qwen", messages=turns, tools=[WEATHER, ADD], **GREEDY)
    answer = final.choices[0].message
    assert final.choices[0].finish_reason == "stop" and answer.tool_calls is None
    assert "18" in answer.content
    plain = client.chat.completions.create(model="qwen", messages=turns, tools=[WEATHER, ADD], extra_body=PLAIN,
                                           **GREEDY)
    assert plain.choices[0].message.content == answer.content
    content, calls, finish = streamed(client, messages=turns, tools=[WEATHER, ADD], **GREEDY)
    assert (content, calls, finish) == (answer.content, [], "stop")


def test_a_pydantic_ai_agent_with_two_tools_runs_to_its_final_answer(live):
    """pydantic-ai asks for a structured answer through an output tool, so every turn is a call
    (tool_choice required): the agent calls both tools, gets their results and ends with its
    output tool's arguments as the answer."""
    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Report(BaseModel):
        city: str
        temperature_c: int

    model = OpenAIChatModel("qwen", provider=OpenAIProvider(base_url=live.url + "/v1", api_key=KEY))
    agent = Agent(model, output_type=Report, model_settings={"temperature": 0.0, "max_tokens": 64},
                  instructions="First call get_weather for the city, then add 0 to its temperature, then report.")
    called: list[str] = []

    @agent.tool_plain
    def get_weather(city: str) -> dict:
        """The current weather in a city."""
        called.append("get_weather")
        return {"city": city, "temp_c": 18}

    @agent.tool_plain
    def add(a: int, b: int) -> int:
        """Add two integers."""
        called.append("add")
        return a + b

    result = agent.run_sync("What is the temperature in Paris?")
    assert isinstance(result.output, Report)
    assert set(called) == {"get_weather", "add"}
    print(f"\npydantic-ai: tools called {called}, output {result.output!r}")
