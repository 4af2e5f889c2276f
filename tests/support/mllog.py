"""MLPerf logs in tests: the real compliance checker on a log, a log's events, and a synthetic
run fired at the MLPerf logger callback (submission.mllog_callback) for tests that need a
realistic log without training."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.launch import ROOT

RULESET = "5.0.0"  # 5.1.0 no longer lists bert (see docs/MLPERF_LOGGING.md)
DGX_1NODE = ROOT / "submission" / "configs" / "config_DGXA100_1x8x56x1.toml"
TRAIN_SAMPLES = 156_725_653   # samples in one pass over the MLPerf training set (any > 0 works)
CLOSED_ACCS = [0.36, 0.52, 0.64, 0.70, 0.716, 0.721]   # reaches the closed target 0.720
PROXY = ["submission.division=open", "train.target_mlm_accuracy=0.45"]


def compliance(log: Path, ruleset: str = RULESET) -> subprocess.CompletedProcess:
    """``python -m mlperf_logging.compliance_checker`` on ``log`` (training, ``ruleset``)."""
    return subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage",
                           "training", "--ruleset", ruleset, str(log)],
                          capture_output=True, text=True, timeout=120, cwd=log.parent)


def assert_compliant(log: Path) -> None:
    """The checker's verdict on ``log`` is SUCCESS (exit 0 and the word)."""
    check = compliance(log)
    assert check.returncode == 0 and "SUCCESS" in check.stdout + check.stderr, \
        check.stdout[-3000:] + check.stderr[-3000:]


def mllog_events(log: Path) -> list[dict]:
    """The ``:::MLLOG`` records of a log, in order (prefixed lines included)."""
    return [json.loads(line.split(":::MLLOG ", 1)[1]) for line in log.read_text().splitlines()
            if ":::MLLOG " in line]


def simulate(log: Path, accuracies, overrides=(), status="success", derived=None,
             world_size=8, drop: tuple[str, ...] = (), **logger_kw) -> Path:
    """Fire a realistic event sequence at the callback: init, blocks of eval_iter_samples
    samples with a STEP per optimizer step and a LOG of the steps since the last one every
    log_every_steps steps and before each block's end, an eval after each block, run_stop.
    The config is the DGX A100 one-node config with ``overrides``."""
    from runtime.config import load_config
    from runtime.events import CallbackList, Event, RunState, StepMetrics
    from submission.mllog_callback import MLPerfLogger

    cfg = load_config(DGX_1NODE, list(overrides))
    gbs = cfg.train.global_batch_size
    _, every = cfg.train.eval_cadence()
    state = RunState(config=cfg, rank=0, world_size=world_size,
                     derived=dict(derived or {}), train_samples=TRAIN_SAMPLES, eval_samples=10_000)
    cb = CallbackList([MLPerfLogger(log, is_main=True, **logger_kw)])
    cb.fire(Event.INIT_START, state)
    cb.fire(Event.INIT_STOP, state)
    cb.fire(Event.RUN_START, state)
    for acc in accuracies:
        steps = -(-every // gbs)
        state.block_start_samples, state.block_samples = state.samples, steps * gbs
        cb.fire(Event.BLOCK_START, state)
        pending = []
        for _ in range(steps):
            state.step += 1
            state.samples += gbs
            pending.append(StepMetrics(step=state.step, samples=state.samples, loss=2.5,
                                       mlm_loss=2.2, nsp_loss=0.3, lr=4e-4, grad_norm=0.9,
                                       clip_coef=1.0, step_time_s=0.3, real_tokens=20_000,
                                       computed_tokens=28_672))
            cb.fire(Event.STEP, state)
            if state.step % cfg.train.log_every_steps == 0:
                state.logged_steps, state.last_step, pending = pending, pending[-1], []
                cb.fire(Event.LOG, state)
        if pending:
            state.logged_steps, state.last_step = pending, pending[-1]
            cb.fire(Event.LOG, state)
        cb.fire(Event.BLOCK_STOP, state)
        cb.fire(Event.EVAL_START, state)
        state.eval_accuracy = acc
        cb.fire(Event.EVAL_STOP, state)
    state.status = status
    cb.fire(Event.RUN_STOP, state)
    if drop:
        lines = [ln for ln in log.read_text().splitlines()
                 if not any(f'"key": "{k}"' in ln for k in drop)]
        log.write_text("\n".join(lines) + "\n")
    return log
