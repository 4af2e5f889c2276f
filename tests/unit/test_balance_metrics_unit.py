"""runtime.observe.balance_meter's arithmetic: per-step padding efficiency and imbalance from
real and padded token counts and step times. In a one-process run:
tests/integration/test_balance_metrics.py; reduced across 2 real ranks:
tests/ranks/test_balance_metrics_ranks.py."""
from __future__ import annotations

from runtime.observe.balance_meter import step_balance


def test_step_balance_arithmetic():
    total = {"real": 300.0, "computed": 400.0, "compute_s": 3.0, "load_s": 0.2}
    top = {"real": 180.0, "computed": 256.0, "compute_s": 2.0, "load_s": 0.15}
    got = step_balance(total, top, world_size=2)
    assert got["padding_efficiency"] == 0.75
    assert got["imbalance_tokens"] == 256 / 200 and got["imbalance_real"] == 180 / 150
    assert got["imbalance_compute"] == 2.0 / 1.5
    assert (got["compute_s_max"], got["compute_s_mean"], got["load_s_max"]) == (2.0, 1.5, 0.15)
    got = step_balance({**total, "cost": 10.0}, {**top, "cost": 6.0}, world_size=2)
    assert got["imbalance_cost"] == 6.0 / 5.0
