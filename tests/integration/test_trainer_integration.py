"""The trainer's eval cadence in a fit: the events in order, the first evaluation and then one
every train.eval_iter_samples, and the stop at max_steps (the tiny model of
tests/support/tiny.py, one process). The other trainer pieces: tests/unit/test_trainer.py."""
from __future__ import annotations

from runtime.events import CallbackList, Event
from runtime.train.trainer import Trainer
from tests.support.tiny import tiny_config


class Recorder:
    def __init__(self):
        self.events = []

    def on_event(self, event, state):
        self.events.append((event, state.samples, state.eval_accuracy, state.status))


def test_eval_cadence_events_and_stop_at_max_steps(small_dataset, single_ctx):
    rec = Recorder()
    cfg = tiny_config(small_dataset, "train.eval_iter_start_samples=32",
                      "train.eval_iter_samples=48", "train.max_steps=7",
                      "train.target_mlm_accuracy=0.99")
    trainer = Trainer(cfg, single_ctx, CallbackList([rec]))
    state = trainer.fit()
    trainer.close()
    assert state.status == "aborted" and state.step == 7 and state.samples == 112
    evals = [s for e, s, _, _ in rec.events if e is Event.EVAL_STOP]
    assert evals == [32, 80, 112]  # first at 32, then every 48, and once more at the budget
    kinds = [e for e, *_ in rec.events if e is not Event.STEP]
    assert kinds[:3] == [Event.INIT_START, Event.INIT_STOP, Event.RUN_START]
    assert kinds[-1] is Event.RUN_STOP


class FakeDeviceClock:
    """A device that takes ``per_step`` seconds for each step, whatever the host does (the
    trainer marks the start and end of every step; a mark here is a count)."""

    cuda = True  # its marks stand for CUDA events

    def __init__(self, per_step: float):
        self.per_step, self.n = per_step, 0

    def now(self):
        self.n += 1
        return self.n

    def seconds(self, start, end):
        return (end - start) * self.per_step


def test_tflops_and_mfu_come_from_the_device_time_not_the_hosts(small_dataset, single_ctx):
    """A host that enqueues steps far ahead of the device (a replayed CUDA graph is ~10
    launches a step) returns from train_step long before the device is done: TFLOP/s and MFU
    divide by the device's time of each step (here a fake device's 2 s), never the host's - in
    the step metrics, the run's figures and the progress line."""
    import io
    import pytest
    from runtime.observe.metrics import ProgressPrinter
    cfg = tiny_config(small_dataset, "system.peak_tflops=1", "train.log_every_steps=1000")
    trainer = Trainer(cfg, single_ctx)
    trainer.setup()
    trainer.step_log.clock = FakeDeviceClock(2.0)
    it = iter(trainer.train_loader)
    for _ in range(3):
        trainer.train_step(it)
    logged = trainer.step_log.flush()
    flops = [m.extra["model_flops_all"] for m in logged]
    for m, f in zip(logged, flops):
        assert m.device_step_s == 2.0 and m.step_time_s < 2.0
        assert m.extra["tflops"] == pytest.approx(f / 2.0 / 1e12)
        assert m.extra["mfu"] == pytest.approx(m.extra["tflops"] / 1.0)  # system.peak_tflops
    run = trainer.step_log.run_figures()
    assert run["time_source"] == "cuda_events" and run["device_seconds"] == 6.0
    assert run["tflops"] == pytest.approx(sum(flops) / 6.0 / 1e12)
    line, st = io.StringIO(), trainer.state
    st.derived["step_time_source"] = trainer.step_log.time_source
    st.logged_steps, st.last_step = logged, logged[-1]
    progress = ProgressPrinter(every=1, stream=line)
    progress.on_event(Event.RUN_START, st)
    progress.on_event(Event.LOG, st)
    assert f"{sum(flops) / 6.0 / 1e12:.3g} TFLOP/s" in line.getvalue()
    assert "(device time)" in line.getvalue()
    trainer.close()


def test_the_step_profiler_traces_and_reports_the_named_steps(small_dataset, single_ctx,
                                                               tmp_path):
    """train.profile_steps: a Chrome trace per named step in the run directory, and per step
    its wall time, busy time (CPU: the ops' own time), op count, top ops and host-bound flag -
    in rank<R>.jsonl and on the console; steps not named are not profiled, and with the key
    empty no profiler exists."""
    import json
    lines = []
    cfg = tiny_config(small_dataset, "train.max_steps=4", "train.target_mlm_accuracy=0.99",
                      "train.profile_steps=[3, 2]", f'train.output_dir="{tmp_path}"')
    trainer = Trainer(cfg, single_ctx, log=lines.append)
    trainer.fit()
    trainer.close()
    assert f"profile: step(s) 2, 3 on every rank, traces in {tmp_path / 'profile'}" in lines
    recs = [json.loads(x) for x in (tmp_path / "profile" / "rank0.jsonl").read_text().split("\n")
            if x]
    assert [r["step"] for r in recs] == [2, 3]
    for r in recs:
        assert 0 < r["busy_s"] and 0 < r["wall_s"] and r["kernels"] > 50
        assert r["busy_source"] == "cpu ops" and isinstance(r["host_bound"], bool)
        assert r["host_bound"] == (r["wall_s"] > 1.5 * r["busy_s"])
        assert len(r["top"]) == 10 and r["top"][0]["us"] >= r["top"][-1]["us"]
        trace = json.loads(open(r["trace"]).read())
        assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == [
        "rank0.jsonl", "rank0_step2.pt.trace.json", "rank0_step3.pt.trace.json"]
    said = [x for x in lines if x.startswith("profile step")]
    assert len(said) == 2 and "busy" in said[0] and "trace" in said[0]
    off = Trainer(tiny_config(small_dataset), single_ctx)
    off.setup()
    assert off.profiler is None
    off.close()


def test_the_profiler_says_which_steps_a_resumed_run_will_profile(tmp_path):
    """Steps at or before the step a resume continues from were trained before: said, not
    silently skipped."""
    import torch
    from runtime.observe.profiler import StepProfiler
    prof = StepProfiler([12, 5, 20], tmp_path, 0, torch.device("cpu"))
    where = tmp_path / "profile"
    assert prof.plan(0) == f"profile: step(s) 5, 12, 20 on every rank, traces in {where}"
    assert prof.plan(12) == (f"profile: step(s) 20 on every rank, traces in {where}"
                             f"; step(s) 5, 12 came before step 12, where this run resumes: "
                             f"not profiled")
    assert prof.plan(20).startswith("profile: no step left to profile; step(s) 5, 12, 20 came")


def test_a_profiled_rank_prints_no_raw_kineto_lines():
    """torch.profiler's kineto printed two raw "USDT: ... profiler_start" / "profiler_stop"
    lines per profiled step and rank into the run's output: the rank entry point
    (submission.train) sets kineto's level first (one child process: a rank's profile)."""
    import os
    import subprocess
    import sys
    from submission.train import KINETO_QUIET
    from tests.support.launch import ROOT
    code = ("import os; from submission.train import quiet_profiler; quiet_profiler(); "
            "import torch; from torch.profiler import profile\n"
            "with profile() as p:\n    torch.ones(4).sum()\n"
            "print(os.environ['KINETO_LOG_LEVEL'], len(p.events()))")
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    level, events = proc.stdout.split()
    assert level == KINETO_QUIET and int(events) > 0   # it profiled
    assert "USDT" not in proc.stderr and "profiler_st" not in proc.stderr, proc.stderr
