"""The launchers' table through its command line (``python -m submission.launchers``, as
run_and_time.sh calls it): the argv as NUL-ended items and the errors as run_and_time.sh
messages. The rows themselves: tests/unit/test_launchers.py; run_and_time.sh's use of it:
tests/e2e/test_run_and_time.py."""
from __future__ import annotations

import os
import subprocess
import sys

from tests.support.launch import ROOT


# ------------------------------------------------------------------ the command line


def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in (
        "MPIEXEC", "MPIRUN", "SRUN", "TORCHRUN", "HOSTFILE", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.run([sys.executable, "-m", "submission.launchers", *args], cwd=ROOT,
                          env={**clean, **env}, capture_output=True, timeout=60)


def test_cli_prints_nul_ended_items(bindir):
    """The signal, this process's rank or '', the ranks the launch starts, then the argv: an
    item may hold spaces and newlines."""
    command = [sys.executable, "-m", "submission.train", "--set", "submission.org=a b\nc"]
    proc = cli("argv", "--launcher", "mpiexec", "--nodes", "1", "--ranks", "2", "--", *command,
               MPIEXEC=str(bindir / "mpiexec"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split(b"\0") == [b"USR1", b"", b"2", str(bindir / "mpiexec").encode(),
                                        b"-n", b"2", *(a.encode() for a in command), b""]
    proc = cli("argv", "--launcher", "srun", "--nodes", "1", "--ranks", "2", "--", *command,
               SLURM_PROCID="1", SLURM_STEP_ID="0", SLURM_JOB_ID="5")
    assert proc.stdout.split(b"\0")[:4] == [b"USR1", b"1", b"1", sys.executable.encode()]
    # torchrun starts one node's ranks: each node's run_and_time.sh waits for its own.
    proc = cli("argv", "--launcher", "torchrun", "--nodes", "2", "--ranks", "4", "--", *command,
               MASTER_ADDR="node0")
    assert proc.stdout.split(b"\0")[:3] == [b"TERM", b"", b"4"]


def test_cli_errors_are_run_and_time_messages():
    proc = cli("argv", "--launcher", "torchrun", "--nodes", "2", "--ranks", "2", "--",
               sys.executable, "-m", "submission.train")
    assert proc.returncode == 2 and proc.stdout == b""
    assert proc.stderr.decode() == ("run_and_time.sh: system.nodes=2 needs MASTER_ADDR (the "
                                    "rendezvous host) for torchrun\n")
    proc = cli("argv", "--launcher", "ssh", "--nodes", "1", "--ranks", "2", "--config", "c.toml",
               "--", "python")
    assert proc.returncode == 2
    assert b"system.launcher='ssh' in 'c.toml' is not one of" in proc.stderr
