"""Stopping a run as users do, and two runs reaching for one directory, through run_and_time.sh
with real launchers (MPICH's mpiexec, Open MPI's mpirun, torchrun, and srun on the private
Slurm cluster of tests/slurm_cluster.py) on real shards:

* Ctrl-C twice and a closed terminal - SIGINT, SIGINT and SIGHUP to the script's whole process
  group, which the test creates as a terminal would - stop a run exactly like one SIGTERM:
  every rank checkpoints at its next logging point and exits 4, presto_interrupted is logged,
  nothing is left running, and the rerun continues bit for bit (mpiexec, the default: each
  alone; mpirun, torchrun and srun: all three in one run);
* a SIGTERM right after the launch, while the ranks still start: exit 4, no launcher crash;
* SIGKILL to run_and_time.sh alone: the ranks still stop (their launcher gets the stop request
  as its parent-death signal) well within 60 s, and the rerun continues bit for bit;
* Ctrl-C to ``run_and_time.sh | tee LOG`` (the user's tee dies of the INT): a stop like any
  other; and a reader that goes away (``| head``) ends nothing: the run goes on to its end;
* a second run_and_time.sh on the RUN_DIR of a run launched a moment ago, and a second run
  with the train.checkpoint_dir of a live run: refused with exit 2 naming the live run, before
  anything is written; it reports itself, never the live run's ranks.

The unit side of the same rules (the launcher gets one stop request, the locks) is
tests/e2e/test_run_and_time_signals.py and test_run_and_time_dirs.py, with stub launchers.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.launch import ROOT, default_stop_signals, needs_mpiexec, needs_torchrun
from tests.support.mllog import mllog_events
from tests.support.runs import (CPU_CONFIG, SEED, evals, finish, ranks_left, run, start, steps,
                                wait_for_step)
from tests.support.runs import resume_overrides as overrides

pytestmark = [pytest.mark.slow, needs_mpiexec]

OPENMPI = shutil.which("mpirun.openmpi")
needs_openmpi = pytest.mark.skipif(OPENMPI is None, reason="Open MPI's mpirun.openmpi missing "
                                   "(apt-get install openmpi-bin)")
LAUNCHERS = {"mpiexec": (), "mpirun": (needs_openmpi,), "torchrun": (needs_torchrun,)}


def launcher_args(launcher: str) -> tuple[dict, dict]:
    """(overrides, environment) of a run under ``launcher``."""
    env = {"MPIRUN": OPENMPI} if launcher == "mpirun" and OPENMPI else {}
    return {"system.launcher": f'"{launcher}"'}, env


def records(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "ranks").glob("rank_*.json"))]


def assert_stopped_like_sigterm(run_dir: Path, out: str, checkpoints: Path | None = None) -> int:
    """Every rank exited 4 at one step after checkpointing there (in ``checkpoints``, default
    the run directory's), the MLPerf log ends with presto_interrupted, nothing runs: the step
    it stopped at."""
    status = records(run_dir)
    assert [s["exit"] for s in status] == [4, 4], status
    assert len({s["step"] for s in status}) == 1, status
    stopped = status[0]["step"]
    ckpt = checkpoints or run_dir / "checkpoints"
    assert (ckpt / f"step_{stopped:08d}" / "checkpoint.json").is_file()
    events = mllog_events(run_dir / "mlperf_bert.log")
    assert events[-1]["key"] == "presto_interrupted" and "run_stop" not in [e["key"] for e in events]
    assert "stopping on signal" in out, out[-3000:]
    deadline = time.time() + 10
    while ranks_left(run_dir) and time.time() < deadline:
        time.sleep(0.2)
    assert not ranks_left(run_dir)
    return stopped


def assert_rerun_continues_exactly(run_dir: Path, small_dataset, reference_run, stopped: int):
    rc, out, err = run(run_dir, overrides(small_dataset))   # the same command again (mpiexec)
    assert rc == 1, out[-3000:] + err[-3000:]
    resumed = next(e for e in mllog_events(run_dir / "mlperf_bert.log")
                   if e["key"] == "presto_resumed")["metadata"]
    assert resumed["step"] == stopped
    assert steps(run_dir) == steps(reference_run.dir)        # every step, bit for bit
    assert evals(run_dir) == evals(reference_run.dir)


def signal_group(proc: subprocess.Popen, sigs: str) -> None:
    """``sigs`` ("INT INT", "HUP") to the script's process group, 0.3 s apart: what a
    terminal sends on Ctrl-C, Ctrl-C, and when it is closed."""
    for name in sigs.split():
        os.killpg(proc.pid, getattr(signal, f"SIG{name}"))
        time.sleep(0.3)


# mpiexec, the default launcher: each probe alone, and the rerun continues bit for bit (after
# Ctrl-C twice; the rerun does not care how the run was stopped). The other launchers: Ctrl-C
# twice, then the terminal closed, in one run (each alone is a stub test and a bench.faults row).
STOPS = [pytest.param("mpiexec", "INT INT", id="mpiexec-INT-INT"),
         pytest.param("mpiexec", "HUP", id="mpiexec-HUP"),
         pytest.param("mpirun", "INT INT HUP", id="mpirun-INT-INT-HUP", marks=needs_openmpi),
         pytest.param("torchrun", "INT INT HUP", id="torchrun-INT-INT-HUP",
                      marks=needs_torchrun)]


@pytest.mark.parametrize("launcher,sigs", STOPS)
def test_ctrl_c_twice_and_a_closed_terminal_stop_a_run_like_one_sigterm(
        small_dataset, reference_run, tmp_path, launcher, sigs):
    run_dir = tmp_path / "run"
    values, env = launcher_args(launcher)
    proc = start(run_dir, overrides(small_dataset, **values), **env)
    wait_for_step(run_dir, 6, proc)
    signal_group(proc, sigs)
    rc, out, err = finish(proc)
    assert rc == 4, out[-3000:] + err[-3000:]
    assert f"got SIG{sigs.split()[0]}" in err
    stopped = assert_stopped_like_sigterm(run_dir, out + err)
    if sigs == "INT INT":
        assert_rerun_continues_exactly(run_dir, small_dataset, reference_run, stopped)
    if launcher == "torchrun":   # resumed under torchrun with its budget spent: a normal end
        values["train.max_steps"] = stopped   # (the rerun only evaluates: cheap)
        rc, out, err = run(run_dir, overrides(small_dataset, **values), **env)
        assert rc == 1, out[-3000:] + err[-3000:]
        for noise in ("ChildFailedError", "Traceback", "FAILED"):
            assert noise not in out + err, out[-3000:] + err[-3000:]
        assert f"run_and_time.sh: stopped at the step budget: {stopped} steps " \
               f"(train.max_steps), {stopped * 16} samples, no target" in err, err[-3000:]


def test_srun_ctrl_c_twice_and_a_closed_terminal_stop_a_run_like_one_sigterm(
        slurm_cluster, small_dataset, tmp_path):
    """srun outside a job (from a login shell): srun aborts the step on a second SIGINT
    within a second; run_and_time.sh passes it one USR1."""
    run_dir = tmp_path / "run"
    env = slurm_cluster.client_env()
    proc = start(run_dir, overrides(small_dataset, **{"system.launcher": '"srun"'}),
                 **{k: env[k] for k in ("PATH", "SLURM_CONF")})
    wait_for_step(run_dir, 6, proc)
    signal_group(proc, "INT INT HUP")
    rc, out, err = finish(proc)
    assert rc == 4, out[-3000:] + err[-3000:]
    assert_stopped_like_sigterm(run_dir, out + err)


@pytest.mark.parametrize("launcher", [pytest.param(n, marks=m) for n, m in LAUNCHERS.items()])
def test_a_sigterm_while_the_ranks_start_stops_the_run_with_4_and_no_launcher_crash(
        small_dataset, tmp_path, launcher):
    """TERM 50 ms after the launch line: MPICH's mpiexec once reported "BAD TERMINATION ...
    Segmentation fault" for a rank that got the stop signal before its handlers were in, and
    the run exited 3. Now the request waits until the ranks can take it."""
    run_dir = tmp_path / "run"
    values, env = launcher_args(launcher)
    proc = start(run_dir, overrides(small_dataset, **values), **env)
    seen = []
    while proc.poll() is None:
        line = proc.stderr.readline()
        seen.append(line)
        if "launching:" in line or not line:
            break
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    rc, out, err = finish(proc)
    err = "".join(seen) + err
    assert rc == 4, out[-3000:] + err[-3000:]
    for crash in ("BAD TERMINATION", "Segmentation fault", "exited on signal"):
        assert crash not in out + err, out[-3000:] + err[-3000:]
    assert_stopped_like_sigterm(run_dir, out + err)


def test_sigkill_to_run_and_time_stops_the_ranks_and_the_rerun_continues(
        small_dataset, reference_run, tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, overrides(small_dataset))
    wait_for_step(run_dir, 6, proc)
    os.kill(proc.pid, signal.SIGKILL)   # run_and_time.sh alone: it can pass nothing on
    killed = time.time()
    finish(proc)   # its output pipes close when the launcher's do
    while ranks_left(run_dir) and time.time() - killed < 60:
        time.sleep(0.2)
    assert not ranks_left(run_dir), "the ranks outlived run_and_time.sh by 60 s"
    out = (run_dir / "launcher.log").read_text()
    stopped = assert_stopped_like_sigterm(run_dir, out)
    assert_rerun_continues_exactly(run_dir, small_dataset, reference_run, stopped)


def test_ctrl_c_to_a_run_piped_to_tee_stops_it_and_a_rerun_whose_reader_goes_away_finishes(
        small_dataset, reference_run, tmp_path):
    """``run_and_time.sh | tee LOG`` in a terminal, Ctrl-C: the user's tee dies of the INT,
    and the script's own tees, mpiexec and the ranks once died of SIGPIPE at their next line
    (exit 141, no checkpoint, the rerun refused). Now it is a stop like any other (exit 4, a
    checkpoint, the summary). The rerun's reader goes away after its first step line (as
    ``| head -n 2`` does): the run goes on to its end, every line in launcher.log, and
    continues the stopped run bit for bit (it once died of SIGPIPE, its steps since the last
    checkpoint lost)."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, CONFIG=str(CPU_CONFIG), SEED=SEED, RUN_DIR=str(run_dir))
    piped = subprocess.Popen(
        ["bash", "-c", f'"$0" -- "$@" | tee {tmp_path}/tee.log; exit "${{PIPESTATUS[0]}}"',
         str(ROOT / "run_and_time.sh"), *overrides(small_dataset)], cwd=ROOT, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=default_stop_signals)
    wait_for_step(run_dir, 6, piped)
    signal_group(piped, "INT")   # to the script and the user's tee
    rc, _, err = finish(piped)
    assert rc == 4, err[-3000:]
    assert "stopped by a signal: " in err and "exit status 4 (stopped by a signal)" in err, err
    stopped = assert_stopped_like_sigterm(run_dir, (run_dir / "launcher.log").read_text())

    rerun = start(run_dir, overrides(small_dataset))
    for line in rerun.stdout:
        if line.startswith("step "):
            break
    rerun.stdout.close()   # the reader is gone: every later line to stdout fails (EPIPE)
    err = rerun.stderr.read()
    assert rerun.wait(timeout=240) == 1, err[-3000:]   # the step budget ended it, as planned
    resumed = next(e for e in mllog_events(run_dir / "mlperf_bert.log")
                   if e["key"] == "presto_resumed")["metadata"]
    assert resumed["step"] == stopped
    assert steps(run_dir) == steps(reference_run.dir) and evals(run_dir) == evals(
        reference_run.dir)
    assert "mllog log:" in (run_dir / "launcher.log").read_text()   # its very last lines


def test_a_second_run_on_a_run_directory_just_launched_is_refused_and_touches_nothing(
        small_dataset, tmp_path):
    """The second run_and_time.sh comes before any rank of the first could take a lock (rank 0
    took it about 4 s after the launch; the second run then exited 3, wrote into the first's
    launcher.log and reported the first run's ranks as SIGKILLed)."""
    run_dir = tmp_path / "run"
    first = start(run_dir, overrides(small_dataset))
    deadline = time.time() + 60
    while not (run_dir / "launcher.log").exists() and time.time() < deadline:
        time.sleep(0.02)
    second = start(run_dir, overrides(small_dataset))
    rc, out, err = finish(second)
    assert rc == 2, out[-3000:] + err[-3000:]
    assert f"is in use by another run (run_and_time.sh pid {first.pid} on " in err, err[-3000:]
    assert "rank 0 (pid" not in err and "rank 1 (pid" not in err   # it reports itself only
    assert "STARTING TIMING RUN" not in out
    wait_for_step(run_dir, 6, first)
    first.send_signal(signal.SIGTERM)
    rc, out, err = finish(first)
    assert rc == 4, out[-3000:] + err[-3000:]
    assert_stopped_like_sigterm(run_dir, out + err)
    assert "in use by another run" not in (run_dir / "launcher.log").read_text()


def test_two_runs_cannot_share_a_checkpoint_directory(small_dataset, tmp_path):
    """A fresh train.checkpoint_dir given to two runs started together (the second with
    another seed, in another run directory): the second is refused (exit 2, naming the first's
    run directory) before anything is written, and the directory stays the first's (once, the
    first run reported four checkpoints that were all the second's)."""
    ckpt, run_a, run_b = tmp_path / "ckpt", tmp_path / "a", tmp_path / "b"
    extra = overrides(small_dataset, **{"train.checkpoint_dir": f'"{ckpt}"'})
    first = start(run_a, extra)
    deadline = time.time() + 60
    while not (run_a / "launcher.log").exists() and time.time() < deadline:
        time.sleep(0.02)
    rc, out, err = run(run_b, [*extra, "train.seed=8"])
    assert rc == 2, out[-3000:] + err[-3000:]
    assert f"train.checkpoint_dir '{ckpt}' is in use by another run (run_and_time.sh pid " \
           f"{first.pid} on " in err and f"run directory {run_a}" in err, err[-3000:]
    assert not run_b.exists()          # nothing of the refused run is left
    wait_for_step(run_a, 6, first)
    first.send_signal(signal.SIGTERM)
    rc, out, err = finish(first)
    assert rc == 4, out[-3000:] + err[-3000:]
    assert json.loads((ckpt / "run.json").read_text())["run_dir"] == str(run_a)
    assert_stopped_like_sigterm(run_a, out + err, checkpoints=ckpt)


SLOW_GXX = f"""#!{sys.executable} -S
# g++ as a slower machine or a larger model has it: the first build of a kernel (Inductor's
# <hash>.main.cpp; not its probes of the CPU's vector ISA, whose failure it takes for "not
# supported") waits 3 s before it compiles, so that a stop sent when it starts finds it
# running - the tiny model's builds are over before a stop reaches them. (Not a sh script:
# dash clears the signal mask it inherits once it has waited for a command.)
import os, sys, time
first = sys.argv[0] + ".slowed"
if any(a.endswith(".main.cpp") for a in sys.argv[1:]) and not os.path.exists(first):
    open(first, "w").close()
    time.sleep(3)
os.execvp("g++", ["g++", *sys.argv[1:]])
"""


def build_starting(gxx: Path) -> bool:
    """The first kernel build by ``gxx`` (SLOW_GXX) is in its first 3 s: the script runs
    still."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(gxx).encode() in argv[:3] and any(a.endswith(b".main.cpp") for a in argv):
                return True
    return False


def test_a_stop_during_the_first_compile_stops_like_any_other_and_keeps_the_cache_good(
        small_dataset, tmp_path):
    """SIGTERM to run_and_time.sh while g++ builds the first compiled layer into a fresh
    Inductor cache (the probe's CL4: the stop reached g++ through the rank's process group -
    CppCompileError and hundreds of g++ lines, an aborted run_stop that made the rerun
    refused, a 0-byte .so that failed every later run on the cache): the compile finishes,
    the rank checkpoints at its next logging point and exits 4, no compiler output, the run
    stays resumable, and the rerun of the same command on the same cache resumes and ends.
    One rank of the tiny model, 6 steps: the compiles are this test's time."""
    cache, run_dir = tmp_path / "inductor_cache", tmp_path / "run"
    gxx = tmp_path / "bin" / "g++"   # (Inductor's compiler: $CXX)
    gxx.parent.mkdir()
    gxx.write_text(SLOW_GXX)
    gxx.chmod(0o755)
    extra = overrides(small_dataset, **{
        "model.compile": '"layers"', "data.shapes": '"static"', "system.ranks_per_node": 1,
        "train.max_steps": 6, "train.log_every_steps": 3, "train.checkpoint_every_samples": 48})
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache), "CXX": str(gxx)}
    proc = start(run_dir, extra, **env)
    log, deadline = run_dir / "mlperf_bert.log", time.time() + 240
    while proc.poll() is None and time.time() < deadline and not (
            log.is_file() and '"run_start"' in log.read_text() and build_starting(gxx)):
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before its first compile"
    os.kill(proc.pid, signal.SIGTERM)
    rc, out, err = finish(proc)
    assert rc == 4, out[-3000:] + err[-3000:]
    for noise in ("CppCompileError", "g++", "Woverflow", "Traceback"):
        assert noise not in out + err, out[-3000:] + err[-3000:]
    status = records(run_dir)
    assert [s["exit"] for s in status] == [4] and status[0]["step"] == 3, status
    assert (run_dir / "checkpoints" / "step_00000003" / "checkpoint.json").is_file()
    assert "run_stop" not in [e["key"] for e in mllog_events(log)]   # it can be rerun
    partial = [p for p in cache.rglob("*") if p.is_file() and (
        p.name.endswith(".tmp") or (p.suffix in (".so", ".o", ".gch") and not p.stat().st_size))]
    assert not partial, partial
    rc, out, err = run(run_dir, extra, **env)   # the same command, the same cache
    assert rc == 1, out[-3000:] + err[-3000:]
    assert next(e for e in mllog_events(log) if e["key"] == "presto_resumed")[
        "metadata"]["step"] == 3
    assert mllog_events(log)[-1]["key"] == "run_stop"
