"""run_and_time.sh runs from tests - the README's entry point, with the CPU benchmark config
and the tiny model's overrides after ``--``, 2 MPI ranks - and the session's reference run.

``reference_run`` (a session fixture; tests/conftest.py imports it): the uninterrupted run the
interrupted-and-resumed runs of tests/e2e/test_resume_e2e.py must equal step for step. 25 steps of
16 samples on 2 ranks with local balancing and 2 micro-batches, a checkpoint every 5 steps,
evaluations at steps 10, 20 and 25, and a target (0.99) it never reaches: the step budget
ends it, aborted (exit 1). Trained once per session, read by every test that compares with it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.launch import ROOT, default_stop_signals
from tests.support.tiny import run_overrides

CPU_CONFIG = ROOT / "submission" / "configs" / "config_CPU_1x2x32x1.toml"
SEED = "7"

EVERY = 80   # samples between checkpoints: every 5 steps of 16
STEPS = 25   # evaluations at steps 10, 20 and 25 (the budget)


def resume_overrides(data_dir: Path, **extra) -> list[str]:
    """The tiny run of the resume tests: 25 steps, 2 micro-batches a step, local balancing, a
    checkpoint every 5 steps, a target it never reaches, a 30 s collective timeout."""
    values = {"train.gradient_accumulation_steps": 2, "data.balance": '"local"',
              "train.max_steps": STEPS, "train.log_every_steps": 5,
              "train.target_mlm_accuracy": 0.99, "train.checkpoint_every_samples": EVERY,
              "system.dist_timeout_s": 30}
    values.update(extra)
    return run_overrides(data_dir, **values)


def run_and_time(overrides: list[str], timeout: float = 240, env_extra=None,
                 **kw) -> subprocess.CompletedProcess:
    """run_and_time.sh to the end (CONFIG the CPU benchmark config, SEED 7), output captured."""
    env = dict(os.environ, CONFIG=str(CPU_CONFIG), SEED=SEED, **(env_extra or {}))
    return subprocess.run(["bash", str(ROOT / "run_and_time.sh"), "--", *overrides], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout, **kw)


def start(run_dir: Path, extra: list[str], **env_extra) -> subprocess.Popen:
    """run_and_time.sh in the background with RUN_DIR=run_dir, in its own session (as a job
    in a terminal: a test can signal the whole process group, or kill it), the stop signals
    at their defaults whatever the suite inherited."""
    env = dict(os.environ, CONFIG=str(CPU_CONFIG), SEED=SEED, RUN_DIR=str(run_dir), **env_extra)
    return subprocess.Popen(["bash", str(ROOT / "run_and_time.sh"), "--", *extra], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=default_stop_signals)


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"run_and_time.sh hung:\n{out[-3000:]}\n{err[-3000:]}")
    return proc.returncode, out, err


def run(run_dir: Path, extra: list[str], **env_extra) -> tuple[int, str, str]:
    return finish(start(run_dir, extra, **env_extra))


def steps(run_dir: Path) -> dict[int, tuple]:
    """step -> (loss, grad_norm, the gradient noise scale's averages and window) from
    metrics.jsonl - a resume continues the noise scale's averages exactly too; a step trained
    twice keeps its last record (the resumed attempt's)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "step":
            out[r["step"]] = (r["loss"], r["grad_norm"], r.get("grad_sq_true"),
                              r.get("grad_trace_cov"), r.get("noise_scale_window_samples"))
    return out


def evals(run_dir: Path) -> list[tuple]:
    return [(r["samples"], r["eval_accuracy"]) for r in map(json.loads,
            (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"]


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 180) -> int:
    deadline = time.time() + timeout
    path = run_dir / "metrics.jsonl"
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the run ended early: {proc.communicate()}")
        if path.exists():
            done = [json.loads(x)["step"] for x in path.read_text().splitlines()
                    if '"kind": "step"' in x]
            if done and max(done) >= step:
                return max(done)
        time.sleep(0.2)
    pytest.fail(f"step {step} not reached in {timeout} s")


def ranks_left(run_dir: Path) -> list[str]:
    """Ranks of the run in ``run_dir`` still running (their command line names it)."""
    return subprocess.run(["pgrep", "-f", f"submission.train.*{run_dir}"], capture_output=True,
                          text=True).stdout.split()


@dataclass(frozen=True)
class Run:
    dir: Path
    rc: int
    out: str
    err: str


@pytest.fixture(scope="session")
def reference_run(small_dataset, tmp_path_factory) -> Run:
    """The uninterrupted run of ``resume_overrides`` (see the module docstring)."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    rc, out, err = run(run_dir, resume_overrides(small_dataset))
    assert rc == 1, out[-3000:] + err[-3000:]     # 25 steps, target 0.99: the budget ends it
    return Run(run_dir, rc, out, err)
