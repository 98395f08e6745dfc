"""``verispec serve``: load the target (and drafter), build the app and run uvicorn.

Shutdown (Ctrl-C or SIGTERM) is graceful in two stages. As soon as uvicorn starts shutting
down, :class:`GracefulServer` tells the engine thread to refuse new work and to give running
requests the app's grace period; requests still running then end with an explicit error event,
so every stream closes with a final ``data:`` line and ``[DONE]`` instead of being cut. uvicorn
meanwhile waits (up to ``GRACEFUL_SHUTDOWN_S``, longer than the grace) for those responses to
finish, and the app's lifespan then joins the engine thread.
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from verispec.config import SpeculativeConfig

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
          device: str, dtype: str) -> None:
    from verispec.engine.engine import Engine
    from verispec.models.loader import load_model
    from verispec.server.app import build_app

    target = load_model(model, device=device, dtype=dtype)
    engine = Engine(target, spec, max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    app = build_app(engine, served_model_name or model, api_key=api_key, max_queue=max_queue)
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    GracefulServer(config).run()
