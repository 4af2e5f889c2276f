"""Time stamps of work on the device, read later: the host clock on CPU, CUDA events on a GPU.

Owns: `DeviceClock`, whose marks say when the *work* reached a point, and `after(work)`, a mark
of when an asynchronous collective finished. On a GPU the host clock times when work was
enqueued, not when it ran, and ProcessGroupNCCL completes a work's future at enqueue (its
``add_done_callback`` runs at once): so there a mark is a CUDA event recorded on the current
stream, and ``after(work)`` records one on a side stream made to wait for the collective
(``work.wait()`` inside that stream blocks neither the host nor the compute stream). On CPU a
mark is ``time.perf_counter()`` and ``after(work)`` is stamped by the future's callback (gloo
runs it on its communication thread when the data has arrived).
Never: waits for the device in a mark (reading marks - `seconds` - waits for the events; do it
at a logging point or after the measured work, not inside a step), or changes what the
measured work does.
"""
from __future__ import annotations

import time
from typing import Any, Optional, Union

import torch


class Later:
    """A host stamp set by a callback (a gloo future's), read with `DeviceClock.seconds`."""

    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t: Optional[float] = None

    def stamp(self, _future: Any = None) -> None:
        if self.t is None:
            self.t = time.perf_counter()


Mark = Union[float, "torch.cuda.Event", Later]


class DeviceClock:
    """Marks on ``device``'s timeline (see the module docstring)."""

    def __init__(self, device: Any = "cpu"):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._side: Optional[torch.cuda.Stream] = None

    def now(self) -> Mark:
        """When the work enqueued so far on the current stream is done (CPU: now)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def after(self, work: Any) -> Mark:
        """When the asynchronous collective ``work`` (``async_op=True``) finishes."""
        if not self.cuda:
            later = Later()
            work.get_future().add_done_callback(later.stamp)
            return later
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
        event = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self._side):
            work.wait()          # the side stream waits for NCCL's; the host does not
            event.record(self._side)
        return event

    def seconds(self, start: Mark, end: Mark) -> Optional[float]:
        """Seconds from ``start`` to ``end``; None if ``end`` never happened (a callback that
        has not run). Waits for CUDA events to complete."""
        a, b = _host(start), _host(end)
        if a is not None and b is not None:
            return b - a
        if isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return None

    def synchronize(self) -> None:
        """Wait for the device (CUDA; nothing on CPU): before a host-timed span ends."""
        if self.cuda:
            torch.cuda.synchronize(self.device)


def _host(mark: Mark) -> Optional[float]:
    if isinstance(mark, (int, float)):
        return float(mark)
    if isinstance(mark, Later):
        return mark.t
    return None
