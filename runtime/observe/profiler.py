"""The step profiler a user turns on (``train.profile_steps``, as torchtitan's and Megatron's):
torch.profiler over the named steps, a trace per step in the run directory and one line per
step that says where the time went.

Owns: ``StepProfiler`` - for each profiled step on each rank: the device synchronised before
and after it (so its wall time is the step's, not the enqueue's), a Chrome/TensorBoard trace
``<output_dir>/profile/rank<R>_step<N>.pt.trace.json`` (chrome://tracing, ui.perfetto.dev, or
TensorBoard's PyTorch profiler plugin pointed at the folder), and a record appended to
``<output_dir>/profile/rank<R>.jsonl`` and said on the console (rank 0): wall time, device
busy time (the sum of the kernels' durations; on a CPU the ops' own time), kernel count, the
top kernels, and ``host-bound`` when the wall time exceeds ``HOST_BOUND`` x the busy time -
the device waited for the host to launch work (docs/GPU.md, "Profiling a step").
``kernel_table``: a profile's kernels by name (calls, microseconds), also what
``python -m bench.gpu`` reads its busy times from.
Never: profiles a step not named (``around`` is a set lookup then: nothing is imported,
started or synchronised), changes what a step computes, or decides anything from what it
measured.
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

HOST_BOUND = 1.5
"""Wall time over busy time above which a step is called host-bound."""
TOP = 10
"""Kernels listed per step."""


def kernel_table(prof: Any, cuda: bool) -> dict[str, list]:
    """{kernel name (90 characters): [calls, microseconds]} of a finished torch.profiler
    profile: the device's kernels on CUDA, the CPU ops' own (self) time on a CPU."""
    names: dict[str, list] = {}
    for e in prof.events():
        if e.device_type.name != ("CUDA" if cuda else "CPU"):
            continue
        us = e.device_time if cuda else e.self_cpu_time_total
        row = names.setdefault(e.name[:90], [0, 0.0])
        row[0] += 1
        row[1] += us
    return names


class StepProfiler:
    """Profiles the steps in ``steps`` (1-based: the step number a step's record carries) of
    this rank; ``say`` prints a line (rank 0's console)."""

    def __init__(self, steps: Iterable[int], out_dir: str | Path, rank: int,
                 device: torch.device, say: Callable[[str], Any] = print):
        self.steps = frozenset(steps)
        self.dir = Path(out_dir) / "profile"
        self.rank, self.device, self.say = rank, torch.device(device), say
        self.cuda = self.device.type == "cuda"
        self.records: list[dict] = []

    def plan(self, done: int) -> str:
        """What this run will profile, said at its start: the steps after ``done`` (the
        step a resume continues from; 0 for a new run), and those it trained before."""
        todo = sorted(s for s in self.steps if s > done)
        before = sorted(s for s in self.steps if s <= done)
        line = (f"profile: step(s) {', '.join(map(str, todo))} on every rank, traces in "
                f"{self.dir}" if todo else "profile: no step left to profile")
        if before:
            line += (f"; step(s) {', '.join(map(str, before))} came before step {done}, where "
                     f"this run resumes: not profiled")
        return line

    def around(self, step: int):
        """A context for step number ``step``: profiled when named, else nothing."""
        return self._profiled(step) if step in self.steps else contextlib.nullcontext()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def _profiled(self, step: int):
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._sync()  # the steps before are not this one's
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            yield
            self._sync()
            wall = time.perf_counter() - t0
        self._write(step, prof, wall)

    def _write(self, step: int, prof: Any, wall: float) -> Optional[dict]:
        table = kernel_table(prof, self.cuda)
        busy = sum(us for _, us in table.values()) / 1e6
        top = sorted(table.items(), key=lambda kv: -kv[1][1])[:TOP]
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / f"rank{self.rank}_step{step}.pt.trace.json"
        prof.export_chrome_trace(str(trace))
        rec = {"kind": "profile", "rank": self.rank, "step": step, "wall_s": wall,
               "busy_s": busy, "busy_source": "cuda kernels" if self.cuda else "cpu ops",
               "kernels": sum(c for c, _ in table.values()),
               "host_bound": bool(busy > 0 and wall > HOST_BOUND * busy),
               "top": [{"kernel": k, "calls": c, "us": round(us, 1)} for k, (c, us) in top],
               "trace": str(trace)}
        self.records.append(rec)
        with open(self.dir / f"rank{self.rank}.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        what = "kernels" if self.cuda else "CPU ops"
        self.say(f"profile step {step} (rank {self.rank}): wall {wall * 1e3:.1f} ms, busy "
                 f"{busy * 1e3:.1f} ms ({rec['kernels']} {what})"
                 + (" - host-bound: the device waited for the host" if rec["host_bound"]
                    else "") + f"; top: {top[0][0] if top else '-'}; trace {trace}")
        return rec
