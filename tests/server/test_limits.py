"""What a request costs before it is refused: the key and the body size are checked before the
body is parsed, and a huge prompt is tokenized off the event loop."""

from __future__ import annotations

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
    still = client.completions.create(model="tiny", prompt="still served", max_tokens=2, extra_body={"ignore_eos": True})
    assert still.usage.completion_tokens == 2 and still.choices[0].finish_reason == "length"


HUGE_PROMPT_SCRIPT = """
import gc, http.client, json, threading, time
from liveserver import API_KEY, MAX_MODEL_LEN, make_server
from tiny import torch_threads

result, latencies, starts, collections = {}, [], [], []


def timed_gc(phase, info, started=[0.0]):
    if phase == "start":
        started[0] = time.monotonic()
    else:
        collections.append((info["generation"], time.monotonic() - started[0], started[0] - begin))


with torch_threads(1), make_server() as live:
    def big():
        conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=120)
        body = json.dumps({"prompt": "abc " * 750_000, "max_tokens": 1})
        conn.request("POST", "/v1/completions", body=body,
                     headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
        resp = conn.getresponse()
        result["status"], result["data"] = resp.status, json.loads(resp.read())

    result["begin"] = begin = time.monotonic()
    gc.callbacks.append(timed_gc)
    sender = threading.Thread(target=big)
    sender.start()
    while sender.is_alive():
        conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
        t0 = time.monotonic()
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        latencies.append(time.monotonic() - t0)
        starts.append(t0 - begin)
        conn.close()
        time.sleep(0.05)
    sender.join()
    elapsed = time.monotonic() - begin
    result["threads"] = {t.native_id: t.name for t in threading.enumerate()}
    gc.callbacks.remove(timed_gc)
print(json.dumps({**result, "latencies": latencies, "starts": starts, "elapsed": elapsed,
                  "collections": [c for c in collections if c[1] > 0.01], "count": len(collections)}))
"""


def sample_threads(pid: int) -> dict[int, tuple[str, int, int, str]]:
    """Each thread of process ``pid``: state, CPU ticks, minor faults and kernel wait channel."""
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            wchan = Path(f"/proc/{pid}/task/{tid}/wchan").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        threads[int(tid)] = (fields[0], int(fields[11]) + int(fields[12]), int(fields[7]), wchan)
    return threads


def during(samples: list, start: float, end: float, names: dict[str, str]) -> list[str]:
    """What each thread did between two sampling times: its states, wait channels, CPU ticks and faults."""
    before = [i for i, (at, _) in enumerate(samples) if at <= start]
    after = [i for i, (at, _) in enumerate(samples) if at >= end]
    inside = [threads for _, threads in samples[before[-1] if before else 0:(after[0] if after else len(samples)) + 1]]
    if len(inside) < 2:
        return []
    first, last = inside[0], inside[-1]
    report = []
    for tid, (_, ticks, faults, _) in last.items():
        seen = sorted({f"{t[tid][0]}:{t[tid][3] or '-'}" for t in inside if tid in t})
        was = first.get(tid, ("", ticks, faults, ""))
        report.append(f"{names.get(str(tid), tid)}: {' '.join(seen)} cpu {ticks - was[1]} ticks, "
                      f"{faults - was[2]} faults")
    return report


def test_a_huge_prompt_does_not_freeze_the_event_loop():
    """A 3 MB prompt takes seconds to tokenize; /health answers within 0.5 s all along.

    The server runs in a process of its own, as `verispec serve` does, rather than in this one,
    whose heap and threads are whatever the tests before it left. This process samples the
    server's threads every 20 ms meanwhile: when a probe is slow, the message says what each
    thread did during it (states, kernel wait channels, CPU ticks, page faults) and whether this
    process, which only sleeps, woke late too (then the machine rather than the server stalled).
    """
    tests = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), os.environ.get("PYTHONPATH", "")])}
    samples, late, output = [], [], []  # (time, the server's threads); (how late, time) this process woke
    with subprocess.Popen([sys.executable, "-c", HUGE_PROMPT_SCRIPT], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as child:
        reader = threading.Thread(target=lambda: output.extend(child.communicate(timeout=300)))
        reader.start()
        last = time.monotonic()
        while reader.is_alive():
            time.sleep(0.02)
            now = time.monotonic()
            if now - last > 0.1:
                late.append((round(now - last, 3), now))
            last = now
            try:
                samples.append((now, sample_threads(child.pid)))
            except OSError:  # the process has ended
                pass
        reader.join()
    stdout, stderr = output
    assert child.returncode == 0, stderr[-3000:]
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["status"] == 400 and out["data"]["error"]["code"] == "context_length_exceeded"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in out["data"]["error"]["message"]
    latencies = out["latencies"]
    assert len(latencies) >= 5, latencies  # the prompt really kept the server busy for a while
    slowest = sorted(zip(latencies, out["starts"]), reverse=True)[:5]
    worst, at = slowest[0]
    assert worst < 0.5, (
        f"slowest /health (s, at s): {slowest}; requests {len(latencies)}, over {out['elapsed']:.2f} s; "
        f"collections over 10 ms: {out['collections']} of {out['count']}; this process woke late "
        f"(s, at s): {[(t, round(w - out['begin'], 3)) for t, w in late]}; the server's threads "
        f"during the slowest probe: "
        f"{during(samples, out['begin'] + at, out['begin'] + at + worst, out['threads'])}")


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


def test_a_small_request_never_waits_behind_large_prompts_being_tokenized():
    """Eight large prompts whose tokenization takes a second each (more than the worker threads
    any shared pool would have) are queued in a pool of their own; a small request sent after
    them is answered at once."""
    from verispec.server.app import LARGE_PROMPT_CHARS

    with make_server() as live:
        tokenizer = live.runner.engine.target.tokenizer
        encode = tokenizer.encode

        def slow_encode(text, *args, **kwargs):
            if len(text) > LARGE_PROMPT_CHARS:
                time.sleep(1.0)
            return encode(text[:20], *args, **kwargs)

        tokenizer.encode = slow_encode
        client = openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        large = [threading.Thread(target=client.completions.create,
                                  kwargs=dict(model="tiny", prompt="a" * (LARGE_PROMPT_CHARS + 1), max_tokens=2))
                 for _ in range(8)]
        for t in large:
            t.start()
        time.sleep(0.3)  # every large one has arrived
        t0 = time.monotonic()
        small = client.completions.create(model="tiny", prompt="small", max_tokens=2)
        assert small.usage.completion_tokens >= 1
        assert time.monotonic() - t0 < 0.8  # not behind a second of tokenization
        for t in large:
            t.join()
