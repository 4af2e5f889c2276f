"""runtime.launch in one process or one child process, no launcher: a plain run never imports
mpi4py (nor starts MPI under Open MPI's variables), a failing task of an srun step cancels its
step (a stub ``scancel``), an expected failure (a full disk) prints one line and keeps its
traceback in the rank's log file, and tests/dist_scripts/worker.py alone joins a world of one.

Rank discovery on fake launcher environments: tests/unit/test_dist.py; real launchers:
tests/ranks/test_dist_ranks.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.envs import OMPI_ENV
from tests.support.launch import ROOT, WORKER, clean_env


# ---------------------------------------------------------------------------------------------
# discovery and the srun step, in a child process


def test_a_failing_srun_task_without_mpi_kills_its_step(tmp_path):
    """run_guarded on a task of an srun step (no MPI): before it exits, `scancel JOB.STEP`
    (Slurm's pmi2 plugin kills the step on MPI_Abort alike), so srun ends even when a node
    is gone. An error every rank raised alike, or bad input (exit 2), kills nothing."""
    log = tmp_path / "scancel.log"
    fake = tmp_path / "bin" / "scancel"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    fake.chmod(0o755)
    code = ("import sys; from runtime.launch.dist import run_guarded; "
            "from runtime.launch.env import discover; "
            "from tests.support.envs import SRUN_ENV; info = discover(SRUN_ENV, use_mpi=False); "
            "e = RuntimeError('boom'); e.raised_on_all_ranks = sys.argv[1] == 'all'; "
            "e.exit_code = 2 if sys.argv[1] == 'bad-input' else 1; "
            "run_guarded(lambda: (_ for _ in ()).throw(e), info)")
    env = dict(os.environ, PATH=f"{fake.parent}:{os.environ['PATH']}")
    for case, rc, expected in [("one", 1, "--quiet 1234.0\n"), ("all", 1, None),
                               ("bad-input", 2, None)]:
        log.unlink(missing_ok=True)
        proc = subprocess.run([sys.executable, "-c", code, case], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == rc and "[rank 5]" in proc.stderr, (case, proc.stderr)
        assert (log.read_text() if log.exists() else None) == expected


def test_a_rank_that_returns_leaves_with_its_status_after_the_exit_handlers(tmp_path):
    """run_guarded(leave=True), a rank's entry point: the returned status is the exit status
    (None = 0), the exit handlers ran (logging's flush, MPI_Finalize live there), buffered
    stdout came out - and nothing after it ran (the interpreter's teardown is skipped)."""
    code = ("import atexit, sys; from pathlib import Path; "
            "from runtime.launch.dist import run_guarded; "
            "atexit.register(lambda: Path(sys.argv[2]).write_text('ran')); "
            "sys.stdout.write('buffered, no newline'); "
            "value = None if sys.argv[1] == 'none' else int(sys.argv[1]); "
            "run_guarded(lambda: value, leave=True); Path(sys.argv[2] + '.after').touch()")
    for arg, rc in (("none", 0), ("3", 3), ("0", 0)):
        mark = tmp_path / f"atexit-{arg}"
        proc = subprocess.run([sys.executable, "-c", code, arg, str(mark)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == rc, (arg, proc.stderr)
        assert proc.stdout == "buffered, no newline" and mark.read_text() == "ran"
        assert not (tmp_path / f"atexit-{arg}.after").exists()
    # without leave, run_guarded returns the value to its caller
    from runtime.launch.dist import run_guarded
    assert run_guarded(lambda: 7) == 7


def test_an_expected_failure_prints_one_line_and_keeps_its_traceback_in_the_ranks_log(
        tmp_path):
    """submission.train's rank: a full disk (an expected failure, exit 3) prints its first
    line and where its traceback went - ranks/rank_00000.log beside the rank's record, or a
    temporary file when the run directory cannot take it - and no traceback; a failure
    nobody expected still prints its traceback on the console."""
    code = ("import errno, sys; from pathlib import Path; "
            "from runtime.launch.dist import keep_tracebacks, run_guarded; "
            "from submission.train import exit_code_of, expected_failure, rank_log; "
            "keep_tracebacks(rank_log(Path(sys.argv[2]), 0)); "
            "def deep(): raise (OSError(errno.ENOSPC, 'No space left on device', 'x.log') "
            "if sys.argv[1] == 'full' else RuntimeError('a bug'))\n"
            "run_guarded(deep, exit_code=exit_code_of, expected=expected_failure)")
    code = code.replace("; def deep", "\ndef deep")
    out = tmp_path / "run"
    (out / "ranks").mkdir(parents=True)
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "ranks").write_text("a file where the ranks' directory would be")
    for case, run_dir, rc in (("full", out, 3), ("full", blocked, 3), ("bug", out, 3)):
        proc = subprocess.run([sys.executable, "-c", code, case, str(run_dir)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == rc, (case, proc.stderr)
        if case == "bug":
            assert "Traceback (most recent call last)" in proc.stderr, proc.stderr
            continue
        (line,) = proc.stderr.splitlines()
        assert line.startswith("[rank ?] OSError: [Errno 28] No space left on device: 'x.log' "
                               "(its traceback: "), line
        kept = Path(line.rsplit("(its traceback: ", 1)[1].rstrip(")"))
        if run_dir == out:
            assert kept == out / "ranks" / "rank_00000.log"
        else:
            assert kept.parent != blocked and kept.name.startswith("presto_rank0_")
        text = kept.read_text()
        assert "Traceback (most recent call last)" in text and "in deep" in text, text
        if run_dir == blocked:
            kept.unlink()


def _run_py(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_plain_run_never_imports_mpi4py():
    code = ("import sys; from runtime.launch.env import discover; i = discover(); "
            "assert 'mpi4py' not in sys.modules, 'imported'; print(i.launcher)")
    out = _run_py(code, clean_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "single"
    # Under Open MPI's launcher with pip's MPICH, mpi4py is looked at but MPI is not started.
    code = ("import sys; from runtime.launch.env import discover; i = discover(); "
            "from mpi4py import MPI; assert not MPI.Is_initialized(); print(i.rendezvous)")
    out = _run_py(code, {**clean_env(), **OMPI_ENV})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "file"


# ---------------------------------------------------------------------------------------------
# no launcher: a world of one


@pytest.mark.timeout(60)
def test_single_process_joins_a_world_of_one():
    proc = subprocess.run([sys.executable, str(WORKER), "allreduce"], env=clean_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    (r,) = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines()
            if line.startswith("RESULT ")]
    assert (r["world_size"], r["launcher"], r["rendezvous"], r["sum"]) == (1, "single", "local", 1.0)
