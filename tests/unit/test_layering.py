"""The import direction run_and_time.sh → submission → runtime → {loaders, kernels} → basis
holds (basis, the torch-free room below them all, imports the standard library alone, and
every room may import it), only runtime/launch/env.py reads the launcher's rank variables, no engine module imports a
test instrument, the lower rooms never import the config, no import circle exists (imports
written anywhere count; the seams kept on purpose are listed with their reason), and nothing
outside tests/ reaches into the test suite."""
import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "loaders": {"runtime", "submission", "kernels"},
    "kernels": {"runtime", "submission", "loaders"},
    "runtime": {"submission"},
    "basis": {"runtime", "submission", "loaders", "kernels", "bench", "tests"},
}
RANK_VARS = re.compile(r"\b(PMI_RANK|PMI_SIZE|OMPI_COMM_WORLD_\w+|SLURM_PROCID|SLURM_LOCALID|"
                       r"LOCAL_RANK|WORLD_SIZE|MPI_LOCALRANKID)\b")


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_direction(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        wrong = imported_packages(path) & FORBIDDEN[package]
        if wrong:
            bad.append(f"{path.relative_to(ROOT)} imports {sorted(wrong)}")
    assert not bad, "one-way imports broken:\n" + "\n".join(bad)


def standard_library_only(source: str, filename: str = "<source>") -> list[str]:
    """The imports in ``source`` (anywhere, ``importlib.import_module`` with a literal name
    included) of anything but the standard library and its own package (``basis``): for the
    room below loaders and runtime, which must import without torch, numpy or the project."""
    bad = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [] if node.level else [node.module or ""]
        elif isinstance(node, ast.Call) and _import_module_name(node):
            names = [_import_module_name(node)]
        else:
            continue
        bad += [f"line {node.lineno}: imports {n}" for n in names
                if n.split(".")[0] not in sys.stdlib_module_names | {"basis", "__future__"}]
    return bad


def test_standard_library_only_finds_torch_and_the_project():
    source = """
import os, re
from pathlib import Path
from . import staging
from basis.staging import Staging
import numpy as np
def later():
    import torch
    from loaders import shards
    return importlib.import_module("runtime.choices")
"""
    assert standard_library_only(source) == ["line 6: imports numpy", "line 8: imports torch",
                                             "line 9: imports loaders",
                                             "line 10: imports runtime.choices"]


def test_basis_imports_the_standard_library_alone():
    files = sorted((ROOT / "basis").rglob("*.py"))
    assert {p.stem for p in files} >= {"model_shape", "presets", "staging", "cli", "tf_names",
                                       "dtypes"}
    bad = [f"{p.relative_to(ROOT)} {where}" for p in files
           for where in standard_library_only(p.read_text(), str(p))]
    assert not bad, ("basis/ imports beyond the standard library (it is the room every other "
                     "imports: what needs torch or the project lives above it):\n"
                     + "\n".join(bad))


def test_only_env_module_reads_rank_variables():
    readers = []
    for package in ("runtime", "loaders", "kernels", "submission", "basis"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "runtime" / "launch" / "env.py":
                continue
            for line in path.read_text().splitlines():
                if "environ" in line and RANK_VARS.search(line):
                    readers.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert not readers, "rank variables read outside runtime/launch/env.py:\n" + "\n".join(readers)


# Inside runtime/, the sub-packages import downwards only (a room never reaches up to the
# rooms built on it): the vocabulary at the top (config, choices, events) is open to all.
RUNTIME_ROOMS = {
    "launch": set(),
    "model": set(),
    "optim": set(),
    "grad_sync": {"launch"},
    "observe": {"launch"},
    "train": {"launch", "model", "optim", "grad_sync", "observe"},
    "calibrate": {"launch", "model", "optim", "grad_sync", "observe", "train"},
}
TOP = {"config", "choices", "events", "numerics"}


def _module_files(base: Path) -> list[Path]:
    """The files of module ``base`` (a .py file, or a package directory)."""
    return sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]


def runtime_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "runtime" and len(parts) > 1:
                out.add(parts[1])
    return out


def test_runtime_rooms_import_downwards():
    bad = []
    for room, allowed in RUNTIME_ROOMS.items():
        for path in sorted((ROOT / "runtime" / room).rglob("*.py")):
            wrong = runtime_imports(path) - allowed - TOP - {room}
            if wrong:
                bad.append(f"{path.relative_to(ROOT)} imports runtime.{sorted(wrong)}")
    for name in TOP:  # the vocabulary: config may name the model's own config, nothing more
        for path in _module_files(ROOT / "runtime" / name):
            wrong = runtime_imports(path) - TOP - {"model"}
            if wrong:
                bad.append(f"{path.relative_to(ROOT)} imports runtime.{sorted(wrong)}")
    assert set(RUNTIME_ROOMS) | TOP | {"__pycache__"} >= {
        p.name for p in (ROOT / "runtime").iterdir() if p.is_dir()}, "a room without a rule"
    assert not bad, "runtime's rooms import upwards:\n" + "\n".join(bad)


# A test instrument stays out of the engine: the simulated device (runtime.observe.hostsync) is
# handed in (DistContext.simulates_cuda, hostsync.simulated(ctx)); bench/ and tests/ use it.
INSTRUMENTS = {"runtime.observe.hostsync"}


def imported_modules(path: Path) -> set[str]:
    """Every dotted name ``path`` imports anywhere (a function's lazy import included), with
    ``from a import b`` giving both ``a`` and ``a.b``."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_engine_never_imports_a_test_instrument():
    bad = []
    for package in ("runtime", "kernels", "loaders"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "runtime" / "observe" / "hostsync.py":
                continue
            wrong = {m for m in imported_modules(path)
                     if any(m == i or m.startswith(i + ".") for i in INSTRUMENTS)}
            if wrong:
                bad.append(f"{path.relative_to(ROOT)} imports {sorted(wrong)}")
    assert not bad, ("a test instrument imported by the engine (hand the simulated device in "
                     "instead: DistContext.simulates_cuda):\n" + "\n".join(bad))


# The rooms below the trainer raise ConfigError from the vocabulary (runtime.choices) and get
# their values handed in: they never import the config, which is built on them.
LOWER_ROOMS = ("runtime/grad_sync", "runtime/optim", "runtime/model", "runtime/launch",
               "runtime/observe", "kernels", "loaders")


def test_lower_rooms_never_import_the_config():
    bad = []
    for room in LOWER_ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            wrong = {m for m in imported_modules(path)
                     if m == "runtime.config" or m.startswith("runtime.config.")}
            if wrong:
                bad.append(f"{path.relative_to(ROOT)} imports {sorted(wrong)}")
    assert not bad, ("a lower room imports the config (take ConfigError from runtime.choices, "
                     "values as arguments):\n" + "\n".join(bad))


# No import circle among the repository's packages. Every import counts, wherever it is
# written: the top level, ``if TYPE_CHECKING:`` blocks, a function's or a method's body, and
# ``importlib.import_module("a.b")`` with a literal name - a lazy import hides a circle from the
# interpreter, never from the reader, who still goes round it. A circle kept on purpose is in
# SEAMS under the import that closes it, with the reason; an entry whose import no longer closes
# a circle fails the test, so the list cannot outlive its circles.
PACKAGES = ("runtime", "submission", "loaders", "kernels", "bench", "basis")
SEAMS = {
    ("submission.hpo.common", "submission.hpo"):
        "a test seam by design: seam() reads run_trial and RUN_AND_TIME from the package at "
        "each call, so a stand-in the tests set on submission.hpo is the one every worker uses",
}


def _module_names() -> dict[str, Path]:
    names = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _import_module_name(node: ast.Call) -> str | None:
    """``importlib.import_module("a.b")``'s literal, absolute name, else None."""
    f = node.func
    called = f.attr if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
        and f.value.id == "importlib" else f.id if isinstance(f, ast.Name) else None
    if called != "import_module" or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) \
            and not arg.value.startswith("."):
        return arg.value
    return None


def module_imports(name: str, source: str, is_package: bool, modules) -> set[str]:
    """The modules of ``modules`` that module ``name`` imports anywhere in ``source``.
    ``from a import b`` is an edge to ``a.b`` when that is a module, else to ``a``; a name
    outside ``modules`` drops."""
    package = name.split(".") if is_package else name.split(".")[:-1]
    edges = set()
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1]
                                + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        elif isinstance(node, ast.Call) and _import_module_name(node):
            targets = [_import_module_name(node)]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
    return edges


def import_graph() -> dict[str, set[str]]:
    """Module -> the repository modules it imports (anywhere: ``module_imports``)."""
    modules = _module_names()
    return {name: module_imports(name, path.read_text(), path.name == "__init__.py", modules)
            for name, path in modules.items()}


def test_imports_count_wherever_written():
    modules = {"p", "p.a", "p.b", "p.c", "p.d", "p.e", "p.f"}
    source = """
from typing import TYPE_CHECKING
import importlib
from p import b
if TYPE_CHECKING:
    from p.c import Thing
def lazy():
    from . import d
class Holder:
    def method(self):
        import p.e.inner
def by_name():
    return importlib.import_module("p.f")
"""
    assert module_imports("p.a", source, False, modules) == {"p.b", "p.c", "p.d", "p.e", "p.f"}
    assert module_imports("p", "from . import a", True, modules) == {"p.a"}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected group of more than one module (Tarjan), as one circle through
    it: ``[a, b, ..., a]``."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(set(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    circles = []
    for group in groups:   # the shortest way round from the group's first name, to name it
        start = min(group)
        came_from, frontier = {}, [start]
        while start not in came_from:
            step = []
            for v in frontier:
                for w in sorted(graph[v] & group):
                    if w not in came_from:
                        came_from[w] = v
                        step.append(w)
            frontier = step
        path, v = [start], came_from[start]
        while v != start:
            path.append(v)
            v = came_from[v]
        circles.append([start] + path[:0:-1] + [start])
    return circles


def test_find_cycles_names_the_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    detour = {"a": {"b"}, "b": {"c", "d"}, "c": {"b"}, "d": {"a"}}
    assert find_cycles(detour) == [["a", "b", "d", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = {start}, [start]
    while todo:
        v = todo.pop()
        if v == goal:
            return True
        for w in graph.get(v, ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return False


def unexplained_circles(graph: dict[str, set[str]], seams) -> tuple[list[list[str]], list]:
    """The circles left once the ``seams`` imports are set aside, and the seams that close no
    circle of ``graph`` (the import gone, or nothing leads back from it): stale entries."""
    stale = sorted((a, b) for a, b in seams
                   if b not in graph.get(a, ()) or not _reaches(graph, b, a))
    kept = {v: {w for w in ws if (v, w) not in seams} for v, ws in graph.items()}
    return find_cycles(kept), stale


def test_seams_excuse_their_circle_and_go_stale_without_it():
    circle = {"a": {"b"}, "b": {"a", "c"}, "c": set()}
    assert unexplained_circles(circle, {}) == ([["a", "b", "a"]], [])
    assert unexplained_circles(circle, {("b", "a"): "why"}) == ([], [])
    assert unexplained_circles(circle, {("b", "c"): "why"}) == ([["a", "b", "a"]], [("b", "c")])
    gone = {"a": {"b"}, "b": {"c"}, "c": set()}          # b stopped importing a
    assert unexplained_circles(gone, {("b", "a"): "why"}) == ([], [("b", "a")])
    assert unexplained_circles({"a": set(), "b": {"a"}}, {("b", "a"): "why"}) == ([], [("b", "a")])


def test_no_import_circle():
    assert all(reason.strip() for reason in SEAMS.values()), "a seam without its reason"
    circles, stale = unexplained_circles(import_graph(), SEAMS)
    assert not stale, ("SEAMS entries that close no circle any more (remove them):\n"
                       + "\n".join(f"{a} -> {b}: {SEAMS[a, b]}" for a, b in stale))
    assert not circles, ("import circles (move the shared rows down to the module both "
                         "import, or list a deliberate seam in SEAMS with its reason):\n"
                         + "\n".join(" -> ".join(c) for c in circles))


# Nothing outside tests/ reaches into the test suite: no import of ``tests``, ``tests.*`` or
# ``conftest``, and no ``sys.path`` entry naming a tests/ folder. What a tool shares with the
# suite moves down to a module both import (the small data set's options: basis/presets.py).
SUITE = {"tests", "conftest"}


def reaches_into_tests(source: str, filename: str = "<source>") -> list[str]:
    """Where ``source`` imports the test suite or puts a tests/ folder on ``sys.path``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and _import_module_name(node):
            names = [_import_module_name(node)]
        else:
            names = []
        found += [(node.lineno, f"imports {n}") for n in names if n.split(".")[0] in SUITE]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value                       # sys.path.insert(0, ...) and kin
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            target = target.value if isinstance(target, ast.Subscript) else target
        else:
            continue
        if ast.unparse(target) == "sys.path" and any(
                isinstance(c, ast.Constant) and isinstance(c.value, str)
                and "tests" in re.split(r"[/\\]", c.value) for c in ast.walk(node)):
            found.append((node.lineno, "puts tests/ on sys.path"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_reaches_into_tests_finds_an_import_and_a_path():
    old_setup = """
import sys
def stage_data(run):
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import SMALL_DATASET_OPTIONS, SOURCES
"""
    assert reaches_into_tests(old_setup) == ["line 4: puts tests/ on sys.path",
                                             "line 5: imports conftest"]
    assert reaches_into_tests("import tests.support.data\nsys.path += ['a/tests/support']") == [
        "line 1: imports tests.support.data", "line 2: puts tests/ on sys.path"]
    assert reaches_into_tests("from tests import x\nsys.path[0:0] = [os.path.join(R, 'tests')]"
                              ) == ["line 1: imports tests", "line 2: puts tests/ on sys.path"]
    clean = """
sys.path.insert(0, str(ROOT))
CUDA_TESTS = ("tests/unit/test_kernels.py",)
subprocess.run(["pytest", "tests/unit"])
from bench.gpu.harness import ROOT
"""
    assert reaches_into_tests(clean) == []


def test_nothing_outside_tests_reaches_into_the_suite():
    files = [p for top in sorted(ROOT.iterdir())
             if not top.name.startswith(".") and top.name != "tests"
             for p in (sorted(top.rglob("*.py")) if top.is_dir() else [top])
             if p.suffix == ".py"]
    assert any(p.relative_to(ROOT).parts[0] == "bench" for p in files)
    bad = [f"{p.relative_to(ROOT)} {where}" for p in files
           for where in reaches_into_tests(p.read_text(), str(p))]
    assert not bad, ("the test suite imported from outside tests/ (move what is shared to a "
                     "module both import):\n" + "\n".join(bad))
