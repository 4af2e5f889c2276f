"""The launchers' table (submission/launchers.py): one row per system.launcher - its argv, its
fail-fast checks and their messages, the signal it is sent, whether this process is a rank,
whether it folds the ranks' exit status, and its report of the rank that died first, read from
real launcher output. run_and_time.sh's use of it is tested in tests/e2e/test_run_and_time.py; its
command line in tests/integration/test_launchers_integration.py."""
from __future__ import annotations

import json
import os
from typing import get_args

import pytest

from runtime.choices import Launcher
from submission import launchers
from submission.launchers import LAUNCHERS, Launch, LauncherError, spec_for

RANK = ("/venv/bin/python", "-m", "submission.train", "--config", "my dir/c.toml")


def argv(name: str, nodes: int = 1, ranks: int = 2, command=RANK, **env) -> list[str]:
    return LAUNCHERS[name].argv(Launch(nodes, ranks, tuple(command), env, "c.toml"))


def test_the_rows_are_exactly_the_config_choices():
    """runtime.choices.Launcher declares the names; the table has one row for each."""
    assert list(LAUNCHERS) == list(get_args(Launcher))
    assert all(name == spec.name for name, spec in LAUNCHERS.items())


def test_mpiexec(bindir):
    mpiexec = str(bindir / "mpiexec")
    assert argv("mpiexec", ranks=2, MPIEXEC=mpiexec) == [mpiexec, "-n", "2", *RANK]
    hosts = "/etc/my hosts"
    assert argv("mpiexec", nodes=3, ranks=4, MPIEXEC=mpiexec, HOSTFILE=hosts) == \
        [mpiexec, "-n", "12", "-f", hosts, *RANK]
    # A relative HOSTFILE is the working directory's.
    assert argv("mpiexec", nodes=2, MPIEXEC=mpiexec, HOSTFILE="h")[4] == \
        os.path.join(os.getcwd(), "h")
    # Without MPIEXEC: the one beside PYTHON (the venv's: the MPICH its mpi4py loads).
    python = str(bindir / "python")
    assert argv("mpiexec", command=(python, *RANK[1:]))[0] == mpiexec


def test_mpiexec_errors(bindir):
    with pytest.raises(LauncherError) as e:
        argv("mpiexec", nodes=2, MPIEXEC=str(bindir / "mpiexec"))
    assert str(e.value) == "system.nodes=2 needs HOSTFILE (one host per line) for mpiexec"
    with pytest.raises(LauncherError, match="needs HOSTFILE"):   # empty is unset, as ${:?}
        argv("mpiexec", nodes=2, MPIEXEC=str(bindir / "mpiexec"), HOSTFILE="")
    with pytest.raises(LauncherError) as e:
        argv("mpiexec", MPIEXEC="/no/such/mpiexec")
    assert str(e.value) == "MPIEXEC '/no/such/mpiexec' not found (set MPIEXEC)"


@pytest.mark.parametrize("euid", [0, 1000])
def test_mpirun(bindir, monkeypatch, euid):
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    mpirun = str(bindir / "mpirun")
    root = ["--allow-run-as-root"] if euid == 0 else []   # Open MPI refuses root without it
    assert argv("mpirun", ranks=4, MPIRUN=mpirun) == \
        [mpirun, "-n", "4", "--oversubscribe", *root, *RANK]
    assert argv("mpirun", nodes=2, ranks=4, MPIRUN=mpirun, HOSTFILE="/h") == \
        [mpirun, "-n", "8", "--oversubscribe", *root, "--hostfile", "/h", *RANK]


def test_mpirun_errors(bindir):
    with pytest.raises(LauncherError) as e:
        argv("mpirun", nodes=2, MPIRUN=str(bindir / "mpirun"))
    assert str(e.value) == "system.nodes=2 needs HOSTFILE (one host per line) for mpirun"
    with pytest.raises(LauncherError) as e:
        argv("mpirun", MPIRUN="no-such-mpirun")
    assert str(e.value) == "MPIRUN 'no-such-mpirun' not found (set MPIRUN)"


def test_srun(bindir):
    srun = str(bindir / "srun")
    # --kill-on-bad-exit: a task that dies (even before the runtime's guard) ends the step
    assert argv("srun", nodes=2, ranks=4, SRUN=srun) == \
        [srun, "--nodes=2", "--ntasks-per-node=4", "--kill-on-bad-exit=1", *RANK]
    assert argv("srun", ranks=2, SRUN=srun)[1:3] == ["--nodes=1", "--ntasks-per-node=2"]
    with pytest.raises(LauncherError) as e:
        argv("srun", SRUN="/no/srun")
    assert str(e.value) == "SRUN '/no/srun' not found: launcher srun needs Slurm"


def test_srun_inside_a_job_step_is_the_rank():
    """run.sub's `srun ... run_and_time.sh`: every task runs the script; it is one rank."""
    step = {"SLURM_PROCID": "3", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"}
    assert argv("srun", nodes=2, **step) == list(RANK)   # no srun needed, none looked for
    assert LAUNCHERS["srun"].self_rank(step) == 3
    for name in ("mpiexec", "mpirun", "torchrun"):   # they start their ranks themselves
        assert LAUNCHERS[name].self_rank(step) is None
    assert LAUNCHERS["srun"].self_rank({}) is None
    # An sbatch script's own shell has SLURM_PROCID=0 but is no step's task: it launches.
    batch = {"SLURM_PROCID": "0", "SLURM_JOB_ID": "77"}
    assert LAUNCHERS["srun"].self_rank(batch) is None
    assert LAUNCHERS["srun"].self_rank(dict(batch, SLURM_STEP_ID="4294967291")) is None


def test_torchrun(bindir):
    assert argv("torchrun", ranks=2) == [
        RANK[0], "-m", "submission.torchrun", "--nnodes=1", "--nproc_per_node=2",
        "--standalone", *RANK[1:]]   # torchrun starts the interpreter: PYTHON dropped
    torchrun = str(bindir / "torchrun")
    assert argv("torchrun", nodes=2, ranks=8, TORCHRUN=torchrun, MASTER_ADDR="node0") == [
        torchrun, "--nnodes=2", "--nproc_per_node=8", "--rdzv_backend=c10d",
        "--rdzv_endpoint=node0:29500", *RANK[1:]]
    assert "--rdzv_endpoint=node0:1234" in argv("torchrun", nodes=2, MASTER_ADDR="node0",
                                                 MASTER_PORT="1234")
    with pytest.raises(LauncherError) as e:
        argv("torchrun", nodes=2, MASTER_PORT="1234")
    assert str(e.value) == ("system.nodes=2 needs MASTER_ADDR (the rendezvous host) for "
                            "torchrun")
    with pytest.raises(LauncherError) as e:   # a TORCHRUN that is not there: said, not run
        argv("torchrun", TORCHRUN="/no/such/torchrun")
    assert str(e.value) == "TORCHRUN '/no/such/torchrun' not found (set TORCHRUN)"


def test_where_the_ranks_run():
    """Whether a launch runs ranks on this host: what they need of it is checked here first
    (submission.preflight)."""
    cases = (("mpiexec", 1, {}, True), ("mpirun", 1, {}, True), ("mpiexec", 2, {}, False),
             ("torchrun", 2, {}, True),   # each node's agent starts that node's ranks
             ("srun", 1, {"SLURM_JOB_ID": "7"}, False))   # salloc's shell: a login node
    for name, nodes, env, expect in cases:
        assert launchers.ranks_run_here(LAUNCHERS[name], Launch(nodes, 2, RANK, env)) == \
            expect, (name, nodes)
    step = {"SLURM_PROCID": "1", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"}
    assert launchers.ranks_run_here(LAUNCHERS["srun"], Launch(2, 4, RANK, step))


def test_signal_fold_and_node_rules():
    # mpiexec, mpirun and srun forward USR1 to every rank; torchrun's agent takes TERM and
    # gives its workers 30 s before SIGKILL.
    assert {n: s.forward_signal for n, s in LAUNCHERS.items()} == {
        "mpiexec": "USR1", "mpirun": "USR1", "srun": "USR1", "torchrun": "TERM"}
    # torchrun reports 1 for any failed worker, whatever status the worker exited with.
    assert [n for n, s in LAUNCHERS.items() if s.folds_exit_status] == ["torchrun"]
    # torchrun starts its own node's workers only (one agent per node).
    assert [n for n, s in LAUNCHERS.items() if not s.starts_every_node] == ["torchrun"]


def test_unknown_launcher():
    with pytest.raises(LauncherError) as e:
        spec_for("ssh", "cfg.toml")
    assert str(e.value) == ("system.launcher='ssh' in 'cfg.toml' is not one of "
                            + " | ".join(LAUNCHERS))   # "mpiexec | mpirun | srun | torchrun"


# ------------------------------------------------------------------ the launchers' reports
# Real output of two ranks, rank 1 killed by SIGKILL: the venv's mpiexec (MPICH 5.0 hydra),
# Debian's mpirun.openmpi 4.1.4, srun of Slurm 22.05 (tests/slurm_cluster.py) and torchrun of
# torch 2.13 (here in the form of one failed worker: torch's template writes
# "<NO_OTHER_FAILURES>" under "Failures:").

HYDRA = """
===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 11016 RUNNING AT vm
=   EXIT CODE: 9
=   CLEANING UP REMAINING PROCESSES
=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
===================================================================================
YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)
"""
OPENMPI = """--------------------------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
--------------------------------------------------------------------------
--------------------------------------------------------------------------
mpirun.openmpi noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed).
--------------------------------------------------------------------------
"""
SRUN = """srun: error: vm: task 1: Killed
srun: launch/slurm: _step_signal: Terminating StepId=1.0
slurmstepd-vm: error: *** STEP 1.0 ON vm CANCELLED AT 2026-11-24T09:58:23 ***
srun: error: vm: task 0: Terminated
srun: Force Terminated StepId=1.0
"""
TORCHRUN_ONE = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
=======================================================
/repo/submission/train.py FAILED
-------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-24_09:54:08
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 11051)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 11051
=======================================================
"""
# torchrun's whole report: the worker it stopped after the root cause (SIGTERM) comes first.
TORCHRUN_TWO = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
=======================================================
/repo/submission/train.py FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-24_09:54:08
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 11050)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 11050
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-24_09:54:08
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 11051)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 11051
=======================================================
"""
RECORDS = {0: {"rank": 0, "pid": 11015}, 1: {"rank": 1, "pid": 11016}}
KILLED = "killed by SIGKILL (kill -9, the OOM killer or a lost node)"


@pytest.mark.parametrize("name,text,phrase", [
    ("mpiexec", HYDRA, f"rank 1 (pid 11016 on vm) ended first: {KILLED}"),
    ("mpirun", OPENMPI, f"rank 1 (pid 11016 on vm) ended first: {KILLED}"),
    ("srun", SRUN, "rank 1 (task on vm) ended first: Killed"),
    ("torchrun", TORCHRUN_ONE, f"rank 1 (pid 11051) ended first: {KILLED}"),
    ("torchrun", TORCHRUN_TWO, f"rank 1 (pid 11051) ended first: {KILLED}"),
])
def test_each_launcher_reads_its_own_report(name, text, phrase):
    assert LAUNCHERS[name].culprit(text, RECORDS) == phrase
    others = [n for n in LAUNCHERS if n != name]
    assert all(LAUNCHERS[n].culprit(text, RECORDS) is None for n in others), others
    assert LAUNCHERS[name].culprit("all ranks finished\n", RECORDS) is None


def test_pids_without_a_record():
    assert LAUNCHERS["mpiexec"].culprit(HYDRA, {}) == \
        f"a rank (pid 11016 on vm) ended first: {KILLED}"
    # Open MPI's "PID 0" stays when the rank wrote no record to say better.
    assert LAUNCHERS["mpirun"].culprit(OPENMPI, {}) == f"rank 1 (pid 0 on vm) ended first: {KILLED}"


def test_rank_status_asks_the_launchers_row():
    from submission.rank_status import launcher_culprit
    assert launcher_culprit("noise\n" + SRUN, RECORDS) == "rank 1 (task on vm) ended first: Killed"
    assert launcher_culprit("noise\n" + SRUN, RECORDS, "srun") == \
        "rank 1 (task on vm) ended first: Killed"
    # mpiexec over several nodes of an allocation starts its daemons with srun: srun's "task 1"
    # is a daemon there, not rank 1.
    assert launcher_culprit(SRUN, RECORDS, "mpiexec") is None
    assert launcher_culprit(SRUN + HYDRA, RECORDS, "mpiexec").startswith("rank 1 (pid 11016")
    assert launcher_culprit("nothing to see", RECORDS) is None


def test_a_rank_the_launcher_ended_after_another_failed_is_said_so_and_after_it(tmp_path):
    """Rank 1 raised (exit 2, its record says why); rank 0 was ended by the launcher before it
    could write its end: the summary names rank 1 first, with the first line of its reason,
    then says rank 0 stopped after rank 1 failed - not "killed (SIGKILL, OOM ...)", which
    stays for a rank gone while no rank recorded a failure."""
    from submission import rank_status
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    started = {"world_size": 2, "host": "vm", "started": 1.0, "step": 15}
    (ranks / "rank_00000.json").write_text(json.dumps({"rank": 0, "pid": 10, **started}))
    (ranks / "rank_00001.json").write_text(json.dumps({
        "rank": 1, "pid": 11, **started, "exit": 2, "state": "failed",
        "reason": "CheckpointError: optimizer_shard_00001.pt: holds shard 0\nsecond line"}))
    code, lines = rank_status.summary(tmp_path, 2, None)
    assert code == 2
    assert lines[0] == ("rank 1 (pid 11 on vm): exit 2, failed after step 15: CheckpointError: "
                        "optimizer_shard_00001.pt: holds shard 0")
    assert lines[1].startswith("rank 0 (pid 10 on vm): stopped after rank 1 failed (the "
                               "launcher ended it"), lines
    assert not any("SIGKILL" in line for line in lines), lines
    (ranks / "rank_00001.json").write_text(json.dumps({"rank": 1, "pid": 11, **started}))
    code, lines = rank_status.summary(tmp_path, 9, None)
    assert code == 3 and lines[0].startswith("which rank ended first cannot be told"), lines
    assert "killed (SIGKILL, OOM, lost node)" in lines[1], lines
    # a full disk: neither rank could finish its record, rank 0 printed its failure
    log = tmp_path / "launcher.log"
    log.write_text("[rank 0] LogWriteError: cannot write metrics.jsonl (No space left on "
                   "device) (its traceback: /tmp/presto_rank0_x.log)\n"
                   "[rank 0] last completed step 15 (960 samples)\nAbort(3) on node 0\n")
    code, lines = rank_status.summary(tmp_path, 3, log)
    assert code == 3 and lines[0] == (
        "rank 0 (pid 10 on vm): failed after step 15 (its record could not be finished; it "
        "printed): LogWriteError: cannot write metrics.jsonl (No space left on device) (its "
        "traceback: /tmp/presto_rank0_x.log)"), lines
    assert lines[1].startswith("rank 1 (pid 11 on vm): stopped after rank 0 failed"), lines


def test_a_torchrun_stop_ends_in_one_line_with_the_signals_status(monkeypatch, capsys):
    """run_and_time.sh's torchrun (python -m submission.torchrun): the agent's SignalException
    after it passed a stop on to its workers is one line and status 128 + 15, not torchrun's
    traceback; anything else is torchrun's own."""
    import signal
    import torch.distributed.run as torchrun_module
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from submission import torchrun

    def stopped(args):
        assert args == ["--standalone", "-m", "submission.train"]
        raise SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)
    monkeypatch.setattr(torchrun_module, "main", stopped)
    assert torchrun.main(["--standalone", "-m", "submission.train"]) == 128 + 15
    err = capsys.readouterr().err
    assert err.startswith("torchrun: got SIGTERM: passed it on to the workers") and \
        err.count("\n") == 1 and "Traceback" not in err, err
    monkeypatch.setattr(torchrun_module, "main", lambda args: None)
    assert torchrun.main(["--standalone"]) == 0
    monkeypatch.setattr(torchrun_module, "main", lambda args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        torchrun.main([])


def test_torchrun_ends_a_budget_run_quietly_and_a_failure_without_its_traceback(
        monkeypatch, capsys):
    """Every worker ending 1 - the budget spent, "target not reached" - made the agent raise
    ChildFailedError, a traceback after every short torchrun run (newcomer walkthrough): now
    no output (run_and_time.sh says "stopped at the step budget"), status 1. Another failure
    is torchrun's own report - which worker, its exit code, the root cause that rank_status
    reads - without the traceback."""
    import torch.distributed.run as torchrun_module
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
    from submission import torchrun

    def failing(codes):
        def main(args):
            raise ChildFailedError("/repo/submission/train.py", {
                rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code,
                                     error_file="<N/A>") for rank, code in enumerate(codes)})
        return main
    monkeypatch.setattr(torchrun_module, "main", failing([1, 1]))
    assert torchrun.main(["--standalone", "-m", "submission.train"]) == 1
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(torchrun_module, "main", failing([1, -9]))
    assert torchrun.main(["--standalone", "-m", "submission.train"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ")
    assert "Traceback" not in err and "/repo/submission/train.py FAILED" in err, err
    assert LAUNCHERS["torchrun"].culprit(err, {}) in (
        "rank 1 (pid 101) ended first: killed by SIGKILL (kill -9, the OOM killer or a lost "
        "node)", "rank 0 (pid 100) ended first: exit status 1")


def test_a_run_its_budget_ended_is_said_so(tmp_path):
    """Exit 1 - the budget spent, the target not reached - is a normal end (a smoke, profile
    or tuning run): one line that says which budget, the steps and samples and the last
    evaluation against the target, instead of a failure's summary."""
    import json
    from submission.rank_status import summary
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    for r in (0, 1):
        (ranks / f"rank_0000{r}.json").write_text(json.dumps({
            "rank": r, "world_size": 2, "pid": 10 + r, "host": "vm", "step": 25,
            "samples": 400, "exit": 1, "state": "finished", "reason": "budget",
            "started": 0.0}))
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 25, "samples": 400,
                                                       "eval_accuracy": 0.03125}))
    assert summary(tmp_path, 1, None, launcher="torchrun", budget=(25, 0, 0.72)) == (1, [
        "stopped at the step budget: 25 steps (train.max_steps), 400 samples, no target: the "
        "last evaluation's accuracy 0.0312 is short of train.target_mlm_accuracy 0.72 (exit 1, "
        "target not reached - not a failure; no RESULT line)"])
    code, (line,) = summary(tmp_path, 1, None, budget=(1000, 400, 0.72))
    assert line.startswith("stopped at the sample budget: 400 samples "
                           "(train.max_samples_termination), 25 steps, no target"), line


def test_a_folding_launchers_failure_is_never_target_not_reached():
    """torchrun exits 1 for any failed worker: with no rank record to say how (a rank that
    failed before writing one), the job's status is 3, not 1 (target not reached)."""
    from submission.rank_status import job_exit_code
    assert job_exit_code({}, None, 1, "torchrun") == 3
    assert job_exit_code({}, None, 0, "torchrun") == 0
    assert job_exit_code({}, None, 1, "mpiexec") == 1   # hydra passes a rank's status on
    assert job_exit_code({}, None, 2, None) == 2
    # With records the ranks speak for themselves, whatever the launcher folded.
    records = {r: {"rank": r, "world_size": 2, "exit": 2, "state": "failed"} for r in (0, 1)}
    assert job_exit_code(records, None, 1, "torchrun") == 2


# ------------------------------------------------------------------ the command line


def test_describe_names_every_launcher_and_variable():
    text = launchers.describe()
    for spec in LAUNCHERS.values():
        assert f"  {spec.name} " in text
        for variable, _ in spec.variables:
            assert variable in text


def test_rank_status_command_line_takes_the_launcher(tmp_path, capsys):
    """run_and_time.sh's call after a failed launch (no rank wrote a record here)."""
    from submission import rank_status
    assert rank_status.main([str(tmp_path), "--rc", "1", "--launcher", "torchrun"]) == 0
    assert capsys.readouterr().out == "3\n"
    assert rank_status.main([str(tmp_path), "--rc", "1"]) == 0
    assert capsys.readouterr().out == "1\n"


def test_discovery_names_each_launcher():
    """runtime.launch.env (which never imports submission) names every system.launcher as
    discovery sees it: both MPI launchers are "mpi" from inside a rank."""
    from runtime.launch.env import DISCOVERED_AS, DISCOVERED_LAUNCHERS
    assert list(DISCOVERED_AS) == list(LAUNCHERS)
    assert set(DISCOVERED_AS.values()) <= set(DISCOVERED_LAUNCHERS)
    assert {n: DISCOVERED_AS[n] for n in ("srun", "torchrun")} == {"srun": "srun",
                                                                   "torchrun": "torchrun"}
