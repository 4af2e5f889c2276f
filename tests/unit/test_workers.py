"""loaders.workers.Workers: a worker that dies fails the wait within a poll, naming it - CPython's
pool replaces a dead worker and waits forever for the task it held (a suite run hung 600 s in
prepare's tokenizing map, 2026-11-27)."""
import os
import signal
import time

import pytest

from loaders.workers import WorkerDied, Workers


def _square_or_die(x: int) -> int:
    if x == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    if x == 7:
        os._exit(3)
    return x * x


def _square(x: int) -> int:
    return x * x


@pytest.mark.parametrize("kind", ["map", "imap"])
def test_a_killed_worker_fails_the_wait_instead_of_hanging(kind):
    started = time.monotonic()
    with pytest.raises(WorkerDied, match=r"pid \d+\) running _square_or_die ended \((killed by "
                                         r"signal 9 \(SIGKILL\)|exit status 3)\)") as got:
        with Workers(2) as pool:
            if kind == "map":
                pool.map(_square_or_die, list(range(10)))
            else:
                list(pool.imap(_square_or_die, list(range(10))))
    assert "out-of-memory killer" in str(got.value) and "fewer --workers" in str(got.value)
    assert time.monotonic() - started < 30


def test_the_watch_leaves_a_healthy_pool_alone():
    with Workers(2) as pool:
        assert pool.map(_square, list(range(50))) == [x * x for x in range(50)]
        assert list(pool.imap(_square, [3, 4])) == [9, 16]
