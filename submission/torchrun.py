"""torchrun's agent as run_and_time.sh starts it (``system.launcher = 'torchrun'`` without
``TORCHRUN``): ``python -m torch.distributed.run`` itself, in this process, with one
difference - a stop request ends it as what it is.

    python -m submission.torchrun [torchrun's options] -m submission.train ARGS

run_and_time.sh passes a stop request (Ctrl-C, a closed terminal, systemd's TERM) on to the
agent as SIGTERM; the agent passes it to its workers, waits for them to checkpoint and stop
(exit 4), then raises ``SignalException`` out of its main: torchrun printed that as a
~30-line traceback and exited 1, and the run looked like a crash before the ranks' own
status (4) was read. Here that one exception is said in one line and the agent exits
128 + the signal's number, the shell's "ended by signal N"; the job's status is the ranks'
(submission.rank_status).

Workers that end non-zero make the agent raise ``ChildFailedError``, which torchrun printed
as a traceback too - after every run that stopped at its budget (exit 1 on every worker:
"target not reached", no failure; run_and_time.sh says "stopped at the step budget"). Here
that is no output at all, exit 1; any other worker failure is torchrun's report of it (which
worker, its exit code, the root cause: what rank_status reads), without the traceback, exit 1.

Owns: nothing but that. Never: changes torchrun's options, its workers or their status.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):   # this module's word; torchrun's options are its
        argparse.ArgumentParser(
            prog="python -m submission.torchrun",
            description="Run torchrun's agent (python -m torch.distributed.run) with the same "
                        "arguments; a stop request that the agent passed on to its workers "
                        "ends it in one line and with status 128 + the signal, not a "
                        "traceback. torchrun's own options: python -m torch.distributed.run "
                        "--help.").parse_args(argv[:1])
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main
    try:
        torchrun_main(argv)
    except SignalException as e:
        print(f"torchrun: got {e.sigval.name}: passed it on to the workers and waited for "
              f"them to stop (their own status is the run's)", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        if {f.exitcode for f in e.failures.values()} != {BUDGET_SPENT}:
            print(f"{type(e).__module__}.{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1   # torchrun's own status for any failed worker
    return 0


BUDGET_SPENT = 1   # submission.train's "target not reached": the budget ended the run


if __name__ == "__main__":
    sys.exit(main())
