"""Whole encoder layers compiled with Inductor (``model.compile = 'layers'``), applied from
outside the model as torchtitan compiles each transformer block: the model is written eager,
for one device; its converter (runtime.model.converters ``CompiledLayers``, the last row of the
list the builder applies) hands it here after its weights are set and the other changes made.

Owns: ``compile_layers(model, static_shapes)``: each ``BertLayer``'s forward becomes a
``CompiledLayer`` - its own ``forward`` compiled by ``torch.compile(fullgraph=True)`` (forward
and, through AOTAutograd, backward; no graph break, so a layer is a handful of generated
kernels around its GEMMs and attention); the choice of what is dynamic:

  * ``static_shapes`` (data.shapes = 'static': every batch alike, what CUDA graphs replay):
    ``dynamic=False``, every size a constant;
  * otherwise ``dynamic=True``: every dimension of the batch symbolic - tokens, sequences,
    the longest sequence (the layout's ``max_len``, a Python int that repad's width and the
    flash kernel take: an int cannot be marked dynamic, and under ``dynamic=False`` each new
    longest sequence would be a recompile) - while the parameters keep static shapes
    (``torch._dynamo.config.force_parameter_static_shapes``, on by default), so the hidden
    and intermediate widths are constants in the generated code (LayerNorm a persistent
    reduction; tests/integration/test_compile_layers.py reads them there). The token
    dimensions are also marked (``torch._dynamo.mark_dynamic``), so a change that
    specialised them would fail the compile instead of recompiling every batch; and "duck
    sizing" is off while a layer compiles (``use_duck_shape``): by default dimensions of
    equal size share one symbol, so a padded batch 128 wide at hidden size 128 had its width
    specialised with the hidden size.

Every layer has the same code and parameter shapes, so one graph serves all of them (the
parameters are graph inputs): compiled once for training and once for evaluation (another
``training`` flag, no gradient). "The same code" is one model's copy of the layer's code
object (``model_code``): Dynamo keeps graphs per code object, and another model in the same
process compiles into a list of its own. The layout's lazily cast offsets are made before the first
layer - made inside it, they would be a side effect that gives the second layer a graph of
its own.

With the CUDA-graph modes (runtime.train.graphs): a layer is compiled in the eager warm-up
steps and its generated kernels are captured with the rest of the step; Inductor's own CUDA
graphs stay off (``triton.cudagraphs``: one capture, Presto's). The compiled fusions of
kernels.fused are not used beside it (the config refuses them; a model built with them here
traces their references into the layer's graph).

Known, not fixed (torch 2.13.0+cpu, 2026-12-01): on a CPU at one thread a rank
(OMP_NUM_THREADS=1), a trainer run of the dynamic-shape fp32 layers failed in the compiled
forward, which called the CPU flash attention's backward without its output gradient
("TypeError: expected Tensor() for op _scaled_dot_product_flash_attention_for_cpu_backward");
at two threads, and with static shapes or bf16 at one, the same runs pass
(tests/integration/test_compile_layers.py). The GPU path (flash varlen) is not this code.

Never: reads the config, changes parameters, the state dict or what a layer computes (the
reference is the eager layer: the tests hold the two equal), or compiles anything outside the
encoder layers (embeddings, heads and loss stay eager).
"""
from __future__ import annotations

import types
from typing import Callable

import torch
import torch.fx.experimental._config as fx_config
from torch import nn

from kernels.own_code import with_own_code
from runtime.model.bert import BertForPreTraining, Unpadded

INDUCTOR_OPTIONS = {"triton.cudagraphs": False}
"""Inductor's own CUDA graphs off whatever the environment says: train.cuda_graphs captures."""


class CompiledLayer:
    """A ``BertLayer``'s forward, compiled (see the module docstring). ``eager`` is the
    layer's own forward (the reference), run through ``code``: the model's own copy of its
    code object (``model_code``)."""

    def __init__(self, layer: nn.Module, static_shapes: bool, code: types.CodeType):
        f = type(layer).forward
        self.eager: Callable = types.MethodType(with_own_code(f, code), layer)
        self.static_shapes = static_shapes
        self.compiled = torch.compile(self.eager, fullgraph=True, dynamic=not static_shapes,
                                      options=INDUCTOR_OPTIONS)

    def __call__(self, x: torch.Tensor, key_mask) -> torch.Tensor:
        if isinstance(key_mask, Unpadded):
            key_mask.varlen.offsets  # made here, outside: see the module docstring
        if self.static_shapes:
            return self.compiled(x, key_mask)
        _mark_tokens(x, key_mask)
        duck = fx_config.use_duck_shape  # (read when a compile makes its shape environment)
        fx_config.use_duck_shape = False
        try:
            return self.compiled(x, key_mask)
        finally:
            fx_config.use_duck_shape = duck


def _mark_tokens(x: torch.Tensor, key_mask) -> None:
    """The token dimensions of a layer's inputs marked dynamic: x's leading ones ([T, H]
    unpadded, [b, L, H] padded) and the unpadded layout's per-token and per-sequence
    tensors. Sizes 0 and 1 are left alone (torch specialises them)."""
    marks = [(x, d) for d in range(x.dim() - 1)]
    if isinstance(key_mask, Unpadded):
        v = key_mask.varlen
        marks += [(t, 0) for t in (v.token_in_seq, v.seq_of_token, v.cu_seqlens, v.offsets)]
    for t, d in marks:
        if t.shape[d] > 1:
            torch._dynamo.mark_dynamic(t, d)


def compile_layers(model: BertForPreTraining, static_shapes: bool) -> int:
    """Each encoder layer of ``model`` compiled (``model.compile = 'layers'``), in place: the
    parameters, their names and the state dict stay as they are. Returns the layers
    compiled. Compiling happens at each layer's first call."""
    layers = model.bert.encoder.layer
    code = model_code(type(layers[0]).forward)
    for i, layer in enumerate(layers):
        if isinstance(layer.forward, CompiledLayer):
            raise ValueError(f"encoder layer {i} is compiled already")
        layer.forward = CompiledLayer(layer, static_shapes, code)
    return len(layers)


def model_code(forward: Callable) -> types.CodeType:
    """A copy of ``forward``'s code object for one model's layers. Dynamo keeps its compiled
    graphs on the code object it compiles, and fails a ``fullgraph`` compile once one code
    object holds ``recompile_limit`` (8) graphs: with the class's own code, every model a
    process builds (a test module, a benchmark of several cases, each static batch shape a
    graph of its own) would add to one list until the ninth graph failed - CI failed so on
    a bf16 run after other tests' models. Per model, the list holds that model's graphs
    (training and evaluation), and goes with the model."""
    return forward.__code__.replace()


def compiled_layers(model: nn.Module) -> list[CompiledLayer]:
    """The compiled layers of ``model`` (none for an eager one)."""
    return [m.forward for m in model.modules() if isinstance(m.forward, CompiledLayer)]
