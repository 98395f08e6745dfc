"""Scale-out on Ray Serve: replicas of the verispec engine behind one OpenAI endpoint.

The application has two deployments::

    HTTP -> Serve proxy -> VerispecIngress --(handle, affinity router)--> VerispecEngine x N

* ``VerispecEngine`` replicas each own one :class:`~verispec.engine.engine.Engine` (model,
  drafter, continuous batching) and the same FastAPI app as ``verispec serve``, built from the
  same settings (:func:`verispec.server.serve.build_server_app`), so routes, errors,
  ``speculative`` extras and ``speculative_stats`` are the single server's, byte for byte. The
  app is driven in-process (:meth:`EngineReplica.forward` plays the ASGI server): no port per
  replica.
* ``VerispecIngress`` checks the API key and the body size, reads just enough of the JSON body to
  pick an affinity key, forwards the raw request through a deployment handle and streams the
  replica's response back. ``/metrics`` merges every replica's ``verispec:`` metrics (each sample
  labelled ``replica``) with the ingress's own; ``/health`` answers for the ingress.

Routing is Serve's request router with a verispec policy, :class:`AffinityRouter`: requests
with the same affinity key (the OpenAI ``user`` field, else the first ``affinity_prefix_chars``
characters of the prompt) go to the same replica by rendezvous hashing, so a suffix drafter's
cross-request cache (and any prefix reuse) stays warm, and a replica joining or leaving moves
only its own share of keys. Load wins over affinity: when the preferred replica's queue is
``max_imbalance`` requests longer than the shortest one, or full, the request goes to the least
loaded of two random replicas (power of two choices, Serve's default policy).

Failure handling:

* A replica whose engine thread died fails Serve's health check (``check_health``), and Serve
  replaces it. A replica whose process dies is replaced the same way.
* A request whose replica fails before any byte reached the client is retried once on another
  replica (nothing was shown, so nothing is repeated; sampled requests with a seed give the same
  text). After the response started it cannot be retried: a stream ends with an error event and
  ``[DONE]``, as the single server ends a failed request; a plain request gets 503.
* Graceful shutdown: Serve stops routing to a replica, waits up to
  ``graceful_shutdown_timeout_s`` for its requests, then the replica's engine gets its own grace
  period and aborts what is left with an explicit error event.

The settings are one pydantic model, :class:`ScaleOutConfig`: the single server's
:class:`~verispec.server.config.ServerConfig` plus the replicas' own fields, used by ``verispec
serve --replicas`` and by Serve config files (``import_path: verispec.server.ray_serve:app_builder``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import signal
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from pydantic import Field, model_validator
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from verispec.server.config import ServerConfig
from verispec.server.metrics import PREFIX
from verispec.server.protocol import error_body

log = logging.getLogger(__name__)

APP_NAME = "verispec"
REPORT_INTERVAL_S = 1.0  # how often a replica sends its metrics to the ingress's directory
REPORT_MAX_AGE_S = 10.0  # a replica silent for longer (gone) leaves /metrics
_SSE = "text/event-stream"
SERVE_NAMESPACE = "serve"  # where Serve runs its actors; the metrics directory lives there too


class ScaleOutConfig(ServerConfig):
    """A :class:`~verispec.server.config.ServerConfig` run as replicas: every server setting (each
    replica's engine and app; the ingress's key and body limit) plus the replicas' placement,
    scaling and routing. ``num_replicas`` fixes the count; ``max_replicas`` above ``min_replicas``
    turns on Serve's autoscaling on ongoing requests per replica. ``host`` and ``port`` are the
    Serve proxy's address for :func:`run`; a Serve config file sets that under ``http_options``."""

    # placement and scaling
    num_replicas: int = Field(1, ge=1)
    min_replicas: int | None = Field(None, ge=0)
    max_replicas: int | None = Field(None, ge=1)
    target_ongoing_requests: float = Field(4.0, gt=0)
    autoscaling_options: dict[str, Any] = Field(
        default_factory=dict, description="more of Serve's autoscaling_config, e.g. upscale_delay_s")
    num_cpus: float = Field(1.0, ge=0, description="CPUs each replica reserves")
    num_gpus: float = Field(0.0, ge=0, description="GPUs each replica reserves")
    max_ongoing_requests: int | None = Field(None, ge=1, description="default: 2 * max_num_seqs")
    # routing
    affinity_prefix_chars: int = Field(256, ge=0, description="0: no affinity, power of two choices only")
    max_imbalance: int = Field(4, ge=1)
    # Serve's operational settings
    health_check_period_s: float = Field(5.0, gt=0)
    graceful_shutdown_timeout_s: float = Field(30.0, ge=0)

    @model_validator(mode="after")
    def _check_scale_out(self) -> ScaleOutConfig:
        if self.exit_on_fatal:
            raise ValueError("exit_on_fatal is for a single server: Serve replaces a replica whose engine died")
        if self.max_replicas is not None and self.max_replicas < (self.min_replicas or 1):
            raise ValueError("max_replicas must be >= min_replicas")
        return self

    def autoscaling(self) -> dict | None:
        if self.max_replicas is None:
            return None
        low = self.min_replicas if self.min_replicas is not None else 1
        return {"min_replicas": low, "max_replicas": self.max_replicas,
                "initial_replicas": max(low, min(self.num_replicas, self.max_replicas)),
                "target_ongoing_requests": self.target_ongoing_requests, **self.autoscaling_options}


# ---- what travels from the ingress to a replica --------------------------------------------------

@dataclass(frozen=True)
class Forwarded:
    """One HTTP request as the ingress received it (body read whole, size already checked)."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    affinity_key: str | None = None  # read by AffinityRouter


@dataclass
class Start:
    """A replica's response status and headers; its body follows as ``bytes`` chunks."""

    status: int
    headers: list[tuple[bytes, bytes]]
    replica: str = ""
    stream: bool = False


def affinity_key(body: bytes, prefix_chars: int) -> str | None:
    """The routing key of a request body: its ``user``, else the start of its prompt (the
    concatenated message contents of a chat). None (no preference) for an unreadable body."""
    if prefix_chars <= 0:
        return None
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    user = data.get("user")
    if isinstance(user, str) and user:
        return "user:" + user
    text = ""
    if isinstance(data.get("prompt"), str):
        text = data["prompt"]
    elif isinstance(data.get("prompt"), list):
        text = " ".join(map(str, data["prompt"][:prefix_chars]))
    elif isinstance(data.get("messages"), list):
        parts = []
        for m in data["messages"]:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if isinstance(content, str):
                parts.append(content)
        text = "\n".join(parts)
    return "prompt:" + text[:prefix_chars] if text else None


def rendezvous_order(key: str, ids: list[str]) -> list[str]:
    """``ids`` from most to least preferred for ``key`` (highest random weight hashing): each
    key's order depends only on the ids present, so removing one moves only its keys."""
    def weight(replica: str) -> bytes:
        return hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest()
    return sorted(ids, key=weight, reverse=True)


class AffinityRouter(RequestRouter):
    """Serve request router: affinity by rendezvous hashing, with load taking over (module doc).

    Returns ranks of replicas; Serve takes the least loaded replica of the first rank that has
    room (its queue below ``max_ongoing_requests``), probing queue lengths as it needs."""

    def initialize_state(self, max_imbalance: int = 4) -> None:
        self.max_imbalance = max_imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        spread = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        key = _request_key(pending_request)
        if key is None or len(candidate_replicas) == 1:
            return [spread]
        try:
            return self._by_affinity(key, candidate_replicas, spread)
        except Exception:  # a raising router would leave the request waiting forever
            log.exception("affinity routing failed; routing by load")
            return [spread]

    def _by_affinity(self, key: str, candidate_replicas: list[RunningReplica],
                     spread: list[RunningReplica]) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        order = [by_id[i] for i in rendezvous_order(key, list(by_id))]
        lengths = [self.replica_queue_len_cache.get(r.replica_id) for r in order]
        known = [n for n in lengths if n is not None]
        if lengths[0] is not None and known and lengths[0] - min(known) >= self.max_imbalance:
            return [spread]
        return [[order[0]], spread]


def _request_key(pending: PendingRequest | None) -> str | None:
    # Duck-typed: the router may run with its own copy of this module's classes.
    for arg in () if pending is None else pending.args:
        key = getattr(arg, "affinity_key", None)
        if isinstance(key, str):
            return key
    return None


# ---- replicas ------------------------------------------------------------------------------------

@ray.remote(num_cpus=0)
class MetricsDirectory:
    """The latest metrics text of each replica, for the ingress's ``/metrics``."""

    def __init__(self) -> None:
        self.reports: dict[str, tuple[float, str, str]] = {}  # replica: (time, actor name, text)

    def report(self, replica: str, actor_name: str, text: str) -> None:
        self.reports[replica] = (time.monotonic(), actor_name, text)

    def _fresh(self, max_age_s: float) -> dict[str, tuple[float, str, str]]:
        now = time.monotonic()
        self.reports = {r: report for r, report in self.reports.items() if now - report[0] <= max_age_s}
        return self.reports

    def snapshot(self, max_age_s: float = REPORT_MAX_AGE_S) -> dict[str, str]:
        """Each live replica's metrics text."""
        return {r: text for r, (_, _, text) in self._fresh(max_age_s).items()}

    def actors(self, max_age_s: float = REPORT_MAX_AGE_S) -> dict[str, str]:
        """Each live replica's Ray actor name (to find its process, e.g. to stop it)."""
        return {r: name for r, (_, name, _) in self._fresh(max_age_s).items()}


def _directory_name(app_name: str) -> str:
    return f"verispec-metrics-{app_name}"


class EngineReplica:
    """One engine and its app in a Serve replica (module doc)."""

    def __init__(self, config: ScaleOutConfig) -> None:
        from verispec.runtime import set_threads  # torch: imported by replicas only, not by the ingress
        from verispec.server.serve import build_server_app

        self.runner = None  # until the engine runs (Serve calls the destructor even if __init__ fails)
        self._stopping = threading.Event()
        set_threads(config.threads or max(1, int(config.num_cpus)))
        self.app = build_server_app(config, api_key=None, progress=False)  # the ingress checks the key
        self.runner = self.app.state.runner
        self.runner.start()
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self.directory_name = _directory_name(context.app_name)
        threading.Thread(target=self._report_metrics, name="verispec-metrics", daemon=True).start()

    def check_health(self) -> None:
        """Serve's liveness probe: a dead engine thread fails it, and Serve replaces the replica."""
        if not self.runner.alive:
            raise RuntimeError(f"the engine thread has died: {self.runner.fatal}")

    async def forward(self, request: Forwarded) -> AsyncIterator[Start | bytes]:
        """Run ``request`` through the app: yield its :class:`Start`, then its body chunks. If the
        caller goes away (the generator is cancelled), the app sees the client disconnect, which
        aborts the engine request."""
        sent: asyncio.Queue[dict] = asyncio.Queue()
        gone = asyncio.Event()
        body_read = False

        async def receive() -> dict:
            nonlocal body_read
            if not body_read:
                body_read = True
                return {"type": "http.request", "body": request.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
                 "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "root_path": "",
                 "query_string": request.query_string, "headers": request.headers,
                 "client": ("ingress", 0), "server": ("replica", 0), "state": {}}
        app = asyncio.ensure_future(self.app(scope, receive, sent.put))
        try:
            more = True
            while more:
                if app.done() and sent.empty():
                    app.result()  # raises what the app raised
                    raise RuntimeError("the app returned without finishing its response")
                get = asyncio.ensure_future(sent.get())
                await asyncio.wait({get, app}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    continue
                message = get.result()
                if message["type"] == "http.response.start":
                    headers = list(message.get("headers", []))
                    stream = any(k == b"content-type" and v.startswith(_SSE.encode()) for k, v in headers)
                    yield Start(message["status"], headers, self.replica, stream)
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield bytes(message["body"])
                    more = message.get("more_body", False)
        finally:
            gone.set()
            if not app.done():
                try:
                    await asyncio.wait_for(app, timeout=5)
                except (asyncio.TimeoutError, Exception):
                    app.cancel()

    def _report_metrics(self) -> None:
        directory = None
        actor_name = ray.get_runtime_context().get_actor_name()
        while not self._stopping.wait(REPORT_INTERVAL_S):
            try:
                if directory is None:
                    directory = ray.get_actor(self.directory_name, namespace=SERVE_NAMESPACE)
                text = generate_latest(self.runner.metrics.registry).decode()
                directory.report.remote(self.replica, actor_name, text)
            except Exception:  # no ingress yet, or it restarted: look the directory up again
                directory = None

    def __del__(self) -> None:
        self._stopping.set()
        if self.runner is None:
            return
        self.runner.begin_stop()
        self.runner.stop()


# ---- the ingress ---------------------------------------------------------------------------------

class Ingress:
    """The endpoint clients see (module doc)."""

    def __init__(self, engine: Any, config: ScaleOutConfig) -> None:
        self.engine = engine.options(stream=True, method_name="forward")
        self.config = config
        self.api_key = config.resolved_api_key()
        self.directory = MetricsDirectory.options(
            name=_directory_name(serve.get_replica_context().app_name), namespace=SERVE_NAMESPACE,
            get_if_exists=True).remote()
        self.registry = CollectorRegistry()
        self.retried = Counter(PREFIX + "ingress_retried", "Requests retried on another replica after "
                               "theirs failed before responding.", registry=self.registry)
        self.failed = Counter(PREFIX + "ingress_replica_failed", "Requests whose replica failed after "
                              "the response started (or twice).", registry=self.registry)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_ingress_app(self)

    async def forward(self, http: Request) -> Response:
        body = await http.body()
        path, root = http.scope["path"], http.scope.get("root_path", "")
        if root and path.startswith(root):  # served under a route prefix: the replica's app has none
            path = path[len(root):]
        request = Forwarded(http.method, path, http.scope.get("query_string", b""),
                            [(k, v) for k, v in http.scope["headers"] if k != b"content-length"]
                            + [(b"content-length", str(len(body)).encode())],
                            body, affinity_key(body, self.config.affinity_prefix_chars))
        for attempt in (0, 1):
            response = self.engine.remote(request)
            try:
                start = await response.__anext__()
            except Exception as e:  # the replica failed before answering: nothing was sent yet
                response.cancel()
                if attempt == 0:
                    log.warning("replica failed before responding (%s); retrying on another", e)
                    self.retried.inc()
                    continue
                self.failed.inc()
                return _replica_failed(e)
            break
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers}
        headers["x-verispec-replica"] = start.replica
        if not start.stream:  # one JSON body: read it whole, so a failure can still be a clean 503
            try:
                content = b"".join([chunk async for chunk in response])
            except Exception as e:
                self.failed.inc()
                return _replica_failed(e)
            return Response(content, status_code=start.status, headers=headers)
        headers.pop("content-length", None)
        return StreamingResponse(self._relay(response), status_code=start.status, headers=headers)

    async def _relay(self, response: Any) -> AsyncIterator[bytes]:
        try:
            async for chunk in response:
                yield chunk
        except Exception as e:  # the replica died mid-stream: end it as the single server ends a failed one
            self.failed.inc()
            log.warning("replica failed mid-stream: %s", e)
            payload = error_body(f"request not completed: the replica failed ({type(e).__name__})",
                                 "service_unavailable", code="replica_failed")
            yield f"data: {json.dumps(payload, separators=(',', ':'))}\n\ndata: [DONE]\n\n".encode()
        finally:
            response.cancel()  # a client that left stops the replica's work too

    async def metrics_text(self) -> bytes:
        reports = await self.directory.snapshot.remote()
        return merge_metrics(reports) + generate_latest(self.registry)


def _replica_failed(e: Exception) -> JSONResponse:
    body = error_body(f"the replica serving this request failed ({type(e).__name__}); retry",
                      "service_unavailable", code="replica_failed")
    return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})


def merge_metrics(reports: dict[str, str]) -> bytes:
    """One Prometheus text of several replicas' texts, each sample labelled ``replica``."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(reports.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for s in family.samples:
                merged.add_sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp)

    class Collected:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collected())
    return generate_latest(registry)


def build_ingress_app(ingress: Ingress) -> FastAPI:
    from verispec.server.app import _Gate

    app = FastAPI(title="verispec (Ray Serve)", openapi_url=None, docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await ingress.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/v1/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"])
    async def v1(http: Request) -> Response:
        return await ingress.forward(http)

    return _Gate(app, api_key=ingress.api_key, max_request_bytes=ingress.config.max_request_bytes,
                 everywhere=ingress.config.api_key_for_metrics_and_docs)


# ---- building the application -------------------------------------------------------------------

def build_application(config: ScaleOutConfig) -> serve.Application:
    """The Serve application for ``config`` (for ``serve.run``)."""
    autoscaling = config.autoscaling()
    engine = serve.deployment(EngineReplica, name="VerispecEngine").options(
        num_replicas="auto" if autoscaling else config.num_replicas,
        autoscaling_config=autoscaling,
        ray_actor_options={"num_cpus": config.num_cpus, "num_gpus": config.num_gpus},
        max_ongoing_requests=config.max_ongoing_requests or 2 * config.max_num_seqs,
        health_check_period_s=config.health_check_period_s,
        graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
        request_router_config=RequestRouterConfig(request_router_class=AffinityRouter,
                                                  request_router_kwargs={"max_imbalance": config.max_imbalance}),
    )
    ingress = serve.deployment(serve.ingress()(Ingress), name="VerispecIngress").options(
        num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024,
        graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
    )
    return ingress.bind(engine.bind(config), config)


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Serve's application builder: ``import_path: verispec.server.ray_serve:app_builder`` with
    the :class:`ScaleOutConfig` fields under ``args`` in a Serve config file."""
    placed = sorted({"host", "port"} & set(args))
    if placed:
        raise ValueError(f"{' and '.join(placed)}: a Serve config file sets the address under http_options, "
                         "not in the application's args")
    return build_application(ScaleOutConfig.model_validate(args))


def run(config: ScaleOutConfig, *, ray_address: str | None = None) -> None:
    """``verispec serve --replicas``: join or start Ray, start Serve's proxy on ``config.host`` and
    ``config.port``, run the application until Ctrl-C or SIGTERM, then shut it down gracefully."""
    if ray_address is None:
        ray.init(include_dashboard=False)  # a local Ray instance on this machine's CPUs
    else:
        ray.init(address=ray_address)
    serve.start(http_options={"host": config.host, "port": config.port})
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        serve.run(build_application(config), name=APP_NAME, route_prefix="/")  # logs "ready at URL"
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        serve.delete(APP_NAME)  # drains in-flight requests (graceful_shutdown_timeout_s)
        if ray_address is None:
            serve.shutdown()
            ray.shutdown()
