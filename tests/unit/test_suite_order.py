"""The order ``make test`` hands files to its workers (tests/conftest.py's slow_files_first):
files holding a slow test first, every file's tests kept together and in their order."""
from __future__ import annotations

from pathlib import Path

from tests.conftest import slow_files_first


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
