"""Prometheus metrics for ``/metrics``, named like vLLM's under a ``verispec:`` prefix.

Speculative counters are exported from each request's :class:`~verispec.metrics.SpecMetrics`
(the one owner of those figures) as deltas after every engine step, so they move while requests
run. Counters carry Prometheus' ``_total`` suffix on the wire, as vLLM's do
(``verispec:spec_decode_num_drafts_total``). Each server has its own registry, so several
servers (tests) can live in one process.

Inter-token latency: a speculative step commits several tokens at once; the gap since the
request's previous tokens is spread evenly over them (one observation per token).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from verispec.metrics import SpecMetrics

PREFIX = "verispec:"
# (num_drafts, num_draft_tokens, num_accepted_tokens, accepted_at) already exported
SpecSnapshot = tuple[int, int, int, tuple[int, ...]]
EMPTY_SNAPSHOT: SpecSnapshot = (0, 0, 0, ())

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, registry=self.registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=_LATENCY_BUCKETS, registry=self.registry)

        self.num_drafts = counter("spec_decode_num_drafts", "Verification rounds that proposed drafts.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position.", ("position",)
        )
        # received = waiting + running + success + aborted + rejected, at any time (runner.py)
        self.received = counter("request_received", "Requests submitted to the engine thread's queue.")
        self.success = counter("request_success", "Requests that completed.", ("finished_reason",))
        self.aborted = counter("request_aborted", "Requests that ended without completing: cancelled, "
                               "timeout, slow_reader, shutdown or error.", ("reason",))
        self.rejected = counter("request_rejected", "Requests refused before running: queue_full, "
                                "shutting_down, engine_dead or invalid.", ("reason",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.")
        self.cached_prompt_tokens = counter("prompt_tokens_cached", "Prompt tokens whose K/V an earlier request "
                                            "left in the slot (prefix caching), of prompt_tokens.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.running = gauge("num_requests_running", "Requests in the running batch (admitted, not ended).")
        self.waiting = gauge("num_requests_waiting", "Requests in the waiting queue.")
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.")

    def observe_inter_token(self, gap_s: float, num_tokens: int) -> None:
        for _ in range(num_tokens):
            self.itl.observe(gap_s / num_tokens)

    def observe_spec(self, m: SpecMetrics, last: SpecSnapshot) -> SpecSnapshot:
        """Export what ``m`` gained since ``last``; return the new snapshot."""
        self.num_drafts.inc(m.num_drafts - last[0])
        self.num_draft_tokens.inc(m.num_draft_tokens - last[1])
        self.num_accepted_tokens.inc(m.num_accepted_tokens - last[2])
        for pos, count in enumerate(m.accepted_at):
            before = last[3][pos] if pos < len(last[3]) else 0
            if count > before:
                self.accepted_per_pos.labels(position=str(pos)).inc(count - before)
        return m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens, tuple(m.accepted_at)
