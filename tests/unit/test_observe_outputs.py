"""What a run shows of itself, in this process: the progress line's throughput after a resume
(runtime.observe.metrics.ProgressPrinter) and the TensorBoard scalars
(runtime.observe.tensorboard.TensorBoardWriter), fed synthetic events.

The trainer's own ``samples_per_s`` of a resumed run, step by step:
tests/integration/test_checkpoint.py (the interrupted-and-resumed run)."""
from __future__ import annotations

import io

import pytest

import runtime.observe.metrics as metrics_module
from runtime.config import load_config
from runtime.events import Event, RunState, StepMetrics


def _step(step: int, samples: int, **extra) -> StepMetrics:
    return StepMetrics(step=step, samples=samples, loss=7.0, mlm_loss=6.0, nsp_loss=1.0,
                       lr=1e-3, grad_norm=1.0, clip_coef=1.0, step_time_s=0.5, real_tokens=96,
                       computed_tokens=128, extra=dict(extra), elapsed_s=2.0)


def test_the_progress_line_after_a_resume_counts_only_this_process_samples(monkeypatch):
    """Resumed at 1,000 samples, 160 more in 2 s: 80 samples/s, not 1,160 / 2 = 580."""
    now = [100.0]
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: now[0])
    state = RunState(config=load_config(None), rank=0, world_size=1, step=50, samples=1000,
                     resume={"step": 50, "samples": 1000})
    out = io.StringIO()
    printer = metrics_module.ProgressPrinter(every=10, stream=out)
    printer.on_event(Event.RUN_START, state)
    now[0] += 2.0
    state.step, state.samples = 60, 1160
    state.last_step = _step(60, 1160)
    state.logged_steps = [state.last_step]
    printer.on_event(Event.LOG, state)
    line = out.getvalue()
    assert "| 80.0 samples/s |" in line and "elapsed 0m02s" in line, line
    # the time left at that rate: the budget's samples past 1,160 at 80 a second
    budget = state.config.train.sample_budget()
    assert f"left <= {metrics_module._fmt_duration((budget - 1160) / 80.0)}" in line


def test_tensorboard_gets_throughput_tflops_and_mfu_from_the_step_records(tmp_path):
    """Every logged step's samples/s (the trainer's: this process's samples over its time),
    TFLOP/s per device and MFU are scalars against samples; a CPU step without MFU (None)
    writes no MFU point."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from runtime.observe.tensorboard import TensorBoardWriter
    state = RunState(config=load_config(None), rank=0, world_size=2)
    tb = TensorBoardWriter(tmp_path / "tb")
    tb.on_event(Event.RUN_START, state)
    state.logged_steps = [_step(1, 16, samples_per_s=40.0, tflops=1.5, mfu=0.25),
                          _step(2, 32, samples_per_s=42.0, tflops=1.75, mfu=None)]
    tb.on_event(Event.LOG, state)
    tb.on_event(Event.RUN_STOP, state)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    assert got["throughput/samples_per_s"] == [(16, 40.0), (32, 42.0)]
    assert got["throughput/tflops_per_device"] == [(16, 1.5), (32, 1.75)]
    assert got["throughput/mfu"] == [(16, 0.25)]
    assert got["loss/total"] == [(16, 7.0), (32, 7.0)]


def test_every_field_of_the_metrics_writer_is_on_the_schema_page(tmp_path):
    """docs/METRICS.md lists the fields MetricsWriter writes of itself (the step record's
    fixed fields, eval, resume, run_stop); the fields a run's parts add are held to it by the
    runs' own tests (tests/support/run_docs.py)."""
    from runtime.observe.metrics import MetricsWriter, read_records
    from tests.support.run_docs import documented, undocumented
    state = RunState(config=load_config(None), rank=0, world_size=1,
                     resume={"checkpoint": "c", "step": 1, "samples": 16, "world_size": 1,
                             "time": "t", "adopted_from_run": None, "notes": [],
                             "config_changes": [], "world_size_now": 1})
    writer = MetricsWriter(tmp_path / "metrics.jsonl")
    writer.on_event(Event.RUN_START, state)
    state.logged_steps = [_step(2, 32, samples_per_s=1.0)]
    writer.on_event(Event.LOG, state)
    writer.on_event(Event.EVAL_STOP, state)
    writer.on_event(Event.RUN_STOP, state)
    records = read_records(tmp_path / "metrics.jsonl")
    assert [r["kind"] for r in records] == ["resume", "step", "eval", "run_stop"]
    assert undocumented(records) == []
    assert undocumented([{"kind": "step", "pad_eff": 1.0}]) == ["step.pad_eff"]
    assert {"step", "eval", "resume", "run_stop"} <= set(documented())


def test_what_compiles_on_first_use_is_named_in_the_configs_words():
    """The trainer says it before the first step (runtime.train.trainer), so that a compile of
    tens of seconds is not silence; nothing compiles lazily by default."""
    def compiled_on_first_use(cfg):
        return cfg.compiles(on_first_use=True)
    # (the default's fused optimizer compiles when it is built, not in the first step)
    assert compiled_on_first_use(load_config(None)) == [] != load_config(None).compiles()
    layers = compiled_on_first_use(load_config(None, ["model.compile=layers"]))
    assert layers == ["model.compile='layers' (each encoder layer's forward and backward)"]
    fused = compiled_on_first_use(load_config(None, ['model.fusions=["bias_gelu", "qkv"]']))
    assert fused == ["model.fusions bias_gelu"]


def test_the_readme_names_every_entry_of_a_run_directory(tmp_path):
    """tests/support/run_docs.unlisted, which the runs' tests call on their real run
    directories: what the README's table of a run's outputs names, and what it would not."""
    from tests.support.run_docs import unlisted
    for name in ("mlperf_bert.log", "metrics.jsonl", "summary.json", "launcher.log", ".lock"):
        (tmp_path / name).write_text("")
    for name in ("ranks", "checkpoints", "tensorboard", "profile", ".armed"):
        (tmp_path / name).mkdir()
    for name in ("rank_00000.json", "rank_00001.log", "ends.jsonl"):
        (tmp_path / "ranks" / name).write_text("")
    assert unlisted(tmp_path) == []
    (tmp_path / "stray.txt").write_text("")
    (tmp_path / "ranks" / "other.json").write_text("")
    assert unlisted(tmp_path) == ["ranks/other.json", "stray.txt"]
