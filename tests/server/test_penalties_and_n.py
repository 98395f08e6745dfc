"""Penalties, logit_bias, min_tokens and n > 1 through the official ``openai`` client: accepted on
chat and completions, streamed and not, the same with speculation on and off, and bad values are
a 400 that names the field."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from liveserver import API_KEY, CHARS, K, SPECIALS, wait_idle

GREEDY = {"temperature": 0.0}
SPECULATIVE = {"speculative": {"num_speculative_tokens": K}}
PLAIN = {"speculative": {"enabled": False}}
PROMPT = "a b c d e f"
MAX_TOKENS = 16
Z = len(SPECIALS) + CHARS.index("z")  # the token id of "z"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def complete(client, extra_body=None, **kwargs):
    return client.completions.create(model="tiny", prompt=PROMPT, extra_body=extra_body,
                                     **{"max_tokens": MAX_TOKENS, **GREEDY, **kwargs})


def chat(client, extra_body=None, **kwargs):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=MAX_TOKENS, extra_body=extra_body, **{**GREEDY, **kwargs})


def test_logit_bias_steers_both_apis(client):
    assert complete(client, logit_bias={str(Z): 100}).choices[0].text == "z" * MAX_TOKENS
    assert chat(client, logit_bias={str(Z): 100}).choices[0].message.content == "z" * MAX_TOKENS
    assert "z" not in complete(client, logit_bias={str(Z): -100}).choices[0].text


@pytest.mark.parametrize("setting", [
    dict(frequency_penalty=2.0),
    dict(presence_penalty=1.5),
    dict(extra={"repetition_penalty": 1.8}),
    dict(presence_penalty=-2.0, frequency_penalty=-1.0),
], ids=["frequency", "presence", "repetition", "negative"])
def test_penalties_change_the_output_and_speculation_does_not(client, setting):
    setting = dict(setting)
    extra = setting.pop("extra", {})
    base = complete(client, PLAIN).choices[0].text
    plain = complete(client, {**PLAIN, **extra}, **setting)
    spec = complete(client, {**SPECULATIVE, **extra}, **setting)
    assert plain.choices[0].text != base
    assert spec.choices[0].text == plain.choices[0].text
    assert spec.model_extra["speculative_stats"]["drafted"] > 0
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True, extra_body={**SPECULATIVE, **extra},
        **{**GREEDY, **setting}) if c.choices)
    assert streamed == plain.choices[0].text
    chat_plain = chat(client, {**PLAIN, **extra}, **setting).choices[0].message.content
    assert chat(client, {**SPECULATIVE, **extra}, **setting).choices[0].message.content == chat_plain


def test_min_tokens_holds_the_end_back(client):
    """With EOS favoured by logit_bias the answer ends at once, unless min_tokens holds it back."""
    eos = SPECIALS.index("<|im_end|>")
    short = chat(client, logit_bias={str(eos): 100})
    assert short.usage.completion_tokens == 1 and short.choices[0].finish_reason == "stop"
    held = chat(client, logit_bias={str(eos): 100}, extra_body={"min_tokens": 5})
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"


def test_n_chat_and_completions_return_n_choices_with_summed_usage(client):
    args = dict(temperature=1.0, seed=11, n=3)
    for r in (complete(client, **args), chat(client, **args)):
        texts = [c.text if hasattr(c, "text") else c.message.content for c in r.choices]
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert len(set(texts)) == 3  # each sample has its own seed stream
        assert r.usage.completion_tokens == 3 * MAX_TOKENS
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # reproducible, and choice 0 is the n = 1 answer with the same seed
    again = complete(client, **args)
    first = complete(client, temperature=1.0, seed=11)
    assert [c.text for c in again.choices] == [c.text for c in complete(client, **args).choices]
    assert again.choices[0].text == first.choices[0].text


def test_greedy_n_gives_identical_choices(client):
    r = chat(client, n=3)
    assert len({c.message.content for c in r.choices}) == 1 and len(r.choices) == 3
    assert r.choices[0].message.content == chat(client).choices[0].message.content


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_n_streamed_gives_the_same_choices_as_one_response(client, kind):
    args = dict(temperature=1.0, seed=5, n=3, extra_body={"frequency_penalty": 0.5})
    whole = complete(client, **args) if kind == "completion" else chat(client, **args)
    texts, finished, usage = ["", "", ""], [None] * 3, None
    create = client.completions.create if kind == "completion" else client.chat.completions.create
    prompt = dict(prompt=PROMPT) if kind == "completion" else dict(messages=[{"role": "user", "content": PROMPT}])
    for chunk in create(model="tiny", max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True},
                        **args, **prompt):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += (c.text if kind == "completion" else c.delta.content) or ""
            finished[c.index] = c.finish_reason or finished[c.index]
    want = [c.text if kind == "completion" else c.message.content for c in whole.choices]
    assert texts == want
    assert finished == [c.finish_reason for c in whole.choices]
    assert usage.completion_tokens == whole.usage.completion_tokens


@pytest.mark.parametrize(("kwargs", "message", "param"), [
    ({"presence_penalty": 2.5}, "presence_penalty: Input should be less than or equal to 2", "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty: Input should be greater than or equal to -2", "frequency_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias.5: Input should be less than or equal to 100", "logit_bias.5"),
    ({"logit_bias": {"z": 1}}, "String should match pattern", "logit_bias.z"),
    ({"logit_bias": {"100000": 1}}, "logit_bias token ids must be in [0, ", "logit_bias"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty: Input should be greater than or equal to 0.01",
     "repetition_penalty"),
    ({"extra_body": {"min_tokens": 5}}, "min_tokens=5 is more than", "min_tokens"),
    ({"extra_body": {"min_tokens": -1}}, "min_tokens: Input should be greater than or equal to 0", "min_tokens"),
    ({"n": 0}, "n: Input should be greater than or equal to 1", "n"),
    ({"n": 5}, "more than this server's max_num_seqs (4)", "n"),
])
def test_bad_values_are_a_400_naming_the_field(client, kwargs, message, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hi", max_tokens=4, **kwargs)
    err = info.value.body
    assert info.value.status_code == 400 and message in err["message"], err
    assert err["param"] == param, err


def test_n_samples_that_end_at_their_first_token_free_their_slots(client, server):
    r = complete(client, n=3, max_tokens=1, temperature=1.0, seed=1)
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 3
    wait_idle(server)


def test_n_samples_wait_for_free_slots_behind_a_running_request(client, server):
    """A request for as many samples as the server has slots, sent while another one runs (it
    is admitted once all slots are free), completes, and so does the other."""
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(complete, client, max_tokens=40)
        time.sleep(0.05)
        many = pool.submit(complete, client, n=4, temperature=1.0, seed=2)
        assert len(first.result().choices) == 1
        assert [c.index for c in many.result().choices] == [0, 1, 2, 3]
    wait_idle(server)


def test_a_client_leaving_an_n_stream_frees_every_slot(client, server):
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=60, stream=True, n=3,
                                       temperature=1.0)
    next(iter(stream))
    stream.close()
    wait_idle(server)
