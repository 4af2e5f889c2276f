"""run_and_time.sh and run directories: one per run (distinct within a second, or the
train.output_dir named), held by a lock from before the launch - as is a checkpoint directory
- and refused, before anything launches, where it cannot take the run.

Under the stub launchers of tests/support/run_and_time.py.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.support.run_and_time import (SCRIPT, end_stubs, run, sandbox,  # noqa: F401
                                        signal_stub, start_script, stub_pids, wait_for,
                                        write_config)

pytestmark = pytest.mark.slow   # tests/e2e: every test here is slow


def test_runs_started_in_the_same_second_get_distinct_directories(sandbox):
    root, _ = sandbox
    cfg = write_config(root, "mpiexec")
    procs, dirs = [], set()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_"))
           and k not in ("RUN_DIR", "SEED")}
    _, stubs = sandbox
    env.update(PYTHON=stubs["python"], MPIEXEC=stubs["mpiexec"], CONFIG=str(cfg),
               LOGDIR=str(root / "log dir"), STUB_LOG=str(root / "calls.jsonl"))
    for _ in range(3):
        procs.append(subprocess.Popen([str(SCRIPT)], env=env, cwd=root, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        dirs.add(re.search(r", output (.+)$", err, re.M).group(1))
    assert len(dirs) == 3 and all(Path(d).is_dir() for d in dirs)


def test_train_output_dir_override_is_the_run_directory(sandbox):
    root, _ = sandbox
    cfg = write_config(root, "mpiexec")
    proc, calls = run(sandbox, cfg, "--", f'train.output_dir="{root}/mine"')
    assert proc.returncode == 0, proc.stderr
    argv = calls[0]["argv"]
    outs = [a for a in argv if a.startswith("train.output_dir=")]
    assert outs == [f"train.output_dir={root}/mine"], argv   # one place, not two
    assert f"output {root}/mine" in proc.stderr
    proc, calls = run(sandbox, cfg, "--", "train.output_dir=/a", RUN_DIR="/b")
    assert proc.returncode == 2 and not calls and "two places for one run" in proc.stderr


def test_the_run_directory_is_held_from_before_the_launch(sandbox, tmp_path):
    """A second run_and_time.sh with the RUN_DIR of a run that has just launched (before any
    of its ranks could take a lock) is refused with exit 2, naming the live run; it starts no
    launcher and writes nothing there, launcher.log included."""
    env, files = signal_stub(sandbox)
    run_dir = tmp_path / "the run"
    try:
        first = start_script(sandbox, dict(env, RUN_DIR=str(run_dir)))
        wait_for(files / "started", first)
        wait_for(run_dir / "ranks" / "ends.jsonl", first)   # the first run's own watch
        log = run_dir / "launcher.log"
        before = sorted(p.name for p in run_dir.iterdir()), log.read_bytes()
        second = start_script(sandbox, dict(env, RUN_DIR=str(run_dir)))
        out, err = second.communicate(timeout=60)
        assert second.returncode == 2, err[-3000:]
        assert f"RUN_DIR '{run_dir}' is in use by another run (run_and_time.sh pid " \
               f"{first.pid} on " in err, err[-3000:]
        assert "STARTING TIMING RUN" not in out and len(stub_pids(files)) == 1
        assert (sorted(p.name for p in run_dir.iterdir()), log.read_bytes()) == before
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=60)
        assert first.returncode == 4, err[-3000:]
    finally:
        end_stubs(files)


def test_a_checkpoint_directory_is_held_by_one_run(sandbox, tmp_path):
    """Two runs in two run directories with one train.checkpoint_dir: the second is refused
    with exit 2 naming the run that holds it, before anything is written - in the checkpoint
    directory, or a run directory of its own left behind."""
    root, _ = sandbox
    env, files = signal_stub(sandbox)
    ckpt = tmp_path / "shared checkpoints"
    share = ["--", f'train.checkpoint_dir="{ckpt}"', "train.checkpoint_every_samples=80"]
    run_a = tmp_path / "run a"
    try:
        first = start_script(sandbox, dict(env, RUN_DIR=str(run_a)), *share)
        wait_for(files / "started", first)
        before = sorted(p.name for p in ckpt.iterdir()), (ckpt / ".lock").read_bytes()
        logdir = root / "log dir"
        second = start_script(sandbox, env, *share)   # a fresh run directory in LOGDIR
        out, err = second.communicate(timeout=60)
        assert second.returncode == 2, err[-3000:]
        assert f"train.checkpoint_dir '{ckpt}' is in use by another run (run_and_time.sh " \
               f"pid {first.pid} on " in err and f"run directory {run_a}" in err, err[-3000:]
        assert len(stub_pids(files)) == 1
        assert (sorted(p.name for p in ckpt.iterdir()), (ckpt / ".lock").read_bytes()) == before
        assert not logdir.exists() or not list(logdir.iterdir())
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 4
    finally:
        end_stubs(files)


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only file system (a tmpfs mounted ro: as root, permission bits stop nothing)."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs",
                                            str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    yield path
    subprocess.run(["umount", str(path)], capture_output=True)


def test_a_run_directory_that_cannot_take_the_run_stops_the_script_before_launch(
        sandbox, tmp_path, read_only_dir):
    """RUN_DIR naming a file, RUN_DIR or LOGDIR on a read-only file system, and RUN_DIR held
    by a live run: exit 2 with the reason (the OS's words), the launcher never started, and
    nothing written into the live run's directory."""
    import fcntl
    root, _ = sandbox
    config = write_config(root, "mpiexec")
    a_file = tmp_path / "a file"
    a_file.write_text("mine\n")
    proc, calls = run(sandbox, config, RUN_DIR=str(a_file))
    assert proc.returncode == 2 and "exists and is not a directory" in proc.stderr, proc.stderr
    assert calls == [] and a_file.read_text() == "mine\n"
    proc, calls = run(sandbox, config, RUN_DIR=str(read_only_dir / "run"))
    assert proc.returncode == 2 and calls == [], proc.stderr
    assert "cannot create RUN_DIR" in proc.stderr and "Read-only file system" in proc.stderr
    proc, calls = run(sandbox, config, LOGDIR=str(read_only_dir / "logs"))
    assert proc.returncode == 2 and calls == [], proc.stderr
    assert "cannot create LOGDIR" in proc.stderr and "Read-only file system" in proc.stderr
    live = tmp_path / "live run"
    live.mkdir()
    (live / "launcher.log").write_text("the live run's own lines\n")
    with open(live / ".lock", "a+") as lock:
        lock.write("pid 4242 on node7 since 2026-11-24 10:00:00\n")
        lock.flush()
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        proc, calls = run(sandbox, config, RUN_DIR=str(live))
    assert proc.returncode == 2 and calls == [], proc.stderr
    assert "is in use by another run (pid 4242 on node7" in proc.stderr, proc.stderr
    assert sorted(p.name for p in live.iterdir()) == [".lock", "launcher.log"]
    assert (live / "launcher.log").read_text() == "the live run's own lines\n"
