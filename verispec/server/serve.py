"""``verispec serve``: load the target (and drafter), build the app and run uvicorn."""

from __future__ import annotations

from verispec.config import SpeculativeConfig

# Seconds uvicorn waits for open connections on shutdown before cancelling them; the engine
# thread then aborts what still runs, so every client gets a final event or a closed stream.
GRACEFUL_SHUTDOWN_S = 10


def serve(model: str, spec: SpeculativeConfig | None, *, host: str, port: int, api_key: str | None,
          served_model_name: str | None, max_num_seqs: int, max_model_len: int, max_queue: int,
          device: str, dtype: str) -> None:
    import uvicorn

    from verispec.engine.engine import Engine
    from verispec.models.loader import load_model
    from verispec.server.app import build_app

    target = load_model(model, device=device, dtype=dtype)
    engine = Engine(target, spec, max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    app = build_app(engine, served_model_name or model, api_key=api_key, max_queue=max_queue)
    uvicorn.run(app, host=host, port=port, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
