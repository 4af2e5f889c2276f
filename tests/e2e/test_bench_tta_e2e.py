"""bench.time_to_accuracy and bench/baseline_ddp.py for real: tiny runs (torchrun /
run_and_time.sh, 2 ranks) of the tiny model of tests/support/tiny.py - one seed of the
harness, and an ablation and a baseline-lr sweep. The baseline's own record is checked on the
run the harness makes of it, not on a run of its own. Parsing, aggregation and the baseline's
pieces: tests/unit/test_bench_tta.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import time_to_accuracy as tta
from bench.baseline_ddp import DEFAULT_BASELINE_LR
from tests.support.tiny import BACKEND, SHAPE, write_toml

pytestmark = pytest.mark.slow   # tests/e2e: every test here is slow


# ----------------------------------------------------------------------- real, tiny runs

def tiny_config(tmp_path: Path, data: Path, **train) -> Path:
    """The tiny model of tests/support/tiny.py as a config file for the harness: 2 ranks,
    16 samples a step, an eval every 32 samples, a target it never reaches in ``max_steps``."""
    t = dict(dict(global_batch_size=16, seed=1, target_mlm_accuracy=0.99, max_steps=4,
                  eval_iter_samples=32, log_every_steps=2, plot="false"), **train)
    values = {**SHAPE, **BACKEND, "model.max_position_embeddings": 128,
              "data.data_dir": f'"{data}"', "data.max_seq_length": 128,
              "data.eval_batch_size": 32, "schedule.warmup_steps": 1,
              "schedule.total_steps": 10, "system.device": '"cpu"', "system.ranks_per_node": 2,
              **{f"train.{k}": v for k, v in t.items()}}
    return write_toml(tmp_path / "config_TINY_1x2x8x1.toml", values)


@pytest.mark.slow  # run_and_time.sh and torchrun, 2 ranks each
def test_harness_one_seed(tmp_path, small_dataset, capsys):
    """One seed through the harness - the runtime (run_and_time.sh) and the baseline (torchrun
    bench/baseline_ddp.py), 4 steps each - and then the baseline's own summary and console,
    which the harness keeps (the baseline's one run in this file)."""
    cfg = tiny_config(tmp_path, small_dataset)
    out = tmp_path / "tta.json"
    rc = tta.main(["--config", str(cfg), "--seeds", "5", "--out", str(out),
                   "--workdir", str(tmp_path / "work"), "--timeout", "120"])
    assert rc == 0
    rec = json.loads(out.read_text())
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["benchmark"] == "time_to_accuracy"
    assert list(rec)[:5] == ["benchmark", "command", "commit", "machine", "date"]
    assert rec["command"].startswith("python -m bench.time_to_accuracy --config")
    assert rec["seeds"] == [5] and rec["order"] == ["runtime"]
    for system in ("runtime", "baseline"):
        (r,) = rec[system]["runs"]
        assert r["seed"] == 5 and r["status"] == "aborted", r
        assert r["samples"] == 64 and r["time_to_target_s"] is None and r["run_time_s"] > 0
        assert r["throughput_samples_per_s"] > 0
    assert rec["ratio_time"] is None and rec["ratio_seeds"] == []

    # bench/baseline_ddp.py's own record (--out) and output of that run
    (b,) = rec["baseline"]["runs"]
    assert b["rc"] == 1, Path(b["console"]).read_text()[-3000:]  # aborted: max_steps before 0.99
    s = json.loads(Path(b["summary"]).read_text())
    assert s["status"] == "aborted"
    assert s["time_to_target_s"] is None and s["samples_to_target"] is None
    assert (s["steps"], s["samples"]) == (4, 64)
    assert [h[0] for h in s["eval_history"]] == [32, 64]
    assert all(0.0 <= h[1] <= 1.0 for h in s["eval_history"])
    assert 0 < s["eval_history"][0][2] <= s["eval_history"][1][2] <= s["run_time_s"]
    assert s["throughput_samples_per_s"] > 0 and 0 < s["padding_efficiency"] <= 1
    assert (s["world_size"], s["local_batch_size"], s["max_seq_length"]) == (2, 8, 128)
    assert s["lr"] == DEFAULT_BASELINE_LR and "lamb" in s["lr_source"]
    assert s["attention"] == "padded"  # the plain recipe computes the padding, always
    assert "[baseline] [eval] step 4" in Path(b["console"]).read_text()


@pytest.mark.slow
def test_ablation_and_sweep_tiny(tmp_path, small_dataset, capsys):
    cfg = tiny_config(tmp_path, small_dataset, max_steps=2)
    out = tmp_path / "abl.json"
    rc = tta.main(["--config", str(cfg), "--seeds", "5", "--out", str(out), "--workdir",
                   str(tmp_path / "work"), "--timeout", "120", "--ablation",
                   "random_padded,adamw", "--baseline-lr", "1e-3"])
    assert rc == 0
    rec = json.loads(out.read_text())
    assert rec["benchmark"] == "ablation" and rec["order"] == [["random_padded", "adamw"]]
    for v in ("random_padded", "adamw"):
        (r,) = rec["variants"][v]["runs"]
        assert r["status"] == "aborted" and r["samples"] == 32, r
        assert r["throughput_samples_per_s"] > 0
    assert rec["variants"]["adamw"]["overrides"] == ["optim.name=adamw", "optim.lr=0.001"]
    log = (tmp_path / "work" / "adamw_seed5.out").read_text()
    assert "optim.name=adamw" in log and "optim.lr=0.001" in log
    assert "random_padded" in capsys.readouterr().out

    out = tmp_path / "sweep.json"
    rc = tta.main(["--config", str(cfg), "--seeds", "5", "--out", str(out), "--workdir",
                   str(tmp_path / "work2"), "--timeout", "120", "--sweep-baseline-lr",
                   "1e-3,3e-3"])
    assert rc == 0
    rec = json.loads(out.read_text())
    assert rec["benchmark"] == "baseline_lr_sweep"
    assert [r["lr"] for r in rec["rows"]] == [1e-3, 3e-3]
    assert all(r["status"] == "aborted" and [h[0] for h in r["eval_history"]] == [32]
               for r in rec["rows"])
    best = max(rec["rows"], key=lambda r: r["eval_accuracy"])
    assert rec["chosen_lr"] == best["lr"]
