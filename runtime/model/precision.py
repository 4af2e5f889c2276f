"""A ``train.precision`` row's torch side: the dtypes its names stand for, the step's autocast,
and a model put in its parameter dtype with its fp32 values kept for the optimizer's masters.

The rows themselves (what each precision is: parameter dtype, autocast, master weights, loss
scale, what it needs) are runtime.choices.PRECISIONS, torch-free. ``*_master`` precisions
(NVIDIA's MLPerf BERT keeps fp16 weights with fp32 masters inside its LAMB; MosaicBERT and
torchtitan keep bf16 compute over fp32 masters the same way) put the parameters - and so their
gradients and every gradient buffer - in bf16/fp16 and run the forward without autocast: no
weight is cast per step, no LayerNorm output cast back, no fp32 gradient accumulated. The
optimizer (runtime.optim, fused backend) keeps the fp32 masters and writes the model's copy.

Owns: ``DTYPES``, ``autocast`` (what the forward runs under), ``to_params_dtype``.
Never: decides which precision a run uses (the config), steps weights (runtime.optim), or
scales losses (runtime.optim.grad_scale).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from basis.dtypes import torch_dtypes
from kernels.cpu_gemm import Fp32Gemms
from runtime.choices import PRECISIONS, PrecisionMode

DTYPES: dict[str, torch.dtype] = torch_dtypes(torch)
"""The dtype each name of the rows stands for (the names: basis.dtypes)."""


def mode(name: str) -> PrecisionMode:
    return PRECISIONS[name]


def autocast(name: str, device: torch.device, cache: bool = True, cpu_gemms: bool = True):
    """What the step's forward runs under for precision ``name``: its row's autocast
    (``cache=False`` under CUDA graphs: a graph would replay the weight casts it captured
    once); for 16-bit parameters on a CPU, their GEMMs in a GPU's arithmetic at fp32's speed
    (kernels.cpu_gemm: bf16 GEMMs are ~10x slower than fp32 on a CPU without bf16 units;
    ``cpu_gemms=False`` on a CPU that stands in for a GPU - runtime.observe.hostsync's
    simulated device -, whose ops must be the GPU's); else nothing."""
    row = PRECISIONS[name]
    if row.autocast is None:
        if row.params != "fp32" and torch.device(device).type == "cpu" and cpu_gemms:
            return Fp32Gemms()
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=DTYPES[row.autocast],
                          cache_enabled=cache)


def to_params_dtype(model: nn.Module, name: str) -> Optional[dict]:
    """Put ``model``'s parameters in precision ``name``'s dtype. With master weights, returns
    each parameter's exact fp32 value before the cast ({id(param): tensor}) for the optimizer
    to keep (``Optimizer.seed_masters``); None otherwise."""
    row = PRECISIONS[name]
    dtype = DTYPES[row.params]
    masters = {id(p): p.detach().to(torch.float32, copy=True) for p in model.parameters()} \
        if row.master else None
    if dtype != torch.float32:
        model.to(dtype)
    return masters
