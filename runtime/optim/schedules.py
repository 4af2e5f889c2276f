"""Learning-rate schedules as pure functions of the step, and batch-size lr scaling rules.

What this module owns: the value of the learning rate for each optimizer update, and how
the base lr (and warm-up) change with the global batch size. It holds no state and touches
no optimizer: the runtime calls ``schedule(t)`` and writes the result into the optimizer
(``runtime.optim.set_lr``) before update ``t``.

Step convention (one meaning everywhere)
----------------------------------------
``t`` is the 0-based index of the optimizer update the lr is used for: the first update
uses ``schedule(0)``, the k-th uses ``schedule(k-1)``; equivalently, t = number of updates
already completed. This is TF's ``global_step`` in the MLPerf BERT reference
(``optimization.py``: lr from ``global_step`` before ``apply_gradients`` increments it).

MLPerf poly schedule (``poly_warmup_lr``, docs/REFERENCES.md §3)::

    η(t) = η · (t − s0)/W                   while t − s0 < W       (linear warm-up)
    η(t) = η · (1 − min(t/T, 1))^p          otherwise              (decay from absolute t)

with η = base_lr, W = warmup_steps, s0 = start_warmup_step (≤ 0), T = total_steps, p = power.
  * W = 0 means no warm-up (the reference's ``if num_warmup_steps:``).
  * With s0 = 0 the first update has lr 0 (as in the reference). With s0 < 0 warm-up starts
    part-way: W=100, s0=−25 gives η·25/100 at t=0 and the last warm-up step is t=74; decay
    applies from t = W + s0 = 75, evaluated at absolute t (so η(75) = η·(1 − 75/T), not η).
  * t ≥ T gives 0 (p > 0).
  * s0 > 0 is refused: the reference formula would give a negative lr for t < s0.

NVIDIA's PyTorch MLPerf implementation (``LinearWarmupPolyDecayScheduler``) is called
before ``optimizer.step()`` with ``last_epoch = completed_steps + 1`` and subtracts
``offset_step = int(start_warmup_step == 0)``: for s0 = 0 it equals this convention exactly;
for s0 ≠ 0 it evaluates at t+1 (one update ahead of the TF reference; e.g. η·26/100 rather
than η·25/100 at the first update for W=100, s0=−25). We follow the reference (TF) here and
note the difference; it is at most one update's worth of schedule.

Batch-size scaling (``scaled_lr``, ``legw``):
  * linear: η(B) = η0 · B/B0;
  * sqrt / LEGW (You et al., arXiv 1901.08256): η(B) = η0 · √(B/B0), and warm-up measured in
    *epochs* grows with the batch, w(B) = w0 · B/B0, so warm-up measured in *iterations*
    stays constant: w(B)·N/B = w0·N/B0.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

__all__ = [
    "poly_warmup_lr",
    "constant_lr",
    "build_schedule",
    "available_schedules",
    "scaled_lr",
    "legw",
    "SCALING_RULES",
]

SCALING_RULES = ("none", "linear", "sqrt", "legw")


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x) -> bool:  # numpy integers count; bools do not
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check(ok: bool, key: str, rule: str, value) -> None:
    if not ok:
        raise ValueError(f"schedule: '{key}' must be {rule}, got {value!r}")


def _check_step(t) -> None:
    _check(_is_int(t) and t >= 0, "t", "an integer >= 0 (0-based update index)", t)


def _check_base_lr(base_lr) -> None:
    _check(_is_number(base_lr) and base_lr > 0, "base_lr", "a number > 0", base_lr)


def _check_poly(base_lr, warmup_steps, start_warmup_step, total_steps, power) -> None:
    _check_base_lr(base_lr)
    _check(_is_int(warmup_steps) and warmup_steps >= 0, "warmup_steps", "an integer >= 0",
           warmup_steps)
    _check(_is_int(start_warmup_step) and start_warmup_step <= 0, "start_warmup_step",
           "an integer <= 0", start_warmup_step)
    _check(_is_int(total_steps) and total_steps > 0, "total_steps", "an integer > 0",
           total_steps)
    _check(_is_number(power) and power > 0, "power", "a number > 0", power)


def poly_warmup_lr(t: int, *, base_lr: float, warmup_steps: int, total_steps: int,
                   start_warmup_step: int = 0, power: float = 1.0) -> float:
    """MLPerf BERT lr for update ``t`` (0-based); see the module docstring for the formula."""
    _check_poly(base_lr, warmup_steps, start_warmup_step, total_steps, power)
    _check_step(t)
    since_warmup_start = t - start_warmup_step
    if warmup_steps > 0 and since_warmup_start < warmup_steps:
        return base_lr * since_warmup_start / warmup_steps
    return base_lr * (1.0 - min(t / total_steps, 1.0)) ** power


def constant_lr(t: int, *, base_lr: float) -> float:
    """The same lr for every update."""
    _check_base_lr(base_lr)
    _check_step(t)
    return float(base_lr)


def _build_poly(*, base_lr: float, total_steps: int, warmup_steps: int = 0,
                start_warmup_step: int = 0, power: float = 1.0) -> Callable[[int], float]:
    _check_poly(base_lr, warmup_steps, start_warmup_step, total_steps, power)

    def schedule(t: int) -> float:
        return poly_warmup_lr(t, base_lr=base_lr, warmup_steps=warmup_steps,
                              total_steps=total_steps, start_warmup_step=start_warmup_step,
                              power=power)

    return schedule


def _build_constant(*, base_lr: float) -> Callable[[int], float]:
    _check_base_lr(base_lr)

    def schedule(t: int) -> float:
        return constant_lr(t, base_lr=base_lr)

    return schedule


_SCHEDULES: dict[str, Callable[..., Callable[[int], float]]] = {
    "poly": _build_poly,
    "constant": _build_constant,
}


def available_schedules() -> tuple[str, ...]:
    return tuple(sorted(_SCHEDULES))


def schedule_param_names(name: str) -> tuple[str, ...]:
    """The keys ``build_schedule(name, ...)`` takes besides ``base_lr`` (to read a config's
    declared fields)."""
    import inspect
    try:
        builder = _SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; available schedules: "
                         f"{', '.join(available_schedules())}") from None
    return tuple(p for p in inspect.signature(builder).parameters if p != "base_lr")


def build_schedule(name: str, **kw) -> Callable[[int], float]:
    """Return ``schedule(t) -> lr`` (t = 0-based update index).

    ``poly``: base_lr, total_steps, warmup_steps=0, start_warmup_step=0, power=1.0.
    ``constant``: base_lr.
    Values are checked here, once; unknown names or keys raise ValueError.
    """
    try:
        builder = _SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; available schedules: "
                         f"{', '.join(available_schedules())}") from None
    try:
        return builder(**kw)
    except TypeError as e:  # unknown or missing keyword
        import inspect
        accepted = ", ".join(inspect.signature(builder).parameters)
        raise ValueError(f"schedule {name!r}: {e}; accepted keys: {accepted}") from None


def _check_batches(base_lr, base_batch, batch) -> None:
    _check_base_lr(base_lr)
    _check(_is_int(base_batch) and base_batch > 0, "base_batch", "an integer > 0", base_batch)
    _check(_is_int(batch) and batch > 0, "batch", "an integer > 0", batch)


def scaled_lr(rule: str, base_lr: float, base_batch: int, batch: int) -> float:
    """Learning rate for global batch ``batch``, given ``base_lr`` tuned at ``base_batch``.

    rule: ``none`` → base_lr; ``linear`` → base_lr·B/B0; ``sqrt`` or ``legw`` → base_lr·√(B/B0).
    """
    if rule not in SCALING_RULES:
        raise ValueError(f"schedule: 'rule' must be one of {', '.join(SCALING_RULES)}, "
                         f"got {rule!r}")
    _check_batches(base_lr, base_batch, batch)
    k = batch / base_batch
    if rule == "none":
        return float(base_lr)
    if rule == "linear":
        return base_lr * k
    return base_lr * math.sqrt(k)


def legw(base_lr: float, base_batch: int, batch: int, *, base_warmup_epochs: float,
         dataset_size: int) -> tuple[float, int]:
    """LEGW scaling: returns ``(lr, warmup_steps)`` for global batch ``batch``.

    ``base_warmup_epochs`` (w0) is the warm-up at ``base_batch`` (B0) in epochs over a data
    set of ``dataset_size`` (N) samples. Then

        lr            = base_lr · √(B/B0)
        warmup epochs = w0 · B/B0
        warmup_steps  = (w0 · B/B0) · N/B = w0 · N/B0      (independent of B)

    rounded to the nearest integer (halves up), as the poly schedule counts whole updates.
    """
    _check_batches(base_lr, base_batch, batch)
    _check(_is_number(base_warmup_epochs) and base_warmup_epochs >= 0, "base_warmup_epochs",
           "a number >= 0", base_warmup_epochs)
    _check(_is_int(dataset_size) and dataset_size > 0, "dataset_size", "an integer > 0",
           dataset_size)
    lr = scaled_lr("legw", base_lr, base_batch, batch)
    warmup_epochs = base_warmup_epochs * batch / base_batch
    warmup_steps = math.floor(warmup_epochs * dataset_size / batch + 0.5)
    return lr, warmup_steps
