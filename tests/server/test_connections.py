"""Connection bounds: half-open connections (no request, headers trickling in, a body that never
completes) are closed or answered within their timeouts, and service goes on meanwhile."""

from __future__ import annotations

import socket
import time

import openai
import pytest

from liveserver import API_KEY, make_app
from verispec.server.serve import BackgroundServer

HALF_OPEN = 50  # of each kind


def closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing ``sock`` within ``seconds`` (None: still open)."""
    sock.settimeout(seconds)
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except socket.timeout:
        return None
    return data


def test_half_open_connections_are_closed_within_their_timeouts_and_service_goes_on():
    app = make_app(body_timeout_s=1.0)
    with BackgroundServer(app, header_timeout_s=1.0) as live:
        def connect() -> socket.socket:
            return socket.create_connection(("127.0.0.1", live.port))

        idle = [connect() for _ in range(HALF_OPEN)]  # never send a byte
        trickle = [connect() for _ in range(HALF_OPEN)]
        for s in trickle:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        body = [connect() for _ in range(HALF_OPEN)]
        for s in body:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{")
        t0 = time.monotonic()
        time.sleep(0.5)
        for s in trickle:  # a header line now and then keeps no connection open past its deadline
            s.sendall(b"X-Slow: 1\r\n")
        client = openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)
        answer = client.completions.create(model="tiny", prompt="meanwhile", max_tokens=2)
        assert answer.usage.completion_tokens >= 1  # served while 150 connections hang
        for s in idle + trickle:
            assert closed_within(s, 3.0) == b""  # closed with no answer
        for s in body:
            reply = closed_within(s, 3.0)
            assert reply is not None and reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
        assert time.monotonic() - t0 < 4.0
        for s in idle + trickle + body:
            s.close()
        again = client.completions.create(model="tiny", prompt="after", max_tokens=2)
        assert again.usage.completion_tokens >= 1


def test_past_the_concurrency_limit_new_requests_get_503_until_connections_close():
    with BackgroundServer(make_app(), header_timeout_s=1.0, limit_concurrency=3) as live:
        held = [socket.create_connection(("127.0.0.1", live.port)) for _ in range(3)]
        time.sleep(0.2)
        client = openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=30)
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model="tiny", prompt="full", max_tokens=2)
        assert info.value.status_code == 503
        for s in held:
            assert closed_within(s, 3.0) == b""  # the header deadline frees them
        assert client.completions.create(model="tiny", prompt="room", max_tokens=2).usage.completion_tokens >= 1
