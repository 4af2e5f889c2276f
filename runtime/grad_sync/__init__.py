"""Gradient synchronisation: how the ranks average gradients, behind one protocol.

Rooms:
  plan.py      bucket plans and the flat-buffer layout they imply - pure data, no torch
  buckets.py   the bucket engine (``train.grad_sync = "buckets"``): flat buffer, overlapped
               allreduce per bucket, clip before the allreduce, first-step re-cut
  tied.py      the tied word embedding's split sync (``train.tied_embedding_sync``)
  shard.py     the sharded optimizer's shards and collectives (``optim.shard``)
  ddp.py       plain DDP (``train.grad_sync = "ddp"``), kept for comparison
  protocol.py  `GradSync`, what the train step calls, and the `SyncReport` it gets back

`build_grad_sync` reads the ``train`` config and returns the one sync object the trainer
talks to. docs/GRADIENT_SYNC.md explains the modes with measurements.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from runtime.choices import ConfigError, clip_spec, shard_scope
from runtime.launch.dist import BlockGroups, all_gather_object, block_groups, broadcast_tensors
from runtime.grad_sync.buckets import CLIP_MODES, GRAD_ALIGN, GradientBuckets
from runtime.grad_sync.ddp import DDPSync
from runtime.grad_sync.plan import (MB, BucketPlan, GradLayout, Piece, PlanError, alone_bucket,
                                    resolve_tied_sync, reverse_registration_order, split_pays)
from runtime.grad_sync.protocol import GradSync, SyncReport
from runtime.grad_sync.shard import Shard
from runtime.grad_sync.tied import TiedEmbeddingSplit, find_tied_head

__all__ = ["CLIP_MODES", "GRAD_ALIGN", "MB", "BucketPlan", "DDPSync", "GradLayout",
           "GradSync", "GradientBuckets", "Piece", "PlanError", "Shard",
           "SyncReport", "TiedEmbeddingSplit", "alone_bucket", "build_grad_sync", "resolve_tied_sync",
           "reverse_registration_order", "shard_groups", "split_pays"]


def build_grad_sync(model: torch.nn.Module, train_cfg: Any, *, world_size: int,
                    device: torch.device, reduce_dtype: torch.dtype,
                    group: Any = None, timeline: Any = None,
                    tokens_per_step: Optional[int] = None, shard: str = "none",
                    local_rank: int = 0, local_world_size: int = 1) -> GradSync:
    """The sync ``train_cfg`` (runtime.config.TrainConfig) asks for, its allreduces in
    ``reduce_dtype`` (the run's numerics' ``reduce``: runtime.numerics resolves
    train.allreduce_dtype).

    ``grad_sync = "ddp"``: `DDPSync`. ``"buckets"``: the initial weights are broadcast from
    rank 0 (as DDP does), then a `GradientBuckets` on a plan file (``bucket_plan``) or cut by
    ``bucket_cap_mb`` in reverse registration order, with the tied embedding split when
    ``tied_embedding_sync`` resolves to split. ``tokens_per_step``: at most how many tokens one
    rank feeds one optimizer step (bounds the split's touched rows on CUDA). ``shard``
    (``optim.shard``): 'node' or 'world' reduces each bucket to the shards' owners instead
    (`shard_groups`: the node's ``local_world_size`` ranks, or every rank, share one update).
    """
    if train_cfg.grad_sync == "ddp":
        return DDPSync(model, world_size=world_size, device=device,
                       fold_clip=clip_spec(train_cfg.clip_mode).after_allreduce
                       and train_cfg.max_grad_norm > 0)
    broadcast_tensors(list(model.parameters()) + list(model.buffers()))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sizes = {n: p.numel() for n, p in named}
    element = named[0][1].element_size() if named else 4
    asked = train_cfg.tied_embedding_sync
    head, tied_name, lookup = None, None, None
    found = find_tied_head(model, named, required=asked == "split") \
        if asked == "split" or (asked == "auto" and world_size > 1) else None
    rows = dict(named)[found[1]].shape[0] if found is not None else None
    plan = BucketPlan.read(train_cfg.bucket_plan, sizes) if train_cfg.bucket_plan else None
    mode, why = resolve_tied_sync(asked, train_cfg.clip_mode, world_size, rows=rows,
                                  tokens_per_step=tokens_per_step,
                                  device_type=torch.device(device).type,
                                  cuda_graphs=getattr(train_cfg, "cuda_graphs", "none"),
                                  plan=plan, tied=(found[1], sizes[found[1]]) if found else None)
    if mode == "split" and found is not None:
        head, tied_name, lookup = found
    cap = None
    if plan is None:   # cut by the cap, the split embedding whole and alone
        cap = max(1, int(train_cfg.bucket_cap_mb * MB) // element)
        plan = BucketPlan.from_cap([(n, sizes[n]) for n in reverse_registration_order(named)],
                                   cap, source=f"bucket_cap_mb={train_cfg.bucket_cap_mb:g}",
                                   alone=tied_name)
    tied = None
    if tied_name is not None:
        param = dict(named)[tied_name]
        rows = param.shape[0] if tokens_per_step is None else tokens_per_step * world_size
        tied = TiedEmbeddingSplit(param, head, lookup, world_size=world_size, group=group,
                                  reduce_dtype=reduce_dtype, max_rows=rows, timeline=timeline)
    groups = shard_groups(shard, world_size, local_rank, local_world_size)
    # CPU ranks whose shard group is on one host share one parameter buffer (shard.py); not
    # on the simulated device (runtime.observe.hostsync), which stands in for a GPU
    one_host = shard_scope(shard).one_host(world_size, local_world_size)
    sync = GradientBuckets(model, plan, world_size=world_size, group=group,
                           clip_mode=train_cfg.clip_mode, max_grad_norm=train_cfg.max_grad_norm,
                           reduce_dtype=reduce_dtype, cap_elements=cap, timeline=timeline,
                           tied=tied, shard_groups=groups,
                           backend="nccl" if torch.device(device).type == "cuda" else "gloo",
                           shared_params=one_host and torch.device(device) == torch.device("cpu"))
    # what the run's derived facts say: the tied sync that runs, and why (auto's reason)
    sync.tied_sync = ("split" if tied is not None else "dense", why)
    return sync


def shard_groups(shard: str, world_size: int, local_rank: int,
                 local_world_size: int) -> Optional[BlockGroups]:
    """The ranks that share one optimizer update under ``optim.shard`` (its row in
    runtime.choices.SHARD_SCOPES; None where each rank updates alone): blocks of the row's
    ``ranks_per_update`` consecutive ranks - every rank, or each node's, the same shard index
    across nodes (checked, since launchers may place ranks otherwise). A collective when it
    makes groups."""
    scope = shard_scope(shard)
    if not scope.sharded:
        return None
    if world_size == 1:
        return BlockGroups(1, 0, 1, 0)
    size = scope.ranks_per_update(world_size, local_world_size)
    if scope.group == "node":
        places = all_gather_object((local_rank, local_world_size))
        bad = [r for r, (lr, n) in enumerate(places) if n != size or lr != r % size]
        if bad or world_size % size:
            raise ConfigError(
                f"optim.shard='{shard}' needs the same number of ranks on every node, placed "
                f"in blocks of consecutive ranks (ranks 0..{size - 1} on the first node, ...): "
                f"rank(s) {bad[:8]} report another place (local rank, ranks on the node: "
                f"{[places[r] for r in bad[:8]]}, rank 0: {places[0]}); place the ranks "
                f"per node in blocks (mpiexec/srun do by default), or use optim.shard='world'")
    return block_groups(size)
