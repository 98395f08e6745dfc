"""Structured outputs through the official ``openai`` client: ``chat.completions.parse`` with a
pydantic model, ``json_object``, vLLM's guided extras, the same answer with speculation on and
off, and a 400 naming the field for a grammar that does not compile."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict

from liveserver import API_KEY, CHARS, K, char_tokenizer, make_server
from verispec import constraints
from verispec.constraints import Grammar

JSON_CHARS = CHARS + list('{}[]"_')
SPECULATIVE = {"speculative": {"num_speculative_tokens": K}}
PLAIN = {"speculative": {"enabled": False}}
MESSAGES = [{"role": "user", "content": "a b c"}]


class Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")  # no further keys (the client's parse adds this too)

    color: Literal["red", "green", "blue"]
    ok: bool
    size: Literal["s", "m", "l"]


@pytest.fixture(scope="module")
def client(one_torch_thread):
    with make_server(chars=JSON_CHARS) as live:  # a vocabulary that can spell JSON
        yield openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.mark.parametrize("extra_body", [SPECULATIVE, PLAIN], ids=["speculative", "plain"])
def test_parse_returns_the_pydantic_object(client, extra_body):
    r = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=Answer, temperature=0.0,
                                      extra_body=extra_body)
    assert isinstance(r.choices[0].message.parsed, Answer)
    assert r.choices[0].finish_reason == "stop"


def test_greedy_structured_answer_is_the_same_with_and_without_speculation(client):
    def answer(extra_body):
        r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0.0, extra_body=extra_body,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "answer", "schema": Answer.model_json_schema()}})
        return r.choices[0].message.content, r.model_extra["speculative_stats"]

    (spec, stats), (plain, _) = answer(SPECULATIVE), answer(PLAIN)
    assert spec == plain and Answer.model_validate_json(spec)
    assert stats["drafted"] > 0


def test_json_object_on_completions(client):
    r = client.completions.create(model="tiny", prompt="a b c", temperature=0.0, max_tokens=60,
                                  extra_body={"response_format": {"type": "json_object"}, **SPECULATIVE})
    text = r.choices[0].text
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # the random model's keys run long: out of tokens, the text is a prefix of a JSON object
        tok = char_tokenizer(JSON_CHARS)
        ids = tok.encode(text, add_special_tokens=False)
        matcher = constraints.start(Grammar.json_object(), tok, len(tok))
        assert text.startswith("{") and matcher.allowed_prefix(ids) == len(ids)


def test_guided_regex_and_choice(client):
    r = client.completions.create(model="tiny", prompt="a b c", temperature=0.0, max_tokens=40,
                                  extra_body={"guided_regex": "(ab|c){1,4} [0-9]{2,4}", **SPECULATIVE})
    assert re.fullmatch("(ab|c){1,4} [0-9]{2,4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, seed=3,
                                       extra_body={"guided_choice": ["yes", "no", "maybe"], **SPECULATIVE})
    assert r.choices[0].message.content in ("yes", "no", "maybe")


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format", "invalid JSON schema"),
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"guided_grammar": "start: foo"}, "guided_grammar", "foo"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "ignore_eos"),
])
def test_a_bad_grammar_is_a_400_naming_the_field(client, body, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MESSAGES, extra_body=body)
    assert e.value.body["param"] == param and message in e.value.body["message"]


def test_a_grammar_the_vocabulary_cannot_spell_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="a b c", extra_body={"guided_regex": "é+"})
    assert "allows no token" in e.value.body["message"]
