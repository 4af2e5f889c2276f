"""bench.noise_check's arithmetic: the per-example B_simple with the unbiased |G|² (checked
on Gaussian per-example gradients whose mean and covariance are known), and the replay of
other horizons from a run's raw norms, which must be what the runtime's estimator logs."""
from __future__ import annotations

import math

import numpy as np
import pytest

from bench.noise_check import b_simple, replay
from runtime.observe.noise_scale import NoiseScale


def test_per_example_b_simple_is_unbiased_where_the_plain_mean_is_not():
    rng = np.random.default_rng(0)
    d, n = 200, 256
    G = np.full(d, 0.05)                        # |G|² = 0.5
    scale = np.linspace(0.5, 1.5, d)           # tr(Σ) = Σ scale² ≈ 216.7
    truth = float((scale ** 2).sum() / (G ** 2).sum())   # ≈ 433: B > n, as late in training
    got, naive = [], []
    for _ in range(200):
        g = G + rng.standard_normal((n, d)) * scale
        mean = g.mean(0)
        got.append(b_simple(float(mean @ mean), float((g * g).sum()), n))
        trace = ((g - mean) ** 2).sum() / (n - 1)
        naive.append(trace / float(mean @ mean))
    assert np.median(got) == pytest.approx(truth, rel=0.1)
    assert np.median(naive) < 0.5 * truth   # |ḡ|² = |G|² + tr(Σ)/n: biased up, B down
    assert math.isnan(b_simple(0.1, 1000.0, 10))   # |G|² estimate not positive: undefined


def test_the_replay_is_what_the_estimator_logs():
    rng = np.random.default_rng(1)
    steps, est = {}, NoiseScale(b_small=32, b_big=64, horizon_samples=1024)
    for step in range(1, 41):
        small, big = (float(x) for x in rng.uniform(1, 3, 2))
        steps[step] = {"grad_sq_small": small, "grad_sq_big": big,
                       **est.update(small, big)}
    replayed = replay(steps, 32, 64, 1024)
    assert all(replayed[s]["noise_scale"] == steps[s]["noise_scale"] for s in steps)
    other = replay(steps, 32, 64, 0)   # each step alone
    assert other[40]["grad_sq_true"] == pytest.approx(2 * steps[40]["grad_sq_big"]
                                                      - steps[40]["grad_sq_small"])
