"""16-bit GEMMs on a CPU, computed as a GPU computes them: the bf16/fp16 operands multiplied
and accumulated in fp32, the result rounded once to the operands' dtype.

Why: a CPU without bf16 units (AVX2, the development machine) runs torch's bf16 ``mm`` about
ten times slower than fp32 (the CPU benchmark's bf16_master step: 10.5 s, 82 % of it in
``aten::mm``, against ~0.8 s in fp32), which would make a convergence check of the bf16
precisions on CPU take hours. A bf16 product is exact in fp32, so an fp32 GEMM of the upcast
operands is a tensor-core GEMM's arithmetic (bf16 products, fp32 accumulation, one rounding of
the output) up to the order of the accumulation - which is what a CPU check of a GPU
precision wants, at fp32's speed plus three casts.

Owns: ``linear`` (``F.linear``'s forward and backward in that arithmetic: each gradient GEMM
also in fp32 and rounded once), ``linear_reference`` (the same through autograd's own fp32
ops), and ``Fp32Gemms``, a torch-function mode that sends every ``F.linear`` on 16-bit CPU
tensors inside it to ``linear`` (runtime.model.precision enters it around the step's forward
on CPU).
Never: touches CUDA tensors or fp32 ones (they pass through unchanged), or other ops (the
attention's batched matmuls stay torch's own: a small share of the step here).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_HALF = (torch.bfloat16, torch.float16)


def linear_reference(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The meaning: fp32 ``F.linear`` of the upcast operands, the output rounded to x's dtype
    (autograd rounds each gradient to its input's dtype at the casts)."""
    y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return linear_reference(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.float().reshape(-1, grad.shape[-1])
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (grad.float() @ weight.float()).to(x.dtype)
        if ctx.needs_input_grad[1]:
            gw = (g.t() @ x.float().reshape(-1, x.shape[-1])).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.sum(0).to(weight.dtype)
        return gx, gw, gb


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """``F.linear`` with fp32 arithmetic for 16-bit operands (see the module docstring)."""
    return _Linear.apply(x, weight, bias)


class Fp32Gemms(TorchFunctionMode):
    """Inside: ``F.linear`` on 16-bit CPU tensors runs as ``linear``; everything else as is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and args and isinstance(args[0], torch.Tensor) \
                and args[0].dtype in _HALF and args[0].device.type == "cpu":
            return linear(*args, **kwargs)
        return func(*args, **kwargs)
