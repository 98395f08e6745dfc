"""The engine thread: a scheduler loop that owns the :class:`Engine` and talks to asyncio.

The HTTP side (asyncio) and the engine (one plain thread, since every step is a blocking torch
call) meet at two thread-safe points:

* :meth:`EngineRunner.submit` appends a :class:`Request` to a bounded waiting queue (a full
  queue raises :class:`QueueFull`, which the app turns into 429 with ``Retry-After``; a dead
  engine thread raises :class:`EngineDead`, 503); :meth:`EngineRunner.cancel` flags a request
  whose client went away (or reads too slowly). A cancelled request that still waits leaves the
  queue at once, so its place is free for the next one.
* The engine thread reports back through each request's ``deliver`` callback, which the app
  binds to ``loop.call_soon_threadsafe(queue.put_nowait, ...)``.

One loop iteration::

    end requests that were cancelled or ran past their deadline (a running or prefilling one
        is aborted: its slots are freed at once)
    admit waiting requests while slots are free (they take their slots; a request for n
        samples waits, first in line, until n slots are free)
    run prompts in chunks, up to a token budget (small while sequences decode), the prompt
        with the fewest positions left first; a finished prompt's first text is delivered
    engine.step()            one target forward for every running sequence
    deliver new text (and new tokens' logprobs); deliver a final event to each finished or
        failed sequence

The loop sleeps on a condition variable when nothing waits or runs (so no deadline can pass).

Every submitted request gets exactly one final event (``Event.done``), whatever raises:

* a failure of one sequence (its drafter, sampling, stop check; see the engine's module doc)
  ends that request with an error, and the others run on;
* a failure of :meth:`Engine.add_requests` ends that request (status 400 for a ``ValueError``,
  the engine's input check, else 500);
* anything else raised by a step fails the running requests, and the loop goes on;
* if the loop itself dies (its error handling raised), the thread's last act ends every request
  still waiting or running, marks the runner dead (so :meth:`submit` refuses at once and
  ``/health`` says so) and calls ``on_fatal`` (``verispec serve --exit-on-fatal`` exits, so a
  supervisor restarts the process).

:meth:`EngineRunner.stop` stops admitting, lets running requests finish for a grace period,
then aborts the rest.

The engine thread keeps a heartbeat: :attr:`EngineRunner.busy_since` is when the engine call
it is in (a prefill or a step) began, None between calls. ``/health`` reads it to say a step has
run too long (:meth:`EngineRunner.stalled_for`); a request whose deadline passes meanwhile is
answered by the HTTP side at its deadline (it cancels the request with reason ``timeout``), and
the engine thread drops its work when the call returns.

Metrics add up: every request counted in ``request_received`` is, at any time, exactly one of
waiting (gauge), running (gauge; a request being prefilled counts as running), succeeded (``request_success``), aborted (``request_aborted``,
by reason: cancelled, timeout, slow_reader, shutdown, error) or rejected (``request_rejected``,
by reason: queue_full, shutting_down, engine_dead, invalid).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from verispec.config import SamplingParams
from verispec.engine.engine import Engine, Prefill
from verispec.logprobs import TokenLogprob
from verispec.sequence import Sequence
from verispec.server.metrics import EMPTY_SNAPSHOT, ServerMetrics, SpecSnapshot

log = logging.getLogger(__name__)


# Prompt positions run per loop iteration: while nothing decodes, and beside running decodes
# (a few rows, about what a decode step costs, so streams' gaps stay within a few steps).
PREFILL_TOKENS = 512
PREFILL_TOKENS_BESIDE_DECODES = 8


class QueueFull(Exception):
    """The waiting queue is at its bound; the client should retry later."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new requests."""


class EngineDead(Exception):
    """The engine thread has died; nothing will be served until the process restarts."""


@dataclass(frozen=True)
class Event:
    """What the engine thread tells one request: new text of choice ``index`` (and, when the
    request asked for them, the logprobs of the tokens committed since the last event), that
    choice's sequence when it has ended, and at the end every choice's sequence or an error.
    ``status`` is the HTTP status an error maps to; ``reason`` its metrics label."""

    text: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()
    index: int = 0  # the choice (0 .. n-1) the text belongs to
    choice: Sequence | None = None  # set on the last event of choice `index`
    final: tuple[Sequence, ...] | None = None  # set on the last event of a completed request: every choice
    error: str | None = None  # set on the last event of a failed or aborted request
    status: int = 500
    reason: str = "error"

    @property
    def done(self) -> bool:
        return self.final is not None or self.error is not None


@dataclass(eq=False)
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    num_speculative_tokens: int | None
    deliver: Callable[[Event], None]  # must be thread-safe
    n: int = 1  # samples of the prompt (choices), with params.for_choice(i)
    arrival: float = field(default_factory=time.monotonic)
    timeout_s: float | None = None  # from arrival to the final event; None: no limit
    cancelled: str | None = None  # why the client side gave up ("cancelled", "slow_reader")
    ended: bool = False  # its final event was delivered
    last_token_at: float = 0.0
    exported: dict[int, SpecSnapshot] = field(default_factory=dict)  # per choice: counters already exported
    sequences: list[Sequence] = field(default_factory=list)  # one per choice, once admitted
    open_choices: int = 0  # choices whose last event is still to come

    @property
    def deadline(self) -> float | None:
        return None if self.timeout_s is None else self.arrival + self.timeout_s


# Final events of requests the engine thread ends without completing them: status, message.
_ABORTS = {
    "cancelled": (499, "cancelled"),
    "slow_reader": (499, "cancelled: the client read the stream too slowly"),
    "timeout": (504, "the request timed out"),
    "shutdown": (503, "the server shut down"),
}


def abort_event(why: str) -> Event:
    status, message = _ABORTS[why]
    return Event(error=message, status=status, reason=why)


def _failure(e: Exception, what: str) -> Event:
    """The final event of a request whose admission or prefill raised: a ``ValueError`` is the
    engine's input check (400), anything else a fault (500, logged)."""
    if isinstance(e, ValueError):
        return Event(error=str(e), status=400, reason="invalid")
    log.exception("%s failed", what)
    return Event(error=f"internal engine error: {what} failed: {type(e).__name__}: {e}")


class EngineRunner:
    def __init__(self, engine: Engine, metrics: ServerMetrics, max_queue: int = 64,
                 shutdown_grace_s: float = 5.0, on_fatal: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self.shutdown_grace_s = shutdown_grace_s
        self.on_fatal = on_fatal
        self._waiting: deque[Request] = deque()
        self._running: dict[Sequence, Request] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._deadline: float | None = None  # when stopping: abort what still runs after this
        self.fatal: str | None = None  # why the engine thread died, if it did
        self.busy_since: float | None = None  # the heartbeat: when the running engine call began
        self._prefills: list[tuple[Prefill, Request]] = []  # admitted requests whose prompts still run
        self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)

    # ---- asyncio side ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: Request) -> None:
        with self._cond:
            self.metrics.received.inc()
            if self.fatal is not None or (self._thread.ident is not None and not self._thread.is_alive()
                                          and not self._stopping):
                self.metrics.rejected.labels(reason="engine_dead").inc()
                raise EngineDead(f"the engine has stopped ({self.fatal or 'its thread ended'}); "
                                 "the server must be restarted")
            if self._stopping:
                self.metrics.rejected.labels(reason="shutting_down").inc()
                raise ShuttingDown("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                self.metrics.rejected.labels(reason="queue_full").inc()
                raise QueueFull(f"the waiting queue is full ({self.max_queue} requests)")
            self._waiting.append(request)
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify()

    def cancel(self, request: Request, reason: str = "cancelled") -> None:
        """End ``request`` for ``reason``: at once if it still waits (it leaves the queue and gets
        its final event), else at the engine thread's next iteration (its sequence is aborted)."""
        with self._cond:
            if request.cancelled is None:
                request.cancelled = reason
            if request in self._waiting:  # only the thread that takes a request out of the queue ends it
                self._waiting.remove(request)
                self._end(request, abort_event(request.cancelled))  # counted before the gauge drops
                self.metrics.waiting.set(len(self._waiting))
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
        return self._thread.is_alive() and self.fatal is None

    def stalled_for(self, now: float | None = None) -> float:
        """Seconds the engine call in progress has run (0 between calls)."""
        since = self.busy_since
        return 0.0 if since is None else max((time.monotonic() if now is None else now) - since, 0.0)

    @property
    def num_active(self) -> int:
        """Requests admitted or waiting (for tests and /health)."""
        with self._cond:
            return len(self._waiting) + self._num_running + len(self._prefills)

    # ---- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # the loop's own error handling failed
            self.fatal = f"{type(e).__name__}: {e}"
            log.critical("the engine thread died; no request will be served", exc_info=e)
        finally:
            self._end_all()
        if self.fatal is not None and self.on_fatal is not None:
            self.on_fatal()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._waiting or self._running or self._prefills or self._stopping):
                    self._cond.wait()
                if self._stopping and not self._running and not self._waiting and not self._prefills:
                    return
            try:
                self._drop_ended()
                self._admit()
                self._prefill_chunks()
                if self._running:
                    self._step()
            except Exception as e:  # a bug must not leave clients waiting forever
                log.exception("engine step failed; failing the running requests")
                self._fail_running(f"internal engine error: {type(e).__name__}: {e}")

    def _fail_running(self, error: str) -> None:
        for seq, r in list(self._running.items()):
            self.engine.abort(seq)
            self._finish(seq, r, Event(error=error))

    def _end_all(self) -> None:
        """The thread is ending: every request still waiting or running gets its final event."""
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
        error = f"the engine stopped: {self.fatal}" if self.fatal else "the server shut down"
        for r in waiting:
            self._end(r, Event(error=error, status=503, reason="shutdown"))
        for pending, r in list(self._prefills):
            self._drop_prefill(pending, r, Event(error=error, status=503, reason="shutdown"))
        for seq, r in list(self._running.items()):
            try:
                self.engine.abort(seq)
            except Exception:
                log.exception("could not abort slot %d", seq.slot)
            self._finish(seq, r, Event(error=error, status=503, reason="shutdown"))
        self._update_gauges()

    def _drop_ended(self) -> None:
        """End requests whose client gave up, that ran past their deadline, or (stopping) that
        are past the grace period."""
        now = time.monotonic()
        with self._cond:
            expired = self._stopping and now >= (self._deadline or 0.0)
            gone = []
            for r in list(self._waiting):
                why = self._why_ended(r, now) or ("shutdown" if self._stopping else None)
                if why is not None:
                    self._waiting.remove(r)
                    gone.append((r, why))
        for r, why in gone:
            self._end(r, abort_event(why))
        for pending, r in list(self._prefills):
            why = self._why_ended(r, now) or ("shutdown" if expired else None)
            if why is not None:
                self._drop_prefill(pending, r, abort_event(why))
        for seq, r in list(self._running.items()):
            why = self._why_ended(r, now) or ("shutdown" if expired else None)
            if why is not None:
                self.engine.abort(seq)
                self._finish(seq, r, abort_event(why))
        self._update_gauges()

    @staticmethod
    def _why_ended(r: Request, now: float) -> str | None:
        if r.cancelled is not None:
            return r.cancelled
        if r.deadline is not None and now >= r.deadline:
            return "timeout"
        return None

    def _admit(self) -> None:
        """Take waiting requests while their slots are free; their prompts run in
        :meth:`_prefill_chunks`."""
        while self.engine.free_slots:
            with self._cond:
                if not self._waiting or len(self.engine.free_slots) < min(self._waiting[0].n, self.engine.cache.num_slots):
                    return  # first come, first served: n samples wait for n free slots
                r = self._waiting.popleft()
                try:
                    pending = self.engine.begin_requests(r.prompt_ids, [r.params.for_choice(i) for i in range(r.n)],
                                                         r.num_speculative_tokens)
                except Exception as e:  # the app validates first; this is a backstop
                    self._refuse(r, e)
                    continue
                self._prefills.append((pending, r))
                self._update_gauges()

    def _prefill_chunks(self) -> None:
        """Run prompts, at most ``PREFILL_TOKENS`` positions in all (``PREFILL_TOKENS_BESIDE_DECODES``
        while sequences decode, so their streams keep flowing), the prompt with the fewest left
        first (a short request is not held up behind a long one); a prompt whose last chunk runs
        joins the batch. Deadlines and cancellations are honoured between chunks."""
        budget = PREFILL_TOKENS_BESIDE_DECODES if self._running else PREFILL_TOKENS
        while budget > 0 and self._prefills:
            pending, r = min(self._prefills, key=lambda item: item[0].remaining)
            before = pending.done
            self.busy_since = time.monotonic()
            try:
                done = self.engine.prefill(pending, budget)
            except Exception as e:
                self._drop_prefill(pending, r, _failure(e, "prefill"))
                continue
            finally:
                self.busy_since = None
            budget -= pending.done - before
            if done:
                self._prefills.remove((pending, r))
                self._started(pending.seqs, r)

    def _started(self, seqs: list[Sequence], r: Request) -> None:
        """``r``'s prompt has run: its sequences have their first tokens and run from now on."""
        now = time.monotonic()
        self.metrics.ttft.observe(now - r.arrival)
        self.metrics.prompt_tokens.inc(len(r.prompt_ids))
        self.metrics.cached_prompt_tokens.inc(seqs[0].metrics.cached_prompt_tokens)
        r.last_token_at = now
        r.sequences, r.open_choices = seqs, len(seqs)
        for seq in seqs:
            self._running[seq] = r
        self._update_gauges()
        for seq in seqs:
            self._report(seq, r, seq.text, len(seq.output_ids))

    def _refuse(self, r: Request, e: Exception) -> None:
        self._end(r, _failure(e, "admission"))
        self._update_gauges()

    def _drop_prefill(self, pending: Prefill, r: Request, event: Event) -> None:
        """End a request whose prompt is still running: its slots are given back."""
        if (pending, r) in self._prefills:
            self._prefills.remove((pending, r))
        try:
            self.engine.abort_prefill(pending)
        except Exception:
            log.exception("could not give back the slots of a prefill")
        self._end(r, event)
        self._update_gauges()

    def _step(self) -> None:
        before = {seq: len(seq.output_ids) for seq in self._running}
        self.busy_since = time.monotonic()
        try:
            texts = self.engine.step()
        finally:
            self.busy_since = None
        for seq, r in list(self._running.items()):
            new = len(seq.output_ids) - before[seq]
            if new:
                now = time.monotonic()
                self.metrics.observe_inter_token(now - r.last_token_at, new)
                r.last_token_at = now
            self._report(seq, r, texts.get(seq, ""), new)

    def _report(self, seq: Sequence, r: Request, text: str, new_tokens: int) -> None:
        if r.ended:
            return  # another choice of the request failed
        index = r.sequences.index(seq)
        self.metrics.generation_tokens.inc(new_tokens)
        r.exported[index] = self.metrics.observe_spec(seq.metrics, r.exported.get(index, EMPTY_SNAPSHOT))
        logprobs = tuple(seq.output_logprobs[len(seq.output_logprobs) - new_tokens:]) if seq.output_logprobs else ()
        if not seq.finished:
            if text or logprobs:
                r.deliver(Event(text=text, logprobs=logprobs, index=index))
            return
        if seq.finish_reason == "error":
            for other in r.sequences:  # one failed choice fails the request
                if other in self._running and other is not seq:
                    self.engine.abort(other)
                    self._running.pop(other)
            self._finish(seq, r, Event(text=text, index=index, error=f"internal engine error: {seq.error}"))
            return
        r.open_choices -= 1
        if r.open_choices:
            self._running.pop(seq, None)
            self._update_gauges()
            r.deliver(Event(text=text, logprobs=logprobs, index=index, choice=seq))
            return
        self._finish(seq, r, Event(text=text, logprobs=logprobs, index=index, choice=seq, final=tuple(r.sequences)))

    def _finish(self, seq: Sequence, r: Request, event: Event) -> None:
        """A running request's final event (its sequence has left the engine's batch)."""
        self._running.pop(seq, None)
        self._end(r, event)
        self._update_gauges()

    def _end(self, r: Request, event: Event) -> None:
        """Deliver ``r``'s final event once, and count how it ended."""
        if r.ended:
            return
        r.ended = True
        if event.error is None:
            self.metrics.success.labels(finished_reason=event.final[0].finish_reason).inc()
        elif event.reason == "invalid":
            self.metrics.rejected.labels(reason="invalid").inc()
        else:
            self.metrics.aborted.labels(reason=event.reason).inc()
        try:
            r.deliver(event)
        except Exception:  # a broken callback must not stop the engine
            log.exception("delivering a final event failed")

    def _update_gauges(self) -> None:
        self.metrics.waiting.set(len(self._waiting))
        self.metrics.running.set(self._num_running + len(self._prefills))

    @property
    def _num_running(self) -> int:
        """Running requests (a request's n samples are n running sequences)."""
        return len(set(self._running.values()))
