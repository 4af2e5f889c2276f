"""Checkpoints (runtime.train.checkpoint), exact resume, stop signals and the divergence guard, in
one process: the format on disk, atomic writes and keep-K, weights_only loading, every
optimizer backend's state round trip, an interrupted-and-resumed run equal to the
uninterrupted one step for step (dropout on, gradient accumulation), non-finite steps in
fp32 and in simulated fp16, and an initial checkpoint holding NaN.

The multi-rank cases (run_and_time.sh, SIGTERM, local balancing, another world size, a killed
rank) are in tests/e2e/test_resume_e2e.py; the RNG states' round trip through weights_only
loading in tests/unit/test_checkpoint_unit.py.
"""
from __future__ import annotations

import json
import os
import math
import shutil
from pathlib import Path

import pytest
import torch

from runtime.train.checkpoint import (FORMAT, MANIFEST, Checkpoint, CheckpointError, find_latest,
                                      list_checkpoints)
from runtime.events import CallbackList
from runtime.optim.grad_scale import DynamicLossScale
from runtime.model.bert import BertForPreTraining
from runtime.model.hf import load_pretrained
from runtime.optim.optimizers import build_optimizer
from runtime.train.trainer import InitCheckpointError, Trainer, build_model
from tests.support.fit import Recorder, fit
from tests.support.tiny import tiny_config


def tiny(data_dir, out, *extra):
    """The tiny model of tests/support/tiny.py, dropout on (the RNG state matters), 16 samples
    a step."""
    return tiny_config(
        data_dir, f'train.output_dir="{out}"', "model.hidden_dropout_prob=0.1",
        "model.attention_probs_dropout_prob=0.1", "train.max_steps=16",
        "train.eval_iter_start_samples=96", "train.eval_iter_samples=96",
        "train.target_mlm_accuracy=0.99", "train.log_every_steps=4", "data.eval_batch_size=32",
        "train.bucket_cap_mb=0.05", "schedule.warmup_steps=3", "schedule.total_steps=40",
        "optim.lr=0.01", *extra)


# The exact resume runs the default pairing (the compiled fused step, whose state lives in flat
# buffers bound to the bucket layout), not the tiny config's foreach step.
DEFAULT_PAIRING = "optim.backend=auto"


# ------------------------------------------------------------------------------ exact resume

@pytest.fixture(scope="module")
def uninterrupted(small_dataset, single_ctx, tmp_path_factory):
    """accum -> (state, Recorder) of the uninterrupted run (trained once per module: the two
    tests below compare against the same one)."""
    runs = {}

    def get(accum: int):
        if accum not in runs:
            out = tmp_path_factory.mktemp(f"full_accum{accum}")
            state, rec, _ = fit(tiny(small_dataset, out, DEFAULT_PAIRING,
                                     f"train.gradient_accumulation_steps={accum}"), single_ctx)
            runs[accum] = (state, rec)
        return runs[accum]
    return get


@pytest.mark.parametrize("accum", [1, 2])
def test_interrupted_and_resumed_equals_uninterrupted(small_dataset, single_ctx, tmp_path, accum,
                                                      uninterrupted):
    extra = [DEFAULT_PAIRING, f"train.gradient_accumulation_steps={accum}"]
    full_state, full = uninterrupted(accum)
    ck = ["train.checkpoint_every_samples=48", "train.checkpoint_keep=1"]
    cfg = tiny(small_dataset, tmp_path / "b", *extra, *ck)
    first_state, first, t1 = fit(cfg, single_ctx, stop_at=6)   # stops at the step-8 logging point
    assert first_state.status == "interrupted" and first_state.stop_reason == "signal SIGTERM"
    assert first_state.step == 8 and t1.checkpoints.last_saved.name == "step_00000008"
    assert [p.name for p in list_checkpoints(tmp_path / "b" / "checkpoints")] == ["step_00000008"]
    from submission.train import exit_code_of_run
    assert exit_code_of_run(first_state) == 4
    second_state, second, t2 = fit(cfg, single_ctx)
    assert t2.resume_from is not None and t2.resume_from.step == 8
    assert second_state.status == full_state.status == "aborted"   # the 16-step budget
    # Step for step, bit for bit: loss, gradient norm, skip flag; and every evaluation.
    assert first.steps + second.steps == full.steps
    assert first.evals + second.evals == full.evals and len(full.evals) >= 2
    # The resumed half started with the bucket plan the first half ended with (no re-cut).
    assert t2.grad_sync.plan.digest() == t1.grad_sync.plan.digest()
    # Its throughput counts its own samples only: the 8 steps before the resume are not in it.
    resumed_at = 8 * 16
    for samples, elapsed, rate in second.rates:
        assert rate * elapsed == pytest.approx(samples - resumed_at)
    # Each process says its first step (and that nothing compiles lazily here).
    assert any(x.startswith("step 9 done, the first of this process: ") and
               x.endswith("; a progress line every 4 steps") for x in second.said), second.said
    assert not any(x.startswith("compiling") for x in first.said + second.said)
    assert t2.grad_sync.layout_version == 1


def test_a_resume_without_the_rng_state_would_differ(small_dataset, single_ctx, tmp_path,
                                                     monkeypatch, uninterrupted):
    """The test above can fail: skip restoring the RNG (what torchtitan does) and dropout draws
    differently after the resume."""
    import runtime.train.checkpoint as ckpt
    full_state, full = uninterrupted(1)
    cfg = tiny(small_dataset, tmp_path / "b", DEFAULT_PAIRING, "train.checkpoint_every_samples=48")
    _, first, _ = fit(cfg, single_ctx, stop_at=6)
    monkeypatch.setattr(ckpt, "set_rng_state", lambda state: None)
    _, second, _ = fit(cfg, single_ctx)
    assert first.steps + second.steps != full.steps
    assert first.steps == full.steps[:len(first.steps)]


# ------------------------------------------------------------------------------ the format

def test_format_atomic_keep_and_damaged_checkpoints(small_dataset, single_ctx, tmp_path):
    cfg = tiny(small_dataset, tmp_path / "run", "train.checkpoint_every_samples=32",
               "train.checkpoint_keep=2", "train.max_steps=6")
    state, _, trainer = fit(cfg, single_ctx)
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["step_00000006", "step_00000004"]
    assert not list(root.glob(".*"))                       # no temporary directory left
    newest = root / "step_00000006"
    manifest = json.loads((newest / MANIFEST).read_text())
    assert manifest["format"] == FORMAT and manifest["step"] == 6 and manifest["samples"] == 96
    assert set(manifest["files"]) == {"model.safetensors", "config.json", "optimizer.pt",
                                      "train_state.pt", "rank_00000.pt", "bucket_plan.json"}
    # The model part is an HF directory: our loader (and HF's from_pretrained) reads it.
    other = BertForPreTraining(cfg.model.bert_config())
    load_pretrained(other, newest)
    for (name, a), b in zip(trainer.model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), name
    assert json.loads((newest / "config.json").read_text())["model_type"] == "bert"
    # Every torch file loads with weights_only=True (no code unpickled).
    for name in ("optimizer.pt", "train_state.pt", "rank_00000.pt"):
        torch.load(newest / name, weights_only=True)
    # A damaged newest checkpoint is skipped with a warning; the one before is taken.
    with open(newest / "optimizer.pt", "r+b") as f:
        f.truncate(100)
    warned = []
    assert find_latest(root, warn=warned.append).step == 4
    assert "optimizer.pt" in warned[0] and "bytes" in warned[0]
    with pytest.raises(CheckpointError, match="optimizer.pt"):
        Checkpoint.open(newest)
    # A directory a crash left behind, with or without a manifest, is not a checkpoint.
    shutil.rmtree(newest)
    (root / ".step_00000008.tmp").mkdir()
    (root / "step_00000009").mkdir()
    assert find_latest(root, warn=lambda m: None).step == 4


CUDA = pytest.mark.cuda  # skipped without a GPU (conftest)


def _apex_available() -> bool:
    from kernels import optim_apex
    return optim_apex.available()


@pytest.mark.parametrize("backend,device", [
    ("reference", "cpu"), ("foreach", "cpu"), ("fused", "cpu"),
    pytest.param("reference", "cuda", marks=CUDA), pytest.param("foreach", "cuda", marks=CUDA),
    pytest.param("fused", "cuda", marks=CUDA),
    pytest.param("apex", "cuda", marks=[CUDA, pytest.mark.skipif(
        not _apex_available(), reason="NVIDIA apex does not import here")])])
@pytest.mark.parametrize("name", ["lamb", "adamw", "lars"])
def test_optimizer_state_round_trips_for_every_backend(tmp_path, backend, device, name):
    """Save after 3 steps, load into a new optimizer (on a fresh model copy), take 2 more
    steps with both: bit-identical parameters. The fused backend's state lives in flat
    buffers with 0-dim step counts; the saved dict has per-tensor copies (on CPU: the
    checkpoint is device-independent); apex's state is its own."""
    from runtime.train.checkpoint import _to_cpu
    from runtime.model.config import BertConfig
    if backend == "apex" and name == "lars":
        pytest.skip("apex offers LAMB and AdamW only")
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=16)
    model = BertForPreTraining(cfg).to(device)
    opt = build_optimizer(name, list(model.named_parameters()), lr=0.01, backend=backend)
    grads = [[torch.randn_like(p) for p in model.parameters()] for _ in range(5)]

    def step(m, o, g):
        for p, x in zip(m.parameters(), g):
            p.grad = x.clone()
        o.step()

    for g in grads[:3]:
        step(model, opt, g)
    torch.save(_to_cpu(opt.state_dict()), tmp_path / "opt.pt")
    twin = BertForPreTraining(cfg).to(device)
    twin.load_state_dict(model.state_dict())
    opt2 = build_optimizer(name, list(twin.named_parameters()), lr=0.01, backend=backend)
    opt2.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    for g in grads[3:]:
        step(model, opt, g)
        step(twin, opt2, g)
    for (n, a), b in zip(model.named_parameters(), twin.parameters()):
        assert torch.equal(a, b), (name, backend, n)


# ------------------------------------------------------------------------------ divergence

def test_nan_storm_stops_the_run_and_keeps_the_last_good_checkpoint(small_dataset, single_ctx,
                                                                   tmp_path):
    """optim.lr=1e4: the loss is NaN within a few steps; the run stops after
    max_nonfinite_steps + 1 of them (at a logging point), status aborted, and the checkpoints
    written are from before (none from a window with a non-finite step)."""
    cfg = tiny(small_dataset, tmp_path / "run", "optim.lr=1e4", "train.max_nonfinite_steps=3",
               "train.max_steps=60", "train.log_every_steps=2",
               "train.checkpoint_every_samples=16", "train.eval_iter_start_samples=10000")
    state, rec, trainer = fit(cfg, single_ctx)
    assert state.status == "aborted" and state.stop_reason == "diverged"
    from submission.train import exit_code_of_run
    assert exit_code_of_run(state) == 3            # a runtime failure, not "target not reached"
    bad = [s for s, loss, norm, skipped in rec.steps if not math.isfinite(loss) or skipped]
    first = bad[0]
    assert state.step <= first + 3 + 2           # detected within one logging interval
    assert rec.steps[-1][0] == state.step and len(bad) >= 4
    said = " ".join(rec.said)
    assert "divergence" in said and "optim.lr" in said and "max_nonfinite_steps = 3" in said
    kept = find_latest(tmp_path / "run" / "checkpoints")
    assert kept is not None and kept.step < first
    assert all(math.isfinite(v.float().sum()) for v in kept.model_state().values())


def test_fp16_overflow_skips_count_only_at_the_loss_scale_floor(small_dataset, single_ctx,
                                                                tmp_path):
    """Simulated fp16 (the loss scaler on; CPU has no fp16): inf gradients from step 3 on.
    The scaler halves 16 -> 1 over steps 3-6 (normal loss scaling, counted apart); only the
    skips at the floor count - steps 7, 8, 9 - and the third exceeds max_nonfinite_steps = 2."""
    cfg = tiny(small_dataset, tmp_path / "run", "train.max_nonfinite_steps=2",
               "train.max_steps=40", "train.log_every_steps=1",
               "train.eval_iter_start_samples=10000")
    rec = Recorder()
    trainer = Trainer(cfg, single_ctx, CallbackList([rec]), log=lambda m: None)
    trainer.setup()
    trainer.loss_scale = DynamicLossScale(16.0, device=single_ctx.device)
    trainer.checkpoints.states["loss_scale"] = trainer.loss_scale
    poison = trainer.model.bert.encoder.layer[0].output.dense.weight
    poison.register_hook(lambda g: torch.full_like(g, float("inf"))
                         if trainer.state.step >= 2 else g)
    state = trainer.fit()
    trainer.close()
    assert state.stop_reason == "diverged"
    skipped = [s for s, _, _, sk in rec.steps if sk]
    assert skipped == [3, 4, 5, 6, 7, 8, 9] and state.step == 9
    guard = trainer.control.guard
    assert guard.overflow_skips == 7 and guard.nonfinite_steps == 3


def test_init_checkpoint_with_nan_is_refused_naming_the_tensors(small_dataset, tmp_path):
    from safetensors.torch import save_file
    cfg = tiny(small_dataset, tmp_path / "run")
    model = build_model(cfg)
    sd = {k: v.clone().contiguous() for k, v in model.state_dict().items()}
    sd["bert.pooler.dense.weight"][0, 0] = float("nan")
    sd["cls.predictions.bias"][3] = float("inf")
    save_file(sd, str(tmp_path / "bad.safetensors"))
    cfg = tiny(small_dataset, tmp_path / "run", f'model.init="{tmp_path / "bad.safetensors"}"')
    with pytest.raises(InitCheckpointError) as e:
        build_model(cfg)
    text = str(e.value)
    assert "bert.pooler.dense.weight (1 of" in text and "cls.predictions.bias" in text
    assert "bad.safetensors" in text
    from submission.train import exit_code_of
    assert exit_code_of(e.value) == 2


@pytest.mark.parametrize("case, needle", [
    ("missing", "no such weight file"),
    ("empty_dir", "no model.safetensors or pytorch_model.bin"),
    ("text_pt", "not a readable weight file"),
    ("random_safetensors", "not a readable weight file"),
    ("truncated", "not a readable weight file"),
    ("not_a_state_dict", "holds a list"),
    ("wrong_shape", "does not fit this model"),
])
def test_every_unreadable_model_init_is_exit_2_naming_the_file(small_dataset, tmp_path, case,
                                                               needle):
    """model.init naming a file that cannot give this model's weights - missing, a directory
    without weights, text or random bytes under a weight file's name, a truncated safetensors,
    a tensor list, another model's shape - fails at set-up with exit 2 and the file's name."""
    from safetensors.torch import save_file
    good = {k: v.clone().contiguous() for k, v in
            build_model(tiny(small_dataset, tmp_path / "run")).state_dict().items()}
    path = {"missing": tmp_path / "nope.safetensors", "empty_dir": tmp_path / "weights",
            "text_pt": tmp_path / "x.pt", "random_safetensors": tmp_path / "x.safetensors",
            "truncated": tmp_path / "cut.safetensors", "not_a_state_dict": tmp_path / "list.pt",
            "wrong_shape": tmp_path / "other.safetensors"}[case]
    if case == "empty_dir":
        path.mkdir()
    elif case == "text_pt":
        path.write_text("these are not weights\n" * 50)
    elif case == "random_safetensors":
        path.write_bytes(bytes(range(256)) * 64)
    elif case == "truncated":
        save_file(good, str(path))
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif case == "not_a_state_dict":
        torch.save([torch.zeros(3)], path)
    elif case == "wrong_shape":
        other = build_model(tiny(small_dataset, tmp_path / "run", "model.hidden_size=32",
                                 "model.intermediate_size=64"))
        save_file({k: v.clone().contiguous() for k, v in other.state_dict().items()}, str(path))
    cfg = tiny(small_dataset, tmp_path / "run", f'model.init="{path}"')
    with pytest.raises(InitCheckpointError) as e:
        build_model(cfg)
    from submission.train import exit_code_of
    assert str(path) in str(e.value) and needle in str(e.value), str(e.value)
    assert exit_code_of(e.value) == 2


def _remanifest(ckpt: Path) -> None:
    """Rewrite a checkpoint's manifest to match its (tampered) files, as an attacker would."""
    import hashlib
    m = json.loads((ckpt / MANIFEST).read_text())
    for name in m["files"]:
        data = (ckpt / name).read_bytes()
        m["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / MANIFEST).write_text(json.dumps(m))


def test_files_past_the_manifest_check_are_named_when_they_cannot_be_restored(
        small_dataset, single_ctx, tmp_path):
    """A damaged model.safetensors, or a pickle planted as optimizer.pt, under a manifest
    that matches them: restoring names the file and says to fall back to the checkpoint
    before (CheckpointError: exit 2), with no hint to change the optimizer."""
    import pickle
    cfg = tiny(small_dataset, tmp_path / "run", "train.checkpoint_every_samples=32",
               "train.max_steps=2")
    _, _, trainer = fit(cfg, single_ctx)
    src = tmp_path / "run" / "checkpoints" / "step_00000002"
    for name in ("model.safetensors", "optimizer.pt"):
        bad = tmp_path / f"bad_{name}"
        shutil.copytree(src, bad)
        if name == "model.safetensors":
            (bad / name).write_bytes((bad / name).read_bytes()[:200] + b"\0" * 64)
        else:
            (bad / name).write_bytes(pickle.dumps(os.system))
        _remanifest(bad)
        ckpt = Checkpoint.open(bad)          # the manifest check passes
        with pytest.raises(CheckpointError) as e:
            trainer.checkpoints.restore(ckpt)
        text = str(e.value)
        assert str(bad / name) in text and f"delete {bad}" in text, text
        assert "optim.name" not in text
        from submission.train import exit_code_of
        assert exit_code_of(e.value) == 2


def test_a_full_disk_at_the_first_checkpoint_does_not_offer_a_resume(small_dataset, single_ctx,
                                                                     tmp_path, monkeypatch):
    """No earlier checkpoint: the rerun starts a new run - the message says so (it said
    "rerun to resume")."""
    import errno
    from runtime.train import checkpoint as ck

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    monkeypatch.setattr(ck, "_write_bytes", full)
    cfg = tiny(small_dataset, tmp_path / "run", "train.checkpoint_every_samples=32",
               "train.max_steps=3")
    with pytest.raises(ck.CheckpointWriteError) as e:
        fit(cfg, single_ctx)
    text = str(e.value)
    assert "no earlier checkpoint exists" in text and "resume" not in text, text
    assert "cannot be continued" in text and "new run directory" in text, text


def test_a_full_disk_while_checkpointing_names_the_directory_and_keeps_the_last_one(
        small_dataset, single_ctx, tmp_path, monkeypatch):
    """ENOSPC in the middle of writing the step-4 checkpoint: CheckpointWriteError (exit 3)
    naming the directory, the bytes the last checkpoint took and the free space; the
    step-2 checkpoint stays complete and no partial directory is left."""
    import errno
    from runtime.train import checkpoint as ck
    real = ck._write_bytes

    def full(path, data):
        if "step_00000004" in str(path) and path.name == "optimizer.pt":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data)
    monkeypatch.setattr(ck, "_write_bytes", full)
    cfg = tiny(small_dataset, tmp_path / "run", "train.checkpoint_every_samples=32",
               "train.max_steps=6")
    with pytest.raises(ck.CheckpointWriteError) as e:
        fit(cfg, single_ctx)
    root = tmp_path / "run" / "checkpoints"
    text = str(e.value)
    assert f"no space left in {root}" in text and "step 4" in text, text
    assert "bytes" in text and "free" in text and "(step_00000002) is kept" in text, text
    assert "rerun the same command: it resumes from" in text, text   # what a rerun does
    assert "another disk" not in text      # a rerun with another checkpoint_dir starts over
    assert [p.name for p in root.iterdir() if p.name.startswith((".step", "step"))] == \
        ["step_00000002"]
    assert find_latest(root).step == 2
    from submission.train import exit_code_of
    assert exit_code_of(e.value) == 3
