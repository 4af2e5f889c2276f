"""The bucket tuner (runtime.calibrate.tune) for real: a tune on 2 CPU ranks (production order,
arbitration) whose plan the trainer then runs (tests/dist_scripts/tune_plan.py). The solver,
the simulator, the fits and the plan files: tests/unit/test_tune.py; the command line and the
side-by-side race in one process: tests/integration/test_tune_integration.py."""
from __future__ import annotations

import json
import sys

import pytest

from runtime.grad_sync.plan import production_order
from tests.support.launch import ROOT, needs_mpiexec, run_ranks, run_script
from tests.support.tiny import tiny_config, tiny_overrides

pytestmark = pytest.mark.slow   # tests/ranks: every test here launches ranks


# ---------------------------------------------------------------------------------------------
# the command on real ranks


@needs_mpiexec
@pytest.mark.slow  # two real commands on 2 ranks (CI runs slow tests too)
def test_real_tune_on_two_ranks_and_the_trainer_runs_its_plan(small_dataset, tmp_path):
    out = tmp_path / "tune"
    sets = tiny_overrides(small_dataset, "train.global_batch_size=8",
                          "data.verify_checksums=false")
    cmd = [sys.executable, "-m", "runtime.calibrate.tune", "--config",
           ROOT / "submission/configs/config_CPU_1x2x32x1.toml", "--out", out,
           "--steps", "2", "--warmup", "1", "--repeats", "1", "--sizes", "5",
           "--contention-steps", "1", "--no-png",
           # every row a contender (the tiny model's rows may all be far apart): the real
           # arbitration on both ranks, one measured step each
           "--arbitrate-within", "10", "--arbitrate-steps", "1"]
    for s in sets:
        cmd += ["--set", s]
    proc = run_ranks(2, *cmd, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "| **tuned**" in proc.stdout and "use it:" in proc.stdout
    assert "| measured step ms |" in proc.stdout and "decided by measurement:" in proc.stdout
    rec = json.loads((out / "tune.json").read_text())
    assert rec["world_size"] == 2 and len(rec["sweep"]["bytes"]) == 5
    # the production order: the BERT's hooks fire out of registration order, and the profile
    # lists gradients by their median ready times (the slowest rank's), the engine's rule
    from runtime.train.build import build_model
    names = [g[0] for g in rec["profile"]["grads"]]
    ready = {g[0]: g[2] for g in rec["profile"]["grads"]}
    first = rec["engine_first_step_order"]
    registration = [n for n, p in build_model(tiny_config(small_dataset)).named_parameters()
                    if p.requires_grad][::-1]
    assert sorted(first) == sorted(registration) and first != registration
    assert all(r >= 0 for r in ready.values()) and names == production_order(ready, first)
    assert "median ready times over 2 steps" in rec["production_order"]
    arb = rec["arbitration"]
    assert arb["decided_by"] == "measurement" and len(arb["contenders"]) >= 2
    medians = {n: m["median_s"] for n, m in arb["measured"].items()}
    assert set(medians) == {c["name"] for c in arb["contenders"]}
    assert arb["recommended"] == min(medians, key=medians.get)
    assert [r["name"] for r in rec["table"] if r["recommended"]] == [arb["recommended"]]
    meta = json.loads((out / "bucket_plan.json").read_text())["meta"]
    assert meta["plan"] == arb["recommended"] and meta["decided_by"] == "measurement"
    assert meta["measured_step_s"] == medians[arb["recommended"]]
    # the trainer runs the written plan and reaches the same gradient as a size-cap plan
    proc = run_script(2, "tune_plan.py", out / "bucket_plan.json", tmp_path / "result.json",
                      *sets, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["buckets"] == len(json.loads((out / "bucket_plan.json").read_text())["buckets"])
    assert res["max_rel_diff"] < 1e-5
