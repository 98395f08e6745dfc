"""Logprobs through the official ``openai`` client: the shapes it parses, for chat and
completions, streamed and not, and the same floats with speculation on and off."""

from __future__ import annotations

import math

import openai
import pytest

from liveserver import API_KEY, K

GREEDY = {"temperature": 0.0}
SPECULATIVE = {"speculative": {"num_speculative_tokens": K}}  # drafts every round (the tiny drafter rarely pays)
PLAIN = {"speculative": {"enabled": False}}
PROMPT = "a b c d e f"  # some of the tiny drafter's drafts are accepted, for chat and completions
TOP = 3
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def chat(client, stream=False, extra_body=SPECULATIVE, **kwargs):
    """(content, logprobs content entries as plain dicts, speculative stats) of one chat answer."""
    args = dict(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS,
                logprobs=True, top_logprobs=TOP, extra_body=extra_body, **GREEDY, **kwargs)
    if not stream:
        r = client.chat.completions.create(**args)
        return (r.choices[0].message.content, [e.model_dump() for e in r.choices[0].logprobs.content],
                r.model_extra["speculative_stats"])
    text, entries, stats = "", [], None
    for chunk in client.chat.completions.create(stream=True, **args):
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        if choice.logprobs is not None:
            entries += [e.model_dump() for e in choice.logprobs.content]
        stats = chunk.model_extra.get("speculative_stats") or stats
    return text, entries, stats


def completion(client, stream=False, extra_body=SPECULATIVE):
    """(text, logprobs as a dict of lists, speculative stats) of one completion."""
    args = dict(model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, logprobs=TOP, extra_body=extra_body,
                **GREEDY)
    if not stream:
        r = client.completions.create(**args)
        return r.choices[0].text, r.choices[0].logprobs.model_dump(), r.model_extra["speculative_stats"]
    text, merged, stats = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}, None
    for chunk in client.completions.create(stream=True, **args):
        choice = chunk.choices[0]
        text += choice.text
        if choice.logprobs is not None:
            for key in merged:
                merged[key] += getattr(choice.logprobs, key)
        stats = chunk.model_extra.get("speculative_stats") or stats
    return text, merged, stats


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_logprobs_have_openais_shape_and_do_not_depend_on_speculation(client, stream):
    text, entries, stats = chat(client, stream)
    plain_text, plain_entries, plain_stats = chat(client, stream, extra_body=PLAIN)
    assert stats["accepted"] > 0 and plain_stats["drafted"] == 0
    assert (text, entries) == (plain_text, plain_entries)  # the same floats, bit for bit
    assert len(entries) == MAX_TOKENS  # one per generated token (finish_reason "length")
    assert "".join(e["token"] for e in entries) == text
    for e in entries:
        assert e["bytes"] == list(e["token"].encode())
        assert e["logprob"] <= 0 and len(e["top_logprobs"]) == TOP
        top = [t["logprob"] for t in e["top_logprobs"]]
        assert top == sorted(top, reverse=True)
        assert e["top_logprobs"][0]["token"] == e["token"] and top[0] == e["logprob"]  # greedy: the argmax
    assert math.fsum(math.exp(t["logprob"]) for t in entries[0]["top_logprobs"]) <= 1 + 1e-6


def test_chat_streamed_and_whole_logprobs_agree(client):
    assert chat(client, stream=True)[:2] == chat(client)[:2]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_logprobs_have_openais_shape_and_do_not_depend_on_speculation(client, stream):
    text, logprobs, stats = completion(client, stream)
    plain_text, plain_logprobs, plain_stats = completion(client, stream, extra_body=PLAIN)
    assert stats["accepted"] > 0 and plain_stats["drafted"] == 0
    assert (text, logprobs) == (plain_text, plain_logprobs)
    tokens = logprobs["tokens"]
    assert len(tokens) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == MAX_TOKENS
    assert "".join(tokens) == text
    assert logprobs["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    for token, lp, top in zip(tokens, logprobs["token_logprobs"], logprobs["top_logprobs"]):
        assert len(top) == TOP and top[token] == lp == max(top.values())  # greedy: the argmax


def test_completion_streamed_and_whole_logprobs_agree(client):
    assert completion(client, stream=True)[:2] == completion(client)[:2]


def test_without_logprobs_they_are_null(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert r.choices[0].logprobs is None
    r = client.completions.create(model="tiny", prompt="hi", max_tokens=4)
    assert r.choices[0].logprobs is None


@pytest.mark.parametrize(
    ("kind", "kwargs", "message", "param"),
    [
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs: Input should be less than or equal to 20",
         "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs is only allowed when logprobs is true", "top_logprobs"),
        ("chat", {"logprobs": False, "top_logprobs": 0}, "top_logprobs is only allowed when logprobs is true",
         "top_logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs: Input should be greater than or equal to 0",
         "top_logprobs"),
        ("chat", {"extra_body": {"logprobs": 2}}, "logprobs: Input should be a valid boolean", "logprobs"),
        ("completion", {"logprobs": 21}, "logprobs: Input should be less than or equal to 20", "logprobs"),
        ("completion", {"extra_body": {"logprobs": True}}, "logprobs: Input should be a valid integer", "logprobs"),
    ],
)
def test_bad_logprobs_are_a_400_naming_the_field(client, kind, kwargs, message, param):
    with pytest.raises(openai.BadRequestError) as e:
        if kind == "chat":
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           **kwargs)
        else:
            client.completions.create(model="tiny", prompt="hi", max_tokens=2, **kwargs)
    assert message in e.value.body["message"]
    assert e.value.body["param"] == param
