"""The fusions a model can use (``model.fusions``), by name: declared here, torch-free, so the
config checks them without importing torch; the kernels are kernels.fused's, the padded
vocabulary runtime.model.bert's, the one QKV projection runtime.model.converters'.

Owns: ``FUSIONS``, ``CONVERTED`` (the ones made on a built model), ``COMPILED`` (the ones
kernels.fused compiles), ``check_fusions``.
Never: imports torch or implements a kernel.
"""
from __future__ import annotations

FUSIONS = ("bias_gelu", "dropout_add_norm", "pad_vocab", "qkv")
"""bias_gelu: GELU(y + bias) after the intermediate GEMM, one pass; dropout_add_norm:
LayerNorm(dropout(y + bias) + residual) after the attention-output and output GEMMs, one
pass; pad_vocab: the tied embedding and the MLM decoder GEMM on a vocabulary padded to a
multiple of 64; qkv: each layer's Q, K and V projections as one [3H, H] GEMM with one bias."""

CONVERTED = ("qkv",)
"""The fusions made on a built model (runtime.model.converters: a row of the same name) rather
than by its constructor - runtime.model.bert refuses them there."""

COMPILED = ("bias_gelu", "dropout_add_norm")
"""The fusions that are compiled functions of their own (kernels.fused); what a compiled whole
layer (model.compile = 'layers') already does, so the config refuses them together."""


def check_fusions(names) -> None:
    """ValueError naming an unknown fusion and the ones there are."""
    unknown = [n for n in names if n not in FUSIONS]
    if unknown:
        raise ValueError(f"unknown fusion(s) {', '.join(map(repr, unknown))}; choose from "
                         f"{', '.join(FUSIONS)}")
