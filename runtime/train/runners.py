"""How a training step runs: one runner per ``train.cuda_graphs`` mode (its row:
runtime.choices.GRAPH_MODES), each owning what its mode needs - the stream the run works on,
the CUDA graphs, the learning-rate table and the device's step counter.

The trainer's step (runtime.train.trainer ``Trainer.train_step``) asks its runner for the
step's device values and never which mode it is in; the runner calls the trainer's step body
(``Trainer.step_body``: forward and backward over the micro-batches, the gradient sync, the
optimizer) with the micro-batches and the forward the mode gives it:

  ``Eager``      the body on the batches, moved to the device through pinned memory, the
                 learning rate set from the host's schedule;
  ``Encoder``    the same, each micro-batch's forward and backward replayed from the encoder
                 graphs (runtime.train.graphs.EncoderGraphs, which take the host batch);
  ``Full``       the whole body replayed from one graph (runtime.train.graphs.FullStepGraph)
                 on the static buffers, the learning rate read inside it from a device table
                 by a device step counter.

A new mode: its row in runtime.choices.GRAPH_MODES and one class here, registered in
``RUNNERS`` under the row's name (docs/EXTENDING.md).

Owns: the run's stream under graphs (``Runner.begin``, before the parts are built: autograd's
nodes are made on it, and a graph cannot be captured on the default stream), the graphs, the
learning-rate table and step counter, moving a step's batches to the device.
Never: decides what a step computes (the trainer's body does), reads the config or the
environment (the trainer hands each runner what it needs), or runs a graph off CUDA (the
simulated device of runtime.observe.hostsync stands in: ``simulated``, its eager warm-up).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from runtime.choices import GRAPH_MODES, ConfigError
from runtime.optim.optimizers import set_lr
from runtime.train.graphs import EncoderGraphs, FullStepGraph

LR_TABLE_MAX = 1 << 22
"""Steps whose learning rate a full-graph run keeps on the device (32 MiB of float64)."""


class Runner:
    """The eager step and what every runner shares (``Eager`` is this class)."""

    def __init__(self, mode: str, device: torch.device, simulated: bool = False):
        self.mode, self.row = mode, GRAPH_MODES[mode]
        self.device, self.simulated = torch.device(device), simulated
        self.trainer: Any = None
        self._stream_before = None

    @property
    def captures(self) -> bool:
        return self.row.captures

    def begin(self) -> None:
        """Before the parts are built: a captured mode refused off CUDA (a config error,
        exit 2, before anything is built), on CUDA the run's own stream set."""
        if not self.captures or self.simulated:  # (the simulated device: eager warm-ups)
            return
        if self.device.type != "cuda":
            raise ConfigError(f"train.cuda_graphs='{self.mode}' needs a CUDA device; this rank "
                              f"runs on {self.device} - set train.cuda_graphs='none'")
        self._stream_before = torch.cuda.current_stream(self.device)
        torch.cuda.set_stream(torch.cuda.Stream(self.device))

    def attach(self, trainer) -> "Runner":
        """After the parts are built and restored (a resumed run captures anew)."""
        self.trainer = trainer
        return self

    def step(self, it, lr: float, seen: list) -> dict:
        """One optimizer step on the next micro-batches of ``it`` (each host batch also
        appended to ``seen``); the body's device values."""
        t = self.trainer
        set_lr(t.optimizer, lr)
        return t.step_body(self._batches(it, seen), t.forward_losses)

    def _batches(self, it, seen: list):
        for _ in range(self.trainer.accum):
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

    def attach(self, trainer) -> "Runner":
        super().attach(trainer)
        trainer.balance_meter.hooked = False  # graphs run no module hooks: spans are explicit
        self.graphs = EncoderGraphs(trainer.net, self.device, trainer.autocast,
                                    pause=trainer.balance_meter.paused,
                                    micro_batches=trainer.accum)
        return self

    def step(self, it, lr: float, seen: list) -> dict:
        t = self.trainer
        set_lr(t.optimizer, lr)
        return t.step_body(self._host_batches(it, seen), self._forward)

    def _host_batches(self, it, seen: list):
        for _ in range(self.trainer.accum):
            seen.append(next(it))
            yield seen[-1]

    def _forward(self, batch):
        with self.trainer.balance_meter.span():
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

    def attach(self, trainer) -> "Runner":
        super().attach(trainer)
        trainer.balance_meter.hooked = False
        steps = trainer.cfg.train.max_steps + 1
        if steps > LR_TABLE_MAX:
            raise ConfigError(f"train.cuda_graphs='full' keeps the learning rate of every step "
                              f"on the device: train.max_steps={steps - 1} exceeds "
                              f"{LR_TABLE_MAX - 1}; lower it or use train.cuda_graphs='encoder'")
        self.lr_table = torch.tensor([trainer.schedule(t) for t in range(steps)],
                                     dtype=torch.float64).to(self.device)
        self.device_step = torch.zeros((), dtype=torch.int64, device=self.device)
        self.device_step.fill_(trainer.state.step)
        self.graph = FullStepGraph(self.body, self.device, pause=trainer.balance_meter.paused)
        return self

    def step(self, it, lr: float, seen: list) -> dict:
        seen += [next(it) for _ in range(self.trainer.accum)]
        with self.trainer.balance_meter.span():
            return self.graph.step(seen)

    def body(self, slots) -> dict:
        """What the graph captures: the learning rate from the table, then the step."""
        at = self.device_step.clamp(max=self.lr_table.shape[0] - 1).reshape(1)
        set_lr(self.trainer.optimizer, self.lr_table.index_select(0, at).reshape(()))
        self.device_step.add_(1)
        t = self.trainer
        return t.step_body(slots, t.forward_losses)

    def close(self) -> None:
        if self.graph is not None:
            self.graph.close()
            self.graph = None
        super().close()


RUNNERS: dict[str, Callable[..., Runner]] = {"none": Eager, "encoder": Encoder, "full": Full}
"""Each GRAPH_MODES row's runner, by the row's name."""


def runner_for(mode: str, device: torch.device, simulated: bool = False) -> Runner:
    """The runner of ``train.cuda_graphs = mode`` (its stream not yet set: ``begin``)."""
    return RUNNERS[mode](mode, device, simulated)


@contextlib.contextmanager
def swapped(trainer, mode: str):
    """``trainer`` stepping in ``mode`` inside the block, on the same parts and stream (for
    benchmarks that compare modes on one trainer: bench.gpu's graphs stage); its own runner
    back after it."""
    own = trainer.runner
    other = RUNNERS[mode](mode, own.device, own.simulated).attach(trainer)
    trainer.balance_meter.hooked = not other.captures
    trainer.runner = other
    try:
        yield other
    finally:
        other.close()  # its graphs (it never set a stream: the run's stays)
        trainer.runner = own
        trainer.balance_meter.hooked = not own.captures
