"""The package's structure: imports run one way, floor by floor, and the engine asks a drafter
only what :class:`~verispec.speculative.base.Drafter` declares.

Both checks read the source with ``ast``, so an import inside a function counts as much as one
at the top of a module, and an attribute read counts whether or not a test runs through it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from verispec.speculative.base import Drafter

ROOT = Path(__file__).resolve().parent.parent / "verispec"

# Floors, bottom up: a module may import its own floor and those below it, never one above.
FLOORS = [
    ("verispec", "verispec.runtime", "verispec.files", "verispec.config", "verispec.sampling", "verispec.detokenize",
     "verispec.sequence", "verispec.metrics"),
    ("verispec.kernels",),
    ("verispec.models",),
    ("verispec.speculative",),
    ("verispec.engine",),
    ("verispec.train", "verispec.server", "verispec.bench"),
    ("verispec.cli", "verispec.plan", "verispec.__main__"),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module that importing ``name`` (a module, or a name inside one) runs last."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Every verispec module ``path`` imports, at any depth (functions included), except those
    under ``if TYPE_CHECKING:``, which only type checkers run."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[0] == "verispec":
                target = resolve(name, known)
                if target is not None and target != module_name(path):
                    found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(path, known) for name, path in known.items()}


def floor(module: str) -> int:
    best, best_len = None, -1
    for i, members in enumerate(FLOORS):
        for m in members:
            if (module == m or module.startswith(m + ".")) and len(m) > best_len:
                best, best_len = i, len(m)
    assert best is not None, f"{module} is on no floor: add it to FLOORS"
    return best


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_circle():  # the negative control for the check below
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_verispec():
    assert cycles(import_graph()) == []


def test_no_floor_imports_a_floor_above_it():
    upward = [f"{m} -> {t}" for m, targets in import_graph().items() for t in sorted(targets) if floor(t) > floor(m)]
    assert upward == []


# ---- the engine's reads of a drafter ---------------------------------------------------------

ENGINE = ROOT / "engine"


def drafter_reads(tree: ast.AST) -> tuple[set[str], list[str]]:
    """Attribute names read off a drafter (``self.drafter.X``, ``drafter.X``), and any
    ``getattr``/``hasattr``/``setattr`` on one (probing, which the interface rules out)."""
    def is_drafter(expr: ast.AST) -> bool:
        return ((isinstance(expr, ast.Name) and expr.id == "drafter")
                or (isinstance(expr, ast.Attribute) and expr.attr == "drafter"))

    reads, probes = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_drafter(node.value):
            reads.add(node.attr)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr") and node.args and is_drafter(node.args[0])):
            probes.append(ast.unparse(node))
    return reads, probes


def declared() -> set[str]:
    return {name for name in dir(Drafter) if not name.startswith("_")}


def test_the_read_walker_sees_reads_and_probes():  # the negative control for the check below
    reads, probes = drafter_reads(ast.parse(
        "self.drafter.propose(seq, k)\nx = drafter.secret\nhasattr(self.drafter, 'calibrate')"))
    assert reads == {"propose", "secret"} and probes == ["hasattr(self.drafter, 'calibrate')"]
    assert "secret" not in declared()


@pytest.mark.parametrize("path", sorted(ENGINE.glob("*.py")), ids=lambda p: p.name)
def test_the_engine_reads_only_what_the_drafter_interface_declares(path):
    reads, probes = drafter_reads(ast.parse(path.read_text()))
    assert probes == []
    assert reads <= declared(), sorted(reads - declared())


def test_the_interface_declares_what_the_engine_reads():
    reads = set().union(*(drafter_reads(ast.parse(p.read_text()))[0] for p in ENGINE.glob("*.py")))
    assert {"start", "propose", "feedback", "finish", "hidden_layers", "last_prompt_state_only",
            "stops_within_round", "bind_costs", "bind_stop", "reads_prompts_as", "calibrate"} <= reads
