"""RunControl and DivergenceGuard (runtime/train/run_control.py) as pure units: every branch of
the decisions a logging point takes - divergence, a signal with and without checkpoints, after
a resume with nothing trained, a non-finite window, non-finite weights, the checkpoint cadence
- with a stand-in checkpoint manager, in milliseconds. (The end-to-end runs in
tests/integration/test_checkpoint.py check that a real run takes them.)"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from runtime.launch import signals
from runtime.train.run_control import DivergenceGuard, RunControl


def m(step, loss=1.0, skipped=False, scale=1.0, lr=0.1):
    return SimpleNamespace(step=step, loss=loss, skipped=skipped, loss_scale=scale, lr=lr)


# ------------------------------------------------------------------------------ the guard

def test_the_guard_counts_consecutive_bad_steps_and_resets_on_a_good_one():
    g = DivergenceGuard()
    assert g.observe([m(1), m(2, math.nan), m(3, math.inf)], loss_scaled=False) is False
    assert (g.run, g.nonfinite_steps, g.first_bad_step) == (2, 2, 2)
    assert g.observe([m(4)], loss_scaled=False) is True and g.run == 0
    assert g.observe([m(5, skipped=True)], loss_scaled=False) is False  # a skip is bad in fp32/bf16
    assert (g.run, g.first_bad_step, g.nonfinite_steps) == (1, 5, 3)


def test_loss_scaled_skips_count_only_at_the_loss_scale_floor():
    g = DivergenceGuard(scale_before=4.0)
    # the scale halves 4 -> 2 -> 1: those skips are loss scaling, not divergence
    assert g.observe([m(1, skipped=True, scale=2.0), m(2, skipped=True, scale=1.0)],
                     loss_scaled=True) is False
    assert (g.run, g.overflow_skips) == (0, 2)
    g.observe([m(3, skipped=True, scale=1.0), m(4, skipped=True, scale=1.0)], loss_scaled=True)
    assert (g.run, g.overflow_skips, g.nonfinite_steps, g.first_bad_step) == (2, 4, 2, 3)
    g.observe([m(5, loss=math.nan, scale=1.0)], loss_scaled=True)  # a NaN loss is bad at any scale
    assert g.run == 3


def test_the_guard_round_trips_through_a_checkpoint():
    g = DivergenceGuard(run=2, nonfinite_steps=5, overflow_skips=3, first_bad_step=9,
                        scale_before=0.5)
    h = DivergenceGuard()
    h.load_state_dict(g.state_dict())
    assert h == g


# ------------------------------------------------------------------------------ decisions

@dataclass
class Checkpoints:
    """A stand-in CheckpointManager: remembers what was saved."""

    saved: list = field(default_factory=list)
    last_saved: Path | None = None
    save_seconds: list = field(default_factory=list)

    def save(self, step, samples):
        self.last_saved = Path(f"/ck/step_{step}")
        self.saved.append(step)
        self.save_seconds.append(0.01)
        return self.last_saved


def control(every=0, limit=3, finite=True, loss_scaled=False, batch=8):
    cfg = SimpleNamespace(checkpoint_every_samples=every, max_nonfinite_steps=limit,
                          global_batch_size=batch, init_loss_scale=1.0)
    said: list[str] = []
    rc = RunControl(cfg, Checkpoints(), params_finite=lambda: finite, say=said.append,
                    loss_scaled=lambda: loss_scaled, device=torch.device("cpu"))
    return rc, said


def state(step, samples):
    return SimpleNamespace(step=step, samples=samples)


@pytest.fixture
def no_signal(monkeypatch):
    monkeypatch.setattr(signals, "requested", lambda: None)


def test_checkpoints_at_each_multiple_of_the_cadence(no_signal):
    rc, said = control(every=16)
    assert [rc.is_checkpoint_step(s) for s in (8, 16, 24)] == [False, True, False]
    rc.at_log_point([m(1), m(2)], [0.0], state(2, 16))
    assert rc.checkpoints.saved == [2] and rc.next_checkpoint == 32
    assert rc.is_checkpoint_step(32) and not rc.is_checkpoint_step(40)
    rc.at_log_point([m(3)], [0.0], state(3, 24))  # not due
    assert rc.checkpoints.saved == [2]


def test_no_checkpoint_from_a_window_with_a_bad_step_nor_of_bad_weights(no_signal):
    rc, said = control(every=8)
    rc.at_log_point([m(1), m(2, math.nan)], [0.0], state(2, 16))
    assert rc.checkpoints.saved == [] and rc.stop is None  # tried again at the next point
    rc, said = control(every=8, finite=False)
    rc.at_log_point([m(1)], [0.0], state(1, 8))
    assert rc.checkpoints.saved == [] and "non-finite values" in said[-1]
    assert rc.next_checkpoint == 16


def test_divergence_stops_the_run_and_says_what_is_kept(no_signal):
    rc, said = control(every=8, limit=2)
    rc.checkpoints.last_saved = Path("/ck/step_1")
    rc.at_log_point([m(2, math.nan), m(3, math.nan)], [0.0], state(3, 24))
    assert rc.stop is None
    rc.at_log_point([m(4, math.nan)], [0.0], state(4, 32))
    assert rc.stop == "diverged"
    assert "3 consecutive steps from step 2 to 4" in said[-1]
    assert "model.init=/ck/step_1" in said[-1] and "max_nonfinite_steps = 2" in said[-1]
    rc, said = control(limit=0)
    rc.at_log_point([m(1, math.inf)], [0.0], state(1, 8))
    assert rc.stop == "diverged" and "there is no checkpoint of this run" in said[-1]


def test_a_signal_stops_with_a_checkpoint_where_one_can_be_written(monkeypatch):
    monkeypatch.setattr(signals, "requested", lambda: 15)
    rc, said = control(every=100)
    rc.at_log_point([m(5)], [1.0], state(5, 40))
    assert rc.stop == "signal SIGTERM" and rc.checkpoints.saved == [5]
    assert "rerun the same command to resume" in said[-1]
    rc, said = control(every=0)  # no checkpoints at all
    rc.at_log_point([m(5)], [1.0], state(5, 40))
    assert "a rerun starts over" in said[-1] and rc.checkpoints.saved == []
    rc, said = control(every=100)  # the last window was not finite
    rc.checkpoints.last_saved = Path("/ck/step_2")
    rc.at_log_point([m(5, math.nan)], [1.0], state(5, 40))
    assert rc.checkpoints.saved == [] and "the last one is /ck/step_2" in said[-1]


def test_a_signal_on_another_rank_and_right_after_a_resume(monkeypatch):
    monkeypatch.setattr(signals, "requested", lambda: None)
    rc, said = control(every=100)
    rc.resumed_from = SimpleNamespace(step=5, path=Path("/ck/step_5"))
    rc.at_log_point([], [1.0], state(5, 40))  # another rank's request, nothing trained yet
    assert rc.stop == "signal (on another rank)" and rc.checkpoints.saved == []
    assert "nothing trained since /ck/step_5" in said[-1]
    assert rc.resumable() and rc.last_checkpoint() == Path("/ck/step_5")


def test_the_cadence_and_the_guard_are_checkpointed(no_signal):
    rc, _ = control(every=16)
    rc.at_log_point([m(1, math.nan)], [0.0], state(1, 8))
    again, _ = control(every=16)
    again.load_state_dict(rc.state_dict())
    assert again.next_checkpoint == rc.next_checkpoint and again.guard == rc.guard
