"""End-to-end: real ranks under mpiexec train a tiny BERT on real shards through
run_and_time.sh; the MLPerf log passes the real compliance checker; invalid configs and dead
ranks stop every rank quickly."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_CONFIG = ROOT / "submission" / "configs" / "config_CPU_1x2x32x1.toml"
RULESET = "5.0.0"  # 5.1.0 no longer lists bert (see docs/MLPERF_LOGGING.md)


def tiny_overrides(data_dir: Path, out: Path, **extra) -> list[str]:
    """A 1-layer BERT on the small real set: a few seconds per run on 2 cores."""
    values = {
        "data.data_dir": f'"{data_dir}"', "train.output_dir": f'"{out}"',
        "model.num_hidden_layers": 1, "model.hidden_size": 64, "model.num_attention_heads": 2,
        "model.intermediate_size": 128, "train.global_batch_size": 16,
        "train.eval_iter_start_samples": 160, "train.eval_iter_samples": 160,
        "train.max_steps": 80, "train.log_every_steps": 10, "data.eval_batch_size": 32,
        "schedule.warmup_steps": 5, "schedule.total_steps": 200,
        "train.target_mlm_accuracy": 0.03,
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def run_and_time(overrides: list[str], timeout: float = 240, env_extra=None):
    """The README's entry point, with the CPU benchmark config and overrides after `--`."""
    env = dict(os.environ, CONFIG=str(CPU_CONFIG), SEED="7", **(env_extra or {}))
    return subprocess.run(["bash", str(ROOT / "run_and_time.sh"), "--", *overrides], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def compliance(log: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage",
                           "training", "--ruleset", RULESET, str(log)],
                          capture_output=True, text=True, timeout=120, cwd=log.parent)


def mllog_events(log: Path) -> list[dict]:
    return [json.loads(line.split(":::MLLOG ", 1)[1]) for line in log.read_text().splitlines()
            if ":::MLLOG " in line]


@pytest.mark.slow
def test_short_real_run_reaches_target_and_log_passes_checker(small_dataset, tmp_path):
    out = tmp_path / "run"
    proc = run_and_time(tiny_overrides(small_dataset, out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^RESULT,bert,7,\d+,\S+,\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [AP]M$",
                     proc.stdout, re.M), proc.stdout[-2000:]
    assert "eval acc" in proc.stdout and "samples/s" in proc.stdout  # the progress line

    log = out / "mlperf_bert.log"
    check = compliance(log)
    assert check.returncode == 0 and "SUCCESS" in check.stdout + check.stderr, \
        check.stdout[-3000:] + check.stderr[-3000:]
    events = mllog_events(log)
    stop = [e for e in events if e["key"] == "run_stop"]
    assert stop[0]["metadata"]["status"] == "success"
    accs = [e for e in events if e["key"] == "eval_accuracy"]
    assert accs[-1]["value"] >= 0.03 and accs[-1]["metadata"]["epoch_num"] % 160 == 0

    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "success" and summary["samples"] == accs[-1]["metadata"]["epoch_num"]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m["kind"] == "step"]
    assert len(steps) == summary["steps"] and steps[0]["samples"] == 16
    assert all(0 < m["padding_efficiency"] <= 1 for m in steps)
    assert (out / "loss_accuracy.png").stat().st_size > 1000


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_other_launchers_train_the_same_run(small_dataset, tmp_path, launcher):
    """torchrun and Open MPI's mpirun start the same 2-rank training (mpiexec: above)."""
    if launcher == "mpirun" and shutil.which("mpirun.openmpi") is None:
        pytest.skip("Open MPI's mpirun is not installed (make test installs openmpi-bin as root)")
    out = tmp_path / "run"
    env = {"MPIRUN": "mpirun.openmpi"} if launcher == "mpirun" else {}
    proc = run_and_time(tiny_overrides(small_dataset, out, **{"system.launcher": f'"{launcher}"'}),
                        env_extra=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RESULT,bert,7," in proc.stdout
    assert compliance(out / "mlperf_bert.log").returncode == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "success"


@pytest.mark.slow
def test_budget_exhausted_is_aborted_without_result_line(small_dataset, tmp_path):
    out = tmp_path / "run"
    proc = run_and_time(tiny_overrides(small_dataset, out, **{
        "train.max_steps": 12, "train.target_mlm_accuracy": 0.99}))
    assert proc.returncode == 1
    assert "RESULT," not in proc.stdout
    events = mllog_events(out / "mlperf_bert.log")
    assert [e["metadata"]["status"] for e in events if e["key"] == "run_stop"] == ["aborted"]
    assert compliance(out / "mlperf_bert.log").returncode == 0  # aborted runs are valid logs


@pytest.mark.parametrize("override, words", [
    ("train.global_batch_size=63", ["train.global_batch_size", "63", "divisible"]),
    ("train.glboal_batch_size=64", ["unknown key", "did you mean train.global_batch_size"]),
    ("train.precision=bf16", ["train.precision", "CPU"]),
    ("optim.lr=-1", ["optim.lr"]),
])
def test_invalid_config_fails_every_rank_before_training(small_dataset, tmp_path, override, words):
    out = tmp_path / "run"
    proc = run_and_time(tiny_overrides(small_dataset, out) + [override], timeout=120)
    assert proc.returncode != 0
    for word in words:
        assert word in proc.stderr, proc.stderr[-2000:]
    assert not (out / "metrics.jsonl").exists()  # nothing trained


@pytest.mark.slow
def test_killed_rank_stops_the_job_within_60s(small_dataset, tmp_path):
    out = tmp_path / "run"
    overrides = tiny_overrides(small_dataset, out, **{
        "train.max_steps": 100000, "train.target_mlm_accuracy": 0.99,
        "train.eval_iter_start_samples": 10**9, "system.dist_timeout_s": 30})
    env = dict(os.environ, CONFIG=str(CPU_CONFIG), SEED="7")
    proc = subprocess.Popen(["bash", str(ROOT / "run_and_time.sh"), "--", *overrides], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.time() + 120
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 3):
            time.sleep(0.5)
        assert metrics.exists(), "training never started"
        pids = subprocess.run(["pgrep", "-f", f"submission.train.*{out}"], capture_output=True,
                              text=True).stdout.split()
        assert len(pids) >= 2, pids
        os.kill(int(pids[-1]), signal.SIGKILL)
        killed_at = time.time()
        rc = proc.wait(timeout=90)
        assert rc != 0
        assert time.time() - killed_at < 60
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    survivors = subprocess.run(["pgrep", "-f", f"submission.train.*{out}"], capture_output=True,
                               text=True).stdout.split()
    assert not survivors, f"ranks outlived the job: {survivors}"
