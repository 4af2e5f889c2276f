"""The step timeline (runtime.observe.timeline) recorded into a run's metrics and drawn, in one
process. The rest of the buckets' tests: tests/unit/test_buckets.py,
tests/ranks/test_buckets_ranks.py."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from runtime.observe.timeline import plot_timeline
from tests.support.launch import ROOT
from tests.support.run_docs import undocumented
from tests.support.tiny import tiny_config

# ---------------------------------------------------------------------------------------------
# timeline


def test_timeline_is_recorded_into_metrics_and_drawn(small_dataset, tmp_path, single_ctx):
    from runtime.events import CallbackList
    from runtime.observe.metrics import MetricsWriter
    from runtime.train.trainer import Trainer
    ctx = single_ctx
    cfg = tiny_config(small_dataset, "train.global_batch_size=8", "train.timeline=true",
                      "train.max_steps=2", "train.eval_iter_start_samples=16",
                      "train.eval_iter_samples=16", "train.clip_mode=bucket_before",
                      "data.eval_batch_size=64", "train.bucket_cap_mb=1")
    metrics = tmp_path / "metrics.jsonl"
    trainer = Trainer(cfg, ctx, CallbackList([MetricsWriter(metrics)]))
    trainer.fit()
    trainer.close()
    steps = [json.loads(line) for line in metrics.read_text().splitlines()
             if json.loads(line)["kind"] == "step"]
    assert len(steps) == 2
    assert undocumented(steps) == []                        # docs/METRICS.md lists each field
    for rec in steps:
        b = rec["timeline"]["buckets"]
        assert len(b["launch"]) == rec["buckets"] == len(b["bytes"]) > 1
        assert all(r is not None and r <= l <= d for r, l, d in zip(b["ready"], b["launch"], b["done"]))
        assert {"comm_s", "exposed_comm_s", "overlap_frac", "clip_coef_min", "clip_coef_mean",
                "local_grad_norm"} <= set(rec)
    png = tmp_path / "t.png"
    out = subprocess.run([sys.executable, "-m", "runtime.observe.timeline", str(metrics), "--out", str(png)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert png.stat().st_size > 10_000
    with pytest.raises(ValueError, match="step 7 has no timeline"):
        plot_timeline(metrics, tmp_path / "x.png", step=7)
