"""The tiers' rules as tests/conftest.py holds them, and the rooms it marks tests with
(tests/support/rooms.py): a unit test that compiles, starts a child process or spends more
than its CPU budget is told which rule it broke; a test file's rooms come from what it
imports and names, rank scripts followed, test helpers not."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import UNIT_BUDGET_S, _NoChildProcess, broken_unit_rule
from tests.support import rooms


def test_a_compile_or_an_overspent_budget_is_named_and_a_small_test_passes():
    assert broken_unit_rule(0.2, UNIT_BUDGET_S, 0) is None
    assert "compiled 2 graph(s) with torch.compile" in broken_unit_rule(0.2, UNIT_BUDGET_S, 2)
    text = broken_unit_rule(UNIT_BUDGET_S + 1, UNIT_BUDGET_S, 0)
    assert f"budget of {UNIT_BUDGET_S:g} s" in text and "tests/integration" in text
    assert broken_unit_rule(UNIT_BUDGET_S + 1, UNIT_BUDGET_S + 2, 0) is None   # @budget


def test_a_child_process_is_refused_naming_it_and_git_is_let_through():
    before = subprocess.Popen.__init__
    with _NoChildProcess():
        with pytest.raises(AssertionError, match=r"starts no child process .*'-c', 'pass'.*"
                                                 r"move it to tests/integration"):
            subprocess.run([sys.executable, "-c", "pass"])
        with pytest.raises(AssertionError, match="C\\+\\+ compiler: the unit tier compiles"):
            subprocess.run(["g++", "--version"])
        assert subprocess.run(["git", "--version"], capture_output=True).returncode == 0
    assert subprocess.Popen.__init__ is before


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "test_x.py"
    path.write_text(text)
    rooms.rooms_of.cache_clear()
    return path


def test_rooms_come_from_imports_and_module_names_in_strings(tmp_path):
    path = _write(tmp_path, '''
"""Holds runtime/observe/metrics.py."""
import kernels.fused
from runtime import choices
from runtime.grad_sync.buckets import GradientBuckets
from tests.support.runs import CPU_CONFIG      # a helper: says nothing of the test


def test_it():
    from loaders.dataset import STATS_FILE
    run(["python", "-m", "runtime.calibrate.tune"])
    run(["./run_and_time.sh"])
''')
    assert rooms.rooms_of(path) == {"kernels", "choices", "grad_sync", "loaders", "observe",
                                    "calibrate", "run_and_time"}


def test_a_rank_script_named_by_the_test_brings_its_rooms(tmp_path):
    path = _write(tmp_path, 'def test_it():\n    run_script(2, "grad_sync.py", [])\n')
    assert {"grad_sync", "train", "launch"} <= rooms.rooms_of(path)


def test_every_room_of_runtime_on_disk_is_a_room():
    runtime = Path(rooms.ROOT) / "runtime"
    packages = {p.name for p in runtime.iterdir() if (p / "__init__.py").exists()}
    assert packages and packages <= set(rooms.all_rooms())
    assert {"kernels", "loaders", "submission", "bench", "run_and_time"} <= set(rooms.all_rooms())


def test_conftest_marks_each_test_with_its_files_rooms(request):
    rooms.rooms_of.cache_clear()
    mine = rooms.rooms_of(Path(__file__))
    assert "run_and_time" in mine            # this file names it in a string above
    marked = {m.name for m in request.node.iter_markers()} & set(rooms.all_rooms())
    assert marked == mine
