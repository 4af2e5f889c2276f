"""bench.batch_scaling's arithmetic: the learning-rate rules (linear; √ with LEGW warm-up),
the crossing of the target read between evaluations, McCandlish's trade-off fitted back from
points made by it, the samples table the projection reads, the budget cap, which earlier
runs answer for a planned one, and which are rerun to re-measure the noise scale."""
from __future__ import annotations

import json
import math

import pytest

from bench.batch_scaling import (WARMUP_STEPS, best_samples_table, crossing, fit_tradeoff,
                                 load_reuse, noise_at, remeasure, reusable, run_plan)


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


def test_the_budget_is_capped_and_an_earlier_run_is_reused_only_when_its_outcome_holds():
    plan = run_plan("lamb", "sqrt", 1024, 32, 1e-2, 30000, 0.1, 400_000)
    capped = run_plan("lamb", "sqrt", 1024, 32, 1e-2, 30000, 0.1, 400_000, cap=60000)
    assert int(_value(plan, "train.max_samples_termination")) == 120000 // 1024 * 1024 + 1024
    budget = int(_value(capped, "train.max_samples_termination"))
    assert budget == 60000 // 1024 * 1024 + 1024
    assert int(_value(capped, "train.max_steps")) == budget // 1024 + 1
    same = [o for o in plan if not o.startswith(("train.max_steps", "train.max_samples"))]
    assert same == [o for o in capped if not o.startswith(("train.max_steps", "train.max_sam"))]
    missed = {"overrides": plan, "status": "aborted", "samples_to_target": None}
    assert reusable(missed, capped)          # not reached within a larger budget
    assert not reusable({**missed, "overrides": capped}, plan)  # might reach with more
    hit = {"overrides": plan, "status": "success", "samples_to_target": 50000.0}
    assert reusable(hit, capped)
    assert not reusable({**hit, "samples_to_target": 90000.0}, capped)  # past the new cap
    assert not reusable({**hit, "status": "failed"}, capped)
    other_lr = [o if not o.startswith("optim.lr=") else "optim.lr=0.5" for o in plan]
    assert not reusable(hit, other_lr)


def test_a_record_of_another_study_is_refused_by_name(tmp_path):
    path = tmp_path / "old.json"
    path.write_text('{"target": 0.2, "runs": []}')
    with pytest.raises(SystemExit, match=r"old.json: its target is 0.2"):
        load_reuse(path, {"target": 0.1})
    path.write_text("{not json")
    with pytest.raises(SystemExit, match="cannot read the record"):
        load_reuse(path, {"target": 0.1})
    assert load_reuse(None, {}) == []


def test_an_earlier_attempts_directory_is_set_aside_and_a_failed_run_is_no_data_point(tmp_path):
    from bench.batch_scaling import set_aside, summarise
    d = tmp_path / "lamb_sqrt_b64_seed2"
    d.mkdir()
    (d / "mlperf_bert.log").write_text("old attempt\n")
    set_aside(d)
    set_aside(d)                                   # nothing there any more: nothing to do
    assert not d.exists() and (tmp_path / "lamb_sqrt_b64_seed2.attempt1" / "mlperf_bert.log"
                               ).read_text() == "old attempt\n"

    class Args:
        rules, base_batch = ["sqrt"], 32
    run = {"optimizer": "lamb", "rule": "sqrt", "batch": 64, "seed": 1,
           "samples_to_target": 1000.0, "steps_to_target": 15.6, "resolution": 0.1,
           "noise_scale_at_target": None, "status": "success"}
    failed = {**run, "seed": 2, "status": "failed", "samples_to_target": None,
              "steps_to_target": None}
    (row,) = summarise([run, failed], Args)["table"]
    assert (row["runs"], row["reached"], row["samples"]) == (1, 1, 1000.0)


def test_remeasuring_the_noise_reruns_only_the_runs_that_reached_the_target(tmp_path):
    hit = {"status": "success", "samples_to_target": 9000.0, "noise_scale_at_target": 80.0}
    missed = {"status": "aborted", "samples_to_target": None, "noise_scale_at_target": None}
    assert remeasure(hit, True) and not remeasure(missed, True)
    assert not remeasure(hit, False)                   # without the flag: taken as it is
    again = {**hit, "before": {"samples_to_target": 9000.0, "noise_scale_at_target": 80.0}}
    assert not remeasure(again, True)  # re-measured already (a resumed re-measurement)
    lines = [{"kind": "step", "samples": s, "noise_scale": b, "noise_scale_window_samples": w}
             for s, b, w in ((64, None, 64), (8960, 40.0, 2016), (9024, 41.0, 2017))]
    lines.append({"kind": "eval", "samples": 9024, "eval_accuracy": 0.1})
    (tmp_path / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n")
    assert noise_at(tmp_path, 9000.0) == (41.0, 2017)   # the logged step nearest the target
    assert noise_at(tmp_path / "missing", 9000.0) == (None, None)
