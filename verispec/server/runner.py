"""The engine thread: a scheduler loop that owns the :class:`Engine` and talks to asyncio.

The HTTP side (asyncio) and the engine (one plain thread, since every step is a blocking torch
call) meet at two thread-safe points:

* :meth:`EngineRunner.submit` appends a :class:`Request` to a bounded waiting queue (a full
  queue raises :class:`QueueFull`, which the app turns into 429 with ``Retry-After``);
  :meth:`EngineRunner.cancel` flags a request whose client went away.
* The engine thread reports back through each request's ``deliver`` callback, which the app
  binds to ``loop.call_soon_threadsafe(queue.put_nowait, ...)``.

One loop iteration::

    drop cancelled requests (abort running ones: their slot is freed at once)
    admit waiting requests while a slot is free (prefill each; its first text is delivered)
    engine.step()            one target forward for every running sequence
    deliver new text; deliver a final event to each finished sequence

The loop sleeps on a condition variable when there is nothing to do. :meth:`EngineRunner.stop`
stops admitting, lets running requests finish for a grace period, then aborts the rest, so
every request ends with a final event: completed or explicitly errored.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from verispec.config import SamplingParams
from verispec.engine.engine import Engine
from verispec.engine.sequence import Sequence
from verispec.server.metrics import EMPTY_SNAPSHOT, ServerMetrics, SpecSnapshot

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The waiting queue is at its bound; the client should retry later."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new requests."""


@dataclass(frozen=True)
class Event:
    """What the engine thread tells one request: new text, and at the end the sequence."""

    text: str = ""
    final: Sequence | None = None  # set on the last event of a completed request
    error: str | None = None  # set on the last event of a failed or aborted request

    @property
    def done(self) -> bool:
        return self.final is not None or self.error is not None


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    num_speculative_tokens: int | None
    deliver: Callable[[Event], None]  # must be thread-safe
    arrival: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    last_token_at: float = 0.0
    exported: SpecSnapshot = EMPTY_SNAPSHOT  # speculative counters already exported


class EngineRunner:
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_queue: int = 64,
                 shutdown_grace_s: float = 5.0) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.shutdown_grace_s = shutdown_grace_s
        self._waiting: deque[Request] = deque()
        self._running: dict[Sequence, Request] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._deadline: float | None = None  # when stopping: abort what still runs after this
        self._thread = threading.Thread(target=self._loop, name="verispec-engine", daemon=True)

    # ---- asyncio side ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request) -> None:
        with self._cond:
            if self._stopping:
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                self.metrics.rejected.labels(reason="queue_full").inc()
                raise QueueFull(f"the waiting queue is full ({self.max_queue} requests)")
            self._waiting.append(request)
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify()

    def cancel(self, request: Request) -> None:
        with self._cond:
            request.cancelled = True
            self._cond.notify()

    def begin_stop(self) -> None:
        """Refuse new requests from now on; abort what still runs after the grace period."""
        with self._cond:
            if not self._stopping:
                self._stopping = True
                self._deadline = time.monotonic() + self.shutdown_grace_s
            self._cond.notify()

    def stop(self) -> None:
        """:meth:`begin_stop`, then wait until every request has ended and the thread is done."""
        self.begin_stop()
        if self._thread.is_alive():
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_active(self) -> int:
        """Requests admitted or waiting (for tests and /health)."""
        with self._cond:
            return len(self._waiting) + len(self._running)

    # ---- engine thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._running or self._stopping):
                    self._cond.wait()
                if self._stopping and not self._running and not self._waiting:
                    return
            try:
                self._drop_cancelled()
                self._admit()
                if self._running:
                    self._step()
            except Exception as e:  # a bug must not leave clients waiting forever
                log.exception("engine step failed; failing the running requests")
                for seq, r in list(self._running.items()):
                    self.engine.abort(seq)
                    self._finish(seq, r, f"internal engine error: {e}")

    def _drop_cancelled(self) -> None:
        with self._cond:
            expired = self._stopping and time.monotonic() >= (self._deadline or 0.0)
            gone = [r for r in self._waiting if r.cancelled or self._stopping]
            for r in gone:
                self._waiting.remove(r)
            self.metrics.waiting.set(len(self._waiting))
        for r in gone:
            r.deliver(Event(error="cancelled" if r.cancelled else "the server is shutting down"))
        for seq, r in list(self._running.items()):
            if r.cancelled or expired:
                self.engine.abort(seq)
                self._finish(seq, r, "cancelled" if r.cancelled else "the server shut down")

    def _admit(self) -> None:
        while self.engine.free_slots:
            with self._cond:
                if not self._waiting:
                    return
                r = self._waiting.popleft()
                self.metrics.waiting.set(len(self._waiting))
            try:
                seq = self.engine.add_request(r.prompt_ids, r.params, r.num_speculative_tokens)
            except (ValueError, RuntimeError) as e:  # the app validates first; this is a backstop
                self.metrics.rejected.labels(reason="engine").inc()
                r.deliver(Event(error=str(e)))
                continue
            now = time.monotonic()
            self.metrics.ttft.observe(now - r.arrival)
            self.metrics.prompt_tokens.inc(len(r.prompt_ids))
            r.last_token_at = now
            self._running[seq] = r
            self._report(seq, r, seq.text, len(seq.output_ids))
        self.metrics.running.set(len(self._running))

    def _step(self) -> None:
        before = {seq: len(seq.output_ids) for seq in self._running}
        texts = self.engine.step()
        for seq, r in list(self._running.items()):
            new = len(seq.output_ids) - before[seq]
            if new:
                now = time.monotonic()
                self.metrics.observe_inter_token(now - r.last_token_at, new)
                r.last_token_at = now
            self._report(seq, r, texts.get(seq, ""), new)

    def _report(self, seq: Sequence, r: Request, text: str, new_tokens: int) -> None:
        self.metrics.generation_tokens.inc(new_tokens)
        r.exported = self.metrics.observe_spec(seq.metrics, r.exported)
        if not seq.finished:
            if text:
                r.deliver(Event(text=text))
            return
        r.deliver(Event(text=text, final=seq))
        self.metrics.success.labels(finished_reason=seq.finish_reason).inc()
        del self._running[seq]
        self.metrics.running.set(len(self._running))

    def _finish(self, seq: Sequence, r: Request, error: str) -> None:
        del self._running[seq]
        self.metrics.running.set(len(self._running))
        self.metrics.aborted.inc()
        r.deliver(Event(error=error))
