"""Deadlines and abandoned work: timeouts, clients that leave while tokens flow, slow readers,
and gauges that tell the truth through a request's life.

Steps are slowed down (a sleep per engine step) where a test needs a request to run for a while.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time

import openai
import pytest

from liveserver import API_KEY, make_server, wait_idle
from verispec.server.app import build_app

GREEDY = {"temperature": 0.0}


def slow_steps(engine, seconds: float):
    step = engine.step

    def slow():
        time.sleep(seconds)
        return step()

    engine.step = slow


def gauge(metric) -> float:
    return metric._value.get()


def test_a_request_past_its_timeout_ends_with_504_and_frees_its_slot():
    with make_server(request_timeout_s=0.5) as live:
        slow_steps(live.runner.engine, 0.05)
        client = openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model="tiny", prompt="slow", max_tokens=80, **GREEDY)
        assert info.value.status_code == 504 and info.value.body["type"] == "timeout"
        assert time.monotonic() - t0 < 3  # 80 slowed steps would take 4 s
        stream = client.completions.create(model="tiny", prompt="slow stream", max_tokens=80, stream=True, **GREEDY)
        with pytest.raises(openai.APIError, match="timed out"):
            for _ in stream:
                pass
        wait_idle(live)
        assert live.runner.metrics.aborted.labels(reason="timeout")._value.get() == 2
        # a request that fits its deadline is untouched (EOS ignored: a sampled EOS would end it
        # sooner, which CI once saw)
        quick = client.completions.create(model="tiny", prompt="quick", max_tokens=3, extra_body={"ignore_eos": True})
        assert quick.usage.completion_tokens == 3 and quick.choices[0].finish_reason == "length"


def test_a_non_streaming_client_that_leaves_while_tokens_flow_is_noticed_at_once():
    with make_server() as live:
        slow_steps(live.runner.engine, 0.05)  # a token every 50 ms: never an idle gap
        cancelled = live.runner.metrics.aborted.labels(reason="cancelled")
        conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "leave", "max_tokens": 80, **GREEDY}),
                     {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        deadline = time.monotonic() + 10
        while gauge(live.runner.metrics.running) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        conn.close()
        t0 = time.monotonic()
        while cancelled._value.get() < 1:
            assert time.monotonic() - t0 < 1.0, "the disconnect went unnoticed"  # 80 steps: 4 s
            time.sleep(0.01)
        wait_idle(live)


def test_a_stream_that_its_client_does_not_read_is_cancelled_past_the_backlog_bound():
    """The app driven directly over ASGI, with a client whose socket never drains: every send
    of the response body blocks, so the stream's events pile up unread."""
    with make_server(max_stream_backlog=4) as proto:  # only for its engine and tokenizer
        engine = proto.runner.engine
        wait_idle(proto)
    app = build_app(engine, "tiny", api_key=None, max_stream_backlog=4)
    runner = app.state.runner
    runner.start()
    body = json.dumps({"prompt": "never read", "max_tokens": 60, "stream": True, **GREEDY}).encode()

    async def drive():
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "query_string": b"", "root_path": "", "server": ("127.0.0.1", 80),
                 "client": ("127.0.0.1", 1234), "headers": [(b"content-type", b"application/json"),
                                                            (b"content-length", str(len(body)).encode())]}
        sent = [False]
        blocked = asyncio.Event()

        async def receive():
            if not sent[0]:
                sent[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client never leaves

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                blocked.set()
                await asyncio.Event().wait()  # the socket never drains

        task = asyncio.ensure_future(app(scope, receive, send))
        await asyncio.wait_for(blocked.wait(), 10)
        slow = runner.metrics.aborted.labels(reason="slow_reader")
        deadline = time.monotonic() + 10
        while slow._value.get() < 1:
            assert time.monotonic() < deadline, "the unread stream was never cancelled"
            await asyncio.sleep(0.02)
        task.cancel()

    try:
        asyncio.run(drive())
        deadline = time.monotonic() + 10
        while runner.num_active or engine.running:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert sorted(engine.free_slots) == list(range(engine.cache.num_slots))
    finally:
        runner.stop()


def test_gauges_and_counters_follow_a_request_through_its_life():
    with make_server(max_num_seqs=1) as live:
        metrics = live.runner.metrics
        slow_steps(live.runner.engine, 0.05)
        first = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
        second = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
        headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
        first.request("POST", "/v1/completions", json.dumps({"prompt": "one", "max_tokens": 20, **GREEDY}), headers)
        deadline = time.monotonic() + 10
        while gauge(metrics.running) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        second.request("POST", "/v1/completions", json.dumps({"prompt": "two", "max_tokens": 20, **GREEDY}), headers)
        while gauge(metrics.waiting) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert gauge(metrics.running) == 1 and metrics.received._value.get() == 2
        second.close()  # gives up while waiting: counted as cancelled
        assert first.getresponse().status == 200
        wait_idle(live)
        assert gauge(metrics.running) == 0 and gauge(metrics.waiting) == 0
        assert metrics.success.labels(finished_reason="length")._value.get() == 1
        assert metrics.aborted.labels(reason="cancelled")._value.get() == 1
        assert metrics.received._value.get() == 2


def test_a_stalled_step_turns_health_503_and_its_requests_get_504_at_their_deadline():
    """One engine step stalls for 3 s: /health says so once the step is past its bound (and ok
    again after), and requests whose 1 s deadline passes meanwhile, streamed or not, are
    answered at the deadline, not when the step returns; the engine then drops their work."""
    with make_server(request_timeout_s=1.0, max_step_s=0.5) as live:
        stall = {"s": 3.0}
        step = live.runner.engine.step

        def stalling():
            time.sleep(stall.pop("s", 0.0))  # the first step only
            return step()

        live.runner.engine.step = stalling
        client = openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)

        def health():
            conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=5)
            conn.request("GET", "/health")
            resp = conn.getresponse()
            body = json.loads(resp.read())
            conn.close()
            return resp.status, body

        async def run():
            loop = asyncio.get_running_loop()
            plain = loop.run_in_executor(None, lambda: client.completions.create(
                model="tiny", prompt="stall", max_tokens=8, **GREEDY))
            await asyncio.sleep(0.1)
            streamed = loop.run_in_executor(None, lambda: list(client.completions.create(
                model="tiny", prompt="stall too", max_tokens=8, stream=True, **GREEDY)))
            await asyncio.sleep(0.6)  # the step has run past 0.5 s
            status, body = await loop.run_in_executor(None, health)
            assert status == 503 and body["status"] == "engine stalled" and "bound is 0.5 s" in body["error"], body
            t0 = time.monotonic()
            with pytest.raises(openai.APIStatusError) as info:
                await plain
            assert info.value.status_code == 504 and info.value.body["type"] == "timeout"
            with pytest.raises(openai.APIError, match="timed out"):
                await streamed
            return time.monotonic() - t0

        waited = asyncio.run(run())
        assert waited < 1.0  # at the deadlines (~0.3 s and ~0.4 s later), not when the step returns (~2.3 s)
        wait_idle(live)
        assert live.runner.metrics.aborted.labels(reason="timeout")._value.get() == 2
        assert health() == (200, {"status": "ok"})


def test_a_request_being_prefilled_counts_as_running():
    with make_server() as live:
        metrics = live.runner.metrics
        prefill = live.runner.engine.prefill

        def slow_prefill(*args, **kwargs):
            time.sleep(1.0)
            return prefill(*args, **kwargs)

        live.runner.engine.prefill = slow_prefill
        client = openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)
        done = threading.Thread(target=lambda: client.completions.create(model="tiny", prompt="p", max_tokens=2))
        done.start()
        deadline = time.monotonic() + 10
        while metrics.received._value.get() < 1 or live.runner.busy_since is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert (gauge(metrics.waiting), gauge(metrics.running)) == (0, 1)  # in the prefill, not lost between
        done.join()
        wait_idle(live)
        assert (gauge(metrics.waiting), gauge(metrics.running)) == (0, 0)
