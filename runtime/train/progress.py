"""The run's progress as one checkpoint part: step, samples, epoch, the eval position, the run
control's state (checkpoint position, divergence guard), the bucket plan in use and the
resolved config.

Owns: what of the trainer a checkpoint keeps and a resume restores.
Never: writes files (runtime.train.checkpoint) or decides anything - which config changes a
resume accepts is runtime.train.resume_rules' (the trainer asks it before building).
"""
from __future__ import annotations

import json
from typing import Any


class Progress:
    """The trainer's counters as one checkpoint part: step, samples, epoch, the eval position,
    the run control's (checkpoint position, divergence guard), the bucket plan in use and the
    resolved config (for the record: a resume says which values changed)."""

    def __init__(self, trainer: Any):
        self.t = trainer

    def state_dict(self) -> dict:
        t, st = self.t, self.t.state
        plan = t.grad_sync.plan_json()
        return {"step": st.step, "samples": st.samples, "epoch": st.epoch,
                "eval_accuracy": st.eval_accuracy, "next_eval": t.next_eval,
                **t.control.state_dict(), "world_size": t.dist.world_size,
                "bucket_plan": None if plan is None else json.dumps(plan),
                "noise_scale": None if t.noise is None else t.noise.state_dict(),
                "config": json.dumps(t.cfg.to_dict(), sort_keys=True)}

    def load_state_dict(self, state: dict) -> None:
        t, st = self.t, self.t.state
        st.step, st.samples, st.epoch = int(state["step"]), int(state["samples"]), int(state["epoch"])
        st.eval_accuracy = state["eval_accuracy"]
        t.next_eval = int(state["next_eval"])
        t.control.load_state_dict(state)
        if t.noise is not None and state.get("noise_scale"):
            t.noise.load_state_dict(state["noise_scale"])
