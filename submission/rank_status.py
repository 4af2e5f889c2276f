"""Each rank's last word, in the run directory: who failed, who vanished, at which step.

Owns:
  * ``RankStatus``: a callback that keeps ``<run dir>/ranks/rank_<r>.json`` current - host and
    PID at start, step and samples at every logging point (a small file replaced atomically,
    never on an ordinary step), and how the rank ended (``finish``: its exit status, state and
    reason; written from the failure path too);
  * ``lost_ranks``: on a failed collective, which peers are gone (a dead PID on this host, or
    a rank that recorded its own end) - the text the failing rank prints;
  * ``python -m submission.rank_status RUN_DIR --rc N [--launcher L] [--launcher-log FILE]``:
    after a launch, the one exit status of the job (below) on stdout and, when something
    failed, a summary naming the rank and the last completed step on stderr; a run its budget
    ended (exit 1) gets one line that says so instead (``budget_line``: "stopped at the step
    budget: N steps, no target ..."), the budgets and target given as ``--budget``. The launcher's
    own report, when captured (run_and_time.sh keeps it in ``<run dir>/launcher.log``), names
    the PID or task that died first; its row in submission.launchers maps it to a rank. When
    ranks ended without a record (killed), the order in which they ended
    (submission.rank_ends, watched beside the launcher) says which died first - a launcher
    ends the others itself, and MPICH's banner may name one of those; when nothing can tell,
    the summary says so instead of naming a rank. A rank the watch saw end before a peer
    recorded its failure is named first: the failure (a broken collective) followed it.
Never: steers training, talks to other ranks, or reads the environment.

Why a summary after the launch: launchers end the other ranks the moment one dies (MPICH's
mpiexec and srun --kill-on-bad-exit with SIGKILL), so the survivors cannot always speak; and
torchrun reports 1 for any failed worker, whatever status it exited with.

The job's exit status (submission/train.py's table): a rank that recorded a failure -> its
status (2 bad input, 3 runtime failure; 3 wins); else a rank that recorded nothing (killed:
SIGKILL, the OOM killer, a lost node) -> 3; else the status every rank recorded (the highest
when they differ); no record at all (the launch failed before any rank wrote one) -> the
launcher's status when it is one of ours (0-4), else 3 - and 3 for any failure of a launcher
that folds the ranks' status (submission.launchers: torchrun).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from runtime.events import Event, RunState
from submission.launchers import LAUNCHERS
from submission.rank_ends import alive, first_ended

STATUS_DIR = "ranks"
EXIT_CODES = (0, 1, 2, 3, 4)
RUNTIME_FAILURE = 3


def status_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / STATUS_DIR / f"rank_{rank:05d}.json"


def _write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)   # a full disk: no half-written file left
        raise


def read_all(run_dir: str | Path, since: Optional[float] = None) -> dict[int, dict]:
    """Every rank's record; with ``since`` (a launch's start, seconds since the epoch) only
    those started by that launch - an earlier attempt in the same run directory (a resume,
    perhaps on another world size) leaves records a summary must not count."""
    out = {}
    for path in sorted((Path(run_dir) / STATUS_DIR).glob("rank_*.json")):
        try:
            record = json.loads(path.read_text())
            if since is not None and float(record.get("started", 0)) < since - 1.0:
                continue
            out[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def clear(run_dir: str | Path) -> None:
    """Forget the records of an earlier attempt (rank 0, before this attempt's ranks write
    theirs)."""
    for path in (Path(run_dir) / STATUS_DIR).glob("rank_*.json"):
        path.unlink(missing_ok=True)


class RankStatus:
    """Keeps this rank's status file current (see the module docstring)."""

    def __init__(self, run_dir: str | Path, rank: int, world_size: int):
        self.path = status_path(run_dir, rank)
        self.record: dict[str, Any] = {
            "rank": rank, "world_size": world_size, "host": socket.gethostname(),
            "pid": os.getpid(), "started": time.time(), "state": "starting", "step": 0,
            "samples": 0}
        self._write()

    def _write(self) -> None:
        self.record["time"] = time.time()
        try:
            _write(self.path, self.record)
        except OSError:
            pass  # a status file is a courtesy: never fail a run over it

    def on_event(self, event: Event, state: RunState) -> None:
        if event in (Event.LOG, Event.RUN_START, Event.EVAL_STOP):
            self.record.update(state="training", step=state.step, samples=state.samples)
            self._write()

    def finish(self, exit_code: int, state: str, reason: str = "",
               lost: Sequence[int] = ()) -> None:
        """How this rank ended: exit status, "finished" | "stopped" | "failed", and why;
        ``lost``: the peers it found gone without a word when it failed (``lost_ranks``)."""
        self.record.update(exit=exit_code, state=state, reason=reason[-2000:])
        if lost:
            self.record["lost"] = sorted(lost)
        self._write()


PEER_GRACE_S = 1.0
"""How long a failing rank looks for a peer that is gone (``lost_ranks(wait_s=...)``): a
killed peer's sockets close as it exits, a moment before /proc shows it ended, and its
peers' collectives fail in that moment."""


def lost_ranks(run_dir: str | Path, me: int,
               wait_s: float = 0.0) -> tuple[list[str], list[int]]:
    """Peers of rank ``me`` that are gone or said they stopped: (one phrase each, the ranks
    gone without a word). With ``wait_s``, looks again until one is found or that long has
    passed."""
    deadline = time.monotonic() + wait_s
    while True:
        said, gone = _lost_now(run_dir, me)
        if said or time.monotonic() >= deadline:
            return said, gone
        time.sleep(0.05)


def _lost_now(run_dir: str | Path, me: int) -> tuple[list[str], list[int]]:
    host = socket.gethostname()
    out, gone = [], []
    for rank, rec in sorted(read_all(run_dir).items()):
        if rank == me:
            continue
        where = f"pid {rec.get('pid')} on {rec.get('host')}"
        if "exit" in rec:
            out.append(f"rank {rank} ({where}) ended with status {rec['exit']} "
                       f"({rec.get('state')}: {rec.get('reason', '')[:200]}) after step "
                       f"{rec.get('step')}")
        elif rec.get("host") == host and not alive(int(rec.get("pid", 0))):
            out.append(f"rank {rank} ({where}) is gone without a word after step "
                       f"{rec.get('step')}: killed by a signal (SIGKILL, the OOM killer) or "
                       f"crashed in native code")
            gone.append(rank)
    return out, gone


# ------------------------------------------------------------------ after the launch

def launcher_culprit(text: str, records: dict[int, dict],
                     launcher: Optional[str] = None) -> Optional[str]:
    """The rank the launcher says ended first, as a phrase; None when it says nothing we read.

    Each launcher's report and its phrase are its row in submission.launchers. With
    ``launcher`` (system.launcher) only its own report counts: mpiexec and mpirun start their
    daemons with srun inside an allocation, and srun's "task N" there is a daemon, not a rank.
    Without, the first row whose report is in ``text`` answers.
    """
    specs = [LAUNCHERS[launcher]] if launcher in LAUNCHERS else list(LAUNCHERS.values())
    for spec in specs:
        phrase = spec.culprit(text, records)
        if phrase:
            return phrase
    return None


# A rank's failure as run_guarded prints it: "[rank N] ErrorName: message" (its one line, or
# the last line of its traceback) - read when the rank could not record it (a full disk).
_CONSOLE_FAILURE = re.compile(r"^\[rank (\d+)\] ([A-Za-z_][\w.]*): (.+)$", re.M)


def console_failures(text: str) -> dict[int, str]:
    """Rank -> "ErrorName: message", the last failure each rank printed in ``text``."""
    return {int(m[1]): f"{m[2]}: {m[3]}" for m in _CONSOLE_FAILURE.finditer(text)}


def job_exit_code(records: dict[int, dict], world_size: Optional[int], launcher_rc: int,
                  launcher: Optional[str] = None) -> int:
    if not records:
        if launcher in LAUNCHERS and LAUNCHERS[launcher].folds_exit_status and launcher_rc:
            # torchrun's 1 says a worker failed, not how; never "target not reached" (1),
            # which only a rank that trained to the end records.
            return RUNTIME_FAILURE
        return launcher_rc if launcher_rc in EXIT_CODES else RUNTIME_FAILURE
    world = world_size or max(int(r.get("world_size", 1)) for r in records.values())
    failed = [int(r["exit"]) for r in records.values() if r.get("state") == "failed"
              and "exit" in r]
    if failed:  # the root cause; ranks without a record were ended by the launcher after it
        return RUNTIME_FAILURE if RUNTIME_FAILURE in failed else max(failed)
    codes = [records[r].get("exit") if r in records else None for r in range(world)]
    if None in codes:
        return RUNTIME_FAILURE  # a rank died without a word
    return codes[0] if len(set(codes)) == 1 else max(codes)


NOT_REACHED = 1


def budget_line(run_dir: str | Path, records: dict[int, dict],
                budget: Optional[tuple[int, int, float]] = None) -> str:
    """The line of a run its budget ended (exit 1: no failure - a smoke, profile or tuning
    run ends so): which budget, the steps and samples, the last evaluation against the target.
    ``budget``: (train.max_steps, train.max_samples_termination, train.target_mlm_accuracy)."""
    end: dict = {}
    try:   # rank 0's summary of this attempt (written by every run that ended so)
        end = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        pass
    steps = end.get("steps", max((int(r.get("step", 0)) for r in records.values()), default=0))
    samples = end.get("samples", max((int(r.get("samples", 0)) for r in records.values()),
                                     default=0))
    max_steps, max_samples, target = budget or (0, 0, None)
    if max_samples and samples >= max_samples and not (max_steps and steps >= max_steps):
        which = f"sample budget: {samples:,} samples (train.max_samples_termination), {steps} steps"
    else:
        which = f"step budget: {steps} steps (train.max_steps), {samples:,} samples"
    acc = end.get("eval_accuracy")
    goal = f" {target:g}" if target is not None else ""
    short = (f"the last evaluation's accuracy {acc:.4f} is short of train.target_mlm_accuracy"
             f"{goal}" if isinstance(acc, (int, float)) else "no evaluation reached "
             f"train.target_mlm_accuracy{goal}")
    return (f"stopped at the {which}, no target: {short} (exit 1, target not reached - not a "
            f"failure; no RESULT line)")


def summary(run_dir: str | Path, launcher_rc: int, launcher_log: Optional[Path],
            since: Optional[float] = None, launcher: Optional[str] = None,
            budget: Optional[tuple[int, int, float]] = None) -> tuple[int, list[str]]:
    records = read_all(run_dir, since)
    code = job_exit_code(records, None, launcher_rc, launcher)
    lines: list[str] = []
    if code == NOT_REACHED and records:
        return code, [budget_line(run_dir, records, budget)]
    if code in (0, 1) or not records:
        return code, lines
    text = ""
    if launcher_log is not None and launcher_log.is_file():
        text = launcher_log.read_text(errors="replace")
    last = max((int(r.get("step", 0)) for r in records.values()), default=0)
    failed = [r for r, rec in sorted(records.items()) if rec.get("state") == "failed"]
    said = {}   # records the ranks could not finish (a full disk): what they printed
    if not failed:
        said = {r: why for r, why in console_failures(text).items()
                if r in records and "exit" not in records[r]}
        failed = sorted(said)
    who = (f"rank {failed[0]}" if len(failed) == 1 else
           "ranks " + ", ".join(map(str, failed))) + " failed"
    culprit = launcher_culprit(text, records, launcher)
    unrecorded = [r for r in sorted(records) if "exit" not in records[r] and r not in said]
    first = None
    if not failed and unrecorded:   # ended without a word: which first, the launcher's checked
        first, culprit = _first_killed(run_dir, records, unrecorded, since, culprit, launcher)
    elif failed and unrecorded:     # a failure recorded: was a rank killed before it?
        first, culprit = _killed_before_failure(run_dir, records, failed, unrecorded, since,
                                                culprit, launcher)
    if culprit:
        lines.append(culprit)
    # the rank that ended first, then those that failed: the others ended because of them
    for rank, rec in sorted(records.items(), key=lambda kv: (
            0 if kv[0] == first else 1 if kv[0] in failed else 2, kv[0])):
        where = f"pid {rec.get('pid')} on {rec.get('host')}"
        if "exit" in rec:
            reason = next((x for x in rec.get("reason", "").splitlines() if x.strip()), "")
            lines.append(f"rank {rank} ({where}): exit {rec['exit']}, {rec.get('state')} after "
                         f"step {rec.get('step')}" + (f": {reason}" if reason else ""))
        elif rank in said:
            lines.append(f"rank {rank} ({where}): failed after step {rec.get('step')} (its "
                         f"record could not be finished; it printed): {said[rank]}")
        elif rank == first:
            lines.append(f"rank {rank} ({where}): no exit record - ended first; last logged "
                         f"step {rec.get('step')}")
        elif failed:
            lines.append(f"rank {rank} ({where}): stopped after {who} (the launcher ended it "
                         f"before it could record its end); last logged step {rec.get('step')}")
        elif first is not None:
            lines.append(f"rank {rank} ({where}): no exit record - ended after rank {first} "
                         f"(the launcher ends the others); last logged step {rec.get('step')}")
        else:
            lines.append(f"rank {rank} ({where}): no exit record - killed (SIGKILL, OOM, lost "
                         f"node) or stopped by the launcher after another rank ended; last "
                         f"logged step {rec.get('step')}")
    lines.append(f"last completed step logged: {last}; exit status {code} "
                 f"({_meaning(code)})")
    return code, lines


_NAMED = re.compile(r"^rank (\d+) ")   # a launcher's phrase names its rank first (launchers.py)


def _first_killed(run_dir, records: dict[int, dict], killed: list[int], since, culprit,
                  launcher) -> tuple[Optional[int], Optional[str]]:
    """(the rank of ``killed`` that ended first or None, the line that says so): the
    launcher's own line when it names that rank (it says how), else ours; when nothing can
    tell, the launcher's word marked as unconfirmed, or nothing."""
    first, why = first_ended(run_dir, records, killed, since)
    named = _NAMED.match(culprit or "")
    named_rank = int(named[1]) if named else None
    if first is not None:
        if named_rank == first:
            return first, culprit
        rec = records[first]
        line = (f"rank {first} (pid {rec.get('pid')} on {rec.get('host')}) ended first, "
                f"without an exit record: killed (SIGKILL, the OOM killer, a lost node) or "
                f"crashed in native code")
        if named_rank is not None:
            line += (f"; {launcher or 'the launcher'}'s report names rank {named_rank}, "
                     f"which it ended itself after")
        return first, line
    if len(killed) == 1:   # the only rank without a word: the launcher's line, if any
        return None, culprit
    line = f"which rank ended first cannot be told: {why}"
    if named_rank is not None:
        how = culprit.split(" ended first: ", 1)[-1]
        line += (f"; {launcher or 'the launcher'}'s report names rank {named_rank} ({how}), "
                 f"which may be one it ended itself after the first")
    elif culprit:
        line += f"; the launcher's report: {culprit}"
    return None, line


def _killed_before_failure(run_dir, records: dict[int, dict], failed: list[int],
                           unrecorded: list[int], since, culprit,
                           launcher) -> tuple[Optional[int], Optional[str]]:
    """(the rank of ``unrecorded`` that ended before the first of ``failed`` recorded its
    failure, or None; the line that says so, else the launcher's own). A rank killed
    outright breaks its peers' next collective: a peer may record that failure (gloo's
    barrier: "Ranks 3 failed to pass monitoredBarrier") before the launcher ends it, and then
    the failure is the consequence, the killed rank the cause. Known from the failed ranks'
    own records (the peers they found gone, ``lost``; several: the watch's order), else
    from the watch (an end it saw before the first failure was recorded)."""
    lost = sorted({r for f in failed for r in records.get(f, {}).get("lost", ())
                   if r in unrecorded})   # found gone by a failing rank: before its failure
    first = lost[0] if len(lost) == 1 else None
    if len(lost) > 1:
        first, _ = first_ended(run_dir, records, lost, since)
    times = [float(records[r]["time"]) for r in failed   # when each recorded its failure
             if "exit" in records.get(r, {}) and "time" in records[r]]
    if first is None and times:
        first, _ = first_ended(run_dir, records, unrecorded, since, before=min(times))
    if first is None:
        return None, culprit
    rec = records[first]
    failed_ones = (f"rank {failed[0]}" if len(failed) == 1 else
                   "ranks " + ", ".join(map(str, failed)))
    line = (f"rank {first} (pid {rec.get('pid')} on {rec.get('host')}) ended first, without an "
            f"exit record: killed (SIGKILL, the OOM killer, a lost node) or crashed in native "
            f"code; {failed_ones} failed after it")
    named = _NAMED.match(culprit or "")
    if named and int(named[1]) != first:
        line += (f"; {launcher or 'the launcher'}'s report names rank {named[1]}, which it "
                 f"ended itself after")
    return first, line


def _meaning(code: int) -> str:
    return {0: "success", 1: "target not reached", 2: "bad input",
            3: "runtime failure", 4: "stopped by a signal"}.get(code, "?")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m submission.rank_status",
        description="After a launch: the job's one exit status on stdout, from its ranks' "
                    "status files, and on stderr a summary of the rank that failed and the "
                    "last step.")
    ap.add_argument("run_dir")
    ap.add_argument("--rc", type=int, required=True, help="the launcher's exit status")
    ap.add_argument("--launcher", help="system.launcher: read only its report, and know "
                    "whether its status folds the ranks' (torchrun)")
    ap.add_argument("--launcher-log", type=Path, help="the launcher's captured output")
    ap.add_argument("--since", type=float, help="the launch's start (seconds since the "
                    "epoch): records of earlier attempts are ignored")
    ap.add_argument("--budget", nargs=3, metavar=("MAX_STEPS", "MAX_SAMPLES", "TARGET"),
                    help="train.max_steps, train.max_samples_termination and "
                         "train.target_mlm_accuracy, for the line of a run its budget ended")
    a = ap.parse_args(argv)
    budget = (int(a.budget[0]), int(a.budget[1]), float(a.budget[2])) if a.budget else None
    code, lines = summary(a.run_dir, a.rc, a.launcher_log, a.since, a.launcher, budget)
    for line in lines:
        print(f"run_and_time.sh: {line}", file=sys.stderr)
    print(code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
