"""Google BERT's TensorFlow variable names, stated once: every pre-training weight
(``modeling.py`` and ``run_pretraining.py``), its shape and its Hugging Face key, and the
names TF trainers give optimizer state.

One list for the three that read or write such checkpoints: the converter
(runtime.model.convert maps each name to its HF key with ``map_name``), the benchmark that
writes a BERT-large checkpoint (bench/convert_crc.py) and the generator of the test fixture
written by real TensorFlow (tests/fixtures/tf_bert_tiny/make_fixture.py), both with
``variables``.

Owns: ``VARIABLES`` (rows: TF name, HF key, transposed, TF shape - ``{n}`` the encoder layer),
``variables`` (the names and shapes of a config, in the order Google's code creates them),
``map_name`` (a TF name's HF key and transposition, or None), and the optimizer state's names
(``SLOT``: ``<var>/adam_m``, ``<var>/LAMB`` ...; ``OPTIMIZER_STATE``: ``global_step`` ...).
Never: reads a checkpoint (runtime.model.tf_bundle), knows torch, or imports anything but the
standard library (basis/: the room below loaders and runtime).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

Dim = Union[str, int]   # a config field's name (its value), or a fixed size


@dataclass(frozen=True)
class Variable:
    """One TF variable: ``tf`` and ``hf`` with ``{n}`` for an encoder layer's number;
    ``transpose``: a TF kernel is [in, out], torch's Linear weight [out, in]; ``shape``: TF's,
    in config fields."""

    tf: str
    hf: str
    transpose: bool
    shape: tuple[Dim, ...]


H, I, V = "hidden_size", "intermediate_size", "vocab_size"
_LAYER, _HF_LAYER = "bert/encoder/layer_{n}", "bert.encoder.layer.{n}"


def _dense(tf: str, hf: str, out: Dim = H, into: Dim = H) -> tuple[Variable, Variable]:
    """A dense layer's kernel ([into, out] in TF) and bias."""
    return (Variable(f"{tf}/kernel", f"{hf}.weight", True, (into, out)),
            Variable(f"{tf}/bias", f"{hf}.bias", False, (out,)))


def _norm(tf: str, hf: str) -> tuple[Variable, Variable]:
    return (Variable(f"{tf}/gamma", f"{hf}.weight", False, (H,)),
            Variable(f"{tf}/beta", f"{hf}.bias", False, (H,)))


EMBEDDINGS = (
    Variable("bert/embeddings/word_embeddings", "bert.embeddings.word_embeddings.weight",
             False, (V, H)),
    Variable("bert/embeddings/token_type_embeddings",
             "bert.embeddings.token_type_embeddings.weight", False, ("type_vocab_size", H)),
    Variable("bert/embeddings/position_embeddings",
             "bert.embeddings.position_embeddings.weight", False, ("max_position_embeddings", H)),
    *_norm("bert/embeddings/LayerNorm", "bert.embeddings.LayerNorm"),
)
LAYER = (
    *(v for part in ("query", "key", "value")
      for v in _dense(f"{_LAYER}/attention/self/{part}", f"{_HF_LAYER}.attention.self.{part}")),
    *_dense(f"{_LAYER}/attention/output/dense", f"{_HF_LAYER}.attention.output.dense"),
    *_norm(f"{_LAYER}/attention/output/LayerNorm", f"{_HF_LAYER}.attention.output.LayerNorm"),
    *_dense(f"{_LAYER}/intermediate/dense", f"{_HF_LAYER}.intermediate.dense", out=I),
    *_dense(f"{_LAYER}/output/dense", f"{_HF_LAYER}.output.dense", into=I),
    *_norm(f"{_LAYER}/output/LayerNorm", f"{_HF_LAYER}.output.LayerNorm"),
)
HEADS = (
    *_dense("bert/pooler/dense", "bert.pooler.dense"),
    *_dense("cls/predictions/transform/dense", "cls.predictions.transform.dense"),
    *_norm("cls/predictions/transform/LayerNorm", "cls.predictions.transform.LayerNorm"),
    Variable("cls/predictions/output_bias", "cls.predictions.bias", False, (V,)),
    # [2, hidden] already, unlike a dense kernel: no transposition
    Variable("cls/seq_relationship/output_weights", "cls.seq_relationship.weight", False,
             (2, H)),
    Variable("cls/seq_relationship/output_bias", "cls.seq_relationship.bias", False, (2,)),
)
VARIABLES = EMBEDDINGS + LAYER + HEADS
"""Every weight of BertForPreTraining in TF, the layer's once (``{n}``)."""


def variables(cfg: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The TF variables of a BERT of config ``cfg`` (bert_config.json's fields) and their
    shapes, in the order Google's modeling.py and run_pretraining.py create them."""
    def shape(v: Variable) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else int(cfg[d]) for d in v.shape)
    out = [(v.tf, shape(v)) for v in EMBEDDINGS]
    for n in range(int(cfg["num_hidden_layers"])):
        out += [(v.tf.format(n=n), shape(v)) for v in LAYER]
    return out + [(v.tf, shape(v)) for v in HEADS]


@dataclass(frozen=True)
class Mapped:
    """A TF weight's name, its HF key, and whether its tensor is transposed on the way."""

    tf: str
    hf: str
    transpose: bool


_PATTERNS = tuple((re.compile(re.escape(v.tf).replace(re.escape("{n}"), r"(\d+)")), v)
                  for v in VARIABLES)


def map_name(name: str) -> Optional[Mapped]:
    """The HF key of a TF weight name (None: not a BERT weight)."""
    for pattern, v in _PATTERNS:
        m = pattern.fullmatch(name)
        if m:
            return Mapped(name, v.hf.format(n=m.group(1)) if m.groups() else v.hf, v.transpose)
    return None


# Optimizer state of the TF BERT trainers: the reference's LAMB/AdamW slots (``<var>/adam_m``,
# ``<var>/adam_v``), tf.train optimizers' slots (``<var>/LAMB``, ``<var>/Adam_1``...), gradient
# accumulation (``<var>/GradientAccumulator``) and their scalars; a TF2 object graph.
SLOT = re.compile(r"^(?P<var>.+)/(?P<slot>adam_m|adam_v|LAMB|LAMB_1|Adam|Adam_1|Momentum|"
                  r"GradientAccumulator)$")
OPTIMIZER_STATE = frozenset(("global_step", "beta1_power", "beta2_power", "update_count",
                             "good_steps", "loss_scale", "current_loss_scale",
                             "_CHECKPOINTABLE_OBJECT_GRAPH"))
