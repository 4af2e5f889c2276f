"""Load balancing by sequence length: which samples form each rank's batch at each step.

Owns: the balancing modes ``random | global | local | pack | offline_pack`` as plans — pure
arithmetic on the shard sizes, the per-sample lengths index (``dataset.read_lengths``), the
world size, the seed and a cost model (``length_cost.LengthCost``), so every rank derives
every rank's batches alone —, the strata and length bins of ``local``/``pack``, what a saved
data position records of a spec (``describe``), and the errors for specifications that cannot
work. The modes' names and their configuration (``BalanceMode``, ``BalanceSpec``) are
balance_spec.py's, which the config imports without numpy. Never: I/O, collation
(collate.py), the deal and packing algorithms themselves (partition.py, packing.py),
communication, or reading the launcher's environment (world and group sizes are passed in).

Every balanced mode deals by the **cost model**, not by token counts: a rank's step time is
its forward+backward, which grows with Σ len² (attention), has a per-row cost, and for a
padded model is set by rows × its longest row. ``BalanceSpec.cost`` is that model (the
trainer passes the measured or default one for its model shape; without one, real tokens).
A deal (partition.py ``balanced_deal``) splits a step's items into equal-count sets so that
the largest set cost is as small as the candidates reach: balanced largest differencing with
a swap search, zig-zag and strided; the best wins, so no deal is worse than the strided one.

``random`` is today's plan (``ShardPlan``, dataset.py): rank r reads its own whole shards
in a seeded order, its *pool*. The other modes regroup samples by length:

* ``global`` (NVIDIA's exchange padding, dealt by cost). Step s: the P pools' next b samples
  each (P·b) are dealt into P batches of b minimising the largest rank cost. NVIDIA
  all-gathers the lengths and exchanges samples every step (O(P·b) lengths over the world).
  Here every rank already knows every pool's lengths (the lengths index, read once at start:
  8 bytes per sample), so it computes the same deal with no collective, then *reads* the
  samples dealt to it from the other ranks' shards instead of receiving them (each node holds
  the whole data set, as MLPerf systems do).
* ``local`` (Samsung's stratified local presort, strata from the data). Offline, over the
  whole data set: *strata*. By default (``num_bins = 0``) the data set sorted by length is cut
  into S = G·b equal slices (sizes differ by at most one; ties split in index order), and
  every node group of G ranks takes one sample of each stratum per step: all groups get the
  same length mix down to 1/(G·b) of the distribution, so group costs agree (the long tail
  included: at seq 512 the top stratum is all 512-token samples). With ``bin_edges`` or
  ``num_bins ≥ 1`` the strata are length bins instead (the given upper edges, or quantiles)
  and a group takes G·c_k of bin k, c_k ∝ the bin's share (largest remainder, Σ c_k = b).
  The epoch's order (every shard, shard-major, seeded) is split into one stream per stratum;
  step s gives group j the next samples of every stratum; the group's G·b are dealt by cost
  among its G ranks. The only exchange is inside the group, O(G) and independent of world
  size (computed here without communication). All strata advance through the epoch order at
  the same pace, so every rank reads the same few shards at a time: each rank reads the
  whole data set once per epoch (a row-level reader would be needed where a node cannot hold
  it).
* ``pack``: ``local``'s batches, each packed best-fit into rows of ``pack_length`` tokens by
  the loader (block-diagonal attention, positions restart per sequence, NSP/MLM per
  sequence), dealt by the cost of the packed rows. b samples per rank and step.
* ``offline_pack`` (NVIDIA's packed data set, packed at load time): each epoch, windows of
  whole shards of the epoch order (≥ ``packing.PACK_WINDOW`` sequences) are packed best-fit
  decreasing into rows of ``pack_length`` (≈ 0.99 full at seq 512 instead of ≈ 0.85 for one
  rank's b), the rows shuffled; each step takes rows holding exactly P·b sequences — the
  step consumes the same sequences as in every other mode, so batch size, learning-rate
  schedule and MLPerf's sample count mean what they mean — and gives every rank the same
  number R of rows (a padded rank's cost is rows × its longest row: equal full rows, equal
  costs), sequences per rank balanced (b ± a few; see packing.py).

The remainder (``remainder()`` lists it exactly). ``random``/``global``: the ``n % P`` shards
no rank reads that epoch and each rank's pool surplus beyond the common step count.
``local``/``pack``: stratified steps last while every stratum can give all groups their
counts; the leftovers (fewer than one step's per stratum with the default strata), in epoch
order, then form *tail* steps (dealt by cost in groups, without the stratification) while
P·b are left; fewer than P·b samples remain. ``offline_pack``: the rows left when no step of
exactly P·b sequences can be formed (about one step's worth). Orders are reshuffled every
epoch, so a different remainder is left out each epoch. Every other sample of the epoch is
trained exactly once across ranks.
"""
from __future__ import annotations

import numpy as np

from loaders.balance_spec import MODES, PACKED_MODES, BalanceMode, BalanceSpec  # noqa: F401
from loaders.length_cost import LengthCost, tokens_cost
from loaders.packing import PACK_WINDOW, pack_window, best_fit_decreasing, row_steps
from loaders.partition import balanced_deal, sort_desc
from loaders.shards import DataError


def spec_cost(spec: BalanceSpec) -> LengthCost:
    """What a rank's batch costs under ``spec``: its cost model, else real tokens."""
    return spec.cost or tokens_cost()


def describe(spec: BalanceSpec) -> dict:
    """What a saved data position must agree on."""
    d = {"mode": spec.mode}
    if spec.mode != "random":
        d["cost"] = spec_cost(spec).digest()
    if spec.mode in ("local", "pack"):
        d.update(bin_edges=list(spec.bin_edges), num_bins=spec.num_bins,
                 group_size=spec.group_size)
    if spec.mode in PACKED_MODES:
        d["pack_length"] = spec.pack_length
    if spec.mode == "offline_pack" and spec.max_seqs_per_row:
        d["max_seqs_per_row"] = spec.max_seqs_per_row
    if spec.mode == "offline_pack" and spec.static_rows >= 0:
        d["static_rows"] = spec.static_rows
    return d


def make_plan(spec: BalanceSpec, base, lengths):
    """The plan for ``spec`` on top of ``base`` (a ShardPlan: pools per rank). ``lengths``:
    per shard, int array of sample lengths (unused, may be None, for ``random``)."""
    plan = PLANS[spec.mode]
    if plan is None:  # random: the shard plan itself
        return base
    if lengths is None:
        raise ValueError(f"data.balance={spec.mode} needs the per-sample lengths index")
    if spec.mode in PACKED_MODES:
        check_pack_length(lengths, spec.pack_length)
    return plan(base, lengths, spec)


def check_pack_length(lengths, pack_length: int) -> None:
    for shard, column in enumerate(lengths):
        if len(column) and column.max() > pack_length:
            row = int(np.argmax(column))
            raise DataError(f"data.pack_length={pack_length} is shorter than a sample (shard "
                            f"{shard} row {row} has {int(column.max())} tokens): set "
                            f"data.pack_length >= {int(max(c.max() for c in lengths if len(c)))}"
                            " (at most data.max_seq_length)")


# ------------------------------------------------------------------------------ plans

class _PlanBase:
    """Shared by the balanced plans: the per-epoch cache and the ShardPlan-like interface
    the loader and the benchmark use (``steps_per_epoch``, ``rank_batches``, ``rank_rows``,
    ``remainder``). Batches are int32 [P, steps, n, 2] (shard, row) pairs; a plan whose
    ranks carry different sequence counts (``offline_pack``) pads with (-1, -1)."""

    name = ""
    packs_per_batch = False
    """Whether the loader packs each batch's samples into rows (best fit) as it reads them."""

    def __init__(self, base, lengths, spec: BalanceSpec):
        self.base = base
        self.spec = spec
        self.cost = spec_cost(spec)
        self.lengths = [np.asarray(c, dtype=np.int64) for c in lengths]
        if [len(c) for c in self.lengths] != list(base.shard_samples):
            raise DataError("the lengths index does not match the shard sizes in stats.json")
        self.world_size = base.world_size
        self.offsets = np.concatenate([[0], np.cumsum(base.shard_samples)]).astype(np.int64)
        self.flat_lengths = (np.concatenate(self.lengths) if self.lengths
                             else np.zeros(0, np.int64))
        self._cache: dict = {}

    def length_of(self, pairs: np.ndarray) -> np.ndarray:
        """Lengths of (shard, row) ``pairs`` [..., 2]; 0 for padding (-1, -1)."""
        pairs = np.asarray(pairs)
        flat = self.offsets[np.maximum(pairs[..., 0], 0)] + pairs[..., 1]
        return np.where(pairs[..., 0] >= 0, self.flat_lengths[np.maximum(flat, 0)], 0)

    def pairs_of(self, flat: np.ndarray) -> np.ndarray:
        """(shard, row) of flat sample indices."""
        shard = np.searchsorted(self.offsets, flat, side="right") - 1
        return np.stack([shard, flat - self.offsets[shard]], -1).astype(np.int32)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """[N, 2] every sample of the data set, shard by shard in the epoch's seeded file order,
        rows permuted within each shard (a one-rank ShardPlan). Streams drawn from it at the
        same pace read from the same one or two shards at any step."""
        one_rank = type(self.base)(self.base.shard_samples, 1, self.base.seed)
        return one_rank.rank_order(epoch, 0)

    def all_batches(self, epoch: int, local_batch_size: int) -> np.ndarray:
        """int32 [P, steps, n, 2]: every rank's (shard, row) pairs of ``epoch``."""
        return self._epoch(epoch, local_batch_size)[0]

    def all_rows(self, epoch: int, local_batch_size: int) -> np.ndarray | None:
        """int [P, steps, n]: the packed row of each sample within its rank's batch (-1 on
        padding), or None where the plan leaves rows to the loader."""
        return self._epoch(epoch, local_batch_size)[1]

    def _epoch(self, epoch: int, b: int):
        key = (epoch, b)
        if key not in self._cache:
            self._cache.clear()  # one epoch at a time (the loader asks for the next early)
            self._cache[key] = self._compute(epoch, b)
        return self._cache[key]

    def rank_batches(self, epoch: int, rank: int, local_batch_size: int) -> np.ndarray:
        return self.all_batches(epoch, local_batch_size)[rank]

    def rank_rows(self, epoch: int, rank: int, local_batch_size: int) -> np.ndarray | None:
        rows = self.all_rows(epoch, local_batch_size)
        return None if rows is None else rows[rank]

    def steps_per_epoch(self, epoch: int, local_batch_size: int) -> int:
        return self.all_batches(epoch, local_batch_size).shape[1]

    def remainder(self, epoch: int, local_batch_size: int) -> np.ndarray:
        """[n, 2] (shard, row) pairs no rank trains in ``epoch``."""
        used = self.all_batches(epoch, local_batch_size).reshape(-1, 2)
        return missing_pairs(self.base.shard_samples, used[used[:, 0] >= 0])

    def deal(self, lengths: np.ndarray, parts: int) -> np.ndarray:
        """[parts·m] sample lengths → [parts, m] positions, by this plan's cost."""
        cost = self.cost
        set_costs = None if cost.additive else (lambda sets: cost.of_lengths(lengths[sets]))
        return balanced_deal(cost.sample_weights(lengths), parts, set_costs,
                             order=sort_desc(lengths))

    def _deal_groups(self, batches: np.ndarray, parts: int) -> np.ndarray:
        """[groups, steps, G·b, 2] → [groups·G, steps, b, 2]: each group's batch of each step
        dealt among its G ranks."""
        groups, steps, n, _ = batches.shape
        b = n // parts
        out = np.empty((groups, parts, steps, b, 2), dtype=np.int32)
        for j in range(groups):
            for s in range(steps):
                sets = self.deal(self.length_of(batches[j, s]), parts)
                out[j, :, s] = batches[j, s][sets]
        return out.reshape(groups * parts, steps, b, 2)

    def _compute(self, epoch: int, b: int):
        raise NotImplementedError


class GlobalPlan(_PlanBase):
    """NVIDIA-style exchange: per step, the world's P·b pool samples dealt by cost among the
    P ranks (see the module docstring)."""

    name = "global-v2"

    def _compute(self, epoch: int, b: int):
        pools = np.stack([self.base.rank_batches(epoch, r, b) for r in range(self.world_size)])
        steps = pools.shape[1]
        flat = pools.transpose(1, 0, 2, 3).reshape(1, steps, -1, 2)  # one group: the world
        return self._deal_groups(flat, self.world_size), None


class LocalPlan(_PlanBase):
    """Samsung-style: every node group takes the same stratified length mix each step, dealt
    by cost among its G ranks (see the module docstring). ``pack`` uses the same batches,
    dealt by the cost of their packed rows."""

    def __init__(self, base, lengths, spec: BalanceSpec):
        super().__init__(base, lengths, spec)
        self.name = f"{spec.mode}-v2"
        self.group_size = spec.group_size
        if self.world_size % self.group_size:
            raise ValueError(f"data.group_size={self.group_size} does not divide the world size "
                             f"{self.world_size} into node groups: set data.group_size to a "
                             f"divisor of {self.world_size} (0 = ranks per node)")
        self.binned = bool(spec.bin_edges) or spec.num_bins > 0
        if self.binned:
            self.edges = bin_edges(self.flat_lengths, spec.bin_edges, spec.num_bins)
            self.bin_sizes = np.bincount(self.bin_of(self.flat_lengths),
                                         minlength=len(self.edges))

    def bin_of(self, lengths: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.edges, lengths, side="left")

    def strata(self, local_batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(stratum of every sample [N] in flat order, samples per group and step of each
        stratum [S]). Default: S = G·b equal slices of the length-sorted data set, one each;
        with bins: the bin, G·c_k each."""
        g = self.group_size
        if self.binned:
            return self.bin_of(self.flat_lengths), g * self.counts(local_batch_size)
        n, slices = len(self.flat_lengths), g * local_batch_size
        stratum = np.empty(n, dtype=np.int64)
        stratum[np.argsort(self.flat_lengths, kind="stable")] = np.arange(n) * slices // n
        return stratum, np.ones(slices, dtype=np.int64)

    def counts(self, local_batch_size: int) -> np.ndarray:
        """c_k: per-rank samples from length bin k (binned strata only)."""
        return per_bin_counts(self.bin_sizes, self.edges, local_batch_size)

    def stratified_steps(self, epoch: int, local_batch_size: int) -> int:
        """The first steps of ``epoch``, where every group takes its count of every stratum;
        the remaining ("tail") steps are made of the strata's leftovers."""
        return self._stratified(epoch, local_batch_size)[1]

    def _compute(self, epoch: int, b: int):
        batches = self._stratified(epoch, b)[0]  # [groups, steps, G·b, 2]
        return self._deal_groups(batches, self.group_size), None

    def _stratified(self, epoch: int, b: int) -> tuple[np.ndarray, int]:
        """Each group's batches before the deal, [groups, steps, G·b, 2], and the number of
        stratified steps. The epoch's order (``epoch_order``) is split by stratum; stratified
        step s gives group j the next n_k of stratum k while every stratum can give all
        groups theirs; then tail steps give each group the next G·b of the leftovers, in
        epoch order, while P·b are left (the rest is the remainder)."""
        g = self.group_size
        groups = self.world_size // g
        stratum, counts = self.strata(b)
        order = self.epoch_order(epoch)
        kinds = stratum[self.offsets[order[:, 0]] + order[:, 1]]
        sizes = np.bincount(kinds, minlength=len(counts))
        steps = int(min(sizes // (groups * counts)))
        if steps == 0:
            self._cannot_fill(sizes, groups * counts)
        by_kind = np.argsort(kinds, kind="stable")  # epoch order within each stratum
        starts = np.concatenate([[0], np.cumsum(sizes)])
        head, rest = [], np.ones(len(order), dtype=bool)
        for k, c in enumerate(counts.tolist()):
            members = by_kind[starts[k]:starts[k] + steps * groups * c]
            head.append(order[members].reshape(steps, groups, c, 2))
            rest[members] = False
        leftovers = order[rest]
        tail = len(leftovers) // (self.world_size * b)
        tail_batches = leftovers[:tail * self.world_size * b].reshape(tail, groups, g * b, 2)
        batches = np.concatenate([np.concatenate(head, axis=2), tail_batches])
        return batches.transpose(1, 0, 2, 3), steps

    def _deal_packed(self, batches: np.ndarray) -> np.ndarray:
        """``pack``: each group's batch dealt by the cost of the rows its ranks will pack."""
        g, cost, width = self.group_size, self.cost, self.spec.pack_length
        groups, steps, n, _ = batches.shape
        out = np.empty((groups, g, steps, n // g, 2), dtype=np.int32)
        for j in range(groups):
            for s in range(steps):
                lengths = self.length_of(batches[j, s])

                def packed_costs(sets, lengths=lengths):
                    return np.array([cost.of_rows(packed_rows(lengths[p], width)) for p in sets])

                sets = balanced_deal(cost.sample_weights(lengths), g, packed_costs,
                                     order=sort_desc(lengths))
                out[j, :, s] = batches[j, s][sets]
        return out.reshape(groups * g, steps, n // g, 2)

    def _cannot_fill(self, sizes, need) -> None:
        k = int(np.flatnonzero(sizes < need)[0])
        what = f"length bin {self.bin_label(k)}" if self.binned else f"length stratum {k}"
        raise DataError(
            f"{what} cannot fill its count: it holds {int(sizes[k])} samples but one step of "
            f"{self.world_size} ranks needs {int(need[k])}; use wider bins (data.bin_edges / "
            "fewer data.num_bins, or 0 for strata), a smaller batch, or more data")

    def bin_label(self, k: int) -> str:
        low = int(self.edges[k - 1]) if k else 0
        return f"({low}, {int(self.edges[k])}]"


class PackPlan(LocalPlan):
    """``pack``: LocalPlan's stratified batches, each group's dealt by the cost of the rows
    its ranks will pack; the loader packs each batch best-fit into rows as it reads it."""

    packs_per_batch = True

    def _compute(self, epoch: int, b: int):
        batches = self._stratified(epoch, b)[0]  # [groups, steps, G·b, 2]
        return self._deal_packed(batches), None


class OfflinePackPlan(_PlanBase):
    """Rows packed over windows of whole shards, P·b sequences per step in equal rows per
    rank (see the module docstring and packing.py)."""

    name = "offline_pack-v1"

    def epoch_rows(self, epoch: int) -> list[np.ndarray]:
        """The epoch's packed rows in stream order, each an array of flat sample indices."""
        order = self.epoch_order(epoch)
        flat = self.offsets[order[:, 0]] + order[:, 1]
        shard_ends = np.flatnonzero(np.diff(order[:, 0])) + 1
        cuts, start = [], 0
        for end in [*shard_ends.tolist(), len(flat)]:
            if end - start >= PACK_WINDOW or end == len(flat):
                cuts.append((start, end))
                start = end
        if len(cuts) > 1 and cuts[-1][1] - cuts[-1][0] < PACK_WINDOW:  # no short last window
            cuts[-2:] = [(cuts[-2][0], cuts[-1][1])]
        rng = np.random.default_rng([self.base.seed, epoch, 1])
        rows: list[np.ndarray] = []
        for a, z in cuts:
            rows += pack_window(flat[a:z], self.flat_lengths[flat[a:z]], self.spec.pack_length,
                                rng, max_count=self.spec.max_seqs_per_row)
        return rows

    def rows_per_rank(self, b: int) -> int:
        """Static shapes: the rows R each rank computes per step - ``static_rows``, or (0)
        ceil(b / the mean sequences per row of epoch 0's packed stream); 0 when not static.
        A step takes R rows per rank where P·R rows can hold exactly P·b sequences, else
        R − 1 or R − 2 (the rest of a rank's R rows are empty): the stream's mix of rows never
        drifts away from what the steps need, and every step is exact."""
        if self.spec.static_rows < 0:
            return 0
        if self.spec.static_rows > 0:
            return self.spec.static_rows
        key = ("rows_per_rank", b)
        if key not in self._cache:
            rows = self.epoch_rows(0)
            mean = sum(len(r) for r in rows) / max(len(rows), 1)
            self._cache[key] = max(1, int(np.ceil(b / mean - 1e-9)))
        return self._cache[key]

    def _compute(self, epoch: int, b: int):
        rows = self.epoch_rows(epoch)
        counts = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        tokens = np.fromiter((int(self.flat_lengths[r].sum()) for r in rows), dtype=np.int64,
                             count=len(rows))
        def set_costs(sets: np.ndarray) -> np.ndarray:  # [P, R] rows → [P] costs
            return np.array([self.cost.of_rows([self.flat_lengths[rows[r]].tolist()
                                                for r in members]) for members in sets])

        fixed = self.rows_per_rank(b)
        steps = row_steps(counts, tokens, self.world_size, b, self.spec.pack_length,
                          set_costs, rows_per_rank=fixed, members=rows,
                          lengths=self.flat_lengths)
        counts = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))  # split
        left = int(counts.sum()) - len(steps) * self.world_size * b
        if fixed and left > 4 * self.world_size * b:  # more than the usual remainder
            mean = counts.mean()
            derived = self.spec.static_rows == 0  # (the rows' mean said how many)
            more = max(int(np.ceil(b / mean)), fixed + 1)
            raise DataError(
                f"data.static_rows={self.spec.static_rows}: "
                f"{'the derived ' if derived else ''}{fixed} packed rows per rank cannot hold "
                f"a local batch of {b} sequences for the whole epoch (the rows hold "
                f"{mean:.2f} sequences on average; {left} of {int(counts.sum())} sequences of "
                f"epoch {epoch} would be left out): set data.static_rows >= {more}")
        widest = max((int(counts[s].sum(1).max()) for s in steps), default=b)
        pairs = np.full((self.world_size, len(steps), widest, 2), -1, dtype=np.int32)
        row_of = np.full((self.world_size, len(steps), widest), -1, dtype=np.int16)
        for s, step in enumerate(steps):
            for rank, members in enumerate(step):
                ids = np.concatenate([rows[r] for r in members])
                pairs[rank, s, :len(ids)] = self.pairs_of(ids)
                row_of[rank, s, :len(ids)] = np.repeat(np.arange(len(members)),
                                                       counts[members])
        return pairs, row_of


def packed_rows(lengths: np.ndarray, pack_length: int) -> list[list[int]]:
    """The rows (as lists of lengths) the loader packs a batch with these lengths into."""
    return [[int(lengths[i]) for i in row] for row in best_fit_decreasing(lengths, pack_length)]


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


PLANS: dict[str, object] = {"random": None, "global": GlobalPlan, "local": LocalPlan,
                            "pack": PackPlan, "offline_pack": OfflinePackPlan}
"""data.balance → its plan class (None: the shard plan as it is). A new mode is a row here, its
plan class, and its name in ``BalanceMode``."""
