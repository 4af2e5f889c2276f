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

both unbiased but noisy: each is averaged over the last ``horizon_samples`` training samples
(``train.noise_scale_horizon_samples``) before the ratio - an exponential moving average in
steps, each step weighing d = 1 − B_big/horizon of the step after it, so its weights sum to
the horizon (in samples) once the run is longer than that, and to every sample so far before
(an average, not a decayed sum: Adam's bias correction, exactly). A change in the gradient's
statistics shows 1 − 1/e ≈ 63 % of the way after one horizon, 95 % after three. B_simple is in
sequences (the unit of the batch sizes); the MLM loss is a mean over masked tokens, so one
sequence here stands for its ~15 % masked positions - multiply by the masked tokens per
sequence for a token count.

What it measures is the whole gradient, every parameter, whatever the sync (DDP's buckets, the
bucket engine's, the split tied embedding's two shares: each reports its whole local squared
norm, tests/ranks/test_noise_scale_ranks.py holds them equal).

Each step's record carries ``noise_scale_window_samples``: the samples the average spans (its
weights' sum × B_big: every sample so far early on, then the horizon), beside the raw
per-step norms ``grad_sq_small`` / ``grad_sq_big`` (so any other horizon can be replayed from
metrics.jsonl, as bench/noise_check.py does).
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

@dataclass
class NoiseScale:
    """B_simple from per-step squared norms; see the module docstring."""

    b_small: int            # sequences behind one rank's local gradient (local batch × accum)
    b_big: int              # sequences behind the averaged gradient (the global batch)
    horizon_samples: int    # the averages' horizon (train.noise_scale_horizon_samples; 0:
    #                         each step alone)
    steps: int = 0          # steps folded in
    weight: float = 0.0     # Σ d^age over the steps folded in: the steps the average spans
    g2_sum: float = 0.0     # Σ d^age · (this step's |G|² estimate)
    trace_sum: float = 0.0  # Σ d^age · (this step's tr(Σ) estimate)

    def __post_init__(self):
        if not (0 < self.b_small < self.b_big):
            raise ValueError(f"the noise scale needs a global batch ({self.b_big}) larger "
                             f"than one rank's ({self.b_small}): more than one rank")
        if not (isinstance(self.horizon_samples, int) and self.horizon_samples >= 0):
            raise ValueError(f"noise-scale horizon must be a whole number of samples >= 0, "
                             f"got {self.horizon_samples!r}")

    @property
    def decay(self) -> float:
        """Each step's weight relative to the next one's: 1 − B_big/horizon (0 for a
        horizon of at most one step: no averaging)."""
        return max(0.0, 1.0 - self.b_big / self.horizon_samples) if self.horizon_samples else 0.0

    def update(self, small_sq: float, big_sq: float) -> dict:
        """Fold in one step: ``small_sq`` the mean over ranks of the local squared norms,
        ``big_sq`` the averaged gradient's squared norm (both unscaled by the loss scale).
        Returns this step's figures (None where undefined) and the two norms."""
        if not (math.isfinite(small_sq) and math.isfinite(big_sq)):
            return self.figures()  # a skipped (non-finite) step teaches nothing
        bs, bb = self.b_small, self.b_big
        g2 = (bb * big_sq - bs * small_sq) / (bb - bs)
        trace = (small_sq - big_sq) / (1.0 / bs - 1.0 / bb)
        d = self.decay
        self.steps += 1
        self.weight = d * self.weight + 1.0
        self.g2_sum = d * self.g2_sum + g2
        self.trace_sum = d * self.trace_sum + trace
        return {**self.figures(), "grad_sq_small": small_sq, "grad_sq_big": big_sq}

    def figures(self) -> dict:
        """{"grad_sq_true": |G|², "grad_trace_cov": tr(Σ), "noise_scale": B_simple,
        "noise_scale_window_samples": the samples the averages span}; B_simple None while
        |G|² ≤ 0 or tr(Σ) < 0 (undefined: n/a)."""
        if self.steps == 0:
            return {"grad_sq_true": None, "grad_trace_cov": None, "noise_scale": None,
                    "noise_scale_window_samples": 0}
        g2, trace = self.g2_sum / self.weight, self.trace_sum / self.weight
        defined = g2 > 0 and trace >= 0
        return {"grad_sq_true": g2, "grad_trace_cov": trace,
                "noise_scale": trace / g2 if defined else None,
                "noise_scale_window_samples": round(self.weight * self.b_big)}

    def state_dict(self) -> dict:
        return {"steps": self.steps, "weight": self.weight, "g2_sum": self.g2_sum,
                "trace_sum": self.trace_sum, "b_small": self.b_small, "b_big": self.b_big,
                "horizon_samples": self.horizon_samples}

    def load_state_dict(self, state: dict) -> None:
        """The averages as saved, continued with this run's horizon (a changed horizon weighs
        the steps from here on by its own decay). A checkpoint written before the horizon was
        a key (a per-step ``decay`` and bias-corrected EMAs) is converted exactly."""
        if (state.get("b_small"), state.get("b_big")) != (self.b_small, self.b_big):
            return  # another batch shape: its averages measure other batch sizes; start over
        self.steps = int(state["steps"])
        if "weight" in state:
            self.weight = float(state["weight"])
            self.g2_sum, self.trace_sum = float(state["g2_sum"]), float(state["trace_sum"])
            return
        d = float(state["decay"])  # g2_ema = (1 − d) Σ d^age g2: the sums are ema / (1 − d)
        self.weight = (1 - d ** self.steps) / (1 - d) if self.steps else 0.0
        self.g2_sum = float(state["g2_ema"]) / (1 - d)
        self.trace_sum = float(state["trace_ema"]) / (1 - d)


def for_run(local_batch: int, accumulation: int, world_size: int,
            horizon_samples: int) -> Optional[NoiseScale]:
    """The estimator of a run, or None with one rank (there is no second batch size)."""
    if world_size < 2:
        return None
    b = local_batch * accumulation
    return NoiseScale(b_small=b, b_big=b * world_size, horizon_samples=horizon_samples)
