"""submission.mllog_callback: a synthetic run through the callback (``simulate``,
tests/support/mllog.py), judged by the REAL MLPerf compliance checker
(``python -m mlperf_logging.compliance_checker``, run as a subprocess); and a full disk in a
real one-process run, then the documented rerun: the log stays whole.

Ruleset: 5.0.0. It is the last one whose ``*_common.yaml`` accepts ``submission_benchmark`` =
"bert"; 5.1.0 ships the very same ``closed_bert.yaml``/``open_bert.yaml`` but dropped "bert" from
the benchmark list, so every BERT log fails 5.1.0 on that one key (a test below pins this).
The callback's own conventions: tests/unit/test_mllog.py."""
from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from runtime.events import Event
from submission.mllog_callback import COMPLIANCE_RULESET, MLPerfLogger
from tests.support.mllog import CLOSED_ACCS, PROXY, simulate
from tests.support.mllog import mllog_events as parse


# ------------------------------------------------------------------ the checker, as a subprocess

@dataclass
class CheckResult:
    rc: int
    passed: bool
    configs: list[str]        # rule files the checker ran, in order
    failed_keys: set[str]     # keys named by failure messages
    output: str


_FAIL_PATTERNS = [re.compile(p) for p in (
    r"CHECK for '(\w+)' failed",
    r"Required EXACTLY_ONE occurrence of '(\w+)'",
    r"Required AT_LEAST_ONE occurrence of '(\w+)'",
    r"Required AT_LEAST\(\d+\) occurrence of '(\w+)'",
    r"Failed checks for (\w+) :",
    r'Failed executing[^\n]*\n(?:[^\n]*\n){0,3}?[^\n]*"key": "(\w+)"',
)]


def check(log: Path, ruleset: str = COMPLIANCE_RULESET, config: str | None = None) -> CheckResult:
    """Run the compliance checker on a log; its verdict is the exit status plus SUCCESS/FAILED."""
    cmd = [sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
           "--ruleset", ruleset, "--log_output", str(log.with_suffix(".checker.log")), str(log)]
    if config:
        cmd += ["--config", config]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out   # a crash is not a verdict
    passed = proc.returncode == 0 and re.search(r"^INFO - SUCCESS$", out, re.M) is not None
    if not passed:
        assert proc.returncode == 1 and re.search(r"^ERROR - FAILED$", out, re.M), out
    failed = {m.group(1) for p in _FAIL_PATTERNS for m in p.finditer(out)}
    configs = re.findall(r"Compliance checks: (\S+)", out)
    return CheckResult(proc.returncode, passed, configs, failed, out)


# ------------------------------------------------------------------ compliance

def test_closed_run_passes_the_real_checker(tmp_path):
    res = check(simulate(tmp_path / "closed.log", CLOSED_ACCS))
    assert res.passed, res.output
    assert res.configs == [f"training_{COMPLIANCE_RULESET}/common.yaml",
                           f"training_{COMPLIANCE_RULESET}/closed_common.yaml",
                           f"training_{COMPLIANCE_RULESET}/closed_bert.yaml"]


def test_closed_run_below_target_fails_on_eval_accuracy_only(tmp_path):
    res = check(simulate(tmp_path / "short.log", CLOSED_ACCS[:-1], status="aborted"))
    assert not res.passed and res.failed_keys == {"eval_accuracy"}, res.output


def test_proxy_run_passes_open_and_fails_closed_only_on_accuracy(tmp_path):
    log = simulate(tmp_path / "proxy.log", [0.36, 0.41, 0.45], overrides=PROXY)
    res = check(log)
    assert res.passed, res.output
    assert res.configs[-1] == f"training_{COMPLIANCE_RULESET}/open_bert.yaml"
    # The same log judged by the closed rules: every closed hyperparameter key is there, only
    # the accuracy (< 0.720) is not closed-division quality.
    closed = check(log, config=f"training_{COMPLIANCE_RULESET}/closed_common.yaml")
    assert closed.configs[-1] == f"training_{COMPLIANCE_RULESET}/closed_bert.yaml"
    assert not closed.passed and closed.failed_keys == {"eval_accuracy"}, closed.output


def test_log_without_run_stop_fails(tmp_path):
    res = check(simulate(tmp_path / "cut.log", CLOSED_ACCS, drop=("run_stop",)))
    assert not res.passed and "run_stop" in res.failed_keys, res.output


def test_log_without_a_hyperparameter_fails_closed(tmp_path):
    res = check(simulate(tmp_path / "nolamb.log", CLOSED_ACCS, drop=("opt_lamb_epsilon",)))
    assert not res.passed and res.failed_keys == {"opt_lamb_epsilon"}, res.output


def test_ruleset_510_rejects_only_the_benchmark_name(tmp_path):
    """5.1.0 removed BERT: the only failure is submission_benchmark; its bert rules still run
    (the POST that enqueues closed_bert.yaml runs whatever the CHECK said) and pass."""
    res = check(simulate(tmp_path / "r510.log", CLOSED_ACCS), ruleset="5.1.0")
    assert not res.passed and res.failed_keys == {"submission_benchmark"}, res.output
    assert res.configs[-1] == "training_5.1.0/closed_bert.yaml"
    bert_only = check(tmp_path / "r510.log", ruleset="5.1.0", config="training_5.1.0/closed_bert.yaml")
    assert bert_only.passed, bert_only.output


# ------------------------------------------------------- a full disk, then the documented rerun

class _FillsUp:
    """A file whose disk fills: each write puts half its text down, then ENOSPC - the partial
    last line a real full disk leaves."""

    def __init__(self, f):
        self.f = f

    def write(self, text):
        import errno
        self.f.write(text[:len(text) // 2])
        self.f.flush()
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.f, name)


class _DiskFillsAt:
    """Arms _FillsUp on the MLPerf log and the metrics file at the logging point of ``step``
    (first in the callback list: the other callbacks' writes at that point fail)."""

    def __init__(self, step, mllogger, metrics):
        self.step, self.mllogger, self.metrics, self.armed = step, mllogger, metrics, False

    def on_event(self, event, state):
        if event is Event.LOG and state.step >= self.step and not self.armed:
            self.armed = True
            handler = next(h for h in self.mllogger._handlers
                           if isinstance(h, logging.FileHandler))
            handler.stream = _FillsUp(handler.stream)
            self.metrics._file = _FillsUp(self.metrics._file)


def _attempt(cfg, ctx, out: Path, fill_at: int | None = None, first: str = "mllog"):
    """One attempt of a run in ``out`` with the real MLPerf logger and metrics file; the
    disk fills at ``fill_at``, under ``first`` of the two ("mllog" | "metrics") - the one
    written first after it fills. The exception it ended with (None: it ended)."""
    from runtime.events import CallbackList
    from runtime.launch import signals
    from runtime.observe.metrics import MetricsWriter
    from runtime.train.trainer import Trainer
    mllogger = MLPerfLogger(out / "mlperf_bert.log", is_main=True)
    metrics = MetricsWriter(out / "metrics.jsonl")
    cbs = [mllogger, metrics] if first == "mllog" else [metrics, mllogger]
    if fill_at is not None:
        cbs.insert(0, _DiskFillsAt(fill_at, mllogger, metrics))
    trainer = Trainer(cfg, ctx, CallbackList(cbs), log=lambda m: None)
    try:
        trainer.fit()
        return None
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return e
    finally:
        trainer.close()
        mllogger.close()
        signals.clear()


def _run_cfg(data_dir, out, *extra):
    from tests.support.tiny import tiny_config
    return tiny_config(data_dir, f'train.output_dir="{out}"', "train.max_steps=12",
                       "train.eval_iter_start_samples=64", "train.eval_iter_samples=64",
                       "train.target_mlm_accuracy=0.99", "train.log_every_steps=2",
                       "data.eval_batch_size=32", "schedule.warmup_steps=3",
                       "schedule.total_steps=40", 'submission.division="open"', *extra)


@pytest.mark.parametrize("first", ["mllog", "metrics"])
def test_a_rerun_after_a_full_disk_drops_the_partial_line_and_the_log_stays_whole(
        small_dataset, single_ctx, tmp_path, first):
    """The disk fills at step 6 under the MLPerf log (or metrics.jsonl): it ends in a partial
    line. The run's message says what a rerun does (resume from the step-4 checkpoint); the
    rerun drops the partial line, says so (presto_resumed log_repaired, or the metrics' resume
    record), and every line of both files parses - presto_resumed included, which the full
    disk's half line used to swallow - and the checker passes."""
    from runtime.observe.metrics import LogWriteError
    out = tmp_path / "run"
    cfg = _run_cfg(small_dataset, out, "train.checkpoint_every_samples=32")
    e = _attempt(cfg, single_ctx, out, fill_at=6, first=first)
    assert isinstance(e, LogWriteError), e
    text = str(e)
    assert "rerun the same command: it resumes from" in text and "step_00000004" in text, text
    log, metrics = out / "mlperf_bert.log", out / "metrics.jsonl"
    cut = log if first == "mllog" else metrics
    assert not cut.read_bytes().endswith(b"\n")
    assert _attempt(cfg, single_ctx, out) is None
    events = parse(log)                              # every :::MLLOG line is whole JSON
    assert len(events) == sum(1 for ln in log.read_text().splitlines() if ln.strip())
    resumed = [r for r in events if r["key"] == "presto_resumed"]
    assert len(resumed) == 1 and resumed[0]["metadata"]["step"] == 4
    records = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    resume = [r for r in records if r["kind"] == "resume"]
    assert len(resume) == 1 and records[-1]["kind"] == "run_stop"
    repaired_log = resumed[0]["metadata"]["log_repaired"]
    repaired_metrics = [n for n in resume[0]["notes"] if "partial last line" in n]
    if first == "mllog":
        assert "partial last line" in repaired_log and not repaired_metrics
    else:
        assert repaired_log is None and len(repaired_metrics) == 1
    verdict = check(log)
    assert verdict.passed, verdict.output[-3000:]


def test_without_a_checkpoint_the_full_disk_message_does_not_offer_a_resume(
        small_dataset, single_ctx, tmp_path):
    """No checkpoints: a rerun starts a new run (run_and_time.sh gives it a new directory;
    this one's log cannot be continued) - the message says that, not "resume from the last
    checkpoint", which the rerun then refused."""
    from runtime.observe.metrics import LogWriteError
    out = tmp_path / "run"
    e = _attempt(_run_cfg(small_dataset, out), single_ctx, out, fill_at=4)
    assert isinstance(e, LogWriteError), e
    text = str(e)
    assert "resume" not in text and "cannot be continued" in text, text
    assert "new run directory" in text and "train.checkpoint_every_samples = 0" in text, text
