"""The OpenAI API as the official ``openai`` client sees it, against a live server."""

from __future__ import annotations

import http.client
import json
import logging

import openai
import pytest

from liveserver import API_KEY, CHARS, K, MAX_MODEL_LEN, SPECIALS, raw

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]


def test_chat_completion_has_usage_and_speculative_stats(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello there"}],
                                       max_tokens=10, **GREEDY)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stats = r.model_extra["speculative_stats"]
    assert stats["drafted"] >= stats["accepted"] >= 0 and stats["rounds"] >= 1
    assert 1.0 <= stats["mean_acceptance_length"] <= K + 1


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streaming_gives_the_same_text_as_one_response(client, kind):
    if kind == "chat":
        args = dict(model="tiny", messages=[{"role": "user", "content": "stream me"}], max_tokens=12, **GREEDY)
        whole = client.chat.completions.create(**args).choices[0].message.content
        chunks = list(client.chat.completions.create(stream=True, **args))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        args = dict(model="tiny", prompt="stream me", max_tokens=12, **GREEDY)
        whole = client.completions.create(**args).choices[0].text
        chunks = list(client.completions.create(stream=True, **args))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole and len(chunks) >= 2
    last = chunks[-1]
    assert last.choices[0].finish_reason in ("stop", "length")
    assert last.usage.completion_tokens >= 1
    assert "drafted" in last.model_extra["speculative_stats"]


def test_sse_stream_ends_with_done(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = json.dumps({"prompt": "abc", "max_tokens": 4, "stream": True, **GREEDY})
    conn.request("POST", "/v1/completions", body=body,
                 headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
    events = [line for line in resp.read().decode().split("\n\n") if line]
    conn.close()
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] >= 1


def test_stop_string_cuts_the_text_before_it(client):
    args = dict(model="tiny", prompt="the stop test", max_tokens=24, **GREEDY)
    free = client.completions.create(**args).choices[0].text
    assert len(free) >= 12, free
    stop = free[8:10]
    cut = free[: free.index(stop)]
    r = client.completions.create(stop=[stop, "never-there"], **args)
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **args))
    assert streamed == cut


def test_seed_reproduces_a_sampled_completion(client):
    args = dict(model="tiny", prompt="sample this", max_tokens=8, temperature=1.0)
    a = client.completions.create(seed=7, **args).choices[0].text
    b = client.completions.create(seed=7, **args).choices[0].text
    others = {client.completions.create(seed=s, **args).choices[0].text for s in (8, 9)}
    assert a == b
    assert others != {a}  # seeds matter


def test_per_request_speculative_extra(client):
    args = dict(model="tiny", prompt="extra", max_tokens=12, **GREEDY)
    on = client.completions.create(extra_body={"speculative": {"num_speculative_tokens": K}}, **args)
    off = client.completions.create(extra_body={"speculative": {"enabled": False}}, **args)
    one = client.completions.create(extra_body={"speculative": {"num_speculative_tokens": 1}}, **args)
    assert on.choices[0].text == off.choices[0].text == one.choices[0].text
    assert on.model_extra["speculative_stats"]["drafted"] > 0
    assert off.model_extra["speculative_stats"]["drafted"] == 0
    s1 = one.model_extra["speculative_stats"]
    assert 0 < s1["drafted"] <= s1["rounds"]
    with pytest.raises(openai.BadRequestError, match="num_speculative_tokens"):
        client.completions.create(extra_body={"speculative": {"num_speculative_tokens": K + 1}}, **args)


@pytest.mark.parametrize(
    ("kwargs", "message", "param"),
    [
        ({"n": 200}, "n: Input should be less than or equal to 128", "n"),
        ({"logprobs": 21}, "logprobs: Input should be less than or equal to 20", "logprobs"),
        ({"max_tokens": MAX_MODEL_LEN}, "maximum context length", "max_tokens"),
        ({"prompt": "x" * MAX_MODEL_LEN}, "maximum context length", "prompt"),
        ({"temperature": "hot"}, "temperature", "temperature"),
        ({"top_p": 0}, "top_p", "top_p"),
        ({"extra_body": {"speculative": {"enabled": "maybe"}}}, "speculative.enabled", "speculative.enabled"),
        ({"extra_body": {"bogus_field": 1}}, "bogus_field", "bogus_field"),
        ({"prompt": ""}, "prompt: String should have at least 1 character", "prompt"),
        ({"prompt": []}, "prompt: List should have at least 1 item", "prompt"),
        ({"prompt": [1, -2]}, "prompt.1: Input should be greater than or equal to 0", "prompt.1"),
        ({"prompt": [1, 10**6]}, "prompt token ids must be in [0, ", "prompt"),
        ({"prompt": [10**6] * MAX_MODEL_LEN}, "maximum context length", "prompt"),  # counted before the ids are checked
        ({"seed": 2**64}, "seed: Input should be less than or equal to 9223372036854775807", "seed"),
        ({"seed": -(2**63) - 1}, "seed: Input should be greater than or equal to -9223372036854775808", "seed"),
        ({"extra_body": {"top_k": 2**63}}, "top_k: Input should be less than or equal to 2147483647", "top_k"),
        ({"stop": ["a"] * 17}, "stop: List should have at most 16 items", "stop"),
        ({"stop": "a" * 1001}, "stop: String should have at most 1000 characters", "stop"),
        ({"stop": ["ok", ""]}, "stop.1: String should have at least 1 character", "stop.1"),
        ({"max_tokens": "5"}, "max_tokens: Input should be a valid integer", "max_tokens"),
        ({"stream": 1}, "stream: Input should be a valid boolean", "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options is only allowed when stream is true",
         "stream_options"),
    ],
)
def test_bad_input_is_a_400_with_an_openai_error_body(client, kwargs, message, param):
    """The error names the field in ``param`` too, as OpenAI's errors do."""
    args = {"model": "tiny", "prompt": "hi", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**args)
    err = info.value.body
    assert info.value.status_code == 400 and message in err["message"], err
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'{"prompt": 5}', b"", b'{"prompt": "\xe9"}',
                                  b'{"prompt": "a", "max_tokens": -1}', b'{"prompt": [1, "a"]}'])
def test_malformed_bodies_are_400_never_500(server, body):
    status, _, data = raw(server, "POST", "/v1/completions", body)
    assert status == 400 and data["error"]["message"] and data["error"]["type"] == "invalid_request_error", data


def test_a_body_that_is_not_json_says_where_and_names_no_field(server):
    status, _, data = raw(server, "POST", "/v1/completions", b'{"prompt": "a",,}')
    assert status == 400 and data["error"]["param"] is None, data
    assert data["error"]["message"].startswith("invalid request: body: JSON decode error at character 15: "), data


def test_n_null_means_one_choice_as_in_openais_api(server):
    for n in (None, 1):
        status, _, data = raw(server, "POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2, "n": n}))
        assert status == 200 and len(data["choices"]) == 1, data


def test_stream_options_need_stream_true(server):
    """As OpenAI answers: ``stream_options`` with ``stream`` false or absent is a 400 naming it;
    null is as good as absent."""
    for extra in ({}, {"stream": False}):
        body = {"prompt": "hi", "max_tokens": 2, "stream_options": {"include_usage": True}, **extra}
        status, _, data = raw(server, "POST", "/v1/completions", json.dumps(body))
        assert status == 400 and data["error"]["param"] == "stream_options", data
    status, _, data = raw(server, "POST", "/v1/completions",
                          json.dumps({"prompt": "hi", "max_tokens": 2, "stream_options": None}))
    assert status == 200, data
    status, _, text = raw(server, "POST", "/v1/completions", json.dumps(
        {"prompt": "hi", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}))
    assert status == 200 and text.endswith("data: [DONE]\n\n"), text


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "user", "content": "hi", "colour": "red"}, "messages.0.colour"),
    ({"role": "user", "content": [{"type": "text", "text": "hi", "weight": 2}]}, "messages.0.content.0.weight"),
])
def test_unknown_keys_inside_chat_messages_are_a_400_naming_the_key(server, message, param):
    body = {"messages": [message], "max_tokens": 2}
    status, _, data = raw(server, "POST", "/v1/chat/completions", json.dumps(body))
    assert status == 400 and data["error"]["param"] == param, data
    assert f"{param}: Extra inputs are not permitted" in data["error"]["message"], data


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", '{"prompt": "a\\ud800", "max_tokens": 2}'),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\udfff"], "max_tokens": 2}'),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}], "max_tokens": 2}'),
])
def test_a_lone_surrogate_is_a_400_not_a_tokenizer_crash(server, path, body):
    status, headers, data = raw(server, "POST", path, body)
    assert status == 400 and headers["content-type"] == "application/json", data
    assert data["error"]["type"] == "invalid_request_error" and "lone surrogate" in data["error"]["message"]


def test_wrong_method_is_405_with_allow(server):
    status, headers, data = raw(server, "DELETE", "/v1/completions")
    assert status == 405 and headers["allow"] == "POST"
    assert data["error"]["message"] == "Method Not Allowed"


def test_an_unexpected_error_is_a_logged_500_with_an_error_body(server, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("the tokenizer broke")

    monkeypatch.setattr(server.runner.engine.target.tokenizer, "encode", broken)
    with caplog.at_level(logging.ERROR, logger="verispec.server.app"):
        status, headers, data = raw(server, "POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}))
    assert status == 500 and headers["content-type"] == "application/json"
    assert data == {"error": {"message": "internal server error", "type": "server_error", "param": None,
                              "code": "internal_error"}}  # nothing of the exception leaks
    logged = [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], RuntimeError)]
    assert len(logged) == 1 and "POST /v1/completions" in logged[0].getMessage()
    monkeypatch.undo()
    status, _, data = raw(server, "POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}))
    assert status == 200 and data["usage"]["completion_tokens"] == 2


def test_openapi_document_matches_the_server(server):
    status, _, doc = raw(server, "GET", "/openapi.json", headers={"Authorization": ""})
    assert status == 200
    paths, schemas = doc["paths"], doc["components"]["schemas"]
    envelope = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, kind in (("/v1/completions", "CompletionResponse"), ("/v1/chat/completions", "ChatCompletionResponse")):
        op = paths[path]["post"]
        responses = op["responses"]
        assert set(responses) == {"200", "400", "401", "404", "408", "413", "429", "500", "503", "504"}
        for code in set(responses) - {"200"}:
            assert responses[code]["content"] == {"application/json": {"schema": envelope}}, code
        assert responses["200"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{kind}"}
        assert "text/event-stream" in responses["200"]["content"]
        assert op["security"] == [{"bearer": []}]
    assert set(paths["/v1/models"]["get"]["responses"]) == {"200", "401", "408", "413", "500"}
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    request = schemas["CompletionRequest"]["properties"]
    assert {"type": "string", "minLength": 1} in request["prompt"]["anyOf"]
    assert {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1} in request["prompt"]["anyOf"]
    assert request["seed"]["anyOf"][0] == {"type": "integer", "format": "int64"}
    assert request["top_k"]["maximum"] == 2**31 - 1
    stop_string = {"type": "string", "minLength": 1, "maxLength": 1000}
    assert request["stop"]["anyOf"][:2] == [stop_string, {"type": "array", "items": stop_string, "maxItems": 16}]
    assert request["n"]["anyOf"] == [{"type": "integer", "minimum": 1, "maximum": 128}, {"type": "null"}]
    assert request["max_tokens"]["anyOf"][0] == {"type": "integer", "minimum": 1}

    def keys(node):  # every key of every object in the document
        if isinstance(node, dict):
            yield from node
            for value in node.values():
                yield from keys(value)
        elif isinstance(node, list):
            for value in node:
                yield from keys(value)

    assert not {"ge", "le", "gt", "lt"} & set(keys(doc))  # pydantic's names, which JSON Schema ignores


def test_chat_without_messages_is_400(server):
    status, _, data = raw(server, "POST", "/v1/chat/completions", json.dumps({"messages": []}))
    assert status == 400 and "messages" in data["error"]["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist") as info:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert info.value.body["param"] == "model"


def test_a_chat_too_long_for_the_context_names_the_field_at_fault(client):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="maximum context length") as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x" * MAX_MODEL_LEN}])
    assert info.value.body["param"] == "messages"
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError, match="maximum context length") as info:
            client.chat.completions.create(model="tiny", messages=messages, **{field: MAX_MODEL_LEN})
        assert info.value.body["param"] == field


@pytest.mark.parametrize("key", [None, "wrong-key", API_KEY + "x"])
def test_wrong_or_missing_api_key_is_401(server, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {"Authorization": ""}
    status, _, data = raw(server, "GET", "/v1/models", headers=headers)
    assert status == 401 and data["error"]["type"] == "authentication_error"


def test_health_and_metrics_need_no_key(server, client):
    client.completions.create(model="tiny", prompt="metrics", max_tokens=6, **GREEDY)
    status, _, data = raw(server, "GET", "/health", headers={"Authorization": ""})
    assert status == 200 and data == {"status": "ok"}
    status, headers, text = raw(server, "GET", "/metrics", headers={"Authorization": ""})
    assert status == 200
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "generation_tokens_total"):
        assert values["verispec:" + name] > 0, name
    per_pos = sum(v for n, v in values.items()
                  if n.startswith("verispec:spec_decode_num_accepted_tokens_per_pos_total{"))
    assert per_pos == values["verispec:spec_decode_num_accepted_tokens_total"]
    assert values['verispec:time_to_first_token_seconds_count'] > 0
    assert values['verispec:inter_token_latency_seconds_count'] > 0
    assert "verispec:num_requests_waiting" in values and "verispec:num_requests_running" in values
    assert any(n.startswith("verispec:request_success_total") for n in values)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_include_usage_sends_usage_in_a_last_chunk_without_choices(client, kind):
    args = dict(model="tiny", max_tokens=5, stream=True, stream_options={"include_usage": True}, **GREEDY)
    if kind == "chat":
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "usage"}], **args))
    else:
        chunks = list(client.completions.create(prompt="usage", **args))
    *content, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert last.usage.total_tokens == last.usage.prompt_tokens + 5
    assert all(c.usage is None for c in content)  # usage comes once, as OpenAI sends it
    assert content[-1].choices[0].finish_reason == "length"


def test_stop_token_ids_end_the_completion_without_their_text(client):
    args = dict(model="tiny", prompt="stop token", max_tokens=16, **GREEDY)
    free = client.completions.create(**args).choices[0].text
    char = free[6]
    token = len(SPECIALS) + CHARS.index(char)  # the tiny server's tokenizer: one id per character
    r = client.completions.create(**args, extra_body={"stop_token_ids": [token], "ignore_eos": True})
    assert r.choices[0].text == free[: free.index(char)]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == free.index(char) + 1  # the stop token is counted


def test_max_completion_tokens_bounds_a_chat_answer(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "bounded"}],
                                       max_completion_tokens=3, **GREEDY)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
