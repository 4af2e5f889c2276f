"""The whole Slurm path for real: ``python -m submission`` against the one-node cluster of
tests/slurm_cluster.py (real munged, slurmctld, slurmd; sbatch, srun, squeue).

``submit`` sends the CPU benchmark config with NEXP=2 and tiny overrides (a 1-layer BERT on the
small real data set, tens of seconds per experiment, one srun task per rank); the test waits for
the job and checks that ``status`` shows both experiments done, that both MLPerf logs pass the
real compliance checker (ruleset 5.0.0) and that ``report`` computes their times from
run_start/run_stop; then ``package`` must pass every check that applies — all but the number of
result files, which needs MLPerf's 10 runs. A submission.org value full of shell syntax rides
along the whole way: it must land verbatim in the MLPerf logs and nothing in it may run.
The cluster's teardown rule: tests/unit/test_slurm_unit.py.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.mllog import compliance, mllog_events
from tests.support.runs import CPU_CONFIG
from tests.support.tiny import run_overrides

pytestmark = pytest.mark.slow   # tests/e2e: every test here is slow

ROOT = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 200


def cli(cluster, *args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "submission", *args], env=cluster.client_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def wait_for(cluster, job: str, logs: Path) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline:
        if not cluster.run("squeue", "-h", "-j", job, "-o", "%i").stdout.strip():
            return
        time.sleep(1)
    cluster.run("scancel", job)
    pytest.fail(f"job {job} still queued after {JOB_TIMEOUT_S} s\n{job_output(logs, job)}")


def job_output(logs: Path, job: str) -> str:
    parts = []
    for path in [logs / f"slurm-{job}.out", *sorted(logs.glob("run_*.out"))]:
        if path.exists():
            parts.append(f"--- {path.name}\n" + path.read_text()[-3000:])
    return "\n".join(parts)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_submit_status_report_package_on_a_real_cluster(slurm_cluster, small_dataset, tmp_path):
    logs, registry = tmp_path / "logs", tmp_path / "jobs.jsonl"
    hostile = f"Presto $(touch {tmp_path}/PWNED1); `touch {tmp_path}/PWNED2` 'q' \"dq\""
    overrides = [o for o in run_overrides(small_dataset, tmp_path)
                 if not o.startswith("train.output_dir=")]   # run.sub sets it per experiment
    overrides += ["system.launcher=srun", "system.walltime_minutes=3",
                  f"submission.org={hostile}"]
    sets = [a for o in overrides for a in ("--set", o)]

    proc = cli(slurm_cluster, "submit", "--config", str(CPU_CONFIG), "--nexp", "2",
               "--logdir", str(logs), "--registry", str(registry), *sets)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = proc.stdout.strip().splitlines()[-1]
    assert job.isdigit() and f"submitted job {job}: 2 experiment(s)" in proc.stdout
    assert "partition debug: MaxTime unlimited min, 1 node(s)" in proc.stdout
    wait_for(slurm_cluster, job, logs)
    out = job_output(logs, job)

    # status: Slurm's word (scontrol: this cluster keeps no accounting) and each experiment's.
    status = cli(slurm_cluster, "status", job, "--registry", str(registry))
    assert status.returncode == 0, status.stderr
    assert f"job {job}: COMPLETED, exit 0:0" in status.stdout, status.stdout + out
    for i in (1, 2):
        assert re.search(rf"run_{i}\s+done\s+time-to-train [\d.]+ s", status.stdout), status.stdout

    # Each experiment: its own seed, a RESULT line, a log that passes the real checker.
    slurm_out = (logs / f"slurm-{job}.out").read_text()
    cleared = "experiment 1: cache_clear done on 1 node(s)" in slurm_out
    assert cleared or "experiment 1: cache_clear NOT done" in slurm_out, slurm_out
    for i, seed in ((1, 42), (2, 43)):
        assert re.search(rf"^RESULT,bert,{seed},\d+,", (logs / f"run_{i}.out").read_text(),
                         re.M), out
        log = logs / f"run_{i}" / "mlperf_bert.log"
        check = compliance(log)
        assert check.returncode == 0 and "SUCCESS" in check.stdout + check.stderr, \
            check.stdout[-2000:] + check.stderr[-2000:]
        events = {e["key"]: e for e in mllog_events(log)}
        assert events["submission_org"]["value"] == hostile       # verbatim, never evaluated
        assert events["seed"]["value"] == seed
        assert events["cache_clear"]["value"] is cleared           # run.sub's word, logged
    assert not list(tmp_path.glob("PWNED*")) and not list(ROOT.glob("PWNED*"))

    # report: times from run_start -> run_stop, samples, verdicts; JSON beside the table.
    rep = cli(slurm_cluster, "report", "--logs", str(logs))
    assert rep.returncode == 0, rep.stdout + rep.stderr
    report = json.loads((logs / "report.json").read_text())
    assert [r["status"] for r in report["runs"]] == ["success", "success"]
    for r in report["runs"]:
        events = {e["key"]: e for e in mllog_events(Path(r["log"]))}
        assert r["time_to_train_s"] == \
            (events["run_stop"]["time_ms"] - events["run_start"]["time_ms"]) / 1000 > 0
        assert r["samples_to_converge"] > 0 and r["compliance"] == "pass"
    assert "2 run(s): olympic scoring needs at least 3" in report["olympic"]["note"]
    assert report["olympic"]["mean_of_converged_s"] > 0
    assert not report["rcp"]["applicable"]

    # package: every check that applies passes; the result count needs 10 runs.
    pkg = cli(slurm_cluster, "package", "--logs", str(logs), "--org", "Presto", "--system",
              "CPU_2core", "--out", str(tmp_path / "pkg"))
    assert pkg.returncode == 1, pkg.stdout + pkg.stderr
    result = json.loads((tmp_path / "pkg" / "package_report.json").read_text())
    verdicts = {c["name"]: c["verdict"] for c in result["checks"]}
    failed = [name for name, v in verdicts.items() if v == "fail"]
    assert failed == ["package_checker: number of result files", "package_checker: overall"], \
        pkg.stdout
    assert verdicts["system description (system_desc_checker)"] == "pass"
    assert verdicts["package_checker: compliance of each result (ruleset 5.0.0)"] == "pass"
    assert result["system_facts_from"] == str(logs / "sysinfo.json")   # the compute node's
    system = json.loads((tmp_path / "pkg" / "Presto" / "systems" / "CPU_2core.json").read_text())
    assert system["accelerators_per_node"] == "0" and system["submitter"] == "Presto"
