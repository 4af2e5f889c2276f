"""Stop requests: the signals that ask a run to checkpoint and stop, as one flag.

Owns: this process's handlers for SIGTERM, SIGINT, SIGHUP and SIGUSR1 (``install``) - what
``kill``, ``Popen.terminate()``, systemd, a closed terminal, Ctrl-C, a launcher passing a
signal on, Slurm's time limit and its ``--signal=USR1@N`` warning send - and the first one
received (``requested``). A handler only records the signal: the trainer asks at its logging
points, where every rank agrees on a step to checkpoint and stop at (runtime.train.trainer), so a
signal never interrupts a collective, a step or a file write half-way. A repeated signal
changes nothing (one Ctrl-C reaches a rank from the terminal and again from the launcher).
Never: exits, raises, does I/O in a handler, or reads the environment.

The four signals mean the same here; which one arrived is kept for the messages.
"""
from __future__ import annotations

import os
import signal
import socket
import threading
from typing import Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)

_requested: Optional[int] = None
_receiver: Optional[threading.Thread] = None


def _handler(signum, frame) -> None:
    global _requested
    if _requested is None:
        _requested = signum


def install() -> None:
    """Record TERM/INT/HUP/USR1 instead of dying, and keep them from the children this
    process starts from now on (the module docstring). Main thread only (a no-op elsewhere);
    call it before any other thread starts - a thread started earlier keeps its mask and may
    take a signal itself, which its handler then records all the same."""
    global _receiver
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, _handler)
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    if _receiver is None:   # started with the mask blocked, as sigwait needs
        _receiver = threading.Thread(target=_receive, name="presto-stop-signals", daemon=True)
        _receiver.start()


def _receive() -> None:
    while True:
        _handler(signal.sigwait(STOP_SIGNALS), None)


def announce(directory: Optional[str]) -> None:
    """After ``install``: create ``<directory>/<host>.<pid>``, telling whoever waits there that
    this process can take a stop request now. Best effort (a missing or read-only directory:
    the launcher's script stops waiting after a while and passes the request on anyway)."""
    if not directory:
        return
    try:
        path = os.path.join(directory, f"{socket.gethostname()}.{os.getpid()}")
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644))
    except OSError:
        pass


def requested() -> Optional[int]:
    """The first stop signal received (its number), or None."""
    return _requested


def request(signum: int = signal.SIGTERM) -> None:
    """Record a stop request as if ``signum`` had arrived (tests, tools)."""
    _handler(signum, None)


def clear() -> None:
    """Forget a recorded request (tests)."""
    global _requested
    _requested = None


def name(signum: Optional[int]) -> str:
    return signal.Signals(signum).name if signum else "none"
