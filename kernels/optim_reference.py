"""Reference optimizer steps (LAMB, AdamW, LARS) and gradient-norm clipping, in plain torch.

What this module owns: the *meaning* of one optimizer update, written per tensor so it can
be read against the papers (docs/REFERENCES.md §1, §2). Fast backends (foreach / fused, added later
beside this file) must produce the same numbers and are tested against these functions.

What it never does:
  * clip. ``grad_scale`` is a multiplier applied to every gradient inside the step; the
    runtime folds its global clip coefficient (``clip_coefficient``) and any loss-scale
    unscale into it, so clipping costs no extra pass over the gradients and the runtime
    never clips twice (apex ``FusedLAMB`` clips inside its step by default; this does not).
  * decide which parameters get weight decay or layer adaptation: callers pass one weight
    decay and one adapt flag per tensor (``runtime.optim`` derives them from BERT names).
  * sync with the host: trust ratios stay 0-dim tensors (``torch.where``), so a GPU step
    launches kernels without a ``.item()``.

Conventions shared by all steps:
  * ``params`` are updated in place; ``exp_avgs``/``exp_avg_sqs``/``momentum_buffers`` are
    fp32 state tensors (fp64 for fp64 parameters), updated in place. All math is fp32 (fp64
    for fp64 tensors, which tests use to check formulas without rounding noise); a bf16/fp16
    parameter is read as fp32 and the result copied back (rounded once).
  * ``step`` is the 1-based count of updates *including this one* (bias correction uses
    β^step); the caller increments it before calling.
  * ``weight_decays`` / ``adapt_flags`` are per-tensor sequences (a single number/bool is
    broadcast to all tensors).
  * ``lr`` and ``grad_scale`` may be Python floats or 0-dim tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Union

import torch

Scalar = Union[float, torch.Tensor]

__all__ = [
    "lamb_step",
    "adamw_step",
    "lars_step",
    "global_grad_norm",
    "clip_coefficient",
    "clip_coefficient_of_norm",
    "row_norms",
    "norm_of_rows",
    "CLIP_EPS",
    "ROW",
]

#: Added to the global norm in ``clip_coefficient`` (as torch.nn.utils.clip_grad_norm_ does).
CLIP_EPS = 1e-6

#: Elements per row of norm reductions, and of the flat buffers (``kernels.optim_flat.ROW``).
ROW = 1024


def _per_tensor(value, n: int, name: str) -> list:
    if isinstance(value, (bool, int, float)):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{name}: expected one value per tensor ({n}), got {len(values)}")
    return values


def _check_lengths(**lists: Sequence) -> int:
    lengths = {k: len(v) for k, v in lists.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"tensor lists differ in length: {lengths}")
    return next(iter(lengths.values()), 0)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the math dtype: fp32, or fp64 for fp64 tensors (never lower than fp32).

    An fp32/fp64 tensor is returned as is, so callers must not modify the result in place.
    """
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _trust_ratio(w_norm: torch.Tensor, u_norm: torch.Tensor, num: torch.Tensor,
                 den: torch.Tensor) -> torch.Tensor:
    """num/den where both norms are positive, else 1 (LAMB v5, LARS)."""
    ok = (w_norm > 0) & (u_norm > 0)
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)),
                       torch.ones_like(num))


def _adam_direction(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                    *, step: int, beta1: float, beta2: float, eps: float,
                    weight_decay: float, bias_correction: bool):
    """Update m, v in place; return (x fp32, u = m̂/(√v̂+ε) + λx)."""
    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    if bias_correction:
        bc1 = 1.0 - beta1 ** step
        bc2 = 1.0 - beta2 ** step
    else:
        bc1 = bc2 = 1.0
    x = _fp32(p)
    u = (m / bc1) / ((v / bc2).sqrt() + eps)
    if weight_decay != 0.0:
        u = u + weight_decay * x
    return x, u


def _check_step(step: int) -> None:
    if step < 1:
        raise ValueError(f"step must be the 1-based update count (>= 1), got {step}")


@torch.no_grad()
def lamb_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
              exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
              step: int, lr: Scalar, beta1: float, beta2: float, eps: float,
              weight_decays, adapt_flags, bias_correction: bool = True,
              grad_scale: Scalar = 1.0, trust_clamp: float | None = None,
              update_dtype: torch.dtype | None = None) -> None:
    """One LAMB update (You et al., paper v5), per tensor:

        g  = grad_scale · grad
        m  = β1·m + (1−β1)·g            v = β2·v + (1−β2)·g²
        m̂  = m/(1−β1^step)              v̂ = v/(1−β2^step)       (if bias_correction)
        u  = m̂/(√v̂ + ε) + λ·x
        ratio = φ(‖x‖)/‖u‖  if adapt and ‖x‖ > 0 and ‖u‖ > 0, else 1
        x ← x − lr · ratio · u

    φ is the identity, or ``min(‖x‖, trust_clamp)`` when ``trust_clamp`` is set.
    Excluded parameters (bias/LayerNorm) are passed with adapt=False and λ=0.
    ``update_dtype``: the u applied to x is u rounded to this dtype (the ratio is of the
    unrounded u) - the stored update of ``optim.lamb_update = "stored"``, kept in the
    gradients' dtype (kernels.optim_flat.FusedLambStoredUpdate).
    """
    _check_step(step)
    n = _check_lengths(params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
    wds = _per_tensor(weight_decays, n, "weight_decays")
    adapts = _per_tensor(adapt_flags, n, "adapt_flags")
    for p, grad, m, v, wd, adapt in zip(params, grads, exp_avgs, exp_avg_sqs, wds, adapts):
        g = _fp32(grad) * grad_scale
        x, u = _adam_direction(p, g, m, v, step=step, beta1=beta1, beta2=beta2, eps=eps,
                               weight_decay=wd, bias_correction=bias_correction)
        if adapt:
            w_norm = torch.linalg.vector_norm(x)
            u_norm = torch.linalg.vector_norm(u)
            phi = w_norm if trust_clamp is None else w_norm.clamp(max=trust_clamp)
            ratio = _trust_ratio(w_norm, u_norm, phi, u_norm)
        else:
            ratio = 1.0
        if update_dtype is not None:
            u = u.to(update_dtype).to(u.dtype)
        p.copy_(x - (lr * ratio) * u)   # lr · 1.0 is lr exactly: unadapted, x − lr·u


@torch.no_grad()
def adamw_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
               exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
               step: int, lr: Scalar, beta1: float, beta2: float, eps: float,
               weight_decays, bias_correction: bool = True,
               grad_scale: Scalar = 1.0) -> None:
    """One AdamW update (decoupled weight decay), per tensor:

        u = m̂/(√v̂ + ε) + λ·x,   x ← x − lr·u

    Same as ``torch.optim.AdamW`` (which applies x ← x − lr·λ·x first, using the same x).
    """
    _check_step(step)
    n = _check_lengths(params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
    wds = _per_tensor(weight_decays, n, "weight_decays")
    for p, grad, m, v, wd in zip(params, grads, exp_avgs, exp_avg_sqs, wds):
        g = _fp32(grad) * grad_scale
        x, u = _adam_direction(p, g, m, v, step=step, beta1=beta1, beta2=beta2, eps=eps,
                               weight_decay=wd, bias_correction=bias_correction)
        p.copy_(x - lr * u)


@torch.no_grad()
def lars_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
              momentum_buffers: Sequence[torch.Tensor], *, lr: Scalar, momentum: float,
              trust_coefficient: float, eps: float, weight_decays, adapt_flags,
              grad_scale: Scalar = 1.0) -> None:
    """One LARS update (You et al. 2017), per tensor:

        g         = grad_scale · grad
        local_lr  = η_trust·‖w‖ / (‖g‖ + λ‖w‖ + ε)  if adapt and ‖w‖ > 0 and ‖g‖ > 0, else 1
        buf       = momentum·buf + lr·local_lr·(g + λw)
        w        ← w − buf

    ``momentum_buffers`` start as zeros (the first step is then buf = lr·local_lr·(g + λw)).
    """
    n = _check_lengths(params=params, grads=grads, momentum_buffers=momentum_buffers)
    wds = _per_tensor(weight_decays, n, "weight_decays")
    adapts = _per_tensor(adapt_flags, n, "adapt_flags")
    for p, grad, buf, wd, adapt in zip(params, grads, momentum_buffers, wds, adapts):
        g = _fp32(grad) * grad_scale
        w = _fp32(p)
        d = g + wd * w if wd != 0.0 else g
        if adapt:
            w_norm = torch.linalg.vector_norm(w)
            g_norm = torch.linalg.vector_norm(g)
            local_lr = _trust_ratio(w_norm, g_norm, trust_coefficient * w_norm,
                                    g_norm + wd * w_norm + eps)
            buf.mul_(momentum).add_((lr * local_lr) * d)
        else:
            buf.mul_(momentum).add_(lr * d)
        p.copy_(w - buf)


@torch.no_grad()
def row_norms(t: torch.Tensor) -> torch.Tensor:
    """fp32 L2 norms of the rows of ``t``: its flattened elements cut into rows of ``ROW``, the
    last row zero-padded. A flat buffer that starts every tensor on a row boundary
    (``kernels.optim_flat``, ``runtime.grad_sync``) has exactly these rows, so per-row norms
    of the buffer equal the concatenated per-tensor ones, bit for bit."""
    flat = t.reshape(-1)
    n = flat.numel()
    full = n // ROW
    parts = []
    if full:
        parts.append(torch.linalg.vector_norm(flat[:full * ROW].view(full, ROW), dim=1,
                                              dtype=torch.float32))
    if n > full * ROW:
        tail = flat.new_zeros(ROW)
        tail[:n - full * ROW] = flat[full * ROW:]
        parts.append(torch.linalg.vector_norm(tail.view(1, ROW), dim=1, dtype=torch.float32))
    if not parts:
        return torch.zeros(0, dtype=torch.float32, device=t.device)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def norm_of_rows(norms: torch.Tensor) -> torch.Tensor:
    """The L2 norm of everything, from per-row norms: squares summed in fp64, 0-dim fp32."""
    return norms.double().pow(2).sum().sqrt().float()


@torch.no_grad()
def global_grad_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all gradients together, a 0-dim fp32 tensor; 0 for an empty list.

    Accumulated per row of ``ROW`` elements in fp32 (``row_norms``), the rows' squares summed in
    fp64: accurate (~1e-10 relative on millions of elements, where one fp32 accumulation drifts
    to ~1e-4), no gradient-sized temporary, and the same bits wherever the gradients sit in a
    row-aligned flat buffer - so the bucket plan never changes the clip coefficient (the order
    of the fp64 sum can, by fp64 rounding). Non-finite gradients give a non-finite norm (the
    caller decides whether to skip the step); nothing is synced to the host.
    """
    grads = [g for g in grads if g is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    device = grads[0].device
    return norm_of_rows(torch.cat([row_norms(g).to(device) for g in grads]))


def clip_coefficient_of_norm(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The clip coefficient min(1, max_norm / (total_norm + CLIP_EPS)), in the norm's dtype.

    The one formula: ``clip_coefficient`` below, the runtime's global clip and its
    before-allreduce clip modes all call it."""
    return torch.clamp(max_norm / (total_norm + CLIP_EPS), max=1.0)


@torch.no_grad()
def clip_coefficient(grads: Sequence[torch.Tensor], max_norm: float):
    """Global-norm clipping as a multiplier: returns (coef, total_norm), both 0-dim fp32.

        total_norm = ‖(g_1, …, g_n)‖₂          coef = min(1, max_norm / (total_norm + 1e-6))

    Multiplying every gradient by ``coef`` is ``torch.nn.utils.clip_grad_norm_``; the runtime
    instead passes ``coef`` as the optimizer step's ``grad_scale``. Gradients are not touched.
    """
    if not (isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"max_norm must be a finite number > 0, got {max_norm!r}")
    total_norm = global_grad_norm(grads)
    return clip_coefficient_of_norm(total_norm, max_norm), total_norm
