"""The import direction run_and_time.sh → submission → runtime → {loaders, kernels} holds,
and only runtime/launch/env.py reads the launcher's rank variables."""
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
        top = ROOT / "runtime" / name   # a module, or a package (runtime/config/)
        for path in sorted(top.rglob("*.py")) if top.is_dir() else [top.with_suffix(".py")]:
            wrong = runtime_imports(path) - TOP - {"model"}
            if wrong:
                bad.append(f"{path.relative_to(ROOT)} imports runtime.{sorted(wrong)}")
    assert set(RUNTIME_ROOMS) | TOP | {"__pycache__"} >= {
        p.name for p in (ROOT / "runtime").iterdir() if p.is_dir()}, "a room without a rule"
    assert not bad, "runtime's rooms import upwards:\n" + "\n".join(bad)
