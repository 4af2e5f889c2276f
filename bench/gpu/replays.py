"""What the device and the host did between a whole-step CUDA graph's replays, for the graphs
stages of ``python -m bench.gpu``: device idle while the host was still launching (a launch
gap) told from the host blocked on the device (a host wait).

How it is measured (``ReplayClock``, around the timed steps of a full-graph case):

  * a CUDA event S_i just before and E_i just after each replay, on the replaying stream
    (``torch.cuda.Event(enable_timing=True)``, recorded by a stand-in for the graph whose
    ``replay`` records them around the real one), and the host's clock (``perf_counter``)
    just before each replay call, c_i;
  * one anchor: the device synchronised, the host's clock read (h_A) and an event A recorded
    at once - the device is idle, so A runs within a launch's latency (a few µs) of h_A. An
    event's device time is then on the host's clock: s_i = h_A + A.elapsed_time(S_i), and
    e_i likewise.

What ``replay_gaps`` computes from them (the pure arithmetic, tested on given timestamps):

  * ``replay_s``: a replay's device time, mean of e_i - s_i (its kernels and the bubbles
    between them; the profiler's kernel sum of a step is ``busy_s`` beside it);
  * ``gap_mean_s`` / ``gap_max_s``: the device time between one replay's end and the next
    one's start, s_{i+1} - e_i - the device's work between replays (the next batch's copy
    into the static inputs, the copy-out of the step's values) and its idle time;
  * ``launch_gap_s``: the part of each gap before the host called the next replay,
    clamp(c_{i+1} - e_i, 0, gap): the device had finished and waited for the host to launch
    (mean per gap; ``host_behind`` counts the gaps that had one). A host that keeps ahead of
    the device leaves none: its next replay is queued before the current one ends;
  * ``device_step_s``: s_{i+1} - s_i, the step on the device's clock (beside the step's wall
    time between two synchronisations, ``step_s``).

Host waits - the host blocked until the device reached a point - are the CUDA runtime's
blocking calls: ``host_waits`` sums the host time of those calls (``BLOCKING``: the
synchronisations, a copy that waits for the device, a pinned allocation, a graph launch
whose queue is full) in the profiled steps, per step, from torch.profiler's runtime events.
A step whose time is the host's has launch gaps and no waits; one whose host waits for the
device has waits and (after each wait, while the host launches again) short launch gaps.

On a CPU (``--smoke``) there are neither events nor graphs: the fields are None.

Owns: the replay events, the anchor, the gap arithmetic, the blocking calls' names.
Never: replays, captures or changes a graph (the runner does; the stand-in only records
around its ``replay``), or times a step (graphs.py).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Optional, Sequence

BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
            "cudaMemcpy", "cudaMemcpyAsync", "cudaHostAlloc", "cudaFreeHost", "cudaFree",
            "cudaGraphLaunch")
"""The CUDA runtime calls the host can be blocked in: the three synchronisations, the copies
(a device-to-host copy, or one from pageable memory, waits for the stream), a pinned host
allocation and cudaFree (both synchronise the device), a graph launch (blocks when the launch
queue is full). Their host time in a profiled step is the step's host waits; a call that did
not block adds its few µs."""


def replay_gaps(starts_ms: Sequence[float], ends_ms: Sequence[float],
                calls_s: Optional[Sequence[float]] = None,
                anchor_s: Optional[float] = None) -> dict:
    """The gaps between consecutive replays (the module docstring). ``starts_ms`` and
    ``ends_ms``: each replay's device start and end in ms after the anchor event;
    ``calls_s``: the host clock (s) at each replay call and ``anchor_s`` at the anchor (both
    or neither: without them no launch gap is told). Times out are seconds."""
    n = len(starts_ms)
    if n != len(ends_ms) or n < 2:
        raise ValueError(f"replay_gaps needs the start and end of at least 2 replays, got "
                         f"{n} starts and {len(ends_ms)} ends")
    if (calls_s is None) != (anchor_s is None) or (calls_s is not None and len(calls_s) != n):
        raise ValueError("replay_gaps: give a host time for every replay call and the "
                         "anchor's, or neither")
    s = [t / 1e3 for t in starts_ms]
    e = [t / 1e3 for t in ends_ms]
    if any(b < a for a, b in zip(s, e)) or any(s[i + 1] < e[i] for i in range(n - 1)):
        raise ValueError("replay_gaps: a replay ends before it starts, or starts before the "
                         "one before it ends (one stream runs them in order)")
    gaps = [s[i + 1] - e[i] for i in range(n - 1)]
    out: dict[str, Any] = {
        "replays": n,
        "replay_s": statistics.fmean(b - a for a, b in zip(s, e)),
        "device_step_s": (s[-1] - s[0]) / (n - 1),
        "gap_mean_s": statistics.fmean(gaps), "gap_max_s": max(gaps),
        "launch_gap_s": None, "host_behind": None}
    if calls_s is not None:
        calls = [c - anchor_s for c in calls_s]  # on the anchor's clock, as s and e
        launch = [min(max(calls[i + 1] - e[i], 0.0), gaps[i]) for i in range(n - 1)]
        out["launch_gap_s"] = statistics.fmean(launch)
        out["host_behind"] = sum(1 for x in launch if x > 0)
    return out


def host_waits(prof: Any, steps: int) -> dict:
    """{"host_wait_s": host seconds a step in the runtime's blocking calls, "calls": {name:
    µs a step}} of a finished torch.profiler profile over ``steps`` steps (CUDA activity:
    the runtime's calls are its events on the CPU side); both None where the profile holds
    no CUDA runtime call at all (a CPU, or a profiler that did not record them: no figure
    rather than a wrong 0)."""
    per: dict[str, float] = {}
    seen = False
    for ev in prof.events():
        seen = seen or ev.name.startswith("cuda")
        if ev.name in BLOCKING:
            per[ev.name] = per.get(ev.name, 0.0) + ev.cpu_time_total
    if not seen:
        return {"host_wait_s": None, "calls": None}
    calls = {k: round(v / steps, 1) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}
    return {"host_wait_s": sum(per.values()) / steps / 1e6, "calls": calls}


class _Timed:
    """The captured graph, its ``replay`` between two recorded events (what FullStepGraph
    calls; any other attribute is the graph's)."""

    def __init__(self, graph, clock: "ReplayClock"):
        self._graph, self._clock = graph, clock

    def replay(self) -> None:
        import torch
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        self._clock.calls.append(time.perf_counter())
        start.record()
        self._graph.replay()
        end.record()
        self._clock.events.append((start, end))

    def __getattr__(self, name):
        return getattr(self._graph, name)


class ReplayClock:
    """``with ReplayClock(full_step_graph) as clock:`` the replays inside are timed (the
    graph must be captured already: after the warm-up); ``clock.result()`` after the block,
    with the device synchronised: ``replay_gaps`` of them."""

    def __init__(self, step_graph):
        if step_graph is None or not getattr(step_graph, "captured", False):
            raise RuntimeError("ReplayClock: the full-step graph is not captured yet (time "
                               "the replays after the warm-up)")
        self.step_graph = step_graph
        self.calls: list[float] = []
        self.events: list[tuple] = []
        self.anchor = None
        self.anchor_s = 0.0

    def __enter__(self) -> "ReplayClock":
        import torch
        torch.cuda.synchronize()
        self.anchor = torch.cuda.Event(enable_timing=True)
        self.anchor_s = time.perf_counter()
        self.anchor.record()
        self._graph = self.step_graph.graph
        self.step_graph.graph = _Timed(self._graph, self)
        return self

    def __exit__(self, *exc) -> None:
        self.step_graph.graph = self._graph

    def result(self) -> dict:
        import torch
        torch.cuda.synchronize()
        if len(self.events) < 2:
            return {"replays": len(self.events)}
        starts = [self.anchor.elapsed_time(s) for s, _ in self.events]
        ends = [self.anchor.elapsed_time(e) for _, e in self.events]
        return replay_gaps(starts, ends, self.calls, self.anchor_s)


NO_EVENTS = {"replays": None, "replay_s": None, "device_step_s": None, "gap_mean_s": None,
             "gap_max_s": None, "launch_gap_s": None, "host_behind": None}
"""The fields where no replay ran (a CPU, an eager mode): the record's shape, no figures."""
