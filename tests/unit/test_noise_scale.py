"""The gradient noise scale (runtime.observe.noise_scale) in process: the estimator's arithmetic,
its n/a cases, its horizon, its checkpoint. Through the real syncs on 2 and 4 ranks:
tests/ranks/test_noise_scale_ranks.py."""
from __future__ import annotations

import math

import numpy as np
import pytest

from runtime.observe.noise_scale import NoiseScale, for_run

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


