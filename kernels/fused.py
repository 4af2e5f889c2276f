"""Fused elementwise kernels of the BERT layer, each beside its plain-torch reference.

Owns:
  * ``bias_gelu(y, bias)``: GELU(y + bias) after a GEMM without bias (the intermediate
    layer's): one pass instead of a bias add and a GELU;
  * ``bias_dropout_add_layer_norm(y, bias, residual, weight, ln_bias, p, training, eps)``:
    LayerNorm(dropout(y + bias) + residual) after a GEMM without bias (the attention output's
    and the layer output's): one pass instead of four;
  * the kernels of two of the names ``model.fusions`` takes (kernels.fusions: ``bias_gelu``,
    ``dropout_add_norm``; ``pad_vocab`` is the model's: the MLM decoder on a vocabulary
    padded to a multiple of 64).
The fast versions are the references compiled by torch.compile (Inductor: Triton on CUDA,
C++/OpenMP on CPU) with dynamic shapes - one compile per dtype and training flag, none per
batch (tests/integration/test_fused.py counts them over an epoch of real batches) - the route
of NVIDIA's MLPerf BERT (nvFuser-scripted bias-GELU and dropout-add, apex's LayerNorm) and
MosaicBERT (fused LayerNorm, GELU, dropout-add), without CUDA code of our own. Where compiling
fails the reference runs, after one warning (the numbers are the same).

Never: owns parameters or decides which fusion a model uses (runtime.model.bert does, from the
config). Dropout masks of the compiled version come from Inductor's RNG, not eager torch's:
the two agree exactly only with p = 0 or in eval mode (what the tests check; a dropout rate
test covers p > 0).
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.nn.functional as F

from kernels.fusions import FUSIONS, check_fusions  # noqa: F401 - the names, torch-free


def bias_gelu_reference(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    # the bias in the GEMM output's dtype, as nn.Linear under autocast adds it
    return F.gelu(y + bias.to(y.dtype))  # erf form: HF's "gelu"


def bias_dropout_add_layer_norm_reference(y: torch.Tensor, bias: torch.Tensor,
                                          residual: torch.Tensor, weight: torch.Tensor,
                                          ln_bias: torch.Tensor, p: float, training: bool,
                                          eps: float) -> torch.Tensor:
    x = F.dropout(y + bias.to(y.dtype), p, training) + residual
    return F.layer_norm(x, (x.shape[-1],), weight, ln_bias, eps)


class _Compiled:
    """``fn`` compiled on its first call (dynamic shapes); the reference after a failure."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.compiled: Callable | None = None
        self.failed = False

    def __call__(self, *args):
        if not self.failed:
            if self.compiled is None:
                self.compiled = torch.compile(self.fn, dynamic=True, fullgraph=True)
            try:
                return self.compiled(*args)
            except Exception as e:  # noqa: BLE001 - compile errors come before any output
                self.failed = True
                first = (str(e).strip().splitlines() or [""])[0][:300]
                warnings.warn(f"fused {self.fn.__name__}: torch.compile failed "
                              f"({type(e).__name__}: {first}); running the reference instead "
                              "(same numbers, more kernels)", RuntimeWarning, stacklevel=2)
        return self.fn(*args)


bias_gelu = _Compiled(bias_gelu_reference)
bias_dropout_add_layer_norm = _Compiled(bias_dropout_add_layer_norm_reference)
