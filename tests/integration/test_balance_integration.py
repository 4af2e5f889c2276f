"""loaders.balance with the loaders that use it, over whole epochs: every mode trains each sample
of an epoch once (the plan's remainder aside) on 2 and 4 ranks, a resume mid-epoch gives the
uninterrupted batches in every mode, DALI == torch, and offline-packed rows compute what the
sequences alone compute (the model on both).

Runs on the synthetic data set (tests/support/data.py) and on the real-text ``small_dataset``.
The deals, stratification, packing rules and the errors: tests/unit/test_balance.py."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from loaders.balance import MODES, make_plan
from loaders.collate import IGNORE_INDEX
from loaders.dataset import DataSetInfo, ShardPlan, read_lengths
from tests.support.data import assert_batches_equal, raw_fingerprint, shard_rows
from tests.support.loaders import loader, sequences_of, spec


@pytest.fixture(params=["synthetic_dataset", "small_dataset"])
def dataset(request) -> Path:
    return Path(request.getfixturevalue(request.param))


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
        planned_pairs = plan.rank_batches(0, rank, 4).reshape(-1, 2)
        planned = [raw_fingerprint(shards[s], r) for s, r in planned_pairs.tolist() if s >= 0]
        assert Counter(got) == Counter(planned)  # the loader reads what the plan says
        if mode != "offline_pack":
            assert len(got) == plan.steps_per_epoch(0, 4) * 4  # b sequences per rank and step
        read.update(got)
    assert sum(read.values()) == plan.steps_per_epoch(0, 4) * world * 4  # P·b per step
    left_out = Counter(raw_fingerprint(shards[s], r) for s, r in plan.remainder(0, 4).tolist())
    everything = Counter(raw_fingerprint(s, r) for s in shards.values() for r in range(len(s)))
    assert max(read.values()) == 1 and not read & left_out  # never twice, never a left-out one
    assert read + left_out == everything                     # and nothing else missing
    if mode in ("random", "global"):                          # remainder = ShardPlan's only
        assert len(left_out) == len(ShardPlan(info.train_samples, world, 7).remainder(0, 4))


# ------------------------------------------------------------------------------- packing


def test_offline_packed_rows_compute_what_the_sequences_alone_compute(small_dataset):
    """A padded model built with packed=True on an offline_pack batch gives each sequence the
    hidden states, MLM logits and NSP logit it has alone in an unpacked batch."""
    from runtime.model.bert import BertConfig, BertForPreTraining
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=2, intermediate_size=64, max_position_embeddings=128,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    alone_model = BertForPreTraining(cfg).eval()
    packed_model = BertForPreTraining(cfg, packed=True).eval()
    packed_model.load_state_dict(alone_model.state_dict())
    with loader(small_dataset, 0, 2, 8, "offline_pack") as ld:
        batch = next(ld)
    assert batch.packed
    with torch.no_grad():
        out = packed_model(batch.input_ids, batch.token_type_ids, batch.attention_mask,
                           batch.masked_lm_labels, batch.next_sentence_labels)
        hidden = packed_model.bert(batch.input_ids, batch.token_type_ids,
                                   batch.attention_mask)[0]
    masked_rows = 0
    for i, (r, k) in enumerate((r, k) for r in range(batch.size)
                               for k in range(1, int(batch.attention_mask[r].max()) + 1)):
        where = batch.attention_mask[r] == k
        ids, types = batch.input_ids[r, where][None], batch.token_type_ids[r, where][None]
        labels = batch.masked_lm_labels[r, where][None]
        with torch.no_grad():
            alone = alone_model(ids, types, torch.ones_like(ids), labels,
                                batch.next_sentence_labels[i:i + 1])
            h = alone_model.bert(ids, types, torch.ones_like(ids))[0][0]
        torch.testing.assert_close(hidden[r, where], h, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.nsp_logits[i], alone.nsp_logits[0], atol=1e-5, rtol=1e-5)
        n = int((labels != IGNORE_INDEX).sum())
        torch.testing.assert_close(out.mlm_logits[masked_rows:masked_rows + n],
                                   alone.mlm_logits, atol=1e-4, rtol=1e-5)
        masked_rows += n
    assert masked_rows == out.mlm_logits.shape[0]


# -------------------------------------------------------------------- determinism, resume


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", [2, 4])
def test_resume_mid_epoch_in_every_mode(dataset, mode, world):
    rank = world - 1
    with loader(dataset, rank, world, 4, mode, seed=9) as ld:
        steps = ld.steps_per_epoch
        expected = [next(ld) for _ in range(steps + 3)]
    for consumed in (3, steps - 1):  # mid-epoch, and a resume whose next batches cross epochs
        with loader(dataset, rank, world, 4, mode, seed=9) as first:
            for _ in range(consumed):
                next(first)
            state = json.loads(json.dumps(first.state_dict()))
        with loader(dataset, rank, world, 4, mode, seed=9) as resumed:
            resumed.load_state_dict(state)
            assert_batches_equal([next(resumed) for _ in range(steps + 3 - consumed)],
                                 expected[consumed:])


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
