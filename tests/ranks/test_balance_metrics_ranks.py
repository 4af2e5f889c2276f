"""runtime.observe.balance_meter on 2 real ranks under mpiexec (tests/dist_scripts/balance_steps.py):
real tokens and step times are reduced across the ranks. The arithmetic:
tests/unit/test_balance_metrics_unit.py; the metrics a one-process run writes:
tests/integration/test_balance_metrics.py."""
from __future__ import annotations

import json

import pytest

from tests.support.launch import needs_mpiexec, run_script, tail

pytestmark = pytest.mark.slow   # tests/ranks: every test here launches ranks


@pytest.mark.slow  # a 2-rank mpiexec launch
@needs_mpiexec
def test_two_ranks_reduce_tokens_and_time(small_dataset, tmp_path):
    proc = run_script(2, "balance_steps.py", small_dataset, tmp_path, "global", "padded",
                      timeout=180)
    assert proc.returncode == 0, tail(proc)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for step in range(3):
        local = [r["steps"][step]["local"] for r in ranks]
        # every rank holds the reduced values; TFLOP/s and MFU divide them by this rank's own
        # step time (runtime.observe.step_log), so they may differ in the last digits
        own = ("tflops", "mfu")
        extra, other = ({k: v for k, v in r["steps"][step]["extra"].items() if k not in own}
                        for r in ranks)
        assert extra == other
        for r in ranks:
            assert r["steps"][step]["extra"]["tflops"] > 0
        real = [x["real"] for x in local]
        computed = [x["computed"] for x in local]
        cost = [x["cost"] for x in local]
        assert min(cost) > 0 and extra["imbalance_cost"] == pytest.approx(max(cost) / (sum(cost) / 2))
        assert extra["real_tokens_all"] == sum(real)
        assert extra["padding_efficiency"] == pytest.approx(sum(real) / sum(computed))
        assert extra["imbalance_real"] == pytest.approx(max(real) / (sum(real) / 2))
        assert extra["imbalance_tokens"] == pytest.approx(max(computed) / (sum(computed) / 2))
        times = [x["compute_s"] for x in local]
        assert extra["compute_s_max"] == pytest.approx(max(times))
        assert extra["imbalance_compute"] == pytest.approx(max(times) / (sum(times) / 2))
        for r in ranks:
            s = r["steps"][step]
            assert s["computed_tokens"] == s["local"]["computed"]
