"""Tasks for the data builders' worker pool (loaders.workers) that the tests hand it: module-
level functions, so a worker started from the forkserver imports them by name."""
import gc
import os
import signal
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
