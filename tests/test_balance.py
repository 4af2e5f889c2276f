"""loaders.balance + the loaders that use it: every mode trains each sample of an epoch once
(the plan's remainder aside), the deals (strided, zig-zag), stratification, packing,
determinism, exact resume, DALI == torch, and the errors for specifications that cannot work.

Runs on the synthetic data set of test_dataset.py and on the real-text ``small_dataset``."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from loaders.balance import (BalanceSpec, GlobalPlan, LocalPlan, bin_edges, make_plan,
                             per_bin_counts, strided_deal, zigzag_positions)
from loaders.collate import IGNORE_INDEX, Batch, best_fit_rows, collate_packed
from loaders.dataset import DataSetInfo, ShardPlan, TrainLoader, read_lengths
from loaders.shards import DataError, Samples
from tests.test_dataset import (assert_batches_equal, build_synthetic, raw_fingerprint,
                                shard_rows, synthetic_dataset)  # noqa: F401 (fixture)

MODES = ("random", "global", "local", "pack")


@pytest.fixture(params=["synthetic_dataset", "small_dataset"])
def dataset(request) -> Path:
    return Path(request.getfixturevalue(request.param))


def spec(mode: str, group_size: int = 2, **kw) -> BalanceSpec:
    return BalanceSpec(mode, group_size=group_size, pack_length=128, **kw)


def sequences_of(batch: Batch) -> list[tuple]:
    """Per *sequence* (packed or not), in the row-major order of next_sentence_labels:
    the fingerprint ``raw_fingerprint`` gives a stored sample."""
    out = []
    nsp = batch.next_sentence_labels.tolist()
    for r in range(batch.size):
        mask = batch.attention_mask[r]
        for k in range(1, int(mask.max()) + 1):
            where = torch.nonzero(mask == k).flatten()
            start = int(where[0])
            labels = batch.masked_lm_labels[r, where]
            masked = torch.nonzero(labels != IGNORE_INDEX).flatten().tolist()
            out.append((tuple(batch.input_ids[r, where].tolist()),
                        tuple(batch.token_type_ids[r, where].tolist()),
                        tuple((p, int(labels[p])) for p in masked)))
            assert int(where[-1]) - start + 1 == len(where)  # contiguous in its row
    assert len(out) == len(nsp)
    return [fp + (label,) for fp, label in zip(out, nsp)]


def loader(root, rank, world, b, mode, seed=7, **kw) -> TrainLoader:
    return TrainLoader(root, rank, world, b, seed, verify=False, balance=spec(mode, **kw))


def epoch_sequences(root, rank, world, b, mode, **kw) -> list[tuple]:
    with loader(root, rank, world, b, mode, **kw) as ld:
        batches = [next(ld) for _ in range(ld.steps_per_epoch)]
        assert (ld.epoch, ld.step_in_epoch) == (1, 0)
    return [fp for batch in batches for fp in sequences_of(batch)]


# --------------------------------------------------------------------- exactly once, per mode

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", [2, 4])
def test_every_sample_trained_exactly_once_except_the_remainder(dataset, mode, world):
    shards = shard_rows(dataset)
    info = DataSetInfo.read(dataset)
    plan = make_plan(spec(mode), ShardPlan(info.train_samples, world, 7), read_lengths(info))
    read = Counter()
    for rank in range(world):
        got = epoch_sequences(dataset, rank, world, 4, mode)
        assert len(got) == plan.steps_per_epoch(0, 4) * 4  # b sequences per rank per step
        planned = [raw_fingerprint(shards[s], r) for s, r in plan.rank_batches(0, rank, 4)
                   .reshape(-1, 2).tolist()]
        assert Counter(got) == Counter(planned)  # the loader reads what the plan says
        read.update(got)
    left_out = Counter(raw_fingerprint(shards[s], r) for s, r in plan.remainder(0, 4).tolist())
    everything = Counter(raw_fingerprint(s, r) for s in shards.values() for r in range(len(s)))
    assert max(read.values()) == 1 and not read & left_out  # never twice, never a left-out one
    assert read + left_out == everything                     # and nothing else missing
    if mode in ("random", "global"):                          # remainder = ShardPlan's only
        assert len(left_out) == len(ShardPlan(info.train_samples, world, 7).remainder(0, 4))


def test_remainder_of_local_is_small_on_real_data(small_dataset):
    info = DataSetInfo.read(small_dataset)
    plan = make_plan(spec("local"), ShardPlan(info.train_samples, 2, 1), read_lengths(info))
    assert len(plan.remainder(0, 8)) < 0.08 * sum(info.train_samples)


# -------------------------------------------------------------------------------- the deals

def test_zigzag_deal_assignment():
    assert zigzag_positions(4, 5).tolist() == [[0, 7, 8, 15, 16], [1, 6, 9, 14, 17],
                                               [2, 5, 10, 13, 18], [3, 4, 11, 12, 19]]
    assert zigzag_positions(1, 3).tolist() == [[0, 1, 2]]


def test_strided_deal_assignment():
    order = np.arange(12)[None]  # one step, P=3 ranks, b=4
    assert strided_deal(order, 3)[:, 0].tolist() == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]


def lengths_plan(lengths_per_shard, world, cls, **kw):
    sizes = tuple(len(x) for x in lengths_per_shard)
    base = ShardPlan(sizes, world, seed=0)
    lengths = [np.asarray(x) for x in lengths_per_shard]
    return base, (cls(base, lengths) if cls is GlobalPlan
                  else cls(base, lengths, BalanceSpec("local", **kw)))


def test_global_plan_sorts_the_world_batch_and_deals_strided():
    base, plan = lengths_plan([[10, 50, 30, 20], [60, 40, 5, 70]], 2, GlobalPlan)
    pools = [base.rank_batches(0, r, 2) for r in range(2)]
    for step in range(2):
        pairs = np.concatenate([p[step] for p in pools])
        by_length = sorted(plan.length_of(pairs).tolist(), reverse=True)
        for g in range(2):
            assert plan.length_of(plan.rank_batches(0, g, 2)[step]).tolist() == by_length[g::2]


def test_local_plan_stratifies_then_deals_zigzag_in_groups():
    rng = np.random.default_rng(0)
    shards = [rng.integers(10, 129, 40) for _ in range(4)]
    base, plan = lengths_plan(shards, 4, LocalPlan, group_size=2, bin_edges=(60, 100, 128))
    counts = plan.counts(6)
    assert counts.sum() == 6 and (counts >= 1).all()
    batches = plan.all_batches(0, 6)
    stratified = plan.stratified_steps(0, 6)
    assert 0 < stratified < batches.shape[1]  # some tail steps too
    order = plan.epoch_order(0)
    bins = plan.bin_of(plan.length_of(order))
    streams = [order[bins == k] for k in range(len(counts))]
    for step in range(stratified):
        for group in (0, 1):
            # group j took the next 2·c_k of each bin's stream ...
            first = [(step * 2 + group) * 2 * c for c in counts]
            group_batch = np.concatenate([s[f:f + 2 * c]
                                          for s, f, c in zip(streams, first, counts)])
            lengths = sorted(plan.length_of(group_batch).tolist(), reverse=True)
            for g, r in enumerate((2 * group, 2 * group + 1)):
                mine = batches[r, step]
                # ... sorted them and dealt zig-zag, so each rank has exactly c_k of bin k
                want = [lengths[j] for j in zigzag_positions(2, 6)[g]]
                assert plan.length_of(mine).tolist() == want
                assert np.bincount(plan.bin_of(plan.length_of(mine)),
                                   minlength=len(counts)).tolist() == counts.tolist()
                assert {tuple(p) for p in mine.tolist()} <= {tuple(p) for p in group_batch}


def test_balanced_modes_even_out_tokens_on_real_data(small_dataset):
    info = DataSetInfo.read(small_dataset)
    lengths = read_lengths(info)

    def imbalance(mode):
        plan = make_plan(BalanceSpec(mode, group_size=4), ShardPlan(info.train_samples, 4, 3),
                         lengths)
        if mode == "random":
            pairs = np.stack([plan.rank_batches(0, r, 8) for r in range(4)])
            real = np.vectorize(lambda s, r: lengths[s][r])(pairs[..., 0], pairs[..., 1]).sum(-1)
        else:
            real = plan.length_of(plan.all_batches(0, 8)).sum(-1)
        return float((real.max(0) / real.mean(0)).mean())

    random_ = imbalance("random")
    assert imbalance("global") < random_ and imbalance("local") < random_
    assert imbalance("local") < 1.02


# ------------------------------------------------------------------------------- packing

def test_best_fit_rows():
    assert best_fit_rows(np.array([100, 60, 28, 60, 40, 128]), 128) == [[5], [0, 2], [1, 3],
                                                                       [4]]
    with pytest.raises(DataError, match="raise data.pack_length to at least 100"):
        best_fit_rows(np.array([100, 20]), 64)


def test_packed_batch_layout():
    def sample(ids, positions, nsp):
        return ([np.array(ids, np.int16)], [np.zeros(len(ids), np.int16)],
                [np.array(positions, np.int16)], [np.array(ids, np.int16)[positions]], nsp)

    parts = [sample([101, 5, 6, 102], [2], 1), sample([101, 7, 102], [1], 0),
             sample([101, 8, 9, 10, 102], [3], 1)]
    samples = Samples(*[sum((p[i] for p in parts), []) for i in range(4)],
                      next_sentence_labels=np.array([p[4] for p in parts], np.int8))
    batch = collate_packed(samples, 8)
    assert batch.input_ids.tolist() == [[101, 8, 9, 10, 102, 101, 7, 102],
                                        [101, 5, 6, 102, 0, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 0, 0, 0, 0]]
    assert batch.masked_lm_labels.tolist() == [
        [-100, -100, -100, 10, -100, -100, 7, -100], [-100, -100, 6, -100, -100, -100, -100, -100]]
    assert batch.next_sentence_labels.tolist() == [1, 0, 1]  # per sequence, row-major
    assert batch.packed and batch.num_sequences == 3 and batch.size == 2
    assert (batch.num_real_tokens, batch.num_padded_tokens) == (12, 16)


def test_pack_mode_rows_fit_the_pack_length(small_dataset):
    with loader(small_dataset, 0, 2, 8, "pack") as ld:
        for _ in range(5):
            batch = next(ld)
            assert batch.num_sequences == 8 and batch.size < 8
            assert batch.input_ids.shape[1] <= 128


# -------------------------------------------------------------------- determinism, resume

@pytest.mark.parametrize("mode", MODES)
def test_same_seed_same_batches_other_seed_other_batches(synthetic_dataset, mode):
    def first(seed):
        with loader(synthetic_dataset, 1, 2, 4, mode, seed=seed) as ld:
            return [next(ld) for _ in range(4)]
    assert_batches_equal(first(3), first(3))
    assert [sequences_of(b) for b in first(3)] != [sequences_of(b) for b in first(4)]


@pytest.mark.parametrize("mode", MODES)
def test_resume_mid_epoch_in_every_mode(dataset, mode):
    with loader(dataset, 1, 2, 4, mode, seed=9) as ld:
        steps = ld.steps_per_epoch
        expected = [next(ld) for _ in range(steps + 3)]
    for consumed in (3, steps - 1):  # mid-epoch, and a resume whose next batches cross epochs
        with loader(dataset, 1, 2, 4, mode, seed=9) as first:
            for _ in range(consumed):
                next(first)
            state = json.loads(json.dumps(first.state_dict()))
        with loader(dataset, 1, 2, 4, mode, seed=9) as resumed:
            resumed.load_state_dict(state)
            assert_batches_equal([next(resumed) for _ in range(steps + 3 - consumed)],
                                 expected[consumed:])


def test_resume_with_another_balance_is_a_clear_error(synthetic_dataset):
    state = loader(synthetic_dataset, 0, 2, 4, "local").state_dict()
    with pytest.raises(ValueError, match="saved with plan='local-v1'"):
        loader(synthetic_dataset, 0, 2, 4, "pack").load_state_dict(state)
    with pytest.raises(ValueError, match="saved with balance="):
        loader(synthetic_dataset, 0, 2, 4, "local", bin_edges=(50, 128)).load_state_dict(state)


# ------------------------------------------------------------------------------------ DALI

@pytest.mark.parametrize("mode", MODES)
def test_dali_batches_equal_torch_batches(dataset, mode):
    pytest.importorskip("nvidia.dali")
    from loaders.dali_pipeline import DaliTrainLoader
    with loader(dataset, 1, 2, 4, mode) as ld:
        steps = ld.steps_per_epoch
        expected = [next(ld) for _ in range(steps + 2)]  # into the next epoch
    with DaliTrainLoader(dataset, 1, 2, 4, 7, verify=False, balance=spec(mode)) as dali:
        got = [next(dali) for _ in range(steps + 2)]
        assert (dali.epoch, dali.step_in_epoch) == (1, 2)
    assert_batches_equal(got, expected)


def test_dali_resumes_at_the_delivered_position(synthetic_dataset):
    pytest.importorskip("nvidia.dali")
    from loaders.dali_pipeline import DaliTrainLoader
    kw = dict(verify=False, balance=spec("pack"))
    with loader(synthetic_dataset, 0, 2, 4, "pack") as ld:
        expected = [next(ld) for _ in range(8)]
    with DaliTrainLoader(synthetic_dataset, 0, 2, 4, 7, **kw) as first:
        for _ in range(3):
            next(first)  # DALI has fetched further ahead than this
        state = first.state_dict()
    assert (state["epoch"], state["step_in_epoch"]) == (0, 3)
    with DaliTrainLoader(synthetic_dataset, 0, 2, 4, 7, **kw) as resumed:
        resumed.load_state_dict(state)
        assert_batches_equal([next(resumed) for _ in range(5)], expected[3:])


# ---------------------------------------------------------------------------- bad input

def test_a_bin_spec_leaving_a_bin_empty_is_an_error():
    lengths = np.array([20, 30, 90, 100, 120])
    with pytest.raises(DataError, match=r"length bin \(40, 80\] holds no sample.*remove"):
        bin_edges(lengths, (40, 80, 128), 4)
    with pytest.raises(DataError, match="last edge must be >= the longest sample"):
        bin_edges(lengths, (40, 100), 4)


def test_a_bin_too_small_for_its_per_bin_count_is_an_error():
    with pytest.raises(DataError, match=r"bin \(64, 100\] holds 1 of 101.*data.num_bins"):
        per_bin_counts(np.array([50, 1, 50]), np.array([64, 100, 128]), 8)


def test_per_bin_counts_that_cannot_be_filled_are_an_error():
    shards = [[10] + [100] * 7] * 3 + [[100] * 8]  # 3 short samples: c = (1, 7) needs 4
    _, plan = lengths_plan(shards, 4, LocalPlan, group_size=2, bin_edges=(50, 128))
    assert plan.counts(8).tolist() == [1, 7]
    with pytest.raises(DataError, match=r"length bin \(0, 50\] cannot fill its per-bin count: "
                                        r"it holds 3 samples but one step of 4 ranks needs 4"):
        plan.all_batches(0, 8)


def test_pack_length_shorter_than_a_sample_is_an_error(synthetic_dataset):
    longest = max(int(c.max()) for c in read_lengths(DataSetInfo.read(synthetic_dataset)))
    with pytest.raises(DataError, match=rf"data.pack_length=64 is shorter than a sample.* "
                                        rf"has \d+ tokens\): set data.pack_length >= {longest} "):
        TrainLoader(synthetic_dataset, 0, 2, 4, 1, verify=False,
                    balance=BalanceSpec("pack", group_size=2, pack_length=64))


def test_world_not_divisible_into_node_groups_is_an_error(tmp_path):
    root = build_synthetic(tmp_path / "d", [12] * 6)
    with pytest.raises(ValueError, match="data.group_size=4 does not divide the world size 6"):
        TrainLoader(root, 0, 6, 2, 1, verify=False, balance=BalanceSpec("local", group_size=4))


def test_unknown_mode_and_bad_edges_are_errors():
    with pytest.raises(ValueError, match="data.balance='sorted'"):
        BalanceSpec("sorted")
    with pytest.raises(ValueError, match="strictly increasing"):
        BalanceSpec("local", bin_edges=(90, 60))
