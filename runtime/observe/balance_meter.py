"""Load-balance measurement: padding efficiency and imbalance across ranks, for every step,
reduced only when metrics are logged.

Owns: counting, per step and rank, the real tokens, the computed tokens (what the model
computes on: rows × L when padded, the real tokens when ``model.attention='unpadded'``), the
compute time and the time waiting for data; keeping those counts for the steps since the last
reduction, and reducing them across ranks in one go (`reduce`: a sum and a max over a
[steps × fields] tensor, two small all-reduces however many steps) into per-step metrics:

  padding_efficiency  Σ real / Σ computed tokens over ranks (1.0 = no compute on padding)
  imbalance_tokens  max / mean computed tokens over ranks (the padded compute a step waits for)
  imbalance_real    max / mean real tokens
  imbalance_cost    max / mean batch cost over ranks, by the length-cost model (data.length_cost:
                    a·Σlen + b·Σlen² + c·rows ..., loaders.length_cost) - what the deals balance
  imbalance_compute max / mean compute time over ranks
  compute_s_max, compute_s_mean, load_s_max   seconds
  real_tokens_all, computed_tokens_all        the sums (the progress line accumulates them)
  model_flops_all   Σ over ranks of the step's model FLOPs (runtime.model.arithmetic): the
                    step log turns it into TFLOP/s and MFU (runtime.observe.mfu)

Compute time is the forward passes of the training step, timed by hooks on the model: the
forward has no communication, so it is this rank's own work, while the end of the backward
waits for the slowest rank's gradient allreduce and cannot be timed per rank without that
wait. The backward runs on the same shapes (≈ 2× the forward), so the ratio carries over.
On CUDA the hooks record events; they are read (one synchronisation) in `reduce`, which the
trainer calls on logging steps only - an ordinary step pays no collective and no host read.

Never: changes what is trained, steers the loop, or reads the environment.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from runtime.launch.dist import all_reduce_max, all_reduce_sum

FIELDS = ("real", "computed", "cost", "compute_s", "load_s", "flops")


class BalanceMeter:
    """Measures one rank's steps (``wrap`` the training iterator: data wait; hooks on
    ``model``: forward time); ``end_step`` closes a step with its token counts (host
    bookkeeping only), ``reduce`` all-reduces every closed step."""

    def __init__(self, model: torch.nn.Module, device: torch.device, world_size: int,
                 cost: Any = None):
        self.device, self.world_size = device, world_size
        self.cost = cost  # a loaders.length_cost.LengthCost; None = real tokens
        self._load_s = self._cost = 0.0
        self._spans: list = []
        self._closed: list[tuple[dict, list]] = []  # (counts, forward spans) per closed step
        self._hooks = [model.register_forward_pre_hook(self._forward_start),
                       model.register_forward_hook(self._forward_stop)]

    def wrap(self, batches):
        """The training iterator, timing the wait for each batch and pricing it (host data:
        the batch is still on the CPU here)."""
        while True:
            t0 = time.perf_counter()
            batch = next(batches)
            self._load_s += time.perf_counter() - t0
            self._cost += (self.cost.of_batch(batch) if self.cost is not None
                           else batch.num_real_tokens)
            yield batch

    def end_step(self, real: int, computed: int, flops: float = 0.0) -> None:
        """Close this rank's step: its real and computed tokens and model FLOPs (host numbers,
        no sync)."""
        counts = {"real": float(real), "computed": float(computed), "cost": self._cost,
                  "compute_s": 0.0, "load_s": self._load_s, "flops": float(flops)}
        self._closed.append((counts, self._spans))
        self._load_s, self._cost, self._spans = 0.0, 0.0, []

    def reduce(self) -> list[dict[str, float]]:
        """All-reduce the steps closed since the last call (every rank must call it at the
        same point) and return one metrics dict per step, in order."""
        closed, self._closed = self._closed, []
        if not closed:
            return []
        rows = []
        for counts, spans in closed:
            counts["compute_s"] = self._compute_seconds(spans)
            rows.append([counts[f] for f in FIELDS])
        local = torch.tensor(rows, dtype=torch.float64, device=self.device)
        total = all_reduce_sum(local.clone()).tolist()
        top = all_reduce_max(local.clone()).tolist()
        return [step_balance(dict(zip(FIELDS, t)), dict(zip(FIELDS, m)), self.world_size)
                for t, m in zip(total, top)]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()

    # -- forward timing ----------------------------------------------------------------------
    hooked = True
    """Whether the model's forward hooks time the forward; under CUDA graphs no module hook
    runs in a replay (and none may record an event inside a capture): the trainer turns them
    off and marks ``span``s itself - each micro-batch's forward replay (train.cuda_graphs
    'encoder'), the whole step (``full``: backward and its allreduce waits included)."""
    _paused = False

    @contextlib.contextmanager
    def paused(self):
        """No timing inside (a CUDA graph being captured)."""
        before, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = before

    @contextlib.contextmanager
    def span(self):
        """Time what runs inside as compute (see ``hooked``)."""
        self._spans.append([self._mark()])
        try:
            yield
        finally:
            self._spans[-1].append(self._mark())

    def _forward_start(self, module, args) -> None:
        if module.training and self.hooked and not self._paused:
            self._spans.append([self._mark()])

    def _forward_stop(self, module, args, output) -> None:
        if module.training and self.hooked and not self._paused and self._spans \
                and len(self._spans[-1]) == 1:
            self._spans[-1].append(self._mark())

    def _mark(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _compute_seconds(self, spans: list) -> float:
        spans = [s for s in spans if len(s) == 2]
        if self.device.type == "cuda":
            if spans:
                spans[-1][1].synchronize()
            return sum(a.elapsed_time(b) for a, b in spans) / 1000.0
        return sum(b - a for a, b in spans)


def step_balance(total: dict, top: dict, world_size: int) -> dict[str, float]:
    """The ``extra`` metrics from per-field sums and maxima over ``world_size`` ranks."""
    def ratio(field: str) -> float:
        mean = total.get(field, 0.0) / world_size
        return top[field] / mean if mean > 0 else 1.0

    return {"padding_efficiency": total["real"] / max(total["computed"], 1.0),
            "imbalance_tokens": ratio("computed"), "imbalance_real": ratio("real"),
            "imbalance_cost": ratio("cost"),
            "imbalance_compute": ratio("compute_s"),
            "compute_s_max": top["compute_s"], "compute_s_mean": total["compute_s"] / world_size,
            "load_s_max": top["load_s"],
            "real_tokens_all": total["real"], "computed_tokens_all": total["computed"],
            "model_flops_all": total.get("flops", 0.0)}
