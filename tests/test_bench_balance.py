"""bench.balance: the simulation's arithmetic, the packing bound, variant names and the
metrics parsing (the timed parts are benchmarks, not tests)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from bench.balance import (packing_bound, parse_balance, rank_costs, simulate,
                           variant_overrides, virtual_shards)
from loaders.dataset import DataSetInfo, read_lengths


def test_rank_costs():
    lengths = np.array([100, 28, 60, 60])
    assert rank_costs(lengths, "random", 128) == (248, 400, 100**2 + 28**2 + 2 * 60**2)
    # packed: [100, 28] and [60, 60] → 2 rows of width 128
    assert rank_costs(lengths, "pack", 128)[:2] == (248, 256)


def test_packing_bound_is_best_fit_decreasing():
    b = packing_bound(np.array([100, 70, 60, 30, 28, 10]), 128)
    # longest first, each into the fullest row it fits: [100, 28], [70, 30, 10], [60]
    assert b["rows"] == 3 and b["samples_longer_than_half"] == 2
    assert b["padding_efficiency"] == pytest.approx(298 / 384)


def test_virtual_shards_cover_every_sample_once():
    lengths = [np.arange(10), np.arange(10, 25)]
    parts = virtual_shards(lengths, 5)
    assert len(parts) >= 5 and sorted(np.concatenate(parts).tolist()) == list(range(25))
    assert virtual_shards(lengths, 2) == lengths


def test_simulation_on_real_text(small_dataset):
    lengths = read_lengths(DataSetInfo.read(small_dataset))
    rows = {mode: simulate(lengths, mode, 4, 8, 8) for mode in ("random", "local", "pack")}
    assert all(0 < r["padding_efficiency"] <= 1 for r in rows.values())
    assert rows["pack"]["padding_efficiency"] > rows["random"]["padding_efficiency"]
    assert rows["local"]["imbalance_real"] < rows["random"]["imbalance_real"]
    assert rows["local"]["group"] == 4 and rows["random"]["group"] is None


def test_variants_and_metrics_parsing(tmp_path):
    assert variant_overrides("local+unpadded") == ["data.balance=local", "model.attention=unpadded"]
    with pytest.raises(SystemExit, match="MODE or MODE\\+unpadded"):
        variant_overrides("sorted")
    steps = [{"kind": "step", "step_time_s": t, "real_tokens": 75, "computed_tokens": 100,
              "real_tokens_all": 150, "computed_tokens_all": 200, "imbalance_tokens": 1.0,
              "imbalance_compute": 1.1} for t in (9.0, 1, 1, 1, 1, 2, 2, 2)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(s) for s in steps + [{"kind": "eval"}]))
    got = parse_balance(path)
    assert got["median_step_time_s"] == 2 and got["pad_eff"] == 0.75  # first 5 steps skipped
    assert got["imbalance_compute"] == pytest.approx(1.1) and got["steps_measured"] == 8
