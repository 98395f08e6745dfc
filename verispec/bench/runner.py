"""The benchmark loop: every method on the same prompts, interleaved, in one process.

:func:`run_bench` takes runners that are already built (so tests can hand in tiny models and
the CLI stays a thin layer) and runs, for each question and each repeat, every method in turn.
The method that goes first rotates from one (question, repeat) block to the next, so a slow
drift of the machine (thermal throttling, a neighbour's job) spreads over all methods instead
of landing on whichever runs last, and per-repeat figures show it.

Multi-turn questions run turn by turn within a method: turn 2's prompt carries the method's
own decoded answer to turn 1 (see :func:`verispec.bench.workloads.turn_messages`). At T = 0
every method's answers are compared with plain decoding's for the same question, turn and
repeat in :mod:`verispec.bench.report`.

Sampling (T > 0) uses one seed per (question, turn, repeat), the same for every method.

Ctrl-C stops the loop; the (question, repeat) blocks that every method finished are returned
with ``partial`` set, so a partial report still compares methods on the same questions (the
CLI also saves the report after every block, so a killed run loses only its last block). A later
run with ``--resume`` reads them back and runs only the blocks still missing, so a benchmark
longer than one sitting is built block by block; every block is still all methods side by side
in one process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tqdm import tqdm

from verispec.bench.methods import Runner, TurnResult
from verispec.bench.workloads import PromptFormat, Question, turn_messages
from verispec.config import SamplingParams
from verispec.sequence import common_prefix

WARMUP_PROMPT = "Say hello."
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class Settings:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0  # nucleus sampling for T > 0 (1: off)
    repeats: int = 1
    seed: int = 0
    warmup: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"--repeats must be at least 1, got {self.repeats}")
        SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens)  # validates them

    def params(self, seed: int) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_tokens,
                              seed=None if self.temperature == 0 else seed)


@dataclass
class Run:
    """One method's answer to one turn of one question."""

    method: str
    question_id: str
    category: str
    turn: int
    repeat: int
    order: int  # position of the method within its (question, repeat) block
    prompt_tokens: int
    result: TurnResult
    # the most prompt tokens this method's engine or server could have cached from the run's own
    # earlier requests (the longest prefix shared with one of them, its answer included); a
    # server that reports more cached kept K/V from before the run (see report.stale_caches)
    reusable_prompt_tokens: int | None = None


@dataclass
class BenchResult:
    runs: list[Run]
    partial: bool
    wall_s: float


def run_bench(
    runners: dict[str, Runner],
    questions: Sequence[Question],
    fmt: PromptFormat,
    settings: Settings,
    done: Sequence[Run] = (),
    on_block: Callable[[BenchResult], None] | None = None,
) -> BenchResult:
    """Run every runner on every question; ``runners`` maps method label -> runner, plain first.

    ``done`` holds the runs of an earlier, interrupted run of the same benchmark (``--resume``):
    their (question, repeat) blocks are kept as they are and not run again. ``on_block`` is
    called with the (partial) result after every finished block, e.g. to save a checkpoint.
    """
    labels = list(runners)
    runs: list[Run] = list(done)
    sent: dict[str, list[list[int]]] = {label: [] for label in labels}  # each method's requests: prompt + answer
    finished = {(r.question_id, r.repeat) for r in done}
    t0 = time.perf_counter()
    total = len(labels) * sum(len(q.turns) for q in questions for k in range(settings.repeats)
                              if (q.question_id, k) not in finished)
    bar = tqdm(total=total, desc="bench", unit="turn", disable=not settings.progress, dynamic_ncols=True)
    partial = True
    try:
        if settings.warmup:
            warm = fmt.encode([{"role": "user", "content": WARMUP_PROMPT}])
            params = SamplingParams(temperature=settings.temperature, seed=0,
                                    max_tokens=min(WARMUP_TOKENS, settings.max_tokens))
            for label in labels:
                bar.set_postfix_str(f"warm-up {label}")
                sent[label].append(warm + runners[label].generate(warm, params).output_ids)
        for qi, q in enumerate(questions):
            for repeat in range(settings.repeats):
                if (q.question_id, repeat) in finished:
                    continue
                block: list[Run] = []
                shift = (qi * settings.repeats + repeat) % len(labels)
                for order, label in enumerate(labels[shift:] + labels[:shift]):
                    bar.set_postfix_str(f"{q.category} q{q.question_id} {label}")
                    block += _run_question(runners[label], label, q, qi, repeat, order, fmt, settings, bar,
                                           sent[label])
                runs += block  # only whole blocks: every method on the same questions
                if on_block is not None:
                    on_block(BenchResult(list(runs), True, time.perf_counter() - t0))
        partial = False
    except KeyboardInterrupt:
        pass
    finally:
        bar.close()
    return BenchResult(runs, partial, time.perf_counter() - t0)


def _run_question(runner: Runner, label: str, q: Question, qi: int, repeat: int, order: int,
                  fmt: PromptFormat, settings: Settings, bar: tqdm, sent: list[list[int]]) -> list[Run]:
    answers: list[str] = []
    out: list[Run] = []
    for turn in range(len(q.turns)):
        prompt_ids = fmt.encode(turn_messages(q, answers))
        seed = settings.seed + (qi * 100 + turn) * 100 + repeat
        reusable = max((common_prefix(prompt_ids, s) for s in sent), default=0)
        result = runner.generate(prompt_ids, settings.params(seed))
        sent.append(prompt_ids + result.output_ids)
        out.append(Run(label, q.question_id, q.category, turn, repeat, order, len(prompt_ids), result, reusable))
        answers.append(fmt.decode(result.output_ids))
        bar.update(1)
    return out


def max_model_len(questions: Sequence[Question], fmt: PromptFormat, max_tokens: int, slack: int = 64) -> int:
    """KV positions the longest conversation can need: its user turns, every answer, and drafts."""
    need = 0
    for q in questions:
        placeholders = [""] * (len(q.turns) - 1)
        prompt = len(fmt.encode(turn_messages(q, placeholders)))
        need = max(need, prompt + len(q.turns) * max_tokens)
    return need + slack
