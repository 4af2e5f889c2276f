"""Workers and retries: a worker takes the study's next trial while the budget lasts, runs
it, tells the result; a trial whose worker was killed is failed and retried with the same
parameters; several local workers as processes.

Owns: the budget (a trial counts once COMPLETE, PRUNED or FAILED without a retry), the
bookkeeping lock (one worker at a time counts, reaps and asks), stale heartbeats, a
signalled worker's own trial given back, the local workers' devices and cores.
Never: runs the training (objective.py) or reads Optuna's private names (optuna_api.py).
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Optional

from runtime.config import load_config
from submission.hpo import optuna_api
from submission.hpo.common import (EXIT_BAD_INPUT, EXIT_OK, EXIT_STOPPED, ROOT, STORAGE_ENV,
                                   HpoError, heartbeat_file, seam)
from submission.hpo.objective import Outcome, Stop, prune_warmup_samples
from submission.hpo.space import trial_overrides
from submission.hpo.study import Study, open_study, storage_env_names


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


def retried_numbers(trials) -> set[int]:
    """The numbers of the trials a retry was queued for."""
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
    if not optuna_api.fail_running(ostudy, frozen, why):
        return   # finished meanwhile (its worker was alive after all): nothing to do
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
        hb = heartbeat_file(study, t.number)
        try:
            last = hb.stat().st_mtime
        except FileNotFoundError:
            last = t.datetime_start.timestamp() if t.datetime_start else now
        if now - last > study.heartbeat_grace_s:
            fail_and_retry(ostudy, t, f"worker gone: no heartbeat for {now - last:.0f} s "
                                      f"(grace {study.heartbeat_grace_s:.0f} s)")
            reaped.append(t.number)
    return reaped


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
    stop = Stop()
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
                    heartbeat_file(study, trial.number).write_text(
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
                    fail_and_retry(ostudy, optuna_api.current(ostudy, trial),
                                   f"worker stopped by a signal ({stop.signum})")
            run_trial = seam("run_trial")   # the package's: a stand-in set there runs instead
            o = run_trial(study, trial, target, stop, env_extra, on_stop=give_back,
                          warmup_samples=warmup,
                          keep_out=(STORAGE_ENV, *storage_env_names(url)))
            frozen = optuna_api.current(ostudy, trial)
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
                heartbeat_file(study, trial.number).unlink()
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


def local_slots(cfg, workers: int) -> list[dict]:
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


def spawn_workers(study: Study, url: Optional[str], slots: list[dict], out) -> int:
    """One ``hpo-worker`` process per slot, a signal passed on to all of them; the study's
    status from theirs."""
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
