"""Plain torch DDP behind the `GradSync` protocol (``train.grad_sync = "ddp"``): DDP's default
buckets (25 MiB, first 1 MiB, whole parameters, reverse registration order, rebuilt after the
first iteration), kept to compare the runtime's buckets against.

Owns: wrapping the model in ``DistributedDataParallel`` (several ranks; a world of one calls
the model itself), and the protocol around it. Never: clips before the allreduce (clip_mode
global_after | none only: runtime.config refuses the others), splits a parameter, or owns
gradient memory (autograd or a fused optimizer's buffer does; DDP copies into its buckets).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from kernels.optim_reference import global_grad_norm
from runtime.grad_sync.protocol import SyncReport


class DDPSync:
    """DDP's allreduce during backward; `finish` has nothing left to do."""

    def __init__(self, model: torch.nn.Module, *, world_size: int, device: torch.device,
                 fold_clip: bool = False):
        self.model = model
        self.fold_clip = fold_clip  # global_after: the step folds the clip (DDP clips never)
        self._local_sq: list[torch.Tensor] = []
        self._loss_scale: Any = 1.0
        if world_size > 1:
            ids = [device.index] if device.type == "cuda" else None
            self.module: torch.nn.Module = DistributedDataParallel(model, device_ids=ids)
            self.module.register_comm_hook(None, self._allreduce)
        else:
            self.module = model

    def _allreduce(self, _state, bucket):
        """DDP's own allreduce (divide by P, sum), after noting the squared norm of this
        rank's bucket for the gradient noise scale: on the device, no host read."""
        self._local_sq.append(torch.linalg.vector_norm(bucket.buffer(), dtype=torch.float32)
                              .square())
        return allreduce_hook(self.module.process_group, bucket)

    def begin_step(self, loss_scale: Any = 1.0) -> None:
        self._local_sq = []
        self._loss_scale = loss_scale

    def no_sync(self):
        """Accumulate without averaging (every micro-step but the last)."""
        if isinstance(self.module, DistributedDataParallel):
            return self.module.no_sync()
        return contextlib.nullcontext()

    def finish(self) -> SyncReport:
        report = SyncReport()
        if self._local_sq:
            scale = self._loss_scale
            report.local_sq_norm = torch.stack(self._local_sq).sum() / (scale * scale)
        return report

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def grad_norm(self) -> torch.Tensor:
        return global_grad_norm(self._grads())

    def zero_grad(self) -> None:
        """In place: gradients that are views of a fused optimizer's buffer stay views."""
        grads = self._grads()
        if grads:
            torch._foreach_zero_(grads)

    def on_layout(self, listener: Callable[[torch.Tensor, list], None]) -> None:
        """DDP owns no flat gradient buffer to share: the optimizer keeps its own."""

    def plan_json(self) -> None:
        """DDP cuts its own buckets: no plan to keep."""
        return None

    def close(self) -> None:
        pass
