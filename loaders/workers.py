"""Worker processes for the data-set builders (``loaders.prepare``, its MLPerf text source,
``loaders.adopt``): an ordered ``map`` over tasks, inline for one worker or in a forked pool.

Owns: starting and ending the pool, the workers' signal handling and their one tokenizers
thread. Never: what the tasks do, or any ordering but the tasks' own: results come back in
task order whatever finishes first, which is what makes every builder's output independent of
``--workers``.
"""
from __future__ import annotations

import multiprocessing
import os
import signal


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
        return self.pool.map(fn, tasks, chunksize=chunksize)

    def imap(self, fn, tasks: list):
        """Results in task order as they become ready (the caller can act on the first before
        the last is done)."""
        if self.pool is None:
            return (fn(t) for t in tasks)
        return self.pool.imap(fn, tasks)
