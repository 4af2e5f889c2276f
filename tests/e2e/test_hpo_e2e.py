"""``python -m submission hpo`` with real trials: each one run_and_time.sh training the tiny
model on 2 MPI ranks (a few seconds), on this machine and as a job array on the real one-node
Slurm cluster of tests/slurm_cluster.py.

Locally: the config's own learning rate first, then a learning rate far too small to learn (1e-4)
(pruned by the median pruner at its first evaluation - through the runtime's stop signal, exit
4), then a sampled trial during which the worker is SIGKILLed. Nothing of that trial may keep
running (its run_and_time.sh gets SIGTERM when the worker dies); the rerun of the same command
finds the trial's heartbeat stale, fails it, retries its parameters once and ends with the
budget spent: no trial lost, none repeated, no process left behind.
On Slurm: two array tasks share the study; the first is cancelled (scancel: SIGTERM) in the
middle of its trial, which it fails and queues again; the second task runs that retry (the
budget: one trial) and, last to finish, writes the table and the best config.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.config import load_config
from tests.support.runs import CPU_CONFIG
from tests.support.tiny import run_overrides

pytestmark = pytest.mark.slow   # tests/e2e: every test here is slow

ROOT = Path(__file__).resolve().parents[2]
SPACE = '[params."optim.lr"]\nlow = 1e-4\nhigh = 3e-2\nlog = true\n'
# 10 steps of 16 samples, an evaluation every 5 steps, a target the tiny model never reaches
# (every finished trial is censored: its value is what its accuracy gap says).
TRIAL = {"train.max_steps": 10, "train.eval_iter_start_samples": 80,
         "train.eval_iter_samples": 80, "train.log_every_steps": 5,
         "train.target_mlm_accuracy": 0.5}


# The pruned trial must still be running when its pruning signal lands: the worker reads the
# evaluation within its 0.5 s poll and the ranks stop at their next logging point, and the
# 5 steps after it took 0.25 s (2026-12-02): that trial finished first and was "complete".
# Now 35 steps follow the evaluation the pruner reads (at 80 samples; then 368, 640), and
# --prune-warmup 0.125 ends the pruner's warm-up at 80 samples (1/8 of 640). The same for the
# trial a test cancels once its first metrics are written (step 5).
LONG = {"train.max_steps": 40, "train.eval_iter_samples": 280}


def _sets(data_dir, **extra) -> list[str]:
    over = [o for o in run_overrides(data_dir, **{**TRIAL, **extra})]
    return [a for o in over for a in ("--set", o)]


def _pids_under(path: Path) -> list[str]:
    """Processes whose command line names ``path`` (a study's trials)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if str(path) in cmd or str(path).encode() in environ:
            found.append(f"{proc.name}: {cmd[:120]}")
    return found


def _wait_gone(path: Path, timeout: float = 60) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := _pids_under(path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def _trials(d: Path) -> list[dict]:
    import optuna
    from submission import hpo
    study = hpo.read_study(d)
    return [{"number": t.number, "state": t.state.name, "params": t.params,
             "retry_of": t.user_attrs.get("retry_of"), "attrs": t.user_attrs}
            for t in hpo.open_study(study).trials]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_local_study_prunes_survives_a_killed_worker_and_resumes(small_dataset, tmp_path):
    d = tmp_path / "study"
    (tmp_path / "space.toml").write_text(SPACE)
    cmd = [sys.executable, "-m", "submission", "hpo", "--config", str(CPU_CONFIG),
           "--space", str(tmp_path / "space.toml"), "--trials", "3", "--dir", str(d),
           "--prune-after", "1", "--prune-warmup", "0.125", "--enqueue", "optim.lr=0.0001",
           "--heartbeat", "1", "--heartbeat-grace", "4",
           *_sets(small_dataset, **{"optim.lr": 0.02}, **LONG)]
    first = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    lines = []
    for line in first.stdout:
        lines.append(line)
        if line.startswith("hpo: trial 2 ("):
            break
    else:
        pytest.fail("the study ended before its third trial:\n" + "".join(lines))
    started = d / "trials" / "trial_2" / "mlperf_bert.log"
    deadline = time.monotonic() + 120
    while not started.is_file() and time.monotonic() < deadline:
        time.sleep(0.1)    # the trial's ranks are up (before its first evaluation)
    first.kill()           # SIGKILL: the worker cannot say anything
    first.wait()
    first.stdout.close()
    out1 = "".join(lines)
    assert "trial 0 (baseline): optim.lr=0.02" in out1 and "trial 0: complete" in out1, out1
    assert "trial 1 (enqueued): optim.lr=0.0001" in out1, out1
    assert "trial 1: pruned at 80 samples" in out1, out1
    left = _wait_gone(d / "trials" / "trial_2")
    assert not left, f"the killed worker's trial kept running: {left}"
    rc2 = (d / "trials" / "trial_2.out").read_text()
    assert "exit status 4 (stopped by a signal)" in rc2, rc2[-2000:]

    second = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    out2 = second.stdout + second.stderr
    assert second.returncode == 0, out2
    assert "trial 2: its worker is gone (no heartbeat): failed, retried" in out2, out2
    trials = _trials(d)
    assert [(t["number"], t["state"], t["retry_of"]) for t in trials[:3]] == \
        [(0, "COMPLETE", None), (1, "PRUNED", None), (2, "FAIL", None)]
    assert len(trials) == 4 and trials[3]["retry_of"] == 2    # retried once, then ended
    assert trials[3]["state"] in ("COMPLETE", "PRUNED") and trials[3]["attrs"]["exit_code"] in (1, 4)
    assert trials[3]["params"] == trials[2]["params"]
    assert trials[1]["attrs"]["exit_code"] == 4 and trials[1]["attrs"]["pruned_at_samples"] == 80
    assert trials[0]["attrs"]["censored"] and trials[0]["attrs"]["samples_trained"] == 640
    # The pruned trial's run stopped through the runtime's stop path and left nothing behind.
    pruned = (d / "trials" / "trial_1.out").read_text()
    assert "stopped after step" in pruned and "signal SIGUSR1" in pruned, pruned[-2000:]
    assert not _pids_under(d)
    rows = json.loads((d / "trials.json").read_text())
    assert [r["state"] for r in rows][:3] == ["COMPLETE", "PRUNED", "FAIL"]
    best = load_config(d / f"{CPU_CONFIG.stem}_hpo.toml")
    winner = min((r for r in rows if r["state"] == "COMPLETE"), key=lambda r: r["value"])
    assert best.optim.lr == winner["params"]["optim.lr"]
    assert (d / "history.png").is_file() and (d / "slices.png").is_file()


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_slurm_array_retries_the_trial_of_a_cancelled_task(slurm_cluster, small_dataset,
                                                             tmp_path):
    d = tmp_path / "study"
    (tmp_path / "space.toml").write_text(SPACE)
    env = slurm_cluster.client_env()
    proc = subprocess.run(
        [sys.executable, "-m", "submission", "hpo", "--config", str(CPU_CONFIG),
         "--space", str(tmp_path / "space.toml"), "--trials", "1", "--workers", "2",
         "--dir", str(d), "--slurm", "--no-baseline", "--pruner", "none",
         *_sets(small_dataset, **{"system.launcher": '"srun"',
                                  "system.walltime_minutes": 3}, **LONG)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = proc.stdout.strip().splitlines()[-1]
    assert job.isdigit() and "submitted job array" in proc.stdout, proc.stdout

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}"
                         for p in sorted(d.glob("slurm-*.out")) + sorted(d.glob("trials/*.out")))

    metrics = d / "trials" / "trial_0" / "metrics.jsonl"
    deadline = time.monotonic() + 150
    while not (metrics.is_file() and metrics.stat().st_size) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert metrics.is_file(), logs()
    slurm_cluster.run("scancel", f"{job}_0")          # task 0, in the middle of trial 0
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if not slurm_cluster.run("squeue", "-h", "-j", job, "-o", "%i").stdout.strip():
            break
        time.sleep(1)
    else:
        slurm_cluster.run("scancel", job)
        pytest.fail("the array did not finish\n" + logs())
    trials = _trials(d)
    assert [(t["state"], t["retry_of"]) for t in trials] == \
        [("FAIL", None), ("COMPLETE", 0)], logs()
    assert trials[1]["params"] == trials[0]["params"]
    assert "stopped by a signal" in trials[0]["attrs"]["fail_reason"], trials[0]
    assert (d / "trials.json").is_file() and (d / f"{CPU_CONFIG.stem}_hpo.toml").is_file(), \
        logs()
    assert not _pids_under(d)
