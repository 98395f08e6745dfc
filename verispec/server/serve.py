"""``verispec serve``: load the target (and drafter), build the app and run uvicorn.

Shutdown (Ctrl-C or SIGTERM) is graceful in two stages. As soon as uvicorn starts shutting
down, :class:`GracefulServer` tells the engine thread to refuse new work and to give running
requests the app's grace period; requests still running then end with an explicit error event,
so every stream closes with a final ``data:`` line and ``[DONE]`` instead of being cut. uvicorn
meanwhile waits (up to ``GRACEFUL_SHUTDOWN_S``, longer than the grace) for those responses to
finish, and the app's lifespan then joins the engine thread.

Serving on a non-loopback address without an API key logs a warning: anyone who can reach the
port can then use the model.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time

import uvicorn

from verispec.config import MAX_REQUEST_BYTES, SpeculativeConfig

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 15  # uvicorn's wait for open responses; above the engine's grace period


class GracefulServer(uvicorn.Server):
    """A uvicorn server that starts the engine's graceful stop when its own shutdown starts."""

    async def shutdown(self, sockets=None) -> None:
        self.config.app.state.runner.begin_stop()
        await super().shutdown(sockets=sockets)


class BackgroundServer:
    """An app served by uvicorn in a background thread on a free port of 127.0.0.1 (for tests
    and benchmarks). Use as a context manager; leaving it shuts the server down gracefully."""

    def __init__(self, app, log_level: str = "warning") -> None:
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
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


def serve(model: str, spec: SpeculativeConfig | None, *, host: str, port: int, api_key: str | None,
          served_model_name: str | None, max_num_seqs: int, max_model_len: int, max_queue: int,
          device: str, dtype: str, request_timeout_s: float | None = 600.0, exit_on_fatal: bool = False,
          max_request_bytes: int = MAX_REQUEST_BYTES, prefix_caching: bool | None = None,
          kv_cache_dtype: str = "auto") -> None:
    """Run the server until it is stopped. With ``exit_on_fatal``, a dead engine thread stops
    the server (gracefully, as SIGTERM would) and the process exits with status 1."""
    from verispec.engine.engine import Engine
    from verispec.models.loader import load_model
    from verispec.server.app import build_app

    warn_if_exposed(host, api_key)
    target = load_model(model, device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    engine = Engine(target, spec, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                    prefix_caching=prefix_caching)
    server: GracefulServer | None = None

    def on_fatal() -> None:
        if exit_on_fatal and server is not None:
            server.should_exit = True

    app = build_app(engine, served_model_name or model, api_key=api_key, max_queue=max_queue,
                    max_request_bytes=max_request_bytes,
                    request_timeout_s=request_timeout_s, on_fatal=on_fatal)
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    server = GracefulServer(config)
    server.run()
    if exit_on_fatal and app.state.runner.fatal is not None:
        raise SystemExit(1)


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
