"""python -m submission report, package and status on a synthetic run.sub LOGDIR (MLPerf logs
written by tests/support/mllog.py), in seconds; Slurm's squeue/sacct/scontrol are stub scripts
on PATH where status asks them. Submitting and run.sub itself: tests/e2e/test_submission.py.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from submission import report as rep
from tests.support.launch import ROOT
from tests.support.mllog import PROXY, simulate
from tests.support.runs import CPU_CONFIG

pytestmark = pytest.mark.slow   # tests/e2e: every test here is slow


@pytest.fixture
def tool_env(tmp_path):
    """(bin dir first on PATH, for stub Slurm clients; the environment without a job's)."""
    bindir = tmp_path / "bin dir"
    bindir.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PMI_", "OMPI_")) and k not in (
               "CONFIG", "NEXP", "LOGDIR", "PRESTO_OVERRIDES", "PRESTO_ROOT", "SEED_BASE")}
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    return bindir, env


def cli(env, *args, cwd=ROOT):
    env = dict(env, PYTHONPATH=str(ROOT))   # the repository importable from any cwd
    return subprocess.run([sys.executable, "-m", "submission", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


# ------------------------------------------------------------------------------ report

def make_logdir(tmp_path) -> Path:
    """A run.sub LOGDIR of 4 experiments: 2 converged, 1 aborted, 1 that never started."""
    logs = tmp_path / "logs"
    for i, accs, status in ((1, [0.36, 0.41, 0.45], "success"), (2, [0.36, 0.41, 0.46], "success"),
                            (3, [0.30, 0.33], "aborted")):
        simulate(logs / f"run_{i}" / "mlperf_bert.log", accs, overrides=PROXY, status=status,
                 cache_clear=i != 2)
        (logs / f"run_{i}.exit").write_text("0\n" if status == "success" else "1\n")
    (logs / "run_4.out").write_text("run.sub: attempt of experiment 4 at now\n"
                                    "config error: data.data_dir missing\nmore noise\n")
    (logs / "run_4.exit").write_text("2\n")
    (logs / "job.json").write_text(json.dumps({"job_id": "9", "nexp": 5, "config": str(CPU_CONFIG),
                                               "overrides": []}))
    return logs


def test_report_lists_every_run_with_status_time_and_verdict(tool_env, tmp_path):
    _, env = tool_env
    logs = make_logdir(tmp_path)
    proc = cli(env, "report", "--logs", str(logs))
    assert proc.returncode == 1, proc.stdout + proc.stderr     # not every run converged
    report = json.loads((logs / "report.json").read_text())
    runs = {r["name"]: r for r in report["runs"]}
    assert list(runs) == ["run_1", "run_2", "run_3", "run_4", "run_5"]
    assert [r["status"] for r in runs.values()] == ["success", "success", "aborted", "missing",
                                                    "missing"]
    for name in ("run_1", "run_2"):
        events = rep.read_events(Path(runs[name]["log"]))
        t = {e["key"]: e["time_ms"] for e in events if e["key"] in ("run_start", "run_stop")}
        assert runs[name]["time_to_train_s"] == (t["run_stop"] - t["run_start"]) / 1000
        assert runs[name]["compliance"] == "pass"
    assert runs["run_1"]["samples_to_converge"] == runs["run_1"]["eval_samples"] > 0
    assert runs["run_2"]["cache_clear"] is False and runs["run_1"]["cache_clear"] is True
    assert "target not reached (last eval_accuracy 0.3300" in runs["run_3"]["reason"]
    assert runs["run_3"]["compliance"] == "pass"       # open division: aborted logs comply
    assert runs["run_4"]["reason"].endswith("exit 2: config error: data.data_dir missing")
    assert report["olympic"]["score_s"] is None and "3 of 5 runs did not converge" in \
        report["olympic"]["note"]
    assert not report["rcp"]["applicable"] and "open" in report["rcp"]["message"]
    for name in runs:
        assert re.search(rf"^{name}\s", proc.stdout, re.M), proc.stdout
    assert "compliance ruleset: 5.0.0" in proc.stdout


def test_report_json_to_stdout_relative_paths_and_bad_dir(tool_env, tmp_path):
    _, env = tool_env
    make_logdir(tmp_path)
    proc = cli(env, "report", "--logs", "logs", "--json", "-", "--no-compliance", cwd=tmp_path)
    assert json.loads(proc.stdout)["runs"][0]["compliance"] is None
    proc = cli(env, "report", "--logs", "logs", "--json", "-", cwd=tmp_path)
    assert json.loads(proc.stdout)["runs"][0]["compliance"] == "pass", proc.stdout
    proc = cli(env, "report", "--logs", str(tmp_path / "nope"))
    assert proc.returncode == 2 and "is not a directory" in proc.stderr


# ------------------------------------------------------------------------------ package


def test_package_layout_and_checks(tool_env, tmp_path):
    _, env = tool_env
    logs = make_logdir(tmp_path)
    out = tmp_path / "pkg"
    proc = cli(env, "package", "--logs", str(logs), "--org", "Presto", "--system", "CPU_2core",
               "--out", str(out))
    assert proc.returncode == 1, proc.stdout + proc.stderr      # 3 result files, 10 needed
    top = out / "Presto"
    results = sorted(p.name for p in (top / "results" / "CPU_2core" / "bert").iterdir())
    assert results == ["result_0.txt", "result_1.txt", "result_2.txt"]
    assert (top / "results/CPU_2core/bert/result_2.txt").read_bytes() == \
        (logs / "run_3" / "mlperf_bert.log").read_bytes()
    impl = top / "benchmarks" / "bert" / "implementations" / "presto_pytorch"
    for f in ("run_and_time.sh", "submission/run.sub", "submission/configs/config_CPU_1x2x32x1.toml",
              "runtime/config/__init__.py", "basis/model_shape.py", "README.md"):
        assert (impl / f).is_file(), f
    assert not list(impl.rglob("__pycache__"))
    res = json.loads((out / "package_report.json").read_text())
    verdicts = {c["name"]: c["verdict"] for c in res["checks"]}
    assert verdicts["system description (system_desc_checker)"] == "pass"
    assert verdicts["package_checker: system description"] == "pass"
    assert verdicts["package_checker: number of result files"] == "fail"
    assert verdicts["package_checker: compliance of each result (ruleset 5.0.0)"] == "pass"
    assert verdicts["package_checker: unique seeds"] == "n/a"
    assert verdicts["package_checker: RCP (reference convergence points)"] == "n/a"
    assert verdicts["package_checker: overall"] == "fail"
    assert [n["run"] for n in res["not_packaged"]] == ["run_4", "run_5"]
    assert "found 3, MLPerf bert needs 10" in proc.stdout
    again = cli(env, "package", "--logs", str(logs), "--org", "Presto", "--system", "CPU_2core",
                "--out", str(out))
    assert again.returncode == 2 and "exists" in again.stderr
    # Relative --logs/--out (the checkers run in a temporary directory: paths must not break).
    rel = cli(env, "package", "--logs", "logs", "--org", "Presto", "--system", "CPU_2core",
              "--out", "pkg2", cwd=tmp_path)
    assert rel.returncode == 1 and "Traceback" not in rel.stderr, rel.stdout + rel.stderr
    rel = json.loads((tmp_path / "pkg2" / "package_report.json").read_text())
    assert [c["verdict"] for c in rel["checks"]] == [c["verdict"] for c in res["checks"]]


@pytest.mark.parametrize("args,expect", [
    (["--org", "Presto Inc", "--system", "S"], "--org 'Presto Inc'"),
    (["--org", "P", "--system", "../../etc"], "--system '../../etc'"),
])
def test_package_refuses_unsafe_names(tool_env, tmp_path, args, expect):
    _, env = tool_env
    logs = make_logdir(tmp_path)
    proc = cli(env, "package", "--logs", str(logs), "--out", str(tmp_path / "pkg"), *args)
    assert proc.returncode == 2 and expect in proc.stderr, proc.stderr
    assert not (tmp_path / "pkg").exists()


# ------------------------------------------------------------------------------ status

def test_status_reads_logs_and_slurm_fallbacks(tool_env, tmp_path):
    bindir, env = tool_env
    # squeue: not queued; sacct: accounting disabled; scontrol: still remembers the job.
    (bindir / "squeue").write_text("#!/bin/sh\nexit 0\n")
    (bindir / "sacct").write_text("#!/bin/sh\necho 'Slurm accounting storage is disabled' >&2\n"
                                  "exit 1\n")
    (bindir / "scontrol").write_text("#!/bin/sh\necho 'JobId=9 JobState=FAILED Reason=NonZeroExitCode "
                                     "ExitCode=1:0 RunTime=00:01:05'\n")
    for name in ("squeue", "sacct", "scontrol"):
        (bindir / name).chmod(0o755)
    logs = make_logdir(tmp_path)
    proc = cli(env, "status", "--logs", str(logs))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "job 9: FAILED, exit 1:0, elapsed 00:01:05, reason NonZeroExitCode (from scontrol)" in out
    assert re.search(r"run_1\s+done\s+time-to-train [\d.]+ s", out), out
    assert re.search(r"run_3\s+failed\s+aborted: run_stop status aborted", out), out
    assert re.search(r"run_4\s+failed\s+missing: .*exit 2: config error", out), out
