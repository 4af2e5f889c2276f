"""The default step's hot path in one process: fp16 skips stay exact when they are logged later
(the default pairing - optim.backend auto, the compiled fused step - not the foreach step of
the tiny config, tests/support/tiny.py). The same step on real ranks:
tests/ranks/test_hot_path.py."""
from __future__ import annotations

import torch

from runtime.optim.grad_scale import DynamicLossScale
from runtime.train.trainer import Trainer
from tests.support.tiny import tiny_config


def test_fp16_skips_stay_exact_when_logged_later(small_dataset, single_ctx):
    trainer = Trainer(tiny_config(small_dataset, "optim.backend=auto",
                                  "train.log_every_steps=100"), single_ctx)
    trainer.setup()
    trainer.loss_scale = DynamicLossScale(1024.0)  # as with precision=fp16
    poison = trainer.model.bert.encoder.layer[0].output.dense.weight
    it = iter(trainer.train_loader)
    bad = {1, 3}
    for i in range(5):
        handle = poison.register_hook(lambda g: torch.full_like(g, float("nan"))) \
            if i in bad else None
        trainer.train_step(iter([next(it)]))
        if handle:
            handle.remove()
    logged = trainer.step_log.flush()
    assert [m.skipped for m in logged] == [i in bad for i in range(5)]
    assert int(trainer.loss_scale.skipped) == 2
    assert [m.loss_scale for m in logged] == [1024.0, 512.0, 512.0, 256.0, 256.0]
    trainer.close()
