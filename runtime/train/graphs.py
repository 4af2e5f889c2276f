"""CUDA graphs of the training step (``train.cuda_graphs``): the whole iteration captured once
and replayed every step (``full``), or each micro-batch's forward and backward (``encoder``).

Why: at the local batches where MLPerf records are set (2-4 sequences per GPU) an eager step
is host-bound - ~2,500 kernel launches at ~10 µs of host time each against ~20 ms of device
work on an H100 - while a replayed graph launches a kernel in ~1 µs. NVIDIA's MLPerf BERT
captures the full iteration at 2-3 packed rows per GPU and only the encoder at larger local
batches (mlcommons/training_results_v3.1, NVIDIA/benchmarks/bert/implementations/pytorch,
``--cuda_graph_mode full_iteration | segmented``); docs/GPU.md has the numbers.

Owns:
  * ``StaticInputs``: the device buffers a graph reads, one static batch
    (``loaders.collate.StaticShape``) per micro-batch. Before each replay a batch's tensors
    go host → pinned → these buffers in one copy (``load``): no host read, no new device
    memory, and a batch whose shapes differ from the capture's is refused (a bug: the
    config requires data.shapes='static');
  * ``FullStepGraph``: runs the trainer's step body (runtime.train.trainer: forward,
    backward with the bucket engine's allreduces and clipping, the fp16 loss-scale update
    with its skip, the fused optimizer, the learning rate from the device's step counter)
    eagerly for ``WARMUP_STEPS`` steps on the static buffers - the bucket re-cut, compiles and
    lazy initialisations happen there -, then captures it once and replays it. The step's
    device outputs are packed into one vector inside the graph and copied out after each
    replay (one kernel), so a step's record is never overwritten by the next replay;
  * ``EncoderGraphs``: ``torch.cuda.make_graphed_callables`` over one micro-batch's forward
    and loss (an autograd function whose forward and backward are graphs); AccumulateGrad,
    the bucket hooks, the sync and the optimizer run eagerly after it - any local batch,
    gradient accumulation, any optimizer backend.
Never: decides what a step computes (the trainer's body does; a graph only records it),
reads the config or the environment, or runs outside CUDA (the trainer refuses the key on
other devices before anything trains; the CPU tests check the captured region on the
simulated device of runtime.observe.hostsync instead).

Rules every captured region keeps (tests/integration/test_graphs_integration.py checks them on
CPU, tests/integration/test_cuda_graphs.py on a GPU): no host read of a device value, no
data-dependent shape, no host tensor and no copy from host memory inside the region, every
state update in place (a graph writes where it wrote at capture: ``DynamicLossScale.update``,
the optimizer's step counts and buffers, the device step counter), the same op sequence and
shapes for every batch, the same capture on every rank (NCCL: a captured collective must be
captured by every rank). Autocast runs with ``cache_enabled=False`` under graphs (its
weight-cast cache would be captured once and never refreshed). The whole run uses one
non-default stream (set by the trainer before the parts are built), so autograd's
AccumulateGrad nodes, the eager warm-up, the capture and every replay share it (PyTorch warns
that a mismatch breaks capture). Compiled layers (model.compile = 'layers',
runtime.model.compile) are compiled in the eager warm-up with static shapes - the config
requires data.shapes='static' here - and their generated kernels captured like any other;
Inductor's own CUDA graphs stay off (one capture: this one).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn

from loaders.collate import Batch, Layout
from runtime.model.bert import run_batch

WARMUP_STEPS = 3
"""Eager steps on the static buffers before the capture: the bucket engine's first-step
re-cut, torch.compile of the fused optimizer and of compiled layers, and cuDNN/cuBLAS plans
happen in them (PyTorch's whole-network example warms up 3 iterations)."""


# ------------------------------------------------------------------------------ static inputs

def batch_tensors(batch: Batch) -> list[torch.Tensor]:
    """The tensors of ``batch`` and its layout, in one fixed order (the graphs' inputs)."""
    out = [getattr(batch, f.name) for f in dataclasses.fields(batch)
           if isinstance(getattr(batch, f.name), torch.Tensor)]
    if batch.layout is not None:
        out += [getattr(batch.layout, f.name) for f in dataclasses.fields(batch.layout)
                if isinstance(getattr(batch.layout, f.name), torch.Tensor)]
    return out


def _with_tensors(batch: Batch, tensors: list[torch.Tensor]) -> Batch:
    """``batch`` with its tensors (and its layout's) replaced, in ``batch_tensors`` order."""
    it = iter(tensors)
    values = {f.name: next(it) if isinstance(getattr(batch, f.name), torch.Tensor)
              else getattr(batch, f.name) for f in dataclasses.fields(batch)}
    if batch.layout is not None:
        lay = batch.layout
        values["layout"] = Layout(**{
            f.name: next(it) if isinstance(getattr(lay, f.name), torch.Tensor)
            else getattr(lay, f.name) for f in dataclasses.fields(lay)})
    return Batch(**values)


def shapes_of(batch: Batch) -> list[tuple]:
    return [(tuple(t.shape), t.dtype) for t in batch_tensors(batch)]


class StaticInputs:
    """Device buffers with the shapes of ``first`` (one static batch per micro-batch); see
    the module docstring. The host fields of each slot (token counts, lengths) are the first
    batch's: the graphs never read them (a static batch's kernels take only the constants
    max_len = width and the tensors)."""

    def __init__(self, first: list[Batch], device: torch.device):
        self.device = torch.device(device)
        self._shapes = [shapes_of(b) for b in first]
        self._dtypes = [[t.dtype for t in batch_tensors(b)] for b in first]
        sizes = [[t.numel() for t in batch_tensors(b)] for b in first]
        self._offsets = [np.concatenate([[0], np.cumsum(s)]).tolist() for s in sizes]
        total = sum(o[-1] for o in self._offsets)
        # One int64 buffer for every tensor of every micro-batch: one host-to-device copy per
        # step. Tensors of another dtype (cu_seqlens is int32) get their own buffer, cast
        # from their int64 slice after the copy (one small kernel each).
        self.flat = torch.zeros(total, dtype=torch.int64, device=self.device)
        self.slots: list[Batch] = []
        self._casts: list[tuple[torch.Tensor, torch.Tensor]] = []
        base = 0
        for b, shapes, offsets in zip(first, self._shapes, self._offsets):
            views = []
            for (shape, dtype), lo, hi in zip(shapes, offsets[:-1], offsets[1:]):
                view = self.flat[base + lo:base + hi].view(shape)
                if dtype != torch.int64:
                    own = torch.zeros(shape, dtype=dtype, device=self.device)
                    self._casts.append((own, view))
                    view = own
                views.append(view)
            base += offsets[-1]
            self.slots.append(_with_tensors(b, views))

    def load(self, batches: list[Batch]) -> None:
        """Copy ``batches`` (host tensors) into the slots, without a host wait."""
        if len(batches) != len(self.slots):
            raise RuntimeError(f"a captured step takes {len(self.slots)} micro-batches, got "
                               f"{len(batches)}")
        parts = []
        for i, b in enumerate(batches):
            if shapes_of(b) != self._shapes[i]:
                raise RuntimeError(
                    "a batch whose shapes differ from the captured step's reached the CUDA "
                    f"graph: {shapes_of(b)} vs {self._shapes[i]} (train.cuda_graphs needs "
                    "data.shapes='static', which makes every batch alike)")
            parts += [t.reshape(-1).to(torch.int64) for t in batch_tensors(b)]
        host = torch.cat(parts)
        if self.device.type == "cuda":
            host = host.pin_memory()  # from pageable memory the copy would wait for the GPU
        self.flat.copy_(host, non_blocking=True)
        for own, view in self._casts:
            own.copy_(view)


# --------------------------------------------------------------------------- output packing

class _Packed:
    """A step's outputs (name -> 0-dim device tensor, or a host number) as one float64 vector
    made inside the captured region, and back: after a replay one copy keeps the step's
    values (the graph overwrites the vector at the next replay)."""

    def __init__(self, values: dict[str, Any]):
        self.names = [k for k, v in values.items() if isinstance(v, torch.Tensor)]
        self.shapes = [tuple(values[k].shape) for k in self.names]
        self.host = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}

    def pack(self, values: dict[str, Any]) -> torch.Tensor:
        return torch.cat([values[k].detach().double().reshape(-1) for k in self.names])

    def unpack(self, vector: torch.Tensor) -> dict[str, Any]:
        out, at = dict(self.host), 0
        for name, shape in zip(self.names, self.shapes):
            n = int(np.prod(shape)) if shape else 1
            out[name] = vector[at:at + n].view(shape)
            at += n
        return out


# ----------------------------------------------------------------------------------- full

class FullStepGraph:
    """The whole step as one CUDA graph (``train.cuda_graphs = 'full'``); see the module
    docstring. ``captured_step(slots) -> {name: tensor or number}`` is what the graph captures:
    the trainer's step on device batches (runtime.train.runners ``Full.captured_step``: the
    learning rate, then the step body); it must leave every piece of state it changes changed
    in place."""

    def __init__(self, captured_step: Callable[[list[Batch]], dict], device: torch.device,
                 warmup_steps: int = WARMUP_STEPS, pause: Optional[Callable] = None):
        self.captured_step, self.device = captured_step, torch.device(device)
        self.warmup_steps = warmup_steps
        self.pause = pause or contextlib.nullcontext  # e.g. the balance meter's hooks
        self.inputs: Optional[StaticInputs] = None
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.steps = 0          # steps run through this object (eager warm-up included)
        self.replays = 0
        self._packed: Optional[_Packed] = None
        self._out: Optional[torch.Tensor] = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def step(self, batches: list[Batch]) -> dict[str, Any]:
        """One training step on ``batches`` (host tensors): eager during warm-up, captured at
        the step after it, replayed from then on. Returns the step's device values."""
        if self.inputs is None:
            self.inputs = StaticInputs(batches, self.device)
        self.inputs.load(batches)
        self.steps += 1
        if self.steps <= self.warmup_steps:
            values = self.captured_step(self.inputs.slots)
            return _Packed(values).unpack(_Packed(values).pack(values))  # a copy of its own
        if self.graph is None:
            self._capture()
        self.graph.replay()
        self.replays += 1
        return self._packed.unpack(self._out.clone())

    def _capture(self) -> None:
        stream = torch.cuda.current_stream(self.device)
        if stream == torch.cuda.default_stream(self.device):
            raise RuntimeError("capture on the default stream: the trainer sets a stream of "
                               "its own for the run before building its parts")
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread's unsafe CUDA calls are refused during the capture
        # (the shard prefetch thread, NCCL's watchdog go on); autograd's worker thread still
        # records into the capturing stream.
        with self.pause(), torch.cuda.graph(graph, stream=stream,
                                            capture_error_mode="thread_local"):
            values = self.captured_step(self.inputs.slots)
            self._packed = _Packed(values)
            self._out = self._packed.pack(values)
        self.graph = graph

    def close(self) -> None:
        self.graph = None  # its memory pool goes with it


# -------------------------------------------------------------------------------- encoder

class _MicroBatchLoss(nn.Module):
    """One micro-batch's forward and losses as a module of tensors only (what
    make_graphed_callables takes): (loss, mlm_loss, nsp_loss)."""

    def __init__(self, net: nn.Module, template: Batch):
        super().__init__()
        self.net = net
        self.template = template  # host fields and field order of the static batch

    def forward(self, *tensors: torch.Tensor):
        out = run_batch(self.net, _with_tensors(self.template, list(tensors)))
        return out.loss, out.mlm_loss, out.nsp_loss


class EncoderGraphs:
    """Each micro-batch's forward and backward from graphs (``train.cuda_graphs =
    'encoder'``), captured after ``warmup_steps`` eager optimizer steps of ``micro_batches``
    micro-batches each; see the module docstring. ``forward(host_batch)`` returns (loss,
    mlm_loss, nsp_loss) whose backward replays the backward graph.

    Counted in steps, not micro-batches: the bucket engine's re-cut at the end of the first
    step re-binds every parameter and gradient to new buffers (runtime.grad_sync.buckets), and
    a graph captured before it - at the 4th micro-batch of step 1 with 4 a step - would go on
    reading and writing the freed ones: garbage or NaN, with no error."""

    def __init__(self, net: nn.Module, device: torch.device, autocast: Callable,
                 warmup_steps: int = WARMUP_STEPS, pause: Optional[Callable] = None,
                 micro_batches: int = 1):
        self.net, self.device, self.autocast = net, torch.device(device), autocast
        self.warmup_steps, self.micro_batches = warmup_steps, micro_batches
        self.pause = pause or contextlib.nullcontext
        self.inputs: Optional[StaticInputs] = None
        self.loss: Optional[_MicroBatchLoss] = None
        self.graphed = None
        self.calls = 0

    @property
    def captured(self) -> bool:
        return self.graphed is not None

    def forward(self, batch: Batch):
        if self.inputs is None:
            self.inputs = StaticInputs([batch], self.device)
            self.loss = _MicroBatchLoss(self.net, self.inputs.slots[0])
        self.inputs.load([batch])
        args = batch_tensors(self.inputs.slots[0])
        self.calls += 1
        if self.calls <= self.warmup_steps * self.micro_batches:
            with self.autocast():
                return self.loss(*args)
        if self.graphed is None:
            with self.pause(), self.autocast():
                self.graphed = torch.cuda.make_graphed_callables(self.loss, tuple(args))
        with self.autocast():
            return self.graphed(*args)

    def close(self) -> None:
        self.graphed = None
