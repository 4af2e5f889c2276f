"""The RNG states a checkpoint holds (runtime.train.checkpoint.rng_state / set_rng_state) round
trip through a weights_only load: torch, numpy and Python's generators, and on a GPU the rank's
own device's generator (marked cuda). Checkpoints in runs: tests/integration/test_checkpoint.py."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from runtime.train.checkpoint import rng_state, set_rng_state


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
