"""What a captured step may touch, watched from a test: the collectives it calls and the
tensors that must live from step to step.

``Collectives`` wraps torch.distributed's collectives (``COLLECTIVES``) and counts the calls
until ``restore``; ``persistent_tensors`` gives (identity, memory) of every tensor a CUDA graph
of the trainer's step would read or write at each replay - equal before and after a step
means the step changed them in place."""
from __future__ import annotations

import torch
import torch.distributed as torch_dist

COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
               "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "gather", "scatter",
               "reduce", "send", "recv")


class Collectives:
    """Counts the calls of each collective (``calls``: name -> count) until ``restore``."""

    def __init__(self):
        self.calls: dict[str, int] = {}
        self._real = {}
        for name in COLLECTIVES:
            real = getattr(torch_dist, name, None)
            if real is None:
                continue
            self._real[name] = real

            def counted(*a, _name=name, _real=real, **k):
                self.calls[_name] = self.calls.get(_name, 0) + 1
                return _real(*a, **k)
            setattr(torch_dist, name, counted)

    def reset(self):
        self.calls = {}

    def restore(self):
        for name, real in self._real.items():
            setattr(torch_dist, name, real)


def persistent_tensors(trainer) -> dict[str, tuple[int, int]]:
    """What lives from step to step: (identity, memory) of each tensor a graph would read or
    write at every replay."""
    out = {}
    scale = trainer.loss_scale
    for name in ("scale", "good_steps", "skipped"):
        t = getattr(scale, name)
        if isinstance(t, torch.Tensor):
            out[f"loss_scale.{name}"] = t
    for i, part in enumerate(trainer.optimizer.flat_binding.parts):
        out[f"opt{i}.steps"] = part.steps
        out[f"opt{i}.params"] = part.buffers.params
        for k, v in part.buffers.state.items():
            out[f"opt{i}.{k}"] = v
    out["grads"] = trainer.grad_sync.flat
    out["device_step"] = trainer.runner.device_step
    out["lr_table"] = trainer.runner.lr_table
    for n, p in trainer.model.named_parameters():
        out[n] = p
    return {k: (id(t), t.data_ptr()) for k, t in out.items()}


class ForcedOverflow:
    """A loss-scale overflow forced into a run (a ``between(trainer, i)`` hook of the step
    loop): before step ``at`` the scale is set to ``scale`` - far beyond the gradients' range
    -, restored to its value before that at step ``at + restore_after``. The scale is changed
    in place, so a captured step reads it as an eager one does.

    What must follow, eager or replayed (``check``): steps ``at`` to ``at + restore_after - 1``
    are skipped, the scale halving inside each (halving once cannot bring a scale this large
    into range: 2^120 x a gradient of size 1 is still past fp16's 65504 at 2^119), and no step
    before or after them is skipped."""

    def __init__(self, scale: float, at: int = 6, restore_after: int = 2):
        self.scale, self.at, self.restore_after = scale, at, restore_after
        self.before: float | None = None

    def __call__(self, trainer, i: int) -> None:
        live = trainer.loss_scale.scale
        if i == self.at:
            self.before = float(live)
            live.fill_(self.scale)
        elif i == self.at + self.restore_after:
            live.fill_(self.before)

    def check(self, recs) -> None:
        bad = range(self.at, self.at + self.restore_after)
        assert [r.skipped for r in recs] == [i in bad for i in range(len(recs))], \
            [r.skipped for r in recs]
        for k, i in enumerate(bad):
            assert recs[i].loss_scale == self.scale / 2 ** (k + 1)  # halved inside the step
