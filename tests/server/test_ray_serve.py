"""Scale-out on Ray Serve: a local Ray cluster on loopback with 2 replicas of the SmolLM2 model
(n-gram speculation), reached with the real ``openai`` client through the ingress.

The tests share one deployment and run in file order; the last one shuts it down. Each replica
decodes on one thread; greedy texts must equal a single in-process ``verispec serve`` app's.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from verispec.config import SpeculativeConfig
from verispec.engine.engine import Engine
from verispec.server.app import build_app
from verispec.server.ray_serve import APP_NAME, ScaleOutConfig, build_application, rendezvous_order
from verispec.server.serve import BackgroundServer

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
KEY = "ray-test-key"
SPEC = {"method": "ngram", "num_speculative_tokens": 4}
MAX_MODEL_LEN = 1024
REPLICAS = 2
CHATS = ["Name three colours.", "Count from one to five.", "What is a prime number?",
         "Write a haiku about rain.", "Say hello in French.", "List two fruits."]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,",
           "import numpy as np\n", "The sky is blue because"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = ScaleOutConfig(model=MODEL, speculative_config=SPEC, num_replicas=REPLICAS, threads=1,
                            max_model_len=MAX_MODEL_LEN, api_key=KEY, health_check_period_s=1.0,
                            graceful_shutdown_timeout_s=30.0)
    serve.run(build_application(config), name=APP_NAME, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while len(ray.get(directory().actors.remote())) < REPLICAS:  # both replicas have reported
        assert time.monotonic() < deadline, "the replicas never reported their metrics"
        time.sleep(0.5)
    try:
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=cluster + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def single(smollm):
    """The reference: one in-process ``verispec serve`` app on the same model and drafter."""
    engine = Engine(smollm, SpeculativeConfig.from_dict(SPEC), max_model_len=MAX_MODEL_LEN, max_num_seqs=4)
    with BackgroundServer(build_app(engine, MODEL)) as live:
        yield openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=120)


def directory():
    return ray.get_actor(f"verispec-metrics-{APP_NAME}", namespace="serve")


def users_by_replica(per_replica: int) -> dict[str, list[str]]:
    """``per_replica`` user names that the affinity router sends to each live replica (the
    router's own hashing, over the replicas' ids)."""
    replicas = sorted(ray.get(directory().actors.remote()))
    assert len(replicas) == REPLICAS, replicas
    users: dict[str, list[str]] = {r: [] for r in replicas}
    i = 0
    while min(map(len, users.values())) < per_replica:
        name = f"user-{i}"
        home = users[rendezvous_order("user:" + name, replicas)[0]]
        if len(home) < per_replica:
            home.append(name)
        i += 1
    return users


def replica_counters(url: str) -> dict[str, float]:
    """Completed requests per replica, from the ingress's merged ``/metrics``."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    done: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "verispec:request_success_total":
                done[s.labels["replica"]] = done.get(s.labels["replica"], 0.0) + s.value
    return done


def ask(client: openai.OpenAI, i: int, stream: bool, user: str | None = None) -> tuple[str, str | None]:
    """Request ``i`` (even: chat, odd: completion), streamed or not: (text, replica or None)."""
    extra = {} if user is None else {"user": user}
    if i % 2 == 0:
        messages = [{"role": "user", "content": CHATS[i // 2 % len(CHATS)]}]
        if stream:
            chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32,
                                                    temperature=0, stream=True, **extra)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), None
        raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=32,
                                                               temperature=0, **extra)
        return raw.parse().choices[0].message.content, raw.headers.get("x-verispec-replica")
    prompt = PROMPTS[i // 2 % len(PROMPTS)]
    if stream:
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stream=True,
                                           **extra)
        return "".join(c.choices[0].text for c in chunks if c.choices), None
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0,
                                                      **extra)
    return raw.parse().choices[0].text, raw.headers.get("x-verispec-replica")


def test_replicas_answer_concurrent_requests_as_one_server_does(cluster, client, single):
    a, b = users_by_replica(6).values()
    users = [user for pair in zip(a, b) for user in pair]  # alternating between the replicas
    jobs = [(i, i % 4 >= 2, users[i % len(users)]) for i in range(24)]  # chat/completion x stream/plain
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda job: ask(client, *job), jobs))
    want = [ask(single, i, stream)[0] for i, stream, _ in jobs]
    assert [text for text, _ in got] == want
    assert all(want), "every reference answer has text"
    served_by = {replica for _, replica in got if replica is not None}
    assert len(served_by) == REPLICAS, served_by
    # The replicas' own counters agree: both completed requests, all of them in total.
    deadline = time.monotonic() + 15
    while True:
        done = replica_counters(cluster)
        if sum(done.values()) >= len(jobs) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert set(done) == served_by and all(n > 0 for n in done.values()), done
    assert sum(done.values()) == len(jobs)


def test_requests_with_one_user_stay_on_one_replica(client):
    replicas = {ask(client, i, stream=False, user="the-same-user")[1] for i in range(6)}
    assert len(replicas) == 1, replicas


def test_the_ingress_checks_the_key_and_forwards_errors(cluster, client):
    bad = openai.OpenAI(base_url=cluster + "/v1", api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert [m.id for m in client.models.list().data] == [MODEL]
    with pytest.raises(openai.NotFoundError, match="does not exist"):  # the replica's own answer
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=MAX_MODEL_LEN * 2)


def long_stream(client: openai.OpenAI, user: str, started: threading.Event) -> tuple[str, str | None]:
    """A long streamed completion: (text, finish reason or the error it ended with); ``started``
    is set when its first text arrives."""
    pieces, finish = [], None
    try:
        for c in client.completions.create(model=MODEL, prompt="Tell me a long story about a dragon.",
                                           max_tokens=300, temperature=0, stream=True, user=user,
                                           extra_body={"ignore_eos": True}):
            if c.choices:
                pieces.append(c.choices[0].text)
                finish = c.choices[0].finish_reason or finish
                started.set()
    except openai.APIError as e:
        finish = f"error: {e}"
    return "".join(pieces), finish


def test_a_killed_replica_fails_only_its_requests_and_serve_replaces_it(cluster, client):
    before = ray.get(directory().actors.remote())
    users = users_by_replica(3)
    victim, survivor = sorted(users)
    with ThreadPoolExecutor(6) as pool:
        started = {user: threading.Event() for user in users[victim] + users[survivor]}
        streams = {user: pool.submit(long_stream, client, user, started[user]) for user in started}
        assert all(event.wait(120) for event in started.values())
        ray.kill(ray.get_actor(before[victim], namespace="serve"), no_restart=True)
        results = {user: f.result(timeout=300) for user, f in streams.items()}
    # The victim's streams end with an explicit error after the text they had; the survivor's complete.
    for user in users[victim]:
        text, finish = results[user]
        assert text and finish.startswith("error") and "the replica failed" in finish, results[user]
    for user in users[survivor]:
        assert results[user][1] == "length", results[user]
    # New requests are served meanwhile, and Serve brings a replacement replica up.
    assert all(ask(client, i, stream=False)[0] for i in range(4))
    deadline = time.monotonic() + 180
    while True:
        now = ray.get(directory().actors.remote(1.5))
        if len(now) == REPLICAS and victim not in now:
            break
        assert time.monotonic() < deadline, f"no replacement replica: {now}"
        time.sleep(1)
    replacement = (set(now) - set(before)).pop()
    reached = {ask(client, 1, stream=False, user=user)[1] for user in users_by_replica(1)[replacement]}
    assert reached == {replacement}


def test_the_deployment_shuts_down_after_draining_a_stream(cluster, client):
    first = threading.Event()
    result: list = []

    def run() -> None:
        pieces, finish = [], None
        for c in client.completions.create(model=MODEL, prompt="Tell me a story.", max_tokens=120,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True}):
            if c.choices:
                pieces.append(c.choices[0].text)
                finish = c.choices[0].finish_reason or finish
                first.set()
        result.append(("".join(pieces), finish))

    reader = threading.Thread(target=run)
    reader.start()
    assert first.wait(60)
    serve.delete(APP_NAME)  # blocks until the application is gone
    reader.join(timeout=60)
    assert result and result[0][1] == "length", result
    assert APP_NAME not in serve.status().applications
