"""Worker processes for the data-set builders (``loaders.prepare``, its MLPerf text source,
``loaders.adopt``): an ordered ``map`` over tasks, inline for one worker or in a forked pool.

Owns: starting and ending the pool, the workers' signal handling and their one tokenizers
thread, and stopping safely: a builder's SIGTERM handler asks ``defer_stop()`` first - while
the parent waits on the pool the stop is noted and the wait raises KeyboardInterrupt at its
next poll (a tenth of a second), never inside the pool's own locks: an exception raised there
by a signal handler left the pool's clean-up (terminate, join) waiting forever on a lock no
thread would release (seen as a hung ``prepare`` under load). Never: what the tasks do, or any
ordering but the tasks' own: results come back in task order whatever finishes first, which
is what makes every builder's output independent of ``--workers``.
"""
from __future__ import annotations

import multiprocessing
import os
import signal


_STOP = {"waiting": 0, "requested": False}
POLL_S = 0.1


def defer_stop() -> bool:
    """For a builder's stop-signal handler: True when the parent is waiting on a pool - the
    stop is noted and that wait raises KeyboardInterrupt at its next poll -, False when the
    handler should raise itself (no pool wait: nothing can be left holding a lock)."""
    if _STOP["waiting"]:
        _STOP["requested"] = True
        return True
    return False


def _stop_point() -> None:
    if _STOP["requested"]:
        _STOP["requested"] = False
        raise KeyboardInterrupt("stopped by a signal")


def worker_init() -> None:
    # The parent handles Ctrl-C/SIGTERM and terminates the pool; workers just die.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # Parallelism comes from the processes; one tokenizers thread each.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


class Workers:
    """``map`` over tasks in order, inline for one worker or in a forked process pool (the
    children inherit the parent's module state as it is when the pool starts)."""

    def __init__(self, workers: int):
        self.workers = workers
        self.pool = None

    def __enter__(self):
        if self.workers > 1:
            self.pool = multiprocessing.get_context("fork").Pool(self.workers,
                                                                 initializer=worker_init)
        return self

    def __exit__(self, *exc):
        if self.pool is not None:
            if exc[0] is None:
                self.pool.close()
            else:
                self.pool.terminate()
            self.pool.join()
        return False

    def map(self, fn, tasks: list, chunksize: int = 1) -> list:
        if self.pool is None:
            return [fn(t) for t in tasks]
        _STOP["waiting"] += 1
        try:
            result = self.pool.map_async(fn, tasks, chunksize=chunksize)
            while not result.ready():  # polled: a stop request is raised here, not in a lock
                result.wait(POLL_S)
                _stop_point()
            return result.get()
        finally:
            _STOP["waiting"] -= 1

    def imap(self, fn, tasks: list):
        """Results in task order as they become ready (the caller can act on the first before
        the last is done)."""
        if self.pool is None:
            yield from (fn(t) for t in tasks)
            return
        _STOP["waiting"] += 1
        try:
            results = [self.pool.apply_async(fn, (t,)) for t in tasks]
        finally:
            _STOP["waiting"] -= 1
        _stop_point()
        for result in results:
            _STOP["waiting"] += 1
            try:
                while not result.ready():
                    result.wait(POLL_S)
                    _stop_point()
            finally:
                _STOP["waiting"] -= 1
            yield result.get()
