"""The checks that read more than one section of a run's config, or a key against its type.

Owns: a ``Literal`` key's value against its choices (``check_choice``: the error names the
key, the choices and the nearest one), and the rules that tie keys of different sections
together - the model's positions against the sequence length, the precision against the
device, the static shapes' sizes against the local batch, what a ``train.cuda_graphs`` mode,
an ``optim.shard`` scope and a ``model.fp8`` recipe need (their rows' ``Need``s in
runtime.choices: one check reads them all), the numerics' keys together (runtime.numerics.resolve
refuses what does not compose), the closed division's target. Each refusal names the keys and what to set.
Never: reads files or overrides (runtime.config.load), or checks a key that one section's
``validate`` can check alone (runtime.config.sections).
"""
from __future__ import annotations

import difflib
from typing import Any, Literal, get_args, get_origin

from loaders.shapes import shape_size_problem
from runtime.choices import FP8_RECIPES, GRAPH_MODES, PRECISIONS, ConfigError, shard_scope


def check_choice(key: str, value: Any, hint: Any) -> None:
    """For a ``Literal`` field: the value must be one of its choices."""
    if get_origin(hint) is Literal and value not in get_args(hint):
        choices = [str(c) for c in get_args(hint)]
        near = difflib.get_close_matches(str(value), choices, 1)
        hint_text = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"{key}={value!r}: choose one of {' | '.join(choices)}{hint_text}")


def check_run(cfg: Any) -> None:
    """The cross-section rules of ``cfg`` (a runtime.config.Config whose sections each passed
    their own ``validate``)."""
    if cfg.model.max_position_embeddings < cfg.data.max_seq_length:
        raise ConfigError(f"model.max_position_embeddings ({cfg.model.max_position_embeddings})"
                          f" < data.max_seq_length ({cfg.data.max_seq_length}); raise the former")
    _check_needs(cfg, "train.precision", PRECISIONS[cfg.train.precision].needs, "fp32")
    _check_needs(cfg, "train.cuda_graphs", GRAPH_MODES[cfg.train.cuda_graphs].needs)
    d = cfg.data   # static/bucketed sizes within what the data and sequence length allow
    why = shape_size_problem(
        static_rows=d.static_rows, max_seqs_per_row=d.max_seqs_per_row,
        shape_bucket=d.shape_bucket, seq_len=d.max_seq_length,
        pack_length=d.pack_length or d.max_seq_length,
        local_batch=cfg.local_batch_size(cfg.system.nodes * cfg.system.ranks_per_node)
        if d.static_rows else d.static_rows)
    if why:
        raise ConfigError(why)
    _check_needs(cfg, "optim.shard", shard_scope(cfg.optim.shard).needs)
    _check_needs(cfg, "model.fp8", FP8_RECIPES[cfg.model.fp8].needs)
    cfg.numerics()   # precision, FP8 and the allreduce's dtype: what does not compose
    if cfg.model.fp8 != "none" and cfg.model.fp8_emulate == "off" and \
            cfg.system.device == "cpu":
        raise ConfigError(f"model.fp8='{cfg.model.fp8}' with model.fp8_emulate='off' and "
                          f"system.device='cpu': a CPU has no FP8 GEMMs; set "
                          f"model.fp8_emulate='auto' (torchao's emulate mode) or "
                          f"model.fp8='none'")
    if cfg.submission.division == "closed" and cfg.train.target_mlm_accuracy < 0.720:
        raise ConfigError("submission.division='closed' needs train.target_mlm_accuracy >= "
                          "0.720 (MLPerf); use division='open' for a proxy target")


def _check_needs(cfg: Any, key: str, needs: tuple, way_out: str = "none") -> None:
    """``key``'s value where its row cannot work (the row's ``Need``s: a train.cuda_graphs
    mode's in runtime.choices.GRAPH_MODES, a precision's in PRECISIONS, a shard scope's in
    SHARD_SCOPES): refused before anything starts, naming the key, what it needs and the way
    out (``way_out``)."""
    section, name = key.split(".")
    value = getattr(getattr(cfg, section), name)
    for need in needs:
        need_section, need_key = need.key.split(".")
        if getattr(getattr(cfg, need_section), need_key) not in need.allowed:
            raise ConfigError(f"{key}='{value}' needs {need.why}; set it, or "
                              f"{key}='{way_out}'")
