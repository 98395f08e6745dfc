"""A long prompt does not stall the server: it is prefilled a chunk at a time beside running
decodes, so streams keep flowing, a short request admitted with it finishes first, /health
answers, and a cancelled or timed-out long prompt gives its slot back between chunks.

The model is tiny (float32, on the decode kernels, so its prompts may be chunked); every forward
pass is slowed by a fixed time per row, so a pass costs what its rows do, as on a real model."""

from __future__ import annotations

import http.client
import statistics
import threading
import time

import openai
import pytest
import torch

from liveserver import API_KEY, CHARS, SPECIALS, LiveServer, char_tokenizer, wait_idle
from tiny import tiny_model
from types import SimpleNamespace
from verispec import kernels
from verispec.engine.engine import Engine
from verispec.server.app import build_app

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs the native kernels")

ROW_S = 0.004  # what each row of a pass costs (on top of the tiny model's own time)
LONG = 1500  # characters = tokens of the long prompt: 6 s to prefill whole


@pytest.fixture(scope="module")
def live(one_torch_thread):
    tokenizer = char_tokenizer()
    model = tiny_model(vocab=len(SPECIALS) + len(CHARS), seed=1, dtype=torch.float32)
    model.lm_head.weight.data[: len(SPECIALS)] = 0  # never an early end
    engine = Engine(SimpleNamespace(model=model, tokenizer=tokenizer, name="tiny"), None, max_model_len=2048,
                    max_num_seqs=4, prefix_caching=True)
    assert engine.chunked_prefill
    forward = model.forward

    def slowed(ids, *args, **kwargs):
        time.sleep(ROW_S * ids.shape[1])
        return forward(ids, *args, **kwargs)

    model.forward = slowed
    with LiveServer(build_app(engine, "tiny", api_key=API_KEY, request_timeout_s=20)) as server:
        yield server


def health_ms(live) -> float:
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=5)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()
    return (time.monotonic() - t0) * 1000


def test_a_long_prompt_beside_a_stream_and_a_short_request(live):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    arrivals: list[float] = []
    first_long = threading.Event()

    def stream():
        for chunk in client.completions.create(model="tiny", prompt="stream", max_tokens=400, stream=True,
                                               temperature=0.0, extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].text:
                arrivals.append(time.monotonic())
            if first_long.is_set() and len(arrivals) > 60 and time.monotonic() > long_done[0]:
                break

    long_done = [float("inf")]
    streaming = threading.Thread(target=stream)
    streaming.start()
    while len(arrivals) < 20:
        time.sleep(0.01)
    before = statistics.median(b - a for a, b in zip(arrivals[:-1], arrivals[1:]))
    t_long = time.monotonic()
    result: dict = {}
    long_thread = threading.Thread(target=lambda: result.setdefault("long", client.completions.create(
        model="tiny", prompt="a" * LONG, max_tokens=2, temperature=0.0)))
    long_thread.start()
    first_long.set()
    time.sleep(0.2)  # the long prompt is in its prefill
    t_short = time.monotonic()
    short = client.completions.create(model="tiny", prompt="short one", max_tokens=2, temperature=0.0)
    short_s = time.monotonic() - t_short
    worst_health = max(health_ms(live) for _ in range(5))
    long_thread.join()
    long_done[0] = time.monotonic()
    streaming.join()
    assert short.usage.completion_tokens == 2 and result["long"].usage.prompt_tokens == LONG
    during = [b - a for a, b in zip(arrivals[:-1], arrivals[1:]) if t_long <= a <= long_done[0]]
    assert during, "the stream produced nothing while the long prompt was prefilled"
    print(f"\nchunked prefill: stream gap {before * 1000:.0f} ms before, worst {max(during) * 1000:.0f} ms "
          f"during ({len(during)} gaps); short request {short_s:.2f} s; long prompt "
          f"{long_done[0] - t_long:.1f} s; /health worst {worst_health:.0f} ms")
    # chunks of a few rows between the stream's steps: here a row costs ROW_S whatever the pass, so
    # an 8-row chunk costs 8 steps; on a real model, whose small passes are bound by reading the
    # weights, it costs about one
    assert max(during) <= 8 * ROW_S + 4 * before + 0.02
    assert short_s < 1.5  # not behind the long prompt's 6 s
    assert worst_health < 500
    wait_idle(live)


def test_a_long_prompt_past_its_deadline_or_cancelled_leaves_between_chunks(live):
    client = openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    runner = live.runner
    t0 = time.monotonic()
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model="tiny", prompt="b" * LONG, max_tokens=2, temperature=0.0,
                                  timeout=0.5)  # the client leaves: the request is cancelled
    wait_idle(live)  # its slot came back well before a whole prefill would end
    assert time.monotonic() - t0 < 4.0
    assert runner.metrics.aborted.labels(reason="cancelled")._value.get() >= 1
