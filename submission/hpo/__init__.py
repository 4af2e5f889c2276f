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

The package, one module per part (each says what it owns and never does):
  common.py       the paths, the study directory's layout, exit statuses, HpoError
  space.py        the search space file, its checks, values as typed overrides
  study.py        the study's identity (study.json), its storage and the URL's secrets, the
                  sampler and pruner rows, the first trials of a new study
  objective.py    one trial: its run, its value, pruning
  worker.py       workers and retries: the budget, heartbeats, stale trials, local workers
  outputs.py      the trial table, the best config, the plots
  slurm_array.py  the study's Slurm job array (hpo.sub)
  cli.py          the two commands (hpo, hpo-worker): their arguments and checks
  optuna_api.py   the only user of Optuna's private names

Two names of this package are its seams, read from here when they are used: ``run_trial``
(how a worker runs one trial) and ``RUN_AND_TIME`` (the script a trial runs). A stand-in set
on ``submission.hpo`` (the tests' runs that answer at once, a stand-in script) is the one
every worker of this process uses.
"""
from __future__ import annotations

from submission.hpo.common import (DEFAULT_DIR, EXIT_BAD_INPUT, EXIT_NONE_COMPLETE, EXIT_OK,
                                   EXIT_STOPPED, HPO_SUB, ROOT, RUN_AND_TIME, STORAGE_ENV,
                                   STUDY_FILE, HpoError, heartbeat_file)
from submission.hpo.space import Param, load_space, toml_literal, trial_overrides
from submission.hpo.study import (Study, claim_dir, enqueue_first, expand_storage, open_storage,
                                  open_study, read_study, redact, scrub, storage_env_names,
                                  storage_secrets)
from submission.hpo.objective import Outcome, Stop, prune_warmup_samples, run_trial
from submission.hpo.worker import (bookkeeping_lock, counted, fail_and_retry, local_slots,
                                   reap_stale, retried_numbers, work)
from submission.hpo.outputs import (best_config_text, format_table, plot, trial_rows,
                                    write_outputs)
from submission.hpo.slurm_array import slurm_plan, slurm_submit
from submission.hpo.cli import add_arguments, prepare, run_command, worker_command

__all__ = ["DEFAULT_DIR", "EXIT_BAD_INPUT", "EXIT_NONE_COMPLETE", "EXIT_OK", "EXIT_STOPPED",
           "HPO_SUB", "ROOT", "RUN_AND_TIME", "STORAGE_ENV", "STUDY_FILE", "HpoError",
           "heartbeat_file", "Param", "load_space", "toml_literal", "trial_overrides", "Study",
           "claim_dir", "enqueue_first", "expand_storage", "open_storage", "open_study",
           "read_study", "redact", "scrub", "storage_env_names", "storage_secrets", "Outcome",
           "Stop", "prune_warmup_samples", "run_trial", "bookkeeping_lock", "counted",
           "fail_and_retry", "local_slots", "reap_stale", "retried_numbers", "work",
           "best_config_text", "format_table", "plot", "trial_rows", "write_outputs",
           "slurm_plan", "slurm_submit", "add_arguments", "prepare", "run_command",
           "worker_command"]
