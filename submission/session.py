"""The launcher's process, as run_and_time.sh starts it: in a session of its own, and stopped
when the script dies.

    python -m submission.session --stop-signal USR1 --parent PID [--same-session] -- CMD...

becomes CMD (exec: the same process, the same PID) after:
  * ``setsid()``: CMD and everything it starts leave run_and_time.sh's process group and
    terminal, so what a terminal sends to its foreground group - SIGINT per Ctrl-C, SIGHUP
    when it is closed - and any signal to the script's whole group reach the script alone,
    which passes one stop request on. Sent to the launchers themselves, a second SIGINT makes
    MPICH's mpiexec abort the job and srun kill the step, SIGHUP kills mpiexec, and torchrun's
    agent, given INT by the terminal and TERM by the script, tears its store down under its
    workers: no checkpoint, exit 3. ``--same-session``: not for a task of a Slurm job step
    that is itself a rank (Slurm's process tracking may follow the process group);
  * ``prctl(PR_SET_PDEATHSIG, stop signal)``: when run_and_time.sh dies without passing
    anything on (SIGKILL, the OOM killer), CMD gets the stop request all the same - the
    launcher's own ``--stop-signal``, which it forwards to every rank - so the ranks
    checkpoint and stop rather than train on as orphans. The setting survives exec; if the
    script (``--parent``) is already gone, nothing is started (exit 4).
SIGPIPE and SIGXFSZ go back to their defaults (Python ignores them; exec would pass that on).

Owns: the launcher's process session and its parent-death signal.
Never: forks, waits, or reads the launcher's environment (the launch itself is
submission.launchers' row; what reaches the ranks is the launcher's business).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
from typing import Optional, Sequence

PR_SET_PDEATHSIG = 1   # <linux/prctl.h>
EXIT_STOPPED = 4


def set_parent_death_signal(signum: int) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent dies (Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    options = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m submission.session",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--stop-signal", required=True, help="USR1, TERM ...: the launcher's stop "
                    "request (submission.launchers), sent to it when --parent dies")
    ap.add_argument("--parent", type=int, required=True, help="run_and_time.sh's PID")
    ap.add_argument("--same-session", action="store_true",
                    help="stay in the caller's session (a Slurm task that is itself a rank)")
    a = ap.parse_args(options)
    if not command:
        ap.error("no command after '--'")
    try:
        signum = signal.Signals[f"SIG{a.stop_signal.removeprefix('SIG')}"]
    except KeyError:
        ap.error(f"--stop-signal {a.stop_signal!r} is not a signal name")
    if not set_parent_death_signal(signum):
        print(f"run_and_time.sh: warning: cannot set the launcher's parent-death signal "
              f"(prctl failed): if run_and_time.sh is killed, stop the ranks yourself",
              file=sys.stderr, flush=True)
    if os.getppid() != a.parent:   # it died before the line above could take effect
        print(f"run_and_time.sh (pid {a.parent}) ended before its launcher started: nothing "
              f"was started", file=sys.stderr, flush=True)
        return EXIT_STOPPED
    if not a.same_session:
        try:
            os.setsid()
        except PermissionError:
            # Already a process group leader (a shell with job control put us in our own
            # group): a group of our own is what the terminal's signals miss anyway.
            pass
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_DFL)
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"run_and_time.sh: cannot start {command[0]}: {e.strerror}", file=sys.stderr,
              flush=True)
        return 127
    return 0   # not reached


if __name__ == "__main__":
    sys.exit(main())
