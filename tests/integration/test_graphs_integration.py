"""Static shapes and the CUDA-graph step (issue: the small-batch step at the device's speed),
checked on the CPU with the model and the trainer: a static batch's losses and gradients equal
the dynamic batch's on the same samples, and the region a full graph captures is capture-safe
on the simulated device (runtime.observe.hostsync: no host read, no data-dependent shape, no
host copy, the same op trace for other data, state changed in place) and keeps each step's
values - in every precision and compile mode bench.gpu's verdicts capture (bf16_master, its
qkv, compiled layers). The shapes, the capacity rule and the config's refusals:
tests/unit/test_graphs.py; the replays themselves on a GPU: tests/integration/test_cuda_graphs.py
(marked cuda)."""
from __future__ import annotations


import pytest
import torch

from loaders.collate import pad_rows, pad_rows_static
from runtime.model.bert import BertForPreTraining
from runtime.model.config import BertConfig
from runtime.observe.hostsync import SIM_DEVICE, HostSyncs, simulated
from runtime.optim.grad_scale import DynamicLossScale
from runtime.train.graphs import _Packed
from tests.support.capture import ForcedOverflow, persistent_tensors
from tests.support.loaders import OFFLINE, static_loader
from tests.support.tiny import tiny_config


# ------------------------------------------------------------------------------ the batches


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


# ------------------------------------------------------------------------------ the step

def simulated_trainer(data, *extra):
    """A trainer of the tiny model on the simulated GPU, static shapes, the full graph mode
    (its eager warm-up: on the simulated device nothing is captured)."""
    from runtime.launch import dist
    from runtime.train.trainer import Trainer
    ctx = simulated(dist.current())
    cfg = tiny_config(data, "train.log_every_steps=1000", 'system.device="auto"',
                      "data.shapes=static", "train.cuda_graphs=full", "optim.backend=auto",
                      *extra)
    trainer = Trainer(cfg, ctx)
    trainer.setup()
    trainer.runner.graph.warmup_steps = 10 ** 9  # never capture: run the body, watched
    return trainer


@pytest.mark.parametrize("case", [
    ["model.attention=unpadded", "data.balance=offline_pack"],
    ["data.balance=offline_pack", "train.clip_mode=local_before",
     "train.gradient_accumulation_steps=2"],
    ["model.attention=unpadded", "train.clip_mode=bucket_before", "fp16"],
    ["train.clip_mode=none"],
    ["model.attention=unpadded", "optim.shard=world", "optim.name=lars",
     "train.clip_mode=bucket_before", "fp16"],
    # model.fp8: torchao's amax, scale and cast (emulated here; the GEMM alone differs on a GPU)
    ["model.attention=unpadded", "model.fp8=tensorwise"],
    # bench.gpu's verdict modes: bf16 parameters with fp32 masters and the one QKV GEMM, and
    # the best mode - with pad_vocab, whole layers compiled (in the warm-up, as on a GPU)
    ["model.attention=unpadded", "data.balance=offline_pack", "train.precision=bf16_master",
     'model.fusions=["qkv"]'],
    ["model.attention=unpadded", "data.balance=offline_pack", "train.precision=bf16_master",
     'model.fusions=["pad_vocab","qkv"]', "model.compile=layers"],
], ids=["unpadded-packed-global_after", "padded-packed-local_before-accum2",
        "unpadded-bucket_before-fp16", "padded-none", "sharded-lars-bucket_before-fp16",
        "unpadded-fp8", "bf16_master-qkv", "bf16_master-layers"])
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
        graph = trainer.runner.graph
        before = persistent_tensors(trainer)
        traces = []
        for step in range(2):
            batches = [next(it) for _ in range(trainer.body.accum)]
            graph.inputs.load(batches)  # outside the region, as before a replay
            n, e = len(syncs.trace), len(syncs.events)
            values = trainer.runner.captured_step(graph.inputs.slots)  # the region the graph captures
            assert syncs.events[e:] == [], HostSyncs.report(syncs)
            traces.append(syncs.trace[n:])
            _Packed(values).pack(values)  # what the graph copies out
        assert traces[0] == traces[1], "the op sequence depends on the data"
        assert len(traces[0]) > 100
        # every state the step changes is changed where it lives
        assert persistent_tensors(trainer) == before
        assert int(trainer.runner.device_step) == trainer.state.step + 2
        trainer.close()


def test_a_full_graph_step_keeps_each_steps_values_and_counts_the_steps(small_dataset,
                                                                        single_ctx):
    trainer = simulated_trainer(small_dataset)
    it = iter(trainer.train_loader)
    recs = [trainer.train_step(it) for _ in range(3)]
    losses = [r.loss for r in recs]
    assert len(set(losses)) == 3  # each record kept its own step's values
    assert int(trainer.runner.device_step) == 3 == trainer.state.step
    # the learning rate the device used is the host's schedule, exactly
    assert recs[-1].lr == trainer.schedule(2) == float(trainer.runner.lr_table[2])
    trainer.close()


def test_a_forced_overflow_skips_until_the_scale_is_back_in_range(small_dataset, single_ctx):
    """The CUDA test's fp16 overflow scenario (tests/integration/test_cuda_graphs.py) in the full
    graph's step body on the CPU: fp32 overflows at 2^127 and still at 2^126 (a loss of ~10
    times either is past fp32's 3.4e38), so two steps are skipped, the scale halving inside
    each - the CUDA test once expected one."""
    trainer = simulated_trainer(small_dataset)
    trainer.loss_scale = DynamicLossScale(2.0 ** 16, device=SIM_DEVICE)
    forced, it, recs = ForcedOverflow(2.0 ** 127), iter(trainer.train_loader), []
    for i in range(10):
        forced(trainer, i)
        recs.append(trainer.train_step(it))
    forced.check(recs)
    assert all(r.loss == r.loss for r in recs)  # the skipped steps left no NaN behind
    trainer.close()


def _addresses(trainer, grads: bool = True) -> dict:
    """Where each parameter and its gradient live (what a captured graph reads and writes;
    ``grads=False``: the parameters alone - an encoder graph reads them and hands its
    gradients to the eager AccumulateGrad, which the bucket engine adds into its buffer)."""
    return {n: (p.data_ptr(), None if p.grad is None or not grads else p.grad.data_ptr())
            for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("accum", [1, 2, 4, 8])
@pytest.mark.parametrize("mode", ["encoder", "full"])
def test_graphs_are_captured_after_the_recut_on_the_live_buffers(small_dataset, single_ctx,
                                                                 monkeypatch, mode, accum):
    """The bucket engine re-cuts its plan at the end of the first step and re-binds every
    parameter and gradient to new buffers: a graph captured before that (encoder graphs once
    counted micro-batches, so with 4 a step they captured inside step 1) would replay on the
    freed ones. The capture, faked on CPU, records the buffers it would bake in; after more
    steps they are still the live ones, at every accumulation."""
    from runtime.launch import dist
    from runtime.train.graphs import FullStepGraph
    from runtime.train.trainer import Trainer
    baked = []

    def fake_make_graphed(fn, args):  # encoder: the callable, run eagerly from now on
        baked.append(_addresses(trainer, grads=False))  # inside a step: no .grad set
        return fn

    def fake_capture(graph):  # full: the body, replayed eagerly from now on
        baked.append(_addresses(trainer))

        class Replay:
            def replay(self):
                values = graph.captured_step(graph.inputs.slots)
                graph._out = graph._packed.pack(values)
        values = graph.captured_step(graph.inputs.slots)
        graph._packed = _Packed(values)
        graph._out = graph._packed.pack(values)
        graph.graph = Replay()
    monkeypatch.setattr(torch.cuda, "make_graphed_callables", fake_make_graphed)
    monkeypatch.setattr(FullStepGraph, "_capture", fake_capture)
    ctx = simulated(dist.current())
    cfg = tiny_config(small_dataset, "train.log_every_steps=1000", 'system.device="auto"',
                      "data.shapes=static", f"train.cuda_graphs={mode}",
                      "model.attention=unpadded", "data.balance=offline_pack",
                      "train.bucket_cap_mb=0.05", f"train.gradient_accumulation_steps={accum}",
                      "optim.backend=auto")
    trainer = Trainer(cfg, ctx)
    trainer.setup()
    grads = mode == "full"  # the whole step's graph writes the gradient buffer too
    before = _addresses(trainer, grads)
    it = iter(trainer.train_loader)
    for _ in range(5):  # 3 eager steps, the capture in the 4th, one more
        trainer.train_step(it)
    assert len(baked) == 1, "captured once"
    assert baked[0] != before, "no re-cut: the test would not see an early capture"
    assert baked[0] == _addresses(trainer, grads)
    trainer.close()
