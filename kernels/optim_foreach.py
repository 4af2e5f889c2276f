"""Multi-tensor optimizer steps (LAMB, AdamW, LARS) on ``torch._foreach_*``, CPU and CUDA.

What this module owns: the ``foreach`` backend. Each function has exactly the signature and
the meaning of its counterpart in ``kernels.optim_reference`` (read that module for the math
and the conventions: in-place updates, fp32 math, 1-based ``step``, ``grad_scale`` folding)
and is held equal to it by ``tests/integration/test_optim_backends.py``. The same arithmetic is
done in the same order, one operation at a time over the whole tensor list, so a step is a few
dozen kernel launches instead of a few per tensor.

What it never does:
  * allocate less than the reference: scaled gradients, the denominator and the update are
    model-sized temporaries (the ``fused`` backend in ``optim_flat`` is the one without);
  * sync with the host: trust ratios and per-tensor scales stay tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.optim_reference import (Scalar, _check_lengths, _check_step, _fp32,
                                     _per_tensor, _trust_ratio)

__all__ = ["lamb_step", "adamw_step", "lars_step"]


def _math_tensors(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters in the math dtype: themselves when fp32/fp64, else fp32 copies."""
    return [_fp32(p) for p in params]


def _write_back(params: Sequence[torch.Tensor], xs: list[torch.Tensor]) -> None:
    """Copy fp32 results into low-precision parameters (rounded once); a no-op otherwise."""
    low = [(p, x) for p, x in zip(params, xs) if p is not x]
    if low:
        torch._foreach_copy_([p for p, _ in low], [x for _, x in low])


def _scaled_grads(grads: Sequence[torch.Tensor], grad_scale: Scalar) -> list[torch.Tensor]:
    """grad_scale · grad in the math dtype; never aliases the caller's gradients when the
    result will be modified, and skips the multiply when it is a no-op (fp32 and 1.0)."""
    gs = [_fp32(g) for g in grads]
    if isinstance(grad_scale, float) and grad_scale == 1.0:
        return gs
    return torch._foreach_mul(gs, grad_scale)


def _subsets(values: Sequence, n: int) -> dict:
    """value -> indices holding it (weight decays come in one or two distinct values)."""
    out: dict = {}
    for i in range(n):
        out.setdefault(values[i], []).append(i)
    return out


def _small(values: list, like: torch.Tensor) -> torch.Tensor:
    """Host numbers as a vector on ``like``'s device, without the host waiting: a copy from
    pageable memory synchronises a CUDA stream, so it goes through pinned memory there."""
    t = torch.tensor(values, dtype=like.dtype)
    if like.is_cuda:
        t = t.pin_memory()
    return t.to(like.device, non_blocking=True)


def _pick(tensors: Sequence[torch.Tensor], idx: Sequence[int]) -> list[torch.Tensor]:
    return [tensors[i] for i in idx]


def _adam_directions(xs, grads, ms, vs, wds, *, step, beta1, beta2, eps, bias_correction,
                     grad_scale) -> list[torch.Tensor]:
    """Update m, v in place; return u = m̂/(√v̂+ε) + λx per tensor (new tensors)."""
    gs = _scaled_grads(grads, grad_scale)
    torch._foreach_mul_(ms, beta1)
    torch._foreach_add_(ms, gs, alpha=1.0 - beta1)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, gs, gs, value=1.0 - beta2)
    bc1, bc2 = (1.0 - beta1 ** step, 1.0 - beta2 ** step) if bias_correction else (1.0, 1.0)
    den = torch._foreach_div(vs, bc2) if bc2 != 1.0 else [v.clone() for v in vs]
    torch._foreach_sqrt_(den)
    torch._foreach_add_(den, eps)
    us = torch._foreach_div(ms, bc1) if bc1 != 1.0 else [m.clone() for m in ms]
    torch._foreach_div_(us, den)
    for wd, idx in _subsets(wds, len(xs)).items():
        if wd != 0.0:
            torch._foreach_add_(_pick(us, idx), torch._foreach_mul(_pick(xs, idx), wd))
    return us


@torch.no_grad()
def lamb_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
              exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
              step: int, lr: Scalar, beta1: float, beta2: float, eps: float,
              weight_decays, adapt_flags, bias_correction: bool = True,
              grad_scale: Scalar = 1.0, trust_clamp: float | None = None) -> None:
    """LAMB as ``optim_reference.lamb_step``, on tensor lists."""
    _check_step(step)
    n = _check_lengths(params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
    if n == 0:
        return
    wds = _per_tensor(weight_decays, n, "weight_decays")
    adapts = _per_tensor(adapt_flags, n, "adapt_flags")
    xs = _math_tensors(params)
    us = _adam_directions(xs, grads, list(exp_avgs), list(exp_avg_sqs), wds, step=step,
                          beta1=beta1, beta2=beta2, eps=eps, bias_correction=bias_correction,
                          grad_scale=grad_scale)
    on = [i for i in range(n) if adapts[i]]
    off = [i for i in range(n) if not adapts[i]]
    if on:
        w = torch._foreach_norm(_pick(xs, on))
        u = torch._foreach_norm(_pick(us, on))
        w_all, u_all = torch.stack(w), torch.stack(u)
        phi = w_all if trust_clamp is None else w_all.clamp(max=trust_clamp)
        ratio = _trust_ratio(w_all, u_all, phi, u_all)
        torch._foreach_mul_(_pick(us, on), list((lr * ratio).unbind()))
    if off:
        torch._foreach_mul_(_pick(us, off), lr)
    torch._foreach_sub_(xs, us)
    _write_back(params, xs)


@torch.no_grad()
def adamw_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
               exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
               step: int, lr: Scalar, beta1: float, beta2: float, eps: float,
               weight_decays, bias_correction: bool = True,
               grad_scale: Scalar = 1.0) -> None:
    """AdamW as ``optim_reference.adamw_step``, on tensor lists."""
    _check_step(step)
    n = _check_lengths(params=params, grads=grads, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs)
    if n == 0:
        return
    wds = _per_tensor(weight_decays, n, "weight_decays")
    xs = _math_tensors(params)
    us = _adam_directions(xs, grads, list(exp_avgs), list(exp_avg_sqs), wds, step=step,
                          beta1=beta1, beta2=beta2, eps=eps, bias_correction=bias_correction,
                          grad_scale=grad_scale)
    torch._foreach_mul_(us, lr)
    torch._foreach_sub_(xs, us)
    _write_back(params, xs)


@torch.no_grad()
def lars_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
              momentum_buffers: Sequence[torch.Tensor], *, lr: Scalar, momentum: float,
              trust_coefficient: float, eps: float, weight_decays, adapt_flags,
              grad_scale: Scalar = 1.0) -> None:
    """LARS as ``optim_reference.lars_step``, on tensor lists."""
    n = _check_lengths(params=params, grads=grads, momentum_buffers=momentum_buffers)
    if n == 0:
        return
    wds = _per_tensor(weight_decays, n, "weight_decays")
    adapts = _per_tensor(adapt_flags, n, "adapt_flags")
    ws = _math_tensors(params)
    gs = _scaled_grads(grads, grad_scale)
    ds = list(gs)  # d = g + λw (a new tensor where λ ≠ 0; g itself otherwise, never modified)
    for wd, idx in _subsets(wds, n).items():
        if wd != 0.0:
            summed = torch._foreach_add(_pick(gs, idx), torch._foreach_mul(_pick(ws, idx), wd))
            for i, d in zip(idx, summed):
                ds[i] = d
    on = [i for i in range(n) if adapts[i]]
    off = [i for i in range(n) if not adapts[i]]
    steps: list = [None] * n
    if on:
        w = torch.stack(torch._foreach_norm(_pick(ws, on)))
        g = torch.stack(torch._foreach_norm(_pick(gs, on)))
        wd = _small([wds[i] for i in on], w)
        local = _trust_ratio(w, g, trust_coefficient * w, g + wd * w + eps)
        for i, s in zip(on, torch._foreach_mul(_pick(ds, on), list((lr * local).unbind()))):
            steps[i] = s
    if off:
        for i, s in zip(off, torch._foreach_mul(_pick(ds, off), lr)):
            steps[i] = s
    bufs = list(momentum_buffers)
    torch._foreach_mul_(bufs, momentum)
    torch._foreach_add_(bufs, steps)
    torch._foreach_sub_(ws, bufs)
    _write_back(params, ws)
