"""Schemathesis against a live server, all checks on: every request the OpenAPI document allows
is accepted with a response the document describes, every request it forbids is refused (400,
401, 404, ...), and nothing is ever a 500.

The document cannot state the limits of the server's model: its context (96 tokens), its
vocabulary, its k, its max_num_seqs (n), whether its chat template renders tools, nor whether a
grammar compiles, nor that min_tokens is at most the max tokens and given without a grammar. A hook fits positive cases into them (and
keeps generation to a few tokens); negative cases go out as generated. Schemathesis needs the
document when the tests are
collected, so it comes from an app built like the live server's, and the test checks that the
live server serves the same one.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
import schemathesis
from hypothesis import settings

from liveserver import API_KEY, CHARS, K, MAX_MODEL_LEN, SPECIALS, make_app, make_server
from verispec.server.protocol import GRAMMAR_FIELDS

SEED = 0
MAX_EXAMPLES = 1000  # fuzzed cases per operation; the coverage and examples phases add their own
MAX_TOKENS = 4
MAX_NUM_SEQS = 4  # make_app's
VOCAB = len(SPECIALS) + len(CHARS)  # the tiny server's char tokenizer

DOCUMENT = make_app().openapi()
CONFIG = schemathesis.Config.from_dict({
    "seed": SEED,
    "headers": {"Authorization": f"Bearer {API_KEY}"},
    "generation": {"max-examples": MAX_EXAMPLES},
    "request-timeout": 30,
})
schema = schemathesis.openapi.from_dict(DOCUMENT, config=CONFIG)


@schema.hook
def map_case(_context, case):
    """Fit a positive generation request into the tiny server's limits."""
    if case.meta is None or not case.meta.generation.mode.is_positive or not isinstance(case.body, dict):
        return case
    body = case.body
    for field in ("max_tokens", "max_completion_tokens"):
        if body.get(field) is not None:
            body[field] = min(body[field], MAX_TOKENS)
    if body.get("max_completion_tokens") is None:
        body["max_tokens"] = min(body.get("max_tokens") or MAX_TOKENS, MAX_TOKENS)
    room = MAX_MODEL_LEN - MAX_TOKENS - 40  # the chat template takes ~10 tokens per message
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        body["prompt"] = prompt[:room]
    elif isinstance(prompt, list):
        body["prompt"] = [t % VOCAB for t in prompt[:room]]
    # The live server's chat template renders no tools (a 400 the document cannot state), and a
    # call's arguments must be a JSON object written as a string (the document says a string).
    body.pop("tools", None)
    body.pop("tool_choice", None)
    if isinstance(body.get("messages"), list):
        body["messages"] = body["messages"][:2]
        for message in body["messages"]:
            for call in message.get("tool_calls") or ():
                call["function"]["arguments"] = "{}"
            if isinstance(message.get("content"), str):
                message["content"] = message["content"][:10]
            elif isinstance(message.get("content"), list):
                message["content"] = [{**part, "text": part["text"][:5]} for part in message["content"][:2]]
    if any(body.get(field) is not None for field in GRAMMAR_FIELDS):
        # whether a grammar compiles, and whether the vocabulary can spell it, is not in the
        # document: one that does, for the tiny server's letters
        # (nor, past the canonicalizer's reach, that min_tokens cannot come with one)
        body.update({field: None for field in GRAMMAR_FIELDS}, guided_choice=["ab", "c d"], ignore_eos=False,
                    min_tokens=0)
    speculative = body.get("speculative")
    if isinstance(speculative, dict) and speculative.get("num_speculative_tokens") is not None:
        speculative["num_speculative_tokens"] = min(speculative["num_speculative_tokens"], K)
    if isinstance(body.get("n"), (int, float)):  # (3.0 is an integer in JSON Schema)
        body["n"] = min(body["n"], MAX_NUM_SEQS)
    limit = body.get("max_completion_tokens") or body.get("max_tokens")
    if isinstance(body.get("min_tokens"), (int, float)) and limit:
        body["min_tokens"] = min(body["min_tokens"], limit)
    if isinstance(body.get("logit_bias"), dict):
        body["logit_bias"] = {str(int(t) % VOCAB): bias for t, bias in body["logit_bias"].items()}
    return case


@pytest.fixture(scope="module")
def live(one_torch_thread):
    with make_server() as server:
        with urllib.request.urlopen(server.url + "/openapi.json") as resp:
            assert json.load(resp) == DOCUMENT
        yield server


@schema.parametrize()
@settings(deadline=None)
def test_the_server_keeps_the_promises_of_its_openapi_document(case, live):
    case.call_and_validate(base_url=live.url)
