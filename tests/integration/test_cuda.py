"""The trainer on one CUDA GPU, as training runs it (skipped without a GPU; ``python -m
bench.gpu`` runs them): set-up and steps for every path and precision, no host sync in an
ordinary step (torch's own sync debug mode), the unpadded path equal to the padded one under
autocast, the fused optimizer compiled once, the CUDA timeline's marks, DALI's GPU batches
equal to the torch loader's.

What reading found and these confirm: docs/GPU.md. The same classes of bug are caught on CPU
by the simulated device (tests/ranks/test_hot_path.py, tests/unit/test_hostsync.py)."""
from __future__ import annotations

import pytest
import torch

from runtime.observe.hostsync import HostSyncs
from tests.support.cuda import cuda_ctx, cuda_trainer  # noqa: F401 (a fixture)
from tests.support.data import assert_batches_equal

pytestmark = pytest.mark.cuda

PATHS = {"padded": [], "unpadded": ["model.attention=unpadded"], "packed": ["data.balance=pack"]}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_steps_on_one_gpu_sync_nothing(small_dataset, cuda_ctx, path, precision):
    trainer = cuda_trainer(small_dataset, cuda_ctx, f"train.precision={precision}", *PATHS[path])
    it = trainer.balance_meter.wrap(iter(trainer.train_loader))
    for _ in range(2):  # the first step re-cuts the buckets and re-binds the optimizer
        trainer.train_step(it)
    with HostSyncs(cuda_ctx.device) as syncs:
        for _ in range(3):
            trainer.train_step(it)
    assert syncs.events == [], syncs.report()
    logged = trainer.step_log.flush()
    assert len(logged) == 5 and all(m.loss == m.loss for m in logged)  # not NaN
    assert trainer.evaluate().count > 0
    trainer.close()


def test_unpadded_equals_padded_on_cuda_under_autocast(small_dataset, cuda_ctx):
    from loaders.dataset import TrainLoader
    from runtime.model.bert import BertForPreTraining
    trainer = cuda_trainer(small_dataset, cuda_ctx)
    padded = trainer.model.eval()
    unpadded = BertForPreTraining(padded.config, attention="unpadded").cuda().eval()
    unpadded.load_state_dict(padded.state_dict())
    loader = TrainLoader(small_dataset, 0, 1, 16, 3, verify=False)
    batch = next(loader).to("cuda")
    loader.close()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        a = padded(batch.input_ids, batch.token_type_ids, batch.attention_mask,
                   masked_lm_labels=batch.masked_lm_labels,
                   next_sentence_labels=batch.next_sentence_labels, layout=batch.layout)
        b = unpadded(batch.input_ids, batch.token_type_ids, batch.attention_mask,
                     masked_lm_labels=batch.masked_lm_labels,
                     next_sentence_labels=batch.next_sentence_labels, layout=batch.layout)
    torch.testing.assert_close(b.loss.float(), a.loss.float(), rtol=1e-2, atol=1e-2)
    assert int(a.mlm_count) == int(b.mlm_count) > 0
    trainer.close()


def test_the_fused_optimizer_is_compiled_once(small_dataset, cuda_ctx):
    from torch._dynamo.utils import counters
    trainer = cuda_trainer(small_dataset, cuda_ctx)
    binding = trainer.optimizer.flat_binding
    assert binding.compiled, "torch.compile of the fused step failed: it runs eagerly"
    graphs = counters["stats"]["unique_graphs"]
    it = iter(trainer.train_loader)
    for _ in range(3):  # the re-cut after step 1 re-binds the buffers: same shapes
        trainer.train_step(it)
    assert binding.compiled and counters["stats"]["unique_graphs"] == graphs
    assert trainer.state.derived["optimizer_compiled"] is True
    trainer.close()


def test_the_timeline_marks_gpu_work(small_dataset, cuda_ctx):
    trainer = cuda_trainer(small_dataset, cuda_ctx, "train.timeline=true")
    it = iter(trainer.train_loader)
    for _ in range(2):
        trainer.train_step(it)
    (m,) = trainer.step_log.flush()[-1:]
    spans = m.extra["timeline"]["spans"]
    assert spans["forward"][0][1] > spans["forward"][0][0] >= 0  # read from CUDA events
    assert m.extra["timeline"]["step_s"] > 0
    trainer.close()


def test_dali_gpu_batches_equal_the_torch_loaders(small_dataset):
    pytest.importorskip("nvidia.dali")
    from loaders.dali_pipeline import DaliTrainLoader
    from loaders.dataset import TrainLoader
    with TrainLoader(small_dataset, 0, 1, 8, 7, verify=False) as ld:
        want = [next(ld) for _ in range(6)]
    import inspect
    import loaders.dali_pipeline as dp
    lines, first = inspect.getsourcelines(dp.DaliTrainLoader.__next__)
    wait = next(first + i for i, line in enumerate(lines) if "_copied.synchronize()" in line)
    with DaliTrainLoader(small_dataset, 0, 1, 8, 7, verify=False, device_id=0) as dali:
        # The one wait allowed: for the previous copy out of DALI's buffers (a side stream's
        # small copy, not the compute stream) before DALI may reuse them.
        with HostSyncs("cuda", allow=[f"dali_pipeline.py:{wait} "]) as syncs:
            got = [next(dali) for _ in range(6)]
    assert syncs.events == [], syncs.report()
    assert_batches_equal([b.to("cpu") for b in got], want)
