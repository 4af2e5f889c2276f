"""The projection picks the batch (runtime.calibrate.tune.project): a samples-to-target table
read and checked (CSV, a bench.batch_scaling record, the MLPerf reference points), interpolated
log-log inside its range and refused outside it; bad tables named with their file and row;
and per GPU count the global batch with the shortest predicted time to train. The command's
refusal of a bad table: tests/integration/test_batch_choice_integration.py."""
from __future__ import annotations

import json

import pytest

from runtime.calibrate.tune.project import (DATA, SamplesTable, choose_batch, load_profile)
from runtime.calibrate.tune.fabric import load_fabric


def test_tables_read_interpolate_and_refuse_outside_their_range(tmp_path):
    rcp = SamplesTable.rcp()
    assert rcp.rows[0] == (256, pytest.approx(rcp.rows[0][1])) and rcp.batches[1] >= 16384
    b0, s0 = rcp.rows[2]
    b1, s1 = rcp.rows[3]
    mid = rcp.samples_at(int((b0 * b1) ** 0.5))  # log-log: the geometric middle
    assert mid == pytest.approx((s0 * s1) ** 0.5, rel=1e-3)
    assert rcp.samples_at(b0) == pytest.approx(s0)
    with pytest.raises(ValueError, match=r"global batch 100000 is outside the table"):
        rcp.samples_at(100_000)
    csv = tmp_path / "t.csv"
    csv.write_text("# measured\nglobal_batch,samples\n64,2000\n512,3500\n")
    t = SamplesTable.read(csv)
    assert t.rows == ((64, 2000.0), (512, 3500.0)) and t.source == str(csv)
    record = tmp_path / "study.json"
    record.write_text(json.dumps({"samples_table": [[128, 2500], [64, 2000]]}))
    assert SamplesTable.read(record).rows == ((64, 2000.0), (128, 2500.0))
    samsung = SamplesTable.read(DATA / "samples_samsung_adam.csv")
    assert samsung.samples_at(16384) == 2932736
    with pytest.raises(ValueError, match="outside the table"):
        samsung.samples_at(8192)


@pytest.mark.parametrize("text,match", [
    ("global_batch,samples\n", "has no rows"),
    ("global_batch,samples\n64,2000\n64,2100\n", "global batch 64 appears twice"),
    ("global_batch,samples\n64,-5\n", r"row 1: batch 64, samples -5.0"),
    ("batch,n\n64,2000\n", "first line must be the header"),
    ("global_batch,samples\n64,lots\n", r"line 2: '64,lots'"),
])
def test_bad_tables_name_the_file_and_row(tmp_path, text, match):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as e:
        SamplesTable.read(path)
    assert "bad.csv" in str(e.value)


def test_the_chosen_batch_is_the_fastest_of_those_the_table_allows():
    gp, cpu, _ = load_profile(DATA / "a100_packed.toml")
    fabric = load_fabric(DATA / "dgx_a100_8xhdr.toml")
    # A table where samples grow fast past 1,024: on 64 GPUs the small batches must win
    steep = SamplesTable(((256, 2.0e6), (1024, 2.2e6), (4096, 9.0e6)), "steep")
    pts = choose_batch(gp, cpu, fabric, 64, steep)
    assert pts == sorted(pts, key=lambda p: p.ttt_s) and len(pts) >= 3
    assert all(256 <= p.global_batch <= 4096 and p.global_batch % 64 == 0 for p in pts)
    assert all(1 <= p.global_batch // 64 <= gp.max_local_batch for p in pts)
    best = pts[0]
    assert best.global_batch <= 1024 and best.samples == pytest.approx(
        steep.samples_at(best.global_batch))
    assert best.ttt_s == pytest.approx(best.steps * best.step_s + best.evals * best.eval_s)


def test_encoder_graphs_are_charged_the_allreduce_they_cannot_overlap():
    """An encoder graph's backward is one autograd node that hands back every gradient when it
    ends: no bucket starts during backward. The projection makes every gradient ready at the
    end of backward for train.cuda_graphs = 'encoder' and so charges the whole allreduce;
    'full' (collectives captured where backward launches them) keeps the eager overlap."""
    from dataclasses import replace
    from runtime.calibrate.tune.project import step_points
    gp, cpu, _ = load_profile(DATA / "a100_packed.toml")
    fabric = load_fabric(DATA / "dgx_a100_8xhdr.toml")
    points = {mode: {p.plan: p for p in step_points(replace(gp, cuda_graphs=mode), cpu, fabric,
                                                    64, 16, "global_after",
                                                    plans_wanted=["tuned"])}
              for mode in ("none", "encoder", "full")}
    eager, encoder, full = (points[m]["tuned"] for m in ("none", "encoder", "full"))
    assert full.step_s == eager.step_s and full.exposed_s == eager.exposed_s
    assert encoder.exposed_s > 2 * eager.exposed_s and encoder.step_s > eager.step_s
    with pytest.raises(ValueError, match="cuda_graphs must be none | encoder | full"):
        step_points(replace(gp, cuda_graphs="segmented"), cpu, fabric, 64, 16, "global_after")
