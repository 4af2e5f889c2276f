"""Starting processes from tests: the venv's launchers, a clean environment, run helpers.

Every launch a test makes goes through ``clean_env``: pytest may itself run under a launcher
(srun, mpiexec) whose variables would make a child think it is a rank of that job, and a rank
on 2 shared cores wants one thread.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
MPIEXEC = BIN / "mpiexec"        # pip mpich's, next to the interpreter
TORCHRUN = BIN / "torchrun"
WORKER = ROOT / "tests" / "dist_scripts" / "worker.py"   # the rank of the launcher tests

needs_mpiexec = pytest.mark.skipif(not MPIEXEC.exists(), reason=f"{MPIEXEC} missing (pip mpich)")
needs_torchrun = pytest.mark.skipif(not TORCHRUN.exists(), reason=f"{TORCHRUN} missing")

LAUNCH_VARS = re.compile(r"^(OMPI_|PMI_|PMIX_|SLURM_(?!CONF$)|MPI_LOCAL|HYDRA_|TORCHELASTIC_|PRESTO_MPI$|"
                         r"MPI4PY_|RANK$|LOCAL_RANK$|WORLD_SIZE$|LOCAL_WORLD_SIZE$|GROUP_RANK$|"
                         r"MASTER_ADDR$|MASTER_PORT$)")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)


def clean_env(**extra) -> dict:
    """This process's environment without any launcher's variables (pytest may itself run
    under one), one thread per rank (2 cores), and the repo importable."""
    env = {k: v for k, v in os.environ.items() if not LAUNCH_VARS.match(k)}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **extra)
    return env


def default_stop_signals() -> None:
    """``preexec_fn`` for a script whose signal handling a test checks: the stop signals at
    their default disposition, whatever this suite inherited. A signal ignored when bash
    starts cannot be trapped (bash(1)), and the suite may run ignoring some: `nohup` ignores
    HUP, a background job of a non-interactive shell (`make test &`) ignores INT."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def ranks_cmd(ranks: int, *cmd) -> list[str]:
    """``cmd`` on ``ranks`` ranks under the venv's mpiexec; alone (a world of one) for 1."""
    cmd = [str(c) for c in cmd]
    return cmd if ranks == 1 else [str(MPIEXEC), "-n", str(ranks), *cmd]


def run_ranks(ranks: int, *cmd, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    """Run ``cmd`` on ``ranks`` ranks from the repository root, in a clean environment;
    output captured as text."""
    return subprocess.run(ranks_cmd(ranks, *cmd), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=clean_env(**env))


def run_script(ranks: int, script: str, *args, timeout: float = 300,
               **env) -> subprocess.CompletedProcess:
    """tests/dist_scripts/``script`` with ``args`` on ``ranks`` ranks (see ``run_ranks``)."""
    return run_ranks(ranks, sys.executable, ROOT / "tests" / "dist_scripts" / script, *args,
                     timeout=timeout, **env)


def tail(proc: subprocess.CompletedProcess, n: int = 4000) -> str:
    """The end of a finished process's output, for an assertion message."""
    return (proc.stdout or "")[-n // 2:] + (proc.stderr or "")[-n:]


@pytest.fixture
def bindir(tmp_path):
    """A directory with executables named like the launchers (and a python beside them)."""
    d = tmp_path / "bin dir"
    d.mkdir()
    for name in ("python", "mpiexec", "mpirun", "srun", "torchrun"):
        (d / name).write_text("#!/bin/sh\n")
        (d / name).chmod(0o755)
    return d
