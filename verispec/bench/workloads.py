"""Benchmark workloads: question files, category selection and chat prompts.

A workload is a list of :class:`Question`: an id, a category and one or more user turns, the
schema of Spec-Bench's ``question.jsonl`` (one JSON object per line with ``question_id``,
``category`` and ``turns``). Three sources share it:

* ``spec-bench`` -- Spec-Bench's own file (Xia et al. 2024, Apache-2.0), shipped with verispec
  in ``verispec/bench/data/spec_bench/`` with its licence; ``$VERISPEC_SPEC_BENCH`` names another
  copy to read instead.
* ``code-edit`` -- a small built-in set of "rewrite this code with X changed" prompts, where the
  answer copies much of the prompt (the case prompt-lookup drafters are made for).
* any other value is the path of a user's JSONL file in the same schema.

Categories. ``--categories`` names the categories to run, each reported as one group. A name is
either a category of the file, or ``mt_bench``, Spec-Bench's label for the eight MT-bench
categories (writing, roleplay, reasoning, math, coding, extraction, stem, humanities). Spec-Bench
defaults to its six task groups; other files default to every category they contain. Within a
group, questions are taken round-robin over the file categories it covers, in file order, so
``mt_bench`` with 3 questions takes one writing, one roleplay and one reasoning question.

Multi-turn questions run turn by turn, as in Spec-Bench: turn ``i``'s prompt is the chat of
every earlier user turn and the method's own earlier answers, plus user turn ``i``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

SPEC_BENCH_ENV = "VERISPEC_SPEC_BENCH"
SPEC_BENCH_PACKAGED = Path(__file__).parent / "data" / "spec_bench" / "question.jsonl"
MT_BENCH = "mt_bench"
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SPEC_BENCH_GROUPS = (MT_BENCH, "translation", "summarization", "qa", "math_reasoning", "rag")
BUILTIN_WORKLOADS = ("spec-bench", "code-edit")
OVERALL = "overall"  # the pseudo-category that pools every category of a report


@dataclass(frozen=True)
class Question:
    question_id: str
    category: str  # the group it is reported under (a --categories name)
    turns: tuple[str, ...]


@dataclass(frozen=True)
class Workload:
    name: str  # "spec-bench", "code-edit" or the file path
    source: str  # the file actually read
    questions: tuple[Question, ...]
    max_turns: int | None = None  # turns kept per question (None: all, as Spec-Bench runs them)


def load_workload(spec: str, categories: Sequence[str] | None, num_questions: int,
                  max_turns: int | None = None) -> Workload:
    """Resolve ``spec``, read its questions and pick ``num_questions`` per category, each cut to
    its first ``max_turns`` turns when given."""
    if num_questions < 1:
        raise ValueError(f"--num-questions must be at least 1, got {num_questions}")
    if max_turns is not None and max_turns < 1:
        raise ValueError(f"--max-turns must be at least 1, got {max_turns}")
    default: Sequence[str] | None = None
    if spec == "code-edit":
        source = "verispec.bench/data/code_edit.jsonl"
        text = resources.files("verispec.bench").joinpath("data/code_edit.jsonl").read_text(encoding="utf-8")
    else:
        if spec == "spec-bench":
            path, default = spec_bench_path(), SPEC_BENCH_GROUPS
        else:
            path = Path(spec)
            if not path.is_file():
                raise FileNotFoundError(
                    f"question file not found: {spec} (give a JSONL file or one of: {', '.join(BUILTIN_WORKLOADS)})"
                )
        source, text = str(path), path.read_text(encoding="utf-8")
    rows = read_jsonl(text, source)
    wanted = list(categories or default or dict.fromkeys(r["category"] for r in rows))
    questions = select(rows, wanted, num_questions, source)
    if max_turns is not None:
        questions = [replace(q, turns=q.turns[:max_turns]) for q in questions]
    return Workload(spec, source, tuple(questions), max_turns)


def spec_bench_path() -> Path:
    """Spec-Bench's ``question.jsonl``: ``$VERISPEC_SPEC_BENCH`` when set, else the packaged copy."""
    env = os.environ.get(SPEC_BENCH_ENV)
    path = Path(env) if env else SPEC_BENCH_PACKAGED
    if not path.is_file():
        raise FileNotFoundError(
            f"Spec-Bench's question.jsonl was not found at {path} "
            + (f"(from ${SPEC_BENCH_ENV}; unset it to use the copy shipped with verispec)" if env
               else "(the copy shipped with verispec: reinstall verispec, or set "
                    f"{SPEC_BENCH_ENV}=PATH)")
        )
    return path


def read_jsonl(text: str, where: str) -> list[dict[str, Any]]:
    """Parse and check question rows: ``question_id``, ``category`` and a non-empty ``turns`` list."""
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}:{lineno}: not valid JSON ({exc})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}:{lineno}: expected a JSON object, got {type(row).__name__}")
        missing = [key for key in ("question_id", "category", "turns") if key not in row]
        if missing:
            raise ValueError(f"{where}:{lineno}: missing key(s) {', '.join(missing)}")
        turns = row["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise ValueError(f"{where}:{lineno}: 'turns' must be a non-empty list of non-empty strings")
        rows.append(row)
    if not rows:
        raise ValueError(f"{where}: no questions")
    return rows


def select(rows: list[dict[str, Any]], categories: Sequence[str], n: int, where: str) -> list[Question]:
    """``n`` questions per requested category (round-robin over the file categories it covers)."""
    present = list(dict.fromkeys(r["category"] for r in rows))
    out: list[Question] = []
    for group in dict.fromkeys(categories):
        covered = [c for c in MT_BENCH_CATEGORIES if c in present] if group == MT_BENCH else [group]
        if not any(c in present for c in covered):
            choices = present + ([MT_BENCH] if any(c in present for c in MT_BENCH_CATEGORIES) else [])
            raise ValueError(f"{where} has no category {group!r}; it has: {', '.join(choices)}")
        queues = [[r for r in rows if r["category"] == c] for c in covered]
        picked: list[dict[str, Any]] = []
        while len(picked) < n and any(queues):
            for queue in queues:
                if queue and len(picked) < n:
                    picked.append(queue.pop(0))
        out.extend(Question(str(r["question_id"]), group, tuple(r["turns"])) for r in picked)
    return out


class PromptFormat(Protocol):
    """How a conversation becomes prompt ids, and generated ids become text."""

    def encode(self, messages: list[dict[str, str]]) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ChatFormat:
    """The target's chat template (raw concatenated turns when the model has none)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def encode(self, messages: list[dict[str, str]]) -> list[int]:
        if self.tokenizer.has_chat_template:
            return self.tokenizer.apply_chat_template(messages)
        return self.tokenizer.encode("\n\n".join(m["content"] for m in messages))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def turn_messages(question: Question, answers: Sequence[str]) -> list[dict[str, str]]:
    """The conversation for turn ``len(answers)``: earlier turns with their answers, then the next turn."""
    messages: list[dict[str, str]] = []
    for turn, answer in zip(question.turns, answers):
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": question.turns[len(answers)]})
    return messages


# Short functions and classes of about 150 tokens each: the code that the suffix preset's edits
# rewrite, and the agent preset's project files start from.
CODE_BODIES = [
    '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result


def normalize(values):
    low, high = min(values), max(values)
    if high == low:
        return [0.0 for _ in values]
    return [(v - low) / (high - low) for v in values]''',
    '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, quantity):
        if quantity <= 0:
            raise ValueError("quantity must be positive")
        self.items[name] = self.items.get(name, 0) + quantity

    def remove(self, name, quantity):
        current = self.items.get(name, 0)
        if quantity > current:
            raise KeyError(f"not enough {name} in stock")
        self.items[name] = current - quantity
        if self.items[name] == 0:
            del self.items[name]

    def total(self):
        return sum(self.items.values())''',
    '''def parse_config(lines):
    config = {}
    section = None
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            config[section] = {}
            continue
        key, _, value = line.partition("=")
        if section is None:
            raise ValueError("key outside of a section")
        config[section][key.strip()] = value.strip()
    return config''',
    '''def binary_search(items, target):
    low, high = 0, len(items) - 1
    while low <= high:
        mid = (low + high) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            low = mid + 1
        else:
            high = mid - 1
    return -1


def insert_sorted(items, value):
    index = 0
    while index < len(items) and items[index] < value:
        index += 1
    items.insert(index, value)
    return items''',
    '''import json


def load_users(path):
    with open(path) as handle:
        data = json.load(handle)
    users = []
    for entry in data["users"]:
        if not entry.get("active", True):
            continue
        users.append({
            "name": entry["name"],
            "email": entry["email"].lower(),
            "age": int(entry.get("age", 0)),
        })
    return users


def adults(users):
    return [user for user in users if user["age"] >= 18]''',
    '''def word_frequencies(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?\\"'()")
        if not word:
            continue
        counts[word] = counts.get(word, 0) + 1
    return counts


def top_words(text, n):
    counts = word_frequencies(text)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return [word for word, _ in ranked[:n]]''',
    '''class Stack:
    def __init__(self, capacity):
        self.capacity = capacity
        self.data = []

    def push(self, value):
        if len(self.data) >= self.capacity:
            raise OverflowError("stack is full")
        self.data.append(value)

    def pop(self):
        if not self.data:
            raise IndexError("pop from an empty stack")
        return self.data.pop()

    def peek(self):
        if not self.data:
            return None
        return self.data[-1]

    def __len__(self):
        return len(self.data)''',
    '''def merge_intervals(intervals):
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]


def total_covered(intervals):
    return sum(end - start for start, end in merge_intervals(intervals))''',
]
