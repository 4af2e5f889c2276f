"""The gradient noise scale (runtime.observe.noise_scale): the estimator's arithmetic and its
n/a cases in process; through the real gradient syncs on 2 and 4 ranks (mpiexec), on a least
squares problem whose B_simple is known in closed form, the estimate over many steps within
its statistical error of the truth - with gradient accumulation too, and with a weight tied
between a lookup and a decoder as BERT's word embedding is, through the split tied sync - and
the same numbers whatever the loss scale, the clip mode or the sync (dense or split tied
embedding, DDP): the whole gradient's noise scale, never a part a sync left out."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.observe.noise_scale import NoiseScale, for_run
from tests.support.launch import needs_mpiexec
from tests.support.runs import run
from tests.support.tiny import run_overrides

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = Path(sys.executable).parent / "mpiexec"
SCRIPT = ROOT / "tests" / "dist_scripts" / "noise_scale.py"


def test_the_two_batch_estimates_and_their_ratio():
    est = NoiseScale(b_small=8, b_big=32, horizon_samples=0)  # no averaging: one step's
    # |G|² = 1 and tr(Σ) = 40 give E|G_b|² = 1 + 40/b: 6 at b = 8, 2.25 at b = 32
    fig = est.update(6.0, 2.25)
    assert fig["grad_sq_true"] == pytest.approx(1.0)
    assert fig["grad_trace_cov"] == pytest.approx(40.0)
    assert fig["noise_scale"] == pytest.approx(40.0)
    assert (fig["grad_sq_small"], fig["grad_sq_big"]) == (6.0, 2.25)  # the raw norms too
    assert fig["noise_scale_window_samples"] == 32  # this step's global batch alone


def test_undefined_estimates_are_none_never_a_wrong_number():
    est = NoiseScale(b_small=8, b_big=16, horizon_samples=1600)
    assert est.figures()["noise_scale"] is None          # no step yet
    assert est.figures()["noise_scale_window_samples"] == 0
    fig = est.update(1.0, 1.2)  # a noisy step: |G|² estimate > 0, tr(Σ) < 0
    assert fig["grad_trace_cov"] < 0 and fig["noise_scale"] is None
    fig = NoiseScale(b_small=8, b_big=16, horizon_samples=1600).update(1.0, 0.3)  # |G|² < 0
    assert fig["grad_sq_true"] < 0 and fig["noise_scale"] is None
    before = est.state_dict()
    assert est.update(float("nan"), 1.0) == est.figures() and est.state_dict() == before
    assert for_run(8, 2, world_size=1, horizon_samples=1600) is None  # one rank: unavailable
    with pytest.raises(ValueError, match="more than one rank"):
        NoiseScale(b_small=8, b_big=8, horizon_samples=1600)
    with pytest.raises(ValueError, match="horizon"):
        NoiseScale(b_small=8, b_big=16, horizon_samples=-1)


def _norms(g2: float, trace: float, b_small: int, b_big: int) -> tuple[float, float]:
    """The expected squared norms of a b-sequence mean gradient: |G|² + tr(Σ)/b."""
    return g2 + trace / b_small, g2 + trace / b_big


def test_a_step_change_is_tracked_within_the_stated_horizon():
    """The horizon is in samples, and says how fresh the figure is: after a change of the
    gradient's statistics, one horizon of samples later each average has moved at least
    1 − 1/e of the way, three horizons later it is within 5 % - at any batch; the record
    says how many samples the averages span."""
    for b_small, b_big in ((8, 32), (64, 512)):
        horizon = 50 * b_big if b_big == 32 else 20 * b_big
        est = for_run(b_small // 2, 2, world_size=b_big // b_small, horizon_samples=horizon)
        assert (est.b_small, est.b_big) == (b_small, b_big)
        fig = est.update(*_norms(1.0, 40.0, b_small, b_big))
        assert fig["noise_scale_window_samples"] == b_big            # one step so far
        for _ in range(3 * horizon // b_big):
            fig = est.update(*_norms(1.0, 40.0, b_small, b_big))
        assert fig["noise_scale"] == pytest.approx(40.0)             # constant input: exact
        for _ in range(300):
            fig = est.update(*_norms(1.0, 40.0, b_small, b_big))
        assert fig["noise_scale_window_samples"] == pytest.approx(horizon, rel=1e-3)
        samples = 0
        while samples < horizon:  # the statistics change: |G|² halves, tr(Σ) doubles
            fig = est.update(*_norms(0.5, 80.0, b_small, b_big))
            samples += b_big
        moved_g2 = (1.0 - fig["grad_sq_true"]) / 0.5
        moved_trace = (fig["grad_trace_cov"] - 40.0) / 40.0
        assert 1 - 1 / math.e <= moved_g2 < 0.75, moved_g2
        assert 1 - 1 / math.e <= moved_trace < 0.75, moved_trace
        while samples < 3 * horizon:
            fig = est.update(*_norms(0.5, 80.0, b_small, b_big))
            samples += b_big
        assert fig["noise_scale"] == pytest.approx(160.0, rel=0.10)
        assert fig["grad_sq_true"] == pytest.approx(0.5, rel=0.05)
        assert fig["grad_trace_cov"] == pytest.approx(80.0, rel=0.05)


def test_the_averages_survive_a_checkpoint_exactly():
    est = for_run(4, 2, world_size=4, horizon_samples=640)
    assert (est.b_small, est.b_big) == (8, 32)
    rng = np.random.default_rng(0)
    for _ in range(30):
        est.update(*(float(x) for x in rng.uniform(1, 6, 2)))
    again = for_run(4, 2, world_size=4, horizon_samples=640)
    again.load_state_dict(est.state_dict())
    assert again.figures() == est.figures()
    for _ in range(10):  # and go on to the same numbers, bit for bit
        small, big = (float(x) for x in rng.uniform(1, 6, 2))
        assert again.update(small, big) == est.update(small, big)
    other = for_run(4, 1, world_size=4, horizon_samples=640)  # another batch shape: over
    other.load_state_dict(est.state_dict())
    assert other.steps == 0


def test_a_checkpoint_of_the_per_step_decay_estimator_loads_exactly():
    """Checkpoints written before the horizon was a key hold bias-corrected EMAs with a
    per-step decay (0.99): they load as the same averages."""
    old = {"steps": 0, "g2_ema": 0.0, "trace_ema": 0.0, "b_small": 8, "b_big": 32,
           "decay": 0.99}
    rng = np.random.default_rng(1)
    fresh = for_run(4, 2, world_size=4, horizon_samples=3200)  # decay 1 − 32/3200 = 0.99
    for _ in range(40):
        g2, trace = (float(x) for x in rng.uniform(0.5, 2.0, 2))
        old["steps"] += 1
        old["g2_ema"] = 0.99 * old["g2_ema"] + 0.01 * g2
        old["trace_ema"] = 0.99 * old["trace_ema"] + 0.01 * trace * 30
        fresh.update(*_norms(g2, trace * 30, 8, 32))
    loaded = for_run(4, 2, world_size=4, horizon_samples=3200)
    loaded.load_state_dict(old)
    correction = 1 - 0.99 ** 40
    assert loaded.figures()["grad_sq_true"] == pytest.approx(old["g2_ema"] / correction,
                                                             rel=1e-12)
    for key in ("grad_sq_true", "grad_trace_cov", "noise_scale"):
        assert loaded.figures()[key] == pytest.approx(fresh.figures()[key], rel=1e-9)


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
