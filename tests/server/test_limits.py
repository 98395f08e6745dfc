"""What a request costs before it is refused: the key and the body size are checked before the
body is parsed, and a huge prompt is tokenized off the event loop."""

from __future__ import annotations

import gc
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from liveserver import API_KEY, MAX_MODEL_LEN, make_server
from verispec.server.app import MAX_REQUEST_BYTES


def send_headers(port: int, headers: dict, path: str = "/v1/completions") -> http.client.HTTPConnection:
    """A POST whose headers are sent and whose body is not (yet)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.putrequest("POST", path)
    for name, value in {"Content-Type": "application/json", **headers}.items():
        conn.putheader(name, value)
    conn.endheaders()
    return conn


def answer(conn: http.client.HTTPConnection) -> tuple[int, dict, dict]:
    resp = conn.getresponse()
    data = json.loads(resp.read())
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data


def test_a_declared_oversized_body_is_refused_before_it_is_sent(server):
    conn = send_headers(server.port, {"Authorization": f"Bearer {API_KEY}",
                                      "Content-Length": str(MAX_REQUEST_BYTES + 1)})
    status, _, data = answer(conn)  # answered although not one byte of the body was sent
    assert status == 413 and data["error"]["code"] == "request_too_large"
    assert str(MAX_REQUEST_BYTES) in data["error"]["message"]


def test_the_key_is_checked_before_the_size_and_the_body():
    with make_server(max_request_bytes=1000) as live:
        conn = send_headers(live.port, {"Authorization": "Bearer wrong", "Content-Length": "10000000"})
        status, headers, data = answer(conn)
        assert status == 401 and data["error"]["type"] == "authentication_error"
        assert headers["www-authenticate"] == "Bearer"
        conn = send_headers(live.port, {"Authorization": "Bearer wrong", "Content-Length": "9"})
        conn.send(b"{not json")  # never parsed: a wrong key is a 401, not a 400
        status, _, data = answer(conn)
        assert status == 401 and data["error"]["code"] == "invalid_api_key"


def test_a_chunked_body_is_counted_and_refused_past_the_limit():
    with make_server(max_request_bytes=10_000) as live:
        def post(size: int) -> tuple[int, dict]:
            conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
            body = json.dumps({"prompt": "x" * size, "max_tokens": 1}).encode()
            chunks = (body[i:i + 1000] for i in range(0, len(body), 1000))  # no Content-Length
            conn.request("POST", "/v1/completions", body=chunks, encode_chunked=True,
                         headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
            status, _, data = answer(conn)
            return status, data

        status, data = post(20_000)
        assert status == 413 and data["error"]["code"] == "request_too_large"
        status, data = post(9_000)  # under the limit: read and parsed (the prompt is too long)
        assert status == 400 and data["error"]["code"] == "context_length_exceeded"


def test_the_openai_client_sees_413_for_a_body_over_the_limit(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="tiny", prompt="a" * (MAX_REQUEST_BYTES + 1), max_tokens=1)
    assert info.value.status_code == 413 and info.value.body["code"] == "request_too_large"
    assert client.completions.create(model="tiny", prompt="still served", max_tokens=2).usage.completion_tokens == 2


def test_a_huge_prompt_does_not_freeze_the_event_loop(server):
    """A 3 MB prompt takes seconds to tokenize; /health answers within 0.5 s all along."""
    result: dict = {}

    def big() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
        body = json.dumps({"prompt": "abc " * 750_000, "max_tokens": 1})
        conn.request("POST", "/v1/completions", body=body,
                     headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        result["status"], _, result["data"] = answer(conn)

    collections: list[tuple[int, float, float]] = []  # (generation, seconds, start): what a stall could be

    def timed_gc(phase: str, info: dict, started: list[float] = [0.0]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            collections.append((info["generation"], time.perf_counter() - started[0], started[0] - begin))

    begin = time.perf_counter()
    gc.callbacks.append(timed_gc)
    sender = threading.Thread(target=big)
    sender.start()
    latencies, starts = [], []
    try:
        while sender.is_alive():
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            t0 = time.perf_counter()
            conn.request("GET", "/health")
            assert conn.getresponse().status == 200
            latencies.append(time.perf_counter() - t0)
            starts.append(t0 - begin)
            conn.close()
            time.sleep(0.05)
        sender.join()
    finally:
        gc.callbacks.remove(timed_gc)
    assert result["status"] == 400 and result["data"]["error"]["code"] == "context_length_exceeded"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in result["data"]["error"]["message"]
    assert len(latencies) >= 5, latencies  # the prompt really kept the server busy for a while
    slowest = sorted(zip(latencies, starts), reverse=True)[:5]
    assert max(latencies) < 0.5, (f"slowest /health (s, at s): {slowest}; requests {len(latencies)}, "
                                  f"over {time.perf_counter() - begin:.2f} s; collections over 10 ms: "
                                  f"{[c for c in collections if c[1] > 0.01]} of {len(collections)}; "
                                  f"frozen {gc.get_freeze_count()}, threads {threading.active_count()}")



FREEZE_SCRIPT = """
import gc
from liveserver import make_server

def in_full_passes(obj):  # frozen objects are in none of the collector's generations
    return any(o is obj for o in gc.get_objects(generation=2))

old = [object()]  # a container: tracked by the collector
gc.collect()
assert in_full_passes(old)
with make_server():
    assert not in_full_passes(old)
    new = [object()]
    gc.collect()
    assert in_full_passes(new)  # what serving allocates is collected as usual
    with make_server():
        assert not in_full_passes(old)
    assert not in_full_passes(old) and in_full_passes(new)  # the first server still runs
assert in_full_passes(old) and gc.get_freeze_count() == 0
print("checked")
"""


def test_the_heap_is_frozen_while_servers_run_and_unfrozen_after_the_last():
    """The first server of a process freezes the heap it finds, the last to stop unfreezes it
    (in a process of its own: this one's package server holds a freeze already)."""
    tests = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", FREEZE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("checked"), done.stderr[-3000:]
