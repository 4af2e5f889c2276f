"""Static shapes and the CUDA-graph step (issue: the small-batch step at the device's speed),
checked on the CPU: every static batch of an epoch has one set of shapes on every rank, its
losses and gradients equal the dynamic batch's on the same samples, the capacity rule refuses
(never drops), the region a full graph captures is capture-safe on the simulated device
(runtime.observe.hostsync: no host read, no data-dependent shape, no host copy, the same op
trace for other data, state changed in place), and the config refuses what cannot be captured.
The replays themselves are checked on a GPU (tests/test_cuda.py, marked cuda)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from loaders.balance import BalanceSpec
from loaders.collate import (IGNORE_INDEX, Rows, StaticShape, bucket_width, masked_slots_per_row,
                             pad_rows, pad_rows_static)
from loaders.dataset import TrainLoader
from loaders.packing import row_steps
from loaders.shards import DataError
from runtime.config import ConfigError
from runtime.model.bert import BertForPreTraining
from runtime.model.config import BertConfig
from runtime.observe.hostsync import SIM_DEVICE, HostSyncs
from runtime.optim.grad_scale import DynamicLossScale
from runtime.train.graphs import StaticInputs, _Packed, batch_tensors, shapes_of
from tests.support.tiny import tiny_config

OFFLINE = dict(mode="offline_pack", pack_length=128, max_seqs_per_row=3, static_rows=0)


def static_loader(data, rank=0, world=2, b=8, **spec):
    return TrainLoader(data, rank, world, b, 5, verify=False, shapes="static",
                       balance=BalanceSpec(**(spec or {"mode": "random"})),
                       max_predictions_per_seq=20)


# ------------------------------------------------------------------------------ the batches

@pytest.mark.parametrize("spec", [OFFLINE, {"mode": "random"}, {"mode": "local"}],
                         ids=["offline_pack", "random", "local"])
def test_every_static_batch_of_an_epoch_has_the_same_shapes_on_every_rank(small_dataset, spec):
    shapes, real, sequences = set(), 0, 0
    for rank in (0, 1):
        with static_loader(small_dataset, rank, **spec) as loader:
            steps = loader.steps_per_epoch
            for _ in range(steps):
                batch = next(loader)
                shapes.add(tuple(shapes_of(batch)))
                real += batch.num_real_tokens
                sequences += int((batch.next_sentence_labels != IGNORE_INDEX).sum())
                assert batch.layout.max_len == loader.static.width  # a constant
            assert loader.epoch == 1  # the whole epoch went through
    assert len(shapes) == 1, shapes
    # every step holds exactly world x local batch sequences, none lost to the static rows
    assert sequences == 2 * 8 * steps


def test_the_static_epoch_of_offline_pack_uses_the_data_set_to_its_end(small_dataset):
    with static_loader(small_dataset, **OFFLINE) as loader:
        plan, b = loader.plan, loader.local_batch_size
        used = plan.all_batches(0, b).reshape(-1, 2)
        total = sum(plan.base.shard_samples)
        # the remainder is about one step's worth, as without static shapes
        assert total - int((used[:, 0] >= 0).sum()) <= 4 * 2 * b
        rows = plan.all_rows(0, b)
        assert int(rows.max()) + 1 <= loader.static.rows


def test_fixed_rows_per_step_hold_exactly_the_step_and_never_more_rows():
    rng = np.random.default_rng(1)
    counts = rng.choice([1, 2, 3], size=5000, p=[0.3, 0.5, 0.2])
    tokens = counts * 40
    # 8 sequences need 4.2 rows of 1.9 sequences on average: R = 5, some steps 4
    steps = row_steps(counts, tokens, ranks=4, per_rank=8, capacity=128, rows_per_rank=5)
    assert len(steps) >= counts.sum() // 32 - 2  # every sequence of the stream but a step's
    assert {s.shape[1] for s in steps} <= {3, 4, 5}
    for step in steps:
        assert step.shape[0] == 4 and int(counts[step].sum()) == 32
    # too few rows for the batch: most of the stream would be left - the plan refuses it
    too_few = row_steps(counts, tokens, ranks=4, per_rank=8, capacity=128, rows_per_rank=3)
    assert len(too_few) < 0.5 * counts.sum() / 32


def test_too_few_static_rows_are_refused_naming_the_key(small_dataset):
    with pytest.raises(DataError, match=r"data.static_rows=2: .* set data.static_rows >= \d"):
        static_loader(small_dataset, **{**OFFLINE, "static_rows": 2})


@pytest.mark.parametrize("attention", ["unpadded", "padded"])
@pytest.mark.parametrize("spec", [OFFLINE, {"mode": "random"}], ids=["packed", "unpacked"])
def test_static_batches_give_the_dynamic_losses_and_gradients(small_dataset, attention, spec):
    cfg = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=1,
                     num_attention_heads=2, intermediate_size=128, max_position_embeddings=128,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = BertForPreTraining(cfg, attention=attention, packed=spec["mode"] == "offline_pack")
    with static_loader(small_dataset, **spec) as loader:
        for _ in range(2):
            rows = loader.next_rows()
            results = []
            for batch in (pad_rows(rows), pad_rows_static(rows, loader.static)):
                model.zero_grad()
                out = model(batch.input_ids, batch.token_type_ids, batch.attention_mask,
                            masked_lm_labels=batch.masked_lm_labels,
                            next_sentence_labels=batch.next_sentence_labels,
                            layout=batch.layout)
                out.loss.backward()
                results.append((out, [p.grad.clone() for p in model.parameters()]))
            (a, ga), (b, gb) = results
            torch.testing.assert_close(b.mlm_loss, a.mlm_loss, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(b.nsp_loss, a.nsp_loss, rtol=1e-6, atol=1e-6)
            assert int(a.mlm_count) == int(b.mlm_count) > 0
            assert int(a.mlm_correct) == int(b.mlm_correct)
            for x, y in zip(ga, gb):
                torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-6)


def rows_of(lengths_per_row, masked_per_seq=2):
    """Rows of sequences of the given lengths: token 5, [CLS] 101 first, the first
    ``masked_per_seq`` tokens after [CLS] labelled."""
    cols = [[], [], [], [], []]
    for lengths in lengths_per_row:
        ids, seg, mask, lab, nsp = [], [], [], [], []
        for k, n in enumerate(lengths, 1):
            ids += [101] + [5] * (n - 1)
            seg += [0] * n
            mask += [k] * n
            lab += [IGNORE_INDEX] + [7] * min(masked_per_seq, n - 1) + \
                [IGNORE_INDEX] * (n - 1 - min(masked_per_seq, n - 1))
            nsp.append(k % 2)
        for c, v in zip(cols, (ids, seg, mask, lab, nsp)):
            c.append(np.asarray(v, dtype=np.int64))
    return Rows(*cols)


def test_a_row_or_batch_beyond_the_capacity_is_refused_never_cut():
    shape = StaticShape(rows=2, width=16, seqs_per_row=2, masked=6)
    ok = pad_rows_static(rows_of([[8, 6], [10]]), shape)
    assert ok.input_ids.shape == (2, 16) and ok.next_sentence_labels.tolist()[3] == IGNORE_INDEX
    assert ok.layout.cu_seqlens.shape == (shape.segments + 1,)
    assert int(ok.layout.cu_seqlens[-1]) == 32  # every token slot is in some segment
    with pytest.raises(DataError, match="at most 2 rows"):
        pad_rows_static(rows_of([[4], [4], [4]]), shape)
    with pytest.raises(DataError, match="data.max_seqs_per_row"):
        pad_rows_static(rows_of([[4, 4, 4]]), shape)
    with pytest.raises(DataError, match="16 tokens"):
        pad_rows_static(rows_of([[10, 9]]), shape)
    with pytest.raises(DataError, match="masked-LM labels, more than its 6 slots"):
        pad_rows_static(rows_of([[8, 8], [8, 8]], masked_per_seq=3), shape)


def test_fewer_rows_than_the_shape_are_completed_with_empty_rows_that_stay_finite():
    shape = StaticShape(rows=3, width=16, seqs_per_row=2, masked=8)
    batch = pad_rows_static(rows_of([[8, 6]]), shape)
    assert batch.input_ids.shape == (3, 16) and int(batch.attention_mask[1:].sum()) == 0
    cfg = BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=16)
    for attention in ("padded", "unpadded"):
        model = BertForPreTraining(cfg, attention=attention, packed=True)
        out = model(batch.input_ids, batch.token_type_ids, batch.attention_mask,
                    masked_lm_labels=batch.masked_lm_labels,
                    next_sentence_labels=batch.next_sentence_labels, layout=batch.layout)
        out.loss.backward()
        assert torch.isfinite(out.loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_the_masked_slots_bound_holds_for_the_masking_rule():
    # loaders.pretraining: min(max_pred, max(1, round(n*p))) labels for n tokens
    rng = np.random.default_rng(0)
    width, k, p, max_pred = 512, 3, 0.15, 76
    bound = masked_slots_per_row(width, k, max_pred, p)
    assert bound == 79
    for _ in range(2000):
        cuts = np.sort(rng.integers(1, width, size=k - 1))
        lengths = np.diff(np.concatenate([[0], cuts, [rng.integers(cuts[-1], width + 1)]]))
        lengths = lengths[lengths > 0]
        labels = sum(min(max_pred, max(1, int(round(n * p)))) for n in lengths)
        assert labels <= bound
    assert masked_slots_per_row(128, 1, 20, None) == 20  # no p recorded: max_pred per sequence


def test_bucketed_widths():
    assert [bucket_width(n, 64, 512) for n in (1, 64, 65, 500, 512)] == [64, 64, 128, 512, 512]
    assert bucket_width(100, 64, 128) == 128


# ------------------------------------------------------------------------------ the step

def simulated_trainer(data, *extra):
    """A trainer of the tiny model on the simulated GPU, static shapes, the full graph mode
    (its eager warm-up: on the simulated device nothing is captured)."""
    from runtime.launch import dist
    from runtime.train.trainer import Trainer
    ctx = dist.current()
    ctx = dataclasses.replace(ctx, device=SIM_DEVICE)
    cfg = tiny_config(data, "train.log_every_steps=1000", 'system.device="auto"',
                      "data.shapes=static", "train.cuda_graphs=full", "optim.backend=auto",
                      *extra)
    trainer = Trainer(cfg, ctx)
    trainer.setup()
    trainer.full_graph.warmup_steps = 10 ** 9  # never capture: run the body, watched
    return trainer


def persistent_tensors(trainer) -> dict[str, tuple[int, int]]:
    """What lives from step to step: (identity, memory) of each tensor a graph would read or
    write at every replay."""
    out = {}
    scale = trainer.loss_scale
    for name in ("scale", "good_steps", "skipped"):
        t = getattr(scale, name)
        if isinstance(t, torch.Tensor):
            out[f"loss_scale.{name}"] = t
    for i, part in enumerate(trainer.optimizer.flat_binding.parts):
        out[f"opt{i}.steps"] = part.steps
        out[f"opt{i}.params"] = part.buffers.params
        for k, v in part.buffers.state.items():
            out[f"opt{i}.{k}"] = v
    out["grads"] = trainer.grad_sync.flat
    out["device_step"] = trainer.device_step
    out["lr_table"] = trainer.lr_table
    for n, p in trainer.model.named_parameters():
        out[n] = p
    return {k: (id(t), t.data_ptr()) for k, t in out.items()}


@pytest.mark.parametrize("case", [
    ["model.attention=unpadded", "data.balance=offline_pack"],
    ["data.balance=offline_pack", "train.clip_mode=local_before",
     "train.gradient_accumulation_steps=2"],
    ["model.attention=unpadded", "train.clip_mode=bucket_before", "fp16"],
    ["train.clip_mode=none"],
    ["model.attention=unpadded", "optim.shard=world", "optim.name=lars",
     "train.clip_mode=bucket_before", "fp16"],
], ids=["unpadded-packed-global_after", "padded-packed-local_before-accum2",
        "unpadded-bucket_before-fp16", "padded-none", "sharded-lars-bucket_before-fp16"])
def test_the_captured_step_is_capture_safe_on_the_simulated_device(small_dataset, single_ctx,
                                                                  case):
    fp16 = "fp16" in case
    with HostSyncs(SIM_DEVICE, capture=True) as syncs:
        trainer = simulated_trainer(small_dataset, *[c for c in case if c != "fp16"],
                                    "train.bucket_cap_mb=0.05")
        if fp16:  # CPU configs refuse fp16; the loss scale itself is what is checked
            trainer.loss_scale = DynamicLossScale(2.0 ** 16, device=SIM_DEVICE)
        it = iter(trainer.train_loader)
        for _ in range(2):  # the first step re-cuts the buckets (before any capture)
            trainer.train_step(it)
        graph = trainer.full_graph
        before = persistent_tensors(trainer)
        traces = []
        for step in range(2):
            batches = [next(it) for _ in range(trainer.accum)]
            graph.inputs.load(batches)  # outside the region, as before a replay
            n, e = len(syncs.trace), len(syncs.events)
            values = trainer._step(graph.inputs.slots)  # the region a full graph captures
            assert syncs.events[e:] == [], HostSyncs.report(syncs)
            traces.append(syncs.trace[n:])
            _Packed(values).pack(values)  # what the graph copies out
        assert traces[0] == traces[1], "the op sequence depends on the data"
        assert len(traces[0]) > 100
        # every state the step changes is changed where it lives
        assert persistent_tensors(trainer) == before
        assert int(trainer.device_step) == trainer.state.step + 2
        trainer.close()


def test_a_full_graph_step_keeps_each_steps_values_and_counts_the_steps(small_dataset,
                                                                        single_ctx):
    trainer = simulated_trainer(small_dataset)
    it = iter(trainer.train_loader)
    recs = [trainer.train_step(it) for _ in range(3)]
    losses = [r.loss for r in recs]
    assert len(set(losses)) == 3  # each record kept its own step's values
    assert int(trainer.device_step) == 3 == trainer.state.step
    # the learning rate the device used is the host's schedule, exactly
    assert recs[-1].lr == trainer.schedule(2) == float(trainer.lr_table[2])
    trainer.close()


def test_static_inputs_copy_a_batch_in_and_refuse_another_shape(small_dataset):
    with static_loader(small_dataset, **OFFLINE) as loader:
        a, b = next(loader), next(loader)
        inputs = StaticInputs([a], torch.device("cpu"))
        inputs.load([b])
        for x, y in zip(batch_tensors(inputs.slots[0]), batch_tensors(b)):
            assert x.dtype == y.dtype and torch.equal(x, y)
    dynamic = pad_rows(rows_of([[8, 6]]))
    with pytest.raises(RuntimeError, match="data.shapes='static'"):
        inputs.load([dynamic])


# ------------------------------------------------------------------------------ refusals

@pytest.mark.parametrize("extra,why", [
    (['system.device="cpu"'], "CUDA device"),
    (["data.shapes=dynamic"], "data.shapes='static'"),
    (["train.grad_sync=ddp"], "grad_sync='buckets'"),
    (["train.timeline=true"], "train.timeline=false"),
    (["train.tied_embedding_sync=split"], "tied_embedding_sync"),
    (['optim.backend="foreach"'], "optim.backend"),
])
def test_what_cannot_be_captured_is_refused_naming_the_key(small_dataset, extra, why):
    with pytest.raises(ConfigError, match="train.cuda_graphs='full' needs") as e:
        tiny_config(small_dataset, 'system.device="auto"', "data.shapes=static",
                    "train.cuda_graphs=full", "optim.backend=auto", *extra)
    assert why in str(e.value)


def test_static_shapes_refuse_per_batch_packing_and_dali(small_dataset):
    with pytest.raises(ConfigError, match="offline_pack"):
        tiny_config(small_dataset, "data.shapes=static", "data.balance=pack")
    with pytest.raises(ConfigError, match="data.loader='torch'"):
        tiny_config(small_dataset, "data.shapes=bucketed", "data.loader=dali")


def test_a_cpu_rank_refuses_graphs_before_building_anything(small_dataset, single_ctx):
    from runtime.train.trainer import Trainer
    cfg = tiny_config(small_dataset, 'system.device="auto"', "data.shapes=static",
                      "train.cuda_graphs=encoder")
    trainer = Trainer(cfg, single_ctx)
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        trainer.setup()
    assert trainer.grad_sync is None  # nothing was built
