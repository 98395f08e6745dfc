"""Fault injection: one request's failure stays its own, every request ends, nothing leaks.

Each test runs a live server on the tiny models (4 slots, a draft model drafting 3 tokens),
records fault-free greedy outputs, then makes a fault happen for "poisoned" requests (their
prompt starts with ``poison``) or for everyone, and runs poisoned and healthy requests together
through the real ``openai`` client. It checks that:

* healthy requests give exactly their fault-free text;
* poisoned requests end with an OpenAI error body (non-streaming: the status and envelope;
  streaming: an error event, then ``[DONE]``);
* no slot leaks: every slot is free, the gauges read zero, and the server runs its full
  concurrency again;
* ``/health`` tells the truth, and the request counters add up
  (received = success + aborted + rejected + running + waiting).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import random
import threading
import time

import openai
import pytest

from liveserver import API_KEY, K, make_server, wait_idle

GREEDY = {"temperature": 0.0}
HEALTHY = [f"healthy {i}: " + "abcdefgh"[: i % 6] for i in range(6)]
POISONED = ["poison one", "poison two"]
MAX_TOKENS = 12


def poisoned(engine, seq) -> bool:
    return engine.target.tokenizer.hf.decode(seq.prompt_ids).startswith("poison")


def poisoned_slots(engine, slots) -> bool:
    return any(poisoned(engine, seq) for seq in engine.running if seq.slot in slots)


class Injected(Exception):
    """The injected fault (not one the engine expects: no ValueError or RuntimeError)."""


def client_for(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def alone(live, prompts: list[str]) -> list[str]:
    """Greedy texts of the prompts run one at a time (the reference)."""
    c = client_for(live)
    return [c.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, **GREEDY).choices[0].text
            for p in prompts]


async def one(aclient: openai.AsyncOpenAI, prompt: str, stream: bool, pin: bool = False) -> tuple[str, object]:
    """("ok", text), or ("error", (status or None inside a stream, error type, message))."""
    args = dict(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, **GREEDY)
    if pin or prompt.startswith("poison"):  # pinned k: its drafter is asked every round
        args["extra_body"] = {"speculative": {"num_speculative_tokens": K}}
    try:
        if not stream:
            return "ok", (await aclient.completions.create(**args)).choices[0].text
        text = ""
        async for chunk in await aclient.completions.create(stream=True, **args):
            text += chunk.choices[0].text
        return "ok", text
    except openai.APIStatusError as e:
        return "error", (e.status_code, e.body["type"], e.body["message"])
    except openai.APIError as e:  # an error event inside a stream
        return "error", (None, e.body["type"], e.message)


def internal_error(result) -> bool:
    """An OpenAI error body for an engine fault: 500 (or an event in a stream), server_error."""
    kind, detail = result
    return kind == "error" and detail[0] in (500, None) and detail[1] == "server_error" and (
        "internal engine error" in detail[2])


def run_together(live, prompts: list[str], pin: bool = False) -> list[tuple[str, object]]:
    async def go():
        async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0,
                                      timeout=60) as aclient:
            return await asyncio.gather(*(one(aclient, p, i % 2 == 1, pin) for i, p in enumerate(prompts)))
    return asyncio.run(go())


def counted(metrics) -> tuple[float, float]:
    """(received, ended or in flight) from the server's own counters."""
    def total(counter) -> float:
        return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))
    ended = total(metrics.success) + total(metrics.aborted) + total(metrics.rejected)
    return total(metrics.received), ended + metrics.running._value.get() + metrics.waiting._value.get()


def assert_clean(live) -> None:
    """No leaked slot, gauges at zero, counters that add up, healthy, full concurrency again."""
    wait_idle(live)
    metrics = live.runner.metrics
    assert metrics.running._value.get() == 0 and metrics.waiting._value.get() == 0
    received, accounted = counted(metrics)
    assert received == accounted
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    n = live.runner.engine.cache.num_slots
    results = run_together(live, [f"again {i}" for i in range(n)])
    assert [kind for kind, _ in results] == ["ok"] * n


@pytest.fixture
def live():
    with make_server() as server:
        yield server


def check_isolated(live) -> None:
    reference = alone(live, HEALTHY)
    prompts = HEALTHY[:3] + POISONED[:1] + HEALTHY[3:] + POISONED[1:]
    results = dict(zip(prompts, run_together(live, prompts)))
    assert [results[p] for p in HEALTHY] == [("ok", t) for t in reference]
    assert all(internal_error(results[p]) for p in POISONED), [results[p] for p in POISONED]


def drafter_propose(engine):
    return engine.drafter, "propose", lambda seq, k: poisoned(engine, seq)


def sampling(engine):  # at a step's verification, not at the prefill's first token
    return engine, "_verify_logits", lambda seq, proposal, logits: poisoned(engine, seq) and bool(seq.output_ids)


def prefill(engine):
    return engine, "prefill", lambda pending, *args: engine.target.tokenizer.hf.decode(
        pending.prompt_ids).startswith("poison")


def forward_pass(engine):
    """The shared verify pass raises whenever a poisoned sequence is in it: the batch is retried
    without drafts, then each sequence alone, and only the poisoned ones fail."""
    return engine.model, "forward", lambda *args, slots=None, prefill=False, **kwargs: (
        not prefill and slots is not None and poisoned_slots(engine, slots))


@pytest.mark.parametrize("fault", [drafter_propose, sampling, prefill, forward_pass])
def test_a_failure_of_one_request_ends_only_that_request(live, fault):
    owner, name, fails = fault(live.runner.engine)
    original = getattr(owner, name)

    def failing(*args, **kwargs):
        if fails(*args, **kwargs):
            raise Injected(f"{name} broke")
        return original(*args, **kwargs)

    setattr(owner, name, failing)  # an instance attribute over the method
    try:
        check_isolated(live)
    finally:
        delattr(owner, name)
    assert live.runner.metrics.aborted.labels(reason="error")._value.get() == len(POISONED)
    assert_clean(live)


def test_a_transient_forward_failure_is_retried_without_speculation(live):
    """One failed verify pass: every request still completes with its fault-free text."""
    engine = live.runner.engine
    model = engine.model
    forward = model.forward
    failures = []

    def flaky(ids, positions, cache, *args, slots=None, prefill=False, **kwargs):
        if not prefill and ids.shape[1] > 1 and not failures:
            failures.append(ids.shape)
            raise Injected("one bad pass")
        return forward(ids, positions, cache, *args, slots=slots, prefill=prefill, **kwargs)

    reference = alone(live, HEALTHY)
    model.forward = flaky
    results = run_together(live, HEALTHY, pin=True)
    del model.forward
    assert failures, "the fault never fired: no verify pass carried drafts"
    assert results == [("ok", t) for t in reference]
    assert live.runner.metrics.aborted.labels(reason="error")._value.get() == 0
    assert_clean(live)


def test_a_dead_engine_thread_fails_its_requests_refuses_new_ones_and_says_so():
    fatal = threading.Event()
    with make_server(on_fatal=fatal.set) as live:
        runner, engine = live.runner, live.runner.engine
        step = engine.step
        started = threading.Event()

        def failing_step():
            started.set()
            time.sleep(0.2)  # let every request arrive first
            raise Injected("step broke")

        def failing_handler(error):
            raise Injected(f"the handler broke too, handling: {error}")

        engine.step = failing_step
        runner._fail_running = failing_handler
        results = run_together(live, HEALTHY[:2])
        assert started.is_set() and fatal.wait(10)
        # the in-flight requests ended with an error body (503: the engine stopped)
        assert all(kind == "error" and detail[0] in (503, None) and "the engine stopped" in detail[2]
                   for kind, detail in results), results
        assert not runner.alive and "handler broke" in runner.fatal
        conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=10)
        conn.request("GET", "/health")
        resp = conn.getresponse()
        assert resp.status == 503 and "handler broke" in json.loads(resp.read())["error"]
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as info:
            client_for(live).completions.create(model="tiny", prompt="anyone?", max_tokens=2)
        assert time.monotonic() - t0 < 2 and info.value.status_code == 503
        assert info.value.body["code"] == "engine_dead"
        received, accounted = counted(runner.metrics)
        assert received == accounted and runner.metrics.running._value.get() == 0
        engine.step = step


def test_soak_with_disconnects_rejections_and_poisoned_requests_accounts_for_every_request():
    """300 requests, 12 at a time on 4 slots and a queue of 6: a random sixth of the clients
    leave early (streaming or not), one request in 15 is poisoned (its drafter raises), and the
    rest must give their text alone. Every request is accounted for on both sides.

    A 429 is answered at once while an admitted request takes many steps, so most attempts of
    a saturated soak are rejected; a poisoned client therefore tries again until it is admitted
    (each rejected try counted), so that every poisoned request reaches the engine and fails."""
    rng = random.Random(0)
    prompts = [f"soak {i}: " + "abcdefgh"[: i % 7] for i in range(12)]
    with make_server(max_queue=6) as live:
        reference = dict(zip(prompts, alone(live, prompts)))
        engine = live.runner.engine
        propose = engine.drafter.propose

        def failing(seq, k):
            if poisoned(engine, seq):
                raise Injected("drafter broke")
            return propose(seq, k)

        engine.drafter.propose = failing
        outcomes: list[str] = []
        retries = [0]  # rejected tries of poisoned requests, each tried again
        poisoned_requests = [0]

        async def request(aclient, i: int) -> None:
            poison = rng.random() < 1 / 15
            poisoned_requests[0] += poison
            prompt = f"poison {i}" if poison else rng.choice(prompts)
            leave = not poison and rng.random() < 1 / 6
            stream = rng.random() < 0.5
            args = dict(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, **GREEDY)
            if poison:
                args["extra_body"] = {"speculative": {"num_speculative_tokens": K}}
            try:
                if stream:
                    text = ""
                    while True:
                        try:
                            events = await aclient.completions.create(stream=True, **args)
                            break
                        except openai.RateLimitError:
                            if not poison:
                                raise
                            retries[0] += 1
                            await asyncio.sleep(0.01)
                    async for chunk in events:
                        text += chunk.choices[0].text
                        if leave:
                            await events.close()
                            break
                else:
                    wait = rng.uniform(0.005, 0.1) if leave else 60
                    while True:
                        try:
                            done = await asyncio.wait_for(aclient.completions.create(**args), wait)
                            break
                        except openai.RateLimitError:
                            if not poison:
                                raise
                            retries[0] += 1
                            await asyncio.sleep(0.01)
                    text = done.choices[0].text
            except asyncio.TimeoutError:
                outcomes.append("left")
                return
            except openai.RateLimitError:
                outcomes.append("rejected")
                return
            except openai.APIError as e:
                assert poison and "internal engine error" in (e.body or {}).get("message", e.message), e
                outcomes.append("error")
                return
            if leave:
                outcomes.append("left")
                return
            assert not poison and text == reference[prompt], (prompt, text)
            outcomes.append("ok")

        async def soak():
            gate = asyncio.Semaphore(12)
            async with openai.AsyncOpenAI(base_url=live.url + "/v1", api_key=API_KEY, max_retries=0,
                                          timeout=60) as aclient:
                async def gated(i):
                    async with gate:
                        await request(aclient, i)
                await asyncio.gather(*(gated(i) for i in range(300)))

        asyncio.run(soak())
        engine.drafter.propose = propose
        wait_idle(live)
        m = live.runner.metrics
        count = {k: outcomes.count(k) for k in ("ok", "error", "left", "rejected")}
        assert sum(count.values()) == 300 and min(count.values()) > 0, count
        assert count["error"] == poisoned_requests[0], (count, poisoned_requests)
        received, accounted = counted(m)
        sent = 300 + retries[0] + len(prompts)  # the soak, its retries and the reference runs
        assert received == accounted
        # a client that left may have left before its request reached the engine's queue
        assert sent - count["left"] <= received <= sent
        errors = m.aborted.labels(reason="error")._value.get()
        successes = sum(s.value for x in m.success.collect() for s in x.samples if s.name.endswith("_total"))
        cancelled = m.aborted.labels(reason="cancelled")._value.get()
        rejected = m.rejected.labels(reason="queue_full")._value.get()
        # every request the server received ended one of these ways; a client that left did so
        # before or after its answer, so its request was rejected, cancelled or completed
        assert successes + cancelled + rejected + errors == received
        assert errors == count["error"] and rejected >= count["rejected"] + retries[0]
        assert successes >= count["ok"] + len(prompts) and cancelled <= count["left"]
        assert_clean(live)


def test_a_step_failure_of_unknown_cause_fails_the_running_requests_and_the_loop_goes_on(live):
    engine = live.runner.engine
    step = engine.step
    calls = []

    def once():
        if not calls:
            calls.append(1)
            raise Injected("the whole step broke")
        return step()

    engine.step = once
    results = run_together(live, HEALTHY[:2])
    del engine.step
    assert calls and any(internal_error(r) for r in results), results
    assert all(r[0] == "ok" or internal_error(r) for r in results)
    assert live.runner.alive
    assert_clean(live)


def test_serve_with_exit_on_fatal_stops_and_exits_with_status_1_when_the_engine_dies(monkeypatch):
    """`verispec serve --exit-on-fatal` (the serve() it calls, on the tiny models): the engine
    thread dies, the server shuts down, and the process would exit with status 1."""
    import socket

    from liveserver import tiny_target_and_draft
    from verispec.engine import engine as engine_module
    from verispec.models import loader
    from verispec.server import serve as serve_module
    from verispec.server.config import ServerConfig

    target, _ = tiny_target_and_draft()
    built = []

    class DyingEngine(engine_module.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

        def step(self):
            raise Injected("step broke")

    monkeypatch.setattr(loader, "load_model", lambda *args, **kwargs: target)
    monkeypatch.setattr(engine_module, "Engine", DyingEngine)
    monkeypatch.delenv("VERISPEC_API_KEY", raising=False)  # a server without a key
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outcome = []

    def run():
        try:
            serve_module.serve(ServerConfig(model="tiny", port=port, max_num_seqs=2, max_model_len=64, max_queue=4,
                                            exit_on_fatal=True))
            outcome.append("returned")
        except SystemExit as e:
            outcome.append(e.code)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while True:  # the server is up once its port answers
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            assert conn.getresponse().status == 200
            break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert len(built) == 1
    # the step raises, and so does the handler's abort of the running sequence
    monkeypatch.setattr(DyingEngine, "abort", lambda self, seq: (_ for _ in ()).throw(Injected("abort broke")))
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "hello", "max_tokens": 4}),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 503 and "the engine stopped" in json.loads(response.read())["error"]["message"]
    thread.join(30)
    assert outcome == [1]
