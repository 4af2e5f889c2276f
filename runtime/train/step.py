"""One training step's device work, as one object: forward and losses over the micro-batches,
backward through the gradient sync, the optimizer update with the clip coefficient and the
loss-scale unscale folded in, the loss-scale update.

A run reads top to bottom in one direction: the trainer (runtime.train.trainer: what a step
is for - its batch counts, records, logging points) -> its runner (runtime.train.runners: how
the step runs - eager, encoder graphs or one whole-step graph) -> this body -> the model or the
graphs. The runner hands ``StepBody.run`` the micro-batches and the forward its mode gives; the
body never asks which mode that is, and nothing in it reads the host.

Owns: the order of one step's work and its device values (losses, gradient norm, clip
coefficient, skip flag, loss scale, the sync's metrics), the step's mixed precision
(``autocast``: the run's runtime.numerics.Numerics, the weight-cast cache off under capture),
the learning rate handed to the optimizer.
Never: builds its parts (runtime.train.build), decides how it runs (runtime.train.runners) or
when it runs (runtime.train.trainer), launches an allreduce itself or asks which gradient sync
it has (runtime.grad_sync: one ``GradSync``), clips or scales gradients itself
(runtime.optim.grad_scale), reads a device value back.

Clipping (clip_mode 'global_after', the reference semantics): gradients are averaged across
ranks during backward, then g = min(1, tau/|g|) g is applied as the optimizer's ``grad_scale``
- no extra pass over the gradients, and the optimizer itself never clips, so nothing is
clipped twice. The before-allreduce modes clip inside the sync. A non-finite gradient norm
(fp16 overflow, or divergence in any precision) skips the update on the device
(``found_inf``); fp16's loss scale then halves.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Optional

import torch

from runtime.model import precision
from runtime.numerics import Numerics
from runtime.model.bert import run_batch
from runtime.optim.grad_scale import step_multiplier
from runtime.optim.optimizers import set_lr

DEVICE_KEYS = ("grad_norm", "clip_coef", "skipped", "loss_scale", "grad_sq_mean")
"""What ``StepBody.run`` returns for the step log's device fields (besides ``losses``); the
rest are the sync's metrics."""


class StepBody:
    """The device work of one optimizer step (see the module docstring), built from the parts
    it steps: ``net`` (what forward is called on: the model or DDP's wrapper), ``grad_sync``,
    ``optimizer``, ``loss_scale``; ``accum`` micro-batches a step, ``numerics`` (the run's
    runtime.numerics.Numerics), ``max_grad_norm``, the ``device`` its losses live on, an optional
    ``timeline`` (train.timeline) whose spans mark the phases."""

    captured = False
    """Whether a runner captures this body in CUDA graphs (its row's ``captures``; the runner
    sets it when it attaches): autocast's weight-cast cache is then off - a graph would
    replay the casts it captured once."""

    def __init__(self, net, grad_sync, optimizer, loss_scale, *, accum: int, numerics: Numerics,
                 max_grad_norm: float, device: torch.device, timeline=None,
                 simulated: bool = False):
        self.net, self.grad_sync, self.optimizer, self.loss_scale = (net, grad_sync, optimizer,
                                                                     loss_scale)
        self.accum, self.numerics, self.max_grad_norm = accum, numerics, max_grad_norm
        self.device, self.timeline = torch.device(device), timeline
        self.simulated = simulated  # a CPU standing in for a GPU: the GPU's ops, not the CPU's

    @classmethod
    def of(cls, parts, cfg, dist) -> "StepBody":
        """The body of runtime.train.build's ``parts`` under ``cfg`` on ``dist``'s device."""
        return cls(parts.grad_sync.module, parts.grad_sync, parts.optimizer, parts.loss_scale,
                   accum=cfg.train.gradient_accumulation_steps, numerics=parts.numerics,
                   max_grad_norm=cfg.train.max_grad_norm, device=dist.device,
                   timeline=parts.timeline, simulated=dist.simulates_cuda)

    def autocast(self):
        """The step's autocast (the numerics' ``autocast``: bf16 and fp16 over fp32
        parameters; nothing for fp32 and for the master-weight precisions, whose parameters
        are already in the training dtype)."""
        return precision.autocast(self.numerics, self.device, cache=not self.captured,
                                  cpu_gemms=not self.simulated)

    def set_lr(self, lr) -> None:
        """The learning rate of the next update: a host number, or a device scalar (read
        inside a captured step)."""
        set_lr(self.optimizer, lr)

    def run(self, batches: Iterable, forward: Optional[Callable] = None) -> dict:
        """Forward, backward, gradient sync, optimizer update on ``batches`` (``accum`` of
        them: device batches, or what the runner's ``forward`` takes - default
        ``forward_losses``). What the whole-step graph captures (runtime.train.graphs): every
        state it changes it changes in place, and nothing in it reads the host."""
        forward = forward or self.forward_losses
        sync, scale = self.grad_sync, self.loss_scale
        self.net.train()
        sync.begin_step(scale.scale)
        losses = torch.zeros(4, device=self.device)
        for i, batch in enumerate(batches):
            with sync.no_sync() if i < self.accum - 1 else contextlib.nullcontext():
                with self._span("forward"):
                    loss, mlm_loss, nsp_loss = forward(batch)
                with self._span("backward"):
                    (loss * scale.loss_multiplier(self.accum)).backward()
            losses[:3] += torch.stack([loss.detach(), mlm_loss.detach(),
                                       nsp_loss.detach()]).float() / self.accum
        with self._span("sync"):  # the last launches and the wait for every allreduce
            report = sync.finish()
        with self._span("optimizer"):
            grad_scale, found_inf, coef, norm = step_multiplier(
                sync.grad_norm(), scale.scale, max_norm=self.max_grad_norm,
                clip=sync.fold_clip)
            self.optimizer.step(grad_scale=grad_scale, found_inf=found_inf)
            scale.update(~found_inf)
            sync.zero_grad()
        values = dict(losses=losses, grad_norm=norm, clip_coef=coef * report.clip_coef,
                      skipped=found_inf, loss_scale=scale.value())
        if report.local_sq_norm is not None:  # the gradient noise scale's two batch sizes
            losses[3] = report.local_sq_norm  # averaged over ranks at the logging point
            values["grad_sq_mean"] = norm.square()  # the whole averaged gradient's
        return {**values, **report.metrics()}

    def forward_losses(self, batch):
        """(loss, mlm_loss, nsp_loss) of one micro-batch on the device: the model's forward
        under the step's precision."""
        with self.autocast():
            out = run_batch(self.net, batch)
        return out.loss, out.mlm_loss, out.nsp_loss

    def _span(self, name: str):
        """A timeline span (train.timeline), else nothing."""
        return self.timeline.span(name) if self.timeline else contextlib.nullcontext()
