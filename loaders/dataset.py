"""Reading a prepared data set for training and eval: which rank reads which samples, when.

Owns: the data-set description read from ``stats.json`` (``DataSetInfo``), the per-sample
lengths index (``read_lengths``), the per-epoch sample plan it reads by (``ShardPlan``,
loaders/shard_plan.py, re-exported here: the ``random`` balancing mode, and the per-rank pools
the other modes of balance.py regroup), shard I/O with a background prefetch (``ShardStore``), the
training iterator with a saveable data position (``TrainLoader``, any balancing mode) and the
eval split (``load_eval_batches``). Never: writing data sets (prepare.py), the on-disk schema
(shards.py), padding, packing and labels (collate.py), reading the launcher's environment
(rank and world size are passed in) or any communication: every rank derives the same plan
from ``stats.json``, the lengths index and the seed alone.

Policies, in one place:

* **Whole shards per rank.** Epoch ``e`` shuffles the file list with
  ``numpy.random.default_rng([seed, e])``; rank ``r`` reads ``files[(f·W + r) % n]`` for
  ``f in range(n // W)``. When ``n % W != 0`` the ``n % W`` files at the end of that epoch's
  shuffled list are skipped for the epoch (a different set each epoch; a warning says so once).
* **Order inside a rank.** The rank reads its shards in that order and each shard's rows in a
  permutation drawn from ``default_rng([seed, e, r])``. Rows are shuffled within a shard, not
  across the rank's shards, so only the current shard and the prefetched next one are in
  memory; across an epoch the file order changes too. A batch may straddle two shards.
* **Equal steps on every rank** (otherwise collectives hang): ``steps_per_epoch(e)`` is the
  minimum over ranks of ``samples_r // local_batch_size``, computed from ``stats.json`` sizes.
  A rank's surplus samples (the tail of its order) are not read that epoch. It varies by
  epoch when shard sizes differ.
* **Balanced modes** (``balance=BalanceSpec(...)``, see balance.py for their plans and
  remainders): a rank's batch draws on other ranks' shards, so it reads those too; the
  prefetch then starts every shard a coming step needs first. Equal steps on every rank,
  endless iteration and the data position below hold for every mode. Every mode gives each
  rank ``local_batch_size`` sequences per step except ``offline_pack``, whose step holds
  exactly world × local_batch_size sequences in equal rows per rank (b ± a few per rank).
* **Iteration never ends**: the loader runs on into the next epoch; the trainer stops it
  (MLPerf counts samples, not epochs). ``epoch``/``step_in_epoch`` name the *next* batch.
* **Data position**: ``state_dict()`` is the same on every rank (no rank in it), so one
  copy in a checkpoint serves all ranks; restoring it replays the exact batch sequence.
* **Checksums and values**: with ``verify=True`` every rank checks ``stats.json`` and the eval
  file, and rank ``r`` checks every ``W``-th file of ``checksums.sha256`` from ``r`` (plus the
  row count and, given ``limits``, the values of each train shard among them: token ids in
  [0, vocab), masked positions inside their sequence, ... - ``shards.check_samples``):
  together the ranks read the data set once before the first step, so a bad shard late in
  the epoch stops the run at start-up, not hours in. A failing rank raises ``DataError``
  naming the file and row; the launcher (mpiexec, torchrun, srun) ends the others. Every
  shard's row count and values are checked again when it is loaded (also with
  ``verify=False``).
* **The data set against the model** (``check_data_set``): ``stats.json``'s sequence length,
  ``max_pred`` and vocabulary size against the config's ``data.max_seq_length``,
  ``data.max_predictions_per_seq`` (the MLPerf log reports it) and ``model.vocab_size``.
* **Eval split**: rank ``r`` takes eval samples ``r, r+W, r+2W, …`` in file order, no
  shuffling; every sample is evaluated exactly once across ranks and ranks differ by at most
  one sample. Ranks may run a different number of eval forward passes: the trainer
  all-reduces only the final correct/total sums, never per batch.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from loaders.build_record import STATS_FILE
from loaders.balance import BalanceSpec, make_plan, describe as describe_balance
from loaders.collate import (Batch, Rows, StaticShape, best_fit_rows, bucket_width, collate,
                             masked_slots_per_row, pad_rows, pad_rows_static, sample_rows)
from basis.presets import build_hint
from loaders.shard_plan import PLAN_NAME, ShardPlan  # noqa: F401 (re-exported)
from loaders.shards import (EVAL_FILE, VLEN_INT16, DataError, Limits, Samples, check_samples,
                            read_checksums, read_shard, verify_checksums)

_warned_skips: set = set()
_lengths_cache: dict = {}


# --------------------------------------------------------------------------- data-set info

@dataclass(frozen=True)
class DataSetInfo:
    """What ``stats.json`` says about a prepared data set: shard files, their sizes, the
    parameters used. Read before any shard is opened, so each rank can plan alone."""

    root: Path
    train_files: tuple[str, ...]    # paths relative to root, in stats.json order
    train_samples: tuple[int, ...]  # rows per shard
    parameters: dict
    vocab_size: int | None = None   # lines of the data set's vocab.txt, when stats.json says

    @classmethod
    def read(cls, root, seq_len: int | None = None, max_pred: int | None = None) -> "DataSetInfo":
        """``seq_len``, ``max_pred``: the config's, for the build a missing set is told of."""
        root = Path(root)
        check_data_dir(root, seq_len, max_pred)
        path = root / STATS_FILE
        try:
            stats = json.loads(path.read_text())
            shards = stats["train_shards"]
            files = tuple(str(s["file"]) for s in shards)
            sizes = tuple(int(s["samples"]) for s in shards)
            vocab = stats.get("vocab", {}).get("size") if isinstance(stats.get("vocab"), dict) \
                else None
        except FileNotFoundError:
            raise DataError(f"{path}: missing; {root} is not a prepared data set - build one: "
                            f"{_build(root, seq_len, max_pred)}") from None
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path}: cannot read the train shard list ({e!r}); expected "
                            '"train_shards": [{"file": ..., "samples": N}, ...]') from e
        if not files:
            raise DataError(f"{path}: lists no train shards")
        return cls(root, files, sizes, dict(stats.get("parameters", {})),
                   int(vocab) if isinstance(vocab, int) else None)

    @property
    def num_shards(self) -> int:
        return len(self.train_files)

    @property
    def digest(self) -> str:
        """Identifies the shard list and sizes: a saved data position only means something
        for the same data set."""
        text = json.dumps([self.train_files, self.train_samples])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _build(root: Path, seq_len: int | None, max_pred: int | None) -> str:
    """How to make the data set at ``root``: the build of the config's shape when known."""
    if seq_len is None or max_pred is None:
        return f"`python -m loaders.prepare --out {root}` (make data builds data/cpu128)"
    return build_hint(root, seq_len, max_pred)


def check_data_dir(root: Path, seq_len: int | None = None, max_pred: int | None = None) -> None:
    """A missing data directory is said so, with how to make one (of the config's
    ``seq_len`` and ``max_pred`` when given: basis.presets.build_hint)."""
    if not root.exists():
        raise DataError(f"data.data_dir {root} does not exist: build the data set - "
                        f"{_build(root, seq_len, max_pred)} - or set data.data_dir to where it "
                        f"is")
    if not root.is_dir():
        raise DataError(f"data.data_dir {root} is a file, not a prepared data set directory")


def check_data_set(info: DataSetInfo, *, max_seq_length: int, max_predictions_per_seq: int,
                   vocab_size: int) -> None:
    """The config agrees with what ``stats.json`` says the data set was built with; a
    DataError naming the key and both values otherwise (parameters a data set does not
    record are not checked)."""
    stats = info.root / STATS_FILE
    p = info.parameters
    if "max_pred" in p and int(p["max_pred"]) != max_predictions_per_seq:
        raise DataError(f"{stats}: the data set was built with max_pred = {p['max_pred']}, "
                        f"data.max_predictions_per_seq = {max_predictions_per_seq}: set "
                        f"data.max_predictions_per_seq = {p['max_pred']} (the MLPerf log "
                        f"reports it), or use a data set built with --max-pred "
                        f"{max_predictions_per_seq}")
    if "seq_len" in p and int(p["seq_len"]) > max_seq_length:
        raise DataError(f"{stats}: the data set was built with seq_len = {p['seq_len']}, "
                        f"longer than data.max_seq_length = {max_seq_length}: set "
                        f"data.max_seq_length = {p['seq_len']} or use a data set built "
                        f"with --seq-len {max_seq_length}")
    if info.vocab_size is not None and info.vocab_size > vocab_size:
        raise DataError(f"{stats}: the data set's vocabulary has {info.vocab_size} tokens, "
                        f"model.vocab_size = {vocab_size}: token ids would overflow the "
                        f"embedding - set model.vocab_size >= {info.vocab_size}")


def read_lengths(info: DataSetInfo) -> tuple[np.ndarray, ...]:
    """The lengths index: per train shard, every sample's length (tokens of its input_ids).

    Balancing plans need every sample's length on every rank. It is read from the shards
    themselves once per process (only the input_ids column: about 0.2 s for the 104,573
    samples of data/cpu128) rather than stored by prepare, so data sets built before it
    existed, and their checksums, stay valid."""
    key = (str(info.root), info.digest)
    if key not in _lengths_cache:
        _lengths_cache[key] = tuple(_shard_lengths(info.root / rel, expected)
                                    for rel, expected in zip(info.train_files,
                                                             info.train_samples))
    return _lengths_cache[key]


def _shard_lengths(path: Path, expected: int) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"{path}: missing from the data set - rebuild it with "
                        "`python -m loaders.prepare`")
    try:
        with h5py.File(path, "r") as f:
            column = f["input_ids"][()]
    except (OSError, KeyError, ValueError) as e:
        raise DataError(f"{path}: cannot read its input_ids for the lengths index ({e}); the "
                        "shard is corrupt or not in the MLPerf schema - rebuild the data set") from e
    _check_rows(path, len(column), expected)
    return np.fromiter((len(x) for x in column), dtype=np.int64, count=len(column))


# ------------------------------------------------------------------------------- shard I/O

class ShardStore:
    """The shards a rank holds in memory, loaded on demand or ahead of time on one background
    thread. What is loaded never changes what is read: the order comes from the plan, and a
    prefetch only decides *when* a shard's bytes arrive."""

    def __init__(self, info: DataSetInfo, prefetch: bool = True, limits: Limits | None = None):
        self._info = info
        self._limits = limits
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="presto-shard-prefetch")
                      if prefetch else None)
        self._shards: dict[int, Samples | Future] = {}

    @property
    def resident(self) -> list[int]:
        return sorted(self._shards)

    def prefetch(self, index: int) -> None:
        if self._pool is not None and index not in self._shards:
            self._shards[index] = self._pool.submit(self._read, index)

    def get(self, index: int) -> Samples:
        entry = self._shards.get(index)
        if entry is None:
            entry = self._read(index)
        elif isinstance(entry, Future):
            entry = entry.result()  # re-raises the reader's DataError here, on the main thread
        self._shards[index] = entry
        return entry

    def retain(self, keep: set[int]) -> None:
        for index in [i for i in self._shards if i not in keep]:
            entry = self._shards.pop(index)
            if isinstance(entry, Future):
                entry.cancel()

    def close(self) -> None:
        self._shards.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _read(self, index: int) -> Samples:
        path = self._info.root / self._info.train_files[index]
        samples = _read_shard(path)
        _check_rows(path, len(samples), self._info.train_samples[index])
        check_samples(path, samples, self._limits)
        return samples


def _check_rows(path: Path, found: int, expected: int) -> None:
    if found != expected:
        raise DataError(f"{path}: has {found} samples but {STATS_FILE} says {expected}; the "
                        "data set was modified after preparation - rebuild it")


def _read_shard(path: Path) -> Samples:
    """``read_shard`` with every failure (missing file, damaged data past a good header)
    turned into a DataError that names the file."""
    if not path.is_file():
        raise DataError(f"{path}: missing from the data set - rebuild it with "
                        "`python -m loaders.prepare`")
    try:
        return read_shard(path)
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read ({e}); the shard is corrupt or truncated - "
                        "rebuild the data set with `python -m loaders.prepare`") from e


def _count_rows(path: Path) -> int:
    try:
        with h5py.File(path, "r") as f:
            return len(f["next_sentence_labels"])
    except (OSError, KeyError) as e:
        raise DataError(f"{path}: cannot read its row count ({e}); the shard is corrupt or "
                        "not in the MLPerf schema - rebuild the data set") from e


def take(samples: dict[int, Samples], pairs: np.ndarray) -> Samples:
    """Gather the (shard, row) ``pairs`` from loaded shards into one ``Samples``."""
    cols = {key: [] for key in VLEN_INT16}
    nsp = np.empty(len(pairs), dtype=np.int8)
    for i, (shard, row) in enumerate(pairs.tolist()):
        source = samples[shard]
        for key in VLEN_INT16:
            cols[key].append(getattr(source, key)[row])
        nsp[i] = source.next_sentence_labels[row]
    return Samples(**cols, next_sentence_labels=nsp)


# ---------------------------------------------------------------------------------- training

class TrainLoader:
    """Endless iterator of local training ``Batch``es for one rank (see the module docstring
    for the sharding, ordering, remainder and checksum policies). ``balance`` picks the
    balancing mode (default ``random``); a specification that cannot work on this data set
    (an empty bin, counts no bin can fill, a sample longer than the pack length, a world size
    that does not divide into node groups) raises here, before any batch is read.

    ``drop_last`` must stay True: every rank takes the same number of full batches per epoch
    and the surplus is dropped; partial batches would differ in size across ranks.
    ``limits``: what the model takes (vocabulary, sequence length); every shard's values are
    checked against them when it is loaded, and with ``verify`` this rank's share of the
    shards before the first batch."""

    def __init__(self, data_dir, rank: int, world_size: int, local_batch_size: int, seed: int,
                 *, verify: bool = True, prefetch: bool = True, drop_last: bool = True,
                 balance: BalanceSpec | None = None, limits: Limits | None = None,
                 shapes: str = "dynamic", shape_bucket: int = 64,
                 max_predictions_per_seq: int | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if local_batch_size < 1:
            raise ValueError(f"local_batch_size must be >= 1, got {local_batch_size}")
        if not drop_last:
            raise ValueError("drop_last=False is not supported: every rank must run the same "
                             "number of equal-size steps; the surplus of an epoch is dropped")
        root = Path(data_dir)
        check_data_dir(root)
        self.limits = limits
        if verify:
            verify_checksums(root, [STATS_FILE])
        self.info = DataSetInfo.read(root)
        try:
            self.shard_plan = ShardPlan(self.info.train_samples, world_size, seed)
        except DataError as e:
            raise DataError(f"{root / STATS_FILE}: {e}") from None
        self.balance = balance or BalanceSpec()
        lengths = read_lengths(self.info) if self.balance.mode != "random" else None
        self.plan = make_plan(self.balance, self.shard_plan, lengths)
        self.rank, self.world_size = rank, world_size
        self.local_batch_size, self.seed = local_batch_size, seed
        self._steps_cache: dict[int, int] = {}
        if verify:
            self._verify()
        self._warn_if_shards_skipped()
        self.shapes, self.shape_bucket = shapes, shape_bucket
        self.static = self._static_shape(max_predictions_per_seq) if shapes == "static" else None
        self._check_steps(0)
        self._store = ShardStore(self.info, prefetch, limits)
        self._epoch, self._step = 0, 0
        self._schedules: dict[int, _EpochSchedule] = {}

    # -- position ------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def step_in_epoch(self) -> int:
        return self._step

    @property
    def steps_per_epoch(self) -> int:
        """Steps of the current epoch (it changes with the epoch when shard sizes differ)."""
        return self._steps(self._epoch)

    def steps_in(self, epoch: int) -> int:
        """Steps of ``epoch`` (equal on every rank)."""
        return self._steps(epoch)

    @property
    def resident_shards(self) -> list[int]:
        return self._store.resident

    def state_dict(self) -> dict:
        return {"epoch": self._epoch, "step_in_epoch": self._step, "seed": self.seed,
                "world_size": self.world_size, "local_batch_size": self.local_batch_size,
                "num_shards": self.info.num_shards, "data_set": self.info.digest,
                "plan": self.plan.name, "balance": describe_balance(self.balance)}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        state = {"balance": {"mode": "random"}, **state}  # saved before balancing existed
        for key in ("plan", "balance", "world_size", "local_batch_size", "seed", "num_shards",
                    "data_set"):
            if key not in state:
                raise ValueError(f"data position has no '{key}'; it was not saved by "
                                 "TrainLoader.state_dict()")
            if state[key] != mine[key]:
                raise ValueError(f"data position was saved with {key}={state[key]!r}, this "
                                 f"run has {key}={mine[key]!r}: the sample order would differ. "
                                 f"Resume with the same {key}, or start the data from scratch")
        epoch, step = int(state["epoch"]), int(state["step_in_epoch"])
        steps = self._steps(epoch) if epoch >= 0 else 0
        if not 0 <= step < steps:
            raise ValueError(f"data position epoch={epoch} step_in_epoch={step} is outside "
                             f"that epoch's {steps} steps")
        self._epoch, self._step = epoch, step
        self._schedules.clear()
        self._store.retain(set())

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self) -> "TrainLoader":
        return self

    def __next__(self) -> Batch:
        rows = self.next_rows()
        if self.static is not None:
            return pad_rows_static(rows, self.static)
        if self.shapes == "bucketed":
            longest = max(len(r) for r in rows.input_ids)
            return pad_rows(rows, bucket_width(longest, self.shape_bucket, self._width))
        return pad_rows(rows)

    @property
    def _width(self) -> int:
        """The longest a row can be: the packed row length, else the data set's seq_len."""
        if self.balance.mode in ("pack", "offline_pack"):
            return self.balance.pack_length
        return int(self.info.parameters.get("seq_len", 0)) or (
            self.limits.max_seq_length if self.limits is not None else 512)

    def _static_shape(self, max_predictions_per_seq: int | None) -> StaticShape:
        """Every batch's shapes under ``shapes='static'`` (loaders.collate.StaticShape): rows
        of the full width; offline_pack: the plan's rows per rank, up to max_seqs_per_row
        sequences each; other unpacked modes: one sequence per row, a row per sample."""
        if self.plan.packs_per_batch:
            raise ValueError("static shapes need rows planned for the epoch: data.balance "
                             "'pack' packs each batch on the fly; use 'offline_pack'")
        b = self.local_batch_size
        if hasattr(self.plan, "rows_per_rank"):
            rows = self.plan.rows_per_rank(b)
            per_row = self.balance.max_seqs_per_row or b
        else:
            rows, per_row = b, 1
        p = self.info.parameters
        max_pred = max_predictions_per_seq or int(p.get("max_pred", 0)) or self._width
        prob = p.get("masked_lm_prob")
        per_row_masked = masked_slots_per_row(self._width, per_row, max_pred,
                                              None if prob is None else float(prob))
        return StaticShape(rows=rows, width=self._width, seqs_per_row=per_row,
                           masked=rows * per_row_masked)

    def next_rows(self) -> Rows:
        """The next batch before padding (what the DALI pipeline pads), advancing the
        position. ``pack`` packs the batch's samples best-fit into rows here;
        ``offline_pack``'s rows come from its plan."""
        schedule = self._schedule(self._epoch)
        pairs, rows = schedule.batch(self._step)
        self._plan_residency(schedule)
        shards = {s: self._store.get(s) for s in np.unique(pairs[:, 0]).tolist()}
        samples = take(shards, pairs)
        if self.plan.packs_per_batch:
            rows = best_fit_rows(samples.lengths(), self.balance.pack_length)
        self._advance(len(schedule.batches))
        return sample_rows(samples, rows)

    def close(self) -> None:
        self._store.close()

    def __enter__(self) -> "TrainLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------
    def _advance(self, steps: int) -> None:
        self._step += 1
        if self._step == steps:
            self._schedules.pop(self._epoch, None)
            self._epoch, self._step = self._epoch + 1, 0

    def _schedule(self, epoch: int) -> "_EpochSchedule":
        if epoch not in self._schedules:
            self._check_steps(epoch)
            batches = self.plan.rank_batches(epoch, self.rank, self.local_batch_size)
            rows = (self.plan.rank_rows(epoch, self.rank, self.local_batch_size)
                    if hasattr(self.plan, "rank_rows") else None)
            self._schedules[epoch] = _EpochSchedule(batches, rows)
        return self._schedules[epoch]

    def _plan_residency(self, schedule: "_EpochSchedule") -> None:
        """Keep the shards still needed this epoch, start loading the next ones (several
        at once in the balanced modes, where a batch draws on other ranks' shards)."""
        keep = schedule.needed_from(self._step)
        upcoming = schedule.next_new_shards(self._step)
        if not upcoming:  # last shards of the epoch: prefetch the next epoch's first
            upcoming = self._schedule(self._epoch + 1).first_shards
        self._store.retain(keep | set(upcoming))
        for shard in upcoming:
            self._store.prefetch(shard)

    def _steps(self, epoch: int) -> int:
        if epoch not in self._steps_cache:
            self._steps_cache[epoch] = self.plan.steps_per_epoch(epoch, self.local_batch_size)
        return self._steps_cache[epoch]

    def _check_steps(self, epoch: int) -> None:
        if self._steps(epoch) == 0:
            fewest = min(self.shard_plan.rank_samples(epoch, r) for r in range(self.world_size))
            raise DataError(f"{self.info.root}: in epoch {epoch} a rank gets only {fewest} "
                            f"samples, fewer than local_batch_size={self.local_batch_size}; "
                            "use a smaller batch or a bigger data set")

    def _verify(self) -> None:
        root, w = self.info.root, self.world_size
        share = set(sorted(read_checksums(root))[self.rank::w])
        verify_checksums(root, sorted(share | {EVAL_FILE}))
        for index, rel in enumerate(self.info.train_files):
            if rel in share:
                if self.limits is None:
                    _check_rows(root / rel, _count_rows(root / rel),
                                self.info.train_samples[index])
                    continue
                samples = _read_shard(root / rel)  # rows and values: ~0.06 s a shard
                _check_rows(root / rel, len(samples), self.info.train_samples[index])
                check_samples(root / rel, samples, self.limits)

    def _warn_if_shards_skipped(self) -> None:
        n, w = self.info.num_shards, self.world_size
        key = (str(self.info.root), n, w)
        if n % w and key not in _warned_skips:
            _warned_skips.add(key)
            warnings.warn(f"{self.info.root}: {n} train shards do not divide among {w} ranks; "
                          f"each epoch skips {n % w} shard(s) (a different set each epoch). "
                          f"Prepare a multiple of {w} shards to read every sample every epoch",
                          stacklevel=3)


class _EpochSchedule:
    """One epoch's batches for this rank (``rows``: each sample's packed row, where the plan
    packs; (-1, -1) pairs pad a batch with fewer sequences) plus, per shard, the first and
    last step using it."""

    def __init__(self, batches: np.ndarray, rows: np.ndarray | None = None):
        self.batches, self.rows = batches, rows
        flat = batches[:, :, 0].ravel()
        width = batches.shape[1]
        steps = np.arange(len(flat)) // width
        real = flat >= 0
        flat, steps = flat[real], steps[real]
        shards, first = np.unique(flat, return_index=True)
        _, last_reversed = np.unique(flat[::-1], return_index=True)
        self._last = dict(zip(shards.tolist(), steps[len(flat) - 1 - last_reversed].tolist()))
        by_first = np.argsort(first, kind="stable")
        self._first_steps = steps[first[by_first]]
        self._by_first = shards[by_first]

    def batch(self, step: int) -> tuple[np.ndarray, list[list[int]] | None]:
        """(pairs of the step's samples, their rows as lists of positions, or None)."""
        pairs = self.batches[step]
        real = pairs[:, 0] >= 0
        pairs = pairs[real]
        if self.rows is None:
            return pairs, None
        row_of = self.rows[step][real]
        return pairs, [np.flatnonzero(row_of == r).tolist() for r in range(int(row_of.max()) + 1)]

    @property
    def first_shards(self) -> list[int]:
        return self.next_new_shards(-1)

    def needed_from(self, step: int) -> set[int]:
        return {s for s, last in self._last.items() if last >= step}

    def next_new_shards(self, step: int) -> list[int]:
        """The shards first used at the earliest step after ``step``: the ones to prefetch."""
        i = int(np.searchsorted(self._first_steps, step, side="right"))
        if i == len(self._by_first):
            return []
        same = self._first_steps == self._first_steps[i]
        return self._by_first[same].tolist()


# -------------------------------------------------------------------------------------- eval

def eval_rows(num_samples: int, rank: int, world_size: int) -> np.ndarray:
    """The eval rows rank evaluates: ``rank, rank+W, …`` (strided, file order)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    return np.arange(rank, num_samples, world_size)


def load_eval_batches(data_dir, rank: int, world_size: int, batch_size: int,
                      limits: Limits | None = None) -> list[Batch]:
    """This rank's share of the fixed eval set as a list of ``Batch``es, the last one possibly
    smaller. Deterministic and unshuffled; covers each eval sample exactly once across ranks.
    A rank may get one sample (and so one batch) more than another: all-reduce only the final
    correct/total sums, never per batch. Checksums are verified by ``TrainLoader``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    samples = _read_shard(Path(data_dir) / EVAL_FILE)
    check_samples(Path(data_dir) / EVAL_FILE, samples, limits)
    rows = eval_rows(len(samples), rank, world_size)
    pairs = np.stack([np.zeros_like(rows), rows], 1)
    return [collate(take({0: samples}, pairs[i:i + batch_size]))
            for i in range(0, len(pairs), batch_size)]
