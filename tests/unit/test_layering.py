"""The import direction run_and_time.sh → submission → runtime → {loaders, kernels} holds,
only runtime/launch/env.py reads the launcher's rank variables, no engine module imports a
test instrument, the lower rooms never import the config, and no import circle exists."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "loaders": {"runtime", "submission", "kernels"},
    "kernels": {"runtime", "submission", "loaders"},
    "runtime": {"submission"},
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


def test_only_env_module_reads_rank_variables():
    readers = []
    for package in ("runtime", "loaders", "kernels", "submission"):
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
TOP = {"config", "choices", "events"}


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


# No import circle among the repository's packages: a module's imports at import time (its
# top level, ``if TYPE_CHECKING:`` blocks included - a circle hidden from the interpreter is
# still a circle to the reader) form a graph without cycles.
PACKAGES = ("runtime", "submission", "loaders", "kernels", "bench")


def _module_names() -> dict[str, Path]:
    names = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _top_level_imports(body):
    """The import statements a module runs when imported: its top level and the blocks there
    (if/else, try/except/finally, with), never a function's or a class's body."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", []),
                          *[h.body for h in getattr(node, "handlers", [])]):
                yield from _top_level_imports(block)


def import_graph() -> dict[str, set[str]]:
    """Module -> the repository modules it imports at import time. ``from a import b`` is an
    edge to ``a.b`` when that is a module, else to ``a``; names outside the repository drop."""
    modules = _module_names()
    graph = {}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges = set()
        for node in _top_level_imports(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1]
                                    + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


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


def test_no_import_circle():
    circles = find_cycles(import_graph())
    assert not circles, ("import circles (move the shared rows down to the module both "
                         "import):\n" + "\n".join(" -> ".join(c) for c in circles))
