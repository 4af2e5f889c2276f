"""Worker processes for the data-set builders (``loaders.prepare``, its MLPerf text source,
``loaders.adopt``): an ordered ``map`` over tasks, inline for one worker or in a forked pool.

Owns: starting and ending the pool, the workers' signal handling and their one tokenizers
thread, and stopping safely, which CPython's pool does not: (1) a builder's SIGTERM handler
asks ``defer_stop()`` first - while a pool exists the stop is noted, and a wait on the pool
raises KeyboardInterrupt at its next poll (a tenth of a second; the pool's end raises it
otherwise), never while the parent holds one of the pool's locks; (2) a pool left by an
exception is abandoned, not ``terminate()``d: its workers are killed and its own clean-up is
cancelled - ``Pool.terminate()`` stops the result handler, then waits for the result queue's
lock, which a worker blocked writing a large result into the unread pipe holds forever (a hung
``prepare``, about once in 25 stops under load; py-spy showed the parent in _terminate_pool's
outqueue.put and a worker in its result's send); (3) a worker that dies (killed - the OOM
killer, a stray SIGKILL - or crashed) fails the wait within a poll, naming the worker and its
exit status: CPython's pool starts a replacement and waits forever for the lost task's result
(a test run hung 600 s in a map). Never: what the tasks do, or any
ordering but the tasks' own: results come back in task order whatever finishes first, which
is what makes every builder's output independent of ``--workers``.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.pool
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


def _abandon(pool) -> None:
    """End ``pool`` at once without ``Pool.terminate()`` (see the module docstring): no new
    workers, the workers killed (their results are not wanted), the pool's own clean-up
    cancelled (also the one the interpreter would run at exit). Falls back to terminate()
    on a Pool without these internals."""
    handler, workers = getattr(pool, "_worker_handler", None), getattr(pool, "_pool", None)
    finalizer = getattr(pool, "_terminate", None)
    if handler is None or workers is None or not hasattr(finalizer, "cancel"):
        pool.terminate()
        pool.join()
        return
    handler._state = multiprocessing.pool.TERMINATE  # the worker handler replaces no one
    for p in list(workers):
        p.kill()
    for p in list(workers):
        p.join(5)
    finalizer.cancel()


class WorkerDied(RuntimeError):
    """A worker process of the pool ended while its task was unfinished."""


class Workers:
    """``map`` over tasks in order, inline for one worker or in a forked process pool (the
    children inherit the parent's module state as it is when the pool starts)."""

    def __init__(self, workers: int):
        self.workers = workers
        self.pool = None

    def __enter__(self):
        if self.workers > 1:
            _STOP["waiting"] += 1  # from here to the pool's end a stop signal is deferred
            self.pool = multiprocessing.get_context("fork").Pool(self.workers,
                                                                 initializer=worker_init)
            self._started = list(getattr(self.pool, "_pool", []))  # the workers, to watch
        return self

    def __exit__(self, *exc):
        if self.pool is not None:
            if exc[0] is None and not _STOP["requested"]:
                self.pool.close()
                self.pool.join()
            else:
                _abandon(self.pool)
            self.pool = None
            _STOP["waiting"] -= 1
            if exc[0] is None:
                _stop_point()  # a stop that came while no wait polled
        return False

    def map(self, fn, tasks: list, chunksize: int = 1) -> list:
        if self.pool is None:
            return [fn(t) for t in tasks]
        result = self.pool.map_async(fn, tasks, chunksize=chunksize)
        while not result.ready():  # polled: a stop request is raised here, not in a lock
            _stop_point()
            self._check_workers(fn)
            result.wait(POLL_S)
        _stop_point()
        return result.get()

    def _check_workers(self, fn) -> None:
        """Raise WorkerDied when a worker of the pool has ended: the pool would replace it
        and wait forever for the task it held."""
        for p in self._started:
            code = p.exitcode
            if code is not None:
                how = (f"killed by signal {-code} ({signal.Signals(-code).name})" if code < 0
                       else f"exit status {code}")
                raise WorkerDied(
                    f"a worker process (pid {p.pid}) running {getattr(fn, '__name__', fn)} "
                    f"ended ({how}) with its task unfinished, so this build cannot be "
                    f"completed (it stops here, its output unfinished). A SIGKILL is most "
                    f"often the out-of-memory killer (see dmesg): run again with fewer "
                    f"--workers")

    def imap(self, fn, tasks: list):
        """Results in task order as they become ready (the caller can act on the first before
        the last is done)."""
        if self.pool is None:
            yield from (fn(t) for t in tasks)
            return
        results = [self.pool.apply_async(fn, (t,)) for t in tasks]
        for result in results:
            while not result.ready():
                _stop_point()
                self._check_workers(fn)
                result.wait(POLL_S)
            _stop_point()
            yield result.get()
