"""runtime.observe.balance_meter in a run: a one-process fit of the tiny model
(tests/support/tiny.py) writes per-step padding efficiency and imbalance into StepMetrics.extra,
metrics.jsonl and the progress line, in each balanced mode. The arithmetic:
tests/unit/test_balance_metrics_unit.py; the values reduced across 2 real ranks:
tests/ranks/test_balance_metrics_ranks.py."""
from __future__ import annotations

import io
import json

import pytest

from runtime.events import CallbackList
from runtime.observe.metrics import MetricsWriter, ProgressPrinter
from runtime.train.trainer import Trainer
from tests.support.run_docs import undocumented
from tests.support.tiny import tiny_config


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
    assert undocumented(steps) == []                        # docs/METRICS.md lists each field
    for r in steps:
        assert r["imbalance_tokens"] == r["imbalance_real"] == 1.0  # one rank
        assert r["real_tokens_all"] == r["real_tokens"] > 0
        assert r["computed_tokens_all"] == r["computed_tokens"]
        assert r["padding_efficiency"] == pytest.approx(r["real_tokens"] / r["computed_tokens"])
        assert r["compute_s_max"] > 0 and r["imbalance_compute"] == pytest.approx(1.0)
        if attention == "unpadded":
            assert r["padding_efficiency"] == 1.0
        else:
            assert r["padding_efficiency"] < 1.0
    assert "pad-eff" in stream.getvalue() and "imbalance tok 1.000" in stream.getvalue()
