"""bench.optim's worker for real: one record of the fused (compiled) LAMB step on the tiny
model's shapes, and the copy-bandwidth limit it is held to. The shapes and the goals:
tests/unit/test_bench_optim.py."""

import pytest

from bench import optim as bench


def test_worker_record_and_limit():
    rec = bench.run_case("tiny", "lamb", "presto:fused", reps=2)
    assert rec["compiled"] and rec["compile_s"] > 0 and len(rec["step_times_s"]) == 2
    assert rec["elements"] == 4_433_468 and rec["step_min_s"] <= rec["step_median_s"]
    bench.add_limits(rec, copy_gbps=10.0)
    assert rec["limit_s"] == pytest.approx(4_433_468 * 40 / 10e9)
    assert rec["ratio_to_limit"] == pytest.approx(rec["step_min_s"] / rec["limit_s"])
