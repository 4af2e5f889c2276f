"""How each clip mode acts in the bucket engine: one policy per (where, unit) of a
``runtime.choices.ClipSpec`` row, so the engine asks its policy instead of testing flags.

Owns: ``ClipPolicy`` (the three moments a mode acts: a bucket about to launch, the end of
backward before the last launches, the step's report) and its three kinds - ``Averaging``
(global_after, none: this rank's gradient goes out as it is, divided by P; the global_after
coefficient is folded into the optimizer step by the trainer, as the sync's ``fold_clip``
says), ``RankBefore`` (local_before: the rank's whole gradient to τ, which holds every launch
until backward ends), ``BucketBefore`` (bucket_before: each bucket to τ/√K by its own norm,
Samsung's). ``POLICIES`` maps (where, unit) to them; ``policy_for`` picks one.
Never: launches a collective, owns the gradient buffer or the noise-scale tap's bookkeeping
(runtime.grad_sync.buckets does; a policy hands it the norm of what goes out), or reads the
host: every norm and coefficient stays a device tensor.

The coefficient formula is the one of ``kernels.optim_reference.clip_coefficient_of_norm``.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from kernels.optim_reference import clip_coefficient_of_norm, norm_of_rows, row_norms
from runtime.choices import ClipSpec


class ClipPolicy:
    """What a mode does; see the module docstring. ``engine``: the GradientBuckets asking
    (its flat buffer, bounds, loss scale, noise tap)."""

    holds_launches = False

    def __init__(self, max_norm: float):
        self.max_norm = max_norm

    def begin_step(self) -> None:
        """Forget the last step's norms."""

    def scale_bucket(self, engine: Any, k: int, buf: torch.Tensor, scale: float) -> None:
        """Bucket ``k`` (``buf``) is about to launch: scale it by ``scale`` (1/P) and any clip
        coefficient, and hand the noise tap the norm of what goes out."""
        raise NotImplementedError

    def before_final_launches(self, engine: Any) -> None:
        """Backward has ended; the buckets not yet launched go next."""

    def report(self, report: Any) -> None:
        """This rank's clip coefficients and norm, into the step's SyncReport."""


class Averaging(ClipPolicy):
    """No clip before the averaging (global_after, none)."""

    def scale_bucket(self, engine, k, buf, scale):
        if engine.world_size > 1:  # the noise scale's local norm, before the averaging
            engine.note_local(engine.bucket_norm(k) / engine.loss_scale)
        if scale != 1.0:
            buf.mul_(scale)


class RankBefore(ClipPolicy):
    """Each rank's whole gradient to τ before any launch (local_before)."""

    holds_launches = True

    def begin_step(self):
        self.coef: Optional[torch.Tensor] = None
        self.norm: Optional[torch.Tensor] = None

    def before_final_launches(self, engine):
        self.norm = norm_of_rows(row_norms(engine.flat)) / engine.loss_scale
        self.coef = clip_coefficient_of_norm(self.norm, self.max_norm)
        engine.note_local(self.norm * self.coef)

    def scale_bucket(self, engine, k, buf, scale):
        buf.mul_(self.coef * scale)

    def report(self, report):
        report.clip_coefs = self.coef.reshape(1)
        report.local_norm = self.norm


class BucketBefore(ClipPolicy):
    """Each bucket to τ/√K by its own norm, as it launches (bucket_before)."""

    def begin_step(self):
        self.norms: dict[int, torch.Tensor] = {}
        self.coefs: dict[int, torch.Tensor] = {}

    def scale_bucket(self, engine, k, buf, scale):
        norm = engine.bucket_norm(k) / engine.loss_scale
        coef = clip_coefficient_of_norm(norm, self.max_norm / math.sqrt(engine.num_buckets))
        self.norms[k], self.coefs[k] = norm, coef
        engine.note_local(norm * coef)
        buf.mul_(coef * scale)

    def report(self, report):
        order = sorted(self.coefs)
        report.clip_coefs = torch.stack([self.coefs[k] for k in order])
        report.local_norm = torch.stack([self.norms[k] for k in order]).double().pow(2) \
            .sum().sqrt()


POLICIES: dict[tuple[str, str], type[ClipPolicy]] = {
    ("after", "global"): Averaging, ("none", "none"): Averaging,
    ("before", "rank"): RankBefore, ("before", "bucket"): BucketBefore,
}
"""(where, unit) of a ClipSpec row -> its policy: a new mode is a row, and a class here only
when its (where, unit) is new."""


def policy_for(spec: ClipSpec, max_norm: float) -> ClipPolicy:
    """The policy of ``spec``; no clip (averaging only) when ``max_norm`` is 0 - launches
    still held where the mode holds them (the step the tuner models)."""
    if max_norm <= 0:
        policy = Averaging(max_norm)
        policy.holds_launches = spec.holds_launches
        return policy
    return POLICIES[(spec.where, spec.unit)](max_norm)
