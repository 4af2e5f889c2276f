"""The order in which this host's ranks ended, seen from outside them: which rank died first.

A rank killed outright (SIGKILL, the OOM killer, a crash in native code) writes no record, and
the launcher then ends the others the same way: MPICH's mpiexec SIGKILLs them all and its
banner names one process with a bad status - at 4 ranks one it had killed itself in its
clean-up, so the summary once said "rank 1 ended first" of rank 3's death. The ranks cannot
say it either: their records (submission.rank_status) stop at the last logging point, and
the launcher kills the survivors before their failure path can write. So run_and_time.sh
starts this watcher beside the launcher:

    python -m submission.rank_ends RUN_DIR --armed DIR --ranks N --launcher-pid PID --parent PID

It learns the ranks of this host from the files they create in the ``--armed`` directory
as soon as they can take a stop request (``<host>.<pid>``, runtime.launch.signals.announce),
opens a pidfd for each (Linux 5.3; else it looks every 20 ms) and writes, each time it wakes
to ranks that have ended, one line to ``RUN_DIR/ranks/ends.jsonl``: the time and the PIDs
that ended since it last looked. Ranks on one line ended too close together to be told apart
(a tie); ``late``: they had ended before it found them. It ends when every rank it found has
ended and the launcher has, or when run_and_time.sh (``--parent``) is gone.

``first_ended`` reads that file for the summary: the one rank that ended first when the file
can tell, else why it cannot (a tie, ranks on other hosts not watched, no file).

Owns: the watch and its file. Never: signals, waits for or otherwise touches a rank; fails a
run (a watch that cannot be made leaves no file, and the summary says it cannot tell); reads
the environment.
"""
from __future__ import annotations

import argparse
import json
import os
import select
import socket
import sys
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

ENDS = "ends.jsonl"   # in the run directory's ranks/ (submission.rank_status.STATUS_DIR)
SCAN_S = 0.2          # how often the --armed directory is looked at for ranks not yet found
FALLBACK_S = 0.02     # without pidfds: how often each rank is looked at


def ends_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "ranks" / ENDS


def alive(pid: int) -> bool:
    """Not ended: a zombie has (its parent has not reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _announced(armed: Path, host: str) -> set[int]:
    """The PIDs of this host's ranks that said they are up (``<host>.<pid>`` files)."""
    try:
        names = os.listdir(armed)
    except OSError:
        return set()
    pids = set()
    for name in names:
        where, _, pid = name.rpartition(".")
        if where == host and pid.isdigit():
            pids.add(int(pid))
    return pids


class _Watch:
    """This host's ranks and which of them have ended (pidfds, else /proc)."""

    def __init__(self, out):
        self.out = out
        self.poller = select.poll()
        self.by_fd: dict[int, int] = {}   # pidfd -> pid
        self.plain: set[int] = set()      # watched through /proc (no pidfd)
        self.found: set[int] = set()

    def add(self, pids: set[int]) -> None:
        late = []
        for pid in sorted(pids - self.found):
            self.found.add(pid)
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                late.append(pid)
                continue
            except (AttributeError, OSError):
                if alive(pid):
                    self.plain.add(pid)
                else:
                    late.append(pid)
                continue
            self.by_fd[fd] = pid
            self.poller.register(fd, select.POLLIN)
        if late:
            self.record(late, late=True)

    def wait(self, timeout_s: float) -> None:
        """Up to ``timeout_s`` for ranks to end; records those that did."""
        if self.plain:
            timeout_s = min(timeout_s, FALLBACK_S)
        ended = []
        if self.by_fd:
            for fd, _ in self.poller.poll(timeout_s * 1000):
                ended.append(self.by_fd.pop(fd))
                self.poller.unregister(fd)
                os.close(fd)
        else:
            time.sleep(timeout_s)
        gone = {pid for pid in self.plain if not alive(pid)}
        self.plain -= gone
        if ended or gone:
            self.record(sorted(set(ended) | gone))

    @property
    def watching(self) -> bool:
        return bool(self.by_fd or self.plain)

    def record(self, pids: list[int], late: bool = False) -> None:
        line = {"time": time.time(), "pids": pids}
        if late:
            line["late"] = True
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()


def wake_first() -> bool:
    """Ask the scheduler to run this watch the moment a rank ends: SCHED_FIFO at the lowest
    real-time priority, where the host allows it (root, or an RLIMIT_RTPRIO above 0). The
    launcher kills the other ranks within milliseconds of the first one's end; a watch at
    normal priority on a loaded host may wake only after that, and then sees the ends as a
    tie. The watch only ever sleeps in poll() between looks (the kernel's real-time throttling
    bounds it besides), so it takes no CPU from the ranks. Elsewhere it stays as it is and says
    a tie when it sees one."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        return True
    except (AttributeError, OSError):
        return False


def watch(run_dir: Path, armed: Path, ranks: int, launcher_pid: int, parent: int) -> None:
    host = socket.gethostname()
    wake_first()
    path = ends_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as out:
        out.write(json.dumps({"host": host, "started": time.time()}) + "\n")
        out.flush()
        w = _Watch(out)
        while os.getppid() == parent:
            if len(w.found) < ranks:
                w.add(_announced(armed, host))
            launcher_gone = not alive(launcher_pid)
            if launcher_gone:
                w.add(_announced(armed, host))   # the last look: nothing more can come
                if not w.watching:
                    return
            if not w.watching:
                w.wait(0.1)   # none yet, or every one ended: soon to look again, or to leave
            else:
                w.wait(SCAN_S if len(w.found) < ranks and not launcher_gone else 1.0)


def read_ends(run_dir: str | Path, since: Optional[float] = None) -> Optional[dict]:
    """{"host", "started", "groups": [{"time", "pids", "late"?}, ...]}, or None when there is
    no watch of the launch that started at ``since``."""
    try:
        lines = ends_path(run_dir).read_text().splitlines()
        head = json.loads(lines[0])
        groups = [json.loads(x) for x in lines[1:] if x.strip()]
    except (OSError, IndexError, ValueError):
        return None
    if since is not None and float(head.get("started", 0)) < since - 1.0:
        return None   # an earlier attempt's
    return {"host": head.get("host"), "started": head.get("started"), "groups": groups}


def first_ended(run_dir: str | Path, records: Mapping[int, dict], candidates: Sequence[int],
                since: Optional[float] = None,
                before: Optional[float] = None) -> tuple[Optional[int], str]:
    """(the rank among ``candidates`` - ranks that recorded no end - that ended first, "") when
    the watch can tell; else (None, why it cannot). With ``before`` (seconds since the epoch)
    only ends the watch saw before then count: a watch's time is never earlier than the end
    it records, so a rank seen ended before a peer recorded its failure ended before it."""
    ends = read_ends(run_dir, since)
    if ends is None:
        return None, "no watch of this launch's ranks was kept"
    away = sorted(r for r in candidates if records.get(r, {}).get("host") != ends["host"])
    if away:
        return None, (f"rank(s) {', '.join(map(str, away))} ran on another host than "
                      f"{ends['host']}, where the ranks were watched")
    rank_of = {int(records[r].get("pid", -1)): r for r in candidates}
    for group in ends["groups"]:
        if before is not None and float(group.get("time", before)) >= before:
            break
        mine = sorted(rank_of[p] for p in group.get("pids", []) if p in rank_of)
        if not mine:
            continue
        if len(mine) > 1:
            return None, (f"ranks {', '.join(map(str, mine))} ended within one look of the "
                          f"watch on {ends['host']}: too close together to tell apart")
        return mine[0], ""
    return None, "the watch saw none of them end"


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m submission.rank_ends",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--armed", type=Path, required=True,
                    help="where the ranks say they are up (<host>.<pid> files)")
    ap.add_argument("--ranks", type=int, required=True, help="how many ranks the launch starts")
    ap.add_argument("--launcher-pid", type=int, required=True)
    ap.add_argument("--parent", type=int, required=True, help="run_and_time.sh's PID")
    a = ap.parse_args(argv)
    try:
        watch(a.run_dir, a.armed, a.ranks, a.launcher_pid, a.parent)
    except OSError:
        pass   # a courtesy: the summary says it cannot tell
    return 0


if __name__ == "__main__":
    sys.exit(main())
