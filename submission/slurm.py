"""Slurm batch submission of NEXP experiments, and what Slurm says about the jobs.

Owns: checking a config, its overrides and its data paths for a cluster run; the walltime of
NEXP experiments; the ``sbatch`` command for ``submission/run.sub`` and the environment that
carries every value to it; submitting, recording the job (``LOGDIR/job.json`` and a registry
of jobs) and asking ``squeue``/``sacct``/``scontrol`` for a job's state.
Never: builds a string for a shell to parse. The sbatch command is an argv list and every
value reaches run.sub in an environment variable (``sbatch --export=ALL``), which run.sub only
ever expands quoted; values that Slurm itself reads (partition, account, job name) or that end
up in Slurm file patterns (LOGDIR) are checked against a plain character set instead, with an
error naming the value. Never reads the MLPerf logs either (submission.report does).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from runtime.config import Config, ConfigError, load_config
from submission.launchers import LAUNCHERS

ROOT = Path(__file__).resolve().parents[1]
RUN_SUB = ROOT / "submission" / "run.sub"
DEFAULT_LOGS = ROOT / "results" / "slurm"
DEFAULT_REGISTRY = DEFAULT_LOGS / "jobs.jsonl"
JOB_FILE = "job.json"
MARGIN_MINUTES = 5          # per job: allocation start, sysinfo, a slow last cache clear
# Slurm's warning before the time limit (sbatch --signal=B:USR1@N): run.sub asks the running
# experiment to checkpoint and stop, then requeues the job, which resumes from the checkpoint.
SIGNAL_LEAD_S = 120
SAFE_TOKEN = re.compile(r"[A-Za-z0-9_.+-]+")
SLURM_TIMEOUT_S = 30


class SubmitError(ValueError):
    """Input that cannot be submitted; the message names the value and what to do."""


@dataclass
class Plan:
    """Everything about one submission, checked; ``argv`` and ``env`` are what runs."""

    config: str
    overrides: list[str]
    nexp: int
    logdir: str
    walltime_minutes: int
    argv: list[str]
    env: dict[str, str]
    notes: list[str] = field(default_factory=list)

    def command_line(self) -> str:
        """The exact command as one shell line: environment assignments, then sbatch."""
        assigns = [f"{k}={shlex.quote(v)}" for k, v in self.env.items()]
        return " ".join(assigns + [shlex.quote(a) for a in self.argv])


# ------------------------------------------------------------------------------------ checks

def check_token(what: str, value: str) -> str:
    if not SAFE_TOKEN.fullmatch(value):
        raise SubmitError(f"{what} {value!r}: use letters, digits and '_', '.', '+', '-' only "
                          "(Slurm reads this value itself)")
    return value


# Set by run.sub for each experiment: an override would give every experiment the same one.
PER_EXPERIMENT = {"train.seed": "--seed-base", "train.output_dir": "--logdir",
                  "train.checkpoint_dir": "--logdir (each experiment checkpoints into its "
                                          "own run_<i>/checkpoints)"}


def check_overrides(overrides) -> list[str]:
    out = []
    for text in overrides:
        name, sep, _ = text.partition("=")
        if not sep or "." not in name or text.startswith("-"):
            raise SubmitError(f"override {text!r} is not section.key=value")
        if name.strip() in PER_EXPERIMENT:
            raise SubmitError(f"override {text!r}: run.sub sets {name.strip()} per experiment; "
                              f"use {PER_EXPERIMENT[name.strip()]} instead")
        if "\n" in text or "\r" in text or "\0" in text:
            raise SubmitError(f"override {text!r} holds a line break or NUL: put multi-line values "
                              "in the config file")
        out.append(text)
    return out


def load_checked(config: str | Path, overrides: list[str]) -> Config:
    path = Path(config)
    if not path.is_file():
        raise SubmitError(f"config {path} does not exist (configs live in submission/configs/)")
    try:
        return load_config(path, overrides)
    except ConfigError as e:
        raise SubmitError(f"config {path}: {e}") from None


def repo_path(value: str) -> Path:
    """A config path as run.sub sees it: relative to the repository root."""
    path = Path(value)
    return path if path.is_absolute() else ROOT / path


def check_data(cfg: Config) -> None:
    from loaders.dataset import DataSetInfo, check_data_set
    from basis.presets import build_hint
    from loaders.shards import DataError

    data = repo_path(cfg.data.data_dir)
    build = build_hint(data, cfg.data.max_seq_length, cfg.data.max_predictions_per_seq)
    if not data.is_dir():
        raise SubmitError(f"data.data_dir = {cfg.data.data_dir!r} ({data}) does not exist on "
                          f"this host: build it - {build} - or set data.data_dir to the shared "
                          "data set")
    if not (data / "stats.json").is_file():
        raise SubmitError(f"data.data_dir {data} holds no stats.json: not a prepared data set "
                          f"(build it: {build})")
    try:  # what the ranks check first (the parameters it records), before anything is queued
        stats = json.loads((data / "stats.json").read_text())
        vocab = stats.get("vocab") if isinstance(stats.get("vocab"), dict) else {}
        info = DataSetInfo(data, (), (), dict(stats.get("parameters") or {}),
                           vocab.get("size") if isinstance(vocab.get("size"), int) else None)
        check_data_set(info, max_seq_length=cfg.data.max_seq_length,
                       max_predictions_per_seq=cfg.data.max_predictions_per_seq,
                       vocab_size=cfg.model.vocab_size)
    except (ValueError, AttributeError) as e:
        raise SubmitError(f"data.data_dir {data}: stats.json is not readable JSON ({e}): "
                          f"rebuild the data set ({build})") from None
    except DataError as e:
        raise SubmitError(str(e)) from None
    if cfg.model.init not in ("scratch", "minilm") and not repo_path(cfg.model.init).exists():
        raise SubmitError(f"model.init = {cfg.model.init!r} does not exist on this host")


def check_layout(cfg: Config) -> None:
    s = cfg.system
    try:
        cfg.local_batch_size(s.nodes * s.ranks_per_node)
    except ConfigError as e:
        raise SubmitError(str(e)) from None
    if s.nodes > 1 and not LAUNCHERS[s.launcher].starts_every_node:
        # run.sub runs any launcher but srun once, from the batch shell on the first node.
        raise SubmitError(f"system.launcher = '{s.launcher}' runs on one node under run.sub "
                          "(it starts only its own node's ranks); use system.launcher = 'srun' "
                          "for several nodes")
    # Not a launcher's trait: run.sub adds the pyxis flags to its own srun step only.
    if s.container_image and s.launcher != "srun":
        raise SubmitError("system.container_image needs system.launcher = 'srun' (pyxis adds the "
                          "container to srun steps)")
    if s.container_image:
        for what, path in (("the repository", ROOT), ("data.data_dir", repo_path(cfg.data.data_dir))):
            if re.search(r"[,:\s]", str(path)):
                raise SubmitError(f"{what} path {path} holds ',', ':' or a space, which "
                                  "--container-mounts cannot express")


def check_logdir(logdir: Path, resume: bool) -> Path:
    logdir = logdir.resolve()
    if re.search(r"[%\n\r]", str(logdir)):
        raise SubmitError(f"--logdir {str(logdir)!r}: '%' (a Slurm file pattern) and line breaks "
                          "are not allowed")
    if logdir.exists() and any(logdir.iterdir()) and not resume:
        raise SubmitError(f"--logdir {logdir} exists and is not empty: pick a new one, or pass "
                          "--resume to run the experiments not yet done there")
    return logdir


def required_minutes(cfg: Config, nexp: int, margin: int = MARGIN_MINUTES) -> int:
    return nexp * cfg.system.walltime_minutes + margin


def check_walltime(cfg: Config, nexp: int, time_minutes: int | None, margin: int) -> int:
    need = required_minutes(cfg, nexp, margin)
    if time_minutes is None:
        return need
    if time_minutes < need:
        raise SubmitError(
            f"--time {time_minutes} min is too short for {nexp} experiment(s): {nexp} x "
            f"system.walltime_minutes ({cfg.system.walltime_minutes}) + {margin} min margin = "
            f"{need} min; raise --time, lower --nexp, or lower system.walltime_minutes")
    return time_minutes


# ------------------------------------------------------------------------ Slurm, read only

def slurm_env() -> dict[str, str]:
    return dict(os.environ)


def _slurm(*argv: str) -> subprocess.CompletedProcess | None:
    """Run a Slurm client; None when it is not installed or does not answer."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, env=slurm_env(),
                              timeout=SLURM_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None


def parse_slurm_minutes(text: str) -> int | None:
    """Slurm durations ('30', '1:30:00', '2-00:00:00', 'UNLIMITED') in minutes; None = no limit."""
    text = text.strip()
    if text.upper() in ("UNLIMITED", "INFINITE", "NONE", ""):
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if len(parts) == 1:
        h, m, s = (0, parts[0], 0) if not days else (parts[0], 0, 0)
    elif len(parts) == 2:
        h, m, s = (0, parts[0], parts[1]) if not days else (parts[0], parts[1], 0)
    else:
        h, m, s = parts[-3:]
    return int(days or 0) * 1440 + h * 60 + m + (1 if s else 0)


def partition_limits(partition: str | None) -> dict | None:
    """MaxTime (minutes, None = unlimited), TotalNodes and name of a partition (the default one
    when None), from ``scontrol show partition``; None when Slurm does not answer."""
    proc = _slurm("scontrol", "show", "partition", "-o", *([partition] if partition else []))
    if proc is not None and partition and "not found" in proc.stdout + proc.stderr:
        known = _slurm("sinfo", "-h", "-o", "%R")
        names = " ".join(known.stdout.split()) if known and known.returncode == 0 else "?"
        raise SubmitError(f"--partition {partition}: Slurm has no such partition (it has: "
                          f"{names})")
    if proc is None or proc.returncode != 0:
        return None
    for line in proc.stdout.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if partition is None and fields.get("Default") != "YES":
            continue
        return {"name": fields.get("PartitionName"),
                "max_minutes": parse_slurm_minutes(fields.get("MaxTime", "")),
                "nodes": int(fields.get("TotalNodes", "0") or 0)}
    return None


def check_partition(cfg: Config, partition: str | None, minutes: int, notes: list[str]) -> None:
    limits = partition_limits(partition)
    if limits is None:
        notes.append("partition limits not checked (scontrol show partition did not answer)")
        return
    name = limits["name"]
    if limits["max_minutes"] is not None and minutes > limits["max_minutes"]:
        raise SubmitError(f"walltime {minutes} min exceeds partition {name}'s MaxTime "
                          f"({limits['max_minutes']} min): lower --nexp or pick another "
                          "--partition")
    if limits["nodes"] and cfg.system.nodes > limits["nodes"]:
        raise SubmitError(f"system.nodes = {cfg.system.nodes} but partition {name} has "
                          f"{limits['nodes']} node(s)")
    notes.append(f"partition {name}: MaxTime "
                 f"{limits['max_minutes'] if limits['max_minutes'] is not None else 'unlimited'}"
                 f" min, {limits['nodes']} node(s)")


# ------------------------------------------------------------------------------------- plan

def plan(config: str | Path, nexp: int, overrides=(), *, partition: str | None = None,
         account: str | None = None, logdir: str | Path | None = None,
         time_minutes: int | None = None, margin_minutes: int = MARGIN_MINUTES,
         seed_base: int | None = None, resume: bool = False, ask_slurm: bool = True) -> Plan:
    """Check everything and build the sbatch command; raises SubmitError before any submit."""
    if nexp < 1:
        raise SubmitError(f"--nexp {nexp}: need at least 1 experiment (MLPerf BERT: 10)")
    if partition is not None:
        check_token("--partition", partition)
    if account is not None:
        check_token("--account", account)
    overrides = check_overrides(overrides)
    config = Path(config).resolve()
    cfg = load_checked(config, overrides)
    check_layout(cfg)
    check_data(cfg)
    minutes = check_walltime(cfg, nexp, time_minutes, margin_minutes)
    if logdir is None:
        logdir = DEFAULT_LOGS / f"{config.stem}_{time.strftime('%Y%m%d_%H%M%S')}"
    logdir = check_logdir(Path(logdir), resume)
    notes: list[str] = []
    if nexp != 10:
        notes.append(f"{nexp} experiment(s): an MLPerf BERT result needs 10")
    if ask_slurm:
        check_partition(cfg, partition, minutes, notes)
    return Plan(str(config), overrides, nexp, str(logdir), minutes,
                sbatch_argv(cfg, logdir, minutes, partition, account),
                run_sub_env(config, nexp, logdir, overrides, seed_base), notes)


def sbatch_argv(cfg: Config, logdir: Path, minutes: int, partition: str | None,
                account: str | None) -> list[str]:
    return job_argv(cfg, minutes, partition, account, script=RUN_SUB, flags=[
        f"--job-name=presto_bert_{cfg.system.name}", "--exclusive", "--requeue",
        "--open-mode=append", f"--signal=B:USR1@{SIGNAL_LEAD_S}",
        f"--output={logdir}/slurm-%j.out"])


def job_argv(cfg: Config, minutes: int, partition: str | None, account: str | None, *,
             script: Path, flags: list[str]) -> list[str]:
    """The sbatch argv of a batch ``script``: the config's nodes, tasks and GPUs, the
    walltime, partition and account, the script's own ``flags``; run from the repository with
    the submitter's environment (the values travel in it)."""
    s = cfg.system
    argv = ["sbatch", "--parsable", *flags[:1], f"--nodes={s.nodes}",
            f"--ntasks-per-node={s.ranks_per_node}", f"--time={minutes}", *flags[1:],
            f"--chdir={ROOT}", "--export=ALL"]
    if s.device == "cuda":
        argv.append(f"--gpus-per-node={s.ranks_per_node}")
    if partition:
        argv.append(f"--partition={partition}")
    if account:
        argv.append(f"--account={account}")
    return argv + [str(script)]


def run_sub_env(config: Path, nexp: int, logdir: Path, overrides: list[str],
                seed_base: int | None) -> dict[str, str]:
    """The variables run.sub reads (its header documents them)."""
    env = {"CONFIG": str(config), "NEXP": str(nexp), "LOGDIR": str(logdir),
           "PRESTO_ROOT": str(ROOT), "PRESTO_OVERRIDES": "\n".join(overrides)}
    if seed_base is not None:
        env["SEED_BASE"] = str(seed_base)
    return env


def dry_run_text(p: Plan) -> str:
    lines = ["# sbatch command (run from any directory; values reach run.sub as environment "
             "variables, exported by --export=ALL):", p.command_line(), "",
             f"# walltime {p.walltime_minutes} min; logs in {p.logdir}"]
    lines += [f"# note: {n}" for n in p.notes]
    lines += ["", f"# batch script {RUN_SUB}:", RUN_SUB.read_text()]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ submit/status

def run_sbatch(p: Plan) -> str:
    """Run the plan's sbatch (LOGDIR made first: Slurm writes the job's output there); the
    job id."""
    if shutil.which("sbatch") is None:
        raise SubmitError("sbatch not found: run this on a Slurm login node (or use --dry-run)")
    Path(p.logdir).mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(p.argv, env={**slurm_env(), **p.env}, capture_output=True, text=True,
                          timeout=SLURM_TIMEOUT_S)
    if proc.returncode != 0:
        raise SubmitError(f"sbatch failed ({proc.returncode}): {proc.stderr.strip()}")
    job_id = proc.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise SubmitError(f"sbatch printed {proc.stdout.strip()!r}, not a job id")
    return job_id


def submit(p: Plan, registry: Path = DEFAULT_REGISTRY) -> str:
    """Run sbatch; record the job in LOGDIR/job.json and the registry; return the job id."""
    job_id = run_sbatch(p)
    logdir = Path(p.logdir)
    record = {"job_id": job_id, "submitted": time.strftime("%Y-%m-%dT%H:%M:%S"), **asdict(p)}
    (logdir / JOB_FILE).write_text(json.dumps(record, indent=2))
    registry.parent.mkdir(parents=True, exist_ok=True)
    with open(registry, "a") as f:
        f.write(json.dumps({"job_id": job_id, "logdir": str(logdir), "config": p.config,
                            "nexp": p.nexp, "submitted": record["submitted"]}) + "\n")
    return job_id


def read_job(logdir: Path) -> dict | None:
    path = Path(logdir) / JOB_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def registry_entries(registry: Path = DEFAULT_REGISTRY) -> list[dict]:
    if not registry.is_file():
        return []
    return [json.loads(line) for line in registry.read_text().splitlines() if line.strip()]


@dataclass
class JobState:
    state: str            # PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, ... UNKNOWN
    exit_code: str = ""
    elapsed: str = ""
    reason: str = ""
    source: str = ""      # squeue | sacct | scontrol | none

    @property
    def active(self) -> bool:
        return self.state in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED",
                              "RESIZING", "SUSPENDED")


def job_state(job_id: str) -> JobState:
    """Live jobs from squeue, finished ones from sacct (accounting) or scontrol (recent)."""
    q = _slurm("squeue", "-h", "-j", job_id, "-o", "%T|%M|%r")
    if q is not None and q.returncode == 0 and q.stdout.strip():
        state, elapsed, reason = (q.stdout.strip().splitlines()[0].split("|") + ["", ""])[:3]
        return JobState(state, "", elapsed, "" if reason == "None" else reason, "squeue")
    a = _slurm("sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode,Elapsed")
    if a is not None and a.returncode == 0 and a.stdout.strip():
        state, code, elapsed = (a.stdout.strip().splitlines()[0].split("|") + ["", ""])[:3]
        return JobState(state.split()[0], code, elapsed, "", "sacct")
    c = _slurm("scontrol", "show", "job", "-o", job_id)
    if c is not None and c.returncode == 0 and "JobState=" in c.stdout:
        f = dict(x.split("=", 1) for x in c.stdout.split() if "=" in x)
        reason = f.get("Reason", "")
        return JobState(f.get("JobState", "UNKNOWN"), f.get("ExitCode", ""),
                        f.get("RunTime", ""), "" if reason == "None" else reason, "scontrol")
    why = ("Slurm does not answer" if q is None else
           "not in squeue; sacct has no record (accounting off?) and scontrol forgot it "
           "(MinJobAge)")
    return JobState("UNKNOWN", reason=why, source="none")
