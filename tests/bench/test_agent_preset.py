"""The agent benchmark's workload, fake tools and conversation loop (no model, no server: a
client that answers from a script)."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import jsonschema
import pytest

from verispec.bench.presets import agent


def test_the_workload_is_well_formed():
    convs = agent.conversations()
    assert len(convs) >= 20
    assert len({c["id"] for c in convs}) == len(convs)
    for name, tool in agent.TOOLS.items():
        jsonschema.Draft202012Validator.check_schema(tool["parameters"])
        assert callable(getattr(agent.Workspace, name))
    for c in convs:
        assert c["tools"] and set(c["tools"]) <= set(agent.TOOLS), c["id"]
        assert sum(t["calls"] for t in c["turns"]) >= 1, c["id"]
        for t in c["turns"]:
            assert t["user"] and t["calls"] >= 0
            if "answer_schema" in t:
                jsonschema.Draft202012Validator.check_schema(t["answer_schema"])
    assert agent.conversations(3) == convs[:3]


def test_the_fake_tools_are_deterministic_and_stateful():
    a, b = agent.Workspace(), agent.Workspace()
    for w in (a, b):
        w.call("write_file", {"path": "utils/stats.py", "content": "def f(:\n"})
    assert a.call("run_tests", {"path": "utils/stats.py"}) == b.call("run_tests", {"path": "utils/stats.py"})
    assert json.loads(a.call("run_tests", {"path": "utils/stats.py"}))["failed"] == 1
    assert json.loads(a.call("read_file", {"path": "utils/stats.py"}))["content"] == "def f(:\n"
    assert json.loads(agent.Workspace().call("run_tests", {"path": "utils/stats.py"})) == {"passed": 2, "failed": 0}
    assert "no such file" in json.loads(a.call("read_file", {"path": "nope.py"}))["error"]
    assert a.call("get_weather", {"city": "Paris", "unit": "celsius"}) == b.call(
        "get_weather", {"city": "Paris", "unit": "celsius"})
    a.call("update_order", {"order_id": "A-1042", "status": "shipped"})
    assert json.loads(a.call("lookup_order", {"order_id": "a-1042"}))["status"] == "shipped"
    assert json.loads(b.call("lookup_order", {"order_id": "A-1042"}))["status"] == "pending"
    assert json.loads(a.call("convert_currency", {"amount": 100, "source": "USD", "target": "EUR"}))["amount"] == 92.0
    assert json.loads(a.call("search_code", {"query": "TODO"}))["matches"][0].startswith("utils/text.py:")


class ScriptedClient:
    """Answers chat requests from a list, recording what each request carried."""

    def __init__(self, answers: list) -> None:
        self.answers = list(answers)
        self.requests: list[dict] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    def create(self, **kwargs):
        self.requests.append(json.loads(json.dumps(kwargs)))
        message, finish = self.answers.pop(0)
        return SimpleNamespace(usage=SimpleNamespace(completion_tokens=7),
                               choices=[SimpleNamespace(message=message, finish_reason=finish)])


def _call(name: str, arguments: str, i: int = 0):
    return SimpleNamespace(id=f"call-{i}", function=SimpleNamespace(name=name, arguments=arguments))


def test_a_conversation_runs_calls_sends_results_and_checks_json():
    conv = {"id": "t", "tools": ["get_weather", "lookup_order"], "turns": [
        {"user": "weather?", "calls": 2},
        {"user": "order?", "calls": 1, "answer_schema": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                          "required": ["x"]}},
    ]}
    client = ScriptedClient([
        (SimpleNamespace(content=None, tool_calls=[_call("get_weather", '{"city": "Oslo", "unit": "celsius"}')]), "tool_calls"),
        (SimpleNamespace(content=None, tool_calls=[_call("get_weather", '{"city": "Oslo"}', 1)]), "tool_calls"),  # invalid
        (SimpleNamespace(content="It is cold.", tool_calls=None), "stop"),
        (SimpleNamespace(content=None, tool_calls=None), "length"),  # cut: the turn's calls end
        (SimpleNamespace(content='{"x": 3}', tool_calls=None), "stop"),
    ])
    run = agent.run_conversation(client, conv, 64, 32)
    assert run["requests"] == 5 and run["tokens"] == 35
    assert (run["constrained"], run["valid"], run["cut"]) == (3, 2, 1)
    assert run["produced"][0] == ["call", "get_weather", '{"city": "Oslo", "unit": "celsius"}']
    assert run["produced"][-1] == ["answer", '{"x": 3}']
    first, second, answer = client.requests[0], client.requests[1], client.requests[2]
    assert first["tool_choice"] == "required" and first["parallel_tool_calls"] is False
    assert answer["tool_choice"] == "none"
    result = json.loads(second["messages"][-1]["content"])
    assert second["messages"][-1]["role"] == "tool" and result["city"] == "Oslo"
    assert json.loads(answer["messages"][-1]["content"]) == {"error": "invalid call"}
    assert client.requests[4]["response_format"]["type"] == "json_schema" and "tools" not in client.requests[4]


def test_the_summary_judges_identity_validity_and_the_llama_ratio():
    def run(cid, produced, tokens, wall, valid=1):
        return {"id": cid, "produced": produced, "tokens": tokens, "wall_s": wall, "requests": 1,
                "constrained": 1, "valid": valid, "cut": 0}

    runs = {"verispec": [run("a", [["answer", "x"]], 100, 1.0), run("b", [["answer", "y"]], 100, 1.0)],
            "verispec-plain": [run("a", [["answer", "x"]], 100, 2.0), run("b", [["answer", "z"]], 100, 2.0)],
            "llama-plain": [run("a", [], 50, 1.0), run("b", [], 50, 1.0)],
            "llama-ngram-mod": [run("a", [], 80, 1.0), run("b", [], 80, 1.0, valid=0)]}
    args = argparse.Namespace(target="t", speculative={"method": "suffix"}, threads=2, goal_vs_llama=2.0)
    report = agent.summarise(args, runs, 0.0)
    assert report["methods"]["verispec"]["identical"] == 1
    assert report["methods"]["verispec"]["vs_verispec_plain"] == pytest.approx(2.0)
    goals = report["goals"]
    assert goals["vs_best_llama_server"]["best"] == "llama-ngram-mod"
    assert goals["vs_best_llama_server"]["ratio"] == pytest.approx(100 / 80) and not goals["vs_best_llama_server"]["met"]
    assert goals["vs_best_llama_server"]["quickest"] == "llama-plain"
    assert goals["vs_best_llama_server"]["conversation_time_ratio"] == pytest.approx(1.0)
    assert goals["identical"]["met"] is False and goals["schema_valid"]["met"] is True
    agent.print_table(report)


def test_unknown_llama_modes_are_refused(capsys):
    with pytest.raises(SystemExit):
        agent.parse_args(["--llama-modes", "plain,turbo"])
    assert "unknown --llama-modes turbo" in capsys.readouterr().err


def test_a_server_that_does_not_force_calls_gets_the_calls_schema_instead():
    conv = {"id": "t", "tools": ["get_weather"], "turns": [{"user": "weather?", "calls": 1}]}
    client = ScriptedClient([
        (SimpleNamespace(content='{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}',
                         tool_calls=None), "stop"),
        (SimpleNamespace(content="Cold.", tool_calls=None), "stop"),
    ])
    run = agent.run_conversation(client, conv, 64, 32, calls_by_schema=True)
    assert run["produced"][0] == ["call", "get_weather", '{"city": "Oslo", "unit": "celsius"}']
    assert (run["constrained"], run["valid"]) == (1, 1)
    first, answer = client.requests
    assert "tool_choice" not in first and first["tools"][0]["function"]["name"] == "get_weather"
    schema = first["response_format"]["json_schema"]["schema"]
    assert "x-guidance" not in schema and schema["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    assert answer["messages"][1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert answer["messages"][2]["role"] == "tool" and json.loads(answer["messages"][2]["content"])["city"] == "Oslo"
