"""The fused optimizer steps' passes (kernels.optim_flat): plain-torch functions over
(rows, 1024) views of the flat buffers, which torch.compile compiles into one loop each.

Each pass reads the rows it needs and writes its results in place; per-tensor (or per norm
block) inputs are tables indexed by ``seg`` (each row's tensor or block) inside the kernel:
``t`` a table (one column per hyperparameter, see the step methods), ``keep`` the active mask,
``lr`` the step size; ``gs`` is the 0-dim grad_scale. The ``*_master`` passes step fp32
master weights ``w`` (train.precision '*_master': the parameters ``p`` are bf16/fp16) and write
the parameters' copy after the update; their pass 1 reads x from ``w`` (the caller passes the
master rows as the first argument).

Owns: the arithmetic of each pass, operation for operation kernels.optim_reference's.
Never: lays out buffers, compiles, or chooses a pass (kernels.optim_flat's steps do).
"""
from __future__ import annotations

import torch

# Each pass works on (rows, ROW) views. Per-tensor inputs, indexed by `seg` (each row's
# tensor) inside the kernel: `t` a table (one column per hyperparameter, see the step
# methods), `keep` the active mask, `lr` the step size; `gs` is the 0-dim grad_scale.

def _col(t: torch.Tensor, i: int) -> torch.Tensor:
    return t[:, i:i + 1]


def _adam_direction(x, m, v, t):
    """u = (m/bc1)/(√(v/bc2) + ε) + λx with t columns 0 λ, 5 bc1, 6 bc2, 7 ε."""
    return (m / _col(t, 5)) / ((v / _col(t, 6)).sqrt() + _col(t, 7)) + _col(t, 0) * x


def _moments(g, m, v, keep, t, gs):
    """New (m, v) where keep, old ones elsewhere; t columns 1 β1, 2 1−β1, 3 β2, 4 1−β2."""
    gg = g.to(m.dtype) * gs
    m_new = torch.where(keep, m * _col(t, 1) + gg * _col(t, 2), m)
    v_new = torch.where(keep, v * _col(t, 3) + _col(t, 4) * gg * gg, v)
    return m_new, v_new


def _lamb_moments(p, g, m, v, keep, t, seg, gs):
    """Pass 1's common part: m, v updated in place; returns (per-row keep, x, u)."""
    keep, t = keep[seg][:, None], t[seg]
    x = p.to(m.dtype)
    m_new, v_new = _moments(g, m, v, keep, t, gs)
    u = _adam_direction(x, m_new, v_new, t)
    m.copy_(m_new)
    v.copy_(v_new)
    return keep, x, u


def lamb_pass1(p, g, m, v, keep, t, seg, gs):
    """LAMB pass 1: m, v updated in place; returns per-row (Σx², Σu²)."""
    _, x, u = _lamb_moments(p, g, m, v, keep, t, seg, gs)
    return (x * x).sum(1), (u * u).sum(1)


def lamb_pass1_store(p, g, m, v, keep, t, seg, gs):
    """LAMB pass 1 that also stores the update: as ``lamb_pass1``, and u written over the
    gradient rows ``g`` of the active tensors in their dtype (the gradient is not read after
    this pass; an inactive tensor's stays). The row sums are of u before that rounding."""
    keep, x, u = _lamb_moments(p, g, m, v, keep, t, seg, gs)
    sums = (x * x).sum(1), (u * u).sum(1)
    # the store after the sums: written before them, Inductor's C++ outer-loop fusion fails
    # on a bf16 g (KeyError 'buf0', torch 2.13); the loop it compiles is the same one
    g.copy_(torch.where(keep, u.to(g.dtype), g))
    return sums


def lamb_pass2_stored(p, u, keep, seg, lr):
    """LAMB pass 2 on the update ``u`` that ``lamb_pass1_store`` stored: p ← x − (lr·ratio)·u."""
    x = p.to(torch.promote_types(p.dtype, torch.float32))
    p.copy_(torch.where(keep[seg][:, None], x - lr[seg][:, None] * u.to(x.dtype), x)
            .to(p.dtype))


def lamb_pass2_master_stored(p, w, u, keep, seg, lr):
    """``lamb_pass2_stored`` on fp32 master weights ``w``; the model's copy p ← w."""
    new = torch.where(keep[seg][:, None], w - lr[seg][:, None] * u.to(w.dtype), w)
    w.copy_(new)
    p.copy_(new.to(p.dtype))


def lamb_pass2(p, m, v, keep, t, seg, lr):
    """LAMB pass 2: p ← x − (lr·ratio)·u, u recomputed from the updated m, v."""
    x = p.to(m.dtype)
    u = _adam_direction(x, m, v, t[seg])
    p.copy_(torch.where(keep[seg][:, None], x - lr[seg][:, None] * u, x).to(p.dtype))


def lamb_pass2_master(p, w, m, v, keep, t, seg, lr):
    """LAMB pass 2 with fp32 master weights ``w``: w ← x − (lr·ratio)·u, then the model's
    copy p ← w in p's dtype (pass 1 read x from w)."""
    x = w
    u = _adam_direction(x, m, v, t[seg])
    new = torch.where(keep[seg][:, None], x - lr[seg][:, None] * u, x)
    w.copy_(new)
    p.copy_(new.to(p.dtype))


def adamw_pass(p, g, m, v, keep, t, seg, gs):
    """AdamW in one pass: m, v, p updated in place; t column 8 is lr."""
    keep, t = keep[seg][:, None], t[seg]
    x = p.to(m.dtype)
    m_new, v_new = _moments(g, m, v, keep, t, gs)
    u = _adam_direction(x, m_new, v_new, t)
    m.copy_(m_new)
    v.copy_(v_new)
    p.copy_(torch.where(keep, x - _col(t, 8) * u, x).to(p.dtype))


def adamw_pass_master(p, w, g, m, v, keep, t, seg, gs):
    """AdamW in one pass on fp32 master weights ``w``; the model's copy p ← w."""
    keep, t = keep[seg][:, None], t[seg]
    x = w
    m_new, v_new = _moments(g, m, v, keep, t, gs)
    u = _adam_direction(x, m_new, v_new, t)
    m.copy_(m_new)
    v.copy_(v_new)
    new = torch.where(keep, x - _col(t, 8) * u, x)
    w.copy_(new)
    p.copy_(new.to(p.dtype))


def lars_pass1(p, g, gs):
    """LARS pass 1: per-row (Σw², Σ(grad_scale·g)²); nothing written."""
    x = p.to(torch.promote_types(p.dtype, torch.float32))
    gg = g.to(x.dtype) * gs
    return (x * x).sum(1), (gg * gg).sum(1)


def lars_pass2(p, g, buf, keep, t, seg, gs, lr):
    """LARS pass 2: buf ← μ·buf + (lr·local_lr)·(g + λw); w ← w − buf. t: 0 λ, 1 μ."""
    keep, t = keep[seg][:, None], t[seg]
    x = p.to(buf.dtype)
    d = g.to(buf.dtype) * gs + _col(t, 0) * x
    buf_new = torch.where(keep, buf * _col(t, 1) + lr[seg][:, None] * d, buf)
    buf.copy_(buf_new)
    p.copy_(torch.where(keep, x - buf_new, x).to(p.dtype))


def lars_pass2_master(p, w, g, buf, keep, t, seg, gs, lr):
    """LARS pass 2 on fp32 master weights ``w`` (pass 1 read w); the model's copy p ← w."""
    keep, t = keep[seg][:, None], t[seg]
    x = w
    d = g.to(buf.dtype) * gs + _col(t, 0) * x
    buf_new = torch.where(keep, buf * _col(t, 1) + lr[seg][:, None] * d, buf)
    buf.copy_(buf_new)
    new = torch.where(keep, x - buf_new, x)
    w.copy_(new)
    p.copy_(new.to(p.dtype))
