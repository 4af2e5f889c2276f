"""The gradient noise scale (runtime.observe.noise_scale) through the real gradient syncs on 2
and 4 ranks (mpiexec), on a least squares problem whose B_simple is known in closed form: the
estimate over many steps within its statistical error of the truth - with gradient
accumulation too, and with a weight tied between a lookup and a decoder as BERT's word
embedding is, through the split tied sync - and the same numbers whatever the loss scale, the
clip mode or the sync (dense or split tied embedding, DDP): the whole gradient's noise scale,
never a part a sync left out. The estimator's arithmetic: tests/unit/test_noise_scale.py."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.launch import MPIEXEC, ROOT, needs_mpiexec
from tests.support.runs import run
from tests.support.tiny import run_overrides

SCRIPT = ROOT / "tests" / "dist_scripts" / "noise_scale.py"


def _estimate(case: dict) -> tuple[float, float]:
    """Ratio of the mean unbiased |G|² and tr(Σ) estimates over the steps, and its standard
    error from 20 batches of steps."""
    s, b = np.array(case["small_sq"]), np.array(case["big_sq"])
    bs, bb = case["b_small"], case["b_big"]
    g2 = (bb * b - bs * s) / (bb - bs)
    tr = (s - b) / (1 / bs - 1 / bb)
    chunks = np.array_split(np.arange(len(s)), 20)
    ratios = [tr[c].mean() / g2[c].mean() for c in chunks]
    return tr.mean() / g2.mean(), float(np.std(ratios) / math.sqrt(len(ratios)))


@pytest.mark.slow
@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"{MPIEXEC} missing (pip mpich)")
@pytest.mark.parametrize("ranks", [2, 4])
def test_the_estimate_matches_the_closed_form_through_the_real_syncs(ranks, tmp_path):
    base = dict(sync_kind="buckets", clip_mode="global_after", loss_scale=1.0, seed=1)
    cases = {"accum1": dict(base, steps=1000, accum=1)}
    if ranks == 2:  # accumulation (B_small = 2 micro-batches), at 2 ranks (4 ranks on 2 cores:
        # half this test's time); the same data through every mode and sync: the same numbers
        cases["accum2"] = dict(base, steps=600, accum=2)
        same = dict(base, steps=30, accum=1, seed=2)
        cases.update({"ref": same, "fp16_scale": dict(same, loss_scale=1024.0),
                      "local_before": dict(same, clip_mode="local_before"),
                      "bucket_before": dict(same, clip_mode="bucket_before"),
                      "none": dict(same, clip_mode="none"), "ddp": dict(same, sync_kind="ddp")})
        # the tied weight: the closed form through the split sync, and the same numbers from
        # the split, the dense and DDP's sync on the same data (with accumulation: the
        # decoder's share and the lookup's rows summed over micro-steps, as the other buckets)
        cases["tied_split"] = dict(base, model="tied", steps=1000, accum=1)
        tied = dict(base, model="tied", steps=30, accum=2, seed=3)
        cases.update({"tied_ref": dict(tied, tied="split"),
                      "tied_scaled": dict(tied, tied="split", loss_scale=1024.0),
                      "tied_dense": dict(tied, tied="dense"),
                      "tied_ddp": dict(tied, sync_kind="ddp")})
    out = tmp_path / "noise.json"
    proc = subprocess.run([str(MPIEXEC), "-n", str(ranks), sys.executable, str(SCRIPT),
                           str(out), json.dumps(cases)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    for name in [n for n in ("accum1", "accum2", "tied_split") if n in cases]:
        case = got[name]
        assert case["b_small"] == 8 * (2 if name == "accum2" else 1)
        assert case["b_big"] == case["b_small"] * ranks
        estimate, se = _estimate(case)
        truth = case["true_noise_scale"]
        assert se < 0.1 * truth, (name, se)  # enough steps for the check to mean something
        assert abs(estimate - truth) < 4 * se, (name, estimate, truth, se)
        assert case["figures"]["noise_scale"] is not None  # the averaged online value
    if ranks == 2:
        ref = got["ref"]
        for name in ("fp16_scale", "local_before", "bucket_before", "none", "ddp"):
            for key in ("small_sq", "big_sq"):
                np.testing.assert_allclose(got[name][key], ref[key], rtol=1e-5, err_msg=name)
        assert got["tied_split"]["split"] and got["tied_ref"]["split"]
        assert not got["tied_dense"]["split"]
        for name in ("tied_scaled", "tied_dense", "tied_ddp"):
            for key in ("small_sq", "big_sq"):
                np.testing.assert_allclose(got[name][key], got["tied_ref"][key], rtol=1e-5,
                                           err_msg=name)


def _logged(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text()
                                      .splitlines()) if r["kind"] == "step"}


@pytest.mark.slow
@needs_mpiexec
def test_dense_and_split_tied_sync_log_the_same_noise_scale(small_dataset, tmp_path):
    """The same run (seed, data, 2 ranks) with the tied embedding's gradient reduced whole
    and split in two shares trains the same model; the noise scale it logs is the whole
    gradient's in both, so it must be the same - the split once left the tied weight (90 % of
    this model) out of both norms and logged another quantity (23 against 135 at step 20).
    The record, the progress line and the MLPerf log say what window the figure averages."""
    logs, outs = {}, {}
    for tied in ("dense", "split"):
        run_dir = tmp_path / tied
        rc, out, err = run(run_dir, run_overrides(
            small_dataset, **{"train.tied_embedding_sync": f'"{tied}"', "train.max_steps": 40,
                              "train.log_every_steps": 5, "train.target_mlm_accuracy": 0.99,
                              "train.noise_scale_horizon_samples": 160,  # 10 steps of 16
                              "train.eval_iter_start_samples": 640,
                              "train.eval_iter_samples": 640}))
        assert rc == 1, out[-3000:] + err[-3000:]   # the step budget ends it
        logs[tied], outs[tied] = _logged(run_dir), out
    dense, split = logs["dense"], logs["split"]
    assert sorted(dense) == sorted(split) == list(range(1, 41))
    for step in range(1, 41):  # the same training (the sums differ in order only) and the
        # same two norms every step: the whole local gradient, the whole averaged one
        for key in ("loss", "grad_sq_small", "grad_sq_big"):
            assert split[step][key] == pytest.approx(dense[step][key], rel=1e-4), (step, key)
        assert dense[step]["noise_scale_window_samples"] == \
            split[step]["noise_scale_window_samples"] <= min(16 * step, 160)
    assert dense[40]["noise_scale_window_samples"] == pytest.approx(160, rel=0.02)
    compared = 0
    for step in range(10, 41):  # after the first horizon
        a, b = dense[step]["noise_scale"], split[step]["noise_scale"]
        assert (a is None) == (b is None), (step, a, b)
        if a is not None:
            assert b == pytest.approx(a, rel=0.10), (step, a, b)
            compared += 1
    assert compared >= 10, [dense[s]["noise_scale"] for s in range(10, 41)]
    line = [x for x in outs["split"].splitlines() if x.startswith("step 40 ")]
    assert line and re.search(r"B_noise (\d+|n/a) \(last 15\d samples\)", line[0]), line
    events = [json.loads(x.split(":::MLLOG ", 1)[1]) for x in
              (tmp_path / "split" / "mlperf_bert.log").read_text().splitlines()
              if "presto_gradient_noise_scale" in x]
    assert events and 150 <= events[-1]["metadata"]["window_samples"] <= 160, events[-1]
