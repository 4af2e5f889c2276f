"""The optimizer's part of a checkpoint beyond its ``state_dict()``: the sharded optimizer's
shard files and the fp32 master weights written in the parameters' place.

Owns: a shard file's name (``optimizer_shard_<index>.pt``), the identity each one carries
(its shard index, the shard count, the fingerprint of the flat layout it was cut from, the
step: ``shard_record``), the check that a file read is the one it is named (``check_shard``:
a swapped, stale or foreign file is refused naming it), and ``master_state`` (the model's
state dict with each parameter's fp32 master in its place). Never: reads, writes or commits a
checkpoint directory (runtime.train.checkpoint does), or knows how the shards are cut
(runtime.optim / runtime.grad_sync.shard).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Optional

import torch


def shard_file(index: int) -> str:
    return f"optimizer_shard_{index:05d}.pt"


def layout_fingerprint(meta: dict) -> str:
    """A sharded optimizer's flat layout (its ``presto_shards`` record: shard count and size,
    the state's names, every tensor's place) as a short digest, which each shard file
    carries: a file cut from another layout is not this checkpoint's."""
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]


def shard_record(state: dict, shard: Any, meta: dict, step: int) -> dict:
    """What shard ``shard.index``'s file holds: its ``state`` and its identity."""
    return {**state, "index": shard.index, "shards": shard.size,
            "layout": layout_fingerprint(meta), "step": step}


def shard_mismatch(data: Any, index: int, step: int, meta: Optional[dict]) -> Optional[str]:
    """Why ``data``, read from shard ``index``'s file of the checkpoint of ``step``, is not that
    shard (its index; where the file carries them, ``meta``'s shard count and layout and the
    step), or None. Files written before they carried an identity have their index checked."""
    got = data.get("index") if isinstance(data, dict) else None
    if got != index:
        return f"holds shard {got}, not shard {index}: the file of another shard (swapped)"
    if "step" in data and data["step"] != step:
        return (f"was written at step {data['step']}, this checkpoint is step {step}: a stale "
                f"file from another checkpoint")
    if meta is not None and "shards" in data and data["shards"] != meta.get("shards"):
        return (f"is one of {data['shards']} shards, this checkpoint has {meta.get('shards')}: "
                f"a file from another run")
    if meta is not None and "layout" in data and data["layout"] != layout_fingerprint(meta):
        return (f"was cut from another flat layout (fingerprint {data['layout']}, this "
                f"checkpoint's {layout_fingerprint(meta)}): a file from another run or model")
    return None


def missing_shard(path: Path, checkpoint: Path) -> str:
    return (f"{path}: missing - the optimizer state was saved in shards and this one is "
            f"needed; delete {checkpoint} to resume from the one before")


def master_state(model: torch.nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """``model``'s state dict with each parameter's fp32 master weight (``optimizer.masters``)
    in its place - its rows cut as the state dict cuts them (pad_vocab's padding rows)."""
    masters = optimizer.masters()
    params = dict(model.named_parameters(remove_duplicate=False))
    out = {}
    for key, value in model.state_dict().items():
        p = params.get(key)
        m = masters.get(id(p)) if p is not None else None
        if m is not None and m.shape != value.shape:
            m = m[:value.shape[0]]
        out[key] = m if m is not None else value
    return out
