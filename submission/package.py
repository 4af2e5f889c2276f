"""MLPerf training submission layout from a directory of runs, checked with mlperf-logging.

Owns: writing ``<out>/<org>/`` as the MLPerf training submission layout::

    systems/<SYS>.json                              system description (submission.sysinfo)
    results/<SYS>/bert/result_<i>.txt               one MLPerf log per run, i = 0, 1, ...
    benchmarks/bert/implementations/<impl>/         the code, the configs, a README

and running ``mlperf_logging.system_desc_checker`` and ``mlperf_logging.package_checker``
(ruleset ``COMPLIANCE_RULESET`` = 5.0.0) on it as subprocesses, turning their log lines into
one verdict per check — pass, fail, or not applicable with the reason.
Never: edits a log, drops a run that has a log (failed runs are packaged: MLPerf counts them),
or writes into an existing ``<out>/<org>``.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from runtime.config import Config
from submission import sysinfo
from submission.mllog_callback import COMPLIANCE_RULESET
from submission.report import find_runs
from submission.slurm import ROOT, SubmitError, check_token, load_checked, read_job

BENCHMARK = "bert"
CODE = ("run_and_time.sh", "Makefile", "requirements.txt", "requirements-data.txt",
        "README.md", "submission", "runtime", "kernels", "loaders", "basis", "docs", "tests")
SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
CHECK_TIMEOUT_S = 600


class PackageError(ValueError):
    """The package cannot be written; the message says what to change."""


@dataclass
class Check:
    name: str
    verdict: str      # pass | fail | n/a
    detail: str


def package(logs: Path, org: str, system: str, out: Path, impl: str = "presto_pytorch",
            config: Path | None = None) -> dict:
    """Write the layout, run the checkers, return what was written and each check's verdict."""
    for what, value in (("--org", org), ("--system", system), ("--impl", impl)):
        try:
            check_token(what, value)
        except SubmitError as e:
            raise PackageError(str(e).replace("Slurm reads this value itself",
                                              "it names directories")) from None
    logs, out = Path(logs).resolve(), Path(out).resolve()   # the checkers run elsewhere
    runs = find_runs(logs)
    if not any(r.log for r in runs):
        raise PackageError(f"--logs {logs}: no MLPerf logs found (run_<i>/mlperf_bert.log or "
                           "result_*.txt)")
    job = read_job(logs)
    cfg = _config(job, config, logs)
    top = out / org
    if top.exists():
        raise PackageError(f"{top} exists: remove it or pick another --out")
    facts, facts_from = _facts(logs, cfg)
    sys_json = top / "systems" / f"{system}.json"
    sys_json.parent.mkdir(parents=True)
    sys_json.write_text(json.dumps(sysinfo.system_description(facts, cfg, org, system),
                                   indent=2) + "\n")
    results = top / "results" / system / BENCHMARK
    results.mkdir(parents=True)
    packaged = []
    for i, run in enumerate(r for r in runs if r.log):
        shutil.copyfile(run.log, results / f"result_{i}.txt")
        packaged.append({"result": f"result_{i}.txt", "run": run.name, "status": run.status})
    impl_dir = _write_implementation(top, impl, cfg, job, system)
    checks = run_checks(top, sys_json, cfg)
    return {"package": str(top), "system_json": str(sys_json), "system_facts_from": facts_from,
            "results": packaged,
            "not_packaged": [{"run": r.name, "reason": r.reason} for r in runs if not r.log],
            "implementation": str(impl_dir), "ruleset": COMPLIANCE_RULESET,
            "checks": [asdict(c) for c in checks]}


def _config(job: dict | None, config: Path | None, logs: Path) -> Config:
    if config is not None:
        return load_checked(config, [])
    if job is None:
        raise PackageError(f"--logs {logs} has no job.json (not a run.sub LOGDIR): pass --config")
    try:
        return load_checked(job["config"], job.get("overrides", []))
    except SubmitError as e:
        raise PackageError(f"the config of job {job.get('job_id')}: {e}; pass --config") from None


def _facts(logs: Path, cfg: Config) -> tuple[dict, str]:
    """The compute node's facts (run.sub's sysinfo.json) when there, else this host's."""
    path = logs / "sysinfo.json"
    if path.is_file():
        try:
            return json.loads(path.read_text()), str(path)
        except ValueError:
            pass
    data = Path(cfg.data.data_dir)
    data = data if data.is_absolute() else ROOT / data
    return sysinfo.collect(data if data.exists() else ROOT), "this host (no sysinfo.json in --logs)"


def _write_implementation(top: Path, impl: str, cfg: Config, job: dict | None,
                          system: str) -> Path:
    dest = top / "benchmarks" / BENCHMARK / "implementations" / impl
    dest.mkdir(parents=True)
    for name in CODE:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=SKIP)
        elif src.is_file():
            shutil.copy2(src, dest / name)
    source = Path(job["config"]) if job else Path(cfg.source)
    overrides = job.get("overrides", []) if job else []
    (dest / "README.md").write_text(_impl_readme(cfg, source, overrides, job, system))
    return dest


def _impl_readme(cfg: Config, source: Path, overrides: list[str], job: dict | None,
                 system: str) -> str:
    over = "\n".join(f"    {o}" for o in overrides) or "    (none)"
    submit = (f"    python -m submission submit --config submission/configs/{source.name} "
              f"--nexp {job['nexp']}" if job else "    (not submitted through run.sub)")
    return f"""# Presto BERT pre-training ({system})

MLPerf-style BERT pre-training on PyTorch; the repository README explains the layout.
Results in `results/{system}/{BENCHMARK}/` were produced with config `{source.name}`
(copied here under `submission/configs/` when it lives there) and these overrides:

{over}

How they were run (Slurm, `submission/run.sub`, one experiment per result):

{submit}
    python -m submission report --logs LOGDIR

Model: {cfg.model.num_hidden_layers} layers, hidden {cfg.model.hidden_size}; sequence length
{cfg.data.max_seq_length}; global batch {cfg.train.global_batch_size}; target masked-LM accuracy
{cfg.train.target_mlm_accuracy}; division {cfg.submission.division}.
Logs are checked with `python -m mlperf_logging.compliance_checker --usage training --ruleset
{COMPLIANCE_RULESET}` ({COMPLIANCE_RULESET}: the last ruleset that lists bert).
"""


# ------------------------------------------------------------------------------ the checkers

def _run_checker(module: str, *args: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "checker.log"
        proc = subprocess.run([sys.executable, "-m", module, *args, "--log_output", str(log)],
                              capture_output=True, text=True, timeout=CHECK_TIMEOUT_S, cwd=tmp)
        text = log.read_text() if log.exists() else ""
    if "Traceback" in proc.stderr:
        raise PackageError(f"{module} crashed:\n{proc.stderr[-2000:]}")
    return text


def run_checks(top: Path, sys_json: Path, cfg: Config) -> list[Check]:
    text = _run_checker("mlperf_logging.system_desc_checker", str(sys_json), "training",
                        COMPLIANCE_RULESET)
    failed = re.search(r"System description checker failed for \S* : (.*)", text)
    checks = [Check("system description (system_desc_checker)",
                    "fail" if failed or "passed for" not in text else "pass",
                    failed.group(1) if failed else "all required fields present, status valid")]
    text = _run_checker("mlperf_logging.package_checker", str(top), "training", COMPLIANCE_RULESET)
    return checks + package_checks(text, cfg.submission.division)


def package_checks(text: str, division: str) -> list[Check]:
    """One verdict per check of a package_checker log."""
    checks = []
    sysd = re.search(r"System description (?:file )?checker (passed|failed)[^\n]*", text)
    checks.append(Check("package_checker: system description", "pass" if sysd and
                        sysd.group(1) == "passed" else "fail", sysd.group(0) if sysd else ""))
    count = re.search(r"Incorrect number of files[^\n]*found (\d+), expected (\d+)", text)
    checks.append(Check("package_checker: number of result files",
                        "fail" if count else "pass",
                        f"found {count.group(1)}, MLPerf {BENCHMARK} needs {count.group(2)}: "
                        f"submit --nexp {count.group(2)}" if count else "as many as MLPerf needs"))
    runs = len(re.findall(r"^INFO - Run \d+/\d+", text, re.M))
    bad = re.search(r"(\d+) files do not comply|(1) file does not comply", text)
    nbad = int(bad.group(1) or bad.group(2)) if bad else 0
    checks.append(Check(f"package_checker: compliance of each result (ruleset {COMPLIANCE_RULESET})",
                        "fail" if nbad else "pass",
                        f"{runs - nbad} of {runs} result files comply" +
                        (" (one non-compliant file is accepted under olympic scoring)"
                         if nbad == 1 else "")))
    closed_only = (f"not run: division {division}; package_checker runs it for closed "
                   "submissions only")
    if division != "closed":
        checks.append(Check("package_checker: unique seeds", "n/a", closed_only))
        checks.append(Check("package_checker: RCP (reference convergence points)", "n/a",
                            closed_only + "; the RCPs are BERT-large samples to 0.720, "
                            "meaningless for a proxy model and target"))
    else:
        checks.append(Check("package_checker: unique seeds",
                            "fail" if "Seed checker failed" in text else "pass", ""))
        rcp = re.search(r"RCP Test (Passed|Failed): ([^\n]*)", text)
        checks.append(Check("package_checker: RCP (reference convergence points)",
                            "pass" if rcp and rcp.group(1) == "Passed" else "fail",
                            rcp.group(2) if rcp else "no RCP verdict in the log"))
    checks.append(Check("package_checker: power", "n/a", "no power measurements (none taken)"))
    ok = "PACKAGE CHECKER FOUND NO ERRORS" in text
    errors = re.findall(r"^ERROR - (.*)$", text, re.M)
    checks.append(Check("package_checker: overall", "pass" if ok else "fail",
                        "no errors" if ok else "; ".join(errors)[:500]))
    return checks


def format_checks(result: dict) -> str:
    rows = [("check", "verdict", "detail")] + [
        (c["name"], c["verdict"].upper(), c["detail"]) for c in result["checks"]]
    w = max(len(r[0]) for r in rows)
    lines = [f"package: {result['package']}",
             f"system description from: {result['system_facts_from']}",
             f"results: " + ", ".join(f"{p['result']} <- {p['run']} ({p['status']})"
                                      for p in result["results"])]
    lines += [f"not packaged (no log): {n['run']}: {n['reason']}" for n in result["not_packaged"]]
    lines += ["", *(f"{r[0].ljust(w)}  {r[1].ljust(7)}  {r[2]}" for r in rows)]
    return "\n".join(lines)
