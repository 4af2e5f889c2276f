"""A real ``python -m runtime.model.convert`` stopped midway: HUP (a closed terminal) ends it
with exit 130 and nothing left; KILL leaves its temporary directory, which the next run on
that --out removes.

The child reads each tensor 20 ms late (its ``_tensor`` wrapped: ~1.2 s for the fixture's 62
weights), so the signal lands while the output is being built, after its temporary directory
and lock exist - the state a BERT-large conversion is in for most of its time.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.model import convert as cv
from basis import staging
from tests.support.launch import ROOT, clean_env, default_stop_signals
from tests.support.tf_checkpoint import PREFIX

SLOW_CHILD = """
import sys, time
import runtime.model.convert as cv
real = cv._tensor
def slow(*a):
    time.sleep(0.02)
    return real(*a)
cv._tensor = slow
sys.exit(cv.main(sys.argv[1:]))
"""


def _start(out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SLOW_CHILD, str(PREFIX), "--out", str(out)],
                            cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_stop_signals)


def _temp_of(proc: subprocess.Popen, out: Path, place: Path) -> Path:
    """The child's temporary directory, once it holds its lock."""
    tmp = place / staging.temp_name(out, proc.pid)
    deadline = time.monotonic() + 120
    while not (tmp / staging.LOCK).exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no temporary directory in 120 s"
        time.sleep(0.01)
    return tmp


def test_a_hup_midway_exits_130_leaving_nothing(tmp_path):
    """The terminal closing on a real run (TERM and INT, and HUP ignored under nohup, are
    the unit tests' in-process signals: tests/unit/test_convert_out.py)."""
    out = tmp_path / "out"
    proc = _start(out)
    _temp_of(proc, out, tmp_path)
    proc.send_signal(signal.SIGHUP)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err == "convert: interrupted; nothing was written to --out\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("into", [False, True], ids=["beside", "into an empty dir"])
def test_a_killed_runs_temporary_directory_is_removed_by_the_next_run(tmp_path, capsys, into):
    out = tmp_path / "out"
    if into:
        out.mkdir()
    proc = _start(out)
    tmp = _temp_of(proc, out, out if into else tmp_path)
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL and tmp.is_dir()       # what KILL leaves
    assert cv.main([str(PREFIX), "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert f"removed {tmp}: the temporary directory of an interrupted conversion " \
           f"(pid {proc.pid})" in stdout
    assert not tmp.exists() and (out / cv.MANIFEST_FILE).is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
