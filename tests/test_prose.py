"""The code's prose states contracts and reasons; measurements live in docs/.

A comment or docstring in ``verispec/`` may say why a design is so ("the copy was slow inside the
layer"), and point to the docs/ page that holds the figures, but it gives no timings and names no
CPU model: those belong to one machine on one day, and the code outlives both. ``docs/`` keeps
conclusions, not raw reports (git keeps those), and ``docs/kernels.md`` is a reference, not a
diary.

Timings are looked for in comments and docstrings only, read with ``tokenize`` and ``ast`` for
Python and a small lexer for C++, so string literals (output formats such as f"{ms:.1f} ms",
CLI help) never count. A number directly followed by a time unit or a rate (``13.6 ms``,
``5.1-5.3 s``, ``150-350 us``, ``34.6 tok/s``, ``4.1 GHz``) is a timing; a duration that a
setting names (a default, a timeout, a deadline, an interval) is not.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "verispec"
DOCS = ROOT / "docs"
SOURCE_SUFFIXES = {".py", ".cpp", ".h", ".cc"}

CPU_MODEL = re.compile(
    r"\b(?:Xeon|EPYC|Epyc|Ryzen|Threadripper|Opteron|Zen ?[1-9]|Sapphire Rapids|Emerald Rapids"
    r"|Granite Rapids|Cascade Lake|Ice Lake|Skylake|Alder Lake|Raptor Lake|Meteor Lake|Genoa"
    r"|Graviton|Neoverse|Apple M[1-9])\b")

_NUM = r"\d+(?:[.,]\d+)*"
_RANGE = rf"{_NUM}(?:\s*(?:-|–|to)\s*{_NUM})?"
_TIME_UNIT = r"(?:ms|us|µs|μs|ns|s|secs?|seconds?|milliseconds?|microseconds?|nanoseconds?)"
_RATE_UNIT = r"(?:tok(?:en)?s?/s|[KMGT]i?B/s|[GT]FLOP/s|GMAC/s|[GM]Hz)"
# not part of a longer word or number before it (x86-64, 1.5B, v2), and no letter, digit or slash
# right after the unit ("8 steps", "2 slots", "tokens/s" as a word)
TIMING = re.compile(rf"(?<![\w.\-/]){_RANGE}\s*(?:{_TIME_UNIT}|{_RATE_UNIT})(?![\w/])")
# a duration that names a setting rather than a measurement: "default 600 s", "a timeout of 5 s"
SETTING = re.compile(r"\b(?:defaults?|timeouts?|deadlines?|intervals?|every|sleeps?|polls?)\b[^.;:]{0,24}$",
                     re.IGNORECASE)


def python_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every module, class and function docstring."""
    prose = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                doc = body[0].value
                prose += [(doc.lineno + i, line) for i, line in enumerate(doc.value.splitlines())]
    return prose


def cpp_prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every // and /* */ comment, string and character literals skipped."""
    prose, i, line, n = [], 0, 1, len(source)
    while i < n:
        if source.startswith("//", i):
            end = source.find("\n", i)
            end = n if end < 0 else end
            prose.append((line, source[i:end]))
            i = end
        elif source.startswith("/*", i):
            end = source.find("*/", i + 2)
            end = n if end < 0 else end + 2
            prose += [(line + k, text) for k, text in enumerate(source[i:end].splitlines())]
            line += source.count("\n", i, end)
            i = end
        elif source[i] in "\"'":
            quote, j = source[i], i + 1
            while j < n and source[j] != quote and source[j] != "\n":
                j += 2 if source[j] == "\\" else 1
            line += source.count("\n", i, j)
            i = j + 1
        else:
            line += source[i] == "\n"
            i += 1
    return prose


def timings(text: str) -> list[str]:
    return [m.group(0) for m in TIMING.finditer(text) if not SETTING.search(text[:m.start()])]


def package_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*") if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts)


def test_the_extractors_read_prose_only():
    py = ('"""Module: a step took 13.6 ms."""\n'
          'x = f"{ms:.1f} ms, {tps:.1f} tokens/s"  # 150-350 us per layer\n'
          'HELP = "timeout in seconds (default 600 s)"\n'
          'def f():\n    """A pass of 9 positions, 2 threads."""\n')
    found = [(line, t) for line, text in python_prose(py) for t in timings(text)]
    assert found == [(2, "150-350 us"), (1, "13.6 ms")]
    cpp = ('const char* fmt = "took %d ms";  // 5.1-5.3 s on a long prompt\n'
           "char q = '\"'; /* 4.1 GHz,\n   34.6 tok/s */ int x = 2;\n")
    found = [(line, t) for line, text in cpp_prose(cpp) for t in timings(text)]
    assert found == [(1, "5.1-5.3 s"), (2, "4.1 GHz"), (3, "34.6 tok/s")]


@pytest.mark.parametrize("text", [
    "x86-64 and AVX2", "a 1.5B model", "blocks of 32 rows", "9 steps", "2 slots", "tokens/s as a field",
    "the request's deadline (default 600 s)", "a timeout of 5 s", "s_0 < s_1", "(1 - s)", "Q4_K at 16 rows",
])
def test_no_false_timing(text):
    assert timings(text) == []


@pytest.mark.parametrize("text", ["took 13.6 ms", "5.1-5.3 s against 5.7 s", "150-350 us", "0.24 -> 0.12 ms",
                                  "~170 ns", "5,373 us", "34.6 tok/s", "18 GB/s", "at 4.1 GHz"])
def test_timings_are_found(text):
    assert timings(text)


def test_no_cpu_model_in_the_package():
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in package_files()
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if CPU_MODEL.search(line)]
    assert not hits, "CPU models named in verispec/ (say which ISA feature matters instead):\n" + "\n".join(hits)


def test_no_timing_in_the_package_prose():
    hits = []
    for p in package_files():
        source = p.read_text(encoding="utf-8")
        prose = python_prose(source) if p.suffix == ".py" else cpp_prose(source)
        hits += [f"{p.relative_to(ROOT)}:{n}: {found} in {text.strip()!r}"
                 for n, text in prose for found in timings(text)]
    assert not hits, ("timings in verispec/ comments or docstrings (state the reason, point to the "
                      "docs/ page with the figures):\n" + "\n".join(hits))


def test_docs_stay_small():
    total = sum(p.stat().st_size for p in DOCS.rglob("*") if p.is_file())
    assert total <= 1024 * 1024, f"docs/ holds {total} bytes; raw reports belong in git's history"


def test_kernels_doc_is_a_reference():
    assert len((DOCS / "kernels.md").read_text(encoding="utf-8").splitlines()) <= 500
