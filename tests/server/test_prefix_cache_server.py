"""Prefix caching through the server: the second turn of a chat reports the prompt tokens it
reused (``usage.prompt_tokens_details.cached_tokens``, as OpenAI's API does) and answers as a
server that never saw the first turn."""

from __future__ import annotations

from types import SimpleNamespace

import openai
import pytest
import torch

from liveserver import API_KEY, MAX_MODEL_LEN, LiveServer, char_tokenizer
from tiny import tiny_model
from verispec import kernels
from verispec.engine.engine import Engine
from verispec.server.app import build_app

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the native kernels")


def float32_server() -> LiveServer:
    tokenizer = char_tokenizer()
    vocab = len(tokenizer.hf)
    model = tiny_model(vocab=vocab, seed=1, dtype=torch.float32)
    model.lm_head.weight.data[:3] = 0  # the special tokens (see liveserver): answers run long
    target = SimpleNamespace(model=model, tokenizer=tokenizer, name="tiny")
    engine = Engine(target, None, max_model_len=MAX_MODEL_LEN, max_num_seqs=2, prefix_caching=True)
    return LiveServer(build_app(engine, "tiny", api_key=API_KEY))


def chat(client, messages):
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0.0)


def test_a_second_turn_reports_its_cached_prompt_tokens_and_answers_the_same():
    first = [{"role": "user", "content": "abc"}]
    with float32_server() as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        r1 = chat(client, first)
        assert r1.usage.prompt_tokens_details.cached_tokens == 0
        second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                          {"role": "user", "content": "de"}]
        r2 = chat(client, second)
        assert 0 < r2.usage.prompt_tokens_details.cached_tokens < r2.usage.prompt_tokens
        import urllib.request
        with urllib.request.urlopen(live.url + "/metrics") as resp:
            text = resp.read().decode()
        cached = [line for line in text.splitlines() if line.startswith("verispec:prompt_tokens_cached_total")]
        assert cached and float(cached[0].split()[-1]) == r2.usage.prompt_tokens_details.cached_tokens
    with float32_server() as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        alone = chat(client, second)
        assert alone.usage.prompt_tokens_details.cached_tokens == 0
        assert alone.choices[0].message.content == r2.choices[0].message.content
