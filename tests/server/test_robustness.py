"""Robustness: a bounded queue, disconnects, concurrency, a soak, graceful shutdown, and an event
loop that answers while the engine computes.

Every test ends by checking that no request is left waiting or running and that every cache
slot is free again (``wait_idle``).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import threading
import time

import numpy as np
import openai
import pytest
import torch

from liveserver import API_KEY, K, make_app, make_server, wait_idle
from verispec import kernels
from verispec.cli import build_parser
from verispec.config import SamplingParams
from verispec.server.runner import QueueFull, Request, ShuttingDown

GREEDY = {"temperature": 0.0}


def open_stream(port: int, body: dict, key: str | None = API_KEY) -> http.client.HTTPResponse:
    """Start a streaming completion and return the response without reading it."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}), headers=headers)
    return conn.getresponse()


def test_binds_localhost_by_default():
    assert build_parser().parse_args(["serve", "m"]).host == "127.0.0.1"


def test_full_queue_answers_429_with_retry_after():
    with make_server(max_num_seqs=1, max_queue=1, api_key=None) as live:
        long = {"prompt": "busy", "max_tokens": 80, **GREEDY}
        running = open_stream(live.port, long, key=None)
        running.readline()  # the first event: it holds the only slot
        queued = open_stream(live.port, long, key=None)  # waits in the queue (bound 1)
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model="tiny", prompt="one too many", max_tokens=2)
        assert info.value.status_code == 429
        assert info.value.response.headers["retry-after"] == "1"
        assert "queue is full" in info.value.body["message"]
        running.close()  # both clients walk away: their requests are cancelled
        queued.close()
        wait_idle(live)


def _gauge(metric) -> float:
    return metric._value.get()


def _wait_for(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_cancelled_waiting_request_leaves_the_queue_at_once():
    """The engine thread is not started here, so nothing but the cancel can take the request out
    of the queue: its place is free for the next request at once, and it gets its final event."""
    runner = make_app(max_num_seqs=1, max_queue=1).state.runner
    events = []

    def request() -> Request:
        return Request([5, 6, 7], SamplingParams(max_tokens=2), None, events.append)

    waiting = request()
    runner.submit(waiting)
    with pytest.raises(QueueFull):
        runner.submit(request())
    runner.cancel(waiting)
    assert [(e.status, e.reason) for e in events] == [(499, "cancelled")]
    runner.submit(request())  # admitted: the queue holds it alone
    runner.cancel(waiting)  # a second cancel changes nothing
    assert len(events) == 1
    assert _gauge(runner.metrics.waiting) == 1
    assert _gauge(runner.metrics.aborted.labels(reason="cancelled")) == 1
    assert _gauge(runner.metrics.received) == 3 and _gauge(runner.metrics.rejected.labels(reason="queue_full")) == 1


def test_a_request_sent_right_after_a_queued_one_is_cancelled_is_admitted():
    """The engine stands still in a step (held), so only the cancel can free the queue's place."""
    with make_server(max_num_seqs=1, max_queue=1, api_key=None) as live:
        metrics, engine, release = live.runner.metrics, live.runner.engine, threading.Event()
        step = engine.step

        def held_step():
            release.wait(30)
            return step()

        streams = []
        try:
            engine.step = held_step
            long = {"prompt": "busy", "max_tokens": 40, **GREEDY}
            streams.append(open_stream(live.port, long, key=None))  # holds the only slot
            _wait_for(lambda: _gauge(metrics.running) == 1, "the first request never ran")
            queued = open_stream(live.port, long, key=None)
            _wait_for(lambda: _gauge(metrics.waiting) == 1, "the second request never queued")
            queued.close()  # the client leaves
            _wait_for(lambda: _gauge(metrics.waiting) == 0, "the cancelled request still holds its place in the queue")
            assert _gauge(metrics.aborted.labels(reason="cancelled")) == 1
            streams.append(open_stream(live.port, long, key=None))
            assert streams[-1].status == 200  # queued, not 429
            assert _gauge(metrics.waiting) == 1 and _gauge(metrics.rejected.labels(reason="queue_full")) == 0
        finally:
            release.set()
            engine.step = step
        for stream in streams:
            stream.close()
        wait_idle(live)


@pytest.mark.skipif(not kernels.available(), reason="needs the native kernels")
def test_health_answers_while_the_engine_thread_is_inside_a_long_native_call():
    """Each engine step here first runs a native matmul of most of a second on a real model's MLP
    weight ([8960, 1536], Q8_0; random bytes, the values do not matter). The kernels release the
    GIL, so /health answers every probe at once throughout; held, the server (and this process's
    probing thread) would stand still for each call."""
    n, k = 8960, 1536
    raw = np.random.default_rng(0).integers(0, 256, size=n * k // 32 * 34, dtype=np.uint8)
    weight = kernels.repack(kernels.FORMATS["Q8_0"], raw, n, k)
    x = torch.randn(16, k)
    with make_server(api_key=None) as live:
        engine = live.runner.engine
        step = engine.step
        calls = []  # how long each native call took

        def computing_step():
            t0 = time.monotonic()
            kernels.matmul(x, [weight], "scalar")
            calls.append(time.monotonic() - t0)
            return step()

        engine.step = computing_step
        done = threading.Event()

        def send():
            open_stream(live.port, {"prompt": "busy", "max_tokens": 3, "ignore_eos": True, **GREEDY}, key=None).read()
            done.set()

        request = threading.Thread(target=send)
        request.start()
        _wait_for(lambda: _gauge(live.runner.metrics.running) == 1, "the request never ran")
        answered = [time.monotonic()]  # when each probe was answered, from the start
        while not done.is_set():
            conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
            conn.request("GET", "/health")
            assert conn.getresponse().status == 200
            answered.append(time.monotonic())
            conn.close()
            time.sleep(0.02)
        request.join()
        engine.step = step
        wait_idle(live)
    gaps = np.diff(answered)
    assert gaps.max() < min(calls) / 2, (f"{len(gaps)} probes during native calls of {calls} s; the longest "
                                         f"waits between answers: {sorted(gaps)[-5:]}")
    assert len(gaps) >= 10  # the steps kept the engine busy for a while


def test_client_disconnect_cancels_and_frees_the_slot(server):
    cancelled = server.runner.metrics.aborted.labels(reason="cancelled")
    before = cancelled._value.get()
    stream = open_stream(server.port, {"prompt": "leave early", "max_tokens": 80, **GREEDY})
    assert stream.readline().startswith(b"data: ")
    stream.close()
    wait_idle(server)
    assert cancelled._value.get() == before + 1


def test_concurrent_speculative_greedy_equals_each_request_alone_plain(server):
    """16 concurrent greedy requests with speculation on (4 slots, so they queue, join and leave)
    give exactly the texts each gives alone with speculation off."""
    prompts = [f"request {i}: " + "abcdefghij"[: i % 7] for i in range(16)]
    sizes = [6 + (i % 5) for i in range(16)]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=n, **GREEDY,
                                       extra_body={"speculative": {"enabled": False}}).choices[0].text
             for p, n in zip(prompts, sizes)]

    async def together():
        spec = [{"num_speculative_tokens": K}, {}]  # pinned k, and the batch-aware default
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                                      timeout=120) as aclient:
            return await asyncio.gather(*(
                aclient.completions.create(model="tiny", prompt=p, max_tokens=n, **GREEDY,
                                           extra_body={"speculative": spec[i % 2]})
                for i, (p, n) in enumerate(zip(prompts, sizes))))

    results = asyncio.run(together())
    assert [r.choices[0].text for r in results] == alone
    assert sum(r.model_extra["speculative_stats"]["drafted"] for r in results) > 0
    assert len(set(alone)) > 8  # the prompts really differ
    wait_idle(server)


def test_soak_with_random_cancellations_ends_clean(server):
    """200 requests, 8 at a time, a quarter cancelled at random points (in the queue, mid
    stream, mid request): each completes or fails explicitly, no slot leaks, still healthy."""
    rng = random.Random(0)
    outcomes: list[str] = []

    async def one(aclient, i: int, gate: asyncio.Semaphore) -> None:
        async with gate:
            max_tokens = rng.randint(1, 5)
            args = dict(model="tiny", prompt=f"soak {i}", max_tokens=max_tokens, temperature=rng.choice([0.0, 1.0]))
            cancel = rng.random() < 0.25
            if rng.random() < 0.5:
                stream = await aclient.completions.create(stream=True, **args)
                chunks = 0
                async for chunk in stream:
                    chunks += 1
                    if cancel:
                        await stream.close()
                        outcomes.append("cancelled")
                        return
                assert chunk.choices[0].finish_reason in ("stop", "length")
                outcomes.append("completed")
                return
            try:
                r = await asyncio.wait_for(aclient.completions.create(**args),
                                           timeout=rng.uniform(0.01, 0.2) if cancel else 120)
            except asyncio.TimeoutError:
                outcomes.append("cancelled")
                return
            assert r.usage.completion_tokens <= max_tokens
            outcomes.append("completed")

    async def soak():
        gate = asyncio.Semaphore(8)
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                                      timeout=120) as aclient:
            await asyncio.gather(*(one(aclient, i, gate) for i in range(200)))

    asyncio.run(soak())
    assert len(outcomes) == 200 and outcomes.count("cancelled") > 20
    wait_idle(server)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    still = client.completions.create(model="tiny", prompt="still alive", max_tokens=3, **GREEDY)
    assert still.usage.completion_tokens == 3


def test_graceful_shutdown_ends_in_flight_requests_and_refuses_new_ones():
    live = make_server(api_key=None, shutdown_grace_s=0.0).__enter__()
    stream = open_stream(live.port, {"prompt": "shutdown", "max_tokens": 80, **GREEDY}, key=None)
    assert stream.readline().startswith(b"data: ")
    stopper = threading.Thread(target=live.stop)
    stopper.start()
    rest = stream.read().decode()  # no grace period: the request is aborted at once
    stopper.join(timeout=30)
    assert not stopper.is_alive() and not live.runner.alive
    events = [e for e in rest.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    assert "the server shut down" in json.loads(events[-2][6:])["error"]["message"]
    engine = live.runner.engine
    assert not engine.running and sorted(engine.free_slots) == list(range(engine.cache.num_slots))
    with pytest.raises(ShuttingDown):
        live.runner.submit(Request([1, 2], None, None, lambda event: None))
