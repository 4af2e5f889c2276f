"""bench.balance: the simulation's arithmetic, the packing bound, variant names and the
metrics parsing (the timed parts are benchmarks, not tests)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from bench.balance import (CPU_SHAPE, data_seq_len, main, packing_bound, padding_efficiency,
                           parse_balance, rank_costs, rank_rows, simulate, variant_overrides,
                           virtual_shards)
from loaders.dataset import DataSetInfo, read_lengths
from loaders.length_cost import LengthCost, flops_cost


def test_rank_costs():
    costs = {"unpadded": LengthCost.of("unpadded", real_tokens=1.0, attention=0.01),
             "padded": LengthCost.of("padded", padded_tokens=1.0, rows=5.0)}
    lengths = np.array([100, 28, 60, 60])
    squares = 100**2 + 28**2 + 2 * 60**2
    assert rank_costs(rank_rows(lengths, "random", 128), costs) == pytest.approx(
        [248, 400, squares, 248 + 0.01 * squares, 400 + 20])
    # packed: [100, 28] and [60, 60] → 2 rows of width 128
    rows = rank_rows(lengths, "pack", 128)
    assert sorted(map(sorted, rows)) == [[28, 100], [60, 60]]
    assert rank_costs(rows, costs)[:2] == [248, 256] and rank_costs(rows, costs)[4] == 266


def test_packing_bound_is_best_fit_decreasing():
    b = packing_bound(np.array([100, 70, 60, 30, 28, 10]), 128)
    # longest first, each into the fullest row it fits: [100, 28], [70, 30, 10], [60]
    assert b["rows"] == 3 and b["samples_longer_than_half"] == 2 and b["samples"] == 6
    assert b["padding_efficiency"] == pytest.approx(298 / 384)


def test_virtual_shards_cover_every_sample_once():
    lengths = [np.arange(10), np.arange(10, 25)]
    parts = virtual_shards(lengths, 5)
    assert len(parts) >= 5 and sorted(np.concatenate(parts).tolist()) == list(range(25))
    assert virtual_shards(lengths, 2) == lengths


def test_simulation_on_real_text(small_dataset):
    lengths = read_lengths(DataSetInfo.read(small_dataset))
    costs = {layout: flops_cost(CPU_SHAPE, layout) for layout in ("unpadded", "padded")}
    rows = {mode: simulate(lengths, mode, 4, 8, 8, costs=costs)
            for mode in ("random", "local", "pack", "offline_pack")}
    assert all(0 < r["padding_efficiency"] <= 1 for r in rows.values())
    assert rows["pack"]["padding_efficiency"] > rows["random"]["padding_efficiency"]
    assert rows["offline_pack"]["padding_efficiency"] > rows["pack"]["padding_efficiency"]
    assert rows["local"]["imbalance_cost_unpadded"] < rows["random"]["imbalance_cost_unpadded"]
    assert rows["offline_pack"]["imbalance_cost_padded"] < 1.02
    assert rows["local"]["group"] == 4 and rows["random"]["group"] is None
    assert rows["local"]["sequences_per_rank"] == [8, 8]
    lo, hi = rows["offline_pack"]["sequences_per_rank"]
    assert lo <= 8 <= hi


def test_cli_reads_the_row_length_from_the_data_set(small_dataset, tmp_path, capsys):
    info = DataSetInfo.read(small_dataset)
    assert data_seq_len(info, read_lengths(info)) == 128
    out = tmp_path / "rec.json"
    assert main(["--data", str(small_dataset), "--worlds", "4", "--modes", "local,offline_pack",
                 "--attention", "0", "--no-loaders", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["seq_len"] == 128 and rec["batch"] == 32
    assert [r["mode"] for r in rec["simulation"]] == ["local", "offline_pack"]
    assert set(rec["costs"]) == {"unpadded", "padded"}
    assert "| offline_pack | 4 |" in capsys.readouterr().out


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
    assert got["median_step_time_s"] == 2 and got["padding_efficiency"] == 0.75  # 5 skipped
    assert padding_efficiency(got) == padding_efficiency({"pad_eff": 0.75}) == 0.75  # old records
    assert got["imbalance_compute"] == pytest.approx(1.1) and got["steps_measured"] == 8
