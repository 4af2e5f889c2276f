"""The CUDA tests' shared parts: a process group of one rank on the GPU (``cuda_ctx``, a module
fixture) and a trainer of the tiny model as training runs it on a GPU (``cuda_trainer``).
Used by tests/integration/test_cuda.py and test_cuda_graphs.py (skipped without a GPU)."""
from __future__ import annotations

import pytest

from tests.support.tiny import tiny_config


@pytest.fixture(scope="module")
def cuda_ctx():
    from runtime.launch import dist
    from runtime.launch.env import discover
    ours = dist.current() is None
    ctx = dist.init_distributed(discover({}), device="cuda") if ours else dist.current()
    yield ctx
    if ours:
        dist.shutdown()


def cuda_trainer(data, ctx, *extra):
    from runtime.train.trainer import Trainer
    # The default pairing, as training runs it on a GPU: optim.backend auto (the compiled fused
    # step), not the tiny config's foreach.
    cfg = tiny_config(data, "system.device=cuda", "optim.backend=auto",
                      "train.log_every_steps=1000", *extra)
    trainer = Trainer(cfg, ctx)
    trainer.setup()  # the set-up all-reduce used to be a CPU tensor: NCCL refused it
    return trainer
