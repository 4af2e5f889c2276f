"""loaders.balance + the loaders that use it: the remainder of local balancing, each mode's
deal never costlier than the strided deal, stratification, packing (per batch and offline),
determinism, a resume with another balance refused, DALI's resume position, and the errors for
specifications that cannot work.

Runs on the synthetic data set (tests/support/data.py) and on the real-text ``small_dataset``.
Whole epochs in every mode (each sample once, exact resume, DALI == torch) and packed rows
through the model: tests/integration/test_balance_integration.py."""
from __future__ import annotations

import numpy as np
import pytest

from loaders import length_cost as lc
from loaders.balance import (MODES, PACKED_MODES, BalanceSpec, GlobalPlan, LocalPlan,
                             OfflinePackPlan, bin_edges, make_plan, packed_rows,
                             per_bin_counts)
from loaders.collate import best_fit_rows, collate_packed
from loaders.dataset import DataSetInfo, ShardPlan, TrainLoader, read_lengths
from loaders.partition import sort_desc, strided
from loaders.shards import DataError, Samples
from tests.support.data import assert_batches_equal, build_synthetic
from tests.support.loaders import loader, sequences_of, spec

SHAPE = dict(vocab_size=30522, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=512)


# --------------------------------------------------------------------- exactly once, per mode


def test_remainder_of_local_is_small_on_real_data(small_dataset):
    info = DataSetInfo.read(small_dataset)
    for mode in ("local", "offline_pack"):
        plan = make_plan(spec(mode), ShardPlan(info.train_samples, 2, 1), read_lengths(info))
        assert len(plan.remainder(0, 8)) < 2 * 2 * 8  # less than two steps' samples


# -------------------------------------------------------------------------------- the deals

def lengths_plan(lengths_per_shard, world, mode, cost=None, **kw):
    sizes = tuple(len(x) for x in lengths_per_shard)
    base = ShardPlan(sizes, world, seed=0)
    lengths = [np.asarray(x) for x in lengths_per_shard]
    return base, make_plan(BalanceSpec(mode, cost=cost, pack_length=512, **kw), base, lengths)


def group_items(plan, batches, step, ranks):
    """The (shard, row) pairs a set of ranks took at ``step``, as a set."""
    return {tuple(p) for r in ranks for p in batches[r, step].tolist() if p[0] >= 0}


def set_cost(cost, mode, lengths):
    """What one rank's batch with these lengths costs in ``mode``."""
    rows = packed_rows(lengths, 512) if mode == "pack" else [[int(n)] for n in lengths]
    return cost.of_rows(rows)


@pytest.mark.parametrize("mode", ["global", "local", "pack"])
@pytest.mark.parametrize("layout", ["unpadded", "padded"])
def test_each_modes_deal_is_never_costlier_than_strided(mode, layout):
    """On random long-tailed length sets, every step's (global) or group's (local, pack)
    samples are dealt with a largest rank cost no higher than the strided deal of the same
    samples (NVIDIA's: rank g takes sorted positions g, g+P, …)."""
    cost = lc.flops_cost(SHAPE, layout)
    rng = np.random.default_rng(1)
    ratios = []
    for trial in range(3):
        shards = [np.minimum(rng.lognormal(4.6, 0.6, 48).astype(int) + 5, 512)
                  for _ in range(4)]
        _, plan = lengths_plan(shards, 4, mode, cost, group_size=2)
        batches = plan.all_batches(0, 4)
        groups = [range(4)] if mode == "global" else [range(0, 2), range(2, 4)]
        for step in range(batches.shape[1]):
            for ranks in groups:
                pairs = np.array(sorted(group_items(plan, batches, step, ranks)))
                x = plan.length_of(pairs)
                mine = max(set_cost(cost, mode, plan.length_of(batches[r, step])) for r in ranks)
                plain = max(set_cost(cost, mode, x[s])
                            for s in strided(sort_desc(x), len(ranks)))
                assert mine <= plain * (1 + 1e-12)
                ratios.append(mine / plain)
    if layout == "unpadded" or mode == "pack":  # not merely as good: better on the whole
        assert np.mean(ratios) < 0.99


def test_offline_pack_rows_are_dealt_no_costlier_than_strided():
    cost = lc.flops_cost(SHAPE, "padded")
    rng = np.random.default_rng(4)
    shards = [np.minimum(rng.lognormal(4.6, 0.6, 200).astype(int) + 5, 512) for _ in range(4)]
    _, plan = lengths_plan(shards, 4, "offline_pack", cost)
    assert isinstance(plan, OfflinePackPlan)
    batches, rows = plan.all_batches(0, 8), plan.all_rows(0, 8)
    for step in range(batches.shape[1]):
        per_rank = []
        for r in range(4):
            x, k = plan.length_of(batches[r, step]), rows[r, step]
            per_rank.append([x[k == j].tolist() for j in range(k.max() + 1)])
        assert len({len(p) for p in per_rank}) == 1  # R rows on every rank
        assert all(sum(row) <= 512 for p in per_rank for row in p)
        flat = [row for p in per_rank for row in p]
        order = sort_desc(np.array([sum(row) for row in flat]))
        plain = max(cost.of_rows([flat[i] for i in s]) for s in strided(order, 4))
        assert max(cost.of_rows(p) for p in per_rank) <= plain * (1 + 1e-12)
        assert sum(len(row) for row in flat) == 4 * 8  # P·b sequences in the step


def test_global_plan_deals_each_steps_pool_samples():
    base, plan = lengths_plan([[10, 50, 30, 20], [60, 40, 5, 70]], 2, "global")
    assert isinstance(plan, GlobalPlan) and plan.name == "global-v2"
    pools = [base.rank_batches(0, r, 2) for r in range(2)]
    got = plan.all_batches(0, 2)
    for step in range(2):
        world = {tuple(p) for pool in pools for p in pool[step].tolist()}
        assert group_items(plan, got, step, range(2)) == world  # the step's pool samples
        # real tokens (the default cost): the two ranks get 100 + 30 / 70 + 60 … balanced
        sums = [int(plan.length_of(got[r, step]).sum()) for r in range(2)]
        lengths = sorted(plan.length_of(np.array(sorted(world))).tolist())
        assert max(sums) == min(max(a + b, sum(lengths) - a - b)
                                for i, a in enumerate(lengths) for b in lengths[i + 1:])


def test_local_strata_give_every_group_one_sample_of_each():
    rng = np.random.default_rng(0)
    shards = [rng.integers(10, 129, 40) for _ in range(4)]
    _, plan = lengths_plan(shards, 4, "local", group_size=2)
    assert isinstance(plan, LocalPlan) and plan.name == "local-v2"
    stratum, counts = plan.strata(3)  # G·b = 6 strata of the sorted lengths, one each
    assert counts.tolist() == [1] * 6
    sizes = np.bincount(stratum)
    assert sizes.max() - sizes.min() <= 1
    order = np.argsort(plan.flat_lengths, kind="stable")
    assert (np.diff(stratum[order]) >= 0).all()  # slices of the sorted data set
    batches = plan.all_batches(0, 3)
    stratified = plan.stratified_steps(0, 3)
    assert 0 < stratified <= batches.shape[1]
    for step in range(stratified):
        for ranks in (range(0, 2), range(2, 4)):
            pairs = np.array(sorted(group_items(plan, batches, step, ranks)))
            flat = plan.offsets[pairs[:, 0]] + pairs[:, 1]
            assert sorted(stratum[flat].tolist()) == list(range(6))


def test_local_with_bins_takes_per_bin_counts_per_group():
    rng = np.random.default_rng(0)
    shards = [rng.integers(10, 129, 40) for _ in range(4)]
    _, plan = lengths_plan(shards, 4, "local", group_size=2, bin_edges=(60, 100, 128))
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
            # group j took the next 2·c_k of each bin's stream, in epoch order
            first = [(step * 2 + group) * 2 * c for c in counts]
            want = {tuple(p) for s, f, c in zip(streams, first, counts)
                    for p in s[f:f + 2 * c].tolist()}
            assert group_items(plan, batches, step, (2 * group, 2 * group + 1)) == want


def test_balanced_modes_even_out_cost_on_real_data(small_dataset):
    info = DataSetInfo.read(small_dataset)
    lengths = read_lengths(info)
    cost = lc.flops_cost(SHAPE, "unpadded")

    def imbalance(mode):
        plan = make_plan(BalanceSpec(mode, group_size=4, cost=cost),
                         ShardPlan(info.train_samples, 4, 3), lengths)
        if mode == "random":
            pairs = np.stack([plan.rank_batches(0, r, 8) for r in range(4)])
            x = np.vectorize(lambda s, r: lengths[s][r])(pairs[..., 0], pairs[..., 1])
        else:
            x = plan.length_of(plan.all_batches(0, 8))
        return lc.imbalance(cost.of_lengths(x))

    random_ = imbalance("random")
    assert random_ > 1.05
    assert imbalance("global") < 1.01 and imbalance("local") < 1.01


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
    """Every batch's 8 sequences in at most 8 rows of at most 128; over 10 batches, rows
    holding two (the set's long sequences pack only now and then)."""
    rows = []
    with loader(small_dataset, 0, 2, 8, "pack") as ld:
        for _ in range(10):
            batch = next(ld)
            assert batch.num_sequences == 8 and batch.size <= 8
            assert batch.input_ids.shape[1] <= 128
            rows.append(batch.size)
    assert min(rows) < 8, rows


def test_offline_pack_fills_rows_and_keeps_the_steps_sequence_count(small_dataset):
    """Rows packed over the epoch are fuller than per-batch packing (padding efficiency
    within 0.01 of best-fit over the whole data set); the two ranks together take 2·b
    sequences every step in the same number of rows."""
    lengths = np.concatenate(read_lengths(DataSetInfo.read(small_dataset)))
    bound = lengths.sum() / (len(best_fit_rows(lengths, 128)) * 128)
    real = computed = 0
    with loader(small_dataset, 0, 2, 8, "offline_pack") as a, \
            loader(small_dataset, 1, 2, 8, "offline_pack") as b:
        for _ in range(a.steps_per_epoch):
            x, y = next(a), next(b)
            assert x.num_sequences + y.num_sequences == 16 and x.size == y.size
            assert x.packed or x.num_sequences == x.size
            real += x.num_real_tokens + y.num_real_tokens
            computed += x.num_padded_tokens + y.num_padded_tokens
    assert real / computed > bound - 0.01


# -------------------------------------------------------------------- determinism, resume

@pytest.mark.parametrize("mode", MODES)
def test_same_seed_same_batches_other_seed_other_batches(synthetic_dataset, mode):
    def first(seed):
        with loader(synthetic_dataset, 1, 2, 4, mode, seed=seed) as ld:
            return [next(ld) for _ in range(4)]
    assert_batches_equal(first(3), first(3))
    assert [sequences_of(b) for b in first(3)] != [sequences_of(b) for b in first(4)]


def test_resume_with_another_balance_is_a_clear_error(synthetic_dataset):
    state = loader(synthetic_dataset, 0, 2, 4, "local").state_dict()
    with pytest.raises(ValueError, match="saved with plan='local-v2'"):
        loader(synthetic_dataset, 0, 2, 4, "pack").load_state_dict(state)
    with pytest.raises(ValueError, match="saved with balance="):
        loader(synthetic_dataset, 0, 2, 4, "local", bin_edges=(50, 128)).load_state_dict(state)
    other_cost = lc.flops_cost(SHAPE, "unpadded")  # another cost model deals differently
    with pytest.raises(ValueError, match="saved with balance="):
        loader(synthetic_dataset, 0, 2, 4, "local", cost=other_cost).load_state_dict(state)


# ------------------------------------------------------------------------------------ DALI


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
    _, plan = lengths_plan(shards, 4, "local", group_size=2, bin_edges=(50, 128))
    assert plan.counts(8).tolist() == [1, 7]
    with pytest.raises(DataError, match=r"length bin \(0, 50\] cannot fill its count: "
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
    with pytest.raises(ValueError, match="data.balance='sorted'.*offline_pack"):
        BalanceSpec("sorted")
    with pytest.raises(ValueError, match="data.num_bins=-1 must be >= 0"):
        BalanceSpec("local", num_bins=-1)
    assert set(PACKED_MODES) < set(MODES) and "offline_pack" in MODES
    with pytest.raises(ValueError, match="strictly increasing"):
        BalanceSpec("local", bin_edges=(90, 60))
