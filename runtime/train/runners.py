"""How a training step runs: one runner per ``train.cuda_graphs`` mode (its row:
runtime.choices.GRAPH_MODES), each owning what its mode needs - the stream the run works on,
the CUDA graphs, the learning-rate table and the device's step counter.

The trainer (runtime.train.trainer ``Trainer.train_step``) asks its runner for one step's
device values and never which mode it is in; the runner runs the step body
(runtime.train.step ``StepBody.run``: forward and backward over the micro-batches, the
gradient sync, the optimizer) on the micro-batches, with the forward its mode gives:

  ``Eager``      the body on the batches, moved to the device through pinned memory, the
                 learning rate set from the host's schedule;
  ``Encoder``    the same, each micro-batch's forward and backward replayed from the encoder
                 graphs (runtime.train.graphs.EncoderGraphs, which take the host batch);
  ``Full``       the whole body replayed from one graph (runtime.train.graphs.FullStepGraph)
                 on the static buffers, the learning rate read inside it from a device table
                 by a device step counter.

Set-up order, as code: ``building()`` around the parts' construction (a captured mode's own
stream is set first: autograd's nodes are made on it, and a graph cannot be captured on the
default stream), then ``attach(Drive(...))`` with the step the run starts at - known only after
a checkpoint is restored, so a resumed run captures anew. ``attach`` refuses to run before
``building()`` or twice; ``step`` before ``attach``.

A new mode: its row in runtime.choices.GRAPH_MODES and one class here, registered in
``RUNNERS`` under the row's name (docs/EXTENDING.md).

Owns: the run's stream under graphs, the graphs, the learning-rate table and step counter,
moving a step's batches to the device, and applying its row's ``captures`` - to the body's
autocast cache and the balance meter's hooks - in one place (``_apply_row``).
Never: decides what a step computes (the body does), holds the trainer, reads the config or
the environment (``Drive`` carries what a mode needs), or runs a graph off CUDA (the
simulated device of runtime.observe.hostsync stands in: ``simulated``, its eager warm-up).
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from runtime.choices import GRAPH_MODES, ConfigError
from runtime.train.graphs import EncoderGraphs, FullStepGraph
from runtime.train.step import StepBody

LR_TABLE_MAX = 1 << 22
"""Steps whose learning rate a full-graph run keeps on the device (32 MiB of float64)."""


@dataclass
class Drive:
    """What a runner drives and what its mode reads: the step ``body``, the balance ``meter``
    (runtime.observe.balance_meter: its hooks off and explicit spans under graphs), the
    learning-rate ``schedule`` (step -> lr) and ``max_steps`` (a full-graph run keeps every
    step's rate on the device), the step the run starts at (``start_step``: after a resume,
    the restored one)."""

    body: StepBody
    meter: Any
    schedule: Callable[[int], float]
    max_steps: int
    start_step: int


class Runner:
    """The eager step and what every runner shares (``Eager`` is this class)."""

    def __init__(self, mode: str, device: torch.device, simulated: bool = False):
        self.mode, self.row = mode, GRAPH_MODES[mode]
        self.device, self.simulated = torch.device(device), simulated
        self.drive: Optional[Drive] = None
        self._stream_before = None
        self._built = False

    @property
    def captures(self) -> bool:
        return self.row.captures

    @contextlib.contextmanager
    def building(self):
        """Around the construction of the parts this runner will step: a captured mode is
        refused off CUDA (a config error, exit 2, before anything is built), on CUDA the run's
        own stream is set first."""
        if self._built or self.drive is not None:
            raise RuntimeError(f"runner '{self.mode}': building() once, before attach()")
        self._begin()
        yield self
        self._built = True

    def _begin(self) -> None:
        if not self.captures or self.simulated:  # (the simulated device: eager warm-ups)
            return
        if self.device.type != "cuda":
            raise ConfigError(f"train.cuda_graphs='{self.mode}' needs a CUDA device; this rank "
                              f"runs on {self.device} - set train.cuda_graphs='none'")
        self._stream_before = torch.cuda.current_stream(self.device)
        torch.cuda.set_stream(torch.cuda.Stream(self.device))

    def attach(self, drive: Drive) -> "Runner":
        """After the parts are built (``building``) and restored: ``drive.start_step`` is the
        restored step."""
        if not self._built or self.drive is not None:
            raise RuntimeError(f"runner '{self.mode}': attach() once, after building()")
        self.drive = drive
        self._apply_row()
        return self

    def _apply_row(self) -> None:
        """This mode's ``captures``, read once: the body's autocast cache off and the meter's
        hooks off (spans marked by the runner instead) under graphs."""
        self.drive.body.captured = self.captures
        self.drive.meter.hooked = not self.captures

    def step(self, it, lr: float, seen: list) -> dict:
        """One optimizer step on the next micro-batches of ``it`` (each host batch also
        appended to ``seen``); the body's device values."""
        body = self.drive.body
        body.set_lr(lr)
        return body.run(self._batches(it, seen))

    def _batches(self, it, seen: list):
        for _ in range(self.drive.body.accum):
            batch = next(it)
            seen.append(batch)
            yield self.to_device(batch)

    def to_device(self, batch):
        """The batch on the device, copied without making the host wait. From pageable
        memory a CUDA copy synchronises the stream first (non_blocking or not), so on CUDA
        the batch goes through pinned memory (the caching host allocator keeps each block
        until its copy is done). With no other host sync in the step, the host collates the
        next batch while the GPU still runs this one."""
        if self.device.type == "cuda":
            batch = batch.pin_memory()
        return batch.to(self.device, non_blocking=True)

    def close(self) -> None:
        """The graphs go (their memory pools with them); the stream ends with the run."""
        if self._stream_before is not None:
            torch.cuda.current_stream(self.device).synchronize()
            torch.cuda.set_stream(self._stream_before)
            self._stream_before = None


Eager = Runner


class Encoder(Runner):
    """Each micro-batch's forward and backward from the encoder graphs; the host batch goes
    to the graphs' static buffers (runtime.train.graphs.StaticInputs) instead of a device
    copy of its own."""

    graphs: Optional[EncoderGraphs] = None

    def attach(self, drive: Drive) -> "Runner":
        super().attach(drive)
        body = drive.body
        self.graphs = EncoderGraphs(body.net, self.device, body.autocast,
                                    pause=drive.meter.paused, micro_batches=body.accum)
        return self

    def step(self, it, lr: float, seen: list) -> dict:
        body = self.drive.body
        body.set_lr(lr)
        return body.run(self._host_batches(it, seen), self._forward)

    def _host_batches(self, it, seen: list):
        for _ in range(self.drive.body.accum):
            seen.append(next(it))
            yield seen[-1]

    def _forward(self, batch):
        with self.drive.meter.span():
            return self.graphs.forward(batch)

    def close(self) -> None:
        if self.graphs is not None:
            self.graphs.close()
            self.graphs = None
        super().close()


class Full(Runner):
    """The whole step from one graph, the learning rate of every step in a device table the
    graph indexes with its own step counter (the schedule is a pure function of the step:
    its values are the host's exact floats)."""

    graph: Optional[FullStepGraph] = None
    lr_table: Optional[torch.Tensor] = None
    device_step: Optional[torch.Tensor] = None

    def attach(self, drive: Drive) -> "Runner":
        steps = drive.max_steps + 1
        if steps > LR_TABLE_MAX:
            raise ConfigError(f"train.cuda_graphs='full' keeps the learning rate of every step "
                              f"on the device: train.max_steps={steps - 1} exceeds "
                              f"{LR_TABLE_MAX - 1}; lower it or use train.cuda_graphs='encoder'")
        super().attach(drive)
        self.lr_table = torch.tensor([drive.schedule(t) for t in range(steps)],
                                     dtype=torch.float64).to(self.device)
        self.device_step = torch.zeros((), dtype=torch.int64, device=self.device)
        self.device_step.fill_(drive.start_step)
        self.graph = FullStepGraph(self.captured_step, self.device, pause=drive.meter.paused)
        return self

    def step(self, it, lr: float, seen: list) -> dict:
        seen += [next(it) for _ in range(self.drive.body.accum)]
        with self.drive.meter.span():
            return self.graph.step(seen)

    def captured_step(self, slots) -> dict:
        """What the graph captures: the learning rate from the table, then the step body
        (``drive.body``, runtime.train.step) on the graph's static batches."""
        at = self.device_step.clamp(max=self.lr_table.shape[0] - 1).reshape(1)
        self.drive.body.set_lr(self.lr_table.index_select(0, at).reshape(()))
        self.device_step.add_(1)
        return self.drive.body.run(slots)

    def close(self) -> None:
        if self.graph is not None:
            self.graph.close()
            self.graph = None
        super().close()


RUNNERS: dict[str, Callable[..., Runner]] = {"none": Eager, "encoder": Encoder, "full": Full}
"""Each GRAPH_MODES row's runner, by the row's name."""


def runner_for(mode: str, device: torch.device, simulated: bool = False) -> Runner:
    """The runner of ``train.cuda_graphs = mode`` (next: ``building()``, then ``attach``)."""
    return RUNNERS[mode](mode, device, simulated)


@contextlib.contextmanager
def swapped(own: Runner, mode: str, start_step: int):
    """A runner of ``mode`` driving what ``own`` drives, on the same parts and stream, from
    ``start_step`` (for benchmarks that compare modes on one trainer: bench.gpu's graphs
    stage, through ``Trainer.running_as``); ``own``'s row applied again after it."""
    other = RUNNERS[mode](mode, own.device, own.simulated)
    other._built = True   # the parts were built under ``own`` (its stream stays the run's)
    other.attach(dataclasses.replace(own.drive, start_step=start_step))
    try:
        yield other
    finally:
        other.close()  # its graphs (it never set a stream: the run's stays)
        own._apply_row()
