"""bench.tune's scoring (the benchmark itself runs in network namespaces: `python -m bench.tune`):
the plan the tuner recommended - after its arbitration by measurement - is the one judged
against every single size, next to the prediction's own pick."""
from __future__ import annotations

import json

from bench.tune import compare, table


def test_the_recommended_plan_is_judged_against_every_other_plan(tmp_path):
    def plan(name, buckets):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"buckets": buckets}))
        return str(path)

    def row(name, k, step, measured, file):
        return {"name": name, "buckets": k, "tied_sync": "split", "predicted_step_s": step,
                "predicted_exposed_s": 0.4, "plan_file": file, "measured_step_s": measured}
    two = plan("two", [["a"], ["b"]])
    rec = {"table": [row("no bucketing", 1, 2.1, None, plan("one", [["a", "b"]])),
                     row("DDP 25 MiB", 2, 1.60, 1.50, two),
                     row("best single size", 2, 1.60, 1.50, two),
                     row("tuned", 3, 1.59, 1.60, plan("three", [["a"], ["b"], ["c"]]))],
           "arbitration": {"recommended": "best single size", "decided_by": "measurement",
                           "reason": "best single size measured fastest"}}
    runs = {"tuned": [1.6, 1.7], "no bucketing": [2.2, 2.2], "DDP 25 MiB": [1.5, 1.6]}
    measured = {"measured": {n: {"step_s": sum(v) / 2} for n, v in runs.items()},
                "all": {n: [{"step_s": x} for x in v] for n, v in runs.items()}}
    res = compare(rec, measured)
    marked = [r["plan"] for r in res["rows"] if r["recommended"]]
    assert marked == ["DDP 25 MiB"]        # measured under the first name of the same plan
    g = res["goals"]
    assert g["decided_by"] == "measurement"
    assert g["recommended_at_least_as_fast_as_every_single_size"]
    assert g["recommended_vs_best_other"] == 1.65 / 1.55
    assert not g["tuned_at_least_as_fast_as_every_single_size"]
    res.update(shape="l12", rate_mbit=1110.0, full_allreduce_s=1.0, ratio_measured=1.6,
               backward_s=0.6, fit="T(n)")
    text = table(res)
    assert "DDP 25 MiB (= best single size) ← recommended" in text
    assert "decided by measurement" in text
    # a record from before arbitration: the tuned plan is the recommended one
    del rec["arbitration"]
    assert compare(rec, measured)["goals"]["recommended"] == "tuned"


def test_measurably_slower_means_beaten_in_more_than_three_rounds_of_four(tmp_path):
    """The noise-aware verdict: a plan faster than the recommended one in 2 of 4 rounds is
    noise; one faster in all 4 rounds is measurably faster (the paired upper quartile < 1)."""
    def plan(name, buckets):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"buckets": buckets}))
        return str(path)

    def row(name, k, file):
        return {"name": name, "buckets": k, "tied_sync": "split", "predicted_step_s": 1.0,
                "predicted_exposed_s": 0.4, "plan_file": file}
    rec = {"table": [row("tuned", 3, plan("three", [["a"], ["b"], ["c"]])),
                     row("DDP 25 MiB", 2, plan("two", [["a"], ["b"]])),
                     row("this config", 4, plan("four", [["a"], ["b"], ["c"], ["d"]]))]}

    def score(runs):
        measured = {"measured": {n: {"step_s": sorted(v)[len(v) // 2]} for n, v in runs.items()},
                    "all": {n: [{"step_s": x} for x in v] for n, v in runs.items()}}
        return compare(rec, measured)["goals"]
    noisy = score({"tuned": [1.00, 1.02, 0.98, 1.01], "DDP 25 MiB": [0.99, 1.03, 0.97, 1.02],
                   "this config": [1.01, 1.00, 0.99, 1.00]})
    assert noisy["recommended_never_measurably_slower"]
    assert noisy["measurably_faster_than_recommended"] == []
    beaten = score({"tuned": [1.00, 1.02, 0.98, 1.01], "DDP 25 MiB": [0.95, 0.97, 0.93, 0.96],
                    "this config": [1.01, 1.00, 0.99, 1.00]})
    assert not beaten["recommended_never_measurably_slower"]
    assert beaten["measurably_faster_than_recommended"] == ["DDP 25 MiB"]
    assert 0 < beaten["recommended_round_spread"] < 0.05
