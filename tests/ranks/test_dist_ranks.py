"""Process groups and fault handling (runtime.launch.dist) under real launchers: the venv's
MPICH ``mpiexec``, ``torchrun``, and Open MPI's ``mpirun`` when Debian's ``openmpi-bin`` is
installed, on tests/dist_scripts/worker.py - results, exit status and elapsed time. Real
``srun`` (with and without ``--mpi=pmi2``) runs on the private one-node cluster of the
``slurm_cluster`` fixture (tests/slurm_cluster.py).

Rank discovery on fake launcher environments: tests/unit/test_dist.py; one process (a world of
one, the srun step's scancel, mpi4py never imported): tests/integration/test_dist_integration.py."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.launch import (MPIEXEC, ROOT, TORCHRUN, WORKER, clean_env, needs_mpiexec,
                                  needs_torchrun)

pytestmark = pytest.mark.slow   # tests/ranks: every test here launches ranks

LAUNCH_TIMEOUT_S = 90      # a hang fails here, well before pytest-timeout's 150 s
FAULT_DEADLINE_S = 60      # the promise: every rank gone within 60 s of a fault


def _find_openmpi() -> str | None:
    for cand in ("mpirun.openmpi", "/usr/bin/mpirun"):
        path = shutil.which(cand)
        if not path:
            continue
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if "Open MPI" in out.stdout + out.stderr:
            return path
    return None


OPENMPI = _find_openmpi()
OPENMPI_LIB = next((p for p in ("/usr/lib/x86_64-linux-gnu/libmpi.so.40",
                                "/usr/lib/x86_64-linux-gnu/openmpi/lib/libmpi.so.40",
                                "/usr/lib64/openmpi/lib/libmpi.so.40") if os.path.exists(p)), None)
needs_openmpi = pytest.mark.skipif(OPENMPI is None, reason="Open MPI's mpirun not installed "
                                   "(apt-get install openmpi-bin)")


# ---------------------------------------------------------------------------------------------
# real launchers (each test starts ranks)


def _cmd(launcher: str, mode: str, timeout_s: float, tag: str, out_dir: str,
         extra_env: dict | None = None) -> list[str]:
    args = [mode, "--timeout", str(timeout_s), "--tag", tag, "--out", out_dir]
    script = [sys.executable, str(WORKER), *args]
    if launcher == "mpiexec":
        return [str(MPIEXEC), "-n", "2", *script]
    if launcher == "torchrun":
        # --standalone: the agent's store takes a free port, so concurrent jobs never collide.
        return [str(TORCHRUN), "--standalone", "--nproc_per_node", "2", str(WORKER), *args]
    if launcher.startswith("srun"):  # "srun-none", "srun-pmi2"
        # --kill-on-bad-exit, as run_and_time.sh and run.sub launch: a task that dies before
        # the runtime's own guard exists (pip MPICH's intermittent UCX failure in MPI_Init,
        # pmodels/mpich#7417) must still end the step, not leave the other task in MPI_Init.
        return ["srun", f"--mpi={launcher.split('-')[1]}", "--kill-on-bad-exit=1", "-n", "2",
                *script]
    if launcher == "openmpi":
        exports = [a for k in (extra_env or {}) for a in ("-x", k)]
        return [OPENMPI, "--allow-run-as-root", "--oversubscribe", "-np", "2", *exports, *script]
    raise ValueError(launcher)


def _start(launcher, mode, timeout_s=20.0, extra_env=None):
    env = clean_env(**(extra_env or {}))
    tag = f"presto-test-{os.getpid()}-{time.monotonic_ns()}"
    out_dir = tempfile.mkdtemp(prefix="presto-dist-")
    proc = subprocess.Popen(_cmd(launcher, mode, timeout_s, tag, out_dir, extra_env), env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    proc.out_dir = out_dir
    return proc, time.monotonic(), tag


def _live_ranks(tag: str) -> list[int]:
    """Processes still running with ``tag`` on their command line (zombies don't count)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if tag.encode() not in (d / "cmdline").read_bytes():
                continue
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            pids.append(int(d.name))
    return pids


def _finish(proc, started, tag, keep_out: bool = False):
    """(exit status, output, seconds, per-rank results from the --out files); ``keep_out``:
    the caller reads and removes the --out directory."""
    try:
        out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # our own session: the launcher and its ranks
        out, _ = proc.communicate()
        pytest.fail(f"launcher hung for {LAUNCH_TIMEOUT_S} s:\n{out[-4000:]}")
    elapsed = time.monotonic() - started
    deadline = time.monotonic() + 10
    while (left := _live_ranks(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        for pid in left:  # only the ranks this test started
            os.kill(pid, signal.SIGKILL)
        pytest.fail(f"ranks {left} outlived their launcher ({proc.args[0]}):\n{out[-4000:]}")
    results = [json.loads(p.read_text()) for p in sorted(Path(proc.out_dir).glob("rank*.json"))]
    if not keep_out:
        shutil.rmtree(proc.out_dir, ignore_errors=True)
    return proc.returncode, out, elapsed, sorted(results, key=lambda r: r["rank"])


def _launch(launcher, mode, timeout_s=20.0, extra_env=None):
    return _finish(*_start(launcher, mode, timeout_s, extra_env))


def _assert_allreduce_ok(rc, out, elapsed, res, launcher, rendezvous):
    assert rc == 0, out[-4000:]
    assert [r["rank"] for r in res] == [0, 1], out[-4000:]
    for r in res:
        assert r["world_size"] == 2 and r["local_world_size"] == 2 and r["sum"] == 3.0
        assert r["launcher"] == launcher and r["rendezvous"] == rendezvous
        assert r["backend"] == "gloo" and r["is_main"] == (r["rank"] == 0)
    assert [r["local_rank"] for r in res] == [0, 1]


@needs_mpiexec
@pytest.mark.timeout(60)
def test_rank_0_leaves_the_group_last():
    """The store's host (rank 0) returns from shutdown only after every peer has left: a
    peer torn down after it died now and then in std::terminate."""
    rc, out, _, _ = _launch("mpiexec", "leave-last")
    assert rc == 0, out[-4000:]
    stamps = dict(line.split() for line in out.splitlines()
                  if line.startswith(("LEFT", "DONE0", "DONE1")))
    assert float(stamps["DONE0"]) >= float(stamps["LEFT"]), out[-2000:]


@needs_mpiexec
@pytest.mark.timeout(60)
def test_a_rank_ending_after_another_is_not_killed():
    """Rank 1 ends its process 1 s after MPI_Finalize, rank 0 at once: rank 1 must end on its
    own. Ranks leave with os._exit, which skips MPICH's PMI finalize (a C exit handler); its
    hydra proxy then took rank 0's end for a crash and SIGKILLed rank 1 - reported as exit 0
    or 9 depending on when the proxy reaped it (the 4-rank noise-scale test failed so)."""
    rc, out, _, _ = _launch("mpiexec", "end-apart")
    assert rc == 0, out[-4000:]
    assert "END1 " in out, out[-4000:]   # rank 1 got to its own end


@pytest.mark.slow
@needs_mpiexec
@pytest.mark.timeout(150)
def test_mpiexec_two_jobs_at_once():
    """Two 2-rank jobs on one machine at the same time: each finds its own free port."""
    jobs = [_start("mpiexec", "allreduce") for _ in range(2)]
    for job in jobs:
        _assert_allreduce_ok(*_finish(*job), launcher="mpi", rendezvous="mpi")


@pytest.mark.slow
@needs_torchrun
@pytest.mark.timeout(150)
def test_torchrun_two_jobs_at_once():
    jobs = [_start("torchrun", "allreduce") for _ in range(2)]
    for job in jobs:
        _assert_allreduce_ok(*_finish(*job), launcher="torchrun", rendezvous="tcp")


@pytest.mark.slow
@needs_openmpi
@pytest.mark.timeout(150)
def test_openmpi_without_matching_mpi4py_uses_its_env():
    """pip's mpi4py loads MPICH, which cannot join Open MPI's job: the env path takes over."""
    jobs = [_start("openmpi", "allreduce") for _ in range(2)]
    for job in jobs:
        _assert_allreduce_ok(*_finish(*job), launcher="mpi", rendezvous="file")


@pytest.mark.slow
@needs_openmpi
@pytest.mark.skipif(OPENMPI_LIB is None, reason="Open MPI's libmpi.so.40 not found")
@pytest.mark.timeout(120)
def test_openmpi_with_mpi4py_on_openmpi_lib():
    _assert_allreduce_ok(*_launch("openmpi", "allreduce", extra_env={"MPI4PY_LIBMPI": OPENMPI_LIB}),
                         launcher="mpi", rendezvous="mpi")


@pytest.mark.slow
@pytest.mark.parametrize("mode,mpi", [("allreduce", "none"), ("allreduce", "pmi2"),
                                      ("raise", "none"), ("kill", "pmi2")])
@pytest.mark.timeout(150)
def test_srun(mode, mpi, slurm_cluster):
    """Real srun on the test cluster: without MPI (SLURM_* variables, port from the job id)
    and with --mpi=pmi2 (mpi4py on pip's MPICH)."""
    rc, out, elapsed, res = _launch(f"srun-{mpi}", mode, extra_env=slurm_cluster.env)
    if mode == "allreduce":
        _assert_allreduce_ok(rc, out, elapsed, res, launcher="srun",
                             rendezvous="mpi" if mpi == "pmi2" else "tcp")
    else:
        assert rc != 0 and elapsed < FAULT_DEADLINE_S, (rc, elapsed, out[-4000:])


LAUNCHERS = [pytest.param("mpiexec", marks=needs_mpiexec),
             pytest.param("torchrun", marks=needs_torchrun),
             pytest.param("openmpi", marks=needs_openmpi)]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.timeout(120)
def test_ranks_that_disagree_on_the_config_both_fail(launcher):
    rc, out, elapsed, _ = _launch(launcher, "config")
    assert rc != 0, out[-4000:]
    assert "rank(s) 1 disagree with rank 0" in out and "optimizer.lr" in out, out[-4000:]
    assert "config check passed" not in out
    assert elapsed < FAULT_DEADLINE_S


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["raise", "kill"])
@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.timeout(150)
def test_a_failing_rank_ends_the_job(launcher, mode):
    """Rank 1 raises / is SIGKILLed mid-allreduce: the launcher returns non-zero within 60 s."""
    rc, out, elapsed, _ = _launch(launcher, mode, timeout_s=20)
    assert rc != 0, out[-4000:]
    assert elapsed < FAULT_DEADLINE_S, f"took {elapsed:.1f} s\n{out[-4000:]}"
    if mode == "raise":
        # Not one exact line: launchers may interleave the ranks' output mid-line.
        assert "[rank 1]" in out and "injected failure on rank 1" in out, out[-4000:]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.timeout(120)
def test_every_rank_of_a_refusal_notes_it_before_any_leaves(launcher):
    """An error every rank raises alike (a refused resume: exit 2): no rank leaves before
    every rank has run its failure notes - the launcher ends the others the moment one exits
    non-zero, and a rank ended before it wrote its status record was reported "killed
    (SIGKILL, OOM, lost node)". Rank 1's note takes 2 s here."""
    proc, started, tag = _start(launcher, "refuse")
    out_dir = Path(proc.out_dir)
    try:
        rc, out, elapsed, _ = _finish(proc, started, tag, keep_out=True)
        assert rc == (1 if launcher == "torchrun" else 2), out[-4000:]   # torchrun folds it
        assert sorted(p.name for p in out_dir.glob("noted*")) == ["noted0", "noted1"], out[-4000:]
        assert "refused alike on every rank" in out
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


@pytest.mark.slow
@needs_mpiexec
@pytest.mark.timeout(120)
def test_a_refusal_prints_no_c10d_stack_when_the_stores_host_leaves():
    """A refusal every rank makes alike, rank 0 - which hosts the store the ranks meet on -
    the last to note it and rank 1 slow to look: rank 1 asked the store again after rank 0 had
    gone, and c10d printed "recvValue failed ... Connection reset by peer" and a C++ stack of
    13 frames after the one clean refusal (the probe's B3, 3 of 3 refusals after launch).
    Rank 0 leaves last now."""
    proc, started, tag = _start("mpiexec", "refuse-0-late")
    out_dir = Path(proc.out_dir)
    try:
        rc, out, elapsed, _ = _finish(proc, started, tag, keep_out=True)
        assert rc == 2 and out.count("refused alike on every rank") == 2, out[-4000:]
        for noise in ("c10d", "Connection reset", "frame #", "Exception raised from"):
            assert noise not in out, out[-4000:]
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


@pytest.mark.slow
@needs_mpiexec
@pytest.mark.timeout(120)
def test_a_hung_rank_times_out_the_others():
    """Rank 1 stops answering: rank 0's all-reduce times out (5 s) and MPI_Abort ends both."""
    rc, out, elapsed, _ = _launch("mpiexec", "hang", timeout_s=5)
    assert rc != 0, out[-4000:]
    assert "[rank 0]" in out and "Timed out" in out, out[-4000:]
    assert elapsed < 30, f"took {elapsed:.1f} s"
