"""The trainer's eval cadence in a fit: the events in order, the first evaluation and then one
every train.eval_iter_samples, and the stop at max_steps (the tiny model of
tests/support/tiny.py, one process). The other trainer pieces: tests/unit/test_trainer.py."""
from __future__ import annotations

from runtime.events import CallbackList, Event
from runtime.train.trainer import Trainer
from tests.support.tiny import tiny_config


class Recorder:
    def __init__(self):
        self.events = []

    def on_event(self, event, state):
        self.events.append((event, state.samples, state.eval_accuracy, state.status))


def test_eval_cadence_events_and_stop_at_max_steps(small_dataset, single_ctx):
    rec = Recorder()
    cfg = tiny_config(small_dataset, "train.eval_iter_start_samples=32",
                      "train.eval_iter_samples=48", "train.max_steps=7",
                      "train.target_mlm_accuracy=0.99")
    trainer = Trainer(cfg, single_ctx, CallbackList([rec]))
    state = trainer.fit()
    trainer.close()
    assert state.status == "aborted" and state.step == 7 and state.samples == 112
    evals = [s for e, s, _, _ in rec.events if e is Event.EVAL_STOP]
    assert evals == [32, 80, 112]  # first at 32, then every 48, and once more at the budget
    kinds = [e for e, *_ in rec.events if e is not Event.STEP]
    assert kinds[:3] == [Event.INIT_START, Event.INIT_STOP, Event.RUN_START]
    assert kinds[-1] is Event.RUN_STOP
