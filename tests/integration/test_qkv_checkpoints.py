"""A run's own checkpoints across fusion ``qkv`` (runtime/model/bert.py: one [3H, H] Wqkv or
three Linears), on a real tiny run: a resume that changes the layout is refused before any
part is built, naming model.fusions; the checkpoint's weights (HF's keys, either layout)
start a fused run through model.init; and the optimizer state of the other layout, met
without the config's check, is refused naming the file and the parameters - never loaded
onto the wrong tensors."""
from __future__ import annotations

import pytest
import torch

from runtime.events import CallbackList
from runtime.model.hf import read_state_dict, save_hf_state_dict
from runtime.train import trainer as trainer_module
from runtime.train.checkpoint import Checkpoint, CheckpointError, ResumeRefused, find_latest
from runtime.train.trainer import Trainer, build_model
from tests.support.tiny import tiny_config

FUSED = 'model.fusions=["qkv"]'


def config(data, out, *extra):
    return tiny_config(data, f'train.output_dir="{out}"', "train.max_steps=4",
                       "train.checkpoint_every_samples=32", "train.log_every_steps=2",
                       "train.eval_iter_start_samples=0", "train.eval_before_training=false",
                       "data.eval_batch_size=32", *extra)


@pytest.fixture(scope="module")
def split_run(small_dataset, single_ctx, tmp_path_factory):
    """The output directory of a 4-step run of the split layout, with its checkpoints."""
    out = tmp_path_factory.mktemp("split") / "run"
    trainer = Trainer(config(small_dataset, out), single_ctx, CallbackList([]),
                      log=lambda msg: None)
    try:
        trainer.fit()
    finally:
        trainer.close()
    return out


def test_a_resume_that_fuses_the_projection_is_refused_before_anything_is_built(
        small_dataset, single_ctx, split_run, monkeypatch):
    def built(*a, **k):
        raise AssertionError("a part was built")
    monkeypatch.setattr(trainer_module, "build_parts", built)
    trainer = Trainer(config(small_dataset, split_run, FUSED), single_ctx, CallbackList([]),
                      log=lambda msg: None)
    try:
        with pytest.raises(ResumeRefused, match=r"model\.fusions: the checkpoint has \[\], this "
                                                r"run \['qkv'\] \(.*qkv: one \[3H, H\] tensor "
                                                r"or three"):
            trainer.setup()
    finally:
        trainer.close()


def test_the_checkpoints_weights_start_a_fused_run(small_dataset, split_run, tmp_path):
    ck = find_latest(split_run / "checkpoints")
    model = build_model(config(small_dataset, tmp_path / "new", FUSED, f'model.init="{ck.path}"'))
    assert model.bert.encoder.layer[0].attention.self.fused_qkv
    saved = read_state_dict(ck.path)
    mine = save_hf_state_dict(model)
    assert set(mine) == set(saved) and all(torch.equal(mine[k], saved[k]) for k in mine)


def test_optimizer_state_of_the_split_layout_is_refused_by_a_fused_run(
        small_dataset, single_ctx, split_run, tmp_path):
    """What a checkpoint whose config the resume rules cannot read would meet."""
    trainer = Trainer(config(small_dataset, tmp_path / "fused", FUSED), single_ctx,
                      CallbackList([]), log=lambda msg: None)
    try:
        trainer.setup()
        before = [p.detach().clone() for p in trainer.model.parameters()]
        ck = Checkpoint.open(find_latest(split_run / "checkpoints").path)
        with pytest.raises(CheckpointError, match=r"optimizer\.pt: the optimizer state is for "
                                                  r"other parameters: .*'bert\.encoder\.layer\.0"
                                                  r"\.attention\.self\.query\.weight'.*Wqkv"):
            trainer.checkpoints.restore(ck)
        # the weights (HF's keys) were loaded - mapped, right - before the optimizer refused
        saved = read_state_dict(ck.path)
        assert all(torch.equal(v, saved[k]) for k, v in save_hf_state_dict(trainer.model).items())
        assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    finally:
        trainer.close()
