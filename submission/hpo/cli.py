"""The commands ``python -m submission hpo`` (a study: check, claim, run its workers here or
as a Slurm array, write the outputs) and ``python -m submission hpo-worker`` (one worker of
an existing study), and their arguments.

Owns: the flags, every check of the command line before anything is written (exit 2), the
keys a trial must have to itself (refused in --set), the study record a command builds.
Never: runs a trial itself (worker.py), or writes before the checks have passed.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
from pathlib import Path
from typing import Any, Optional

from runtime.config import ConfigError, load_config
from submission.hpo.common import (DEFAULT_DIR, EXIT_BAD_INPUT, EXIT_OK, EXIT_STOPPED,
                                   STORAGE_ENV, HpoError)
from submission.hpo.objective import OBJECTIVES
from submission.hpo.outputs import write_outputs
from submission.hpo.slurm_array import slurm_plan, slurm_submit
from submission.hpo.space import Param, load_space, parse_enqueue
from submission.hpo.study import (PRUNERS, SAMPLERS, Study, claim_dir, enqueue_first, open_storage,
                                  open_study, read_study, redact, sha256_of)
from submission.hpo.worker import bookkeeping_lock, local_slots, spawn_workers, work

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


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The flags of `python -m submission hpo` (docs/HPO.md)."""
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
                  lock_grace_s=a.lock_grace, space_sha256=sha256_of(str(space)),
                  config_sha256=sha256_of(str(config)))
    if study.heartbeat_grace_s < 3 * study.heartbeat_s:
        raise HpoError(f"--heartbeat-grace {a.heartbeat_grace} must be at least 3 x "
                       f"--heartbeat ({a.heartbeat}): a live worker would look dead")
    enqueued = parse_enqueue(a.enqueue, params)
    if a.storage:   # reachable, and its ${VAR}s set, before the directory is claimed
        open_storage(study, a.storage)
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
    slots = local_slots(cfg, a.workers)
    if a.workers == 1:
        code = work(study, url, 0, slots[0], out)
    else:
        code = spawn_workers(study, url, slots, out)
    if code in (EXIT_BAD_INPUT, EXIT_STOPPED):
        out(f"hpo: stopped (exit {code}); rerun the same command to resume the study")
        return code
    return write_outputs(study, open_study(study, url), out)


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
