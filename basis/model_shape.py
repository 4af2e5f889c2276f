"""The model's shape and cost, stated once, with no torch: which config fields make BERT's
shape, the named sizes, the parameter count and the FLOPs of a forward per unit of work.

Every room that needs them imports this one: the balancer's FLOP-count cost
(loaders.length_cost), the trainer's FLOPs, TFLOP/s and MFU and the memory check
(runtime.model.arithmetic, runtime.train.memory), the config's ``model.size``
(runtime.config), the converter's sizes, the report's check of a closed-division model
(submission.report), the benchmarks. It sits in basis/, the room below loaders and runtime:
the balancer (loaders) and the trainer (runtime) both need the formula, and neither may
import the other.

Owns:
  * ``SHAPE_KEYS``: the fields a shape is (HF config.json's names, runtime.model.config's
    ``BertConfig``), ``shape_of`` (them, from a config object or dict);
  * ``SIZES``: the named shapes (``tiny``: the test suite's; ``base``, ``large``: BERT's,
    Devlin et al. 2019), ``size(name)``, and ``sized``: what ``model.size`` beside shape keys
    means (the run config's rule and the converter's);
  * ``parameter_count``: BertForPreTraining's parameters, the tied decoder counted once
    (tests/unit/test_arithmetic.py holds it to the built model's count);
  * ``forward_flops_per_unit``: the FLOP formula (see its docstring), which
    runtime.model.arithmetic sums over a batch and loaders.length_cost lays on its features.
Never: imports anything but the standard library (no torch, nothing of the project), builds a
model, or knows a device.
"""
from __future__ import annotations

from typing import Any

SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
              "intermediate_size")
"""The fields a model's cost depends on (``max_position_embeddings`` and ``type_vocab_size``
add parameters, not FLOPs)."""

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


def sized(name: str, given: dict[str, int]) -> dict[str, int]:
    """The shape a ``[model]`` table means with ``size = name`` beside ``given`` (the shape
    keys it also sets): the size's keys; a key set to another value than the size's is
    refused (ValueError naming both: set one of them) - the one rule for a run config
    (runtime.config) and the converter's ``--config`` alike."""
    if name not in SIZES:
        raise ValueError(f"model.size={name!r}: choose one of {' | '.join(SIZES)}, or '' to "
                         f"give the shape keys")
    shape = size(name)
    for key, value in shape.items():
        if key in given and given[key] != value:
            raise ValueError(f"model.size={name!r} has {key}={value}, but model.{key}="
                             f"{given[key]} is set too: drop one of them")
    return shape


def _getter(m: Any):
    return (lambda k: int(m[k])) if isinstance(m, dict) else (lambda k: int(getattr(m, k)))


def shape_of(config: Any) -> dict:
    """The cost-relevant fields (``SHAPE_KEYS``) of a BertConfig-like object or dict."""
    get = _getter(config)
    return {k: get(k) for k in SHAPE_KEYS}


def parameter_count(m: Any) -> int:
    """Parameters of BertForPreTraining with the tied decoder counted once; ``m`` a BertConfig,
    the config's ``[model]`` section or a dict of their fields."""
    get = _getter(m)
    h, i, v = get("hidden_size"), get("intermediate_size"), get("vocab_size")
    embeddings = (v + get("max_position_embeddings") + get("type_vocab_size")) * h + 2 * h
    layer = 4 * (h * h + h) + 2 * h + (h * i + i) + (i * h + h) + 2 * h
    pooler = h * h + h
    mlm = (h * h + h) + 2 * h + v          # transform, its LayerNorm, the decoder's bias
    nsp = 2 * h + 2
    return embeddings + get("num_hidden_layers") * layer + pooler + mlm + nsp


def forward_flops_per_unit(shape: Any) -> dict[str, int]:
    """The model FLOPs of one forward per unit of work, for a BertConfig-like object or a dict
    of its fields: ``token`` the dense layers 2·layers·(4H² + 2·H·I) per real token, ``score``
    the attention 4·layers·H per score (QKᵀ and the weighted values; n² of them in a
    sequence of n tokens), ``masked`` the masked-LM head 2·(H² + H·V) per masked position,
    ``sequence`` the pooler and NSP head 2·(H² + 2·H) per sequence.

    The one statement of the formula: runtime.model.arithmetic sums it over a batch (the
    FLOPs the trainer reports, held to torch's FlopCounterMode), loaders.length_cost's
    ``flops_cost`` lays it on the balancer's features."""
    get = _getter(shape)
    h, i, v = get("hidden_size"), get("intermediate_size"), get("vocab_size")
    layers = get("num_hidden_layers")
    return {"token": 2 * layers * (4 * h * h + 2 * h * i), "score": 4 * layers * h,
            "masked": 2 * (h * h + h * v), "sequence": 2 * (h * h + 2 * h)}
