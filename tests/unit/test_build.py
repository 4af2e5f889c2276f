"""The builder's translation of config sections into parts' arguments (runtime/train/build.py),
as pure units: every registered optimizer gets exactly the [optim] fields its builder accepts
(the learning rate scaled), every schedule the [schedule] fields its builder accepts - so a new
field reaches its part without a line in the builder (docs/EXTENDING.md)."""
from __future__ import annotations

import pytest

from runtime.config import load_config
from runtime.optim.optimizers import available_optimizers, optimizer_hparam_names
from runtime.optim.schedules import available_schedules, schedule_param_names
from runtime.train.build import learning_rate, optimizer_hparams, schedule_of


@pytest.mark.parametrize("name", available_optimizers())
def test_each_optimizer_gets_the_optim_fields_it_accepts(name):
    cfg = load_config(None, [f'optim.name="{name}"', "optim.lr=0.01", "optim.eps=1e-7"])
    hp = optimizer_hparams(cfg)
    accepted = set(optimizer_hparam_names(name))
    assert set(hp) <= accepted | {"lr"} and "lr" in hp
    for key, value in hp.items():
        if key != "lr":
            assert value == getattr(cfg.optim, key), key
    assert hp["lr"] == 0.01
    if "eps" in accepted:
        assert hp["eps"] == 1e-7


def test_the_learning_rate_is_scaled_from_its_base_batch():
    cfg = load_config(None, ["optim.lr=0.01", 'optim.lr_scaling="sqrt"',
                             "optim.base_global_batch_size=64", "train.global_batch_size=256"])
    assert learning_rate(cfg) == pytest.approx(0.02)
    assert optimizer_hparams(cfg)["lr"] == pytest.approx(0.02)
    linear = load_config(None, ["optim.lr=0.01", 'optim.lr_scaling="linear"',
                                "optim.base_global_batch_size=64", "train.global_batch_size=256"])
    assert learning_rate(linear) == pytest.approx(0.04)


@pytest.mark.parametrize("name", available_schedules())
def test_each_schedule_gets_the_schedule_fields_it_accepts(name):
    cfg = load_config(None, [f'schedule.name="{name}"', "schedule.warmup_steps=4",
                             "schedule.total_steps=20"])
    schedule = schedule_of(cfg, base_lr=0.5)
    assert callable(schedule) and 0.0 <= schedule(0) <= 0.5 and schedule(3) <= 0.5
    if "warmup_steps" in schedule_param_names(name):  # the field reached it: a ramp
        assert schedule(1) < schedule(3) <= 0.5
