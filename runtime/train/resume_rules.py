"""What may change across a resume: one declared rule per config key.

A resumed run continues a checkpoint's weights, optimizer state, data position and MLPerf
log. A key whose change would make that continuation something else - another model shape,
an optimizer whose state means something else, another precision or data set or local batch,
another data order - must MATCH the checkpoint's value: a resume that changes it is refused
before any rank trains (exit 2), naming each key, both values and what to do. Every other key
may change and is RECORDed: the change is said on the console and written into the MLPerf
log's ``presto_resumed`` event and the ``resume`` record of metrics.jsonl.

Owns: ``RULES`` (every config key, its rule and why; tests/unit/test_resume_rules.py checks that
no key is left out, so a new key must be given one), ``compare`` (a saved resolved config
against this run's: the refused keys and the recorded changes) and the refusal's text.
Never: reads checkpoints (runtime.train.checkpoint), logs, or decides what to resume.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MATCH, RECORD = "match", "record"

_SHAPE = "the model's shape: the checkpoint's weights would not fit"
_STATE = "the optimizer state's meaning (moments, momentum, their decay and bias correction)"
_DATA = "the data set, and the data position the checkpoint holds"
_ORDER = "the data order and the per-rank RNG streams the checkpoint continues"
_BATCH = "the local batch (global batch / ranks / accumulation) the data position counts in"

RULES: dict[str, tuple[str, str]] = {
    # [model]
    "model.vocab_size": (MATCH, _SHAPE), "model.hidden_size": (MATCH, _SHAPE),
    "model.num_hidden_layers": (MATCH, _SHAPE), "model.num_attention_heads": (MATCH, _SHAPE),
    "model.intermediate_size": (MATCH, _SHAPE),
    "model.max_position_embeddings": (MATCH, _SHAPE),
    "model.type_vocab_size": (MATCH, _SHAPE), "model.pad_token_id": (MATCH, _SHAPE),
    "model.layer_norm_eps": (MATCH, "the model's function (LayerNorm epsilon)"),
    "model.hidden_dropout_prob": (RECORD, "regularisation from here on"),
    "model.attention_probs_dropout_prob": (RECORD, "regularisation from here on"),
    "model.initializer_range": (RECORD, "used only when weights are initialised"),
    "model.init": (RECORD, "used only on a fresh start: a resume loads the checkpoint"),
    "model.attention": (RECORD, "how attention is computed, not what"),
    "model.size": (MATCH, _SHAPE),
    "model.fusions": (MATCH, "the tied embedding's rows in the optimizer state (pad_vocab)"),
    # [data]
    "data.data_dir": (MATCH, _DATA), "data.max_seq_length": (MATCH, _DATA),
    "data.max_predictions_per_seq": (MATCH, _DATA),
    "data.balance": (MATCH, _ORDER), "data.bin_edges": (MATCH, _ORDER),
    "data.num_bins": (MATCH, _ORDER), "data.group_size": (MATCH, _ORDER),
    "data.pack_length": (MATCH, _ORDER), "data.length_cost": (MATCH, _ORDER),
    "data.loader": (MATCH, _ORDER),
    "data.shapes": (MATCH, _ORDER), "data.max_seqs_per_row": (MATCH, _ORDER),
    "data.static_rows": (MATCH, _ORDER),
    "data.shape_bucket": (RECORD, "padding only: the same samples"),
    "data.verify_checksums": (RECORD, "a check at start-up"),
    "data.eval_batch_size": (RECORD, "how evaluation is batched, not what it measures"),
    "data.prefetch": (RECORD, "when shards are read, not which"),
    # [optim]
    "optim.name": (MATCH, _STATE), "optim.beta1": (MATCH, _STATE),
    "optim.beta2": (MATCH, _STATE), "optim.momentum": (MATCH, _STATE),
    "optim.bias_correction": (MATCH, _STATE),
    "optim.backend": (RECORD, "the step's implementation: the same update"),
    "optim.shard": (RECORD, "which ranks share the update: the same update; the saved "
                            "optimizer state is re-sharded on resume"),
    "optim.lr": (RECORD, "the learning rate from here on"),
    "optim.lr_scaling": (RECORD, "the learning rate from here on"),
    "optim.base_global_batch_size": (RECORD, "the learning rate from here on"),
    "optim.eps": (RECORD, "the update's denominator from here on"),
    "optim.weight_decay": (RECORD, "the decay from here on"),
    "optim.use_nvlamb": (RECORD, "which parameters LAMB adapts, from here on"),
    "optim.trust_clamp": (RECORD, "the trust ratio from here on"),
    "optim.trust_coefficient": (RECORD, "the trust ratio from here on"),
    # [schedule]
    "schedule.name": (RECORD, "the learning-rate schedule from here on"),
    "schedule.warmup_steps": (RECORD, "the learning-rate schedule from here on"),
    "schedule.start_warmup_step": (RECORD, "the learning-rate schedule from here on"),
    "schedule.total_steps": (RECORD, "the learning-rate schedule from here on"),
    "schedule.power": (RECORD, "the learning-rate schedule from here on"),
    # [train]
    "train.global_batch_size": (MATCH, _BATCH),
    "train.gradient_accumulation_steps": (MATCH, _BATCH),
    "train.seed": (MATCH, _ORDER),
    "train.precision": (MATCH, "the precision the weights and the loss scale were kept in"),
    "train.init_loss_scale": (RECORD, "a fresh start's loss scale: a resume restores it"),
    "train.max_grad_norm": (RECORD, "clipping from here on"),
    "train.clip_mode": (RECORD, "where clipping happens, from here on"),
    "train.grad_sync": (RECORD, "how gradients are averaged: the same mean"),
    "train.noise_scale_horizon_samples": (RECORD, "how the logged noise scale is averaged from "
                                          "here on; training is the same"),
    "train.bucket_cap_mb": (RECORD, "communication buckets"),
    "train.bucket_plan": (RECORD, "communication buckets"),
    "train.allreduce_dtype": (RECORD, "the allreduce's precision from here on"),
    "train.tied_embedding_sync": (RECORD, "how the tied embedding is synced"),
    "train.tensorboard": (RECORD, "observation"), "train.timeline": (RECORD, "observation"),
    "train.profile_steps": (RECORD, "observation"),
    "train.cuda_graphs": (RECORD, "how the step is launched: the same update"),
    "train.target_mlm_accuracy": (RECORD, "when the run stops"),
    "train.max_steps": (RECORD, "the budget"),
    "train.max_samples_termination": (RECORD, "the budget"),
    "train.eval_iter_start_samples": (RECORD, "the evaluation cadence"),
    "train.eval_iter_samples": (RECORD, "the evaluation cadence"),
    "train.eval_before_training": (RECORD, "a fresh start's evaluation"),
    "train.log_every_steps": (RECORD, "the logging cadence"),
    "train.output_dir": (RECORD, "where this attempt writes"),
    "train.plot": (RECORD, "observation"),
    "train.checkpoint_every_samples": (RECORD, "the checkpoint cadence"),
    "train.checkpoint_keep": (RECORD, "the checkpoints kept"),
    "train.checkpoint_dir": (RECORD, "where checkpoints go"),
    "train.adopt_checkpoints": (RECORD, "whether another run's checkpoints may be continued"),
    "train.max_nonfinite_steps": (RECORD, "the divergence guard"),
}
# [system] and [submission]: where and how the ranks run, and the log's labels.
SECTION_RULES: dict[str, tuple[str, str]] = {
    "system": (RECORD, "where and how the ranks run"),
    "submission": (RECORD, "the MLPerf log's labels"),
}


def rule(key: str) -> tuple[str, str]:
    """The rule of ``section.key`` and why; KeyError for a key no rule names."""
    if key in RULES:
        return RULES[key]
    return SECTION_RULES[key.split(".", 1)[0]]


@dataclass(frozen=True)
class Difference:
    key: str
    saved: Any
    now: Any
    why: str

    def text(self) -> str:
        return f"{self.key}: {self.saved!r} -> {self.now!r}"


def compare(saved: dict, now: dict) -> tuple[list[Difference], list[Difference]]:
    """(refused, recorded): the keys whose values differ between a checkpoint's resolved
    config ``saved`` and this run's ``now`` (both ``Config.to_dict()`` shapes), by rule. A
    key the checkpoint does not have (written before the key existed) is not compared."""
    refused, recorded = [], []
    for section, table in now.items():
        if not isinstance(table, dict):
            continue
        old_table = saved.get(section) or {}
        for key, value in table.items():
            if key not in old_table:
                continue
            old = old_table[key]
            if json.loads(json.dumps(value)) == old:
                continue
            name = f"{section}.{key}"
            kind, why = rule(name)
            (refused if kind == MATCH else recorded).append(Difference(name, old, value, why))
    return refused, recorded


def refusal(checkpoint: str, refused: list[Difference], run_dir: str) -> str:
    """The message of a refused resume: each key, both values and why, then what to do."""
    lines = [f"cannot resume from {checkpoint}: this run's config changes "
             f"{len(refused)} key(s) a resume must keep:"]
    lines += [f"  {d.key}: the checkpoint has {d.saved!r}, this run {d.now!r} ({d.why})"
              for d in refused]
    keep = " ".join(f"{d.key}={json.dumps(d.saved)}" for d in refused)
    lines.append(f"To continue this run, resume with the checkpoint's values ({keep}). To "
                 f"start afresh from its weights only, run in a new directory with "
                 f"model.init={checkpoint} (new optimizer state, schedule "
                 f"and data order; a new MLPerf log). Nothing was trained; {run_dir} is "
                 f"unchanged.")
    return "\n".join(lines)


def check(ck: Any, cfg: Any) -> list[str]:
    """A resume from checkpoint ``ck`` (runtime.train.checkpoint) by a run of ``cfg``:
    refused (ResumeRefused) when it changes a key that must match; else the changes that may
    happen, as text for the record (console, MLPerf log, metrics)."""
    from runtime.train.checkpoint import ResumeRefused
    saved = ck.train_state().get("progress", {}).get("config")
    if saved is None:
        return []
    refused, recorded = compare(json.loads(saved), cfg.to_dict())
    if refused:
        raise ResumeRefused(refusal(str(ck.path), refused, cfg.train.output_dir))
    return [d.text() for d in recorded]
