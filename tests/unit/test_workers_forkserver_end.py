"""How a build names a dead forkserver (loaders.workers._forkserver_end), read from /proc: a
forkserver still in its exit - its files (the workers' status pipes) already closed, so the
workers read as "exit status 255", but not yet a zombie - is waited for and named with its
signal, not taken for alive (which made the error blame the workers: a flaky suite, 2026-12-06)."""
from __future__ import annotations

import io
import signal
from multiprocessing import forkserver

import pytest

from loaders import workers


def stat(state: str, flags: int = 0, status: int = 0) -> str:
    fields = [state, "1", "1", "1", "0", "-1", str(flags)] + ["0"] * 42 + [str(status)]
    return "4242 (python3) " + " ".join(fields) + "\n"


@pytest.fixture
def proc(monkeypatch):
    seen = []
    monkeypatch.setattr(forkserver._forkserver, "_forkserver_pid", 4242, raising=False)

    def read(lines):
        it = iter(lines)

        def fake_open(path, *a, **k):
            assert path == "/proc/4242/stat"
            seen.append(path)
            return io.StringIO(next(it))
        monkeypatch.setattr(workers, "open", fake_open, raising=False)
        monkeypatch.setattr(workers.time, "sleep", lambda s: None)
        return seen
    return read


def test_a_forkserver_in_its_exit_is_waited_for_and_named_with_its_signal(proc):
    seen = proc([stat("R", workers.PF_EXITING), stat("D", workers.PF_EXITING),
                 stat("Z", workers.PF_EXITING, signal.SIGKILL)])
    assert workers._forkserver_end() == (4242, "killed by signal 9 (SIGKILL)")
    assert len(seen) == 3


def test_a_running_forkserver_is_alive_and_a_zombie_says_how_it_ended(proc):
    proc([stat("S")])
    assert workers._forkserver_end() is None
    proc([stat("Z", status=3 << 8)])
    assert workers._forkserver_end() == (4242, "ended with exit status 3")


def test_an_exit_that_never_ends_is_said_as_ended_after_the_wait(proc, monkeypatch):
    proc([stat("D", workers.PF_EXITING)] * 1000)
    clock = iter(range(1000))
    monkeypatch.setattr(workers.time, "monotonic", lambda: next(clock))
    assert workers._forkserver_end(wait_s=3) == (4242, "ended")
