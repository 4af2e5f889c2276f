"""The model's configuration: ``BertConfig``, HF's config.json fields with their meaning and
validation - one dataclass, used by the model (runtime.model) and, extended by the run's
choices, as the ``[model]`` section of the config file (runtime.config.ModelConfig).

Owns: the size fields, their defaults, docstrings and resume rules (what a resumed run may do
with each: runtime.train.resume_rules reads them), their validation (``validate``: the
message names the key with the caller's prefix, "BertConfig." or "model."), reading an HF
``config.json``. Never: imports torch or builds modules.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from runtime.choices import MATCH, RECORD, key_field as _doc

SHAPE = "the model's shape: the checkpoint's weights would not fit"
"""Why a resume must keep a shape key (its resume rule: runtime.train.resume_rules)."""
_REGULARISE = "regularisation from here on"


@dataclass
class BertConfig:
    """Size and initialisation of a BERT model; field names and meanings are HF's config.json."""

    vocab_size: int = _doc("WordPiece vocabulary size (rows of the word embedding and MLM "
                           "decoder)", 30522, resume=MATCH, why=SHAPE)
    hidden_size: int = _doc("hidden width H", 768, resume=MATCH, why=SHAPE)
    num_hidden_layers: int = _doc("transformer layers", 12, resume=MATCH, why=SHAPE)
    num_attention_heads: int = _doc("attention heads; must divide hidden_size", 12,
                                    resume=MATCH, why=SHAPE)
    intermediate_size: int = _doc("feed-forward width", 3072, resume=MATCH, why=SHAPE)
    max_position_embeddings: int = _doc("position table size; must be >= the sequence length", 512,
                                        resume=MATCH, why=SHAPE)
    type_vocab_size: int = _doc("segment (token type) vocabulary size", 2, resume=MATCH, why=SHAPE)
    hidden_dropout_prob: float = _doc("dropout after embeddings, attention output and FFN", 0.1,
                                      resume=RECORD, why=_REGULARISE)
    attention_probs_dropout_prob: float = _doc("dropout on attention probabilities", 0.1,
                                               resume=RECORD, why=_REGULARISE)
    layer_norm_eps: float = _doc("LayerNorm epsilon", 1e-12,
                                 resume=MATCH, why="the model's function (LayerNorm epsilon)")
    initializer_range: float = _doc("std of the normal init of Linear/Embedding weights", 0.02,
                                    resume=RECORD, why="used only when weights are initialised")
    pad_token_id: int = _doc("id of [PAD]; its word-embedding row is initialised to zero", 0,
                             resume=MATCH, why=SHAPE)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, prefix: str = "BertConfig.") -> None:
        """ValueError naming the key (``prefix`` + field name) when a value makes no model."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{prefix}{name}={value!r}: set it to a positive integer")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"{prefix}hidden_size ({self.hidden_size}) is not divisible by "
                f"num_attention_heads ({self.num_attention_heads}); change one so it divides")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{prefix}{name}={getattr(self, name)}: must be in [0, 1)")
        for name in ("layer_norm_eps", "initializer_range"):
            value = getattr(self, name)
            if not (value > 0 and value < float("inf")):
                raise ValueError(f"{prefix}{name}={value}: must be a finite number > 0")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"{prefix}pad_token_id={self.pad_token_id}: must be in "
                             f"[0, vocab_size={self.vocab_size})")

    @classmethod
    def from_hf_json(cls, path: str | Path) -> "BertConfig":
        """Read an HF ``config.json`` (or a directory holding one); unknown keys are ignored,
        keys that change the architecture to one this module does not implement are refused."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        raw = json.loads(path.read_text())
        unsupported = {"model_type": "bert", "hidden_act": "gelu",
                       "position_embedding_type": "absolute"}
        for key, want in unsupported.items():
            if raw.get(key, want) != want:
                raise ValueError(f"{path}: {key}={raw[key]!r} is not supported; this model "
                                 f"implements {key}={want!r} only")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


