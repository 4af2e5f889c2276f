"""apex's fused CUDA kernels as the ``apex`` backend (LAMB, AdamW), offered only when present.

What this module owns:
  * ``available()``: True only when NVIDIA apex with its CUDA extensions imports
    (``apex.optimizers`` and ``amp_C``). ``import apex`` alone proves nothing: the PyPI
    package called ``apex`` is an unrelated web toolkit, and apex built without
    ``--cuda_ext`` has no ``amp_C``.
  * ``lamb_step`` / ``adamw_step`` with the signatures of ``kernels.optim_reference``, calling
    ``amp_C.multi_tensor_lamb`` / ``amp_C.multi_tensor_adam`` (the kernels behind apex's
    ``FusedLAMB`` / ``FusedAdam``) on the caller's own tensors and state.

Clipping (docs/REFERENCES.md §2; apex/optimizers/fused_lamb.py): ``FusedLAMB`` clips inside its step, dividing every gradient by
max(1, ‖g‖/max_grad_norm) with its own global norm (default max_grad_norm=1.0), so a
runtime that also clips outside clips twice. Passing ``max_grad_norm=0`` does *not*
disable it: apex's kernel then divides by ‖g‖/0 = inf and every gradient becomes 0. This
module never lets apex compute a norm: it calls the kernel with ``global_grad_norm =
1/grad_scale`` and ``max_grad_norm = 1``, so the kernel divides by 1/grad_scale, i.e.
multiplies by the runtime's ``grad_scale`` (clip coefficient × loss-scale unscale) and
nothing else. A ``grad_scale`` above 1 (never produced by the runtime) is applied to the
gradients first, in place.

Differences from the reference that apex imposes (refused with a ValueError, not
approximated): ``trust_clamp``; a tensor that adapts without weight decay is run with
``use_nvlamb`` for its call, but one with weight decay that must *not* adapt cannot be
expressed; parameters must share the state's dtype (apex keeps no fp32 master copy here).
AdamW's ``grad_scale`` ≠ 1 costs one ``_foreach_mul_`` over the gradients (apex's plain
Adam kernel takes no scale). Both kernels overwrite the gradients (LAMB stores its update
there).

What it never does: run on CPU, import apex at module import time, or get tested where apex
is missing (tests skip).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from kernels.optim_foreach import _subsets
from kernels.optim_reference import Scalar, _check_lengths, _check_step, _per_tensor

__all__ = ["available", "lamb_step", "adamw_step"]

@functools.lru_cache(maxsize=1)
def _modules():
    try:
        import amp_C  # noqa: F401  (apex's CUDA extension)
        from apex.multi_tensor_apply import multi_tensor_applier
        from apex.optimizers import FusedAdam, FusedLAMB  # noqa: F401
    except Exception:  # ImportError, or a broken build raising anything else
        return None
    return amp_C, multi_tensor_applier


def available() -> bool:
    """True when NVIDIA apex with its CUDA extensions imports here."""
    return _modules() is not None


def _require(params: Sequence[torch.Tensor], states: Sequence[torch.Tensor]):
    mods = _modules()
    if mods is None:
        raise RuntimeError("backend 'apex': NVIDIA apex with CUDA extensions does not import "
                           "here; use backend 'fused' or 'auto'")
    if any(p.device.type != "cuda" for p in params):
        raise ValueError("backend 'apex' runs on CUDA tensors only; use 'fused' on CPU")
    if any(p.dtype != s.dtype for p, s in zip(params, states)):
        raise ValueError("backend 'apex' needs parameters in the state's dtype (fp32); use "
                         "'fused' for bf16/fp16 parameters")
    return mods


def _scale_grads(grads: list[torch.Tensor], grad_scale: Scalar) -> torch.Tensor:
    """Return 1/grad_scale as apex's 1-element 'global_grad_norm'. apex clamps it with
    max(1, ·), i.e. it can only scale gradients down: a Python scale above 1 is applied to the
    gradients first. A tensor scale is taken to be <= 1 without looking (the runtime's always
    is: a clip coefficient <= 1 over a loss scale >= 1) - checking it would be a host sync."""
    device = grads[0].device
    if not isinstance(grad_scale, torch.Tensor):
        if grad_scale > 1:
            torch._foreach_mul_(grads, float(grad_scale))
            return torch.ones(1, dtype=torch.float32, device=device)
        return torch.full((1,), 1.0 / grad_scale, dtype=torch.float32, device=device)
    return grad_scale.to(device, torch.float32).reshape(1).reciprocal()


@torch.no_grad()
def lamb_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
              exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
              step: int, lr: Scalar, beta1: float, beta2: float, eps: float,
              weight_decays, adapt_flags, bias_correction: bool = True,
              grad_scale: Scalar = 1.0, trust_clamp: float | None = None) -> None:
    """LAMB as ``optim_reference.lamb_step`` on ``amp_C.multi_tensor_lamb``."""
    _check_step(step)
    n = _check_lengths(params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
    if n == 0:
        return
    if trust_clamp is not None:
        raise ValueError("backend 'apex': apex FusedLAMB has no trust_clamp; use 'fused'")
    amp_C, applier = _require(params, exp_avgs)
    wds = _per_tensor(weight_decays, n, "weight_decays")
    adapts = _per_tensor(adapt_flags, n, "adapt_flags")
    grads = list(grads)
    norm = _scale_grads(grads, grad_scale)
    noop = torch.zeros(1, dtype=torch.int, device=params[0].device)
    for (wd, adapt), idx in _subsets(list(zip(wds, adapts)), n).items():
        if wd != 0.0 and not adapt:
            raise ValueError("backend 'apex': a tensor with weight decay that does not adapt "
                             "cannot be expressed with apex FusedLAMB; use 'fused'")
        lists = [[t[i] for i in idx] for t in (grads, params, exp_avgs, exp_avg_sqs)]
        # apex adapts iff weight decay != 0 or use_nvlamb; adapt with λ = 0 needs nvlamb.
        applier(amp_C.multi_tensor_lamb, noop, lists, float(lr), beta1, beta2, eps, step,
                int(bias_correction), wd, 1, 1, norm, 1.0, bool(adapt and wd == 0.0))


@torch.no_grad()
def adamw_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
               exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
               step: int, lr: Scalar, beta1: float, beta2: float, eps: float,
               weight_decays, bias_correction: bool = True,
               grad_scale: Scalar = 1.0) -> None:
    """AdamW as ``optim_reference.adamw_step`` on ``amp_C.multi_tensor_adam`` (mode 1)."""
    _check_step(step)
    n = _check_lengths(params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
    if n == 0:
        return
    amp_C, applier = _require(params, exp_avgs)
    wds = _per_tensor(weight_decays, n, "weight_decays")
    grads = list(grads)
    if not (isinstance(grad_scale, float) and grad_scale == 1.0):
        torch._foreach_mul_(grads, grad_scale)
    noop = torch.zeros(1, dtype=torch.int, device=params[0].device)
    for wd, idx in _subsets(wds, n).items():
        lists = [[t[i] for i in idx] for t in (grads, params, exp_avgs, exp_avg_sqs)]
        applier(amp_C.multi_tensor_adam, noop, lists, float(lr), beta1, beta2, eps, step, 1,
                int(bias_correction), wd)
