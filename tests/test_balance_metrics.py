"""runtime.observe.balance_meter: per-step padding efficiency and imbalance, reduced across real ranks,
in StepMetrics.extra, metrics.jsonl and the progress line; the balanced modes train (the tiny
model of tests/support/tiny.py; 2 real ranks under mpiexec: slow)."""
from __future__ import annotations

import io
import json

import pytest

from runtime.observe.balance_meter import step_balance
from runtime.events import CallbackList
from runtime.observe.metrics import MetricsWriter, ProgressPrinter
from runtime.train.trainer import Trainer
from tests.support.launch import needs_mpiexec, run_script, tail
from tests.support.tiny import tiny_config


def test_step_balance_arithmetic():
    total = {"real": 300.0, "computed": 400.0, "compute_s": 3.0, "load_s": 0.2}
    top = {"real": 180.0, "computed": 256.0, "compute_s": 2.0, "load_s": 0.15}
    got = step_balance(total, top, world_size=2)
    assert got["pad_eff"] == 0.75
    assert got["imbalance_tokens"] == 256 / 200 and got["imbalance_real"] == 180 / 150
    assert got["imbalance_compute"] == 2.0 / 1.5
    assert (got["compute_s_max"], got["compute_s_mean"], got["load_s_max"]) == (2.0, 1.5, 0.15)
    got = step_balance({**total, "cost": 10.0}, {**top, "cost": 6.0}, world_size=2)
    assert got["imbalance_cost"] == 6.0 / 5.0


@pytest.mark.parametrize("balance,attention,loader", [
    ("random", "padded", "torch"), ("pack", "unpadded", "torch"), ("local", "padded", "dali"),
    ("pack", "padded", "torch"), ("offline_pack", "padded", "torch")])
def test_fit_writes_balance_metrics_and_progress(small_dataset, single_ctx, tmp_path,
                                                 balance, attention, loader):
    if loader == "dali":
        pytest.importorskip("nvidia.dali")
    cfg = tiny_config(small_dataset, f"data.balance={balance}", f"model.attention={attention}",
                      f"data.loader={loader}",
                      "train.max_steps=4", "train.eval_iter_start_samples=64",
                      "train.eval_iter_samples=64", "train.target_mlm_accuracy=0.99")
    stream = io.StringIO()
    callbacks = CallbackList([MetricsWriter(tmp_path / "metrics.jsonl"),
                              ProgressPrinter(every=2, stream=stream)])
    trainer = Trainer(cfg, single_ctx, callbacks)
    state = trainer.fit()
    trainer.close()
    assert state.step == 4
    steps = [r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "step"]
    assert len(steps) == 4
    for r in steps:
        assert r["imbalance_tokens"] == r["imbalance_real"] == 1.0  # one rank
        assert r["real_tokens_all"] == r["real_tokens"] > 0
        assert r["computed_tokens_all"] == r["computed_tokens"]
        assert r["pad_eff"] == pytest.approx(r["real_tokens"] / r["computed_tokens"])
        assert r["compute_s_max"] > 0 and r["imbalance_compute"] == pytest.approx(1.0)
        if attention == "unpadded":
            assert r["pad_eff"] == 1.0
        else:
            assert r["pad_eff"] < 1.0
    assert "pad-eff" in stream.getvalue() and "imbalance tok 1.000" in stream.getvalue()


@pytest.mark.slow  # a 2-rank mpiexec launch
@needs_mpiexec
def test_two_ranks_reduce_tokens_and_time(small_dataset, tmp_path):
    proc = run_script(2, "balance_steps.py", small_dataset, tmp_path, "global", "padded",
                      timeout=180)
    assert proc.returncode == 0, tail(proc)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for step in range(3):
        local = [r["steps"][step]["local"] for r in ranks]
        # every rank holds the reduced values; TFLOP/s and MFU divide them by this rank's own
        # step time (runtime.observe.step_log), so they may differ in the last digits
        own = ("tflops", "mfu")
        extra, other = ({k: v for k, v in r["steps"][step]["extra"].items() if k not in own}
                        for r in ranks)
        assert extra == other
        for r in ranks:
            assert r["steps"][step]["extra"]["tflops"] > 0
        real = [x["real"] for x in local]
        computed = [x["computed"] for x in local]
        cost = [x["cost"] for x in local]
        assert min(cost) > 0 and extra["imbalance_cost"] == pytest.approx(max(cost) / (sum(cost) / 2))
        assert extra["real_tokens_all"] == sum(real)
        assert extra["pad_eff"] == pytest.approx(sum(real) / sum(computed))
        assert extra["imbalance_real"] == pytest.approx(max(real) / (sum(real) / 2))
        assert extra["imbalance_tokens"] == pytest.approx(max(computed) / (sum(computed) / 2))
        times = [x["compute_s"] for x in local]
        assert extra["compute_s_max"] == pytest.approx(max(times))
        assert extra["imbalance_compute"] == pytest.approx(max(times) / (sum(times) / 2))
        for r in ranks:
            s = r["steps"][step]
            assert s["computed_tokens"] == s["local"]["computed"]
