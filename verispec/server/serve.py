"""``verispec serve``: load the target (and drafter), build the app and run uvicorn.

Shutdown (Ctrl-C or SIGTERM) is graceful in two stages. As soon as uvicorn starts shutting
down, :class:`GracefulServer` tells the engine thread to refuse new work and to give running
requests the app's grace period; requests still running then end with an explicit error event,
so every stream closes with a final ``data:`` line and ``[DONE]`` instead of being cut. uvicorn
meanwhile waits (up to ``GRACEFUL_SHUTDOWN_S``, longer than the grace) for those responses to
finish, and the app's lifespan then joins the engine thread.
"""

from __future__ import annotations

import uvicorn

from verispec.config import SpeculativeConfig

GRACEFUL_SHUTDOWN_S = 15  # uvicorn's wait for open responses; above the engine's grace period


class GracefulServer(uvicorn.Server):
    """A uvicorn server that starts the engine's graceful stop when its own shutdown starts."""

    async def shutdown(self, sockets=None) -> None:
        self.config.app.state.runner.begin_stop()
        await super().shutdown(sockets=sockets)


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
