"""One trial of ``python -m submission hpo``: its training run (run_and_time.sh with the
trial's values as typed overrides), what is read from it - the value, censored when the
target was not reached - and pruning: each evaluation reported, a hopeless run stopped
through the runtime's own stop path.

Owns: the objectives (samples or time to target), the warm-up before a pruner may stop a
run, the trial's process (its heartbeat thread, its stop on the worker's signal, what is left
of it), the Outcome of a run.
Never: trains (run_and_time.sh does), passes a value through a shell, decides a retry
(worker.py does, from the Outcome), or holds the pruner rows (study.py, beside the samplers).
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from submission import report as rep
from submission.hpo.common import ROOT, STORAGE_ENV, heartbeat_file, seam
from submission.hpo.space import trial_overrides
from submission.hpo.study import Study

OBJECTIVES = ("samples", "time")


@dataclass
class Outcome:
    """What a trial's run came to; the worker tells the study from it."""

    state: str                   # "complete" | "pruned" | "fail" | "retry" | "bad_input"
    value: Optional[float] = None
    attrs: dict = field(default_factory=dict)
    message: str = ""


def _set_pdeathsig() -> None:
    """In the trial's run_and_time.sh, before exec: SIGTERM when the worker dies (Linux), so a
    killed worker's run is asked to stop like any other."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


class Stop:
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


def run_trial(study: Study, trial, target: float, stop: Stop,
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
    proc = subprocess.Popen(["bash", str(seam("RUN_AND_TIME")), "--", *overrides], cwd=ROOT,
                            env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=_set_pdeathsig)
    stop.proc = proc
    if stop.signum is not None:   # a signal between ask and launch
        stop(stop.signum, None)
    beat_stop = threading.Event()
    hb = heartbeat_file(study, trial.number)

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
