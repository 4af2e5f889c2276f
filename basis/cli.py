"""The shell a command-line tool of the house runs in (``python -m loaders.prepare``,
``loaders.adopt``, ``runtime.model.convert``): how it stops, how it fails, what it prints.

Owns:
  * the stop signals - TERM, INT and HUP each stop the tool as Ctrl-C does: exit 130 and
    ``<prog>: interrupted; nothing was written to --out`` (HUP is the terminal closing, whose
    default would kill the process and leave its temporary directory behind); a signal ignored
    when the tool starts (nohup, a background job) stays ignored, and the handlers are put
    back afterwards;
  * a stop held back: while the output moves into place (``commit_window``: the tool is then
    complete a moment later, exit 0, never half-moved), or left to a worker pool's next poll
    (``defer``: loaders.workers.defer_stop, so the stop never lands while the pool's locks
    are held);
  * the failures a tool declares and their exit status - a data error 2, a worker's death 3,
    an ``--out`` that cannot be written 2 or a full disk 3 (``None``: the error's own
    ``exit_code``, as basis.staging.OutputError carries) - and the one line each prints:
    ``<prog>: error: <message>`` on stderr (a hung-up terminal's OSError swallowed: the exit
    status says it).
Never: parses arguments, knows what a tool does, or imports anything but the standard library
(basis/: the room below loaders and runtime).
"""
from __future__ import annotations

import contextlib
import signal
import sys
from typing import Any, Callable, Mapping, Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
EXIT_STOPPED = 130
INTERRUPTED = "interrupted; nothing was written to --out"


class Stopped(BaseException):
    """A stop signal arrived (a BaseException, as KeyboardInterrupt: no ``except Exception``
    of the tool swallows it)."""


_STOP: dict = {"window": False, "defer": None}


def _on_stop(signum, frame):
    if _STOP["window"]:
        return                      # the output moves into place: complete in a moment
    defer = _STOP["defer"]
    if defer is not None and defer():
        return                      # a pool wait raises KeyboardInterrupt at its next poll
    raise Stopped()


@contextlib.contextmanager
def commit_window():
    """While the output moves into place a stop signal is ignored: the tool is then complete
    a moment later (exit 0), never half-moved."""
    _STOP["window"] = True
    try:
        yield
    finally:
        _STOP["window"] = False


def say(line: str) -> None:
    """``line`` on stderr; nothing when stderr is gone (a hung-up terminal)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def run(prog: str, work: Callable[[], Any],
        failures: Mapping[type[BaseException], Optional[int]], *,
        defer: Optional[Callable[[], bool]] = None) -> int:
    """Run ``work()`` as the tool ``prog`` and return its exit status: 0 when it returns; for
    an exception of a ``failures`` type (the first that matches, in order) its one line and
    that status (``None``: the exception's ``exit_code``); 130 on a stop signal or Ctrl-C.
    Anything else propagates (a bug: its traceback is wanted). ``defer``: asked first by the
    stop handler; True means the stop is noted and raised elsewhere."""
    old = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    for s, handler in old.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, _on_stop)
    _STOP["defer"] = defer
    try:
        work()
        return 0
    except (KeyboardInterrupt, Stopped):
        say(f"{prog}: {INTERRUPTED}")
        return EXIT_STOPPED
    except tuple(failures) as e:
        code = next(c for t, c in failures.items() if isinstance(e, t))
        say(f"{prog}: error: {e}")
        return getattr(e, "exit_code", 2) if code is None else code
    finally:
        _STOP["defer"] = None
        for s, handler in old.items():
            signal.signal(s, handler)
