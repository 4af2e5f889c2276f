"""Allreduce cost model T(n): fitted to measured (bytes, seconds) points (docs/REFERENCES.md §6).

Owns: ``CommModel`` - T(n) = α + β·n, or a continuous piecewise-linear T when one line is
wrong (two lines meeting at a fitted breakpoint: latency-bound small messages, bandwidth-bound
large ones); fitting it (`fit_affine`, `fit_piecewise`, `fit` picks), its error on the data,
and the derived figures users know: α, algorithm bandwidth n/T, and NCCL's bus bandwidth
(algbw · 2(p−1)/p). Data checks (`check_sweep`): too few points, times that fall as sizes
grow - warnings with the data, never a silent fit.
Never: measures (runtime.calibrate.tune.measure does) or talks to other ranks. Pure numpy.

The fit minimises Σ |log T(n) − log t| (Gauss-Newton, iteratively reweighted): the sweep
spans 4 KiB to the whole gradient, so a plain least-squares line would fit the few large
points and ignore latency; relative errors are one-sided (an underestimate costs at most
100 %) and pull the latency to zero; and squared errors let one small message that waited for
a busy core drag the whole line. Reported errors are relative, |T(n) − t|/t.
Breakpoints of a piecewise fit are searched among the measured sizes (each split with at least
2 points a side); the piecewise model is kept only when it lowers the mean relative error by a
third or more, so a straight line is never traded for noise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np


class SweepError(ValueError):
    """Measurements that cannot be fitted; the message shows the data and what to do."""


@dataclass(frozen=True)
class CommModel:
    """T(n) seconds for an allreduce of n bytes over ``world_size`` ranks.

    ``segments``: ((n_from, α_i, β_i), ...) sorted by n_from (the first n_from is 0); on
    [n_from_i, n_from_{i+1}) T(n) = α_i + β_i·n. One segment = the α-β model. Fits make
    the pieces meet (continuous), so T is non-decreasing when every β_i ≥ 0.
    """

    segments: tuple[tuple[float, float, float], ...]
    world_size: int = 2
    rms_rel_err: float = 0.0
    max_rel_err: float = 0.0
    kind: str = "affine"
    mean_rel_err: float = 0.0
    """mean |T(n) − t|/t over the fitted points: what the fit minimises"""

    @classmethod
    def affine(cls, alpha: float, beta: float, world_size: int = 2, **kw) -> "CommModel":
        return cls(((0.0, float(alpha), float(beta)),), world_size, **kw)

    @property
    def alpha(self) -> float:
        """Latency: T at 0 bytes (first segment's intercept), seconds."""
        return self.segments[0][1]

    @property
    def beta(self) -> float:
        """Seconds per byte on the largest messages (last segment)."""
        return self.segments[-1][2]

    @property
    def bandwidth(self) -> float:
        """Algorithm bandwidth of large messages, bytes/s (1/β of the last segment)."""
        return 1.0 / self.beta if self.beta > 0 else math.inf

    @property
    def bus_bandwidth(self) -> float:
        """NCCL's bus bandwidth of large messages: algbw · 2(p−1)/p, bytes/s."""
        p = self.world_size
        return self.bandwidth * 2 * (p - 1) / p

    def betas(self) -> list[float]:
        return [s[2] for s in self.segments]

    def breakpoints(self) -> list[float]:
        return [s[0] for s in self.segments[1:]]

    def time(self, nbytes):
        """T(n) for a number or a numpy array of byte counts (0 bytes cost nothing)."""
        if isinstance(nbytes, (int, float, np.integer, np.floating)):
            # one message: the same arithmetic in plain floats (the simulator asks ~10^5 times)
            if not nbytes > 0:
                return 0.0
            _, a, b = self.segments[0]
            for start, sa, sb in self.segments[1:]:
                if nbytes >= start:
                    a, b = sa, sb
            return float(a + b * nbytes)
        n = np.asarray(nbytes, dtype=np.float64)
        out = np.full(n.shape, self.segments[0][1]) + self.segments[0][2] * n
        for start, a, b in self.segments[1:]:
            out = np.where(n >= start, a + b * n, out)
        out = np.where(n > 0, out, 0.0)
        return float(out) if out.ndim == 0 else out

    def to_json(self) -> dict:
        return {"kind": self.kind, "world_size": self.world_size,
                "segments": [list(s) for s in self.segments], "alpha_s": self.alpha,
                "bandwidth_Bps": self.bandwidth, "bus_bandwidth_Bps": self.bus_bandwidth,
                "rms_rel_err": self.rms_rel_err, "max_rel_err": self.max_rel_err,
                "mean_rel_err": self.mean_rel_err}

    @classmethod
    def from_json(cls, d: dict) -> "CommModel":
        return cls(tuple(tuple(float(x) for x in s) for s in d["segments"]),
                   int(d.get("world_size", 2)), float(d.get("rms_rel_err", 0.0)),
                   float(d.get("max_rel_err", 0.0)), d.get("kind", "affine"),
                   float(d.get("mean_rel_err", 0.0)))

    def describe(self) -> str:
        us, gbs = 1e6, 1e-9
        head = (f"T(n) = {self.alpha * us:.1f} µs + n / {self.bandwidth * gbs:.3g} GB/s "
                f"(bus bandwidth {self.bus_bandwidth * gbs:.3g} GB/s at {self.world_size} "
                f"ranks)")
        if len(self.segments) > 1:
            parts = "; ".join(f"from {s[0] / 1024:.0f} KiB: {s[1] * us:.1f} µs + n / "
                              f"{(1 / s[2] if s[2] > 0 else math.inf) * gbs:.3g} GB/s"
                              for s in self.segments)
            head = f"piecewise: {parts}"
        return (f"{head}; fit error (relative) mean {self.mean_rel_err:.1%}, RMS "
                f"{self.rms_rel_err:.1%}, max {self.max_rel_err:.1%}")


@dataclass
class SweepCheck:
    """What `check_sweep` found: warnings (each says what to do) and the data table."""

    warnings: list[str] = field(default_factory=list)
    table: str = ""


def check_sweep(sizes: Sequence[float], times: Sequence[float], min_points: int = 4) -> SweepCheck:
    """Warn about too few points and about times that fall as sizes grow (by more than 10 %
    and 50 µs: noise on a shared machine, a message size the fabric handles oddly), with
    the data, so a user sees what was fitted."""
    check = SweepCheck(table=sweep_table(sizes, times))
    if len(sizes) < min_points:
        check.warnings.append(f"only {len(sizes)} allreduce sizes measured (want ≥ {min_points}): "
                              f"the fit is weak; raise --sizes or lower --min-bytes")
    order = np.argsort(sizes)
    s, t = np.asarray(sizes, float)[order], np.asarray(times, float)[order]
    drops = [(s[i], t[i], s[i + 1], t[i + 1]) for i in range(len(s) - 1)
             if t[i + 1] < 0.9 * t[i] and t[i] - t[i + 1] > 50e-6]
    for a, ta, b, tb in drops:
        check.warnings.append(f"allreduce time falls from {ta * 1e3:.3f} ms at {_size(a)} to "
                              f"{tb * 1e3:.3f} ms at {_size(b)} (not monotonic): noise or another "
                              f"job on the network; rerun with more --repeats on an idle machine")
    return check


def sweep_table(sizes: Sequence[float], times: Sequence[float],
                model: CommModel | None = None) -> str:
    lines = ["  bytes        median ms" + ("   fit ms   error" if model else "")]
    for n, t in sorted(zip(sizes, times)):
        row = f"  {_size(n):>10}  {t * 1e3:10.3f}"
        if model is not None:
            f = model.time(n)
            row += f"  {f * 1e3:8.3f}  {(f - t) / t:+6.1%}"
        lines.append(row)
    return "\n".join(lines)


def _size(n: float) -> str:
    for unit, k in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= k:
            return f"{n / k:.4g} {unit}"
    return f"{n:.0f} B"


def _fit_log(A: np.ndarray, t: np.ndarray, iters: int = 60) -> np.ndarray | None:
    """Coefficients θ of T = A·θ minimising Σ |log(A·θ) − log t| (Gauss-Newton on the log
    residuals, iteratively reweighted for the absolute value). Log errors are symmetric - a
    fit 2× too slow costs what one 2× too fast does - where relative errors bound one side at
    100 % and so pull a line towards zero latency; the absolute value lets a few noisy points
    (a small message that waited for a busy core) not drag the rest. None if T ≤ 0 somewhere."""
    theta, *_ = np.linalg.lstsq(A / t[:, None], np.ones_like(t), rcond=None)  # relative L2 start
    pred = A @ theta
    if np.any(pred <= 0):
        theta = np.zeros(A.shape[1])
        theta[0] = float(np.median(t))
        pred = A @ theta
    weights = np.ones_like(t)
    for _ in range(iters):
        r = np.log(pred) - np.log(t)
        weights = 1.0 / np.maximum(np.abs(r), 1e-3)
        J = A / pred[:, None]
        sw = np.sqrt(weights)
        step, *_ = np.linalg.lstsq(J * sw[:, None], -r * sw, rcond=None)
        cost = np.sum(np.abs(r))
        lam = 1.0
        while lam > 1e-4:
            cand = theta + lam * step
            pc = A @ cand
            if np.all(pc > 0) and np.sum(np.abs(np.log(pc) - np.log(t))) <= cost + 1e-12:
                theta, pred = cand, pc
                break
            lam /= 2
        else:
            break
    return theta if np.all(A @ theta > 0) else None


def _wls(n: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    """α, β minimising Σ |log(α + β n) − log t|."""
    theta = _fit_log(np.stack([np.ones_like(n), n], axis=1), t)
    if theta is None:
        return -1.0, -1.0
    return float(theta[0]), float(theta[1])


def _errors(model: CommModel, n: np.ndarray, t: np.ndarray) -> tuple[float, float, float]:
    rel = (model.time(n) - t) / t
    return (float(np.sqrt(np.mean(rel ** 2))), float(np.max(np.abs(rel))),
            float(np.mean(np.abs(rel))))


def fit_affine(sizes: Iterable[float], times: Iterable[float], world_size: int = 2) -> CommModel:
    """T(n) = α + β·n by relative least squares; α and β are kept ≥ 0."""
    n, t = _arrays(sizes, times)
    a, b = _wls(n, t)
    if b < 0:                      # times do not grow with size: a constant is the honest fit
        a, b = float(np.median(t)), 0.0
    if a < 0:                      # a line through the origin instead of a negative latency
        b = float(np.median(t / n))
        a = 0.0
    m = CommModel.affine(a, b, world_size)
    rms, mx, mean = _errors(m, n, t)
    return CommModel(m.segments, world_size, rms, mx, "affine", mean)


def fit_piecewise(sizes: Iterable[float], times: Iterable[float],
                  world_size: int = 2) -> CommModel:
    """Two lines meeting at a breakpoint searched among the measured sizes (continuous, each
    slope ≥ 0 and the second no steeper - concave, as a latency-bound protocol handing over to
    a bandwidth-bound one - the first intercept ≥ 0); the best by mean relative error."""
    n, t = _arrays(sizes, times)
    order = np.argsort(n)
    n, t = n[order], t[order]
    best = None
    for i in range(2, len(n) - 1):       # ≥ 2 points left of the break, ≥ 2 right
        for knot in (n[i - 1], 0.5 * (n[i - 1] + n[i]), n[i]):
            m = _fit_hinge(n, t, knot, world_size)
            if m is None:
                continue
            rms, mx, mean = _errors(m, n, t)
            if best is None or mean < best[0]:
                best = (mean, rms, mx, m)
    if best is None:
        return fit_affine(n, t, world_size)
    mean, rms, mx, m = best
    return CommModel(m.segments, world_size, rms, mx, "piecewise", mean)


def _fit_hinge(n, t, knot, world_size) -> CommModel | None:
    """T = a + b·n + c·max(0, n − knot), fitted in log space; None if a slope or the
    intercept comes out negative, or the second slope is steeper than the first (large
    messages slower per byte than small ones is not a protocol switch but a burst allowance or
    noise; a convex T would also make many tiny buckets look free)."""
    A = np.stack([np.ones_like(n), n, np.maximum(0.0, n - knot)], axis=1)
    theta = _fit_log(A, t)
    if theta is None:
        return None
    a, b, c = (float(x) for x in theta)
    if a < 0 or b < 0 or b + c < 0 or c > 0:
        return None
    # second segment: a + b n + c (n − knot) = (a − c knot) + (b + c) n
    return CommModel(((0.0, float(a), float(b)), (float(knot), float(a - c * knot), float(b + c))),
                     world_size, kind="piecewise")


def fit(sizes: Iterable[float], times: Iterable[float], world_size: int = 2,
        kind: str = "auto") -> CommModel:
    """``kind`` 'affine' | 'piecewise' | 'auto' (piecewise only when it cuts the mean relative
    error by at least a third and the line's is over 5 %)."""
    n, t = _arrays(sizes, times)
    line = fit_affine(n, t, world_size)
    if kind == "affine" or len(n) < 5:
        return line
    pw = fit_piecewise(n, t, world_size)
    if kind == "piecewise":
        return pw
    if line.mean_rel_err > 0.05 and pw.mean_rel_err < (2 / 3) * line.mean_rel_err:
        return pw
    return line


def _arrays(sizes, times) -> tuple[np.ndarray, np.ndarray]:
    n = np.asarray(list(sizes), dtype=np.float64)
    t = np.asarray(list(times), dtype=np.float64)
    if n.shape != t.shape or n.size < 2:
        raise SweepError(f"need at least 2 (bytes, seconds) points to fit an allreduce model, "
                         f"got {n.size}:\n{sweep_table(n, t) if n.shape == t.shape else ''}")
    if np.any(t <= 0) or np.any(n <= 0):
        raise SweepError("allreduce sizes and times must be positive:\n" + sweep_table(n, t))
    return n, t
