"""The bucket tuner (runtime.calibrate.tune) with real components: arbitration by measurement
runs each plan with the real trainer step side by side, and the command line
(``python -m runtime.calibrate.tune``) checks its options, projects runs against the published
ones and picks the batch, and finds nothing to tune in a world of one. The solver, the
simulator, the fits and the plan files: tests/unit/test_tune.py; a real tune on 2 ranks:
tests/ranks/test_tune_ranks.py."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from runtime.grad_sync.plan import BucketPlan
from tests.support.launch import ROOT, clean_env


# ---------------------------------------------------------------------------------------------
# arbitration by measurement


def test_side_by_side_runs_each_plan_with_the_real_trainer_step(small_dataset, single_ctx,
                                                                 monkeypatch):
    """Two plans of the tiny BERT in a world of one: each contender's trainer runs its own
    plan (bucket count), one step per round in rotated order, timed; times come back per
    contender."""
    from runtime.calibrate.tune.arbitrate import Contender, run_side_by_side
    from runtime.train import trainer as trainer_module
    from runtime.train.build import build_model
    from tests.support.tiny import tiny_config

    cfg = tiny_config(small_dataset, "data.verify_checksums=false",
                      "train.tied_embedding_sync=dense")
    named = [(n, p.numel()) for n, p in build_model(cfg).named_parameters() if p.requires_grad]
    sizes = dict(named)
    plans = {"tuned": BucketPlan.from_cap(named[::-1], 1 << 40),
             "fine": BucketPlan.from_cap(named[::-1], 200_000)}
    assert len(plans["fine"].buckets) > 3
    calls = []
    original = trainer_module.Trainer.train_step

    def spy(self, it):
        calls.append(len(self.grad_sync.plan.buckets))
        return original(self, it)
    monkeypatch.setattr(trainer_module.Trainer, "train_step", spy)
    cs = [Contender(n, p.to_json(sizes), "dense", 1.0) for n, p in plans.items()]
    times = run_side_by_side(cfg, single_ctx, cs, steps=1, warmup=1)
    k1, kf = 1, len(plans["fine"].buckets)
    assert calls == [k1, kf, kf, k1]      # round 1 (warm-up): tuned first; round 2: fine
    assert set(times) == {"tuned", "fine"}
    assert all(len(v) == 1 and v[0] > 0 for v in times.values())
    # a race: a plan measurably slower is out after 5 rounds of 20 asked, and the race ends
    # with one left. Slower by 3x its own step + 0.2 s, not a fixed 0.5 s: under a second test
    # worker's load the tiny step itself took 0.9-1.5 s and a fixed sleep lost rounds
    calls.clear()

    def slow_fine(self, it):
        calls.append(len(self.grad_sync.plan.buckets))
        start = time.perf_counter()
        out = original(self, it)
        if len(self.grad_sync.plan.buckets) > 1:
            time.sleep(2 * (time.perf_counter() - start) + 0.2)
        return out
    monkeypatch.setattr(trainer_module.Trainer, "train_step", slow_fine)
    said = []
    times = run_side_by_side(cfg, single_ctx, cs, steps=20, warmup=1, log=said.append)
    assert len(times["tuned"]) == len(times["fine"]) == 5 and len(calls) == 12
    assert any("after 5 rounds fine out, measurably slower than tuned" in m for m in said)


def test_arbitration_options_are_checked(tmp_path):
    config = str(ROOT / "submission/configs/config_CPU_1x2x32x1.toml")
    for opt, value, message in (("--arbitrate-steps", "0", "must be >= 1"),
                                ("--arbitrate-within", "-0.1", "is a fraction")):
        proc = subprocess.run([sys.executable, "-m", "runtime.calibrate.tune", "--config",
                               config, opt, value], cwd=ROOT, capture_output=True, text=True,
                              timeout=120, env=clean_env())
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------------------------
# projection


def test_projection_runs_compares_with_published_and_picks_the_batch(tmp_path):
    """The whole ``--simulate`` command, once (seconds of simulation): the scaling table, the
    published results against the model and the best batch per GPU count from a samples table
    (tests/unit/test_batch_choice.py has the table's own rules)."""
    systems = ROOT / "runtime/calibrate/tune/systems"
    out = tmp_path / "p.json"
    proc = subprocess.run([sys.executable, "-m", "runtime.calibrate.tune", "--simulate",
                           str(systems / "dgx_a100_8xhdr.toml"), "--gpus", "8,1024",
                           "--samples", str(systems / "samples_samsung_adam.csv"),
                           "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the batch that trains fastest per GPU count" in proc.stdout
    rec = json.loads(out.read_text())
    best = rec["best_batch"]
    assert best["8"] == []                                  # 16,384 / 8 > the local batch limit
    assert best["1024"][0]["global_batch"] == 16384          # the table's only batch
    assert {p["gpus"] for p in rec["points"]} == {8, 1024}
    assert len(rec["published"]) == 4
    for r in rec["published"]:
        assert r["predicted_s"] > 0 and math.isfinite(r["error"])
    # One time per published run, with the assumption it rests on; Presto's own options on
    # the same rows are a table of their own, each column named by its optimizer.
    table = proc.stdout.split("published 1,024-A100 results", 1)[1].split("Not those runs", 1)
    rows = [line for line in table[0].splitlines() if line.startswith("| v")]
    assert len(rows) == 4
    for line, r in zip(rows, rec["published"]):
        assert f"| {r['predicted_s']:.1f} |" in line and r["assumption"] in line
        assert r["assumption"].startswith(("no bucketing, local_before, the update sharded over 8",
                                           "DDP 25 MiB (22 buckets), bucket_before, the update"))
    assert "tuned plan s" not in table[0] and "optim.shard=none" in table[1]
    # optim.shard=node on the published rows: the update is 1/8 on every row, the step
    # shorter; the parameters' fp32 all-gather inside the node is what is left of the span
    assert "optim.shard=node" in proc.stdout and len(rec["sharded"]) == 4
    for r in rec["sharded"]:
        u, s = r["unsharded"], r["sharded"]
        assert s["update_s"] == pytest.approx(u["update_s"] / 8)
        assert s["step_s"] < u["step_s"] and s["ttt_s"] < u["ttt_s"]
        assert r["update_share_cut"] > 6
        small = s["optimizer_s"] - s["update_s"] - s["gather_s"]
        assert s["gather_s"] > 0 and 0 < small < 1e-3
    for p in rec["points"]:
        if p["plan"] == "tuned":        # the tuned plan is never slower than no bucketing
            none = next(q for q in rec["points"] if q["plan"] == "no bucketing" and
                        q["gpus"] == p["gpus"] and q["clip_mode"] == p["clip_mode"])
            assert p["step_s"] <= none["step_s"] + 1e-9


# ---------------------------------------------------------------------------------------------
# the command in a world of one


def test_a_world_of_one_has_nothing_to_tune():
    proc = subprocess.run([sys.executable, "-m", "runtime.calibrate.tune", "--config",
                           str(ROOT / "submission/configs/config_CPU_1x2x32x1.toml")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=clean_env())
    assert proc.returncode == 0, proc.stderr
    assert "nothing to tune" in proc.stdout
