"""The model's arithmetic over a batch: the FLOPs of a training step and the attention path's
cost layout - what the trainer reports (achieved TFLOP/s and MFU) and the balancer's cost
model compute from. The shape, the named sizes (``SIZES``, ``size``), the parameter count and
the per-unit FLOP formula are basis.model_shape's (torch-free, one statement), re-exported
here for the runtime's callers.

Owns:
  * ``step_flops`` (``batch_flops`` of a collated batch): the model FLOPs of a training
    step - forward and backward, 3 x the forward (the backward computes the gradients of
    activations and of weights, each a forward's worth) - of the *real* tokens: the dense
    layers 2·(4H² + 2·H·I) per token and layer, the attention 4·H·n² per sequence of n
    tokens and layer (QKᵀ and the weighted values), the masked-LM head 2·(H² + H·V) per
    masked position, the pooler and NSP head 2·(H² + 2·H) per sequence. These per-unit
    figures are written once, in basis.model_shape.forward_flops_per_unit, for this sum and
    the balancer's FLOP-count cost alike. Padding,
    recomputation and kernels' own overheads are not the model's work: achieved / peak of
    these is the MFU of PaLM (Chowdhery et al. 2022, appendix B), torchtitan's and nanoGPT's
    ``estimate_mfu``. tests/unit/test_arithmetic.py holds the formula to torch's
    FlopCounterMode on the built model, tests/unit/test_length_cost.py the cost to it;
  * ``attention_layout``: ``model.attention`` and the kernel as the length-cost layout
    (kernels.attention_rule: the same rule the kernels follow), and ``computed_tokens``: the
    tokens a layout computes on (what the balance meter counts).
Never: imports torch (the pre-launch memory check and the config use it), builds a model, or
knows a device's peak (runtime.observe.mfu).
"""
from __future__ import annotations

from typing import Any, Sequence

from kernels.attention_rule import cost_layout
from basis.model_shape import forward_flops_per_unit


def forward_flops(m: Any, *, real_tokens: int, squared_lengths: int, masked: int,
                  sequences: int) -> float:
    """The model FLOPs of one forward over sequences holding ``real_tokens`` in all (Σ n),
    ``squared_lengths`` (Σ n²), ``masked`` masked-LM positions and ``sequences`` [CLS]s: the
    per-unit FLOPs of basis.model_shape.forward_flops_per_unit (the one statement of the
    formula, which the balancer's FLOP-count default reads too), summed."""
    per = forward_flops_per_unit(m)
    return float(per["token"] * real_tokens + per["score"] * squared_lengths
                 + per["masked"] * masked + per["sequence"] * sequences)


def step_flops(m: Any, *, real_tokens: int, squared_lengths: int, masked: int,
               sequences: int) -> float:
    """Forward + backward: 3 x ``forward_flops`` (see the module docstring)."""
    return 3.0 * forward_flops(m, real_tokens=real_tokens, squared_lengths=squared_lengths,
                               masked=masked, sequences=sequences)


def batch_work(sequence_lengths: Sequence[Sequence[int]]) -> dict[str, int]:
    """Σ n, Σ n² and the sequence count of a batch's rows (each a list of its sequences'
    lengths, ``loaders.collate.Batch.sequence_lengths``)."""
    lengths = [n for row in sequence_lengths for n in row]
    return {"real_tokens": sum(lengths), "squared_lengths": sum(n * n for n in lengths),
            "sequences": len(lengths)}


def batch_flops(m: Any, batch: Any) -> float:
    """The model FLOPs of one host micro-batch (a loaders.collate.Batch): ``step_flops`` of
    its real tokens, Σ n², masked positions and sequences."""
    lengths, masked = batch.host_work()
    return step_flops(m, masked=masked, **batch_work(lengths))


def attention_layout(attention: str, device_type: str, kernel: str = "auto",
                     cuda_varlen_ok: bool | None = None) -> str:
    """The length-cost layout of ``model.attention`` with ``kernel`` on ``device_type``
    (kernels.attention_rule: the rule the attention kernels resolve ``auto`` by).
    ``cuda_varlen_ok`` None: asked of torch on a CUDA device (as the kernel asks)."""
    if cuda_varlen_ok is None:
        cuda_varlen_ok = True
        if device_type == "cuda":
            from kernels.attention import cuda_varlen_available  # torch: only on a GPU rank
            cuda_varlen_ok = cuda_varlen_available()
    return cost_layout(attention, device_type, kernel, cuda_varlen_ok)


def computed_tokens(layout: str, *, padded_tokens: int, layout_tokens: int) -> int:
    """The tokens a layout computes the dense layers on: every padded slot ('padded'), the
    tokens of the batch's layout otherwise (its real tokens; every slot of a static batch)."""
    return padded_tokens if layout == "padded" else layout_tokens
