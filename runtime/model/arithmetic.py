"""The model's arithmetic: named sizes, the parameter count, the FLOPs of a training step and
the attention path's cost layout - what the trainer reports (achieved TFLOP/s and MFU), the
memory check and the balancer's cost model compute from, in one room.

Owns:
  * ``SIZES``: the named shapes (``tiny``: the test suite's; ``base``, ``large``: BERT's,
    Devlin et al. 2019) that configs, tests and benchmarks name instead of writing sizes out;
  * ``parameter_count``: BertForPreTraining's parameters, the tied decoder counted once
    (tests/unit/test_arithmetic.py holds it to the built model's count);
  * ``step_flops`` (``batch_flops`` of a collated batch): the model FLOPs of a training
    step - forward and backward, 3 x the forward (the backward computes the gradients of
    activations and of weights, each a forward's worth) - of the *real* tokens: the dense
    layers 2·(4H² + 2·H·I) per token and layer, the attention 4·H·n² per sequence of n
    tokens and layer (QKᵀ and the weighted values), the masked-LM head 2·(H² + H·V) per
    masked position, the pooler and NSP head 2·(H² + 2·H) per sequence. These per-unit
    figures are written once, in loaders.length_cost.forward_flops_per_unit (a leaf this room
    may import), for this sum and the balancer's FLOP-count cost alike. Padding,
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
from loaders.length_cost import forward_flops_per_unit

SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=2,
                 intermediate_size=128),
    "base": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12,
                 intermediate_size=3072),
    "large": dict(num_hidden_layers=24, hidden_size=1024, num_attention_heads=16,
                  intermediate_size=4096),
}
"""Named model shapes (the vocabulary, positions and dropout are the config's)."""


def size(name: str) -> dict[str, int]:
    """The shape called ``name`` (a copy), or a ValueError naming the sizes there are."""
    try:
        return dict(SIZES[name])
    except KeyError:
        raise ValueError(f"unknown model size {name!r}; the sizes are "
                         f"{', '.join(SIZES)}") from None


def _get(m: Any, key: str) -> int:
    return int(m[key] if isinstance(m, dict) else getattr(m, key))


def parameter_count(m: Any) -> int:
    """Parameters of BertForPreTraining with the tied decoder counted once; ``m`` a BertConfig,
    the config's ``[model]`` section or a dict of their fields."""
    h, i, v = _get(m, "hidden_size"), _get(m, "intermediate_size"), _get(m, "vocab_size")
    embeddings = (v + _get(m, "max_position_embeddings") + _get(m, "type_vocab_size")) * h \
        + 2 * h
    layer = 4 * (h * h + h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h
    pooler = h * h + h
    mlm = (h * h + h) + 2 * h + v          # transform, its LayerNorm, the decoder's bias
    nsp = 2 * h + 2
    return embeddings + _get(m, "num_hidden_layers") * layer + pooler + mlm + nsp


def forward_flops(m: Any, *, real_tokens: int, squared_lengths: int, masked: int,
                  sequences: int) -> float:
    """The model FLOPs of one forward over sequences holding ``real_tokens`` in all (Σ n),
    ``squared_lengths`` (Σ n²), ``masked`` masked-LM positions and ``sequences`` [CLS]s: the
    per-unit FLOPs of loaders.length_cost.forward_flops_per_unit (the one statement of the
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
