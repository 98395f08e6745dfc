"""A server that kept prompts from before the run is caught: cached prompt tokens beyond what the
run's own requests explain.

Two fake servers answer a two-turn question and a one-turn one. Both share a chat prefix and
cache like llama-server's prompt cache (the longest prefix of any request they served). The
fresh one starts empty; the stale one has already served every prompt of this run once, as a
server reused from an earlier run has. Only the stale one is flagged, and the report says so.
"""

from __future__ import annotations

from verispec.bench.methods import TurnResult, parse_methods
from verispec.bench.report import build_report, render_markdown, stale_caches
from verispec.bench.runner import Settings, run_bench
from verispec.bench.workloads import Question, Workload, turn_messages
from verispec.sequence import common_prefix

PREFIX = [1, 2, 3, 4, 5, 6, 7, 8]  # the chat template's system part, the same in every prompt


class Chars:
    """Prompt ids: the shared prefix, then each message's characters."""

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        return PREFIX + [ord(c) for m in messages for c in m["content"] + "|"]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


class CachingServer:
    """Answers 'ok' plus the prompt's length in letters, and reports the cached prompt tokens
    the way llama-server does: the longest prefix shared with a sequence it served (all but the
    last prompt token, which it always computes)."""

    def __init__(self, served: list[list[int]] | None = None) -> None:
        self.served = list(served or [])

    def generate(self, prompt_ids: list[int], params) -> TurnResult:
        out = [ord(c) for c in f"ok{len(prompt_ids)}"]
        cached = min(max((common_prefix(prompt_ids, s) for s in self.served), default=0), len(prompt_ids) - 1)
        self.served.append(prompt_ids + out)
        return TurnResult(out, 0.1, 0.05, "stop", cached_prompt_tokens=cached)


QUESTIONS = [Question("1", "writing", ("Write a long story about a lighthouse keeper and the sea.",
                                       "Now retell it from the point of view of the lighthouse.")),
             Question("2", "qa", ("What is the tallest mountain on Earth, measured from its base?",))]


def test_a_server_that_kept_this_runs_prompts_from_before_is_flagged():
    fmt = Chars()
    earlier = CachingServer()  # an earlier run of the same benchmark against the same server
    for q in QUESTIONS:
        answers: list[str] = []
        for _ in q.turns:
            answers.append(fmt.decode(earlier.generate(fmt.encode(turn_messages(q, answers)), None).output_ids))
    specs = parse_methods("plain,openai:http://127.0.0.1:1@stale,openai:http://127.0.0.1:2@fresh")
    runners = dict(zip([s.label for s in specs], [CachingServer(), CachingServer(earlier.served), CachingServer()]))
    result = run_bench(runners, QUESTIONS, fmt, Settings(max_tokens=8, progress=False))

    second_turn = [r for r in result.runs if r.method == "openai:fresh" and r.turn == 1]
    assert second_turn and second_turn[0].result.cached_prompt_tokens > len(PREFIX)  # its own first turn
    assert second_turn[0].reusable_prompt_tokens >= second_turn[0].result.cached_prompt_tokens

    stale = stale_caches(result.runs)
    assert list(stale) == ["openai:stale"]
    assert stale["openai:stale"]["turns"] == 3  # every turn's prompt was already in its cache
    assert stale["openai:stale"]["excess_tokens"] > 0

    meta = {"command": "test", "model": "m", "dtype": "float32",
            "machine": {"date": "d", "cpu": "c", "cpu_count": 2, "torch_threads": 2, "torch": "t",
                        "transformers": "t", "loadavg_start": 0.0}}
    report = build_report(result, specs, Workload("w", "w", tuple(QUESTIONS)),
                          Settings(max_tokens=8), meta)
    assert report["stale_caches"] == stale
    md = render_markdown(report)
    assert "WARNING: openai:stale reported" in md and md.count("WARNING") == 1
