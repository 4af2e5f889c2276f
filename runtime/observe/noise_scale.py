"""The gradient noise scale, online: how far the batch can grow before more samples are needed
for the same progress (McCandlish, Kaplan, Amodei 2018, "An Empirical Model of Large-Batch
Training", arXiv 1812.06162).

Owns: ``NoiseScale``, the estimator of B_simple = tr(Σ)/|G|² from two batch sizes that data
parallelism measures anyway (the paper's appendix A): each rank's local gradient, of
B_small = local batch × accumulation sequences, and the averaged gradient, of B_big = the
global batch. From the mean over ranks of the local squared norms |G_small|² and the averaged
gradient's |G_big|², per step,

    |G|²   ≈ (B_big·|G_big|² − B_small·|G_small|²) / (B_big − B_small)
    tr(Σ)  ≈ (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)

both unbiased but noisy: each is smoothed by an exponential moving average (bias-corrected,
as Adam's moments) before the ratio. B_simple is in sequences (the unit of the batch sizes);
the MLM loss is a mean over masked tokens, so one sequence here stands for its ~15 % masked
positions - multiply by the masked tokens per sequence for a token count.
Never: touches gradients or runs a collective - the squared norms come from the gradient sync
(``SyncReport.local_sq_norm``, on the device, before the allreduce) and the mean over ranks
rides the logging point's existing reduction (runtime.observe.step_log).

Early in training |G|² can be small and its estimate negative or near zero: the ratio is then
undefined and reported as None ("n/a"), never as a wrong number.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

DEFAULT_DECAY = 0.99
"""Per-step EMA decay (gpt-neox's; an effective window of ~100 steps)."""


@dataclass
class NoiseScale:
    """B_simple from per-step squared norms; see the module docstring."""

    b_small: int            # sequences behind one rank's local gradient (local batch × accum)
    b_big: int              # sequences behind the averaged gradient (the global batch)
    decay: float = DEFAULT_DECAY
    steps: int = 0          # steps folded in
    g2_ema: float = 0.0     # EMA of the |G|² estimates (not yet bias-corrected)
    trace_ema: float = 0.0  # EMA of the tr(Σ) estimates

    def __post_init__(self):
        if not (0 < self.b_small < self.b_big):
            raise ValueError(f"the noise scale needs a global batch ({self.b_big}) larger "
                             f"than one rank's ({self.b_small}): more than one rank")
        if not 0 <= self.decay < 1:
            raise ValueError(f"noise-scale EMA decay must be in [0, 1), got {self.decay}")

    def update(self, small_sq: float, big_sq: float) -> dict:
        """Fold in one step: ``small_sq`` the mean over ranks of the local squared norms,
        ``big_sq`` the averaged gradient's squared norm (both unscaled by the loss scale).
        Returns this step's figures (None where undefined)."""
        if not (math.isfinite(small_sq) and math.isfinite(big_sq)):
            return self.figures()  # a skipped (non-finite) step teaches nothing
        bs, bb = self.b_small, self.b_big
        g2 = (bb * big_sq - bs * small_sq) / (bb - bs)
        trace = (small_sq - big_sq) / (1.0 / bs - 1.0 / bb)
        self.steps += 1
        self.g2_ema = self.decay * self.g2_ema + (1 - self.decay) * g2
        self.trace_ema = self.decay * self.trace_ema + (1 - self.decay) * trace
        return self.figures()

    def figures(self) -> dict:
        """{"grad_sq_true": |G|², "grad_trace_cov": tr(Σ), "noise_scale": B_simple}, the EMAs
        bias-corrected; B_simple None while |G|² ≤ 0 or tr(Σ) < 0 (undefined: n/a)."""
        if self.steps == 0:
            return {"grad_sq_true": None, "grad_trace_cov": None, "noise_scale": None}
        correction = 1 - self.decay ** self.steps
        g2, trace = self.g2_ema / correction, self.trace_ema / correction
        defined = g2 > 0 and trace >= 0
        return {"grad_sq_true": g2, "grad_trace_cov": trace,
                "noise_scale": trace / g2 if defined else None}

    def state_dict(self) -> dict:
        return {"steps": self.steps, "g2_ema": self.g2_ema, "trace_ema": self.trace_ema,
                "b_small": self.b_small, "b_big": self.b_big, "decay": self.decay}

    def load_state_dict(self, state: dict) -> None:
        if (state.get("b_small"), state.get("b_big")) != (self.b_small, self.b_big):
            return  # another batch shape: its averages measure other batch sizes; start over
        self.steps = int(state["steps"])
        self.g2_ema, self.trace_ema = float(state["g2_ema"]), float(state["trace_ema"])


def for_run(local_batch: int, accumulation: int, world_size: int,
            decay: float = DEFAULT_DECAY) -> Optional[NoiseScale]:
    """The estimator of a run, or None with one rank (there is no second batch size)."""
    if world_size < 2:
        return None
    b = local_batch * accumulation
    return NoiseScale(b_small=b, b_big=b * world_size, decay=decay)
