"""loaders.dataset / loaders.collate: shard plan, batches, data position, checksums, eval split.

The synthetic data set (tests/support/data.py) is schema-correct but random text; where the
session fixture ``small_dataset`` (real text, from tests/conftest.py) exists, the exactly-once
and resume tests run on it too. Two real MPI ranks reading an epoch:
tests/ranks/test_dataset_ranks.py.
"""
from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from loaders.collate import IGNORE_INDEX, Batch, collate
from loaders.dataset import (STATS_FILE, DataSetInfo, ShardPlan, TrainLoader, eval_rows,
                             load_eval_batches)
from loaders.shards import EVAL_FILE, TRAIN_DIR, DataError, Samples, read_shard, shard_name
from tests.support.data import (CLS, MASK, SEP, SEQ_LEN, assert_batches_equal, batch_fingerprints,
                                build_synthetic, every_row, raw_fingerprint, rewrite_checksums,
                                shard_rows)

# synthetic_dataset (module fixture): tests/support/data.py, through tests/conftest.py


# ------------------------------------------------------------------------ synthetic data set

def copy_of(root: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(root, tmp_path / "copy"))


@pytest.fixture(params=["synthetic_dataset", "small_dataset"])
def dataset(request) -> Path:
    """Both data sets; ``small_dataset`` (real text) comes from tests/conftest.py."""
    try:
        return Path(request.getfixturevalue(request.param))
    except pytest.FixtureLookupError:
        pytest.skip(f"no '{request.param}' fixture in tests/conftest.py")


# ------------------------------------------------------------------------- fingerprints

def plan_fingerprints(shards: dict[int, Samples], batches: np.ndarray) -> Counter:
    return Counter(raw_fingerprint(shards[s], r) for s, r in batches.reshape(-1, 2).tolist())


def read_epoch(root: Path, rank: int, world: int, batch: int, seed: int = 7, **kw) -> list[Batch]:
    loader = TrainLoader(root, rank, world, batch, seed, verify=False, **kw)
    batches = [next(loader) for _ in range(loader.steps_per_epoch)]
    assert (loader.epoch, loader.step_in_epoch) == (1, 0)
    loader.close()
    return batches


# -------------------------------------------------------------------------------- batches

def test_batch_shapes_and_dtypes(synthetic_dataset):
    loader = TrainLoader(synthetic_dataset, 0, 2, 4, seed=1)
    batch = next(loader)
    b, width = batch.input_ids.shape
    assert b == 4 and batch.size == 4
    for name in ("input_ids", "token_type_ids", "attention_mask", "masked_lm_labels"):
        t = getattr(batch, name)
        assert t.dtype == torch.int64 and t.shape == (b, width), name
    assert batch.next_sentence_labels.dtype == torch.int64
    assert batch.next_sentence_labels.shape == (b,)
    assert batch.num_padded_tokens == b * width
    assert batch.num_real_tokens == int(batch.attention_mask.sum())
    moved = batch.to("cpu", non_blocking=True)
    assert torch.equal(moved.input_ids, batch.input_ids)
    assert moved.num_real_tokens == batch.num_real_tokens
    # The host-built layout travels with the batch (the model then reads nothing back).
    lay = moved.layout
    assert lay is not batch.layout and torch.equal(lay.token_index, batch.layout.token_index)
    real = batch.attention_mask.reshape(-1) > 0
    assert torch.equal(lay.token_index, real.nonzero().squeeze(1))
    assert lay.cu_seqlens.dtype == torch.int32 and int(lay.cu_seqlens[-1]) == batch.num_real_tokens
    assert list(lay.lengths) == [n for row in batch.sequence_lengths for n in row]
    labels = batch.masked_lm_labels.reshape(-1)
    assert torch.equal(lay.masked_positions, (labels != IGNORE_INDEX).nonzero().squeeze(1))
    loader.close()


def test_padding_only_to_the_batch_longest(synthetic_dataset):
    widths = set()
    for batch in read_epoch(synthetic_dataset, 0, 1, 4):
        lengths = batch.attention_mask.sum(1)
        width = batch.input_ids.shape[1]
        widths.add(width)
        assert width == int(lengths.max()) < SEQ_LEN
        assert torch.equal(batch.attention_mask.bool(),
                           torch.arange(width)[None, :] < lengths[:, None])
        pad = batch.attention_mask == 0
        assert not batch.input_ids[pad].any() and not batch.token_type_ids[pad].any()
        assert (batch.masked_lm_labels[pad] == IGNORE_INDEX).all()
        assert (batch.input_ids[:, 0] == CLS).all()
    assert len(widths) > 1


def test_labels_rebuilt_from_positions(synthetic_dataset):
    shards = shard_rows(synthetic_dataset)
    by_ids = {tuple(s.input_ids[r].tolist()): (s, r) for s, r in every_row(shards)}
    for batch in read_epoch(synthetic_dataset, 1, 2, 4)[:4]:
        for i, n in enumerate(batch.attention_mask.sum(1).tolist()):
            s, r = by_ids[tuple(batch.input_ids[i, :n].tolist())]
            expected = torch.full((batch.input_ids.shape[1],), IGNORE_INDEX)
            expected[torch.from_numpy(s.masked_lm_positions[r].astype(np.int64))] = \
                torch.from_numpy(s.masked_lm_ids[r].astype(np.int64))
            assert torch.equal(batch.masked_lm_labels[i], expected)
            assert batch.token_type_ids[i, :n].tolist() == s.segment_ids[r].tolist()
            assert int(batch.next_sentence_labels[i]) == int(s.next_sentence_labels[r])


def test_collate_ignores_position_zero_padding():
    s = Samples(input_ids=[np.array([CLS, 5000, MASK, SEP], np.int16)],
                segment_ids=[np.zeros(4, np.int16)],
                masked_lm_positions=[np.array([2, 0, 0], np.int16)],
                masked_lm_ids=[np.array([7000, 0, 0], np.int16)],
                next_sentence_labels=np.array([1], np.int8))
    labels = collate(s).masked_lm_labels.tolist()
    assert labels == [[IGNORE_INDEX, IGNORE_INDEX, 7000, IGNORE_INDEX]]


# ------------------------------------------------------------------ exactly once per epoch

@pytest.mark.parametrize("world", [2, 4])
def test_every_sample_read_exactly_once_per_epoch(dataset, world):
    shards = shard_rows(dataset)
    plan = ShardPlan(DataSetInfo.read(dataset).train_samples, world, seed=7)
    read, planned = Counter(), Counter()
    for rank in range(world):
        batches = read_epoch(dataset, rank, world, batch=4)
        assert len(batches) == plan.steps_per_epoch(0, 4)
        read.update(fp for batch in batches for fp in batch_fingerprints(batch))
        planned.update(plan_fingerprints(shards, plan.rank_batches(0, rank, 4)))
    everything = Counter(raw_fingerprint(s, r) for s, r in every_row(shards))
    assert read == planned            # the loader reads exactly what the plan says ...
    assert not read - everything      # ... never a sample twice ...
    steps = plan.steps_per_epoch(0, 4)
    assert sum(read.values()) == world * steps * 4
    if plan.num_shards % world == 0 and all(plan.rank_samples(0, r) == steps * 4
                                            for r in range(world)):
        assert read == everything     # ... and, when shards and batches divide, all of them


def test_plan_pairs_are_disjoint_across_ranks_and_epochs_differ():
    plan = ShardPlan((24, 20, 28, 16, 24, 24), world_size=3, seed=5)
    for epoch in range(3):
        pairs = np.concatenate([plan.rank_batches(epoch, r, 4).reshape(-1, 2) for r in range(3)])
        assert len({tuple(p) for p in pairs.tolist()}) == len(pairs)
    orders = {tuple(plan.file_order(e)) for e in range(4)}
    assert len(orders) > 1


def test_unequal_shards_give_every_rank_the_same_steps(tmp_path):
    root = build_synthetic(tmp_path / "d", [24, 20, 28, 16])
    plan = ShardPlan((24, 20, 28, 16), 2, seed=3)
    loaders = [TrainLoader(root, r, 2, 4, seed=3, verify=False) for r in range(2)]
    for epoch in range(3):
        steps = plan.steps_per_epoch(epoch, 4)
        assert steps == min(plan.rank_samples(epoch, r) for r in range(2)) // 4
        for loader in loaders:
            assert loader.steps_per_epoch == steps
            for _ in range(steps):
                next(loader)
            assert (loader.epoch, loader.step_in_epoch) == (epoch + 1, 0)
    for loader in loaders:
        loader.close()


def test_leftover_shards_are_skipped_with_a_warning(tmp_path):
    root = build_synthetic(tmp_path / "d", [8] * 5)
    with pytest.warns(UserWarning, match="skips 1 shard"):
        TrainLoader(root, 0, 2, 4, seed=0, verify=False).close()
    shards = shard_rows(root)
    plan = ShardPlan((8,) * 5, 2, seed=0)
    read = Counter()
    for rank in range(2):
        for batch in read_epoch(root, rank, 2, 4, seed=0):
            read.update(batch_fingerprints(batch))
    skipped = int(plan.skipped_shards(0)[0])
    expected = Counter(raw_fingerprint(shards[s], r)
                       for s in shards if s != skipped for r in range(8))
    assert read == expected
    assert len({int(plan.skipped_shards(e)[0]) for e in range(6)}) > 1


# ---------------------------------------------------------------- order and determinism

def test_same_seed_same_batches_and_prefetch_does_not_change_them(synthetic_dataset):
    a = read_epoch(synthetic_dataset, 1, 2, 4, seed=11)
    b = read_epoch(synthetic_dataset, 1, 2, 4, seed=11, prefetch=False)
    assert_batches_equal(a, b)


def test_epochs_and_seeds_give_different_orders(synthetic_dataset):
    def order(seed, epochs):
        loader = TrainLoader(synthetic_dataset, 0, 2, 4, seed, verify=False)
        out = []
        for _ in range(epochs):
            out.append([fp[0] for _ in range(loader.steps_per_epoch)
                        for fp in batch_fingerprints(next(loader))])
        loader.close()
        return out

    e0, e1 = order(3, 2)
    assert e0 != e1
    assert order(4, 1)[0] != e0


def test_shards_are_loaded_lazily_one_ahead(synthetic_dataset):
    loader = TrainLoader(synthetic_dataset, 0, 1, 5, seed=2, verify=False)
    assert loader.resident_shards == []
    for _ in range(3 * loader.steps_per_epoch):
        next(loader)
        assert 1 <= len(loader.resident_shards) <= 3  # current (two if a batch straddles) + next
    loader.close()


# -------------------------------------------------------------------------- data position

@pytest.mark.parametrize("prefetch", [True, False])
def test_resume_yields_exactly_the_uninterrupted_batches(dataset, prefetch):
    steps = TrainLoader(dataset, 1, 2, 4, seed=9, verify=False).steps_per_epoch
    total = steps + 3
    reference = TrainLoader(dataset, 1, 2, 4, seed=9, verify=False)
    expected = [next(reference) for _ in range(total)]
    reference.close()
    for consumed in (0, 3, steps - 2, steps):  # steps - 2: the next batches cross an epoch
        first = TrainLoader(dataset, 1, 2, 4, seed=9, verify=False)
        for _ in range(consumed):
            next(first)
        state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint round trip
        first.close()
        resumed = TrainLoader(dataset, 1, 2, 4, seed=9, verify=False, prefetch=prefetch)
        resumed.load_state_dict(state)
        got = [next(resumed) for _ in range(total - consumed)]
        assert_batches_equal(got, expected[consumed:])
        resumed.close()


def test_state_dict_is_rank_independent_and_complete(synthetic_dataset):
    states = [TrainLoader(synthetic_dataset, r, 2, 4, seed=1, verify=False).state_dict()
              for r in range(2)]
    assert states[0] == states[1]
    assert {"epoch", "step_in_epoch", "seed", "world_size", "local_batch_size"} <= set(states[0])


@pytest.mark.parametrize("key,other", [("world_size", 4), ("local_batch_size", 2), ("seed", 2)])
def test_resume_with_other_settings_is_a_clear_error(synthetic_dataset, key, other):
    settings = {"world_size": 2, "local_batch_size": 4, "seed": 1}
    state = TrainLoader(synthetic_dataset, 0, verify=False, **settings).state_dict()
    settings[key] = other
    loader = TrainLoader(synthetic_dataset, 0, verify=False, **settings)
    with pytest.raises(ValueError, match=f"saved with {key}="):
        loader.load_state_dict(state)


def test_resume_on_another_data_set_or_past_the_epoch_is_an_error(synthetic_dataset, tmp_path):
    state = TrainLoader(synthetic_dataset, 0, 2, 4, seed=1, verify=False).state_dict()
    other = build_synthetic(tmp_path / "other", [24, 24, 24, 20])
    with pytest.raises(ValueError, match="saved with data_set="):
        TrainLoader(other, 0, 2, 4, seed=1, verify=False).load_state_dict(state)
    loader = TrainLoader(synthetic_dataset, 0, 2, 4, seed=1, verify=False)
    with pytest.raises(ValueError, match="outside that epoch's 12 steps"):
        loader.load_state_dict({**state, "step_in_epoch": 12})


# ------------------------------------------------------------------------ checksums, errors

def flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def errors_by_rank(root: Path, world: int) -> list[str]:
    messages = []
    for rank in range(world):
        try:
            TrainLoader(root, rank, world, 4, seed=0).close()
        except DataError as e:
            messages.append(str(e))
    return messages


@pytest.mark.parametrize("damage", [flip_bytes, truncate])
def test_corrupt_or_truncated_shard_is_an_error_naming_the_file(synthetic_dataset, tmp_path,
                                                                damage):
    root = copy_of(synthetic_dataset, tmp_path)
    bad = root / TRAIN_DIR / shard_name(2, 4)
    damage(bad)
    with pytest.raises(DataError, match=f"{bad}: checksum mismatch"):
        TrainLoader(root, 0, 1, 4, seed=0)
    messages = errors_by_rank(root, 2)  # the ranks share the hashing; one of them finds it
    assert len(messages) == 1 and str(bad) in messages[0]


def test_truncated_shard_without_verify_fails_when_read(synthetic_dataset, tmp_path):
    root = copy_of(synthetic_dataset, tmp_path)
    for i in range(4):
        truncate(root / TRAIN_DIR / shard_name(i, 4))
    loader = TrainLoader(root, 0, 1, 4, seed=0, verify=False)
    with pytest.raises(DataError, match=str(root / TRAIN_DIR / "part_0000")):
        next(loader)
    loader.close()


def test_corrupt_eval_file_is_found_by_every_rank(synthetic_dataset, tmp_path):
    root = copy_of(synthetic_dataset, tmp_path)
    flip_bytes(root / EVAL_FILE)
    messages = errors_by_rank(root, 2)
    assert len(messages) == 2 and all(str(root / EVAL_FILE) in m for m in messages)


def test_row_count_disagreeing_with_stats_is_an_error(synthetic_dataset, tmp_path):
    root = copy_of(synthetic_dataset, tmp_path)
    stats = json.loads((root / STATS_FILE).read_text())
    stats["train_shards"][1]["samples"] = 25
    (root / STATS_FILE).write_text(json.dumps(stats))
    rewrite_checksums(root)
    bad = root / stats["train_shards"][1]["file"]
    with pytest.raises(DataError, match=f"{bad}: has 24 samples but stats.json says 25"):
        TrainLoader(root, 0, 1, 4, seed=0)
    loader = TrainLoader(root, 0, 1, 4, seed=0, verify=False)  # caught again at load time
    with pytest.raises(DataError, match="says 25"):
        for _ in range(2 * loader.steps_per_epoch):
            next(loader)
    loader.close()


def test_more_ranks_than_shards_is_an_error(synthetic_dataset):
    with pytest.raises(DataError, match=r"need at least 5 shards.*loaders.prepare --shards"):
        TrainLoader(synthetic_dataset, 0, 5, 4, seed=0)


def test_unsupported_drop_last_and_bad_rank(synthetic_dataset):
    with pytest.raises(ValueError, match="drop_last"):
        TrainLoader(synthetic_dataset, 0, 2, 4, seed=0, drop_last=False)
    with pytest.raises(ValueError, match="rank 2"):
        TrainLoader(synthetic_dataset, 2, 2, 4, seed=0)


# ----------------------------------------------------------------------------------- eval

@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_eval_split_covers_every_sample_once(synthetic_dataset, world):
    raw = read_shard(synthetic_dataset / EVAL_FILE)
    everything = Counter(raw_fingerprint(raw, r) for r in range(len(raw)))
    seen, counts = Counter(), []
    for rank in range(world):
        batches = load_eval_batches(synthetic_dataset, rank, world, batch_size=4)
        again = load_eval_batches(synthetic_dataset, rank, world, batch_size=4)
        assert_batches_equal(batches, again)
        assert all(b.size <= 4 for b in batches)
        fps = [fp for b in batches for fp in batch_fingerprints(b)]
        expected = [raw_fingerprint(raw, r) for r in eval_rows(len(raw), rank, world)]
        assert fps == expected  # file order, no shuffling
        seen.update(fps)
        counts.append(len(fps))
    assert seen == everything
    assert max(counts) - min(counts) <= 1
