"""Scoring a directory of MLPerf BERT logs: per run status, time-to-train, samples to converge,
the compliance checker's verdict; over all runs the olympic mean and, where it means
something, the RCP check.

Owns: finding the runs of a directory (the ``run_<i>/`` experiments of a run.sub LOGDIR, or any
``mlperf_bert.log``/``result_*.txt`` below it), reading their ``:::MLLOG`` lines, the reason a
run failed (from its log, exit status and launch output), and calling mlperf-logging's
``compliance_checker`` (ruleset ``COMPLIANCE_RULESET`` = 5.0.0, see docs/MLPERF_LOGGING.md: 5.1.0
no longer lists bert) and ``rcp_checker`` as subprocesses, so their verdicts are theirs.
Never: drops a run. A failed, aborted, incomplete or missing run is listed with its reason
and counts in the olympic mean as MLPerf counts it: as a run that did not converge.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from basis.model_shape import size
from submission.mllog_callback import COMPLIANCE_RULESET
from submission.rank_status import read_all
from submission.slurm import read_job

LOG_NAME = "mlperf_bert.log"
MLLOG = ":::MLLOG "
RUN_DIR = re.compile(r"^run_(\d+)$")
ATTEMPT = "run.sub: attempt of experiment"
CHECK_TIMEOUT_S = 180
ERROR_HINTS = re.compile(r"(config error|launch error|error:|fatal:|Error|FAILED|CANCELLED|TIME LIMIT|"
                         r"Killed|Terminated|Traceback|not permitted|timed out)")
BERT_LARGE = size("large")   # what a closed-division run must train


@dataclass
class RunResult:
    """One run as the report sees it. ``status``: success | aborted | incomplete | failed |
    missing (``running`` only from ``status`` while its job runs)."""

    name: str
    log: str | None
    status: str
    reason: str = ""
    seed: int | None = None
    time_to_train_s: float | None = None
    samples_to_converge: int | None = None
    eval_accuracy: float | None = None
    eval_samples: int | None = None
    cache_clear: bool | None = None
    division: str | None = None
    exit_code: int | None = None
    compliance: str | None = None          # "pass" | "fail" | None (not checked)
    compliance_detail: str = ""

    @property
    def converged(self) -> bool:
        return self.status == "success" and self.time_to_train_s is not None


# ------------------------------------------------------------------------------ one log

def read_events(log: Path) -> list[dict]:
    """The ``:::MLLOG`` records of a log; lines that are not JSON are skipped."""
    events = []
    for line in log.read_text(errors="replace").splitlines():
        if MLLOG not in line:
            continue
        try:
            events.append(json.loads(line.split(MLLOG, 1)[1]))
        except ValueError:
            continue
    return events


def analyse_log(name: str, log: Path) -> RunResult:
    events = read_events(log)
    first = {}
    for e in events:
        first.setdefault(e.get("key"), e)
    accs = [e for e in events if e.get("key") == "eval_accuracy"]
    res = RunResult(name, str(log), "failed")
    if "seed" in first:
        res.seed = int(first["seed"]["value"])
    if "cache_clear" in first:
        res.cache_clear = bool(first["cache_clear"]["value"])
    if "submission_division" in first:
        res.division = first["submission_division"]["value"]
    if accs:
        res.eval_accuracy = float(accs[-1]["value"])
        res.eval_samples = int(accs[-1]["metadata"].get("epoch_num", 0))
    start, stop = first.get("run_start"), first.get("run_stop")
    if start is None:
        res.reason = "no run_start in the log: the run failed during initialisation"
        return res
    if stop is None:
        res.status = "incomplete"
        res.reason = "run_start but no run_stop: the run was stopped or died"
        return res
    res.time_to_train_s = (stop["time_ms"] - start["time_ms"]) / 1000.0
    if stop.get("metadata", {}).get("status") == "success":
        res.status = "success"
        res.samples_to_converge = res.eval_samples
    else:
        res.status = "aborted"
        where = (f"last eval_accuracy {res.eval_accuracy:.4f} at {res.eval_samples} samples"
                 if accs else "no evaluation")
        res.reason = f"run_stop status aborted: target not reached ({where})"
    return res


def launch_reason(out: Path) -> str:
    """The most telling line of the latest attempt in a run_<i>.out, else ''."""
    if not out.is_file():
        return ""
    lines = out.read_text(errors="replace").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(ATTEMPT)]
    lines = [ln.strip() for ln in lines[starts[-1] + 1 if starts else 0:] if ln.strip()]
    hits = [ln for ln in lines if ERROR_HINTS.search(ln)]
    return (hits or lines or [""])[-1][:300]


def analyse_experiment(logdir: Path, index: int) -> RunResult:
    """Experiment ``index`` of a run.sub LOGDIR: its log, exit status and launch output."""
    log = logdir / f"run_{index}" / LOG_NAME
    exit_file, out = logdir / f"run_{index}.exit", logdir / f"run_{index}.out"
    if log.is_file():
        res = analyse_log(f"run_{index}", log)
    else:
        res = RunResult(f"run_{index}", None, "missing", "no log: not started yet, or failed "
                        "before the logger started")
    if exit_file.is_file():
        text = exit_file.read_text().strip()
        res.exit_code = int(text) if text.lstrip("-").isdigit() else None
    if res.status != "success":
        detail = launch_reason(out)
        if res.exit_code not in (None, 0):
            detail = f"exit {res.exit_code}" + (f": {detail}" if detail else "")
        if detail:
            res.reason = f"{res.reason}; {detail}" if res.reason else detail
    return res


# ------------------------------------------------------------------------------ a directory

RUN_MARKS = ("launcher.log", "ranks", "summary.json", "metrics.jsonl")
"""What a run directory holds besides its MLPerf log (README, "Outputs of a run"): a directory
with one of them and no log is a run that failed before its logger started."""


def analyse_unlogged(name: str, run_dir: Path) -> RunResult:
    """A run directory with no MLPerf log: failed, with the reason its ranks recorded (the
    first that failed) or, without a record, the launcher's most telling line."""
    res = RunResult(name, None, "failed", "no MLPerf log: the launch failed before the "
                                          "logger started")
    records = read_all(run_dir)
    failed = [(r, rec) for r, rec in sorted(records.items())
              if rec.get("exit") not in (None, 0, 1)]
    if failed:
        rank, rec = failed[0]
        res.exit_code = int(rec["exit"])
        why = (rec.get("reason") or "").strip().splitlines()
        res.reason += f"; rank {rank} exit {rec['exit']}" + (f": {why[-1][:300]}" if why else "")
    else:
        detail = launch_reason(run_dir / "launcher.log")
        if detail:
            res.reason += f"; {detail}"
    return res


def find_runs(logs: Path) -> list[RunResult]:
    """Every run of ``logs``: run.sub's experiments 1..NEXP (missing ones too) when
    ``job.json`` or ``run_<i>/`` directories are there, else every log file below it and
    every run directory without one (``RUN_MARKS``: listed as failed, with why) - listed,
    never dropped."""
    if not Path(logs).is_dir():
        raise FileNotFoundError(f"--logs {logs} is not a directory")
    logs = Path(logs).resolve()   # the checkers run in a temporary directory
    job = read_job(logs)
    indices = {int(m.group(1)) for p in logs.iterdir() if (m := RUN_DIR.match(p.name))}
    indices |= {int(p.name.split("_")[1].split(".")[0]) for p in logs.glob("run_*.exit")}
    if job:
        indices |= set(range(1, int(job["nexp"]) + 1))
    if indices:
        return [analyse_experiment(logs, i) for i in sorted(indices)]
    files = sorted({*logs.rglob(LOG_NAME), *logs.rglob("result_*.txt")})
    runs = {str(f.relative_to(logs)): analyse_log(str(f.relative_to(logs)), f) for f in files}
    logged = {f.parent for f in files}
    for d in {p.parent for mark in RUN_MARKS for p in logs.rglob(mark)} - logged:
        if d.is_dir() and not any(parent in logged for parent in d.parents):
            name = str(d.relative_to(logs)) if d != logs else "."
            runs[name] = analyse_unlogged(name, d)
    return [runs[k] for k in sorted(runs)]


def check_compliance(log: Path) -> tuple[bool, str]:
    """The real checker's verdict (exit 0 and SUCCESS) and, on failure, the keys it named."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
             "--ruleset", COMPLIANCE_RULESET, "--log_output", str(Path(tmp) / "cc.log"),
             str(log)], capture_output=True, text=True, timeout=CHECK_TIMEOUT_S, cwd=tmp)
    out = proc.stdout + proc.stderr
    if proc.returncode == 0 and re.search(r"^INFO - SUCCESS$", out, re.M):
        return True, ""
    keys = re.findall(r"(?:CHECK for|occurrence of|Failed checks for) '?(\w+)'?", out)
    if keys:
        return False, "failed: " + ", ".join(dict.fromkeys(keys))
    return False, (out.strip().splitlines() or ["checker gave no output"])[-1][:300]


def olympic_mean(runs: list[RunResult]) -> dict:
    """MLPerf's olympic scoring: drop the fastest and the slowest run, average the rest. A run
    that did not converge counts as infinitely slow, so one may be the dropped slowest run;
    two or more leave no score."""
    n = len(runs)
    times = sorted((r.time_to_train_s if r.converged else math.inf, r.name) for r in runs)
    ok = [t for t, _ in times if t != math.inf]
    out = {"runs": n, "converged": len(ok), "required_runs": 10, "score_s": None,
           "dropped": [], "note": ""}
    if n < 3:
        plain = sum(ok) / len(ok) if ok else None
        out["mean_of_converged_s"] = plain
        out["note"] = (f"{n} run(s): olympic scoring needs at least 3 (MLPerf BERT uses 10), "
                       "so no olympic mean" + (f"; plain mean of the {len(ok)} converged run(s)"
                                               f" = {plain:.2f} s" if ok else ""))
        return out
    kept = times[1:-1]
    out["dropped"] = [times[0][1], times[-1][1]]
    if any(t == math.inf for t, _ in kept):
        out["note"] = (f"{n - len(ok)} of {n} runs did not converge; olympic scoring drops only "
                       "the slowest one, so there is no score")
        return out
    out["score_s"] = sum(t for t, _ in kept) / len(kept)
    out["note"] = (f"mean of {len(kept)} runs after dropping the fastest ({times[0][1]}) and the "
                   f"slowest ({times[-1][1]})" + ("" if n == 10 else
                                                   f"; MLPerf BERT needs 10 runs, here {n}"))
    return out


# ------------------------------------------------------------------------------ RCP

def rcp_applicability(runs: list[RunResult], job: dict | None) -> str:
    """'' when the RCP check applies, else why not."""
    divisions = {r.division for r in runs if r.division}
    if divisions != {"closed"}:
        return (f"division {', '.join(sorted(d or '?' for d in divisions)) or 'unknown'}: the "
                "reference convergence points (rcp_checker/training_5.0.0/rcps_bert.json) are "
                "samples to 0.720 masked-LM accuracy for BERT-large on the MLPerf Wikipedia set; "
                "an open-division proxy (another model size, data set and target, such as the "
                "CPU benchmark) converges on another scale, so comparing would mean nothing — "
                "and the package_checker runs the RCP check for closed submissions only")
    cfg = _job_config(job)
    if cfg is not None:
        m = cfg.model
        got = {k: getattr(m, k) for k in BERT_LARGE}
        if got != BERT_LARGE or cfg.data.max_seq_length != 512:
            return f"the config is not BERT-large at seq 512 ({got}): the RCPs are for BERT-large"
    return ""


def _job_config(job: dict | None):
    if not job:
        return None
    from runtime.config import ConfigError, load_config
    try:
        return load_config(job["config"], job.get("overrides", []))
    except (ConfigError, OSError):
        return None


def rcp_check(runs: list[RunResult], job: dict | None) -> dict:
    reason = rcp_applicability(runs, job)
    if reason:
        return {"applicable": False, "passed": None, "message": reason}
    logs = [Path(r.log) for r in runs if r.log]
    if len(logs) < 3:
        return {"applicable": True, "passed": None,
                "message": f"not run: {len(logs)} log(s); the check compares the olympic mean "
                           "of samples to converge (fastest and slowest dropped), which needs "
                           "at least 3 runs (MLPerf BERT: 10)"}
    with tempfile.TemporaryDirectory() as tmp:
        for i, log in enumerate(logs):
            (Path(tmp) / f"result_{i}.txt").write_bytes(log.read_bytes())
        out_log = Path(tmp) / "rcp.log"
        proc = subprocess.run([sys.executable, "-m", "mlperf_logging.rcp_checker", tmp,
                               "--rcp_usage", "training", "--rcp_version", COMPLIANCE_RULESET,
                               "--log_output", str(out_log)],
                              capture_output=True, text=True, timeout=CHECK_TIMEOUT_S, cwd=tmp)
        text = out_log.read_text() if out_log.exists() else proc.stdout + proc.stderr
    verdict = [ln for ln in text.splitlines() if "RCP test" in ln or "Submission mean" in ln]
    return {"applicable": True, "passed": proc.returncode == 0,
            "message": " | ".join(verdict) or text.strip()[-300:]}


# ------------------------------------------------------------------------------ the report

def build_report(logs: Path, compliance: bool = True) -> dict:
    logs = Path(logs)
    runs = find_runs(logs)
    if compliance:
        for r in runs:
            if r.log:
                ok, detail = check_compliance(Path(r.log))
                r.compliance, r.compliance_detail = ("pass" if ok else "fail"), detail
    job = read_job(logs)
    return {"logs": str(logs.resolve()), "ruleset": COMPLIANCE_RULESET,
            "job_id": job.get("job_id") if job else None,
            "runs": [asdict(r) for r in runs], "olympic": olympic_mean(runs),
            "rcp": rcp_check(runs, job) if runs else {"applicable": False, "passed": None,
                                                      "message": "no runs"}}


def _fmt(value, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def format_table(report: dict) -> str:
    head = ["run", "status", "seed", "time_to_train_s", "samples", "eval_acc", "cache_clear",
            "compliance", "reason"]
    rows = [head]
    for r in report["runs"]:
        verdict = {"pass": "PASS", "fail": "FAIL", None: "-"}[r["compliance"]]
        if r["compliance_detail"]:
            verdict += f" ({r['compliance_detail']})"
        rows.append([r["name"], r["status"], _fmt(r["seed"]), _fmt(r["time_to_train_s"], ".2f"),
                     _fmt(r["samples_to_converge"]), _fmt(r["eval_accuracy"], ".4f"),
                     _fmt(r["cache_clear"]), verdict, r["reason"]])
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head) - 1)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) + "  " + str(row[-1])
             for row in rows]
    o, rcp = report["olympic"], report["rcp"]
    score = f"{o['score_s']:.2f} s" if o["score_s"] is not None else "none"
    lines += ["", f"logs: {report['logs']}   compliance ruleset: {report['ruleset']} "
              "(5.1.0 no longer lists bert)",
              f"olympic mean time-to-train: {score} — {o['note']}",
              "RCP check: " + ("not applicable: " if not rcp["applicable"] else
                               {True: "PASS: ", False: "FAIL: ", None: ""}[rcp["passed"]])
              + rcp["message"]]
    return "\n".join(lines)


def all_good(report: dict) -> bool:
    runs = report["runs"]
    return bool(runs) and all(r["status"] == "success" and r["compliance"] != "fail"
                              for r in runs)
