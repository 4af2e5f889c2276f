"""submission.mllog_callback, in this process: a synthetic run through the callback
(``simulate``, tests/support/mllog.py) logs every closed BERT key exactly once with the
conventions the rules ask (samples as the epoch unit, derived values over the config, the
dataset sizes once known, aborted for an unknown status), only the main rank writes, nothing
reaches the root logger, and a full disk ends the run naming the log.

The REAL MLPerf compliance checker judging such logs, and the rerun after a full disk:
tests/integration/test_mllog_integration.py."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

import mlperf_logging
from runtime.config import load_config
from runtime.events import Event, RunState
from submission.mllog_callback import COMPLIANCE_RULESET, MLPerfLogger, hyperparameters
from tests.support.mllog import CLOSED_ACCS, DGX_1NODE, PROXY, TRAIN_SAMPLES, simulate
from tests.support.mllog import mllog_events as parse

RULES = Path(mlperf_logging.__file__).parent / "compliance_checker"


# ------------------------------------------------------------------ content and conventions

def test_every_closed_bert_key_is_logged_exactly_once(tmp_path):
    records = parse(simulate(tmp_path / "c.log", CLOSED_ACCS))
    keys = [r["key"] for r in records]
    rules = yaml.safe_load((RULES / f"training_{COMPLIANCE_RULESET}" / "closed_bert.yaml").read_text())
    required = {r["KEY"]["NAME"] for r in rules if r["KEY"].get("REQ") == "EXACTLY_ONE"}
    required |= {"gradient_accumulation_steps", "submission_benchmark", "submission_division",
                 "submission_org", "submission_platform", "submission_status", "train_samples",
                 "eval_samples", "init_stop", "run_start", "run_stop", "seed", "d_batch_size",
                 "max_predictions_per_seq"}
    for key in required:
        assert keys.count(key) == 1, key
    values = {r["key"]: r["value"] for r in records}
    assert values["global_batch_size"] == 448 and values["d_batch_size"] == 56
    assert values["opt_base_learning_rate"] == 4.25e-4 and values["opt_lamb_epsilon"] == 1e-6
    assert values["opt_learning_rate_training_steps"] == 6700
    assert values["submission_benchmark"] == "bert" and values["submission_division"] == "closed"
    assert values["train_samples"] == TRAIN_SAMPLES and values["eval_samples"] == 10_000
    assert values["cache_clear"] is True
    # Hyperparameters sit between init_start and init_stop, before the timed region.
    assert keys.index("init_start") < keys.index("opt_lamb_beta_1") < keys.index("init_stop") \
        < keys.index("run_start")


def test_samples_are_the_epoch_unit(tmp_path):
    records = parse(simulate(tmp_path / "c.log", CLOSED_ACCS))
    evals = [r for r in records if r["key"] == "eval_accuracy"]
    assert [r["value"] for r in evals] == CLOSED_ACCS
    # 150000 samples per eval at 448 per step: 335 steps = 150080 samples per block.
    assert [r["metadata"]["epoch_num"] for r in evals] == [150_080 * i for i in range(1, 7)]
    blocks = [r for r in records if r["key"] == "block_start"]
    assert [(b["metadata"]["first_epoch_num"], b["metadata"]["epoch_count"]) for b in blocks] \
        == [(150_080 * i, 150_080) for i in range(6)]
    stops = [r["metadata"]["first_epoch_num"] for r in records if r["key"] == "block_stop"]
    assert stops == [150_080 * i for i in range(6)]
    run_stop = [r for r in records if r["key"] == "run_stop"][0]
    assert run_stop["metadata"]["status"] == "success"
    # file/lineno name this module (default_stack_offset), relative to the repository.
    assert all(r["metadata"]["file"] == "submission/mllog_callback.py" for r in records)


def test_derived_values_win_over_the_config(tmp_path):
    derived = {"lr": 1.234e-3, "local_batch_size": 28, "gradient_accumulation_steps": 2,
               "warmup_steps": 10, "start_warmup_step": -3, "total_steps": 999,
               "cache_clear": False}
    values = {r["key"]: r["value"] for r in parse(
        simulate(tmp_path / "d.log", [0.721], derived=derived))}
    assert values["opt_base_learning_rate"] == 1.234e-3
    assert values["d_batch_size"] == 28 and values["gradient_accumulation_steps"] == 2
    assert values["opt_learning_rate_warmup_steps"] == values["num_warmup_steps"] == 10
    assert values["start_warmup_step"] == -3 and values["opt_learning_rate_training_steps"] == 999
    assert values["cache_clear"] is False


def test_cache_clear_argument_wins(tmp_path):
    records = parse(simulate(tmp_path / "cc.log", [0.721], derived={"cache_clear": True},
                             cache_clear=False))
    assert [r["value"] for r in records if r["key"] == "cache_clear"] == [False]


def test_scaled_lr_must_come_from_the_trainer():
    cfg = load_config(DGX_1NODE, ["optim.lr_scaling=sqrt", "optim.base_global_batch_size=256"])
    with pytest.raises(ValueError, match=r"derived\['lr'\]"):
        hyperparameters(RunState(config=cfg, rank=0, world_size=8))
    hp = hyperparameters(RunState(config=cfg, rank=0, world_size=8, derived={"lr": 5e-4}))
    assert hp["opt_base_learning_rate"] == 5e-4


def test_other_optimizers_log_their_own_keys():
    cfg = load_config(DGX_1NODE, ["optim.name=adamw", *PROXY])
    hp = hyperparameters(RunState(config=cfg, rank=0, world_size=8))
    assert hp["opt_name"] == "adamw" and hp["opt_adamw_beta_2"] == 0.999
    assert not any(k.startswith("opt_lamb") for k in hp)


def test_tracked_stats_rate(tmp_path):
    def count(**kw):
        return sum(r["key"] == "tracked_stats"
                   for r in parse(simulate(tmp_path / "t.log", [0.721], **kw)))
    assert count(tracked_stats_every=0) == 0
    assert count(tracked_stats_every=100) == 3              # 335 steps
    assert count() == 335 // 50                             # config train.log_every_steps = 50


def test_dataset_sizes_wait_until_known(tmp_path):
    """A trainer that learns train_samples late still gets exactly one, before run_stop."""
    log = tmp_path / "late.log"
    cfg = load_config(DGX_1NODE)
    state = RunState(config=cfg, rank=0, world_size=8)
    cb = MLPerfLogger(log, is_main=True)
    for ev in (Event.INIT_START, Event.INIT_STOP, Event.RUN_START):
        cb.on_event(ev, state)
    state.eval_samples, state.eval_accuracy, state.samples = 10_000, 0.721, 448
    cb.on_event(Event.EVAL_START, state)
    cb.on_event(Event.EVAL_STOP, state)
    state.train_samples, state.status = 12345, "success"
    cb.on_event(Event.RUN_STOP, state)
    keys = [r["key"] for r in parse(log)]
    assert keys.count("train_samples") == keys.count("eval_samples") == 1
    assert keys.index("eval_accuracy") < keys.index("eval_samples")
    assert keys.index("train_samples") == len(keys) - 2 and keys[-1] == "run_stop"


def test_unknown_status_is_logged_as_aborted(tmp_path):
    records = parse(simulate(tmp_path / "s.log", [0.5], status=None))
    assert records[-1]["key"] == "run_stop" and records[-1]["metadata"]["status"] == "aborted"


# ------------------------------------------------------------------ ranks and output streams

def test_only_the_main_rank_writes(tmp_path):
    cfg = load_config(DGX_1NODE)
    log = tmp_path / "sub" / "rank1.log"
    cb = MLPerfLogger(log, is_main=False)
    state = RunState(config=cfg, rank=1, world_size=8, status="success")
    for ev in Event:
        cb.on_event(ev, state)
    assert not log.exists() and not log.parent.exists()


def test_silent_by_default_and_never_uses_the_root_logger(tmp_path, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    simulate(tmp_path / "q.log", [0.721])
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
    assert not caplog.records


def test_echo_prints_the_same_lines(tmp_path, capsys):
    log = simulate(tmp_path / "e.log", [0.721], echo=True)
    printed = [ln for ln in capsys.readouterr().out.splitlines() if ln]
    assert printed == log.read_text().splitlines()
    assert all(ln.startswith(":::MLLOG {") for ln in printed)


def test_two_loggers_keep_to_their_own_files(tmp_path):
    a = simulate(tmp_path / "a.log", [0.721])
    b = simulate(tmp_path / "b.log", [0.5, 0.721])
    keys_a = [r["key"] for r in parse(a)]
    keys_b = [r["key"] for r in parse(b)]
    assert keys_a.count("run_start") == keys_b.count("run_start") == 1
    assert keys_a.count("eval_accuracy") == 1 and keys_b.count("eval_accuracy") == 2


def test_a_full_disk_ends_the_run_naming_the_log_instead_of_losing_lines(tmp_path):
    """/dev/full answers every write with ENOSPC: the MLPerf log and the metrics file raise
    LogWriteError (exit 3) naming the file - logging's default would print the error and go
    on without the line."""
    from runtime.observe.metrics import LogWriteError, MetricsWriter
    from submission.train import exit_code_of
    cfg = load_config(DGX_1NODE)
    state = RunState(config=cfg, rank=0, world_size=8)
    cb = MLPerfLogger(Path("/dev/full"), is_main=True)
    cb.on_event(Event.INIT_START, state)
    cb.on_event(Event.INIT_STOP, state)
    with pytest.raises(LogWriteError, match=r"cannot write /dev/full \(No space left") as e:
        cb.on_event(Event.RUN_START, state)
        state.eval_samples, state.eval_accuracy, state.samples = 10_000, 0.5, 448
        cb.on_event(Event.EVAL_START, state)
        cb.on_event(Event.EVAL_STOP, state)
    assert exit_code_of(e.value) == 3
    metrics = MetricsWriter(Path("/dev/full"))
    with pytest.raises(LogWriteError, match="/dev/full"):
        metrics.on_event(Event.RUN_START, state)
        metrics.on_event(Event.EVAL_STOP, state)
