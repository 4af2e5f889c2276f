"""What the train step knows of gradient synchronisation: the `GradSync` protocol and the
`SyncReport` a step's sync returns.

Owns: the protocol every gradient sync implements (the bucket engine, plain DDP, any future
one), so the step never asks which one it has. Never: implements a sync.

One optimizer step, as the trainer drives it::

    sync.begin_step(loss_scale)              # before the first forward of the step
    for micro-batch: with sync.no_sync() (all but the last): forward, backward
    report = sync.finish()                   # gradients averaged (and clipped before the
                                             #   allreduce where clip_mode says so)
    norm = sync.grad_norm()                  # ‖averaged gradient‖, 0-dim, still loss-scaled
    optimizer.step(...); sync.zero_grad()

``module`` is what the step calls forward on (DDP's wrapper, or the model itself);
``on_layout(listener)`` tells a flat-buffer optimizer where the gradients live, now and after
every re-layout, so it can step on that memory instead of copying it (and, under optim.shard,
which shard of it is this rank's: ``listener(flat, ordered, shard=...)``); ``plan_json()`` is the
sync's own state a checkpoint keeps (its bucket plan); ``close()`` undoes what the sync did to
the model (hooks, swapped modules).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch


class GradSync(Protocol):
    module: torch.nn.Module
    fold_clip: bool
    """Whether the optimizer step folds the global clip coefficient (clip_mode global_after
    with a threshold): clipping has one owner - the sync clips before the allreduce, or says
    the step must after it."""

    def begin_step(self, loss_scale: Any = 1.0) -> None: ...

    def no_sync(self) -> contextlib.AbstractContextManager: ...

    def finish(self) -> "SyncReport": ...

    def grad_norm(self) -> torch.Tensor: ...

    def zero_grad(self) -> None: ...

    def on_layout(self, listener: Callable[[torch.Tensor, list], None]) -> None: ...

    def plan_json(self) -> Optional[dict]:
        """The bucket plan in use, as a plan file holds it (what a checkpoint saves and a
        resume re-installs); None for a sync that has none."""
        ...

    def close(self) -> None: ...


@dataclass
class SyncReport:
    """What one step's gradient synchronisation did on this rank. Numbers that come from the
    device stay tensors (read on logging steps only, never in the step)."""

    buckets: int = 0
    launched_in_backward: int = 0       # buckets whose allreduce started before backward ended
    clip_coefs: Optional[torch.Tensor] = None  # the before modes: this rank's coefficient per
    #                                            bucket (bucket_before) or its one (local_before)
    local_norm: Optional[torch.Tensor] = None  # ‖g_r‖ before clipping (the before modes)
    local_sq_norm: Optional[torch.Tensor] = None  # ‖g_r‖² of everything this rank sends to
    #   the averaging (after its own clip, unscaled by the loss scale; every parameter, the
    #   split tied embedding's two shares included): the gradient noise scale's small batch

    @property
    def clip_coef(self) -> Any:
        """The strongest clip applied on this rank before the allreduce (1.0 = none)."""
        return 1.0 if self.clip_coefs is None else self.clip_coefs.min()

    def metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {"buckets": self.buckets,
                               "buckets_launched_in_backward": self.launched_in_backward}
        if self.clip_coefs is not None:
            out.update(clip_coef_min=self.clip_coefs.min(), clip_coef_mean=self.clip_coefs.mean())
        if self.local_norm is not None:
            out["local_grad_norm"] = self.local_norm
        return out
