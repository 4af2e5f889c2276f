"""Worker processes for the data-set builders (``loaders.prepare``, its MLPerf text source,
``loaders.adopt``): an ordered ``map`` over tasks, inline for one worker or in a pool of
processes that inherit nothing from the caller.

Owns: starting and ending the pool, handing each worker the builder's state, the workers'
signal handling, their one tokenizers thread and their end with the parent, naming the task a
dead worker held, and stopping safely.

Why no fork: a forked child inherits every lock and condition of the parent in the state it
was in, without the threads that own them. A builder called from a process that holds threads
- a torch.distributed process group (gloo's worker threads), a tokenizers thread pool, CUDA -
forks children that deadlock the first time they touch one: a pytest worker that had made a
gloo group hung 600 s in prepare's tokenizing map, the child's garbage collector inside
``~ProcessGroupGloo`` -> ``pthread_cond_destroy`` (py-spy, 2026-11-29). The workers start from
multiprocessing's forkserver, a fresh interpreter started once per process, so they hold only
what they import and what the builder hands them (``setup``: a function and its arguments,
called once in each worker - and in the caller itself when it runs the tasks inline).

The pool is ``concurrent.futures.ProcessPoolExecutor``: a worker that dies (the OOM killer, a
stray SIGKILL, a crash) breaks it and every wait fails at once (``BrokenProcessPool``), where
CPython's ``multiprocessing.Pool`` replaced the worker and waited forever for its task. One
case the pool cannot see: a worker killed while it sends a result leaves half a message in the
pipe every worker writes to, and the pool's thread waits for the rest for ever; so the wait here
also watches the workers' sentinels and, seeing one ended, kills the rest and closes the pipe
(``_unblock``). Each worker notes in shared memory which task it runs, so the error names the
task (``describe``: "tokenizing part-00001-of-00500") and how the worker ended - or, when the
forkserver itself was killed (the workers' parent: multiprocessing then reports every worker
as "exit status 255"), names the forkserver, how it ended and the tasks its workers held.

Stopping: (1) a builder's SIGTERM handler asks ``defer_stop()`` first - while a pool exists the
stop is noted, and a wait on the pool raises KeyboardInterrupt at its next poll (a tenth of a
second), never while the parent holds one of the pool's locks; (2) a pool left by an exception
or a stop is ended at once: pending tasks cancelled, workers killed, the result pipe closed (a
worker killed halfway through a result would otherwise keep the builder from exiting); (3) a
worker whose parent is killed (SIGKILL: no clean-up runs) ends at once (a thread waits for the
builder's end), instead of working on to the end of its task or waiting forever for the next.

Never: what the tasks do, or any ordering but the tasks' own: results come back in task order
whatever finishes first, which is what makes every builder's output independent of
``--workers``.
"""
from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import multiprocessing.connection
import os
import select
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterable, Optional

START_METHOD = "forkserver"   # see the module docstring: never "fork"
POLL_S = 0.1

_STOP = {"waiting": 0, "requested": False}
_SLOTS: dict = {}   # in a worker: its slot in the parent's table of running tasks


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


class WorkerDied(RuntimeError):
    """A worker process of the pool ended while it held a task (its message names the task)."""


def _end_with(builder: int) -> None:
    """End this worker as soon as the builder process ``builder`` has ended, whatever it was
    doing: a daemon thread waits on a pidfd of the builder (Linux >= 5.3; elsewhere it polls).
    Neither the kernel's parent-death signal nor a closed pipe can tell: the worker's parent is
    the forkserver, and the forkserver, like the pool's queues, has its pipes' other ends open in
    the workers themselves."""
    def watch():
        try:
            fd = os.pidfd_open(builder)
        except ProcessLookupError:
            os._exit(1)
        except (AttributeError, OSError):
            fd = None
        if fd is not None:
            select.select([fd], [], [])
        else:
            while _running(builder):
                time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, name="end-with-builder", daemon=True).start()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _worker_start(builder, table, counter, setup) -> None:
    # The parent handles Ctrl-C/SIGTERM and ends the pool; workers just die.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    # Parallelism comes from the processes; one tokenizers thread each.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _end_with(builder)
    with counter.get_lock():
        slot = counter.value
        counter.value += 1
    _SLOTS.update(table=table, slot=slot)
    if setup is not None:
        fn, args = setup
        fn(*args)


def _run(fn, index: int, task):
    """In a worker: note (pid, task index) in this worker's slot, then run the task."""
    table, slot = _SLOTS["table"], _SLOTS["slot"]
    table[2 * slot], table[2 * slot + 1] = os.getpid(), index
    result = fn(task)
    table[2 * slot + 1] = -1
    return result


PF_EXITING = 0x4
"""/proc/PID/stat's flags (field 9): the process is in its exit (linux/sched.h)."""


def _forkserver_end(wait_s: float = 2.0) -> Optional[tuple[int, str]]:
    """(its pid, how it ended) when the forkserver this process starts its workers from has
    ended, else None. Its parent is this process, which never reaps it (multiprocessing does
    when it starts another): an ended one is a zombie whose /proc stat holds its wait status
    (field 52, Linux >= 3.5). One that is still in its exit (flag PF_EXITING: its files,
    the workers' status pipes among them, are closed before it becomes a zombie - which is
    how its workers came to read as "exit status 255") is waited for, up to ``wait_s``."""
    from multiprocessing import forkserver
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if not pid:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return pid, "ended"
        if fields[0] == "Z":
            break
        if not int(fields[6]) & PF_EXITING:
            return None
        if time.monotonic() > deadline:
            return pid, "ended"
        time.sleep(0.01)
    try:
        status = int(fields[49])
    except (IndexError, ValueError):
        return pid, "ended"
    if os.WIFSIGNALED(status):
        return pid, _how(-os.WTERMSIG(status))
    return pid, _how(os.WEXITSTATUS(status))


def _how(code: Optional[int]) -> str:
    if code is None:
        return "ended"
    if code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"ended with exit status {code}"


class Workers:
    """``map``/``imap`` over tasks in order: inline for one worker, else in a pool of
    ``workers`` processes started from the forkserver (see the module docstring).

    ``setup``: ``(function, args)`` called once in each worker before its first task (and once
    here when inline): how a builder hands its workers what its tasks read. Both must pickle;
    the function by reference (a module-level function)."""

    def __init__(self, workers: int, setup: Optional[tuple[Callable, tuple]] = None):
        self.workers = workers
        self.setup = setup
        self.pool: Optional[cf.ProcessPoolExecutor] = None

    def __enter__(self):
        if self.workers <= 1:
            if self.setup is not None:
                self.setup[0](*self.setup[1])
            return self
        ctx = multiprocessing.get_context(START_METHOD)
        self._table = ctx.RawArray("q", 2 * self.workers)    # per worker: pid, task index
        for i in range(len(self._table)):
            self._table[i] = -1
        counter = ctx.Value("i", 0)
        _STOP["waiting"] += 1  # from here to the pool's end a stop signal is deferred
        try:
            self.pool = cf.ProcessPoolExecutor(
                self.workers, mp_context=ctx, initializer=_worker_start,
                initargs=(os.getpid(), self._table, counter, self.setup))
            # The pool's internals touched here and nowhere else: (1) the workers' Process
            # objects, for their exit status and for killing them (the same dict for the
            # pool's life); (2) this process's end of the workers' result pipe, closed once
            # they are killed (see _unblock); (3) every worker started at the first task,
            # before any task runs - started one per task instead, a worker dying while the
            # next starts has its status read by two threads at once (Process.start polls the
            # children; see _died); (4) whether it broke (imap); (5) its thread, waited for
            # when the pool is ended at once (_end_now).
            self._processes = getattr(self.pool, "_processes", None)
            self._result_writer = self.pool._result_queue._writer
            self.pool._safe_to_dynamically_spawn_children = False
        except BaseException:
            _STOP["waiting"] -= 1
            raise
        return self

    def __exit__(self, *exc):
        if self.pool is not None:
            if exc[0] is None and not _STOP["requested"]:
                self.pool.shutdown(wait=True)
            else:
                self._end_now()
            self.pool = None
            _STOP["waiting"] -= 1
            if exc[0] is None:
                _stop_point()  # a stop that came while no wait polled
        return False

    def _end_now(self) -> None:
        """Cancel what is pending and kill the workers: their results are not wanted. Then
        wait (at most 5 s) for the pool's thread to end: broken by the killed workers, it
        closes the pool's wake-up pipe, and CPython 3.11's exit handler, which wakes every
        pool's thread without the pool's lock, raced that close - "Exception ignored ...
        OSError: [Errno 9] Bad file descriptor" and a traceback after a stop (seen in 1 of
        ~10 suite runs)."""
        manager = getattr(self.pool, "_executor_manager_thread", None)   # shutdown forgets it
        self.pool.shutdown(wait=False, cancel_futures=True)
        self._unblock()
        for p in list((self._processes or {}).values()):
            p.join(5)
        if manager is not None:
            manager.join(5)

    def _unblock(self) -> None:
        """Kill every worker, then close this process's end of the pool's result pipe (only
        workers write there). A worker killed while it sends a result - a stop, the OOM killer
        - leaves half a message in the pipe, and the pool's thread waits for the rest for ever:
        the process could not exit (its exit joins that thread; CI hung so after a SIGTERM,
        2026-12-02), and the pool never learnt it was broken. With every writer gone the wait
        ends (EOF), the pool breaks and its thread ends. Only signals are sent here: no exit
        status is read (see _died)."""
        for p in list((self._processes or {}).values()):
            try:
                p.kill()
            except (ValueError, OSError):   # closed, or already gone
                pass
        self._result_writer.close()

    def _ended(self) -> list[int]:
        """The workers that have ended, told by their sentinels alone (readable once a
        process has ended; nothing is read from them, see _died). A worker never ends on its
        own while the pool lives."""
        ended = []
        for pid, p in list((self._processes or {}).items()):
            try:
                if multiprocessing.connection.wait([p.sentinel], 0):
                    ended.append(pid)
            except (ValueError, OSError):
                ended.append(pid)
        return ended

    def map(self, fn, tasks: Iterable, describe: Optional[Callable[[Any], str]] = None,
            chunksize: int = 1) -> list:
        """``[fn(t) for t in tasks]``, in the pool. ``describe(task)`` names a task for the
        error a dead worker raises ("tokenizing part-00001-of-00500")."""
        return list(self.imap(fn, tasks, describe))

    def imap(self, fn, tasks: Iterable, describe: Optional[Callable[[Any], str]] = None):
        """Results in task order as they become ready (the caller can act on the first before
        the last is done)."""
        tasks = list(tasks)
        if self.pool is None:
            yield from (fn(t) for t in tasks)
            return
        try:
            futures = [self.pool.submit(_run, fn, i, t) for i, t in enumerate(tasks)]
        except BrokenProcessPool:   # a worker died while the tasks were handed out
            raise self._died(fn, tasks, describe) from None
        except OSError:
            # ... and the pool, broken, closed its queues while it started a worker for them
            if not getattr(self.pool, "_broken", False):
                raise
            raise self._died(fn, tasks, describe) from None
        for future in futures:
            while not future.done():  # polled: a stop request is raised here, not in a lock
                _stop_point()
                cf.wait([future], timeout=POLL_S)
                ended = [] if future.done() else self._ended()
                if ended:   # the pool may never learn it (see _unblock): not waited for
                    raise self._died(fn, tasks, describe, ended=ended) from None
            _stop_point()
            try:
                yield future.result()
            except BrokenProcessPool:
                raise self._died(fn, tasks, describe) from None

    def _died(self, fn, tasks: list, describe, ended: Optional[list[int]] = None
              ) -> WorkerDied:
        """The error for a dead worker: which worker ended, how, and the task it held. Seen by
        imap's poll first (``ended``: those that had ended then), the others are killed here;
        seen by the pool first, it has terminated the others (SIGTERM), so a worker that ended
        otherwise is the one that died first.

        The exit codes are read after the pool's own thread has ended the workers: a forkserver
        child's status is one message on its sentinel pipe, and two threads polling it at once
        (ours and the pool's, joining its workers) leave one of them an EOF that multiprocessing
        records as exit status 255 - a SIGKILLed worker was once named "ended with exit status
        255" so."""
        if ended:
            self._unblock()   # the pool may not know: its thread may wait for half a result
        self.pool.shutdown(wait=True)   # broken: its thread has only to terminate and join
        procs = self._processes or {}
        held = {}
        for s in range(self.workers):
            pid, index = self._table[2 * s], self._table[2 * s + 1]
            if pid > 0 and index >= 0:
                held[pid] = index
        codes = {pid: p.exitcode for pid, p in procs.items()}
        first = [pid for pid in (ended or codes)
                 if codes.get(pid) is not None and codes[pid] != -signal.SIGTERM]
        suspects = first or ended or [pid for pid in codes if pid in held] or list(held)

        def name(index: int) -> str:
            task = tasks[index]
            return describe(task) if describe is not None else (
                f"{getattr(fn, '__name__', fn)}({task!r:.60})")
        server = _forkserver_end()
        if server is not None:   # the workers' parent: its end is theirs, whatever they did
            left = " and ".join(dict.fromkeys(name(i) for i in held.values()))
            return WorkerDied(
                f"the forkserver (pid {server[0]}), the process this build's workers are "
                f"started from, {server[1]}"
                + (f" while its workers were {left}" if left else "")
                + "; its workers ended with it, so this build cannot be completed; nothing "
                "was written. It does no work of its own - something other than the build "
                "ended it (the out-of-memory killer picks the largest process): run again")
        what = "; ".join(
            f"pid {pid} {_how(codes.get(pid))}"
            + (f" while {name(held[pid])}" if pid in held else "") for pid in suspects) or \
            "a worker process ended"
        return WorkerDied(
            f"a worker process died ({what}), so this build cannot be completed; nothing was "
            f"written. A SIGKILL is most often the out-of-memory killer (see dmesg): run again "
            f"with fewer --workers")
