"""The Ray Serve deployment's parts that need no cluster: affinity keys, the router's ranking,
merged metrics, the settings, the health probe, the CLI's checks and the replicas it builds."""

from __future__ import annotations

import asyncio
import itertools
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from transformers import Qwen2Config, Qwen2ForCausalLM

from liveserver import CHARS, SPECIALS, char_tokenizer
from verispec.cli import main
from verispec.server import ray_serve
from verispec.server.metrics import ServerMetrics
from verispec.server.ray_serve import (AffinityRouter, EngineReplica, Forwarded, ScaleOutConfig, affinity_key,
                                       app_builder, merge_metrics, rendezvous_order)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "scaling.md"


def test_the_affinity_key_is_the_user_else_the_start_of_the_prompt():
    assert affinity_key(b'{"prompt": "abcdef", "user": "ann"}', 3) == "user:ann"
    assert affinity_key(b'{"prompt": "abcdef"}', 3) == "prompt:abc"
    assert affinity_key(b'{"prompt": [5, 6, 7, 8]}', 3) == "prompt:5 6"
    chat = (b'{"messages": [{"role": "system", "content": "be brief"},'
            b' {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}')
    assert affinity_key(chat, 100) == "prompt:be brief\nhi"
    assert affinity_key(b'{"prompt": "abcdef", "user": "ann"}', 0) is None  # affinity off
    for body in (b"not json", b"[1, 2]", b'{"prompt": ""}', b"\xff\xfe"):
        assert affinity_key(body, 10) is None


def test_rendezvous_order_moves_only_the_keys_of_a_replica_that_leaves():
    replicas = ["r1", "r2", "r3", "r4"]
    keys = [f"user:{i}" for i in range(400)]
    first = {k: rendezvous_order(k, replicas)[0] for k in keys}
    assert set(first.values()) == set(replicas)  # every replica gets keys
    assert all(rendezvous_order(k, list(reversed(replicas)))[0] == first[k] for k in keys)  # order-free
    after = {k: rendezvous_order(k, ["r1", "r2", "r4"])[0] for k in keys}
    moved = {k for k in keys if after[k] != first[k]}
    assert moved == {k for k in keys if first[k] == "r3"}


@dataclass(frozen=True)
class ReplicaID:  # the part of Serve's ReplicaID the router reads; hashable like it
    unique_id: str


def replica(unique_id: str):
    return SimpleNamespace(replica_id=ReplicaID(unique_id))


def choose(replicas, key, queue_lengths=None, max_imbalance=4):
    router = SimpleNamespace(max_imbalance=max_imbalance,
                             replica_queue_len_cache={ReplicaID(i): n for i, n in (queue_lengths or {}).items()})
    router._by_affinity = lambda *a: AffinityRouter._by_affinity(router, *a)
    pending = None if key is False else SimpleNamespace(args=[Forwarded("POST", "/v1/completions", b"", [], b"",
                                                                         key)])
    return asyncio.run(AffinityRouter.choose_replicas(router, replicas, pending))


def test_the_router_ranks_the_preferred_replica_first_unless_it_is_overloaded():
    replicas = [replica(i) for i in ("a", "b", "c")]
    home = rendezvous_order("user:x", ["a", "b", "c"])[0]
    ranks = choose(replicas, "user:x")
    assert [r.replica_id.unique_id for r in ranks[0]] == [home]
    assert len(ranks) == 2 and len(ranks[1]) == 2  # then the less loaded of two random replicas
    loads = {"a": 0, "b": 0, "c": 0}
    assert len(choose(replicas, "user:x", {**loads, home: 3})) == 2  # 3 more is still balanced
    assert len(choose(replicas, "user:x", {**loads, home: 4})) == 1  # 4 more: load decides
    for key in (None, False):  # no key, no request: power of two choices
        assert len(choose(replicas, key)) == 1 and len(choose(replicas, key)[0]) == 2
    assert choose([], "user:x") == []
    assert choose(replicas[:1], "user:x") == [replicas[:1]]


def test_merged_metrics_label_each_replicas_samples():
    a, b = ServerMetrics(), ServerMetrics()
    a.success.labels(finished_reason="stop").inc(3)
    b.success.labels(finished_reason="length").inc(2)
    from prometheus_client import generate_latest

    text = merge_metrics({"ra": generate_latest(a.registry).decode(), "rb": generate_latest(b.registry).decode()})
    samples = {(s.labels.get("replica"), s.labels.get("finished_reason")): s.value
               for f in text_string_to_metric_families(text.decode()) for s in f.samples
               if s.name == "verispec:request_success_total"}
    assert samples == {("ra", "stop"): 3.0, ("rb", "length"): 2.0}


def test_the_ingress_guards_its_metrics_with_the_key_only_when_asked():
    """As the single server: ``api_key_for_metrics_and_docs`` puts /metrics behind the key;
    /health stays open."""
    async def metrics_text() -> bytes:
        return b"verispec:x 1.0\n"

    async def status(app, path: str, key: str | None) -> int:
        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        scope = {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "root_path": "",
                 "query_string": b"", "headers": headers, "scheme": "http", "http_version": "1.1",
                 "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1)}
        sent = []

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        await app(scope, receive, send)
        return sent[0]["status"]

    for everywhere, without_key in ((False, 200), (True, 401)):
        config = ScaleOutConfig(model="m", api_key="k", api_key_for_metrics_and_docs=everywhere)
        app = ray_serve.build_ingress_app(SimpleNamespace(api_key="k", config=config, metrics_text=metrics_text))
        assert asyncio.run(status(app, "/metrics", None)) == without_key
        assert asyncio.run(status(app, "/metrics", "k")) == 200
        assert asyncio.run(status(app, "/health", None)) == 200


def test_the_settings_are_checked_before_any_replica_starts():
    with pytest.raises(ValidationError, match="Extra inputs"):
        ScaleOutConfig(model="m", replicas=2)
    with pytest.raises(ValidationError, match="unknown speculative method"):
        ScaleOutConfig(model="m", speculative_config={"method": "nope"})
    with pytest.raises(ValidationError, match="max_replicas must be >= min_replicas"):
        ScaleOutConfig(model="m", min_replicas=3, max_replicas=2)
    with pytest.raises(ValidationError, match="Input should be 'auto', 'float32' or 'float16'"):
        ScaleOutConfig(model="m", kv_cache_dtype="int8")
    with pytest.raises(ValidationError, match="exit_on_fatal is for a single server"):
        ScaleOutConfig(model="m", exit_on_fatal=True)
    with pytest.raises(ValueError, match="port: a Serve config file sets the address under http_options"):
        app_builder({"model": "m", "port": 8001})
    assert ScaleOutConfig(model="m", num_replicas=2).autoscaling() is None
    assert ScaleOutConfig(model="m", max_replicas=4, target_ongoing_requests=2,
                          autoscaling_options={"upscale_delay_s": 5}).autoscaling() == {
        "min_replicas": 1, "max_replicas": 4, "initial_replicas": 1, "target_ongoing_requests": 2.0,
        "upscale_delay_s": 5}


def test_the_serve_config_file_in_the_docs_builds_the_application():
    block = re.search(r"```yaml\n(.*?)```", DOCS.read_text(), re.S).group(1)
    app = yaml.safe_load(block)["applications"][0]
    assert app["import_path"] == "verispec.server.ray_serve:app_builder"
    config = ScaleOutConfig.model_validate(app["args"])
    assert config.spec() is not None
    assert app_builder(app["args"]) is not None


def test_the_health_probe_fails_when_the_engine_thread_died():
    alive = SimpleNamespace(runner=SimpleNamespace(alive=True, fatal=None))
    EngineReplica.check_health(alive)
    dead = SimpleNamespace(runner=SimpleNamespace(alive=False, fatal="RuntimeError: boom"))
    with pytest.raises(RuntimeError, match="engine thread has died: RuntimeError: boom"):
        EngineReplica.check_health(dead)


@pytest.mark.parametrize(("argv", "message"), [
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--replicas", "2", "--exit-on-fatal"], "--exit-on-fatal is for a single server"),
    (["--max-replicas", "1", "--min-replicas", "2"], "max_replicas must be >= min_replicas"),
    (["--replicas", "2", "--speculative-method", "nope"], "unknown speculative method"),
])
def test_serve_with_replicas_refuses_bad_settings_before_starting_ray(capsys, argv, message):
    assert main(["serve", "no-such-model-anywhere", *argv]) == 2
    assert message in capsys.readouterr().err


def test_serve_with_replicas_refuses_an_unknown_model_before_starting_ray(capsys):
    assert main(["serve", "no-such-model-anywhere", "--replicas", "2"]) == 2
    assert "not a bundled model name" in capsys.readouterr().err


def test_serve_with_replicas_says_what_to_install_without_ray(monkeypatch, capsys):
    import verispec.server

    monkeypatch.delattr(verispec.server, "ray_serve", raising=False)
    monkeypatch.setitem(sys.modules, "verispec.server.ray_serve", None)  # import fails as without Ray
    assert main(["serve", "m", "--replicas", "2"]) == 2
    assert "pip install 'verispec[ray]'" in capsys.readouterr().err


def save_tiny_model(directory: Path) -> None:
    """A random one-layer Qwen2 model with the live server's character tokenizer, saved as a
    Hugging Face directory for ``verispec serve`` to load."""
    config = Qwen2Config(vocab_size=len(SPECIALS) + len(CHARS), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128)
    Qwen2ForCausalLM(config).save_pretrained(str(directory))
    char_tokenizer().hf.save_pretrained(str(directory))


def test_serve_with_replicas_gives_every_replica_the_kv_cache_dtype(tmp_path, monkeypatch):
    """`verispec serve MODEL --replicas 2 --kv-cache-dtype float32` starts both replicas, and each
    replica's engine keeps its KV cache in float32 (the model's own dtype, bfloat16, is what auto
    would keep). A key that guards /metrics too is the ingress's to check: the replicas start
    without one. Ray is left out: `run` builds every replica as Serve does, from the one config
    it is given, and no metrics directory answers; test_ray_serve.py runs a real cluster."""
    save_tiny_model(tmp_path / "tiny")
    replicas: list[EngineReplica] = []

    def run(config: ScaleOutConfig, ray_address: str | None = None) -> None:
        replicas.extend(EngineReplica(config) for _ in range(config.num_replicas))

    def no_actor(*args, **kwargs):
        raise ValueError("no cluster")  # what ray.get_actor raises for an actor that does not exist

    ids = itertools.count()
    monkeypatch.setattr(ray_serve, "run", run)
    monkeypatch.setattr(ray_serve.serve, "get_replica_context", lambda: SimpleNamespace(
        replica_id=ReplicaID(f"replica-{next(ids)}"), app_name="verispec"))
    monkeypatch.setattr(ray_serve, "ray", SimpleNamespace(
        get_runtime_context=lambda: SimpleNamespace(get_actor_name=lambda: None), get_actor=no_actor))
    try:
        assert main(["serve", str(tmp_path / "tiny"), "--replicas", "2", "--kv-cache-dtype", "float32",
                     "--max-model-len", "64", "--threads", "1", "--api-key", "k",
                     "--api-key-for-metrics-and-docs"]) == 0
        assert len(replicas) == 2
        for replica in replicas:
            engine = replica.runner.engine
            assert replica.runner.alive
            assert engine.target.model.dtype == torch.bfloat16
            assert engine.target.model.kv_cache_dtype == torch.float32
            assert {k.dtype for k in engine.cache.k} == {torch.float32}
    finally:
        for replica in replicas:
            replica.__del__()  # as Serve does when a replica stops
        for thread in threading.enumerate():  # the metrics reports end before the stubs go
            if thread.name == "verispec-metrics":
                thread.join(timeout=10)
