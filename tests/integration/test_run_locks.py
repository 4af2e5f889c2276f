"""Rank 0's side of the run-directory and checkpoint-directory locks (submission/train.py):
each directory is held by one live run - an flock on DIR/.lock whose first line names the
holder. run_and_time.sh takes both before it launches and passes its line as
``--lock-holder``: rank 0 accepts a lock held under that line and refuses any other holder;
without run_and_time.sh, rank 0 takes them itself. The script's side, with real launchers:
tests/e2e/test_run_and_time_dirs.py and tests/e2e/test_signals_e2e.py."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.config import load_config
from runtime.launch import signals
from submission import train as entry


def config(out: Path, ckpt: Path | None = None, every: int = 80):
    values = [f'train.output_dir="{out}"', f"train.checkpoint_every_samples={every}"]
    if ckpt is not None:
        values.append(f'train.checkpoint_dir="{ckpt}"')
    return load_config(None, values)


@pytest.fixture(autouse=True)
def release_locks():
    yield
    while entry._held:
        entry._held.pop().close()


@pytest.fixture
def other_process():
    """Hold DIR/.lock from another process, under a given first line, until the test ends."""
    procs = []

    def hold(directory: Path, line: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        code = ("import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
                "fcntl.flock(f, fcntl.LOCK_EX); f.seek(0); f.truncate(); "
                "f.write(sys.argv[2] + '\\n'); f.flush(); print('held', flush=True); "
                "time.sleep(120)")
        proc = subprocess.Popen([sys.executable, "-c", code, str(directory / ".lock"), line],
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "held"
        procs.append(proc)

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait()


def test_rank_0_accepts_the_locks_run_and_time_holds_for_this_run(tmp_path, other_process):
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    line = f"run_and_time.sh pid 4242 on node7 since 2026-11-24 10:00:00 for run directory {out}"
    other_process(out, line)
    other_process(ckpt, line)
    assert entry.run_dir_problem(config(out, ckpt), lock_holder=line) is None
    # Any other line is another run's: refused, naming it.
    problem = entry.run_dir_problem(config(out, ckpt), lock_holder="run_and_time.sh pid 1")
    assert problem == f"{out} is in use by another run ({line}): wait for it to end, or " \
                      f"choose another train.output_dir"


def test_without_run_and_time_rank_0_holds_both_directories_itself(tmp_path):
    """Two runs (two run directories) given one fresh train.checkpoint_dir: the second is
    refused, naming the run that holds it, until the first has ended."""
    ckpt = tmp_path / "ckpt"
    a, b = tmp_path / "a", tmp_path / "b"
    assert entry.run_dir_problem(config(a, ckpt)) is None
    assert (a / ".lock").read_text().endswith(f"for run directory {a}\n")
    problem = entry.run_dir_problem(config(b, ckpt))
    assert problem.startswith(f"train.checkpoint_dir {ckpt} is in use by another run (pid ")
    assert f"for run directory {a})" in problem and "choose another train.checkpoint_dir" in problem
    assert entry.run_dir_problem(config(a, tmp_path / "other")) is not None   # a is held too
    while entry._held:   # the first run ends
        entry._held.pop().close()
    assert entry.run_dir_problem(config(b, ckpt)) is None


def test_a_checkpoint_directory_needs_its_own_lock_only_outside_the_run_directory(tmp_path):
    out = tmp_path / "run"
    assert entry.own_checkpoint_dir(config(out)) is None                     # <run>/checkpoints
    assert entry.own_checkpoint_dir(config(out, out / "ck")) is None         # inside it
    assert entry.own_checkpoint_dir(config(out, out)) is None                # the run dir itself
    assert entry.own_checkpoint_dir(config(out, tmp_path / "ck", every=0)) is None   # none kept
    assert entry.own_checkpoint_dir(config(out, tmp_path / "ck")) == (tmp_path / "ck").resolve()


def test_announce_says_the_handlers_are_in(tmp_path):
    """The file a rank writes once its stop-signal handlers are installed (run_and_time.sh
    holds a stop request until every rank has written one); a missing directory is no error."""
    signals.announce(str(tmp_path))
    assert [p.name for p in tmp_path.iterdir()] == [f"{socket.gethostname()}.{os.getpid()}"]
    signals.announce(str(tmp_path / "missing"))
    signals.announce("")
