"""Which rooms of the house a test file exercises, derived from what it imports - so
``pytest -m grad_sync`` runs every test of ``runtime/grad_sync`` across the tiers, with no
hand-kept list to go stale.

A room is a top-level package (``basis``, ``kernels``, ``loaders``, ``submission``,
``bench``) or a room of ``runtime/`` (each of its packages and top-level modules: ``config``,
``grad_sync``, ``model``, ``choices``, ...), found on disk, so a new room of runtime/ gets its
marker with no edit here; ``run_and_time`` marks the tests that start ``run_and_time.sh``. A
test file belongs to a room when it imports a module of it (anywhere in the file,
``tests/support`` not followed: a helper module says nothing of what a test holds), names one
of its modules in a string (``-m runtime.calibrate.tune``, ``runtime/grad_sync/buckets.py``),
or names a rank script of ``tests/dist_scripts/`` whose own imports reach the room.

``python -m tests.support.rooms`` prints each room with its test files (docs/DEVELOPING.md).
Owns: the rooms and the rule. Never: runs or selects tests (tests/conftest.py marks them).
"""
from __future__ import annotations

import ast
import re
import sys
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOP = ("basis", "kernels", "loaders", "submission", "bench")
SCRIPTS = ROOT / "tests" / "dist_scripts"
RUN_AND_TIME = "run_and_time"


@lru_cache(maxsize=None)
def runtime_rooms() -> tuple[str, ...]:
    """The rooms of runtime/: its packages and its top-level modules, by name."""
    rt = ROOT / "runtime"
    names = [p.name for p in rt.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    names += [p.stem for p in rt.glob("*.py") if p.stem != "__init__"]
    return tuple(sorted(names))


def all_rooms() -> tuple[str, ...]:
    return tuple(sorted(TOP + runtime_rooms() + (RUN_AND_TIME,)))


_NAME = re.compile(r"\b(runtime|basis|kernels|loaders|submission|bench)(?:[./](\w+))?")


def _room(top: str, sub: str | None) -> str | None:
    if top != "runtime":
        return top
    return sub if sub in runtime_rooms() else None


def _rooms_of_module(dotted: str) -> set[str]:
    parts = dotted.split(".")
    if parts[0] not in ("runtime",) + TOP:
        return set()
    room = _room(parts[0], parts[1] if len(parts) > 1 else None)
    return {room} if room else set()


@lru_cache(maxsize=None)
def rooms_of(path: Path) -> frozenset[str]:
    """The rooms the test file (or rank script) at ``path`` exercises."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    rooms: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                rooms |= _rooms_of_module(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            rooms |= _rooms_of_module(node.module)
            if node.module == "tests.support.run_and_time":
                rooms.add(RUN_AND_TIME)
            if node.module in ("runtime",) + TOP:     # from runtime import choices
                for alias in node.names:
                    rooms |= _rooms_of_module(f"{node.module}.{alias.name}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            for top, sub in _NAME.findall(text):
                room = _room(top, sub or None)
                if room:
                    rooms.add(room)
            if "run_and_time" in text:
                rooms.add(RUN_AND_TIME)
            for script in SCRIPTS.glob("*.py"):
                if script.stem != "__init__" and (f"{script.name}" in text
                                                  or f"dist_scripts/{script.stem}" in text):
                    if script.resolve() != Path(path).resolve():
                        rooms |= rooms_of(script)
    return frozenset(rooms)


def main() -> int:
    tests = ROOT / "tests"
    files = sorted(p for tier in ("unit", "integration", "ranks", "e2e")
                   for p in (tests / tier).glob("test_*.py"))
    by_room: dict[str, list[str]] = {r: [] for r in all_rooms()}
    for f in files:
        for r in rooms_of(f):
            by_room.setdefault(r, []).append(str(f.relative_to(tests)))
    for room, names in by_room.items():
        print(f"{room} ({len(names)} files): {', '.join(names) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
