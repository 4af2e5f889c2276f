"""The sharded optimizer (optim.shard) in one process: a world of one runs the sharded step
as the unsharded one, bit for bit. Pure parts: tests/unit/test_shard_unit.py; the real ranks:
tests/ranks/test_shard.py."""
from __future__ import annotations


import torch

from runtime.train.trainer import Trainer
from tests.support.tiny import tiny_config

def test_a_world_of_one_runs_the_sharded_step_as_the_unsharded_one(small_dataset, single_ctx):
    """The sharded binding on one rank (one shard: its window is every row): the same
    parameters and state, bit for bit, as the unsharded fused step."""
    out = {}
    for shard in ("none", "world"):
        cfg = tiny_config(small_dataset, "optim.backend=auto", f"optim.shard={shard}",
                          "train.log_every_steps=100", "optim.name=lars")
        trainer = Trainer(cfg, single_ctx)
        trainer.setup()
        it = iter(trainer.train_loader)
        for _ in range(3):
            trainer.train_step(it)
        out[shard] = [p.detach().clone() for p in trainer.model.parameters()]
        assert (trainer.optimizer.shard is None) == (shard == "none")
        trainer.close()
    assert all(torch.equal(a, b) for a, b in zip(out["none"], out["world"]))
