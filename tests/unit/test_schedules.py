"""Learning-rate schedules at their boundary steps, and lr scaling with the batch size.

Convention under test: schedule(t) is the lr of update t, t = 0, 1, 2, … (completed updates).
"""

import math

import pytest

from runtime.optim.schedules import build_schedule, legw, poly_warmup_lr, scaled_lr

ETA, W, T = 2.0, 100, 1000


@pytest.fixture
def poly():
    return build_schedule("poly", base_lr=ETA, warmup_steps=W, total_steps=T)


@pytest.mark.parametrize("t,expected", [
    (0, 0.0),                         # first update: lr 0 (TF reference, s0 = 0)
    (1, ETA * 1 / 100),
    (W - 1, ETA * 99 / 100),          # last warm-up step
    (W, ETA * (1 - 100 / 1000)),      # decay from absolute t, not from 1
    (500, ETA * 0.5),
    (T - 1, ETA * (1 / 1000)),
    (T, 0.0),
    (T + 1, 0.0),
    (5 * T, 0.0),
])
def test_poly_boundaries(poly, t, expected):
    assert poly(t) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_poly_negative_start_warmup_step():
    s = build_schedule("poly", base_lr=ETA, warmup_steps=100, start_warmup_step=-25,
                       total_steps=T)
    assert s(0) == pytest.approx(ETA * 25 / 100)
    assert s(74) == pytest.approx(ETA * 99 / 100)      # last warm-up step: t − s0 = 99
    assert s(75) == pytest.approx(ETA * (1 - 75 / T))  # warm-up ends at t = W + s0 = 75
    assert s(T) == 0.0


def test_poly_published_8x8x48_config():
    # NVIDIA closed division 8×8×48×1: lr 1.5e-3, 1271 steps, warm-up 100, start −25.
    s = build_schedule("poly", base_lr=1.5e-3, warmup_steps=100, start_warmup_step=-25,
                       total_steps=1271)
    assert s(0) == pytest.approx(1.5e-3 * 0.25)
    assert s(100) == pytest.approx(1.5e-3 * (1 - 100 / 1271))
    assert s(1270) == pytest.approx(1.5e-3 / 1271)


def test_poly_without_warmup():
    s = build_schedule("poly", base_lr=ETA, warmup_steps=0, total_steps=T)
    assert s(0) == ETA
    assert s(1) == pytest.approx(ETA * (1 - 1 / T))
    assert s(T - 1) == pytest.approx(ETA / T)
    assert s(T) == 0.0
    # W = 0 also ignores a negative start (no warm-up at all).
    s = build_schedule("poly", base_lr=ETA, warmup_steps=0, start_warmup_step=-25,
                       total_steps=T)
    assert s(0) == ETA


def test_poly_power():
    s = build_schedule("poly", base_lr=ETA, warmup_steps=10, total_steps=100, power=2.0)
    assert s(5) == pytest.approx(ETA * 0.5)  # warm-up is linear whatever the power
    assert s(50) == pytest.approx(ETA * 0.25)
    assert poly_warmup_lr(50, base_lr=ETA, warmup_steps=10, total_steps=100, power=0.5) == \
        pytest.approx(ETA * math.sqrt(0.5))


def test_constant():
    s = build_schedule("constant", base_lr=3e-4)
    assert s(0) == s(10**6) == 3e-4


@pytest.mark.parametrize("kw,key", [
    (dict(base_lr=1.0, warmup_steps=-1, total_steps=10), "warmup_steps"),
    (dict(base_lr=1.0, warmup_steps=0, total_steps=0), "total_steps"),
    (dict(base_lr=1.0, warmup_steps=0, total_steps=-5), "total_steps"),
    (dict(base_lr=1.0, warmup_steps=0, total_steps=10, power=0.0), "power"),
    (dict(base_lr=1.0, warmup_steps=0, total_steps=10, power=-1.0), "power"),
    (dict(base_lr=0.0, warmup_steps=0, total_steps=10), "base_lr"),
    (dict(base_lr=1.0, warmup_steps=5, start_warmup_step=3, total_steps=10),
     "start_warmup_step"),
])
def test_poly_bad_values_name_the_parameter(kw, key):
    with pytest.raises(ValueError, match=f"'{key}'"):
        build_schedule("poly", **kw)


def test_bad_step_name_and_key():
    s = build_schedule("constant", base_lr=1.0)
    with pytest.raises(ValueError, match="'t'"):
        s(-1)
    with pytest.raises(ValueError, match="unknown schedule 'cosine'.*constant, poly"):
        build_schedule("cosine", base_lr=1.0)
    with pytest.raises(ValueError, match="accepted keys"):
        build_schedule("poly", base_lr=1.0, total_steps=10, warmup=5)


def test_linear_and_sqrt_scaling():
    assert scaled_lr("none", 1e-3, 256, 1024) == 1e-3
    assert scaled_lr("linear", 1e-3, 256, 1024) == pytest.approx(4e-3)
    assert scaled_lr("linear", 1e-3, 256, 64) == pytest.approx(2.5e-4)
    assert scaled_lr("sqrt", 1e-3, 256, 1024) == pytest.approx(2e-3)
    assert scaled_lr("legw", 1e-3, 256, 4096) == pytest.approx(4e-3)
    with pytest.raises(ValueError, match="'rule'"):
        scaled_lr("cubic", 1e-3, 256, 1024)
    with pytest.raises(ValueError, match="'base_batch'"):
        scaled_lr("linear", 1e-3, 0, 1024)


def test_legw_keeps_warmup_iterations_constant():
    # B0 = 256, w0 = 0.5 epochs over N = 51200 samples: 0.5·51200/256 = 100 warm-up steps.
    lr, steps = legw(1e-3, 256, 256, base_warmup_epochs=0.5, dataset_size=51200)
    assert (lr, steps) == (pytest.approx(1e-3), 100)
    # B = 4·B0: lr × 2; warm-up epochs × 4 = 2 epochs = 2·51200/1024 = 100 steps.
    lr, steps = legw(1e-3, 256, 1024, base_warmup_epochs=0.5, dataset_size=51200)
    assert (lr, steps) == (pytest.approx(2e-3), 100)
    # B = 16·B0: lr × 4; still 100 steps.
    lr, steps = legw(1e-3, 256, 4096, base_warmup_epochs=0.5, dataset_size=51200)
    assert (lr, steps) == (pytest.approx(4e-3), 100)
    # Rounded to the nearest whole step: 0.3·1000/64 = 4.6875 → 5.
    assert legw(1e-3, 64, 128, base_warmup_epochs=0.3, dataset_size=1000)[1] == 5
    with pytest.raises(ValueError, match="'dataset_size'"):
        legw(1e-3, 256, 1024, base_warmup_epochs=0.5, dataset_size=0)
