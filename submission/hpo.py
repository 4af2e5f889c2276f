"""``python -m submission hpo``: re-tune the optimizer for a batch - a hyperparameter search
with Optuna whose every trial is a real training run, launched as run_and_time.sh launches
one, on this machine or as a Slurm job array.

    python -m submission hpo --config C --space S.toml --trials N [--workers W]
        [--study NAME] [--dir DIR] [--storage URL] [--objective samples|time]
        [--pruner median|halving|none] [--sampler tpe|random] [--set k=v ...]
        [--enqueue k=v,k=v ...] [--no-baseline] [--slurm [--partition P] [--dry-run]]

Owns: the search space file (``[params."section.key"]`` tables: ``low``/``high`` with
``log``/``step``, or ``choices``; checked against the config's own types and rules, exit 2
naming the key), the study directory (``study.json`` says which study it holds; another study's
command is refused), the storage (Optuna's journal file in the study directory by default -
no server, safe on a shared file system, its lock broken after ``--lock-grace`` seconds so a
killed worker's lock never hangs the study - or any RDB URL, never printed with its
password), the worker loop (take the next trial while the budget lasts, run it, tell the
result), each trial's run and what is read from it, pruning, the heartbeat that lets a killed
worker's trial be failed and retried, and the outputs (the trial table, the best trial as a
ready config file, the plots).
Never: trains (each trial is ``run_and_time.sh``: its launcher, ranks, exit statuses, run
directory and MLPerf log), passes a value through a shell (parameters reach the run as typed
``section.key=value`` arguments), or builds the sbatch command's checks itself
(submission.slurm's are used: the same checks and quoting rules as ``submit``).

A trial's value (lower is better):
  samples (default)  samples to target: the MLPerf log's samples at the evaluation that
                     reached the target (its run_stop says success);
  time               time to target: run_stop - run_start of that log, in seconds;
  not reached        censored: the samples (or seconds) the run used × (1 + gap/target), gap =
                     target - the best accuracy it reached: never better than a run that
                     reached the target within the same budget, and better the closer it got;
  diverged (exit 3, stop reason "diverged") and pruned runs are PRUNED trials, not failures.
Each evaluation is reported as an intermediate value (target - accuracy, at step = samples);
the pruner (median: a trial worse than the median of earlier trials at the same samples,
after ``--prune-after`` complete trials; halving: successive halving/ASHA) stops a hopeless run
by SIGUSR1 to its run_and_time.sh, the runtime's own stop path: every rank agrees at its next
logging point and exits 4, nothing is left running.

A worker killed outright (SIGKILL, a lost node) stops touching its trial's heartbeat file; the
next worker that takes a trial (or a rerun of the command) finds it stale after
``--heartbeat-grace`` seconds, marks the trial FAIL and queues a retry with its parameters
(user attribute ``retry_of``); a worker stopped by a signal does that itself at once. A
trial is counted against ``--trials`` once it is COMPLETE, PRUNED or FAILED without a retry.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import hashlib
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from runtime.config import ConfigError, key_type, load_config, parse_override, read_toml_text
from submission import report as rep
from submission import slurm

ROOT = Path(__file__).resolve().parents[1]
RUN_AND_TIME = ROOT / "run_and_time.sh"
HPO_SUB = ROOT / "submission" / "hpo.sub"
DEFAULT_DIR = ROOT / "results" / "hpo"
STUDY_FILE = "study.json"
STORAGE_ENV = "PRESTO_HPO_STORAGE"   # an RDB URL reaches Slurm workers here, never on disk
OBJECTIVES = ("samples", "time")
PRUNERS = ("median", "halving", "none")
SAMPLERS = ("tpe", "random")
# What a search may change: the optimizer and its schedule, the clip threshold, dropout.
# Not the batch (the search is for a batch), the target, the data or the system.
SEARCHABLE_SECTIONS = ("optim", "schedule")
SEARCHABLE_KEYS = ("train.max_grad_norm", "train.clip_mode", "model.hidden_dropout_prob",
                   "model.attention_probs_dropout_prob")
PARAM_FIELDS = {"low", "high", "log", "step", "choices"}
# Keys a trial must have to itself, refused in --set (exit 2, before the study starts): with
# one checkpoint directory for all, every trial after the first resumed the first one's final
# checkpoint, trained 0 steps and scored its value.
_OWN_CHECKPOINTS = ("each trial writes its checkpoints into its own run directory (a shared "
                    "train.checkpoint_dir makes every later trial resume an earlier trial's "
                    "checkpoint and train nothing); a study does not continue checkpoints")
TRIAL_OWN_KEYS = {
    "train.output_dir": "each trial's run directory is the study's (trials/trial_<n>)",
    "train.checkpoint_dir": _OWN_CHECKPOINTS,
    "train.adopt_checkpoints": _OWN_CHECKPOINTS,
    "train.seed": "the seed is the config's (train.seed in the file): every trial trains the "
                  "same data order and initial weights, so values compare",
}
EXIT_OK, EXIT_NONE_COMPLETE, EXIT_BAD_INPUT, EXIT_STOPPED = 0, 1, 2, 4


class HpoError(ValueError):
    """Input a study cannot run with; the message names the file, key or value and what to
    do (exit 2, nothing started)."""


# ------------------------------------------------------------------------- the search space

@dataclass(frozen=True)
class Param:
    """One searched config key: a float or int range (``log``: sampled on a log scale;
    ``step``: a grid) or a list of choices."""

    key: str
    kind: str                      # "float" | "int" | "categorical"
    low: Optional[float] = None
    high: Optional[float] = None
    log: bool = False
    step: Optional[float] = None
    choices: tuple = ()

    def suggest(self, trial) -> Any:
        if self.kind == "categorical":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), log=self.log,
                                     step=int(self.step or 1))
        return trial.suggest_float(self.key, self.low, self.high, log=self.log, step=self.step)

    def contains(self, value: Any) -> bool:
        if self.kind == "categorical":
            return value in self.choices
        return isinstance(value, (int, float)) and not isinstance(value, bool) \
            and self.low <= value <= self.high


def _field_kind(key: str) -> str:
    hint = str(key_type(key))
    if "Literal" in hint or hint in ("<class 'str'>", "<class 'bool'>"):
        return "categorical"
    if "float" in hint:
        return "float"
    if "int" in hint:
        return "int"
    return "categorical"


def load_space(path: str | Path, config: str | Path, overrides: list[str]) -> list[Param]:
    """The search space file, checked: every key a searchable config key, every range
    non-empty, log scales positive, every bound and choice a value the config accepts."""
    path = Path(path)
    try:
        data = tomllib.loads(read_toml_text(path))
    except FileNotFoundError:
        raise HpoError(f"search space {path} does not exist (see docs/HPO.md for its format)") \
            from None
    except (OSError, ConfigError, tomllib.TOMLDecodeError) as e:
        raise HpoError(f"search space {path}: not a readable TOML file ({e})") from None
    extra = set(data) - {"params"}
    if extra:
        raise HpoError(f"search space {path}: unknown table(s) {sorted(extra)}; the file holds "
                       f"[params.\"section.key\"] tables only")
    table = data.get("params")
    if not isinstance(table, dict) or not table:
        raise HpoError(f"search space {path}: no [params.\"section.key\"] table: name at least "
                       f"one config key to search, e.g. [params.\"optim.lr\"] low = 1e-4, "
                       f"high = 1e-2, log = true")
    params = []
    for key, spec in table.items():
        where = f"search space {path}: [params.\"{key}\"]"
        section, dot, _ = key.partition(".")
        if not dot or not isinstance(spec, dict):
            raise HpoError(f"{where}: each entry is a table named by a config key "
                           f"\"section.key\" (e.g. [params.\"optim.lr\"])")
        try:
            key_type(key)
        except ConfigError:
            raise HpoError(f"{where}: unknown config key {key} (python -m runtime.config "
                           f"--help-keys lists them)") from None
        if section not in SEARCHABLE_SECTIONS and key not in SEARCHABLE_KEYS:
            raise HpoError(f"{where}: {key} is not searched here - a search may change the "
                           f"[optim] and [schedule] keys and {', '.join(SEARCHABLE_KEYS)}; set "
                           f"other keys with --set (the batch, target and data are the study's)")
        unknown = set(spec) - PARAM_FIELDS
        if unknown:
            raise HpoError(f"{where}: unknown field(s) {sorted(unknown)}; use low/high "
                           f"(with log or step) or choices")
        kind = _field_kind(key)
        if "choices" in spec:
            if set(spec) - {"choices"}:
                raise HpoError(f"{where}: give either choices or low/high, not both")
            choices = spec["choices"]
            if not isinstance(choices, list) or not choices:
                raise HpoError(f"{where}: choices is empty: list at least one value")
            param = Param(key, "categorical", choices=tuple(choices))
            values = list(choices)
        else:
            if kind == "categorical":
                raise HpoError(f"{where}: {key} takes one of a set of values: give choices = "
                               f"[...], not a range")
            if "low" not in spec or "high" not in spec:
                raise HpoError(f"{where}: a range needs both low and high")
            low, high = spec["low"], spec["high"]
            for what, v in (("low", low), ("high", high), ("step", spec.get("step", 1))):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise HpoError(f"{where}: {what} = {v!r} is not a finite number")
            if kind == "int" and not all(isinstance(v, int) for v in (low, high)):
                raise HpoError(f"{where}: {key} is an integer: low and high must be integers")
            if not low < high:
                raise HpoError(f"{where}: the range [{low}, {high}] is empty (low must be below "
                               f"high; to fix a value, use --set {key}=VALUE)")
            log = spec.get("log", False)
            if not isinstance(log, bool):
                raise HpoError(f"{where}: log = {log!r} must be true or false")
            if log and low <= 0:
                raise HpoError(f"{where}: a log scale needs low > 0 (low = {low})")
            step = spec.get("step")
            if step is not None and (step <= 0 or log):
                raise HpoError(f"{where}: step = {step!r} must be > 0, and not with log = true")
            param = Param(key, kind, float(low) if kind == "float" else low,
                          float(high) if kind == "float" else high, log, step)
            values = [low, high]
        for v in values:  # every bound and choice must be a value this config accepts
            try:
                load_config(config, [*overrides, f"{key}={toml_literal(v)}"])
            except ConfigError as e:
                raise HpoError(f"{where}: {v!r} is not a value the config accepts ({e})") \
                    from None
        params.append(param)
    return params


def toml_literal(value: Any) -> str:
    """A Python value as a TOML literal, for a ``section.key=value`` argument or a file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise HpoError(f"{value!r} has no TOML form")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    raise HpoError(f"{value!r} ({type(value).__name__}) has no TOML form")


def trial_overrides(params: dict) -> list[str]:
    """A trial's parameters as the run's typed overrides, one argument each."""
    return [f"{k}={toml_literal(v)}" for k, v in sorted(params.items())]


# -------------------------------------------------------------------------------- the study

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
# Query arguments that carry a secret (libpq's password/sslpassword, MySQL's passwd, tokens).
_SECRET_ARG = re.compile(r"pass|pwd|secret|token|credential|auth", re.IGNORECASE)


def redact(url: Optional[str]) -> str:
    """A storage URL fit to print: the password of its userinfo and every secret query
    argument (``?password=``) replaced by ***. The userinfo runs to the last '@' before the
    query, so a password may hold any character ('/', ':', '@' included); ``${VAR}``
    references are shown as written (their values are never in the URL given)."""
    if not url:
        return "journal"
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "<not a URL: not shown>"
    where, q, query = rest.partition("?")
    if "@" in where:
        userinfo, host = where.rsplit("@", 1)
        user, colon, _ = userinfo.partition(":")
        where = f"{user}:***@{host}" if colon else f"{userinfo}@{host}"
    if q:
        query = "&".join(f"{k}=***" if eq and _SECRET_ARG.search(k) else f"{k}{eq}{v}"
                         for k, eq, v in (arg.partition("=") for arg in query.split("&")))
    return f"{scheme}://{where}{q}{query}"


def storage_env_names(url: Optional[str]) -> list[str]:
    """The environment variables a storage URL refers to (``${NAME}``)."""
    return _ENV_REF.findall(url or "")


def expand_storage(url: str) -> str:
    """``${NAME}`` references replaced by the environment's values (exit 2 naming an unset
    one): a password kept in a variable never reaches a command line, ps, a job script or
    study.json."""
    missing = [n for n in storage_env_names(url) if n not in os.environ]
    if missing:
        raise HpoError(f"--storage {redact(url)}: ${{{missing[0]}}} names an environment "
                       f"variable that is not set here: export it (Slurm workers get this "
                       f"environment too) or write the value into the URL")
    return _ENV_REF.sub(lambda m: os.environ[m.group(1)], url)


def storage_secrets(url: Optional[str]) -> list[str]:
    """Every secret of a storage URL as it may appear in a message: the password (the URL's
    and the expanded one, raw and percent-decoded) and each secret query value; longest
    first, so a longer one is hidden whole."""
    from urllib.parse import unquote, unquote_plus
    found: set[str] = set()
    if not url:
        return []
    for form in (url, _ENV_REF.sub(lambda m: os.environ.get(m.group(1), ""), url)):
        if "://" not in form:
            continue
        rest = form.partition("://")[2]
        where, _, query = rest.partition("?")
        if "@" in where:
            found.add(where.rsplit("@", 1)[0].partition(":")[2])
        for arg in query.split("&") if query else ():
            k, eq, v = arg.partition("=")
            if eq and _SECRET_ARG.search(k):
                found.add(v)
    found |= {os.environ.get(n, "") for n in storage_env_names(url)}
    found |= {f(x) for x in list(found) for f in (unquote, unquote_plus)}
    return sorted((x for x in found if len(x) >= 3), key=len, reverse=True)


def scrub(text: str, url: Optional[str]) -> str:
    """``text`` (a driver's or server's message) with every secret of ``url`` as ***."""
    for secret in storage_secrets(url):
        text = text.replace(secret, "***")
    return text


@dataclass
class Study:
    """Everything a worker needs, from the command line; ``study.json`` in ``dir`` keeps the
    identity fields, which a later command must repeat."""

    name: str
    dir: str
    config: str
    space: str
    objective: str = "samples"
    overrides: list[str] = field(default_factory=list)
    trials: int = 10
    pruner: str = "median"
    prune_after: int = 3
    prune_warmup: float = 0.25
    sampler: str = "tpe"
    seed: int = 0
    storage_kind: str = "journal"        # "journal" | the redacted RDB URL
    heartbeat_s: float = 10.0
    heartbeat_grace_s: float = 120.0
    lock_grace_s: int = 30
    space_sha256: str = ""
    config_sha256: str = ""

    IDENTITY = ("name", "config", "config_sha256", "space_sha256", "objective", "overrides",
                "storage_kind")

    @property
    def path(self) -> Path:
        return Path(self.dir)

    def params(self) -> list[Param]:
        return load_space(self.space, self.config, self.overrides)


def _sha(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def claim_dir(study: Study) -> None:
    """Write ``study.json`` into a new or empty directory, or check that the directory holds
    this very study (a rerun resumes it); another study's directory is refused."""
    d = study.path
    f = d / STUDY_FILE
    if f.is_file():
        try:
            held = json.loads(f.read_text())
        except ValueError as e:
            raise HpoError(f"{f} is not readable JSON ({e}): this directory's study record is "
                           f"damaged; choose another --dir") from None
        for key in Study.IDENTITY:
            if held.get(key) != getattr(study, key):
                raise HpoError(
                    f"--dir {d} holds another study ({key}: {held.get(key)!r} there, "
                    f"{getattr(study, key)!r} here): rerun that study's own command to resume "
                    f"it, or choose another --dir (or --study name)")
    elif d.exists() and any(d.iterdir()):
        raise HpoError(f"--dir {d} exists, is not empty and holds no {STUDY_FILE}: it is not a "
                       f"study directory; choose another --dir")
    try:
        d.mkdir(parents=True, exist_ok=True)
        for sub in ("trials", "heartbeats"):
            (d / sub).mkdir(exist_ok=True)
        tmp = f.with_name(f.name + ".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(study), indent=2) + "\n")
        tmp.replace(f)
    except OSError as e:
        raise HpoError(f"--dir {d}: cannot write the study record ({e.strerror or e})") from None


def read_study(d: Path) -> Study:
    f = Path(d) / STUDY_FILE
    try:
        data = json.loads(f.read_text())
    except FileNotFoundError:
        raise HpoError(f"{f} does not exist: --dir must be a study directory that "
                       f"`python -m submission hpo` created") from None
    except ValueError as e:
        raise HpoError(f"{f} is not readable JSON ({e})") from None
    known = {x.name for x in dataclasses.fields(Study)}
    return Study(**{k: v for k, v in data.items() if k in known})


def _storage(study: Study, url: Optional[str]):
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock
    if study.storage_kind == "journal":
        path = str(study.path / "journal.log")
        return JournalStorage(JournalFileBackend(
            path, lock_obj=JournalFileOpenLock(path, grace_period=study.lock_grace_s)))
    if not url:
        raise HpoError(f"study {study.name} keeps its trials in {study.storage_kind}: give the "
                       f"URL again (--storage, or {STORAGE_ENV} for a worker)")
    full = expand_storage(url)
    try:
        # Optuna fills {SCHEMA_VERSION} into the URL with str.format: a brace of a password
        # (or of a value from the environment) is a literal brace.
        return optuna.storages.RDBStorage(full.replace("{", "{{").replace("}", "}}"))
    except Exception as e:  # a driver's or server's error: say it without the secrets
        msg = scrub(str(e).replace(full, redact(url)).replace(url, redact(url)), url)
        raise HpoError(f"--storage {redact(url)}: cannot open it ({type(e).__name__}: "
                       f"{msg.splitlines()[0] if msg else ''})") from None


def open_study(study: Study, url: Optional[str] = None, worker: int = 0):
    import optuna
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = _storage(study, url)
    # Workers of one study, and a resumed worker, must not draw the same points: the seed
    # moves with the worker's index and with the trials the study already holds.
    done = 0
    with contextlib.suppress(KeyError):
        done = len(storage.get_all_trials(storage.get_study_id_from_name(study.name),
                                          deepcopy=False))
    seed = study.seed + 100_003 * worker + done
    sampler = (optuna.samplers.RandomSampler(seed=seed) if study.sampler == "random" else
               optuna.samplers.TPESampler(seed=seed, constant_liar=True,
                                          n_startup_trials=max(study.prune_after, 3)))
    pruner = {"median": lambda: optuna.pruners.MedianPruner(
                  n_startup_trials=study.prune_after, n_warmup_steps=0),
              "halving": lambda: optuna.pruners.SuccessiveHalvingPruner(),
              "none": lambda: optuna.pruners.NopPruner()}[study.pruner]()
    return optuna.create_study(study_name=study.name, storage=storage,
                               direction="minimize", sampler=sampler, pruner=pruner,
                               load_if_exists=True)


@contextlib.contextmanager
def bookkeeping_lock(study: Study):
    """One worker at a time counts, reaps and asks (so the budget is never overshot); a lock
    left by a killed worker is broken after ``lock_grace_s``."""
    from optuna.storages.journal import JournalFileOpenLock
    lock = JournalFileOpenLock(str(study.path / "bookkeeping"), grace_period=study.lock_grace_s)
    lock.acquire()
    try:
        yield
    finally:
        with contextlib.suppress(RuntimeError):
            lock.release()


def _heartbeat(study: Study, number: int) -> Path:
    return study.path / "heartbeats" / f"trial_{number}"


def retried_numbers(trials) -> set[int]:
    return {t.user_attrs["retry_of"] for t in trials if "retry_of" in t.user_attrs}


def counted(trials) -> int:
    """Trials that used up the budget: COMPLETE, PRUNED, or FAIL with no retry queued."""
    from optuna.trial import TrialState
    retried = retried_numbers(trials)
    return sum(1 for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
               or (t.state == TrialState.FAIL and t.number not in retried))


def fail_and_retry(ostudy, frozen, why: str) -> None:
    """Mark a RUNNING trial FAIL and queue a trial with its parameters (once)."""
    import optuna
    from optuna.trial import TrialState
    storage = ostudy._storage
    try:
        storage.set_trial_user_attr(frozen._trial_id, "fail_reason", why)
        storage.set_trial_state_values(frozen._trial_id, TrialState.FAIL)
    except Exception:  # finished meanwhile (its worker was alive after all): nothing to do
        return
    if frozen.number in retried_numbers(ostudy.get_trials(deepcopy=False)):
        return
    ostudy.add_trial(optuna.trial.create_trial(
        state=TrialState.WAITING, params=frozen.params, distributions=frozen.distributions,
        user_attrs={"origin": frozen.user_attrs.get("origin", "sampled"),
                    "retry_of": frozen.number}))


def reap_stale(study: Study, ostudy, now: Optional[float] = None) -> list[int]:
    """FAIL and retry every RUNNING trial whose heartbeat is older than the grace period (its
    worker was killed); returns their numbers. Call under ``bookkeeping_lock``."""
    from optuna.trial import TrialState
    now = time.time() if now is None else now
    reaped = []
    for t in ostudy.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        hb = _heartbeat(study, t.number)
        try:
            last = hb.stat().st_mtime
        except FileNotFoundError:
            last = t.datetime_start.timestamp() if t.datetime_start else now
        if now - last > study.heartbeat_grace_s:
            fail_and_retry(ostudy, t, f"worker gone: no heartbeat for {now - last:.0f} s "
                                      f"(grace {study.heartbeat_grace_s:.0f} s)")
            reaped.append(t.number)
    return reaped


def enqueue_first(study: Study, ostudy, params: list[Param], cfg, baseline: bool,
                  enqueued: list[dict]) -> None:
    """On a new study: the config's own values first (the default to beat), then --enqueue."""
    if ostudy.get_trials(deepcopy=False):
        return
    if baseline:
        own = {p.key: getattr(getattr(cfg, p.key.split(".")[0]), p.key.split(".")[1])
               for p in params}
        own = {k: v for k, v in own.items() if next(p for p in params if p.key == k).contains(v)}
        ostudy.enqueue_trial(own, user_attrs={"origin": "baseline"})
    for values in enqueued:
        ostudy.enqueue_trial(values, user_attrs={"origin": "enqueued"})


# ------------------------------------------------------------------------------ one trial

@dataclass
class Outcome:
    state: str                   # "complete" | "pruned" | "fail" | "retry" | "bad_input"
    value: Optional[float] = None
    attrs: dict = field(default_factory=dict)
    message: str = ""


def _set_pdeathsig() -> None:
    """In the trial's run_and_time.sh, before exec: SIGTERM when the worker dies (Linux), so a
    killed worker's run is asked to stop like any other."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


class _Stop:
    """The worker's stop request (SIGTERM/INT/HUP/USR1), passed on to the running trial."""

    def __init__(self):
        self.signum: Optional[int] = None
        self.proc: Optional[subprocess.Popen] = None

    def __call__(self, signum, _frame):
        self.signum = signum
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGUSR1)


def _read_evals(path: Path, offset: int) -> tuple[list[dict], int]:
    """Whole new ``eval`` lines of a metrics.jsonl from ``offset``; the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        return [], offset
    end = chunk.rfind(b"\n") + 1
    evals = []
    for line in chunk[:end].splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if rec.get("kind") == "eval" and rec.get("eval_accuracy") is not None:
                evals.append(rec)
    return evals, offset + end


def _kill_leftovers(pgid: int) -> bool:
    """End what is left of the trial's process group 10 s after run_and_time.sh exited
    (nothing, normally: it waits for its launcher); whether SIGKILL was needed."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    return True


def prune_warmup_samples(cfg, fraction: float) -> int:
    """Samples a trial trains before a pruner may stop it: ``fraction`` of its budget (the
    sample cap, or max_steps × the global batch, whichever ends the run first). The first
    evaluations of a large-batch run sit on the same plateau for every setting, and a median of
    those is noise: pruning there stopped 5 of 12 trials at 2 of their 57-77 steps
    (docs/BENCHMARKS.md, HPO at batch 1024)."""
    return int(fraction * cfg.train.sample_budget())


def run_trial(study: Study, trial, target: float, stop: _Stop,
              env_extra: Optional[dict] = None, on_stop=lambda: None,
              warmup_samples: int = 0, keep_out: tuple = (STORAGE_ENV,)) -> Outcome:
    """Run the trial's training with run_and_time.sh, report its evaluations, prune it when
    the pruner says so; the outcome from its exit status, summary and MLPerf log. When the
    worker is asked to stop, ``on_stop`` runs at once (Slurm kills a cancelled task a few
    seconds after its SIGTERM: the trial's fate must be written before the run has ended).
    ``keep_out``: environment variables the run must not get (the storage URL and the
    variables it names: the run needs no storage, and its output is no place for secrets)."""
    run_dir = study.path / "trials" / f"trial_{trial.number}"
    if run_dir.exists():  # an earlier attempt of this number cannot be (results never overwritten)
        run_dir = run_dir.with_name(f"{run_dir.name}_{int(time.time())}")
    overrides = [*study.overrides, *trial_overrides(trial.params)]
    # The run needs no storage: neither the URL nor the variables it names reach it.
    env = {k: v for k, v in os.environ.items() if k not in keep_out}
    env.update(CONFIG=study.config, RUN_DIR=str(run_dir), RESUME="0", **(env_extra or {}))
    trial.set_user_attr("run_dir", str(run_dir))
    log = open(study.path / "trials" / f"{run_dir.name}.out", "ab")
    proc = subprocess.Popen(["bash", str(RUN_AND_TIME), "--", *overrides], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_set_pdeathsig)
    stop.proc = proc
    if stop.signum is not None:   # a signal between ask and launch
        stop(stop.signum, None)
    beat_stop = threading.Event()
    hb = _heartbeat(study, trial.number)

    def beat():
        while not beat_stop.wait(study.heartbeat_s):
            with contextlib.suppress(OSError):
                os.utime(hb)
    beater = threading.Thread(target=beat, daemon=True)
    beater.start()
    offset, best_acc, pruned_at, stop_told = 0, 0.0, None, False
    metrics = run_dir / "metrics.jsonl"
    try:
        while True:
            if stop.signum is not None and not stop_told:
                stop_told = True
                on_stop()
            done = proc.poll() is not None
            evals, offset = _read_evals(metrics, offset)
            for e in evals:
                best_acc = max(best_acc, float(e["eval_accuracy"]))
                trial.report(target - float(e["eval_accuracy"]), step=int(e["samples"]))
                if (pruned_at is None and not done and int(e["samples"]) >= warmup_samples
                        and trial.should_prune()):
                    pruned_at = int(e["samples"])
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGUSR1)   # the runtime's own stop path
            if done:
                break
            time.sleep(0.5)
        rc = proc.returncode
    finally:
        beat_stop.set()
        beater.join()
        stop.proc = None
        leftovers = _kill_leftovers(proc.pid)
        log.close()
    attrs = {"exit_code": rc, "best_accuracy": best_acc}
    if leftovers:
        attrs["leftover_processes_killed"] = True
    summary = {}
    with contextlib.suppress(OSError, ValueError):
        summary = json.loads((run_dir / "summary.json").read_text())
    tail = ""
    with contextlib.suppress(OSError):
        tail = " | ".join((study.path / "trials" / f"{run_dir.name}.out").read_text(
            errors="replace").strip().splitlines()[-3:])
    if pruned_at is not None and rc == 4:
        return Outcome("pruned", attrs={**attrs, "pruned_at_samples": pruned_at})
    if rc == 4 or stop.signum is not None:
        return Outcome("retry", attrs=attrs, message=f"stopped by a signal (exit {rc})")
    if rc == 2:
        return Outcome("bad_input", attrs=attrs, message=tail)
    if rc == 3 and summary.get("stop_reason") == "diverged":
        return Outcome("pruned", attrs={**attrs, "diverged": True})
    if rc not in (0, 1):
        return Outcome("fail", attrs=attrs, message=f"exit {rc}: {tail}")
    resumed = summary.get("resumed_from")
    if resumed is not None or summary.get("steps") == 0:
        # Not this trial's parameters' result: the checkpoint's run trained (most of) it.
        since = int(summary.get("steps") or 0) - int((resumed or {}).get("step") or 0)
        return Outcome("fail", attrs={**attrs, "steps_trained": since},
                       message=f"exit {rc}, but the run resumed a checkpoint "
                               f"({(resumed or {}).get('checkpoint', 'none')}) and trained "
                               f"{since} step(s) itself: not a result of these parameters")
    res = rep.analyse_log(run_dir.name, run_dir / "mlperf_bert.log")
    if rc == 0 and res.status == "success" and res.samples_to_converge:
        value = float(res.samples_to_converge if study.objective == "samples"
                      else res.time_to_train_s)
        return Outcome("complete", value, {**attrs, "samples_to_target": res.samples_to_converge,
                                           "time_to_target_s": res.time_to_train_s})
    used = float(summary.get("samples") or res.eval_samples or 0) \
        if study.objective == "samples" else float(res.time_to_train_s or 0)
    gap = min(max(target - best_acc, 0.0), target) / target if target > 0 else 1.0
    if used <= 0:
        return Outcome("fail", attrs=attrs, message=f"exit {rc} with no samples trained: {tail}")
    return Outcome("complete", used * (1 + gap), {**attrs, "censored": True,
                                                  "samples_trained": summary.get("samples")})


# ------------------------------------------------------------------------------- a worker

def work(study: Study, url: Optional[str] = None, worker: int = 0,
         env_extra: Optional[dict] = None, out=print, wait_for_running: bool = True) -> int:
    """Take trials until the budget is spent: 0 when it is (or nothing is left to take),
    2 when a trial's run refused its input, 4 when stopped by a signal. When only RUNNING
    trials stand between the study and its budget, ``wait_for_running`` waits for them to end
    (or to be found stale: a killed worker's); otherwise the worker leaves them to theirs."""
    from optuna.trial import TrialState
    cfg = load_config(study.config, study.overrides)
    target = cfg.train.target_mlm_accuracy
    warmup = prune_warmup_samples(cfg, study.prune_warmup)
    ostudy = open_study(study, url, worker)
    params = study.params()
    stop = _Stop()
    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT,
                                                    signal.SIGHUP, signal.SIGUSR1)}
    try:
        while stop.signum is None:
            with bookkeeping_lock(study):
                for n in reap_stale(study, ostudy):
                    out(f"hpo: trial {n}: its worker is gone (no heartbeat): failed, retried")
                trials = ostudy.get_trials(deepcopy=False)
                running = sum(t.state == TrialState.RUNNING for t in trials)
                full = counted(trials) + running >= study.trials
                if full and (not running or not wait_for_running):
                    break
                trial = None if full else ostudy.ask()
                if trial is not None:
                    _heartbeat(study, trial.number).write_text(
                        f"{socket.gethostname()} pid {os.getpid()} worker {worker}\n")
            if trial is None:
                time.sleep(min(study.heartbeat_s, 5.0))
                continue
            for p in params:
                p.suggest(trial)
            origin = trial.user_attrs.get("origin", "sampled")
            retry = trial.user_attrs.get("retry_of")
            out(f"hpo: trial {trial.number} ({origin}"
                f"{f', retry of {retry}' if retry is not None else ''}): "
                + " ".join(trial_overrides(trial.params)))
            def give_back(trial=trial):
                with bookkeeping_lock(study):
                    fail_and_retry(ostudy, ostudy._storage.get_trial(trial._trial_id),
                                   f"worker stopped by a signal ({stop.signum})")
            o = run_trial(study, trial, target, stop, env_extra, on_stop=give_back,
                          warmup_samples=warmup,
                          keep_out=(STORAGE_ENV, *storage_env_names(url)))
            frozen = ostudy._storage.get_trial(trial._trial_id)
            if frozen.state != TrialState.RUNNING:   # failed already: a stop, or reaped
                o = Outcome("retry", message=frozen.user_attrs.get("fail_reason", ""))
            elif o.state == "retry":
                with bookkeeping_lock(study):
                    fail_and_retry(ostudy, frozen, o.message)
            else:
                for k, v in o.attrs.items():
                    trial.set_user_attr(k, v)
                if o.state == "complete":
                    ostudy.tell(trial, o.value)
                elif o.state == "pruned":
                    ostudy.tell(trial, state=TrialState.PRUNED)
                else:
                    trial.set_user_attr("fail_reason", o.message[-500:])
                    ostudy.tell(trial, state=TrialState.FAIL)
            with contextlib.suppress(FileNotFoundError):
                _heartbeat(study, trial.number).unlink()
            out(f"hpo: trial {trial.number}: {o.state}"
                + (f", value {o.value:,.1f}" if o.value is not None else "")
                + (" (censored: target not reached)" if o.attrs.get("censored") else "")
                + (f" at {o.attrs['pruned_at_samples']} samples" if "pruned_at_samples" in
                   o.attrs else "") + (f": {o.message}" if o.message else ""))
            if o.state == "bad_input":
                out(f"hpo: trial {trial.number}'s run refused its input; the study stops "
                    f"(see {trial.user_attrs.get('run_dir')}.out)")
                return EXIT_BAD_INPUT
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return EXIT_STOPPED if stop.signum is not None else EXIT_OK


# ------------------------------------------------------------------------------- outputs

def trial_rows(ostudy) -> list[dict]:
    retried = retried_numbers(ostudy.get_trials(deepcopy=False))
    rows = []
    for t in ostudy.get_trials(deepcopy=False):
        rows.append({"number": t.number, "state": t.state.name,
                     "retried": t.number in retried,
                     "value": t.value if t.state.name == "COMPLETE" else None,
                     "censored": bool(t.user_attrs.get("censored")),
                     "samples_to_target": t.user_attrs.get("samples_to_target"),
                     "time_to_target_s": t.user_attrs.get("time_to_target_s"),
                     "pruned_at_samples": t.user_attrs.get("pruned_at_samples"),
                     "diverged": bool(t.user_attrs.get("diverged")),
                     "origin": t.user_attrs.get("origin", "sampled"),
                     "retry_of": t.user_attrs.get("retry_of"),
                     "fail_reason": t.user_attrs.get("fail_reason"),
                     "params": t.params, "run_dir": t.user_attrs.get("run_dir")})
    return rows


def format_table(rows: list[dict], keys: list[str]) -> str:
    head = ["trial", "state", "value", *keys, "note"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        note = ("censored (target not reached)" if r["censored"] else
                f"pruned at {r['pruned_at_samples']} samples" if r["pruned_at_samples"] else
                "diverged" if r["diverged"] else
                "retried" if r["retried"] else (r["fail_reason"] or "")[:60])
        if r["origin"] != "sampled":
            note = f"{r['origin']}; {note}" if note else r["origin"]
        if r["retry_of"] is not None:
            note = f"retry of {r['retry_of']}; {note}"
        vals = [f"{r['params'][k]:.4g}" if isinstance(r["params"].get(k), float)
                else str(r["params"].get(k, "-")) for k in keys]
        lines.append("| " + " | ".join([str(r["number"]), r["state"].lower(),
                                         "-" if r["value"] is None else f"{r['value']:,.1f}",
                                         *vals, note]) + " |")
    return "\n".join(lines)


def best_config_text(study: Study, best: dict, rows: list[dict]) -> str:
    """The config file of the best trial: the study's config with its --set overrides and the
    trial's parameters applied, and a header saying where it came from."""
    data = tomllib.loads(read_toml_text(study.config))
    for text in [*study.overrides, *trial_overrides(best["params"])]:
        section, key, value = parse_override(text)
        data.setdefault(section, {})[key] = value
    what = (f"{best['value']:,.0f} samples to target" if study.objective == "samples" else
            f"{best['value']:,.1f} s to target")
    header = [
        f"# Searched by `python -m submission hpo` (study {study.name!r}, {study.dir}):",
        f"# trial {best['number']} of {len(rows)}, {what}"
        + (" (censored: no trial reached the target)" if best["censored"] else "") + ".",
        f"# From {study.config} with the search space {study.space}; "
        f"{time.strftime('%Y-%m-%d')}.",
        f"# Searched keys: {', '.join(sorted(best['params']))}.", ""]
    body = []
    for section, table in data.items():
        body.append(f"[{section}]")
        body += [f"{k} = {toml_literal(v)}" for k, v in table.items()]
        body.append("")
    return "\n".join(header + body)


def plot(rows: list[dict], keys: list[str], out_dir: Path, log_keys: set[str],
         ylabel: str) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    done = [r for r in rows if r["value"] is not None]
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for cens, marker, label in ((False, "o", "reached the target"),
                                (True, "x", "censored (not reached)")):
        pts = [(r["number"], r["value"]) for r in done if r["censored"] == cens]
        if pts:
            ax.plot(*zip(*pts), marker, ls="", label=label)
    best, line = math.inf, []
    for r in sorted(done, key=lambda r: r["number"]):
        best = min(best, r["value"])
        line.append((r["number"], best))
    if line:
        ax.step(*zip(*line), where="post", color="k", lw=1, label="best so far")
    for r in rows:
        if r["state"] == "PRUNED":
            ax.axvline(r["number"], color="tab:gray", lw=0.5, ls=":")
    ax.set_xlabel("trial (dotted: pruned)")
    ax.set_ylabel(ylabel)
    ax.set_title("optimisation history", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "history.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    if keys:
        fig, axes = plt.subplots(1, len(keys), figsize=(3.2 * len(keys), 3.2), squeeze=False)
        for ax, k in zip(axes[0], keys):
            pts = [(r["params"][k], r["value"]) for r in done if k in r["params"]]
            if pts:
                xs, ys = zip(*pts)
                if all(isinstance(x, (int, float)) for x in xs):
                    ax.plot(xs, ys, "o", ms=4)
                else:
                    cats = sorted({str(x) for x in xs})
                    ax.plot([cats.index(str(x)) for x in xs], ys, "o", ms=4)
                    ax.set_xticks(range(len(cats)), cats)
            if k in log_keys:
                ax.set_xscale("log")
            ax.set_xlabel(k, fontsize=8)
        axes[0][0].set_ylabel(ylabel)
        fig.suptitle("value against each parameter", fontsize=9)
        fig.tight_layout()
        paths.append(out_dir / "slices.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def write_outputs(study: Study, ostudy, out=print) -> int:
    """The table (printed, trials.json), the best config (checked) and the plots; 0 when a
    trial completed, else 1."""
    params = study.params()
    keys = [p.key for p in params]
    rows = trial_rows(ostudy)
    (study.path / "trials.json").write_text(json.dumps(rows, indent=1, default=str) + "\n")
    table = format_table(rows, keys)
    (study.path / "trials.md").write_text(table + "\n")
    out(table)
    complete = [r for r in rows if r["state"] == "COMPLETE" and r["value"] is not None]
    pngs = plot(rows, keys, study.path, {p.key for p in params if p.log},
                "samples to target" if study.objective == "samples" else "seconds to target")
    out("plots: " + ", ".join(str(p) for p in pngs))
    if not complete:
        out(f"hpo: no trial completed in study {study.name}: no config written")
        return EXIT_NONE_COMPLETE
    best = min(complete, key=lambda r: (r["value"], r["number"]))
    path = study.path / f"{Path(study.config).stem}_hpo.toml"
    text = best_config_text(study, best, rows)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    load_config(tmp)   # the config check: it must load as it will be used
    tmp.replace(path)
    beat = [r for r in complete if r["origin"] != "baseline"]
    base = next((r for r in complete if r["origin"] == "baseline"), None)
    if base is not None:
        first = next((r for r in sorted(beat, key=lambda r: r["number"])
                      if r["value"] < base["value"]), None)
        out(f"hpo: the config's own values (trial {base['number']}): {base['value']:,.1f}; "
            + (f"first beaten by trial {first['number']} ({first['value']:,.1f})" if first
               else "not beaten"))
    out(f"hpo: best trial {best['number']}: {best['value']:,.1f}"
        + (" (censored)" if best["censored"] else "") + f"; its config: {path}")
    return EXIT_OK


# ---------------------------------------------------------------------------------- Slurm

def slurm_plan(study: Study, workers: int, *, partition: Optional[str], account: Optional[str],
               time_minutes: Optional[int], url: Optional[str],
               ask_slurm: bool = True) -> slurm.Plan:
    """The job array: WORKERS tasks of hpo.sub, each a worker of this study; checked with
    submission.slurm's checks (overrides, config, layout, data, walltime, partition)."""
    if partition is not None:
        slurm.check_token("--partition", partition)
    if account is not None:
        slurm.check_token("--account", account)
    slurm.check_token("--study", study.name)
    overrides = slurm.check_overrides(study.overrides)
    cfg = slurm.load_checked(study.config, overrides)
    slurm.check_layout(cfg)
    slurm.check_data(cfg)
    per_worker = math.ceil(study.trials / workers)
    minutes = slurm.check_walltime(cfg, per_worker, time_minutes, slurm.MARGIN_MINUTES)
    if re.search(r"[%\n\r]", study.dir):
        raise HpoError(f"--dir {study.dir!r}: '%' (a Slurm file pattern) and line breaks are "
                       "not allowed")
    notes: list[str] = []
    if ask_slurm:
        slurm.check_partition(cfg, partition, minutes, notes)
    argv = slurm.job_argv(cfg, minutes, partition, account, script=HPO_SUB, flags=[
        f"--job-name=presto_hpo_{study.name}", f"--array=0-{workers - 1}",
        "--open-mode=append", f"--output={study.dir}/slurm-%A_%a.out"])
    env = {"HPO_DIR": study.dir, "PRESTO_ROOT": str(ROOT)}
    if url:
        env[STORAGE_ENV] = url
    return slurm.Plan(study.config, overrides, workers, study.dir, minutes, argv, env, notes)


def slurm_submit(p: slurm.Plan) -> str:
    """sbatch the array (submit's runner); the job in the study's jobs.jsonl."""
    job = slurm.run_sbatch(p)
    with open(Path(p.logdir) / "jobs.jsonl", "a") as f:
        f.write(json.dumps({"job_id": job, "workers": p.nexp,
                            "submitted": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
    return job


# ------------------------------------------------------------------------ the command line

def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", required=True, help="config TOML the trials train")
    ap.add_argument("--space", required=True, help="search space TOML (docs/HPO.md)")
    ap.add_argument("--trials", type=int, required=True, help="the study's trial budget")
    ap.add_argument("--workers", type=int, default=1,
                    help="trials at a time (locally: needs the cores; --slurm: array tasks)")
    ap.add_argument("--study", help="study name (default <config name>_hpo)")
    ap.add_argument("--dir", type=Path, help="study directory (default results/hpo/<study>)")
    ap.add_argument("--storage", help="RDB URL (e.g. postgresql://...; default: a journal "
                    "file in the study directory)")
    ap.add_argument("--objective", choices=OBJECTIVES, default="samples")
    ap.add_argument("--pruner", choices=PRUNERS, default="median")
    ap.add_argument("--prune-after", type=int, default=3, metavar="N",
                    help="median pruner: prune only once N trials completed (default 3)")
    ap.add_argument("--prune-warmup", type=float, default=0.25, metavar="FRACTION",
                    help="no trial is pruned before it trained this fraction of its sample "
                         "budget (default 0.25)")
    ap.add_argument("--sampler", choices=SAMPLERS, default="tpe")
    ap.add_argument("--seed", type=int, default=0, help="sampler seed")
    ap.add_argument("--set", action="append", default=[], dest="overrides",
                    metavar="SECTION.KEY=VALUE", help="config override for every trial")
    ap.add_argument("--enqueue", action="append", default=[], metavar="K=V[,K=V...]",
                    help="a setting to try first (repeatable)")
    ap.add_argument("--no-baseline", action="store_true",
                    help="do not run the config's own values as the first trial")
    ap.add_argument("--heartbeat", type=float, default=10.0, metavar="S",
                    help="seconds between a worker's heartbeats (default 10)")
    ap.add_argument("--heartbeat-grace", type=float, default=120.0, metavar="S",
                    help="a RUNNING trial without a heartbeat this long is failed and retried")
    ap.add_argument("--lock-grace", type=int, default=30, metavar="S",
                    help="a storage lock older than this is broken (a killed worker's)")
    ap.add_argument("--slurm", action="store_true", help="submit --workers array tasks")
    ap.add_argument("--partition")
    ap.add_argument("--account")
    ap.add_argument("--time", type=int, dest="time_minutes", metavar="MINUTES",
                    help="walltime per array task (default ceil(trials/workers) x "
                    "system.walltime_minutes + margin)")
    ap.add_argument("--dry-run", action="store_true", help="--slurm: print, submit nothing")


def _enqueued(texts: list[str], params: list[Param]) -> list[dict]:
    out = []
    by_key = {p.key: p for p in params}
    for text in texts:
        if "\n" in text or "\r" in text:
            raise HpoError(f"--enqueue {text!r} holds a line break: one setting per --enqueue, "
                           f"its keys separated by commas")
        values = {}
        for item in text.split(","):
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or key not in by_key:
                raise HpoError(f"--enqueue {text!r}: {key!r} is not a searched key "
                               f"({', '.join(by_key)})")
            try:
                value = tomllib.loads(f"v = {raw}")["v"]
            except tomllib.TOMLDecodeError:
                value = raw
            if by_key[key].kind == "float" and isinstance(value, int):
                value = float(value)
            if not by_key[key].contains(value):
                raise HpoError(f"--enqueue {text!r}: {key}={value!r} is outside the search "
                               f"space")
            values[key] = value
        out.append(values)
    return out


def _local_slots(cfg, workers: int) -> list[dict]:
    """Each local worker's environment: its GPUs on a CUDA config; a check of the cores."""
    s = cfg.system
    ranks = s.nodes * s.ranks_per_node
    if s.nodes > 1:
        raise HpoError(f"system.nodes = {s.nodes}: a multi-node trial runs under Slurm (--slurm)")
    if s.device == "cuda":
        import torch
        gpus = torch.cuda.device_count()
        if workers * ranks > gpus:
            raise HpoError(f"--workers {workers} x {ranks} ranks need {workers * ranks} GPUs; "
                           f"this machine has {gpus}")
        return [{"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in
                                                  range(w * ranks, (w + 1) * ranks))}
                for w in range(workers)]
    cores = os.cpu_count() or 1
    need = workers * ranks * max(1, s.threads_per_rank)
    if workers > 1 and need > cores:
        raise HpoError(f"--workers {workers}: {workers} trials x {ranks} ranks x "
                       f"{max(1, s.threads_per_rank)} thread(s) need {need} cores; this "
                       f"machine has {cores} (lower --workers)")
    return [{} for _ in range(workers)]


def prepare(a) -> tuple[Study, Optional[str], list[Param], Any]:
    """Check everything the command names; claim the study directory."""
    if a.trials < 1:
        raise HpoError(f"--trials {a.trials}: need at least 1")
    if not 0.0 <= a.prune_warmup < 1.0:
        raise HpoError(f"--prune-warmup {a.prune_warmup}: a fraction of a trial's sample "
                       "budget, 0 (prune from the first evaluation) to below 1")
    if a.workers < 1:
        raise HpoError(f"--workers {a.workers}: need at least 1")
    config = Path(a.config).resolve()
    if not config.is_file():
        raise HpoError(f"config {config} does not exist (configs live in submission/configs/)")
    try:
        cfg = load_config(config, a.overrides)
    except ConfigError as e:
        raise HpoError(f"config {config}: {e}") from None
    for text in a.overrides:
        key = text.partition("=")[0].strip()
        if key in TRIAL_OWN_KEYS:
            raise HpoError(f"--set {text}: {TRIAL_OWN_KEYS[key]}")
    if cfg.train.checkpoint_dir:
        raise HpoError(f"config {config}: train.checkpoint_dir = "
                       f"{cfg.train.checkpoint_dir!r}: {TRIAL_OWN_KEYS['train.checkpoint_dir']} "
                       f"- use a config without it (the study's copy of it, or --config of "
                       f"another file)")
    space = Path(a.space).resolve()
    params = load_space(space, config, a.overrides)
    name = a.study or f"{config.stem}_hpo"
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", name):
        raise HpoError(f"--study {name!r}: use letters, digits and '_', '.', '+', '-' only")
    d = (a.dir or DEFAULT_DIR / name).resolve()
    study = Study(name=name, dir=str(d), config=str(config), space=str(space),
                  objective=a.objective, overrides=list(a.overrides), trials=a.trials,
                  pruner=a.pruner, prune_after=a.prune_after, prune_warmup=a.prune_warmup,
                  sampler=a.sampler, seed=a.seed,
                  storage_kind=redact(a.storage) if a.storage else "journal",
                  heartbeat_s=a.heartbeat, heartbeat_grace_s=a.heartbeat_grace,
                  lock_grace_s=a.lock_grace, space_sha256=_sha(str(space)),
                  config_sha256=_sha(str(config)))
    if study.heartbeat_grace_s < 3 * study.heartbeat_s:
        raise HpoError(f"--heartbeat-grace {a.heartbeat_grace} must be at least 3 x "
                       f"--heartbeat ({a.heartbeat}): a live worker would look dead")
    enqueued = _enqueued(a.enqueue, params)
    if a.storage:   # reachable, and its ${VAR}s set, before the directory is claimed
        _storage(study, a.storage)
    claim_dir(study)
    return study, a.storage, params, (cfg, enqueued)


def run_command(a, out=print) -> int:
    study, url, params, (cfg, enqueued) = prepare(a)
    ostudy = open_study(study, url)
    with bookkeeping_lock(study):
        enqueue_first(study, ostudy, params, cfg, not a.no_baseline, enqueued)
    out(f"hpo: study {study.name} in {study.dir} (storage {redact(url)}), {study.trials} "
        f"trial(s), objective {study.objective}, pruner {study.pruner}")
    if a.slurm:
        p = slurm_plan(study, a.workers, partition=a.partition, account=a.account,
                       time_minutes=a.time_minutes, url=url, ask_slurm=not a.dry_run)
        if a.dry_run:
            env = " ".join(f"{k}={shlex.quote(redact(v) if k == STORAGE_ENV else v)}"
                           for k, v in p.env.items())
            out(f"{env} {shlex.join(p.argv)}")
            return EXIT_OK
        job = slurm_submit(p)
        out(f"submitted job array {job}: {a.workers} worker(s), walltime {p.walltime_minutes} "
            f"min each; worker logs {study.dir}/slurm-{job}_<i>.out. Rerun this command when "
            f"the array has ended for the table, the best config and the plots")
        for n in p.notes:
            out(f"note: {n}")
        out(job)
        return EXIT_OK
    slots = _local_slots(cfg, a.workers)
    if a.workers == 1:
        code = work(study, url, 0, slots[0], out)
    else:
        code = _spawn_workers(study, url, slots, out)
    if code in (EXIT_BAD_INPUT, EXIT_STOPPED):
        out(f"hpo: stopped (exit {code}); rerun the same command to resume the study")
        return code
    return write_outputs(study, open_study(study, url), out)


def _spawn_workers(study: Study, url: Optional[str], slots: list[dict], out) -> int:
    procs = []
    env_url = {STORAGE_ENV: url} if url else {}
    for i, extra in enumerate(slots):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "submission", "hpo-worker", "--dir", study.dir,
             "--worker", str(i)], cwd=ROOT, env=dict(os.environ, **extra, **env_url)))
    got = []

    def forward(signum, _frame):
        got.append(signum)
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signum)
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT,
                                                       signal.SIGHUP, signal.SIGUSR1)}
    try:
        codes = [p.wait() for p in procs]
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if got or EXIT_STOPPED in codes:
        return EXIT_STOPPED
    return EXIT_BAD_INPUT if EXIT_BAD_INPUT in codes else EXIT_OK


def worker_command(a, out=print) -> int:
    """``python -m submission hpo-worker --dir DIR``: one worker of an existing study (a Slurm
    array task, or one of --workers local processes)."""
    study = read_study(a.dir)
    url = os.environ.get(STORAGE_ENV)
    tag = os.environ.get("SLURM_ARRAY_TASK_ID")
    worker = a.worker if a.worker is not None else int(tag or 0)
    code = work(study, url, worker, None, out, wait_for_running=tag is None)
    if code == EXIT_OK and tag is not None:
        # The last array task to finish writes the outputs (a rerun of the command does too).
        from optuna.trial import TrialState
        ostudy = open_study(study, url, worker)
        with bookkeeping_lock(study):
            trials = ostudy.get_trials(deepcopy=False)
            busy = any(t.state == TrialState.RUNNING for t in trials)
        if not busy:
            write_outputs(study, ostudy, out)
    return code
