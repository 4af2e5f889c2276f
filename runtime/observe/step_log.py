"""Step metrics, kept on the device until they are logged.

Owns: what each optimizer step leaves for the logs - its host numbers (step, samples, lr, time,
tokens) and its device numbers (losses, gradient norm, clip coefficient, skipped flag, loss
scale, the sync's report) - from the step until the next logging point, and turning them into
`runtime.events.StepMetrics` there: the losses and each rank's local squared gradient norm
averaged across ranks in one all-reduce of a [steps × 4] tensor, the balance meter's counts in
its own two, every device number read back in one copy; and, with several ranks, the gradient
noise scale from those norms (runtime.observe.noise_scale) in each step's ``extra``. Logging points are every ``train.log_every_steps`` steps, before each evaluation and
at the end of the run; every rank reaches them at the same step, so the collectives match.
Never: runs a collective or reads a device tensor back on an ordinary step, or changes what is
trained. (torchtitan's lesson: reduce losses only when you log them; a ``.item()`` per step is
a stall on a GPU and rules out CUDA-graph capture of the step.)

Step time for TFLOP/s and MFU is the device's: ``mark()`` (runtime.observe.clock) before and
after each step - CUDA events on a GPU, read at the logging point (already a synchronisation),
so a host that enqueues graph replays dozens of steps ahead cannot inflate them; the host's
wall clock on a CPU, whose ops run as they are called. ``step_time_s`` stays the host's time to
run ``train_step`` (on a GPU: to enqueue it); ``device_step_s`` is the device's.

`StepRecord` is what ``Trainer.train_step`` returns: reading one of its metric attributes
resolves this rank's own values (a host read, no collective) - for tests and tools that drive
single steps; the training loop never reads them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Optional, Sequence

import torch

from runtime.launch.dist import all_reduce_sum
from runtime.events import StepMetrics
from runtime.observe.clock import DeviceClock

_DEVICE_FIELDS = ("grad_norm", "clip_coef", "skipped", "loss_scale")


@dataclass
class StepRecord:
    """One optimizer step as recorded, device values unread (see the module docstring)."""

    host: dict[str, Any]                         # step, samples, lr, step_time_s, elapsed_s,
    #                                              marks (the device marks around the step)...
    losses: torch.Tensor                         # [4] this rank's loss, mlm_loss, nsp_loss and
    #                                              ‖g_r‖² (the noise scale's small batch; 0: none)
    device: dict[str, Any]                       # _DEVICE_FIELDS, 0-dim tensors (or numbers)
    raw_extra: dict[str, Any] = field(default_factory=dict)  # numbers or 0-dim tensors
    _local: Optional[StepMetrics] = None

    def local(self) -> StepMetrics:
        """This rank's values as StepMetrics (host read; losses not averaged across ranks)."""
        if self._local is None:
            self._local = _metrics(self, self.losses.tolist(), _read(self.device),
                                   _read(self.raw_extra))
        return self._local

    def __getattr__(self, name: str) -> Any:
        if name in _METRIC_FIELDS:
            return getattr(self.local(), name)
        raise AttributeError(name)


_METRIC_FIELDS = {f.name for f in fields(StepMetrics)}


def _resolve(values: dict) -> dict:
    """``values`` with every deferred entry (an object with ``resolve()``, e.g. a CUDA step's
    timeline, runtime.observe.timeline.Deferred) replaced by the dict it resolves to."""
    out = {}
    for k, v in values.items():
        if callable(getattr(v, "resolve", None)):
            out.update(v.resolve())
        else:
            out[k] = v
    return out


def _read(values: dict) -> dict:
    """Device numbers as Python numbers (one host read per call)."""
    values = _resolve(values)
    keys = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
    out = dict(values)
    if keys:
        flat = torch.stack([values[k].detach().double().reshape(()) for k in keys]).tolist()
        out.update(zip(keys, flat))
    return out


def _metrics(rec: StepRecord, losses: list, device: dict, extra: dict) -> StepMetrics:
    h = rec.host
    return StepMetrics(step=h["step"], samples=h["samples"], loss=losses[0],
                       mlm_loss=losses[1], nsp_loss=losses[2], lr=h["lr"],
                       grad_norm=device["grad_norm"], clip_coef=device["clip_coef"],
                       step_time_s=h["step_time_s"], real_tokens=h["real_tokens"],
                       computed_tokens=h["computed_tokens"], skipped=bool(device["skipped"]),
                       loss_scale=device["loss_scale"], extra=extra,
                       elapsed_s=h.get("elapsed_s"), device_step_s=h.get("device_step_s"))


class StepLog:
    """The steps since the last logging point; `flush` reduces and returns them."""

    def __init__(self, world_size: int, meter: Any = None, noise: Any = None,
                 peak: Any = None, clock: Optional[DeviceClock] = None):
        self.world_size = world_size
        self.clock = clock or DeviceClock("cpu")  # the step marks (see the module docstring)
        self.meter = meter  # a runtime.observe.balance_meter.BalanceMeter, or None
        self.noise = noise  # a runtime.observe.noise_scale.NoiseScale, or None (one rank)
        self.peak = peak    # a runtime.observe.mfu.Peak: each step's TFLOP/s and MFU
        self.pending: list[StepRecord] = []
        self.flags: list[float] = []  # the last flush's flags, summed over ranks
        self.flops_total = 0.0  # Σ over ranks of the model FLOPs of every flushed step ...
        self.seconds_total = 0.0  # ... and Σ of their device times: the run's TFLOP/s, MFU

    @property
    def time_source(self) -> str:
        """What ``device_step_s`` (and so TFLOP/s and MFU) is timed with."""
        return "cuda_events" if self.clock.cuda else "host_wall"

    def mark(self):
        """A mark on the device's timeline (before and after a step: ``host["marks"]``)."""
        return self.clock.now()

    def record(self, rec: StepRecord) -> StepRecord:
        self.pending.append(rec)
        return rec

    def flush(self, flags: Sequence[float] = ()) -> list[StepMetrics]:
        """Every pending step as StepMetrics, losses averaged across ranks and balance
        metrics in ``extra``. A collective: every rank calls it at the same point.

        ``flags``: host numbers summed across ranks in the same all-reduce (extra rows of the
        [steps × 4] loss tensor: no extra collective, no extra read); the sums are in
        ``self.flags`` afterwards (the trainer's stop requests). Nothing pending: nothing is
        reduced and ``self.flags`` is empty."""
        pending, self.pending = self.pending, []
        self.flags = []
        if not pending:
            return []
        rows = torch.stack([r.losses for r in pending]).double()
        width = rows.shape[1]
        if flags:
            padded = list(flags) + [0.0] * (-len(flags) % width)
            rows = torch.cat([rows, torch.tensor(padded, dtype=torch.float64,
                                                 device=rows.device).view(-1, width)])
        reduced = all_reduce_sum(rows).tolist()  # (the device has done every pending step)
        for r in pending:
            marks = r.host.pop("marks", None)
            if marks is not None:
                r.host["device_step_s"] = self.clock.seconds(*marks)
        self.flags = [x for row in reduced[len(pending):] for x in row][:len(flags)]
        losses = [[x / self.world_size for x in row] for row in reduced[:len(pending)]]
        balance = self.meter.reduce() if self.meter is not None else [{}] * len(pending)
        if len(balance) != len(pending):
            raise RuntimeError(f"balance meter closed {len(balance)} steps, the log "
                               f"recorded {len(pending)}")
        keys = [(i, src, k) for i, r in enumerate(pending)
                for src, d in (("device", r.device), ("raw_extra", r.raw_extra))
                for k, v in d.items() if isinstance(v, torch.Tensor)]
        values = torch.stack([getattr(pending[i], src)[k].detach().double().reshape(())
                              for i, src, k in keys]).tolist() if keys else []
        read: list[dict[str, dict]] = [{"device": dict(r.device),
                                        "raw_extra": _resolve(r.raw_extra)} for r in pending]
        for (i, src, k), v in zip(keys, values):
            read[i][src][k] = v
        noise = [self._noise(loss, d["device"]) for loss, d in zip(losses, read)]
        mfu = [self._mfu(r, bal) for r, bal in zip(pending, balance)]
        return [_metrics(r, loss, d["device"], {**d["raw_extra"], **bal, **ns, **f})
                for r, loss, d, bal, ns, f in zip(pending, losses, read, balance, noise, mfu)]

    def _mfu(self, rec: StepRecord, balance: dict) -> dict:
        """This step's achieved TFLOP/s per device and MFU, from every rank's model FLOPs
        and this rank's device time of the step (runtime.observe.mfu); none without a FLOP
        count or a device time."""
        flops, seconds = balance.get("model_flops_all"), rec.host.get("device_step_s")
        if flops is None or self.peak is None or not flops or not seconds:
            return {}
        from runtime.observe.mfu import figures
        self.flops_total += flops
        self.seconds_total += seconds
        return figures(flops, self.world_size, seconds, self.peak)

    def run_figures(self) -> dict:
        """TFLOP/s and MFU over every flushed step (the run's, for summary.json)."""
        if self.peak is None or not self.flops_total:
            return {}
        from runtime.observe.mfu import figures
        return {**figures(self.flops_total, self.world_size, self.seconds_total, self.peak),
                "peak_tflops": self.peak.tflops, "peak_source": self.peak.source,
                "time_source": self.time_source, "device_seconds": self.seconds_total}

    def _noise(self, loss: list, device: dict) -> dict:
        """This step's gradient-noise-scale figures (from the mean over ranks of ‖g_r‖² and
        the averaged gradient's ‖ḡ‖²); with one rank, B_simple is unavailable (None)."""
        big = device.pop("grad_sq_mean", None)
        if self.noise is None or big is None or len(loss) < 4:
            return {"noise_scale": None}
        return self.noise.update(loss[3], big)
