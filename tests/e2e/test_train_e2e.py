"""End-to-end: real ranks train the tiny BERT of tests/support/tiny.py on real shards through
run_and_time.sh (mpiexec; Open MPI's mpirun where it is installed), in the directory
``-- train.output_dir`` names; the MLPerf log passes the real compliance checker; invalid
configs stop every rank before training. All slow: each test
is a run_and_time.sh launch of 2 ranks.

Elsewhere, on runs made once: the budget-exhausted run (aborted, no RESULT line, a valid log)
is the session's reference run (tests/e2e/test_resume_e2e.py); a killed rank ending the job
within 60 s, and torchrun training and stopping, are in tests/e2e/test_resume_e2e.py too.
"""
from __future__ import annotations

import json
import re
import shutil

import pytest

from tests.support.mllog import assert_compliant, compliance, mllog_events
from tests.support.runs import run_and_time
from tests.support.tiny import run_overrides

pytestmark = pytest.mark.slow


def test_short_real_run_reaches_target_and_log_passes_checker(small_dataset, tmp_path):
    out = tmp_path / "run"
    # `-- train.output_dir=X` (no RUN_DIR): X is the run directory - run_and_time.sh says X
    # and the ranks write there.
    proc = run_and_time(run_overrides(small_dataset) + [f"train.output_dir={out}", "train.plot=true"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"output {out}" in proc.stderr and (out / "mlperf_bert.log").is_file()
    assert re.search(r"^RESULT,bert,7,\d+,\S+,\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [AP]M$",
                     proc.stdout, re.M), proc.stdout[-2000:]
    assert "eval acc" in proc.stdout and "samples/s" in proc.stdout  # the progress line

    log = out / "mlperf_bert.log"
    assert_compliant(log)
    events = mllog_events(log)
    stop = [e for e in events if e["key"] == "run_stop"]
    assert stop[0]["metadata"]["status"] == "success"
    accs = [e for e in events if e["key"] == "eval_accuracy"]
    assert accs[-1]["value"] >= 0.03 and accs[-1]["metadata"]["epoch_num"] % 160 == 0

    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "success" and summary["samples"] == accs[-1]["metadata"]["epoch_num"]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m["kind"] == "step"]
    assert len(steps) == summary["steps"] and steps[0]["samples"] == 16
    assert all(0 < m["padding_efficiency"] <= 1 for m in steps)
    assert (out / "loss_accuracy.png").stat().st_size > 1000


@pytest.mark.skipif(shutil.which("mpirun.openmpi") is None,
                    reason="Open MPI's mpirun is not installed (make test installs openmpi-bin "
                           "as root)")
def test_open_mpi_mpirun_trains_the_same_run(small_dataset, tmp_path):
    """Open MPI's mpirun starts the same 2-rank training (mpiexec: above; torchrun: the
    SIGTERM-through-torchrun test of tests/e2e/test_resume_e2e.py)."""
    out = tmp_path / "run"
    proc = run_and_time(run_overrides(small_dataset, out, **{"system.launcher": '"mpirun"'}),
                        env_extra={"MPIRUN": "mpirun.openmpi"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RESULT,bert,7," in proc.stdout
    assert compliance(out / "mlperf_bert.log").returncode == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "success"


# A global batch the world does not divide: the one case here that needs the world size. The
# values the config check refuses on their own (a misspelt key, bf16 on CPU, a negative lr)
# are tests/unit/test_bad_input.py's; run_and_time.sh's refusals, tests/e2e/test_run_and_time.py's.
@pytest.mark.parametrize("override, words", [
    ("train.global_batch_size=63", ["train.global_batch_size", "63", "divisible"]),
])
def test_invalid_config_fails_every_rank_before_training(small_dataset, tmp_path, override, words):
    out = tmp_path / "run"
    proc = run_and_time(run_overrides(small_dataset, out) + [override], timeout=120)
    assert proc.returncode != 0
    for word in words:
        assert word in proc.stderr, proc.stderr[-2000:]
    assert not (out / "metrics.jsonl").exists()  # nothing trained
