"""TensorBoard event files of a run (``train.tensorboard = true``): the curves people watch a
large-batch run by, in ``<run dir>/tensorboard`` (``tensorboard --logdir <run dir>``).

Owns: ``TensorBoardWriter``, a callback writing at each logging point every logged step's
loss (total, MLM, NSP), learning rate, gradient norm, gradient noise scale (where defined),
throughput (``samples_per_s``: this process's samples over its time, so a resumed run's
earlier samples do not inflate it), achieved TFLOP/s per device and MFU (where the device's
peak is known: runtime.observe.mfu) and imbalance, and each evaluation's accuracy - all
against samples trained, the unit MLPerf counts in; the tags are ``SCALARS`` (the
metrics.jsonl names on the left: docs/METRICS.md). Rank 0 only.
Never: steers training, reads device values (it sees the logging point's numbers), or is
imported unless asked for (``torch.utils.tensorboard`` needs the tensorboard package).
"""
from __future__ import annotations

from pathlib import Path
from runtime.events import Event, RunState

SCALARS = {  # metrics.jsonl / StepMetrics name -> TensorBoard tag
    "loss": "loss/total", "mlm_loss": "loss/mlm", "nsp_loss": "loss/nsp", "lr": "optim/lr",
    "grad_norm": "optim/grad_norm", "noise_scale": "batch/gradient_noise_scale",
    "imbalance_tokens": "balance/imbalance_tokens", "imbalance_cost": "balance/imbalance_cost",
    "samples_per_s": "throughput/samples_per_s", "tflops": "throughput/tflops_per_device",
    "mfu": "throughput/mfu",
}


class TensorBoardWriter:
    """See the module docstring. ``logdir``: where the event files go."""

    def __init__(self, logdir: str | Path):
        self.logdir = Path(logdir)
        self._writer = None

    def on_event(self, event: Event, state: RunState) -> None:
        if not state.is_main:
            return
        if event is Event.RUN_START:
            from torch.utils.tensorboard import SummaryWriter  # the tensorboard package
            self._writer = SummaryWriter(log_dir=str(self.logdir))
        elif event is Event.LOG and self._writer is not None:
            for m in state.logged_steps:
                values = {"loss": m.loss, "mlm_loss": m.mlm_loss, "nsp_loss": m.nsp_loss,
                          "lr": m.lr, "grad_norm": m.grad_norm, **m.extra}
                for key, tag in SCALARS.items():
                    v = values.get(key)
                    if isinstance(v, (int, float)) and v == v:  # numbers, not NaN
                        self._writer.add_scalar(tag, v, m.samples)
        elif event is Event.EVAL_STOP and self._writer is not None \
                and state.eval_accuracy is not None:
            self._writer.add_scalar("eval/mlm_accuracy", state.eval_accuracy, state.samples)
            self._writer.flush()
        elif event is Event.RUN_STOP and self._writer is not None:
            self._writer.close()
            self._writer = None
