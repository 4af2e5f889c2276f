"""Clipping and loss scaling: the one multiplier the optimizer step applies to the gradients.

Owns:
  * ``DynamicLossScale``: fp16's dynamic loss scale (halve on inf/nan, double after
    ``growth_interval`` good steps) and the count of the steps it skipped; a constant 1 for
    fp32/bf16. The scale and counters live on the device and are updated there;
  * ``step_multiplier``: from the averaged gradient's norm (still loss-scaled), the optimizer's
    ``grad_scale`` = clip coefficient / loss scale and its ``found_inf`` flag (a non-finite norm:
    skip the update). The coefficient is ``kernels.optim_reference.clip_coefficient_of_norm`` -
    the one clip formula, also used by the before-allreduce modes in runtime.grad_sync - and
    is applied here only for clip_mode ``global_after`` (the others clip in the sync, or not).
Never: touches the gradients (the optimizer multiplies inside its step, so clipping costs no
extra pass), reads a device tensor back to the host (callers read on logging steps), or
reduces across ranks (the norm it is given is already of the averaged gradient).

The arithmetic is float64 on 0-dim tensors: the same IEEE operations as Python floats, so the
multiplier the step receives is bit-for-bit the one the host would have computed.
"""
from __future__ import annotations

from typing import Any, Optional, Union

import torch

from kernels.optim_reference import clip_coefficient_of_norm

Number = Union[float, torch.Tensor]


class DynamicLossScale:
    """fp16 dynamic loss scaling, on the device: halve on inf/nan (the step is skipped), double
    after ``growth_interval`` good steps; ``enabled=False`` is a constant 1 (fp32, bf16).

    ``scale`` and ``skipped`` are 0-dim device tensors (float64, int64) when enabled."""

    def __init__(self, init_scale: float, growth_interval: int = 2000, enabled: bool = True,
                 device: Optional[torch.device] = None):
        self.enabled = enabled
        self.growth_interval = growth_interval
        device = torch.device("cpu") if device is None else torch.device(device)
        self.scale: Number = torch.tensor(float(init_scale), dtype=torch.float64,
                                          device=device) if enabled else 1.0
        self.good_steps = torch.zeros((), dtype=torch.int64, device=device)
        self.skipped: Number = torch.zeros((), dtype=torch.int64, device=device) \
            if enabled else 0

    def loss_multiplier(self, accum: int) -> Number:
        """What backward multiplies the loss by: scale / accumulation steps (fp32 when a
        tensor, as the loss is)."""
        if not self.enabled:
            return 1.0 / accum
        return (self.scale / accum).float()

    def update(self, finite: Any) -> None:
        """After a step: ``finite`` (bool or 0-dim bool tensor) says whether the gradients
        were finite. Device ops only, in place: the tensors keep their memory, so a CUDA
        graph that captured this update reads and writes the live values at every replay
        (whoever keeps a step's value keeps a copy: ``value()``)."""
        if not self.enabled:
            return
        finite = torch.as_tensor(finite, device=self.good_steps.device)
        good = torch.where(finite, self.good_steps + 1, torch.zeros_like(self.good_steps))
        grow = finite & (good % self.growth_interval == 0)
        self.scale.copy_(torch.where(finite, torch.where(grow, self.scale * 2.0, self.scale),
                                     torch.clamp(self.scale / 2.0, min=1.0)))
        self.good_steps.copy_(good)
        self.skipped.add_((~finite).to(self.skipped.dtype))

    def value(self) -> Number:
        """The scale now, as a value of its own (a copy of the device tensor, which later
        updates overwrite in place)."""
        return self.scale.clone() if self.enabled else self.scale

    def state_dict(self) -> dict:
        """Copies (the live tensors change in place at every step)."""
        clone = lambda t: t.clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
        return {"scale": clone(self.scale), "good_steps": clone(self.good_steps),
                "skipped": clone(self.skipped)}

    def load_state_dict(self, state: dict) -> None:
        if not self.enabled:
            return
        for name, dtype in (("scale", torch.float64), ("good_steps", torch.int64),
                            ("skipped", torch.int64)):  # in place: the tensors stay where
            getattr(self, name).copy_(torch.as_tensor(state[name], dtype=dtype))  # they are


def step_multiplier(norm: torch.Tensor, loss_scale: Number, *, max_norm: float,
                    clip: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_scale, found_inf, coef, unscaled_norm) for one optimizer step, all 0-dim tensors.

    ``norm``: ‖averaged gradient‖ as the sync measured it (loss-scaled); ``clip``: apply the
    global clip (clip_mode global_after with max_norm > 0). ``grad_scale`` = coef / loss_scale
    multiplies every gradient inside the step; ``found_inf`` is True when the norm is not
    finite (the step must leave parameters and state untouched).
    """
    unscaled = norm.double() / loss_scale
    found_inf = ~torch.isfinite(unscaled)
    if clip:
        coef = clip_coefficient_of_norm(unscaled, max_norm)
    else:
        coef = torch.ones((), dtype=torch.float64, device=unscaled.device)
    return coef / loss_scale, found_inf, coef, unscaled
