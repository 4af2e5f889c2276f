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
C++/OpenMP on CPU) with only the token dimension dynamic: every tensor of a token's width is
seen as [tokens, width] and its token dimension marked dynamic (``torch._dynamo.mark_dynamic``)
under ``dynamic=False``, so the hidden and intermediate widths are constants in the generated
kernels - LayerNorm's row reduction can be a persistent one, and nothing is recompiled per
batch (tests/integration/test_fused.py counts compiles over an epoch of real batches and reads
the widths in the generated code). Compiling with every dimension symbolic
(``dynamic=True``, before) made the widths symbolic too - looped LayerNorm reductions: the
likely cause of the fusions' 8.5 % loss on an H200 (docs/benchmarks/gpu.md). Inductor tunes
its kernels (block sizes, reduction splits) for the token count of the first call: compile
at a representative batch (a run's batches are alike; bench.gpu re-compiles at the batch it
measures). The route of NVIDIA's MLPerf BERT (nvFuser-scripted bias-GELU and dropout-add,
apex's LayerNorm) and MosaicBERT (fused LayerNorm, GELU, dropout-add), without CUDA code of our
own. Where compiling fails the reference runs, after one warning (the numbers are the same),
and ``fallbacks()`` says so (bench.gpu writes it into the case's record: a fused case that
ran the reference must not pass for fused). Only a failure at the first call falls back: a
device out of memory (``torch.OutOfMemoryError``) is raised whenever it comes - a memory
limit is the caller's to handle, not a compile failure -, and so is any error after a first
call succeeded (compiled code that ran once is not failing to compile). Inside another
compiled region (model.compile = 'layers' on a model built with the fusions) the reference
is traced into that region's graph.

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


def _as_token_rows(t):
    """A tensor of a token's width as [tokens, width], its token dimension marked dynamic;
    1-D tensors (biases, LayerNorm weights) and non-tensors as they are."""
    if not isinstance(t, torch.Tensor) or t.dim() < 2:
        return t
    rows = t.reshape(-1, t.shape[-1])  # a view: GEMM outputs and the residual are contiguous
    if rows.shape[0] > 1:  # (torch specialises sizes 0 and 1: such a batch gets its own graph)
        torch._dynamo.mark_dynamic(rows, 0)
    return rows


class _Compiled:
    """``fn`` compiled on its first call, only the token dimension dynamic (see the module
    docstring); the reference after its first call failed (``failed``: why), and inside
    another compiled region."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.compiled: Callable | None = None
        self.failed: str | None = None  # why the reference runs instead (None: it does not)
        self.ran = False  # a compiled call has succeeded

    def __call__(self, y: torch.Tensor, *args):
        if torch.compiler.is_compiling():  # traced into a compiled layer: its graph fuses it
            return self.fn(y, *args)
        if self.failed is None:
            if self.compiled is None:
                self.compiled = torch.compile(self.fn, dynamic=False, fullgraph=True)
            try:
                out = self.compiled(_as_token_rows(y), *map(_as_token_rows, args))
            except torch.OutOfMemoryError:
                raise  # the device's memory, not the compile: the caller's to handle
            except Exception as e:  # noqa: BLE001 - a failure to compile, at the first call
                if self.ran:
                    raise  # compiled code that ran before: not a compile failure
                first = (str(e).strip().splitlines() or [""])[0][:300]
                self.failed = f"{type(e).__name__}: {first}"
                warnings.warn(f"fused {self.fn.__name__}: torch.compile failed "
                              f"({self.failed}); running the reference instead "
                              "(same numbers, more kernels)", RuntimeWarning, stacklevel=2)
                return self.fn(y, *args)
            self.ran = True
            return out.view(*y.shape[:-1], out.shape[-1])
        return self.fn(y, *args)


bias_gelu = _Compiled(bias_gelu_reference)
bias_dropout_add_layer_norm = _Compiled(bias_dropout_add_layer_norm_reference)
BY_FUSION = {"bias_gelu": bias_gelu, "dropout_add_norm": bias_dropout_add_layer_norm}
"""The compiled kernels by their model.fusions name."""


def fallbacks() -> dict[str, str]:
    """{model.fusions name: why its reference runs instead} of the kernels whose compile
    failed in this process ({}: every fused kernel compiled, or none was called)."""
    return {name: k.failed for name, k in BY_FUSION.items() if k.failed is not None}
