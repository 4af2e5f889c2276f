"""Per-step timeline of compute and communication (opt-in, ``train.timeline = true``) and its
picture: ``python -m runtime.observe.timeline METRICS.jsonl --out timeline.png [--step N]``.

Owns: recording one optimizer step - the compute spans the trainer marks (forward, backward,
sync = launching what is left and waiting for the allreduces, with local_before's norm and
clip; optimizer) and each bucket's ready, launch and completion time as the gradient buckets
report them - the figures derived from them, and the drawing. Never: changes what a step
does, or waits for the device inside a step. Cost: a few marks per span and per bucket
(``runtime.observe.clock``): on CPU host times, completion stamped by a callback on the allreduce's
future (gloo runs it when the data has arrived); on CUDA events on the compute stream, and
for completion one on a side stream that waits for the collective (NCCL completes its future
at enqueue, so a callback there would stamp the launch) - read at the logging point.

Times in the metrics file are seconds since the step started. Derived figures, per step:
  comm_s          time during which at least one of the step's allreduces was in flight: the
                  length of the union of the intervals [launch_k, done_k].
  exposed_comm_s  max(0, done of the last allreduce − end of the last backward): how long the
                  step waited for the network once its compute had finished. This is the
                  critical-path estimate of "step time − step time without communication"
                  (docs/REFERENCES.md §6's end_K − ready_K, with ready_K = backward end); for
                  local_before it includes the local norm and clip, which sit on that path
                  too. It does not see compute the communication thread takes from backward;
                  bench.overlap therefore also measures the step time without communication.
  overlap_frac    1 − exposed_comm_s / comm_s: the share of communication hidden by backward.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from runtime.observe.clock import DeviceClock, Later

SPANS = ("forward", "backward", "sync", "optimizer")


class StepTimeline:
    """Marks of the current step; ``summary()`` turns them into metrics.jsonl fields.

    ``device``: where the step's work runs. On CPU marks are host times; on CUDA they are
    CUDA events (``runtime.observe.clock``): when the *work* reached each point, read at the next
    logging point, not in the step - so ``summary()`` there returns a `Deferred` that
    runtime.observe.step_log resolves. ``clock``: a host clock to use instead (tests)."""

    def __init__(self, device: Any = "cpu", clock: Optional[Callable[[], float]] = None):
        self._device_clock = DeviceClock(device)
        self.clock: Callable[[], Any] = clock or self._device_clock.now
        self.start_step()

    @property
    def device_clock(self) -> DeviceClock:
        """The clock of the step's device that the marks are taken on: another mark taken
        with it (runtime.calibrate.tune's gradient-ready stamps) compares with the spans."""
        return self._device_clock

    def now(self) -> Any:
        return self.clock()

    def start_step(self, t0: Any = None) -> None:
        self.t0 = self.clock() if t0 is None else t0
        self.spans: dict[str, list[tuple[Any, Any]]] = {name: [] for name in SPANS}
        self.start_buckets([])

    @contextlib.contextmanager
    def span(self, name: str):
        start = self.clock()
        try:
            yield
        finally:
            self.spans[name].append((start, self.clock()))

    # ---- buckets (called by runtime.grad_sync) ---------------------------------------------
    def start_buckets(self, nbytes: list[int]) -> None:
        n = len(nbytes)
        self.bytes = list(nbytes)
        self.ready: list[Any] = [None] * n
        self.launch: list[Any] = [None] * n
        self.done: list[Any] = [None] * n

    def bucket_ready(self, k: int, t: Any = None) -> None:
        self.ready[k] = self.clock() if t is None else t

    def bucket_launched(self, k: int, t: Any = None, work: Any = None) -> None:
        """Bucket k's allreduce was launched (at ``t``); with ``work`` (its async work), its
        completion is stamped when it happens (``runtime.observe.clock.DeviceClock.after``)."""
        self.launch[k] = self.clock() if t is None else t
        if work is not None:
            self.done[k] = self._device_clock.after(work)

    def bucket_done(self, k: int, t: Any = None) -> None:
        self.done[k] = self.clock() if t is None else t

    def waited(self, k: int) -> None:
        """The caller's ``work.wait()`` for bucket k returned: on CPU, stamp the completion
        now if the communication thread's callback has not run yet."""
        if self._device_clock.cuda and self.clock == self._device_clock.now:
            return  # the side-stream event is the completion
        mark = self.done[k]
        if mark is None or (isinstance(mark, Later) and mark.t is None):
            self.done[k] = self.clock()

    # ---- derived ------------------------------------------------------------------------
    def summary(self, end: Any = None) -> dict:
        """The step's figures (module docstring): now on CPU; on CUDA ``{"timeline":
        Deferred}``, resolved when the step is logged."""
        end = self.clock() if end is None else end
        frozen = _Frozen(self.t0, self.spans, self.bytes, self.ready, self.launch, self.done,
                         end, self._device_clock)
        if self._device_clock.cuda and self.clock == self._device_clock.now:
            return {DEFERRED: Deferred(frozen.figures)}
        return frozen.figures()


DEFERRED = "timeline_deferred"
"""The metrics key under which a CUDA step leaves its `Deferred` timeline."""


class Deferred:
    """Figures read later (``resolve()``: a dict to merge into the step's metrics)."""

    def __init__(self, fn: Callable[[], dict]):
        self.resolve = fn


class _Frozen:
    """One step's marks, turned into seconds since the step started when asked."""

    def __init__(self, t0, spans, nbytes, ready, launch, done, end, clock: DeviceClock):
        self.t0, self.spans, self.bytes, self.end, self.clock = t0, spans, nbytes, end, clock
        self.ready, self.launch, self.done = ready, launch, done

    def _at(self, mark) -> Optional[float]:
        return None if mark is None else self.clock.seconds(self.t0, mark)

    def figures(self) -> dict:
        rel = (lambda t: None if t is None else round(t, 6))
        spans = {name: [(self._at(a), self._at(b)) for a, b in v]
                 for name, v in self.spans.items()}
        ready = [self._at(t) for t in self.ready]
        launch = [self._at(t) for t in self.launch]
        done = [self._at(t) for t in self.done]
        backward_end = max((e for _, e in spans["backward"] if e is not None), default=None)
        flights = [(a, b) for a, b in zip(launch, done) if a is not None and b is not None]
        comm = union_length(flights)
        exposed = 0.0
        if flights and backward_end is not None:
            exposed = max(0.0, max(b for _, b in flights) - backward_end)
        overlap = min(1.0, max(0.0, 1.0 - exposed / comm)) if comm > 0 else 0.0
        return {
            "comm_s": comm, "exposed_comm_s": exposed, "overlap_frac": overlap,
            "timeline": {
                "step_s": rel(self._at(self.end)),
                "spans": {name: [[rel(a), rel(b)] for a, b in v] for name, v in spans.items()},
                "buckets": {"bytes": self.bytes, "ready": [rel(t) for t in ready],
                            "launch": [rel(t) for t in launch],
                            "done": [rel(t) for t in done]},
            },
        }


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals (overlaps counted once)."""
    total, reach = 0.0, None
    for a, b in sorted(intervals):
        if reach is None or a > reach:
            total += b - a
            reach = b
        elif b > reach:
            total += b - reach
            reach = b
    return total


# ---------------------------------------------------------------------------------------------
# the picture


def read_timelines(metrics_path: str | Path) -> list[dict]:
    """The step records of a metrics.jsonl file that carry a timeline."""
    out = []
    for line in Path(metrics_path).read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "step" and isinstance(rec.get("timeline"), dict):
            out.append(rec)
    return out


def plot_timeline(metrics_path: str | Path, png_path: str | Path,
                  step: Optional[int] = None) -> Path:
    """Draw one step (``step``, or the last one recorded): a compute lane and one lane per
    bucket (ready tick, allreduce bar from launch to completion)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_timelines(metrics_path)
    if not recs:
        raise ValueError(f"{metrics_path}: no step carries a timeline; train with "
                         f"train.timeline=true")
    rec = recs[-1] if step is None else next((r for r in recs if r["step"] == step), None)
    if rec is None:
        raise ValueError(f"{metrics_path}: step {step} has no timeline; steps with one: "
                         f"{recs[0]['step']}..{recs[-1]['step']}")
    tl, ms = rec["timeline"], 1e3
    b = tl["buckets"]
    k = len(b["bytes"])
    fig, ax = plt.subplots(figsize=(10, 1.6 + 0.28 * (k + 1)))
    colors = {"forward": "tab:blue", "backward": "tab:orange", "sync": "tab:gray",
              "optimizer": "tab:green"}
    for name, spans in tl["spans"].items():
        for i, (a, e) in enumerate(spans):
            ax.barh(k, (e - a) * ms, left=a * ms, height=0.7, color=colors.get(name, "k"),
                    label=name if i == 0 else None)
    for i in range(k):
        y = k - 1 - i
        if b["launch"][i] is not None and b["done"][i] is not None:
            ax.barh(y, (b["done"][i] - b["launch"][i]) * ms, left=b["launch"][i] * ms,
                    height=0.6, color="tab:purple", alpha=0.7,
                    label="allreduce (launch→done)" if i == 0 else None)
        if b["ready"][i] is not None:
            ax.plot([b["ready"][i] * ms] * 2, [y - 0.4, y + 0.4], color="k", lw=1.2,
                    label="bucket ready" if i == 0 else None)
    ax.set_yticks(list(range(k + 1)))
    ax.set_yticklabels([f"b{i} {b['bytes'][i] / 2 ** 20:.1f} MB" for i in reversed(range(k))]
                       + ["compute"], fontsize=7)
    ax.set_xlabel("ms since step start")
    ax.set_title(f"step {rec['step']}: {tl['step_s'] * ms:.0f} ms, communication "
                 f"{rec.get('comm_s', 0) * ms:.0f} ms, exposed {rec.get('exposed_comm_s', 0) * ms:.0f}"
                 f" ms, overlap {rec.get('overlap_frac', 0):.0%}", fontsize=9)
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runtime.observe.timeline",
                                 description="Draw a step's compute and communication lanes "
                                             "from a metrics.jsonl written with train.timeline=true.")
    ap.add_argument("metrics", help="metrics.jsonl of a run")
    ap.add_argument("--out", default="timeline.png", help="PNG to write")
    ap.add_argument("--step", type=int, default=None, help="step to draw (default: the last)")
    args = ap.parse_args(argv)
    try:
        png = plot_timeline(args.metrics, args.out, args.step)
    except (ValueError, OSError) as e:
        print(f"runtime.observe.timeline: {e}", file=sys.stderr)
        return 2
    print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
