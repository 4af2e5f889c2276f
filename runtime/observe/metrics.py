"""Metrics file, progress line and the loss/accuracy plot: callbacks on runtime events.

Owns: ``metrics.jsonl`` (one JSON object per logged step and per eval, rank 0), the progress
line on stdout, and ``plot.png`` drawn from the metrics file. Never: steers training.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from runtime.events import Event, RunState


def _fmt_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    m, s = divmod(seconds, 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _count(n: float) -> str:
    """A sample count, short: 960, 2.0k, 1.5M."""
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else f"{n:.0f}"


class MetricsWriter:
    """Appends step and eval records to ``<dir>/metrics.jsonl`` on rank 0: a record for every
    step (``every``: every n-th), written when the trainer logs (Event.LOG), each stamped
    with its own time since RUN_START."""

    def __init__(self, path: str | Path, every: int = 1):
        self.path = Path(path)
        self.every = max(1, every)
        self._file = None
        self._failed: LogWriteError | None = None

    def on_event(self, event: Event, state: RunState) -> None:
        if not state.is_main:
            return
        if event is Event.RUN_START:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # A resumed run continues its file (time_s restarts at 0 after the resume record),
            # from its last complete line: a full disk may have left half of one.
            repaired = drop_partial_line(self.path) if state.resume is not None else None
            if repaired:
                print(f"metrics: {repaired}", file=sys.stderr, flush=True)
            self._file = open(self.path, "a" if state.resume is not None else "w")
            self._t0 = time.perf_counter()
            if state.resume is not None:
                self._write({"kind": "resume", "time_s": 0.0, **{
                    k: v for k, v in state.resume.items() if k != "notes"},
                    "notes": [*state.resume.get("notes", []), *([repaired] if repaired
                                                                  else [])]})
        elif event is Event.LOG and self._file:
            for m in state.logged_steps:  # every step since the last LOG, written now
                if m.step % self.every:
                    continue
                t = m.elapsed_s if m.elapsed_s is not None else time.perf_counter() - self._t0
                self._write({"kind": "step", "time_s": t, "step": m.step,
                             "samples": m.samples, "loss": m.loss, "mlm_loss": m.mlm_loss,
                             "nsp_loss": m.nsp_loss, "lr": m.lr, "grad_norm": m.grad_norm,
                             "clip_coef": m.clip_coef, "step_time_s": m.step_time_s,
                             "device_step_s": m.device_step_s,
                             "real_tokens": m.real_tokens, "computed_tokens": m.computed_tokens,
                             # every rank's (the balance meter's), else this rank's tokens'
                             "padding_efficiency": m.real_tokens / max(m.computed_tokens, 1),
                             "skipped": m.skipped, "loss_scale": m.loss_scale, **m.extra})
        elif event is Event.EVAL_STOP and self._file:
            self._write({"kind": "eval", "time_s": time.perf_counter() - self._t0,
                         "step": state.step, "samples": state.samples,
                         "eval_accuracy": state.eval_accuracy})
        elif event is Event.RUN_STOP and self._file:
            self._write({"kind": "run_stop", "time_s": time.perf_counter() - self._t0,
                         "status": state.status, "step": state.step, "samples": state.samples,
                         "eval_accuracy": state.eval_accuracy})
            self._file.close()
            self._file = None

    def _write(self, rec: dict) -> None:
        if self._failed is not None:   # after a failed write nothing more: it would be glued
            raise LogWriteError(*self._failed.args)   # to the half line the disk left
        try:
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()
        except OSError as e:
            self._failed = LogWriteError.of(self.path, e)
            raise LogWriteError(*self._failed.args) from None


class LogWriteError(RuntimeError):
    """A log line that could not be written (a full disk): names the file, its directory and
    the free space; a runtime failure (exit 3) - the checkpoints already written stay. What a
    rerun will do depends on the run (is there a checkpoint to resume?): the trainer adds it
    (``advise``), where it knows."""

    exit_code = 3

    @classmethod
    def of(cls, path, e: OSError) -> "LogWriteError":
        import shutil
        path = Path(path)
        try:
            free = f"{shutil.disk_usage(path.parent).free:,} bytes free there now"
        except OSError:
            free = "free space unknown"
        return cls(f"cannot write {path} ({e.strerror or e}): its disk ({path.parent}) is "
                   f"full or failing, {free}")

    def advise(self, what_to_do: str) -> "LogWriteError":
        """The message, with what to do appended once."""
        if not getattr(self, "advised", False):
            self.args = (f"{self.args[0]} - {what_to_do}",)
            self.advised = True
        return self


RENAMED = {"pad_eff": "padding_efficiency"}
"""Fields of older metrics files under their name now (docs/METRICS.md): until 2026-12 a
step record carried ``pad_eff`` (every rank's Σ real / Σ computed tokens) beside a
``padding_efficiency`` of rank 0's tokens alone; it is one field now, every rank's."""


def read_records(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl file, older ones under today's names (``RENAMED``)."""
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            for old, new in RENAMED.items():
                if old in rec:
                    rec[new] = rec.pop(old)
            out.append(rec)
    return out


def drop_partial_line(path: Path) -> str | None:
    """Cut ``path`` back to its last complete line when a write was cut short (a full disk
    leaves half a line, and an appended record would be glued to it); what was dropped, or
    None when the file ends with a newline (or is missing or empty)."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, 2)
            if size == 0:
                return None
            f.seek(max(0, size - 1))
            if f.read(1) == b"\n":
                return None
            keep, pos = 0, size
            while pos > 0:   # the last newline, read backwards in blocks
                step = min(65536, pos)
                pos -= step
                f.seek(pos)
                block = f.read(step)
                nl = block.rfind(b"\n")
                if nl >= 0:
                    keep = pos + nl + 1
                    break
            f.truncate(keep)
    except FileNotFoundError:
        return None
    # Not the dropped text: in the MLPerf log it would hold ":::MLLOG" and key names, which
    # the checkers find by searching raw lines.
    return (f"dropped a partial last line of {size - keep} bytes from {path} (a write cut "
            f"short, e.g. by a full disk)")


class ProgressPrinter:
    """One progress line at each logging point (Event.LOG, every ``every`` steps) and after
    each eval (rank 0).

    The time-left estimate extrapolates the last two eval accuracies linearly to the target
    when accuracy is rising, else reports the time to the step budget. ``pad-eff`` is Σ real
    / Σ computed tokens over all ranks since the start; ``imbalance tok … cost … fwd …`` the
    mean, over the steps since the previous line, of max/mean over ranks of computed tokens,
    of the length-cost model's batch cost and of forward time (runtime.observe.balance_meter);
    TFLOP/s and MFU are per device over the steps since the previous line, from the device's
    time of those steps (runtime.observe.step_log: CUDA events on a GPU, "(device time)"; the
    wall clock on a CPU, "(wall time)"), MFU only where the device's peak is known
    (runtime.observe.mfu)."""

    def __init__(self, every: int = 10, stream=sys.stdout):
        self.every = max(1, every)
        self.stream = stream
        self.evals: list[tuple[int, float]] = []

    def on_event(self, event: Event, state: RunState) -> None:
        if not state.is_main:
            return
        if event is Event.RUN_START:
            # This process's start: a resumed run's earlier samples are not its throughput.
            self.t0, self.samples0 = time.perf_counter(), state.samples
            self.tokens = [0, 0]
            self.imbalance: list[tuple[float, float]] = []
            self.flops = [0.0, 0.0]  # model FLOPs of every rank, step seconds: since the line
        elif event is Event.LOG:
            for m in state.logged_steps:
                if m.extra.get("model_flops_all") and m.device_step_s:
                    self.flops[0] += m.extra["model_flops_all"]
                    self.flops[1] += m.device_step_s
                # All ranks' tokens when the trainer measured balance, else ours.
                self.tokens[0] += m.extra.get("real_tokens_all", m.real_tokens)
                self.tokens[1] += m.extra.get("computed_tokens_all", m.computed_tokens)
                if "imbalance_tokens" in m.extra:
                    self.imbalance.append((m.extra["imbalance_tokens"],
                                           m.extra.get("imbalance_cost", 1.0),
                                           m.extra["imbalance_compute"]))
            if state.last_step is not None and state.last_step.step % self.every == 0:
                self._print(state)
        elif event is Event.EVAL_STOP:
            self.evals.append((state.samples, state.eval_accuracy))
            self._print(state, eval_line=True)
        elif event is Event.RUN_STOP:
            print(f"run stopped: status={state.status} after {state.step} steps, "
                  f"{state.samples} samples, {time.perf_counter() - self.t0:.1f} s", file=self.stream,
                  flush=True)

    def _print(self, state: RunState, eval_line: bool = False) -> None:
        # samples/s and elapsed: this process's (after a resume, since the resume), as the
        # step records' ``samples_per_s`` (the trainer's) and TensorBoard's throughput.
        elapsed = time.perf_counter() - self.t0
        rate = (state.samples - self.samples0) / elapsed if elapsed > 0 else 0.0
        parts = [f"step {state.step}", f"samples {state.samples}", f"{rate:.1f} samples/s"]
        m = state.last_step
        if m is not None:
            parts += [f"loss {m.loss:.3f} (mlm {m.mlm_loss:.3f} nsp {m.nsp_loss:.3f})",
                      f"lr {m.lr:.2e}", f"|g| {m.grad_norm:.2f}"]
            if "noise_scale" in m.extra:  # B_simple, sequences (McCandlish et al.)
                ns = m.extra["noise_scale"]
                window = m.extra.get("noise_scale_window_samples")
                over = f" (last {_count(window)} samples)" if window else ""
                parts.append("B_noise n/a" + (" (1 rank)" if state.world_size == 1 else over)
                             if ns is None else f"B_noise {ns:.0f}{over}")
            if self.tokens[1]:
                parts.append(f"pad-eff {self.tokens[0] / self.tokens[1]:.3f}")
            if self.flops[1] > 0:  # runtime.observe.mfu, over the steps since the last line
                from runtime.observe.mfu import Peak, figures
                peak = Peak(state.derived.get("peak_tflops"), "")
                f = figures(self.flops[0], state.world_size, self.flops[1], peak)
                timed = {"cuda_events": "device time"}.get(
                    state.derived.get("step_time_source"), "wall time")
                parts.append(f"{f['tflops']:.3g} TFLOP/s" + (
                    f" MFU {f['mfu']:.1%}" if f["mfu"] is not None else "") + f" ({timed})")
                self.flops = [0.0, 0.0]
            if self.imbalance:  # mean of the steps since the last line
                tokens, cost, compute = (sum(x) / len(x) for x in zip(*self.imbalance))
                parts.append(f"imbalance tok {tokens:.3f} cost {cost:.3f} fwd {compute:.2f}")
                self.imbalance = []
        if self.evals:
            parts.append(f"eval acc {self.evals[-1][1]:.4f}")
        parts.append(f"elapsed {_fmt_duration(elapsed)}")
        parts.append(self._time_left(state, rate))
        prefix = "[eval] " if eval_line else ""
        print(prefix + " | ".join(parts), file=self.stream, flush=True)

    def _time_left(self, state: RunState, rate: float) -> str:
        t = state.config.train
        if rate <= 0:
            return "left ?"
        if len(self.evals) >= 2:
            (s0, a0), (s1, a1) = self.evals[-2], self.evals[-1]
            if a1 > a0 and s1 > s0:
                need = (t.target_mlm_accuracy - a1) * (s1 - s0) / (a1 - a0)
                return f"left ~{_fmt_duration(max(need, 0) / rate)} (to target, trend)"
        return f"left <= {_fmt_duration((t.sample_budget() - state.samples) / rate)} (to budget)"


def plot_metrics(metrics_path: str | Path, png_path: str | Path, title: str = "",
                 target: float | None = None) -> Path:
    """Draw loss and eval accuracy against samples from a metrics.jsonl file."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, evals, noise = [], [], []
    window = 0
    for rec in read_records(metrics_path):
        if rec["kind"] == "step":
            steps.append((rec["samples"], rec["loss"]))
            if rec.get("noise_scale") is not None:
                noise.append((rec["samples"], rec["noise_scale"]))
                window = max(window, rec.get("noise_scale_window_samples") or 0)
        elif rec["kind"] == "eval" and rec["eval_accuracy"] is not None:
            evals.append((rec["samples"], rec["eval_accuracy"]))
    if noise:  # a second panel: the gradient noise scale against the same samples
        fig, (ax, ax3) = plt.subplots(2, 1, figsize=(8, 7), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
        ax3.plot(*zip(*noise), color="tab:green", lw=1)
        ax3.set_ylabel("gradient noise scale\nB_simple (sequences)", color="tab:green")
        if window:  # how fresh each point is: the samples its averages span
            ax3.set_title(f"B_simple of the whole gradient, averaged over the last "
                          f"{_count(window)} samples", fontsize=9)
        ax3.set_xlabel("samples")
    else:
        fig, ax = plt.subplots(figsize=(8, 4.5))
    if steps:
        ax.plot(*zip(*steps), color="tab:blue", lw=1, label="training loss")
    ax.set_xlabel("samples")
    ax.set_ylabel("loss", color="tab:blue")
    ax2 = ax.twinx()
    if evals:
        ax2.plot(*zip(*evals), "o-", color="tab:red", label="eval MLM accuracy")
    if target is not None:
        ax2.axhline(target, color="tab:red", ls="--", lw=0.8, label=f"target {target}")
    ax2.set_ylabel("eval masked-LM accuracy", color="tab:red")
    ax.set_title(title or "Presto BERT pre-training")
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
