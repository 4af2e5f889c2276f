"""Rank discovery (runtime.launch.env) and process groups + fault handling (runtime.launch.dist).

Unit tests feed fake launcher environments to `discover`. The rest start real launchers —
the venv's MPICH ``mpiexec``, ``torchrun``, and Open MPI's ``mpirun`` when Debian's
``openmpi-bin`` is installed — on tests/dist_scripts/worker.py, and check results, exit
status and elapsed time. Real ``srun`` (with and without ``--mpi=pmi2``) runs on the private
one-node cluster of the ``slurm_cluster`` fixture (tests/slurm_cluster.py).
"""
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

from runtime.launch.env import (LaunchError, LaunchInfo, derived_port, discover, first_host,
                                mpi_launcher_family, parse_tasks_per_node)
from runtime.launch.env import _vendor_fits
from tests.support.launch import (MPIEXEC, ROOT, TORCHRUN, clean_env, needs_mpiexec,
                                  needs_torchrun)

WORKER = ROOT / "tests" / "dist_scripts" / "worker.py"
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
# discover() on fake environments (use_mpi=False: never MPI_Init inside pytest)

TORCHRUN_ENV = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500",
                "TORCHELASTIC_RUN_ID": "none"}
SRUN_ENV = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "7",
            "SLURM_STEP_NUM_TASKS": "7", "SLURM_NODEID": "2", "SLURM_STEP_ID": "0",
            "SLURM_JOB_ID": "1234", "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
            "SLURM_STEP_NODELIST": "gpu[07-10]", "SLURM_NNODES": "4"}
OMPI_ENV = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "OMPI_MCA_ess_base_jobid": "2136997889", "PMIX_NAMESPACE": "2136997889",
            "PMIX_RANK": "1", "OMPI_MCA_orte_jobfam_session_dir": "/tmp/ompi.vm.0/pid.5022"}
MPICH_ENV = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
             "PMI_FD": "9", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "23456"}


def test_no_launcher_is_single_process():
    info = discover({}, use_mpi=False)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (0, 0, 1, 1)
    assert info.launcher == "single" and info.rendezvous == "local" and info.is_main


def test_torchrun_env():
    info = discover(TORCHRUN_ENV, use_mpi=False)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (3, 1, 4, 2)
    assert info.launcher == "torchrun" and info.node_rank == 1
    assert (info.rendezvous, info.master_addr, info.master_port) == ("tcp", "10.0.0.1", 29500)
    assert not info.is_main


def test_torchrun_without_master_addr_fails():
    env = {k: v for k, v in TORCHRUN_ENV.items() if k != "MASTER_ADDR"}
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        discover(env, use_mpi=False)


@pytest.mark.parametrize("value,counts", [
    ("4", [4]), ("2(x3)", [2, 2, 2]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3]),
])
def test_parse_tasks_per_node(value, counts):
    assert parse_tasks_per_node(value) == counts


def test_parse_tasks_per_node_rejects_garbage():
    with pytest.raises(LaunchError, match=r"SLURM_TASKS_PER_NODE='2\(3\)'"):
        parse_tasks_per_node("2(3)")


@pytest.mark.parametrize("nodelist,host", [
    ("node1", "node1"), ("gpu[07-09,12],cpu1", "gpu07"), ("a,b", "a"),
    ("rack1-n[003-004]", "rack1-n003"),
])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_srun_env():
    info = discover(SRUN_ENV, use_mpi=False)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (5, 1, 7, 2)
    assert info.launcher == "srun" and info.node_rank == 2 and info.rendezvous == "tcp"
    assert info.master_addr == "gpu07"
    assert info.master_port == derived_port("1234.0")
    assert 15000 <= info.master_port < 32000
    assert info.slurm_step == "1234.0"   # what a failing rank asks Slurm to kill


def test_srun_env_last_node_and_other_forms():
    last = dict(SRUN_ENV, SLURM_PROCID="6", SLURM_LOCALID="0", SLURM_NODEID="3")
    assert discover(last, use_mpi=False).local_world_size == 1
    # Job-level list when the step's is missing; MASTER_* override the derived values.
    env = {k: v for k, v in SRUN_ENV.items() if k != "SLURM_STEP_TASKS_PER_NODE"}
    env.update(SLURM_TASKS_PER_NODE="3,2(x3)", MASTER_ADDR="10.1.1.1", MASTER_PORT="24000")
    info = discover(env, use_mpi=False)
    assert info.local_world_size == 2 and (info.master_addr, info.master_port) == ("10.1.1.1", 24000)
    env = {k: v for k, v in SRUN_ENV.items() if k != "SLURM_STEP_TASKS_PER_NODE"}
    env["SLURM_NTASKS_PER_NODE"] = "2"
    assert discover(env, use_mpi=False).local_world_size == 2


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
            "from tests.test_dist import SRUN_ENV; info = discover(SRUN_ENV, use_mpi=False); "
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


def test_srun_concurrent_steps_get_different_ports():
    a = discover(SRUN_ENV, use_mpi=False).master_port
    b = discover(dict(SRUN_ENV, SLURM_STEP_ID="1"), use_mpi=False).master_port
    assert a != b


@pytest.mark.parametrize("step", [None, "4294967291"])
def test_batch_script_shell_is_not_an_srun_rank(step):
    """sbatch's shell has SLURM_PROCID=0 and SLURM_NTASKS=N but is one process, not rank 0 of N."""
    env = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "9"}
    if step:
        env["SLURM_STEP_ID"] = step
    assert discover(env, use_mpi=False).launcher == "single"


def test_openmpi_env_one_node_uses_a_file_in_the_session_dir():
    info = discover(OMPI_ENV, use_mpi=False)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (1, 1, 2, 2)
    assert info.launcher == "mpi" and info.rendezvous == "file"
    assert info.store_path == "/tmp/ompi.vm.0/pid.5022/presto-rendezvous-2136997889"


def test_openmpi_env_several_nodes():
    env = dict(OMPI_ENV, OMPI_COMM_WORLD_SIZE="4")
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        discover(env, use_mpi=False)
    info = discover(dict(env, MASTER_ADDR="node1"), use_mpi=False)
    assert info.rendezvous == "tcp" and info.master_addr == "node1"
    assert info.master_port == derived_port("2136997889")


def test_mpich_env():
    info = discover(MPICH_ENV, use_mpi=False)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (1, 1, 2, 2)
    assert info.launcher == "mpi" and info.rendezvous == "tcp" and info.master_port == 23456
    env = {k: v for k, v in MPICH_ENV.items() if not k.startswith("MASTER")}
    with pytest.raises(LaunchError, match="mpi4py"):
        discover(env, use_mpi=False)


def test_innermost_launcher_wins():
    slurm_daemon = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2",
                    "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]",
                    "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_NNODES": "2"}
    # mpirun / hydra inside an allocation start their daemons with srun: ranks see both.
    assert discover({**slurm_daemon, **OMPI_ENV}, use_mpi=False).rank == 1
    hydra = discover({**slurm_daemon, **MPICH_ENV}, use_mpi=False)
    assert (hydra.rank, hydra.launcher) == (1, "mpi")
    # srun --mpi=pmi2 without mpi4py: PMI_RANK but no MPI_LOCALRANKID -> srun's variables.
    pmi2 = discover({**SRUN_ENV, "PMI_RANK": "5", "PMI_SIZE": "7"}, use_mpi=False)
    assert (pmi2.rank, pmi2.launcher, pmi2.local_world_size) == (5, "srun", 2)
    # torchrun started by srun, one agent per node (even with PMI there: MPI is not asked).
    assert discover({**slurm_daemon, **TORCHRUN_ENV}, use_mpi=False).launcher == "torchrun"
    info = discover({**slurm_daemon, **TORCHRUN_ENV, "PMI_RANK": "0", "PMI_SIZE": "2"})
    assert (info.launcher, info.rank) == ("torchrun", 3)


@pytest.mark.parametrize("env,names", [
    (dict(TORCHRUN_ENV, RANK="4"), ["RANK=4", "WORLD_SIZE=4"]),
    (dict(TORCHRUN_ENV, LOCAL_RANK="2"), ["LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"]),
    (dict(OMPI_ENV, OMPI_COMM_WORLD_RANK="2"), ["OMPI_COMM_WORLD_RANK=2", "OMPI_COMM_WORLD_SIZE=2"]),
    (dict(MPICH_ENV, PMI_SIZE="0"), ["PMI_SIZE=0"]),
    (dict(SRUN_ENV, SLURM_PROCID="7"), ["SLURM_PROCID=7", "SLURM_STEP_NUM_TASKS=7"]),
    (dict(TORCHRUN_ENV, WORLD_SIZE="four"), ["WORLD_SIZE='four'"]),
])
def test_inconsistent_env_names_the_variables(env, names):
    with pytest.raises(LaunchError) as e:
        discover(env, use_mpi=False)
    for name in names:
        assert name in str(e.value)


def test_launch_info_validates_itself():
    with pytest.raises(LaunchError, match="rank=2"):
        LaunchInfo(2, 0, 2, 1, "mpi")
    with pytest.raises(LaunchError, match="launcher"):
        LaunchInfo(0, 0, 1, 1, "pbs")


def test_mpi_family_and_vendor_rules():
    assert mpi_launcher_family(OMPI_ENV) == "openmpi"
    assert mpi_launcher_family(MPICH_ENV) == "pmi"
    assert mpi_launcher_family({"PMIX_RANK": "0"}) == "pmix"
    assert mpi_launcher_family(TORCHRUN_ENV) is None
    assert _vendor_fits("MPICH", "pmi") and not _vendor_fits("MPICH", "openmpi")
    assert _vendor_fits("Open MPI", "openmpi") and not _vendor_fits("Open MPI", "pmi")
    assert not _vendor_fits("MPICH", "pmix")


def test_bad_presto_mpi_value():
    with pytest.raises(LaunchError, match="PRESTO_MPI"):
        discover({"PRESTO_MPI": "maybe"})


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
# helpers as a world of one, in-process


def test_helpers_before_init_act_as_a_world_of_one():
    import torch
    from runtime.launch import dist
    t = torch.ones(3)
    assert dist.all_reduce_sum(t) is t and t.tolist() == [1, 1, 1]
    assert dist.broadcast_object({"a": 1}) == {"a": 1}
    assert dist.all_gather_object(5) == [5]
    dist.barrier()
    assert len(dist.check_same_on_all_ranks("config", {"a": 1})) == 64
    assert dist._ranges([1, 2, 3, 7, 9, 10]) == "1-3,7,9-10"


# ---------------------------------------------------------------------------------------------
# real launchers (slow: each test starts ranks)


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


@pytest.mark.timeout(60)
def test_single_process_joins_a_world_of_one():
    proc = subprocess.run([sys.executable, str(WORKER), "allreduce"], env=clean_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    (r,) = [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines()
            if line.startswith("RESULT ")]
    assert (r["world_size"], r["launcher"], r["rendezvous"], r["sum"]) == (1, "single", "local", 1.0)


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
def test_a_hung_rank_times_out_the_others():
    """Rank 1 stops answering: rank 0's all-reduce times out (5 s) and MPI_Abort ends both."""
    rc, out, elapsed, _ = _launch("mpiexec", "hang", timeout_s=5)
    assert rc != 0, out[-4000:]
    assert "[rank 0]" in out and "Timed out" in out, out[-4000:]
    assert elapsed < 30, f"took {elapsed:.1f} s"


def test_device_binding_errors(monkeypatch):
    import torch
    from runtime.launch import dist
    info = LaunchInfo(3, 1, 4, 2, "mpi", rendezvous="mpi")
    assert dist._bind_device(info, "cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dist._bind_device(info, "auto") == torch.device("cpu")
    with pytest.raises(dist.DistError, match="rank 3: device 'cuda'"):
        dist._bind_device(info, "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    bound = []
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    # Each task sees only its own GPU (srun --gpus-per-task=1): local rank 1 takes cuda:0.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert dist._bind_device(info, "auto") == torch.device("cuda", 0) and bound == [0]
    # Every task sees the node's GPUs: local rank i takes cuda:i.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert dist._bind_device(info, "cuda") == torch.device("cuda", 1) and bound[-1] == 1
    # 4 ranks on a node that shows each of them 2 GPUs: which one is ambiguous.
    crowded = LaunchInfo(3, 3, 8, 4, "mpi", rendezvous="mpi")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(dist.DistError, match=r"rank 3 \(local rank 3 of 4.*sees 2 CUDA devices"):
        dist._bind_device(crowded, "auto")
    with pytest.raises(dist.DistError, match=r"needs cuda:5, but this node shows 2"):
        dist._bind_device(info, "cuda:5")
    with pytest.raises(dist.DistError, match="only cpu and cuda"):
        dist._bind_device(info, "meta")
