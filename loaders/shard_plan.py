"""Which samples each rank reads in an epoch before any balancing: ``ShardPlan``, pure
arithmetic on the shards' sizes, the world size and the seed - identical on every rank, so no
rank ever asks another. The load balancers (loaders.balance) replace this layer; the training
reader (loaders.dataset) reads what a plan says.

Owns: the epoch's shard order, each rank's shards and steps, the remainder no rank reads, the
plan's name in checkpoints (``PLAN_NAME``). Never: reads a shard or a length.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loaders.balance import missing_pairs
from loaders.shards import DataError

PLAN_NAME = "shards-v1"  # bump when the sample order for a given seed changes


@dataclass(frozen=True)
class ShardPlan:
    """Which (shard, row) pairs each rank takes at each step of an epoch; pure arithmetic on
    shard sizes and the seed, identical on every rank. Load balancers replace this layer."""

    shard_samples: tuple[int, ...]
    world_size: int
    seed: int
    name = PLAN_NAME  # the ``random`` balancing mode
    packs_per_batch = False  # one sample per row (balance plans say otherwise: PackPlan)

    def __post_init__(self):
        n, w = len(self.shard_samples), self.world_size
        if w < 1:
            raise ValueError(f"world_size must be >= 1, got {w}")
        if w > n:
            raise DataError(f"the data set has {n} train shards but world_size is {w}: each "
                            f"rank reads whole shards, so we need at least {w} shards - re-run "
                            f"`python -m loaders.prepare --shards N` with N >= {w} (a multiple "
                            f"of {w} reads every shard every epoch)")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")

    @property
    def num_shards(self) -> int:
        return len(self.shard_samples)

    def file_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_shards)

    def rank_shards(self, epoch: int, rank: int) -> np.ndarray:
        """Shard indices rank reads in ``epoch``, in reading order."""
        files, n, w = self.file_order(epoch), self.num_shards, self.world_size
        return files[[(f * w + rank) % n for f in range(n // w)]]

    def skipped_shards(self, epoch: int) -> np.ndarray:
        """The ``n % W`` shards no rank reads in ``epoch``."""
        n, w = self.num_shards, self.world_size
        return self.file_order(epoch)[(n // w) * w:]

    def rank_samples(self, epoch: int, rank: int) -> int:
        return sum(self.shard_samples[s] for s in self.rank_shards(epoch, rank))

    def steps_per_epoch(self, epoch: int, local_batch_size: int) -> int:
        n, w = self.num_shards, self.world_size
        reads = self.file_order(epoch)[(np.arange(n // w)[:, None] * w + np.arange(w)) % n]
        per_rank = np.asarray(self.shard_samples, dtype=np.int64)[reads].sum(0)  # [W]
        return int(per_rank.min()) // local_batch_size

    def rank_order(self, epoch: int, rank: int) -> np.ndarray:
        """int32 [samples_r, 2]: every (shard, row) of rank's shards, in reading order."""
        rng = np.random.default_rng([self.seed, epoch, rank])
        pairs = [np.stack([np.full(size, shard), rng.permutation(size)], 1)
                 for shard in self.rank_shards(epoch, rank)
                 for size in [self.shard_samples[shard]]]
        return np.concatenate(pairs).astype(np.int32)

    def rank_batches(self, epoch: int, rank: int, local_batch_size: int) -> np.ndarray:
        """int32 array [steps, local_batch_size, 2] of (shard index, row) per sample."""
        steps = self.steps_per_epoch(epoch, local_batch_size)
        order = self.rank_order(epoch, rank)[: steps * local_batch_size]
        return order.reshape(steps, local_batch_size, 2)

    def remainder(self, epoch: int, local_batch_size: int) -> np.ndarray:
        """[n, 2] (shard, row) pairs no rank reads in ``epoch``: the skipped shards and each
        rank's surplus beyond the common step count."""
        used = np.concatenate([self.rank_batches(epoch, r, local_batch_size).reshape(-1, 2)
                               for r in range(self.world_size)])
        return missing_pairs(self.shard_samples, used)
