"""Tasks for the data builders' worker pool (loaders.workers) that the tests hand it: module-
level functions, so a worker started from the forkserver imports them by name."""
import gc
import os
import signal
import struct
import sys
import time
from pathlib import Path

_STATE: dict = {}


def set_state(state: dict) -> None:
    _STATE.clear()
    _STATE.update(state)


def scaled(x: int) -> int:
    return x * _STATE["factor"]


def square(x: int) -> int:
    return x * x


def square_or_die(x: int) -> int:
    if x == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    if x == 7:
        os._exit(3)
    return x * x


def dies(task):
    """Stands in for a builder's task: the OOM killer's way of ending it."""
    os.kill(os.getpid(), signal.SIGKILL)


def collect_garbage(x: int) -> int:
    """Garbage-collector pressure in a worker: what a tokenizing task's allocations cause."""
    junk = [[i] for i in range(100_000)]
    del junk
    gc.collect()
    return x


def note_pid_and_sleep(directory: str) -> int:
    (Path(directory) / str(os.getpid())).write_text("")
    time.sleep(60)
    return os.getpid()


def half_a_result_then(task: tuple) -> None:
    """A worker ended in the middle of sending its result (a large one, when the OOM killer or
    a stop kills it): the pool's result pipe holds half a message and the lock its writers
    share stays taken. ``task``: (``"die"``: then SIGKILLed, ``"hold"``: then waits, or
    ``"sleep"``: only waits, writing nothing; a directory noted in once that is done)."""
    end, directory = task
    if end != "sleep":
        frame = sys._getframe()
        while frame.f_code.co_name != "_process_worker":   # CPython's worker loop: the queue
            frame = frame.f_back
        results = frame.f_locals["result_queue"]
        results._wlock.acquire()
        os.write(results._writer.fileno(), struct.pack("!i", 1 << 20) + b"x" * 100)
    (Path(directory) / f"{end}-{os.getpid()}").write_text("")
    if end == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3600)
