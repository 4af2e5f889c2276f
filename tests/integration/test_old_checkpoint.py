"""A checkpoint written by the code before a change still resumes after it: the fixture
tests/fixtures/checkpoint_6e39e8f/ (its make_fixture.py says how it was written, by main at
6e39e8f - before runtime.numerics and runtime.model.converters) holds step 2 of a 4-step run of
a tiny BERT in bf16_master (fp32 masters in the fused LAMB) with fusion qkv's one Wqkv and
emulated FP8, its data set and what that run logged after step 2. Resumed here, the masters
are the checkpoint's to the bit, and steps 3 and 4 lose what the old code's run lost."""
from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runtime.config import load_config
from runtime.model.hf import hf_layout
from tests.support.fit import Recorder

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_6e39e8f"


def _overrides() -> list[str]:
    spec = importlib.util.spec_from_file_location("make_fixture", FIXTURE / "make_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.OVERRIDES


def test_a_checkpoint_of_the_old_code_resumes_to_the_old_runs_losses(single_ctx, tmp_path,
                                                                      monkeypatch):
    from runtime.events import CallbackList
    from runtime.train.trainer import Trainer
    shutil.copytree(FIXTURE / "data", tmp_path / "data")
    shutil.copytree(FIXTURE / "checkpoints", tmp_path / "old")
    monkeypatch.chdir(tmp_path)   # the run's paths are relative, as when it was written
    cfg = load_config(None, [*_overrides(), 'train.checkpoint_dir="old"',
                             "train.adopt_checkpoints=true"])
    rec = Recorder()
    trainer = Trainer(cfg, single_ctx, CallbackList([rec]), log=rec.said.append)
    try:
        trainer.setup()
        assert trainer.resume_from is not None and trainer.resume_from.step == 2
        saved = load_file(str(FIXTURE / "checkpoints" / "step_00000002" / "model.safetensors"))
        params = dict(trainer.model.named_parameters())
        masters = trainer.optimizer.masters()
        mine = hf_layout({n: masters[id(p)] for n, p in params.items()})
        assert "bert.encoder.layer.0.attention.self.Wqkv.weight" in params   # fused, as then
        assert set(saved) - set(mine) <= {"cls.predictions.decoder.weight",   # (tied,
                                           "cls.predictions.decoder.bias"}     # HF aliases)
        for key in set(saved) & set(mine):
            assert torch.equal(mine[key], saved[key]), key
        assert {p.dtype for p in params.values()} == {torch.bfloat16}
        state = trainer.fit()
    finally:
        trainer.close()
    expected = json.loads((FIXTURE / "expected.json").read_text())
    assert state.step == 4 and any("resuming from" in m for m in rec.said), rec.said
    losses = {str(step): loss for step, loss, _, _ in rec.steps}
    # bitwise on the machine that wrote the fixture; another CPU's reduction order may move
    # the last bits
    assert losses == pytest.approx(expected["losses"], rel=1e-4)
    assert state.eval_accuracy == pytest.approx(expected["eval_accuracy"], abs=1e-6)
