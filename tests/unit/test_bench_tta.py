"""bench.time_to_accuracy and bench/baseline_ddp.py without a run: parsing MLPerf logs and
metrics, aggregation that keeps failed runs, the baseline's collate and lr rule, and the
ablation's variants and refusals. Tiny real runs (torchrun / run_and_time.sh, 2 ranks):
tests/e2e/test_bench_tta_e2e.py."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import common
from bench import time_to_accuracy as tta
from bench.baseline_ddp import DEFAULT_BASELINE_LR, baseline_lr, pad_to_max_length
from runtime.config import load_config

REPO = Path(__file__).resolve().parents[2]


def mllog_line(key, time_ms, value=None, **meta):
    rec = {"namespace": "", "time_ms": time_ms, "event_type": "POINT_IN_TIME", "key": key,
           "value": value, "metadata": {"file": "x.py", "lineno": 1, **meta}}
    return ":::MLLOG " + json.dumps(rec)


def write_log(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


# ----------------------------------------------------------------------------- parsing

def test_parse_mllog_success(tmp_path):
    log = write_log(tmp_path / "a.log", [
        mllog_line("init_start", 500),
        mllog_line("run_start", 1000),
        mllog_line("eval_accuracy", 2000, 0.10, epoch_num=64),
        "some unrelated line",
        "[0] " + mllog_line("eval_accuracy", 5400, 0.31, epoch_num=128),  # a prefixed line
        mllog_line("run_stop", 5500, status="success"),
    ])
    r = common.parse_mllog(log)
    assert r["status"] == "success"
    assert r["time_to_target_s"] == pytest.approx(4.5)
    assert r["run_time_s"] == pytest.approx(4.5)
    assert r["samples_to_target"] == 128 and r["samples"] == 128
    assert r["eval_accuracy"] == pytest.approx(0.31)
    assert r["eval_history"] == [[64, 0.10, 1.0], [128, 0.31, 4.4]]


def test_parse_mllog_aborted_and_crashed(tmp_path):
    aborted = common.parse_mllog(write_log(tmp_path / "b.log", [
        mllog_line("run_start", 0), mllog_line("eval_accuracy", 3000, 0.2, epoch_num=320),
        mllog_line("run_stop", 3100, status="aborted")]))
    assert aborted["status"] == "aborted"
    assert aborted["time_to_target_s"] is None and aborted["samples_to_target"] is None
    assert aborted["run_time_s"] == pytest.approx(3.1) and aborted["samples"] == 320

    crashed = common.parse_mllog(write_log(tmp_path / "c.log", [
        mllog_line("run_start", 0), mllog_line("eval_accuracy", 3000, 0.2, epoch_num=64)]))
    assert crashed["status"] == "failed" and crashed["time_to_target_s"] is None

    never = common.parse_mllog(write_log(tmp_path / "d.log", [mllog_line("init_start", 0)]))
    assert never["status"] == "failed" and "run_start" in never["error"]


def test_parse_metrics(tmp_path):
    steps = [{"kind": "step", "samples": 64 * i, "step_time_s": 0.5, "real_tokens": 90,
              "computed_tokens": 100} for i in (1, 2)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in
                              steps + [{"kind": "eval", "samples": 128, "eval_accuracy": 0.1}]))
    m = common.parse_metrics(path)
    assert m["throughput_samples_per_s"] == pytest.approx(128.0)
    assert m["padding_efficiency"] == pytest.approx(0.9)
    assert common.parse_metrics(tmp_path / "missing.jsonl")["throughput_samples_per_s"] is None


# ------------------------------------------------------------------------- aggregation

def run(system, seed, status, t=None, samples=None, thr=100.0):
    ok = status == "success"
    return {"system": system, "seed": seed, "status": status,
            "time_to_target_s": t if ok else None, "samples_to_target": samples if ok else None,
            "throughput_samples_per_s": thr, "padding_efficiency": 0.8,
            "eval_accuracy": 0.5, "eval_history": [[64, 0.5, 1.0]]}


def test_summarize_and_compare_keep_failed_runs():
    rt = [run("runtime", 1, "success", 100.0, 640), run("runtime", 2, "success", 120.0, 768),
          run("runtime", 3, "aborted")]
    bl = [run("baseline", 1, "success", 150.0, 704), run("baseline", 2, "failed", thr=None),
          run("baseline", 3, "success", 300.0, 1024)]
    R, B = tta.summarize(rt), tta.summarize(bl)
    assert (R["reached"], R["of"], len(R["runs"])) == (2, 3, 3)
    assert (B["reached"], B["of"], len(B["runs"])) == (2, 3, 3)  # the failed run is kept
    assert R["median_time_to_target_s"] == pytest.approx(110.0)
    assert B["median_time_to_target_s"] == pytest.approx(225.0)
    assert B["median_throughput_samples_per_s"] == pytest.approx(100.0)  # None skipped
    c = tta.compare(rt, bl)
    assert c["ratio_seeds"] == [1]  # the only seed where both reached the target
    assert c["ratio_time"] == pytest.approx(1.5)
    assert c["ratio_samples"] == pytest.approx(1.1)
    assert "1 of 3 seeds" in c["ratio_note"]


def test_compare_without_pairs_and_table():
    rt = [run("runtime", 1, "aborted"), run("runtime", 2, "success", 50.0, 320)]
    bl = [run("baseline", 1, "success", 80.0, 320), run("baseline", 2, "aborted")]
    c = tta.compare(rt, bl)
    assert c["ratio_time"] is None and c["ratio_samples"] is None and c["ratio_seeds"] == []
    record = {"seeds": [1, 2], "order": ["runtime", "baseline"],
              "runtime": tta.summarize(rt), "baseline": tta.summarize(bl), **c}
    text = tta.table(record)
    assert text.count("aborted") == 2 and "1/2 ok" in text and "0 of 2 seeds" in text
    line = tta.compact(record)
    assert "eval_history" not in json.dumps(line)
    assert line["runtime"]["runs"][1]["time_to_target_s"] == 50.0
    assert record["runtime"]["runs"][1]["eval_history"]  # the full record is untouched


# -------------------------------------------------------------------- baseline pieces

def test_baseline_collate_pads_to_max_length():
    items = [{"input_ids": np.array([101, 7, 103, 102], np.int16),
              "segment_ids": np.array([0, 0, 0, 0], np.int16),
              "masked_lm_positions": np.array([2, 0], np.int16),  # 0 = an empty slot
              "masked_lm_ids": np.array([55, 0], np.int16), "next_sentence_labels": 1},
             {"input_ids": np.array([101, 9, 102], np.int16),
              "segment_ids": np.array([0, 1, 1], np.int16),
              "masked_lm_positions": np.array([1], np.int16),
              "masked_lm_ids": np.array([9], np.int16), "next_sentence_labels": 0}]
    b = pad_to_max_length(16)(items)
    assert b["input_ids"].shape == (2, 16) and b["input_ids"].dtype == torch.long
    assert b["attention_mask"].sum(1).tolist() == [4, 3]
    assert b["token_type_ids"][1, :3].tolist() == [0, 1, 1]
    labels = b["masked_lm_labels"]
    assert labels[0, 2] == 55 and labels[1, 1] == 9
    assert int((labels != -100).sum()) == 2  # the empty slot at position 0 is no label
    assert b["next_sentence_labels"].tolist() == [1, 0] and b["real_tokens"] == 7


def test_baseline_lr_rule():
    lamb = load_config(None, ["optim.name=lamb", "optim.lr=4e-4"])
    assert baseline_lr(lamb, None)[0] == DEFAULT_BASELINE_LR
    assert baseline_lr(lamb, 1e-3)[0] == 1e-3
    adamw = load_config(None, ["optim.name=adamw", "optim.lr=5e-4"])
    assert baseline_lr(adamw, 1e-3)[0] == 5e-4  # the config's own AdamW lr wins


# ------------------------------------------------------------- ablation and sweep arguments


def test_ablation_variants_switch_one_mechanism_each():
    base = load_config(REPO / "submission" / "configs" / "config_CPU-MiniLM_1x2x32x1.toml")
    assert (base.data.balance, base.model.attention, base.train.grad_sync,
            base.optim.name) == ("local", "unpadded", "buckets", "adamw")
    assert tta.default_variants("adamw") == ["best", "random_padded", "reference_optim",
                                             "ddp_sync", "lamb"]
    assert tta.default_variants("lamb")[-1] == "adamw"
    changed = {}
    for v in tta.ABLATION:
        cfg = load_config(REPO / "submission" / "configs" / "config_CPU-MiniLM_1x2x32x1.toml",
                          tta.ablation_overrides(v, adamw_lr=3e-4, lamb_lr=5e-3))
        changed[v] = {k for k in ("data.balance", "model.attention", "optim.backend",
                                  "train.grad_sync", "optim.name", "optim.lr")
                      if getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1])
                      != getattr(getattr(base, k.split(".")[0]), k.split(".")[1])}
    assert changed == {"best": set(), "random_padded": {"data.balance", "model.attention"},
                       "reference_optim": {"optim.backend"}, "ddp_sync": {"train.grad_sync"},
                       "adamw": {"optim.lr"}, "lamb": {"optim.name", "optim.lr"}}
    assert tta.ablation_overrides("adamw", adamw_lr=3e-4)[-1] == "optim.lr=0.0003"


def test_ablation_and_sweep_refuse_bad_arguments(tmp_path, capsys):
    cfg = REPO / "submission" / "configs" / "config_CPU-MiniLM_1x2x32x1.toml"
    common = ["--config", str(cfg), "--out", str(tmp_path / "x.json"),
              "--workdir", str(tmp_path / "w")]
    assert tta.main([*common, "--ablation", "best,nope"]) == 2
    assert "unknown ablation variant(s) ['nope']" in capsys.readouterr().err
    assert tta.main([*common, "--ablation", "adamw"]) == 2
    assert "needs --baseline-lr" in capsys.readouterr().err
    assert tta.main([*common, "--ablation"]) == 2  # default set swaps AdamW for LAMB
    assert "the lamb variant needs --lamb-lr" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
