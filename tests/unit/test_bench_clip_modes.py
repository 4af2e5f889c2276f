"""bench.clip_modes: the clip statistics it reads from a run's metrics file, and bad input."""
from __future__ import annotations

import json

import pytest

from bench.clip_modes import clip_stats, main, table


def test_clip_stats_from_step_records(tmp_path):
    rows = [{"kind": "step", "clip_coef": 0.5, "grad_norm": 2.0, "local_grad_norm": 3.0},
            {"kind": "eval", "eval_accuracy": 0.1},
            {"kind": "step", "clip_coef": 1.0, "grad_norm": 0.5, "local_grad_norm": 1.0},
            {"kind": "step", "clip_coef": 0.25, "grad_norm": 1.5, "local_grad_norm": 5.0}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = clip_stats(path)
    assert s["clip_mean"] == pytest.approx(1.75 / 3)
    assert s["clipped_frac"] == pytest.approx(2 / 3)
    assert s["grad_norm_mean"] == pytest.approx(4.0 / 3)
    assert s["local_norm_mean"] == pytest.approx(3.0)
    run = {"clip_mode": "bucket_before", "seed": 1, "status": "success",
           "time_to_target_s": 200.0, "samples_to_target": 22400, "eval_accuracy": 0.131, **s}
    assert "| bucket_before | 1 | success | 200.0 | 22,400 | 0.1310 |" in table([run])


def test_global_modes_have_no_local_norm_and_a_missing_file_gives_none(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"kind": "step", "clip_coef": 1.0, "grad_norm": 0.3}) + "\n")
    assert clip_stats(path)["local_norm_mean"] is None
    assert clip_stats(tmp_path / "absent.jsonl")["clip_mean"] is None


def test_unknown_mode_is_refused_before_any_run(capsys, tmp_path):
    assert main(["--modes", "global_after,sideways", "--workdir", str(tmp_path / "w")]) == 2
    assert "sideways" in capsys.readouterr().err
    assert not (tmp_path / "w").exists()
