"""``python -m submission``: submit MLPerf BERT experiments to Slurm, follow them, score them,
package them; search the optimizer's hyperparameters for a batch.

    python -m submission submit  --config C --nexp N [--partition P] [--dry-run] [--set k=v ...]
    python -m submission status  [JOB] [--logs DIR] [--wait]
    python -m submission report  --logs DIR [--json FILE|-]
    python -m submission package --logs DIR --org ORG --system SYS --out DIR
    python -m submission hpo     --config C --space S.toml --trials N [--workers W] [--slurm]

Owns: the command line, and turning errors into messages and exit statuses: 0 done (report:
every run converged and complies; package: no check failed), 1 a run or check failed, 2 bad
input (nothing was submitted or written). The work is in submission.slurm (submit, status),
submission.report (report) and submission.package (package); docs/SLURM.md walks through
all four; submission.hpo does hpo (docs/HPO.md).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from runtime.config import ConfigError
from submission import hpo
from submission import package as pkg
from submission import report as rep
from submission import slurm

WAIT_POLL_S = 5.0   # status --wait: how often Slurm is asked


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m submission", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)

    s = sub.add_parser("submit", help="check a config and sbatch NEXP experiments of it",
                       description="Check a config and submit NEXP experiments of it as one "
                                   "Slurm job (run.sub); --dry-run prints the command and "
                                   "script instead.")
    s.add_argument("--config", required=True, help="config TOML (submission/configs/...)")
    s.add_argument("--nexp", type=int, required=True, help="experiments (MLPerf BERT: 10)")
    s.add_argument("--partition", help="Slurm partition (default: the cluster's default)")
    s.add_argument("--account", help="Slurm account")
    s.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   dest="overrides", help="config override for every experiment (repeatable)")
    s.add_argument("--logdir", type=Path, help="where the experiments' logs go (default "
                   "results/slurm/<config>_<date>)")
    s.add_argument("--time", type=int, dest="time_minutes", metavar="MINUTES",
                   help="walltime (default NEXP x system.walltime_minutes + margin)")
    s.add_argument("--margin", type=int, default=slurm.MARGIN_MINUTES, metavar="MINUTES",
                   help="walltime margin per job (default %(default)s)")
    s.add_argument("--seed-base", type=int, help="experiment i gets seed BASE+i-1 "
                   "(default train.seed)")
    s.add_argument("--resume", action="store_true",
                   help="reuse an existing --logdir: experiments done there are not rerun")
    s.add_argument("--registry", type=Path, default=slurm.DEFAULT_REGISTRY,
                   help="job list that status reads (default %(default)s)")
    s.add_argument("--dry-run", action="store_true",
                   help="check everything, print the exact command and script, submit nothing")

    s = sub.add_parser("status", help="state of submitted jobs and of each experiment",
                       description="Show the state of submitted jobs and of each of their "
                                   "experiments.")
    s.add_argument("job", nargs="?", help="job id (default: every job in the registry)")
    s.add_argument("--logs", type=Path, help="a run.sub LOGDIR (instead of a job id)")
    s.add_argument("--registry", type=Path, default=slurm.DEFAULT_REGISTRY)
    s.add_argument("--wait", action="store_true",
                   help="first wait until the jobs have left Slurm's queue (asked every "
                        f"{WAIT_POLL_S:.0f} s), then show them")

    s = sub.add_parser("report", help="score a directory of MLPerf logs",
                       description="Score a directory of MLPerf logs: convergence, the "
                                   "compliance checker, and MLPerf's olympic mean.")
    s.add_argument("--logs", type=Path, required=True, help="run.sub LOGDIR or any log directory")
    s.add_argument("--json", metavar="FILE", help="write the JSON report here ('-': print it "
                   "instead of the table; default LOGS/report.json)")
    s.add_argument("--no-compliance", action="store_true", help="skip the compliance checker")

    s = sub.add_parser("package", help="MLPerf submission layout, checked",
                       description="Lay a directory of runs out as an MLPerf submission and "
                                   "check it.")
    s.add_argument("--logs", type=Path, required=True)
    s.add_argument("--org", required=True, help="submitting organisation (directory name)")
    s.add_argument("--system", required=True, help="system name (systems/<SYS>.json)")
    s.add_argument("--out", type=Path, required=True, help="the package goes to OUT/ORG")
    s.add_argument("--impl", default="presto_pytorch", help="implementation directory name")
    s.add_argument("--config", type=Path, help="config, when LOGS has no job.json")

    s = sub.add_parser("hpo", help="search hyperparameters with Optuna, each trial a real run",
                       description="Search hyperparameters with Optuna, each trial a real "
                                   "run (docs/HPO.md).")
    hpo.add_arguments(s)
    s = sub.add_parser("hpo-worker", help="one worker of an existing study (a Slurm array "
                       "task runs this)",
                       description="Run one worker of an existing study (what a task of "
                                   "the study's Slurm array runs).")
    s.add_argument("--dir", type=Path, required=True, help="the study directory")
    s.add_argument("--worker", type=int, help="worker index (default SLURM_ARRAY_TASK_ID)")
    return ap


def cmd_submit(a) -> int:
    p = slurm.plan(a.config, a.nexp, a.overrides, partition=a.partition, account=a.account,
                   logdir=a.logdir, time_minutes=a.time_minutes, margin_minutes=a.margin,
                   seed_base=a.seed_base, resume=a.resume, ask_slurm=True)
    if a.dry_run:
        print(slurm.dry_run_text(p))
        return 0
    job = slurm.submit(p, a.registry)
    print(f"submitted job {job}: {p.nexp} experiment(s) of {Path(p.config).name}, walltime "
          f"{p.walltime_minutes} min, logs in {p.logdir}")
    for note in p.notes:
        print(f"note: {note}")
    print(f"follow it:  python -m submission status {job}")
    print(job)
    return 0


def _experiment_line(r: rep.RunResult, active: bool) -> str:
    pending = active and r.exit_code is None and r.status in ("incomplete", "failed", "missing")
    if pending:
        state = "running" if r.log else "pending"
        what = (f"last eval_accuracy {r.eval_accuracy:.4f} at {r.eval_samples} samples"
                if r.eval_accuracy is not None else "")
    elif r.status == "success":
        state, what = "done", (f"time-to-train {r.time_to_train_s:.2f} s, {r.samples_to_converge}"
                               f" samples, eval_accuracy {r.eval_accuracy:.4f}")
    else:
        state, what = "failed", f"{r.status}: {r.reason}"
    return f"  {r.name:<8} {state:<8} {what}"


def _job_status(job_id: str | None, logdir: Path | None) -> list[str]:
    state = slurm.job_state(job_id) if job_id else None
    head = f"job {job_id or '?'}: "
    if state:
        head += state.state + "".join(f", {k} {v}" for k, v in (
            ("exit", state.exit_code), ("elapsed", state.elapsed), ("reason", state.reason)) if v)
        head += f" (from {state.source})"
    lines = [head]
    if logdir is None or not logdir.is_dir():
        return lines + [f"  logs: {logdir or 'unknown'} (not found)"]
    job = slurm.read_job(logdir) or {}
    lines.append(f"  logs: {logdir}  config: {Path(job.get('config', '?')).name}  "
                 f"experiments: {job.get('nexp', '?')}")
    active = bool(state and state.active)
    return lines + [_experiment_line(r, active) for r in rep.find_runs(logdir)]


def _wait(job_ids: list[str]) -> None:
    """Until none of the jobs is pending or running (Ctrl-C stops the wait, not the jobs)."""
    while any(slurm.job_state(j).active for j in job_ids):
        time.sleep(WAIT_POLL_S)


def cmd_status(a) -> int:
    if a.wait:
        ids = [a.job] if a.job else [(slurm.read_job(a.logs) or {}).get("job_id")] if a.logs \
            else [e["job_id"] for e in slurm.registry_entries(a.registry)[-20:]]
        _wait([j for j in ids if j])
    if a.logs:
        job = slurm.read_job(a.logs) or {}
        print("\n".join(_job_status(a.job or job.get("job_id"), a.logs)))
        return 0
    entries = slurm.registry_entries(a.registry)
    if a.job:
        entries = [e for e in entries if e["job_id"] == a.job] or [{"job_id": a.job}]
    if not entries:
        print(f"no jobs in {a.registry} (python -m submission submit records them there)")
        return 0
    for e in entries[-20:]:
        logdir = Path(e["logdir"]) if e.get("logdir") else None
        print("\n".join(_job_status(e["job_id"], logdir)))
    return 0


def cmd_report(a) -> int:
    report = rep.build_report(a.logs, compliance=not a.no_compliance)
    text = json.dumps(report, indent=2)
    if a.json == "-":
        print(text)
    else:
        path = Path(a.json) if a.json else a.logs / "report.json"
        print(rep.format_table(report))
        path.write_text(text + "\n")
        print(f"JSON report: {path}")
    return 0 if rep.all_good(report) else 1


def cmd_package(a) -> int:
    result = pkg.package(a.logs, a.org, a.system, a.out, a.impl, a.config)
    (a.out / "package_report.json").write_text(json.dumps(result, indent=2) + "\n")
    print(pkg.format_checks(result))
    print(f"JSON: {a.out / 'package_report.json'}")
    return 1 if any(c["verdict"] == "fail" for c in result["checks"]) else 0


def _say(line: str) -> None:
    print(line, flush=True)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"submit": cmd_submit, "status": cmd_status, "report": cmd_report,
               "package": cmd_package, "hpo": lambda a: hpo.run_command(a, out=_say),
               "hpo-worker": lambda a: hpo.worker_command(a, out=_say)}[args.command]
    try:
        return handler(args)
    except (slurm.SubmitError, pkg.PackageError, hpo.HpoError, ConfigError,
            FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
