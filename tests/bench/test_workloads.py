"""Workloads: question files, category selection (mt_bench included), Spec-Bench lookup, code-edit set."""

from __future__ import annotations

import json

import pytest

from verispec.bench.workloads import (
    MT_BENCH_CATEGORIES, SPEC_BENCH_ENV, SPEC_BENCH_GROUPS, load_workload, spec_bench_path, turn_messages,
)


def write(tmp_path, rows):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def rows_for(categories, per=2):
    return [{"question_id": f"{c}{i}", "category": c, "turns": [f"{c} question {i}"]}
            for c in categories for i in range(per)]


def test_default_categories_are_the_files_in_order(tmp_path):
    w = load_workload(write(tmp_path, rows_for(["b", "a"], per=3)), None, 2)
    assert [(q.question_id, q.category) for q in w.questions] == [("b0", "b"), ("b1", "b"), ("a0", "a"), ("a1", "a")]


def test_mt_bench_takes_its_categories_round_robin(tmp_path):
    path = write(tmp_path, rows_for(MT_BENCH_CATEGORIES) + rows_for(["rag"]))
    w = load_workload(path, ["mt_bench", "rag"], 3)
    assert [q.question_id for q in w.questions] == ["writing0", "roleplay0", "reasoning0", "rag0", "rag1"]
    assert {q.category for q in w.questions[:3]} == {"mt_bench"}


def test_max_turns_keeps_each_questions_first_turns(tmp_path):
    rows = [{"question_id": 1, "category": "a", "turns": ["one", "two", "three"]},
            {"question_id": 2, "category": "b", "turns": ["only"]}]
    w = load_workload(write(tmp_path, rows), None, 1, max_turns=2)
    assert [q.turns for q in w.questions] == [("one", "two"), ("only",)] and w.max_turns == 2
    assert [q.turns for q in load_workload(write(tmp_path, rows), None, 1).questions][0] == ("one", "two", "three")
    with pytest.raises(ValueError, match="--max-turns must be at least 1"):
        load_workload(write(tmp_path, rows), None, 1, max_turns=0)


def test_unknown_category_lists_what_the_file_has(tmp_path):
    with pytest.raises(ValueError, match="no category 'nope'; it has: a, b"):
        load_workload(write(tmp_path, rows_for(["a", "b"])), ["nope"], 1)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"question_id": 1, "turns": ["x"]}', "missing key"),
        ('{"question_id": 1, "category": "a", "turns": []}', "non-empty list"),
        ("not json", "not valid JSON"),
        ("[1]", "expected a JSON object"),
    ],
)
def test_bad_question_files_give_clear_errors(tmp_path, line, message):
    path = tmp_path / "q.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=message):
        load_workload(str(path), None, 1)


def test_missing_files_give_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="question file not found"):
        load_workload(str(tmp_path / "none.jsonl"), None, 1)
    monkeypatch.setenv(SPEC_BENCH_ENV, str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match=f"missing.jsonl \\(from \\${SPEC_BENCH_ENV}; unset it"):
        load_workload("spec-bench", None, 1)


def test_spec_bench_ships_with_the_package(monkeypatch):
    """Without ``$VERISPEC_SPEC_BENCH`` the copy inside the package is read, from any directory:
    all 480 questions, 80 per task group and 10 per MT-bench category."""
    monkeypatch.delenv(SPEC_BENCH_ENV, raising=False)
    monkeypatch.chdir("/")
    path = spec_bench_path()
    assert path.parts[-4:] == ("bench", "data", "spec_bench", "question.jsonl")
    assert (path.parent / "LICENSE").read_text(encoding="utf-8").lstrip().startswith("Apache License")
    w = load_workload("spec-bench", None, 80)
    assert w.source == str(path) and len(w.questions) == 6 * 80
    assert list(dict.fromkeys(q.category for q in w.questions)) == list(SPEC_BENCH_GROUPS)
    assert len(load_workload("spec-bench", MT_BENCH_CATEGORIES, 100).questions) == 8 * 10


def test_every_data_file_is_declared_package_data():
    """A plain ``pip install`` (not editable) copies only the files pyproject.toml declares."""
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).resolve().parents[2]
    package = root / "verispec" / "bench"
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["verispec.bench"]
    declared = {f for glob in globs for f in package.glob(glob) if f.is_file()}
    files = {f for f in (package / "data").rglob("*") if f.is_file() and "__pycache__" not in f.parts}
    assert package / "data" / "spec_bench" / "question.jsonl" in files
    assert package / "data" / "spec_bench" / "LICENSE" in files
    assert files <= declared, sorted(str(f) for f in files - declared)


def test_spec_bench_found_through_the_environment_defaults_to_its_six_groups(tmp_path, monkeypatch):
    groups = ["translation", "summarization", "qa", "math_reasoning", "rag"]
    monkeypatch.setenv(SPEC_BENCH_ENV, write(tmp_path, rows_for(["coding", "writing", *groups])))
    w = load_workload("spec-bench", None, 1)
    assert [q.category for q in w.questions] == ["mt_bench", *groups]


def test_builtin_code_edit_set():
    w = load_workload("code-edit", None, 100)
    assert len(w.questions) == 8 and {q.category for q in w.questions} == {"code_edit"}
    assert any(len(q.turns) == 2 for q in w.questions)
    assert all("```" in q.turns[0] for q in w.questions)


def test_turn_messages_carry_earlier_answers():
    w = load_workload("code-edit", None, 100)
    q = next(q for q in w.questions if len(q.turns) == 2)
    assert turn_messages(q, []) == [{"role": "user", "content": q.turns[0]}]
    assert [m["role"] for m in turn_messages(q, ["answer"])] == ["user", "assistant", "user"]
    assert turn_messages(q, ["answer"])[1]["content"] == "answer"
