"""Runtime events and the callback interface (how MLPerf logging, metrics and progress plug in).

The trainer fires events in this order; callbacks observe them and never steer the loop::

    INIT_START                      process up, config validated on every rank
      ... build model, optimizer, data ...
    INIT_STOP                       everything ready; nothing timed has happened yet
    RUN_START                       MLPerf's timed region begins
    while not stopped:
        BLOCK_START                 a block of training between two evaluations
        STEP  (per optimizer step)  state.step and state.samples advanced; no metrics (they
                                    stay on the device until the next LOG)
        LOG   (every train.log_every_steps steps, and before BLOCK_STOP)
                                    state.logged_steps: the StepMetrics of every step since
                                    the last LOG, reduced across ranks (loss, lr, grad norm,
                                    tokens, times, balance); state.last_step is the newest
        BLOCK_STOP
        EVAL_START
        EVAL_STOP                   state.eval_accuracy set
    RUN_STOP                        state.status = "success" | "aborted" | "interrupted"

A resumed run (runtime.train.checkpoint) fires the same events from INIT_START on, with
``state.resume`` set (where it continues from) before INIT_START; its first BLOCK_START opens
the rest of the block it was stopped in. ``status = "interrupted"`` at RUN_STOP: a stop
signal or a failure ended this attempt and a checkpoint exists to continue from - the run is
not over (MLPerf's run_stop waits for the attempt that ends it); ``state.stop_reason`` says
why any run stopped ("target", "budget", "diverged", "signal SIGTERM", "error").

Owns: the event names and the read-only ``RunState`` given to callbacks. Never: I/O.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol


class Event(enum.Enum):
    INIT_START = "init_start"
    INIT_STOP = "init_stop"
    RUN_START = "run_start"
    BLOCK_START = "block_start"
    STEP = "step"
    LOG = "log"
    BLOCK_STOP = "block_stop"
    EVAL_START = "eval_start"
    EVAL_STOP = "eval_stop"
    RUN_STOP = "run_stop"


@dataclass
class StepMetrics:
    """What one optimizer step did, on this rank (and ``*_max``/``*_mean`` across ranks)."""

    step: int
    samples: int                 # samples trained so far, all ranks, after this step
    loss: float
    mlm_loss: float
    nsp_loss: float
    lr: float
    grad_norm: float             # global norm of the averaged gradient: before clipping for
    #                              clip_mode global_after/none; for local_before/bucket_before
    #                              of the averaged *clipped* gradient (the unclipped average is
    #                              never formed; extra.local_grad_norm has this rank's ‖g_r‖)
    clip_coef: float             # strongest clip multiplier applied (1.0 = not clipped):
    #                              global_after the one folded into the step; local_before this
    #                              rank's; bucket_before this rank's smallest bucket coefficient
    step_time_s: float
    real_tokens: int             # this rank's real tokens in the step
    computed_tokens: int         # this rank's tokens computed, padding included
    skipped: bool = False        # fp16: step skipped because of inf/nan gradients
    loss_scale: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)  # numbers; "timeline" is a dict
    elapsed_s: float | None = None  # seconds from RUN_START to the end of this step
    device_step_s: float | None = None  # the device's time for the step (CUDA events around
    #                                     it; a CPU's wall time): TFLOP/s and MFU divide by it


@dataclass
class RunState:
    """The trainer's state as callbacks see it. Callbacks must treat it as read-only."""

    config: Any                  # runtime.config.Config
    rank: int
    world_size: int
    step: int = 0
    samples: int = 0             # samples trained, all ranks
    epoch: int = 0
    block_start_samples: int = 0
    block_samples: int = 0       # samples in the current block (until the next eval)
    eval_accuracy: float | None = None
    eval_samples: int = 0        # eval samples used for eval_accuracy
    train_samples: int = 0       # samples in one training epoch (MLPerf train_samples)
    status: str | None = None    # "success" | "aborted" | "interrupted" at RUN_STOP
    stop_reason: str | None = None  # "target" | "budget" | "diverged" | "signal SIGx" | "error"
    resume: dict | None = None   # a resumed run: checkpoint, step, samples, world sizes, notes
    last_step: StepMetrics | None = None      # the newest logged step (see Event.LOG)
    logged_steps: list = field(default_factory=list)  # StepMetrics of the latest LOG
    derived: dict[str, Any] = field(default_factory=dict)  # local batch, accum, warm-up...

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class Callback(Protocol):
    def on_event(self, event: Event, state: RunState) -> None: ...


class CallbackList:
    """Fans an event out to callbacks in registration order."""

    def __init__(self, callbacks: list[Callback] | None = None):
        self.callbacks = list(callbacks or [])

    def add(self, callback: Callback) -> None:
        self.callbacks.append(callback)

    def fire(self, event: Event, state: RunState) -> None:
        for cb in self.callbacks:
            cb.on_event(event, state)
