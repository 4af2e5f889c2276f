"""The decisions every rank takes together at a logging point: stop on divergence, stop on a
signal (with a checkpoint when they are on), and write a checkpoint at each multiple of
``train.checkpoint_every_samples``.

Owns: ``DivergenceGuard`` (the count of consecutive non-finite steps, typed and checkpointed),
the checkpoint cadence (``next_checkpoint``), the stop reason (``stop``: "diverged",
"signal SIGx"), the finite check before a save (no checkpoint from a window with a non-finite
step, nor of non-finite weights), and what a rank says about each decision. Asked once per
logging point (``at_log_point``) with what that point reduced across ranks, so every rank
decides the same at the same step; and once before the first step (``agree_before_start``:
a signal during set-up).
Never: trains, reduces metrics (runtime.observe.step_log does, and hands the stop requests
over in its ``flags``), or writes checkpoint files itself (runtime.train.checkpoint does).

Detection latency: a signal or a run of non-finite steps is acted on at the next logging
point - at most ``train.log_every_steps`` steps later. A checkpoint is written at the step
that reaches each multiple of ``train.checkpoint_every_samples`` (the trainer makes that step
a logging point), never from a window with a non-finite step (the next logging point tries
again), so the checkpoints kept are from before a divergence.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from runtime.launch import signals
from runtime.launch.dist import all_reduce_sum


@dataclass
class DivergenceGuard:
    """Consecutive non-finite steps (a loss or gradient that is NaN or inf). Where the loss
    is scaled (fp16, fp16_master), overflow skips are normal loss scaling and count only once
    the loss scale is at its floor (1)."""

    run: int = 0                 # consecutive bad steps now
    nonfinite_steps: int = 0     # bad steps in the whole run
    overflow_skips: int = 0      # loss-scaled steps skipped for overflow (any scale)
    first_bad_step: int = 0      # where the current run of bad steps began
    scale_before: float = 1.0    # the loss scale the next logged step started with

    def observe(self, logged: list, loss_scaled: bool) -> bool:
        """Count the logged steps (identical on every rank: the losses are all-reduced, the
        skip flag comes from the averaged gradient) of a run whose loss is scaled or not;
        returns whether the window was finite."""
        window_finite = True
        for m in logged:
            loss_bad = not math.isfinite(m.loss)
            if loss_scaled:
                overflow = m.skipped and not loss_bad
                self.overflow_skips += int(overflow)
                bad = loss_bad or (overflow and self.scale_before <= 1.0)
                self.scale_before = float(m.loss_scale)
            else:
                bad = loss_bad or m.skipped
            window_finite = window_finite and not (loss_bad or m.skipped)
            if bad:
                self.first_bad_step = self.first_bad_step if self.run else m.step
                self.run += 1
                self.nonfinite_steps += 1
            else:
                self.run = 0
        return window_finite

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for f in fields(self):
            if f.name in state:
                setattr(self, f.name, type(getattr(self, f.name))(state[f.name]))


class RunControl:
    """See the module docstring. ``checkpoints``: a runtime.train.checkpoint.CheckpointManager
    (tracking the run's parts); ``params_finite()``: whether the weights are finite;
    ``loss_scaled()``: whether the loss is scaled (the run's loss scale is enabled: fp16 and
    fp16_master - asked at each logging point, a test may swap the scale);
    ``say(message)``: rank 0's voice."""

    def __init__(self, train_cfg: Any, checkpoints: Any, *, params_finite: Callable[[], bool],
                 say: Callable[[str], None], loss_scaled: Callable[[], bool],
                 device: torch.device):
        self.cfg = train_cfg
        self.checkpoints = checkpoints
        self.params_finite = params_finite
        self.say = say
        self.loss_scaled = loss_scaled
        self.device = device
        self.guard = DivergenceGuard(scale_before=float(train_cfg.init_loss_scale))
        self.next_checkpoint = train_cfg.checkpoint_every_samples
        self.stop: Optional[str] = None
        self.resumed_from: Any = None     # the Checkpoint a resumed run started from
        self.base_lr = 0.0                # for the divergence message

    # ---- the cadence ----------------------------------------------------------------------
    @property
    def checkpointing(self) -> bool:
        return self.cfg.checkpoint_every_samples > 0

    def is_checkpoint_step(self, samples: int) -> bool:
        """This step reached a multiple of train.checkpoint_every_samples (so it is made a
        logging point)."""
        return self.checkpointing and samples >= self.next_checkpoint > \
            samples - self.cfg.global_batch_size

    # ---- the decisions --------------------------------------------------------------------
    def at_log_point(self, logged: list, flags: list, state: Any) -> None:
        """Decide at a logging point; ``flags[0]``: the ranks' stop requests, summed."""
        finite = self.guard.observe(logged, self.loss_scaled())
        limit = self.cfg.max_nonfinite_steps
        if self.guard.run > limit:
            self.stop = "diverged"
            self._say_diverged(logged, limit)
            return
        if flags and flags[0] > 0:
            self._stop_on_signal(finite, state)
        elif self.checkpointing and finite and state.samples >= self.next_checkpoint:
            self.save(state)

    def agree_before_start(self, state: Any) -> None:
        """One all-reduce before the first step: did any rank get a stop signal during
        set-up? (Steps after this agree at logging points.)"""
        flag = torch.tensor([1.0 if signals.requested() else 0.0], device=self.device)
        if all_reduce_sum(flag).item() > 0:
            self._stop_on_signal(True, state)

    def _say_diverged(self, logged: list, limit: int) -> None:
        g, last = self.guard, self.last_checkpoint()
        kept = (f"the last checkpoint, {last} (never written from a non-finite step), "
                f"is kept: start a new run from its weights with model.init={last}"
                if last else "there is no checkpoint of this run")
        self.say(f"divergence: {g.run} consecutive steps from step {g.first_bad_step} to "
                 f"{logged[-1].step} had a non-finite loss or gradient "
                 f"(train.max_nonfinite_steps = {limit}; loss now {logged[-1].loss}, lr "
                 f"{logged[-1].lr:.3g}); stopping the run with status aborted. Lower optim.lr "
                 f"(base {self.base_lr:.3g}) or check the data; {kept}")

    def _stop_on_signal(self, finite: bool, state: Any) -> None:
        """Every rank, at the same logging point: checkpoint (when enabled) and stop."""
        mine = signals.requested()
        self.stop = f"signal {signals.name(mine)}" if mine else "signal (on another rank)"
        last = self.last_checkpoint()
        if not self.checkpointing:
            where = "no checkpoint (train.checkpoint_every_samples = 0): a rerun starts over"
        elif self.resumed_from is not None and state.step == self.resumed_from.step \
                and self.checkpoints.last_saved is None:
            where = f"nothing trained since {last}, which a rerun resumes from"
        elif not finite:
            where = f"no new checkpoint (the last steps were not finite); the last one is {last}"
        else:
            saved = self.save(state)
            where = (f"checkpoint {saved} - rerun the same command to resume" if saved else
                     f"no new checkpoint (the model is not finite); the last one is {last}")
        self.say(f"stopping on {self.stop} at step {state.step} ({state.samples} samples): "
                 f"{where}")

    def save(self, state: Any) -> Optional[Path]:
        """A checkpoint now, unless the weights are not finite; the next one is due at the
        next multiple of train.checkpoint_every_samples."""
        every = self.cfg.checkpoint_every_samples
        if every > 0:
            self.next_checkpoint = (state.samples // every + 1) * every
        if not self.params_finite():
            self.say(f"checkpoint: not written at step {state.step}: the model holds "
                     f"non-finite values (the last update diverged); the last good one is "
                     f"{self.last_checkpoint()}")
            return None
        path = self.checkpoints.save(state.step, state.samples)
        self.say(f"checkpoint: {path} (step {state.step}, {state.samples} samples, "
                 f"{self.checkpoints.save_seconds[-1]:.2f} s)")
        return path

    # ---- what a stopped run leaves --------------------------------------------------------
    def last_checkpoint(self):
        return self.checkpoints.last_saved or (
            self.resumed_from.path if self.resumed_from is not None else None)

    def resumable(self) -> bool:
        """A checkpoint of this run exists: it can continue from there."""
        return self.checkpoints.last_saved is not None or self.resumed_from is not None

    # ---- checkpointed state (part of the trainer's progress) ------------------------------
    def state_dict(self) -> dict:
        return {"next_checkpoint": self.next_checkpoint, "guard": self.guard.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.next_checkpoint = int(state["next_checkpoint"])
        self.guard.load_state_dict(state["guard"])

    def after_a_failed_write(self) -> str:
        """What to do after a log write failed, as a rerun of the same command will do it."""
        c = self
        if c.resumable():
            return (f"free space and rerun the same command: it resumes from "
                    f"{c.last_checkpoint()} and continues this run's log (a line the full disk "
                    f"cut short is dropped)")
        why = ("this run writes no checkpoints (train.checkpoint_every_samples = 0)"
               if not c.checkpointing else "it wrote no checkpoint before the write failed")
        return (f"free space and run again: {why}, so it cannot be continued - the same "
                f"command starts a new run in a new run directory (run_and_time.sh makes one; "
                f"if you named this one with RUN_DIR or train.output_dir, name another)")


def params_finite(model) -> bool:
    """Whether every parameter is finite: an update from finite gradients can still overflow
    (lr 1e4). The same answer on every rank (the replicas are identical), so no collective;
    one pass and one host read, at checkpoint time only."""
    with torch.no_grad():
        return all(bool(torch.isfinite(p).all()) for p in model.parameters())
