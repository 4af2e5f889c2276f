"""The run's numerics' torch side (runtime.numerics.Numerics: train.precision, model.fp8 and
train.allreduce_dtype resolved once): the torch dtype each dtype name stands for, the step's
autocast, and a model put in its parameter dtype with its fp32 values kept for the optimizer's
masters.

The rows themselves (what each precision is: parameter dtype, autocast, master weights, loss
scale, what it needs) are runtime.choices.PRECISIONS, torch-free. ``*_master`` precisions
(NVIDIA's MLPerf BERT keeps fp16 weights with fp32 masters inside its LAMB; MosaicBERT and
torchtitan keep bf16 compute over fp32 masters the same way) put the parameters - and so their
gradients and every gradient buffer - in bf16/fp16 and run the forward without autocast: no
weight is cast per step, no LayerNorm output cast back, no fp32 gradient accumulated. The
optimizer (runtime.optim, fused backend) keeps the fp32 masters and writes the model's copy.

Owns: ``DTYPES``, ``autocast`` (what the forward runs under), ``to_params_dtype``.
Never: decides which precision a run uses (the config; runtime.numerics resolves it), compares
a precision's name (it reads the resolved value), steps weights (runtime.optim), or scales
losses (runtime.optim.grad_scale).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from basis.dtypes import torch_dtypes
from kernels.cpu_gemm import Fp32Gemms
from runtime.numerics import Numerics

DTYPES: dict[str, torch.dtype] = torch_dtypes(torch)
"""The torch dtype each dtype name of the rows stands for (the names, their torch attributes
and their widths: basis.dtypes)."""


def autocast(n: Numerics, device: torch.device, cache: bool = True, cpu_gemms: bool = True):
    """What the step's forward runs under for the run's numerics ``n``: its autocast
    (``cache=False`` under CUDA graphs: a graph would replay the weight casts it captured
    once); for 16-bit parameters on a CPU, their GEMMs in a GPU's arithmetic at fp32's speed
    (kernels.cpu_gemm: bf16 GEMMs are ~10x slower than fp32 on a CPU without bf16 units;
    ``cpu_gemms=False`` on a CPU that stands in for a GPU - runtime.observe.hostsync's
    simulated device -, whose ops must be the GPU's); else nothing."""
    kind = torch.device(device).type
    if n.autocast is not None:
        return torch.autocast(kind, dtype=DTYPES[n.autocast], cache_enabled=cache)
    if n.narrow_params and kind == "cpu" and cpu_gemms:
        return Fp32Gemms()
    return contextlib.nullcontext()


def to_params_dtype(model: nn.Module, n: Numerics) -> Optional[dict]:
    """Put ``model``'s parameters in the dtype of the run's numerics ``n``. With master
    weights, returns each parameter's exact fp32 value before the cast ({id(param): tensor})
    for the optimizer to keep (``Optimizer.seed_masters``); None otherwise."""
    masters = {id(p): p.detach().to(torch.float32, copy=True) for p in model.parameters()} \
        if n.master else None
    if n.narrow_params:
        model.to(DTYPES[n.params])
    return masters
