"""The order ``make test`` hands files to its workers (tests/conftest.py's slow_files_first):
HEAVY_FIRST's files, then the files holding a slow test, every file's tests kept together and
in their order."""
from __future__ import annotations

from pathlib import Path

from tests.conftest import HEAVY_FIRST, TESTS, slow_files_first


class Item:
    def __init__(self, path: str, name: str, slow: bool = False):
        self.path, self.name, self.slow = Path(path), name, slow

    def get_closest_marker(self, name):
        return object() if name == "slow" and self.slow else None


def test_files_with_a_slow_test_go_first_whole_and_in_order():
    items = [Item("unit/a.py", "a1"), Item("unit/a.py", "a2"),     # (as collected: by file)
             Item("integration/b.py", "b1"), Item("integration/b.py", "b2", slow=True),
             Item("integration/b.py", "b3"), Item("unit/c.py", "c1"),
             Item("e2e/d.py", "d1", slow=True), Item("e2e/d.py", "d2", slow=True)]
    got = [i.name for i in slow_files_first(items)]
    assert got == ["b1", "b2", "b3", "d1", "d2", "a1", "a2", "c1"]


def test_the_heavy_files_go_before_every_other():
    heavy = str(TESTS / HEAVY_FIRST[0])
    items = [Item("e2e/d.py", "d1", slow=True), Item("unit/a.py", "a1"),
             Item(heavy, "h1"), Item(heavy, "h2", slow=True), Item("e2e/e.py", "e1", slow=True)]
    got = [i.name for i in slow_files_first(items)]
    assert got == ["h1", "h2", "d1", "e1", "a1"]
    assert all((TESTS / name).is_file() for name in HEAVY_FIRST)   # no stale name
