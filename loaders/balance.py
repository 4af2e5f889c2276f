"""Load balancing by sequence length: which samples form each rank's batch at each step.

Owns: the balancing modes ``random | global | local | pack`` as plans — pure arithmetic on the
shard sizes, the per-sample lengths index (``dataset.read_lengths``), the world size and the
seed, so every rank derives every rank's batches alone — their configuration
(``BalanceSpec``), the length bins and per-bin counts of ``local``/``pack``, and the errors for
specifications that cannot work. Never: I/O, collation or packing of rows (collate.py),
communication, or reading the launcher's environment (world and group sizes are passed in).

``random`` is today's plan (``ShardPlan``, dataset.py): rank r reads its own whole shards
in a seeded order, its *pool*. The other modes regroup samples by length:

* ``global`` (NVIDIA's exchange padding). Step s: the P pools' next b samples each (P·b),
  sorted by length descending (stable: ties keep pool order), dealt strided — rank g takes
  sorted positions g, g+P, g+2P, …. NVIDIA all-gathers the lengths and exchanges samples every
  step (an all-gather over the world, O(P·b) lengths). Here every rank already knows every
  pool's lengths (the lengths index, read once at start: 8 bytes per sample), so it computes
  the same deal with no collective, then *reads* the samples dealt to it from the other ranks'
  shards instead of receiving them (each node holds the whole data set, as MLPerf systems do).
  The batches are those of the exchange; the cost moved from the network to shard reads.
* ``local`` (Samsung's stratified local presort). Offline, over the whole data set: length
  bins (upper edges ``bin_edges``, or ``num_bins`` quantiles of the lengths) and per-bin counts
  c_k (∝ the bin's share, rounded by largest remainder to sum to b). The epoch's order (every
  shard, shard-major, seeded) is split into one stream per bin. Step s: each node group of G
  consecutive ranks takes its next G·c_k samples of every bin, sorts the G·b descending and
  deals them zig-zag: rank g takes g, 2G−1−g, 2G+g, 4G−1−g, …. Bins are length ranges, so in
  sorted order bin k is a block of G·c_k consecutive positions, c_k whole rounds of the deal:
  every rank's batch holds exactly c_k samples of bin k. The only exchange is inside the group,
  O(G) and independent of world size (computed here without communication, like ``global``).
  All bins advance through the epoch order at the same pace, so every rank reads the same one
  or two shards at a time: each rank reads the whole data set once per epoch (fine at this
  scale; a row-level reader would be needed where a node cannot hold the data set).
* ``pack``: ``local``'s batches, each packed best-fit into rows of ``pack_length`` tokens by
  collate.py (block-diagonal attention, positions restart per sequence, NSP/MLM per sequence).
  Samples per step stay b per rank, so batch size, learning-rate schedule and MLPerf's sample
  count mean the same as in every other mode; only the rows a rank computes shrink.

The remainder (``remainder()`` lists it exactly). ``random``/``global``: the ``n % P`` shards
no rank reads that epoch and each rank's pool surplus beyond the common step count.
``local``/``pack``: stratified steps last while every bin can give all ranks their c_k (the
first bin to run dry ends them; with c_k rounded, the other bins keep a few % of the epoch);
those leftovers, in epoch order, then form *tail* steps (sorted and dealt zig-zag in groups,
without equal per-bin counts) while P·b are left; fewer than P·b samples remain. Orders are
reshuffled every epoch, so a different remainder is left out each epoch. Every other sample
of the epoch is trained exactly once across ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from loaders.shards import DataError

#: data.balance: declared once here; runtime.config types the key with it.
BalanceMode = Literal["random", "global", "local", "pack"]
MODES = get_args(BalanceMode)


@dataclass(frozen=True)
class BalanceSpec:
    """How to balance; the field names are the ``data.*`` config keys."""

    mode: str = "random"
    bin_edges: tuple[int, ...] = ()  # upper edges of the length bins; () = quantiles
    num_bins: int = 4                # quantile bins when bin_edges is empty
    group_size: int = 1              # G: ranks per node group (local, pack)
    pack_length: int = 128           # tokens per packed row (pack)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"data.balance={self.mode!r}: choose one of {' | '.join(MODES)}")
        edges = list(self.bin_edges)
        if any(e < 1 for e in edges) or edges != sorted(set(edges)):
            raise ValueError(f"data.bin_edges={edges}: give strictly increasing positive upper "
                             "edges, e.g. [64, 96, 127, 128]")
        for key in ("num_bins", "group_size", "pack_length"):
            if getattr(self, key) < 1:
                raise ValueError(f"data.{key}={getattr(self, key)} must be >= 1")

    def describe(self) -> dict:
        """What a saved data position must agree on."""
        d = {"mode": self.mode}
        if self.mode in ("local", "pack"):
            d.update(bin_edges=list(self.bin_edges), num_bins=self.num_bins,
                     group_size=self.group_size)
        if self.mode == "pack":
            d["pack_length"] = self.pack_length
        return d


def make_plan(spec: BalanceSpec, base, lengths):
    """The plan for ``spec`` on top of ``base`` (a ShardPlan: pools per rank). ``lengths``:
    per shard, int array of sample lengths (unused, may be None, for ``random``)."""
    if spec.mode == "random":
        return base
    if lengths is None:
        raise ValueError(f"data.balance={spec.mode} needs the per-sample lengths index")
    if spec.mode == "global":
        return GlobalPlan(base, lengths)
    if spec.mode == "pack":
        check_pack_length(lengths, spec.pack_length)
    return LocalPlan(base, lengths, spec)


def check_pack_length(lengths, pack_length: int) -> None:
    for shard, column in enumerate(lengths):
        if len(column) and column.max() > pack_length:
            row = int(np.argmax(column))
            raise DataError(f"data.pack_length={pack_length} is shorter than a sample (shard "
                            f"{shard} row {row} has {int(column.max())} tokens): set "
                            f"data.pack_length >= {int(max(c.max() for c in lengths if len(c)))}"
                            " (at most data.max_seq_length)")


# ------------------------------------------------------------------------------ deals

def strided_deal(order: np.ndarray, ranks: int) -> np.ndarray:
    """[steps, P·b] sorted positions → [P, steps, b]: rank g takes g, g+P, g+2P, …"""
    steps, total = order.shape
    return order.reshape(steps, total // ranks, ranks).transpose(2, 0, 1)


def zigzag_positions(group_size: int, per_rank: int) -> np.ndarray:
    """[G, b] sorted positions each rank of a group takes: g, 2G−1−g, 2G+g, 4G−1−g, …"""
    g = np.arange(group_size)[:, None]
    rounds = np.arange(per_rank)[None, :]
    within = np.where(rounds % 2 == 0, g, group_size - 1 - g)
    return rounds * group_size + within


def _sort_desc(lens: np.ndarray) -> np.ndarray:
    """Per row of ``lens`` [steps, n]: positions sorted by length descending, ties stable."""
    return np.argsort(-lens, axis=1, kind="stable")


# ------------------------------------------------------------------------------ plans

class _PlanBase:
    """Shared by the balanced plans: the per-epoch cache and the ShardPlan-like interface
    the loader and the benchmark use (``steps_per_epoch``, ``rank_batches``, ``remainder``)."""

    name = ""

    def __init__(self, base, lengths):
        self.base = base
        self.lengths = [np.asarray(c, dtype=np.int64) for c in lengths]
        if [len(c) for c in self.lengths] != list(base.shard_samples):
            raise DataError("the lengths index does not match the shard sizes in stats.json")
        self.world_size = base.world_size
        self._cache: dict = {}

    def length_of(self, pairs: np.ndarray) -> np.ndarray:
        """Lengths of (shard, row) ``pairs`` [..., 2]."""
        flat = pairs.reshape(-1, 2)
        out = np.empty(len(flat), dtype=np.int64)
        for shard in np.unique(flat[:, 0]).tolist():
            sel = flat[:, 0] == shard
            out[sel] = self.lengths[shard][flat[sel, 1]]
        return out.reshape(pairs.shape[:-1])

    def all_batches(self, epoch: int, local_batch_size: int) -> np.ndarray:
        """int32 [P, steps, b, 2]: every rank's (shard, row) pairs of ``epoch``."""
        key = (epoch, local_batch_size)
        if key not in self._cache:
            self._cache.clear()  # one epoch at a time (the loader asks for the next early)
            self._cache[key] = self._compute(epoch, local_batch_size)
        return self._cache[key]

    def rank_batches(self, epoch: int, rank: int, local_batch_size: int) -> np.ndarray:
        return self.all_batches(epoch, local_batch_size)[rank]

    def steps_per_epoch(self, epoch: int, local_batch_size: int) -> int:
        return self.all_batches(epoch, local_batch_size).shape[1]

    def remainder(self, epoch: int, local_batch_size: int) -> np.ndarray:
        """[n, 2] (shard, row) pairs no rank trains in ``epoch``."""
        used = self.all_batches(epoch, local_batch_size).reshape(-1, 2)
        return missing_pairs(self.base.shard_samples, used)

    def _compute(self, epoch: int, b: int) -> np.ndarray:
        raise NotImplementedError


class GlobalPlan(_PlanBase):
    """NVIDIA-style exchange: per step, the world's P·b pool samples sorted descending and
    dealt strided (see the module docstring)."""

    name = "global-v1"

    def _compute(self, epoch: int, b: int) -> np.ndarray:
        pools = np.stack([self.base.rank_batches(epoch, r, b) for r in range(self.world_size)])
        steps = pools.shape[1]
        flat = pools.transpose(1, 0, 2, 3).reshape(steps, -1, 2)  # [steps, P·b, 2] rank-major
        order = _sort_desc(self.length_of(flat))
        picks = strided_deal(order, self.world_size)  # [P, steps, b]
        return np.take_along_axis(flat[None], picks[..., None], axis=2).astype(np.int32)


class LocalPlan(_PlanBase):
    """Samsung-style: batches stratified by global length bins (the same per-bin counts on
    every rank), sorted and dealt zig-zag inside node groups of G ranks (see the module
    docstring). ``pack`` uses the same batches."""

    def __init__(self, base, lengths, spec: BalanceSpec):
        super().__init__(base, lengths)
        self.name = f"{spec.mode}-v1"
        self.group_size = spec.group_size
        if self.world_size % self.group_size:
            raise ValueError(f"data.group_size={self.group_size} does not divide the world size "
                             f"{self.world_size} into node groups: set data.group_size to a "
                             f"divisor of {self.world_size} (0 = ranks per node)")
        everything = np.concatenate(self.lengths)
        self.edges = bin_edges(everything, spec.bin_edges, spec.num_bins)
        self.bin_sizes = np.bincount(self.bin_of(everything), minlength=len(self.edges))

    def bin_of(self, lengths: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.edges, lengths, side="left")

    def counts(self, local_batch_size: int) -> np.ndarray:
        """c_k: samples from bin k in every rank's batch."""
        return per_bin_counts(self.bin_sizes, self.edges, local_batch_size)

    def stratified_steps(self, epoch: int, local_batch_size: int) -> int:
        """The first steps of ``epoch``, where every rank's batch has exactly c_k samples of
        bin k; the remaining ("tail") steps are made of the bins' leftovers."""
        return self._stratified(epoch, local_batch_size)[1]

    def _compute(self, epoch: int, b: int) -> np.ndarray:
        batches = self._stratified(epoch, b)[0]  # [groups, steps, G·b, 2]
        order = np.stack([_sort_desc(self.length_of(f)) for f in batches])
        return self._deal(batches, order, b)

    def _stratified(self, epoch: int, b: int) -> tuple[np.ndarray, int]:
        """Each group's batches before the deal, [groups, steps, G·b, 2], and the number of
        stratified steps. The epoch's order (all shards, shard-major: ``epoch_order``) is
        split by bin; stratified step s gives group j the next G·c_k of bin k, while every bin
        can give all P·c_k; then tail steps give each group the next G·b of the leftovers, in
        epoch order, while P·b are left (the rest is the remainder)."""
        g, counts = self.group_size, self.counts(b)
        groups = self.world_size // g
        order = self.epoch_order(epoch)
        bins = self.bin_of(self.length_of(order))
        sizes = np.bincount(bins, minlength=len(counts))
        steps = int(min(sizes // (self.world_size * counts)))
        if steps == 0:
            self._cannot_fill(sizes, self.world_size * counts)
        head, rest = [], np.zeros(len(order), dtype=bool)
        for k, c in enumerate(counts):
            members = np.flatnonzero(bins == k)
            used = steps * self.world_size * c
            head.append(order[members[:used]].reshape(steps, groups, g * c, 2))
            rest[members[used:]] = True
        leftovers = order[rest]
        tail = len(leftovers) // (self.world_size * b)
        tail_batches = leftovers[:tail * self.world_size * b].reshape(tail, groups, g * b, 2)
        batches = np.concatenate([np.concatenate(head, axis=2), tail_batches])
        return batches.transpose(1, 0, 2, 3), steps

    def epoch_order(self, epoch: int) -> np.ndarray:
        """[N, 2] every sample of the data set, shard by shard in the epoch's seeded file order,
        rows permuted within each shard (a one-rank ShardPlan). Every bin is drawn at the same
        pace, so at any step all ranks read from the same one or two shards of this order."""
        one_rank = type(self.base)(self.base.shard_samples, 1, self.base.seed)
        return one_rank.rank_order(epoch, 0)

    def _deal(self, batches: np.ndarray, order: np.ndarray, b: int) -> np.ndarray:
        """Zig-zag deal of each group's sorted batch: [groups, steps, G·b] → [P, steps, b]."""
        g = self.group_size
        picks = np.take(order, zigzag_positions(g, b), axis=2)  # [groups, steps, G, b]
        dealt = np.take_along_axis(batches[:, :, None], picks[..., None], axis=3)
        steps = batches.shape[1]
        return dealt.transpose(0, 2, 1, 3, 4).reshape(self.world_size, steps, b, 2) \
            .astype(np.int32)

    def _cannot_fill(self, sizes, need) -> None:
        k = int(np.flatnonzero(sizes < need)[0])
        raise DataError(
            f"length bin {self.bin_label(k)} cannot fill its per-bin count: it holds "
            f"{int(sizes[k])} samples but one step of {self.world_size} ranks needs "
            f"{int(need[k])}; use wider bins (data.bin_edges / fewer data.num_bins), a smaller "
            "batch, or more data")

    def bin_label(self, k: int) -> str:
        low = int(self.edges[k - 1]) if k else 0
        return f"({low}, {int(self.edges[k])}]"


# ------------------------------------------------------------------------------ bins

def bin_edges(lengths: np.ndarray, edges: tuple[int, ...], num_bins: int) -> np.ndarray:
    """Upper edges of the length bins (k-th bin = (edge[k-1], edge[k]]): ``edges`` as given,
    or the ``num_bins`` quantiles of ``lengths`` (merged where a length value holds more than
    one quantile, e.g. the many samples at the maximum length)."""
    longest = int(lengths.max())
    if edges:
        out = np.asarray(edges, dtype=np.int64)
        if out[-1] < longest:
            raise DataError(f"data.bin_edges={list(edges)}: the last edge must be >= the "
                            f"longest sample ({longest} tokens); append {longest}")
    else:
        q = np.arange(1, num_bins + 1) / num_bins
        out = np.unique(np.quantile(lengths, q, method="inverted_cdf").astype(np.int64))
    sizes = np.bincount(np.searchsorted(out, lengths, side="left"), minlength=len(out))
    empty = np.flatnonzero(sizes == 0)
    if len(empty):
        k = int(empty[0])
        low = int(out[k - 1]) if k else 0
        raise DataError(f"data.bin_edges={out.tolist()}: length bin ({low}, {int(out[k])}] "
                        "holds no sample of this data set; remove that edge")
    return out


def per_bin_counts(bin_sizes: np.ndarray, edges: np.ndarray, local_batch_size: int) -> np.ndarray:
    """c_k ∝ bin share, rounded by largest remainder to sum to b; every bin needs c_k ≥ 1."""
    share = local_batch_size * bin_sizes / bin_sizes.sum()
    counts = np.floor(share).astype(np.int64)
    short = local_batch_size - int(counts.sum())
    counts[np.argsort(-(share - counts), kind="stable")[:short]] += 1
    if (counts == 0).any():
        k = int(np.flatnonzero(counts == 0)[0])
        low = int(edges[k - 1]) if k else 0
        raise DataError(f"length bin ({low}, {int(edges[k])}] holds {bin_sizes[k]} of "
                        f"{int(bin_sizes.sum())} samples: too few for one of "
                        f"local_batch_size={local_batch_size} per batch. Merge it into a "
                        "neighbour (data.bin_edges) or use fewer bins (data.num_bins)")
    return counts


def missing_pairs(shard_samples, used: np.ndarray) -> np.ndarray:
    """(shard, row) pairs of the data set not in ``used``."""
    offsets = np.concatenate([[0], np.cumsum(shard_samples)])
    taken = np.zeros(offsets[-1], dtype=bool)
    taken[offsets[used[:, 0]] + used[:, 1]] = True
    flat = np.flatnonzero(~taken)
    shard = np.searchsorted(offsets, flat, side="right") - 1
    return np.stack([shard, flat - offsets[shard]], 1).astype(np.int32)
