"""bench.batch_scaling's arithmetic: the learning-rate rules (linear; √ with LEGW warm-up),
the crossing of the target read between evaluations, McCandlish's trade-off fitted back from
points made by it, and the samples table the projection reads."""
from __future__ import annotations

import math

import pytest

from bench.batch_scaling import WARMUP_STEPS, best_samples_table, crossing, fit_tradeoff, run_plan


def _value(over: list[str], key: str) -> str:
    return next(o.split("=", 1)[1] for o in over if o.startswith(key + "="))


def test_the_rules_scale_lr_and_warm_up_as_the_papers_say():
    lin = run_plan("lamb", "linear", 512, 32, 1e-2, 20000, 0.1, 400_000)
    sqrt = run_plan("lamb", "sqrt", 512, 32, 1e-2, 20000, 0.1, 400_000)
    assert float(_value(lin, "optim.lr")) == pytest.approx(1e-2 * 16)
    assert float(_value(sqrt, "optim.lr")) == pytest.approx(1e-2 * 4)
    assert int(_value(lin, "schedule.warmup_steps")) == max(1, round(WARMUP_STEPS / 16))
    assert int(_value(sqrt, "schedule.warmup_steps")) == WARMUP_STEPS  # LEGW: same steps
    assert int(_value(lin, "schedule.total_steps")) == 400_000 // 512  # decay in samples
    accum = int(_value(lin, "train.gradient_accumulation_steps"))
    assert 512 // (2 * accum) <= 128 and 512 % (2 * accum) == 0
    every = int(_value(lin, "train.eval_iter_samples"))
    assert every % 512 == 0 and every <= 0.07 * 20000 + 512


def test_the_crossing_is_interpolated_between_evaluations():
    history = [[1000, 0.06, 1.0], [2000, 0.08, 2.0], [3000, 0.12, 3.0]]
    hit = crossing(history, 0.10, batch=100)
    assert hit["samples"] == pytest.approx(2500) and hit["steps"] == pytest.approx(25)
    assert hit["resolution"] == pytest.approx(1000 / 3000)
    assert crossing(history, 0.2, batch=100) is None


def test_the_tradeoff_fit_recovers_s_min_and_e_min():
    s_min, e_min = 40.0, 12000.0  # B_crit = 300
    points = [(b, s_min + e_min / b) for b in (32, 64, 128, 256, 512, 1024)]
    fit = fit_tradeoff(points)
    assert fit["S_min"] == pytest.approx(s_min) and fit["E_min"] == pytest.approx(e_min)
    assert fit["B_crit"] == pytest.approx(300) and fit["residual_rel"] < 1e-9
    for b, s in points:  # (S/S_min - 1)(E/E_min - 1) = 1 on the curve
        assert (s / s_min - 1) * (b * s / e_min - 1) == pytest.approx(1)
    assert fit_tradeoff(points[:2]) is None


def test_the_samples_table_takes_the_best_rule_that_always_reached_the_target():
    table = [{"batch": 64, "samples": 10000.0, "reached": 2, "runs": 2},
             {"batch": 64, "samples": 9000.0, "reached": 1, "runs": 2},   # not every seed
             {"batch": 128, "samples": 12000.0, "reached": 2, "runs": 2},
             {"batch": 128, "samples": 11000.0, "reached": 2, "runs": 2},
             {"batch": 256, "samples": None, "reached": 0, "runs": 2}]
    assert best_samples_table(table) == [[64, 10000.0], [128, 11000.0]]
    assert math.isfinite(best_samples_table(table)[0][1])
