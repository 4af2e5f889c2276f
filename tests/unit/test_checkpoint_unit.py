"""The RNG states a checkpoint holds (runtime.train.checkpoint.rng_state / set_rng_state) round
trip through a weights_only load: torch, numpy and Python's generators, and on a GPU the rank's
own device's generator (marked cuda); a sharded optimizer's shard files are checked to be the
shard they are named (index, count, layout, step), and a file that is not weights alone is
refused without torch's advice to unpickle it. Checkpoints in runs:
tests/integration/test_checkpoint.py; shard files of real ranks: tests/ranks/test_shard.py."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from runtime.train.checkpoint import (FORMAT, MANIFEST, Checkpoint, CheckpointError,
                                      rng_state, set_rng_state)
from runtime.train.checkpoint_optim import layout_fingerprint, shard_file


# ------------------------------------------------------------------------------ the format


@pytest.mark.cuda  # skipped without a GPU (conftest)
def test_cuda_rng_state_round_trips_through_weights_only(tmp_path):
    """On a GPU the checkpoint holds the rank's own device's generator (dropout masks on CUDA
    come from it), whatever other GPUs the process sees: restored, the next draws are the
    same; a checkpoint of the older every-device format restores too."""
    torch.cuda.init()
    torch.cuda.manual_seed_all(4)
    torch.save(rng_state(), tmp_path / "rng.pt")
    want = torch.rand(5, device="cuda")
    torch.cuda.manual_seed_all(9)
    state = torch.load(tmp_path / "rng.pt", weights_only=True)
    assert torch.is_tensor(state["cuda"])  # one generator, not one per visible device
    set_rng_state(state)
    assert torch.equal(torch.rand(5, device="cuda"), want)
    torch.cuda.manual_seed_all(9)
    set_rng_state(dict(state, cuda=[state["cuda"]] * torch.cuda.device_count()))
    assert torch.equal(torch.rand(5, device="cuda"), want)


def test_rng_states_round_trip_through_weights_only(tmp_path):
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    torch.save(rng_state(), tmp_path / "rng.pt")
    want = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(want[0], got[0]) and np.array_equal(want[1], got[1]) and want[2] == got[2]


# ------------------------------------------------------------------------------ shard files

META = {"format": "presto-optimizer-shards/1", "shards": 2, "shard_elements": 4, "total": 8,
        "state_names": ["exp_avg"], "segments": [[0, 0, 8]]}


def sharded_checkpoint(path, step=15, **files) -> Checkpoint:
    """A checkpoint directory of step ``step`` whose shard files hold ``files[name]`` (an
    identity dict; the state is made up)."""
    path.mkdir()
    for name, identity in files.items():
        torch.save({"window": [0, 4], "state": {"exp_avg": torch.zeros(4)}, **identity},
                   path / name)
    (path / MANIFEST).write_text(f'{{"format": "{FORMAT}", "step": {step}, "samples": 0, '
                                 f'"world_size": 2, "files": {{}}}}')
    return Checkpoint.open(path, verify=False)


def identity(index, step=15, shards=2, meta=META):
    return {"index": index, "shards": shards, "layout": layout_fingerprint(meta), "step": step}


def test_each_shard_file_must_be_the_shard_it_is_named(tmp_path):
    """Swapped (each file the other's), stale (another checkpoint's step), foreign (another
    shard count or flat layout): refused naming the file and what to do; the shard files a
    checkpoint wrote load, and so do files written before they carried an identity (their
    index is still checked)."""
    from submission.train import exit_code_of
    good = sharded_checkpoint(tmp_path / "good", **{shard_file(0): identity(0),
                                                    shard_file(1): identity(1)})
    assert [good.optimizer_shard(j, META)["index"] for j in (0, 1)] == [0, 1]
    other_layout = dict(META, segments=[[0, 0, 7], [1, 7, 1]])
    cases = {
        "swapped": ({shard_file(0): identity(1), shard_file(1): identity(0)},
                    "holds shard 1, not shard 0: the file of another shard"),
        "stale": ({shard_file(0): identity(0, step=10), shard_file(1): identity(1)},
                  "was written at step 10, this checkpoint is step 15: a stale file"),
        "count": ({shard_file(0): identity(0, shards=4), shard_file(1): identity(1)},
                  "is one of 4 shards, this checkpoint has 2"),
        "layout": ({shard_file(0): identity(0, meta=other_layout), shard_file(1): identity(1)},
                   "was cut from another flat layout"),
    }
    for case, (files, needle) in cases.items():
        ck = sharded_checkpoint(tmp_path / case, **files)
        with pytest.raises(CheckpointError) as e:
            ck.optimizer_shard(0, META)
        text = str(e.value)
        assert text.startswith(f"{ck.path / shard_file(0)}: ") and needle in text, (case, text)
        assert f"delete {ck.path} to resume from the one before" in text
        assert exit_code_of(e.value) == 2
    old = sharded_checkpoint(tmp_path / "old", **{shard_file(0): {"index": 0},
                                                  shard_file(1): {"index": 0}})
    assert old.optimizer_shard(0, META)["index"] == 0
    with pytest.raises(CheckpointError, match="holds shard 0, not shard 1"):
        old.optimizer_shard(1, META)


def test_a_file_that_is_not_weights_alone_is_refused_without_torchs_advice(tmp_path):
    """torch's weights_only refusal says re-running with weights_only=False "will likely
    succeed" - which unpickles whatever code the file holds. The message names the file and
    says to delete the checkpoint; torch's advice is not in it, nor in its chain."""
    import os
    import pickle
    ck = sharded_checkpoint(tmp_path / "ck", **{shard_file(1): identity(1)})
    (ck.path / shard_file(0)).write_bytes(pickle.dumps(os.system))
    with pytest.raises(CheckpointError) as e:
        ck.optimizer_shard(0, META)
    text = str(e.value)
    assert text.startswith(f"{ck.path / shard_file(0)}: not a readable torch file") and \
        "Unsupported operand" in text and f"delete {ck.path}" in text, text
    for advice in ("weights_only", "Re-running", "arbitrary code", "Check the documentation"):
        assert advice not in text, text
    assert e.value.__cause__ is None and e.value.__suppress_context__


# ------------------------------------------------------------------------------ keep-K

def fake_checkpoint(root, step: int) -> None:
    """A complete checkpoint directory of one small file (its manifest true)."""
    import hashlib
    import json
    d = root / f"step_{step:08d}"
    d.mkdir(parents=True)
    (d / "model.safetensors").write_bytes(b"weights %d" % step)
    data = (d / "model.safetensors").read_bytes()
    (d / MANIFEST).write_text(json.dumps({
        "format": FORMAT, "step": step, "samples": step * 64, "world_size": 2,
        "files": {"model.safetensors": {"bytes": len(data),
                                        "sha256": hashlib.sha256(data).hexdigest()}}}))


def test_a_damaged_checkpoint_is_set_aside_so_keep_k_never_deletes_the_good_one(tmp_path):
    """The probe's row N7: step 15 damaged (a file of it deleted), the run falls back to
    step 10 - and at step 20 keep-2 deleted step 10 and kept the damaged 15, leaving nothing
    to fall back to after one more bad save. The look-up now moves the damaged one to
    damaged/ (and says so); keep-2 then keeps 20 and 10."""
    from runtime.train.checkpoint import CheckpointManager, list_checkpoints
    root = tmp_path / "checkpoints"
    for step in (10, 15):
        fake_checkpoint(root, step)
    (root / "step_00000015" / "model.safetensors").unlink()
    said = []
    manager = CheckpointManager(root, keep=2, rank=0, world_size=2, log=said.append)
    assert manager.latest().step == 10
    assert any("skipping checkpoint" in s and "step_00000015" in s for s in said), said
    assert any(f"moved the damaged checkpoint {root / 'step_00000015'} to "
               f"{root / 'damaged' / 'step_00000015'}" in s for s in said), said
    assert (root / "damaged" / "step_00000015" / MANIFEST).is_file()
    fake_checkpoint(root, 20)   # the next save, then its pruning
    manager._prune()
    assert [p.name for p in list_checkpoints(root)] == ["step_00000020", "step_00000010"]
    # a damaged one that cannot be moved is not counted either
    fake_checkpoint(root, 25)
    (root / "step_00000025" / "model.safetensors").write_bytes(b"changed")
    manager._damaged.add("step_00000025")
    fake_checkpoint(root, 30)
    manager._prune()
    assert [p.name for p in list_checkpoints(root)] == ["step_00000030", "step_00000025",
                                                        "step_00000020"]
