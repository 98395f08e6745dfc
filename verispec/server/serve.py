"""``verispec serve``: run the server a :class:`~verispec.server.config.ServerConfig` describes.

:func:`build_server_app` loads the target (and drafter) and builds the engine and the app; each
Ray Serve replica builds its app with it too. :func:`serve` runs that app on uvicorn.

Shutdown (Ctrl-C or SIGTERM) is graceful in two stages. As soon as uvicorn starts shutting
down, :class:`GracefulServer` tells the engine thread to refuse new work and to give running
requests the app's grace period; requests still running then end with an explicit error event,
so every stream closes with a final ``data:`` line and ``[DONE]`` instead of being cut. uvicorn
meanwhile waits (up to ``GRACEFUL_SHUTDOWN_S``, longer than the grace) for those responses to
finish, and the app's lifespan then joins the engine thread.

Serving on a non-loopback address without an API key logs a warning: anyone who can reach the
port can then use the model.

Connections are bounded (:func:`uvicorn_config`): one that has not sent a whole request's headers
within ``header_timeout_s`` of opening, or of its last response, is closed (uvicorn closes an
idle keep-alive connection, but one that trickles a byte now and then, or never sends one,
would otherwise stay open for good); a body slower than ``body_timeout_s`` gets 408 (the app's
gate); past ``limit_concurrency`` open connections and requests, uvicorn answers 503.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from verispec.runtime import set_threads
from verispec.server.app import build_app
from verispec.server.config import ServerConfig

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 15  # uvicorn's wait for open responses; above the engine's grace period


class GracefulServer(uvicorn.Server):
    """A uvicorn server that starts the engine's graceful stop when its own shutdown starts."""

    async def shutdown(self, sockets=None) -> None:
        self.config.app.state.runner.begin_stop()
        await super().shutdown(sockets=sockets)


class HeaderDeadline(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol with a deadline on each request's headers: armed when the
    connection opens and when a response completes, it closes the connection if no request is
    being served when it fires (its headers never all arrived)."""

    header_timeout_s = 10.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer = None
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_overdue)

    def _headers_overdue(self) -> None:
        self._header_timer = None
        serving = self.cycle is not None and not self.cycle.response_complete
        if not serving and not self.transport.is_closing():
            self.transport.close()


def uvicorn_config(app: FastAPI, *, header_timeout_s: float = 10.0, limit_concurrency: int | None = 512,
                   **kwargs) -> uvicorn.Config:
    """uvicorn's config for ``app`` with the connection bounds of the module doc."""
    protocol = type("HeaderDeadline", (HeaderDeadline,), {"header_timeout_s": header_timeout_s})
    return uvicorn.Config(app, http=protocol, limit_concurrency=limit_concurrency,
                          timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, **kwargs)


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now, for a server started next (another
    process may take it meanwhile; the servers this package starts itself keep their socket)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BackgroundServer:
    """An app served by uvicorn in a background thread on a free port of 127.0.0.1 (for tests
    and benchmarks). Use as a context manager; leaving it shuts the server down gracefully."""

    def __init__(self, app, log_level: str = "warning", **bounds) -> None:
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(app, log_level=log_level, **bounds)
        self.server = GracefulServer(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.sock.close()


def serve(config: ServerConfig) -> None:
    """Run the server ``config`` describes until it is stopped. With ``exit_on_fatal``, a dead
    engine thread stops the server (gracefully, as SIGTERM would) and the process exits with
    status 1."""
    api_key = config.resolved_api_key()
    warn_if_exposed(config.host, api_key)
    if config.threads is not None:
        set_threads(config.threads)
    server: GracefulServer | None = None

    def on_fatal() -> None:
        if config.exit_on_fatal and server is not None:
            server.should_exit = True

    app = build_server_app(config, api_key=api_key, on_fatal=on_fatal)
    server = GracefulServer(uvicorn_config(app, header_timeout_s=config.header_timeout_s,
                                           limit_concurrency=config.limit_concurrency, host=config.host,
                                           port=config.port))
    server.run()
    if config.exit_on_fatal and app.state.runner.fatal is not None:
        raise SystemExit(1)


def build_server_app(config: ServerConfig, *, api_key: str | None, progress: bool = True,
                     on_fatal: Callable[[], None] | None = None) -> FastAPI:
    """Load ``config``'s model (and drafter), build its engine and the app that serves it (the
    engine thread starts with the app). The app requires ``api_key`` (None: no key), whatever
    ``config.api_key`` says: a Ray Serve replica leaves the key to its ingress."""
    # Looked up when called, not at import: tests patch both on their modules.
    from verispec.engine.engine import Engine
    from verispec.models.loader import load_model

    target = load_model(config.model, device=config.device, dtype=config.dtype, progress=progress,
                        quantization=config.quantization, group_size=config.quantization_group_size,
                        kv_cache_dtype=config.kv_cache_dtype)
    engine = Engine(target, config.spec(), max_model_len=config.max_model_len, max_num_seqs=config.max_num_seqs,
                    prefix_caching=config.enable_prefix_caching)
    # without a key (a Ray Serve replica's app), there is nothing to guard /metrics with
    everywhere = config.api_key_for_metrics_and_docs and api_key is not None
    return build_app(engine, config.name, api_key=api_key, api_key_for_metrics_and_docs=everywhere,
                     max_queue=config.max_queue, max_request_bytes=config.max_request_bytes,
                     request_timeout_s=config.request_timeout_s, max_step_s=config.max_step_s,
                     body_timeout_s=config.body_timeout_s, on_fatal=on_fatal)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # another host name: it may resolve to any address
        return False


def warn_if_exposed(host: str, api_key: str | None) -> None:
    if api_key is None and not is_loopback(host):
        log.warning("serving on %s without an API key: anyone who can reach this port can use the model "
                    "(set --api-key-file or VERISPEC_API_KEY)", host)
