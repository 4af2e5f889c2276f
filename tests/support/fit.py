"""A Trainer fitted in the test's own process, and what it logged: the in-process runs of the
checkpoint and FP8 tests (an uninterrupted run, or one stopped at a step and resumed).

``fit(cfg, ctx, stop_at)`` trains ``cfg`` to its end in the world ``ctx`` and returns (state,
Recorder, trainer); ``Recorder`` keeps every logged step's (step, loss, grad_norm, skipped)
and its throughput figures, every evaluation's (samples, accuracy) and every line the trainer
said, and asks for a stop (as a signal would) once a logged step reaches ``stop_at``.
"""
from __future__ import annotations

from runtime.events import CallbackList, Event
from runtime.launch import signals


class Recorder:
    """Every logged step's (step, loss, grad_norm, skipped) and (samples, elapsed_s,
    samples_per_s), every eval's (samples, accuracy), every line said; asks for a stop once a
    logged step reaches ``stop_at``."""

    def __init__(self, stop_at: int = 0):
        self.steps, self.evals, self.said, self.stop_at = [], [], [], stop_at
        self.rates = []

    def on_event(self, event, state):
        if event is Event.LOG:
            self.steps += [(m.step, m.loss, m.grad_norm, m.skipped) for m in state.logged_steps]
            self.rates += [(m.samples, m.elapsed_s, m.extra.get("samples_per_s"))
                           for m in state.logged_steps]
            if self.stop_at and state.step >= self.stop_at:
                signals.request()
        elif event is Event.EVAL_STOP:
            self.evals.append((state.samples, state.eval_accuracy))


def fit(cfg, ctx, stop_at: int = 0):
    """(state, Recorder, trainer) of ``cfg`` trained in ``ctx`` (stopped at ``stop_at``)."""
    from runtime.train.trainer import Trainer
    rec = Recorder(stop_at)
    trainer = Trainer(cfg, ctx, CallbackList([rec]), log=rec.said.append)
    try:
        state = trainer.fit()
    finally:
        trainer.close()
        signals.clear()
    return state, rec, trainer
