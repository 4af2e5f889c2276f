"""The cost of one rank's forward+backward, predicted from the lengths in its batch.

Owns: the cost model (``LengthCost``: a layout and its coefficients, in seconds), the features
each layout computes from a batch's lengths, the least-squares fit of the coefficients from
measured step times (``fit``), their JSON file (``save`` / ``load``), the default for a model
shape (``default_cost``: coefficients measured on this machine where ``length_costs.json``
has the shape, else a FLOP count from the model's formula in basis.model_shape), per-rank
costs of a batch (``LengthCost.of_rows``,
``of_lengths``, ``of_batch``) and the imbalance statistic (``imbalance``). Never: timing a
model (``python -m runtime.calibrate.length_cost`` measures and calls ``fit``), choosing batches
(balance.py uses these costs), torch or I/O beyond the coefficients file.

Why a model and not token counts: a rank's step time is not its token count. Attention grows
with the square of a sequence's length, every row has a fixed cost (pooler, NSP head, kernel
launches) and a padded model computes on rows × the longest row, its attention on rows × L².
Balancing by the wrong cost leaves the waits it exists to remove.

The layouts (how the model lays a batch out; runtime.model.arithmetic.attention_layout maps
the config and the attention kernel that runs to one - kernels.attention_rule, the same rule
the kernels follow - and hands it here as a string):

=============  =====================================================================
``padded``     every row padded to the batch's longest row L (``model.attention =
               'padded'``; packed rows too: attention is masked, not skipped)
``unpadded``   dense layers on the real tokens, attention per sequence (varlen kernels:
               ``per_sequence``, ``cuda_varlen``): Σ len²
``repad``      dense layers on the real tokens, attention padded to the longest
               *sequence* (the CPU default kernel ``repad``): n · Lseq²
=============  =====================================================================

Features (per rank and step; a row holds one sequence unless packed):

  real_tokens       Σ len                   embeddings, the MLM head (on ≈15 % of tokens)
  padded_tokens     rows · L                dense layers of a padded model
  padded_attention  rows · L²               attention of a padded model
  attention         Σ len²                  attention of the varlen kernels
  repad_tokens      n · Lseq                the repad kernel's scatter/gather
  repad_attention   n · Lseq²               the repad kernel's attention
  rows              rows (padded) or sequences (unpadded layouts)
  step              1                       the fixed cost of a forward+backward

t = Σ coefficient · feature over the layout's features (``FEATURES``). In ``unpadded`` the
cost is additive over sequences (``sample_weights``), which the deals of balance.py exploit;
the other layouts depend on the longest row and are evaluated whole.
"""
from __future__ import annotations

import datetime
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence, get_args

import numpy as np

from basis.model_shape import SHAPE_KEYS, forward_flops_per_unit

Layout = Literal["padded", "unpadded", "repad"]
LAYOUTS: tuple[str, ...] = get_args(Layout)

FEATURES: dict[str, tuple[str, ...]] = {
    "padded": ("real_tokens", "padded_tokens", "padded_attention", "rows", "step"),
    "unpadded": ("real_tokens", "attention", "rows", "step"),
    "repad": ("real_tokens", "repad_tokens", "repad_attention", "rows", "step"),
}

MASKED_FRACTION = 0.15
"""Share of real tokens the MLM head runs on, for the FLOP-count default."""

NOMINAL_FLOPS = 1e12
"""FLOP/s that turn the FLOP-count default into 'seconds': only ratios matter to balancing."""

DEFAULTS_FILE = Path(__file__).with_name("length_costs.json")
"""Coefficients measured with ``python -m runtime.calibrate.length_cost``, one entry per shape × layout."""


# ------------------------------------------------------------------------------ features

def row_features(layout: str, rows: Sequence[Sequence[int]]) -> np.ndarray:
    """float64 [F]: the features of ``layout`` for one rank batch given as rows, each a list
    of its sequences' lengths (one per row unless packed)."""
    seqs = np.fromiter((n for row in rows for n in row), dtype=np.float64)
    if not len(seqs):
        return np.zeros(len(FEATURES[layout]))
    widths = np.fromiter((sum(row) for row in rows), dtype=np.float64)
    width, longest = widths.max(), seqs.max()
    every = {"real_tokens": seqs.sum(), "padded_tokens": len(rows) * width,
             "padded_attention": len(rows) * width ** 2, "attention": (seqs ** 2).sum(),
             "repad_tokens": len(seqs) * longest, "repad_attention": len(seqs) * longest ** 2,
             "rows": float(len(rows) if layout == "padded" else len(seqs)), "step": 1.0}
    return np.array([every[f] for f in FEATURES[layout]])


def length_features(layout: str, lengths: np.ndarray) -> np.ndarray:
    """float64 [..., b, F] → [..., F]: features of unpacked batches ``lengths`` [..., b]
    (one sequence per row; a length of 0 is an absent sequence), vectorized."""
    x = np.asarray(lengths, dtype=np.float64)
    n = (x > 0).sum(-1)
    longest = x.max(-1)
    every = {"real_tokens": x.sum(-1), "padded_tokens": n * longest,
             "padded_attention": n * longest ** 2, "attention": (x ** 2).sum(-1),
             "repad_tokens": n * longest, "repad_attention": n * longest ** 2,
             "rows": n.astype(np.float64), "step": np.ones(x.shape[:-1])}
    return np.stack([every[f] for f in FEATURES[layout]], -1)


# ---------------------------------------------------------------------------- the model

@dataclass(frozen=True)
class LengthCost:
    """t = Σ coefficient · feature (seconds) for one model shape and layout."""

    layout: str
    coefficients: tuple[tuple[str, float], ...]  # (feature, seconds per unit), FEATURES order
    shape: tuple[tuple[str, int], ...] = ()      # the model shape it describes; () = any
    source: str = ""                             # where the numbers come from
    fit_error: tuple[tuple[str, float], ...] = ()  # from ``fit``: rel. errors, r2, points
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"length cost layout={self.layout!r}: choose one of "
                             f"{' | '.join(LAYOUTS)}")
        names = tuple(name for name, _ in self.coefficients)
        if names != FEATURES[self.layout]:
            raise ValueError(f"length cost of layout {self.layout!r} needs coefficients "
                             f"{list(FEATURES[self.layout])} in that order, got {list(names)}")
        bad = [name for name, value in self.coefficients if not value >= 0]
        if bad:
            raise ValueError(f"length cost coefficients {bad} are negative or NaN: a cost "
                             "cannot fall as a batch grows; refit with more varied batches")

    @classmethod
    def of(cls, layout: str, shape: dict | None = None, source: str = "", **coefficients):
        """From keyword coefficients; missing features are 0."""
        unknown = set(coefficients) - set(FEATURES[layout])
        if unknown:
            raise ValueError(f"length cost: {sorted(unknown)} are not features of layout "
                             f"{layout!r} ({list(FEATURES[layout])})")
        return cls(layout, tuple((f, float(coefficients.get(f, 0.0)))
                                 for f in FEATURES[layout]),
                   tuple(sorted((shape or {}).items())), source)

    @property
    def vector(self) -> np.ndarray:
        return np.array([value for _, value in self.coefficients])

    def coefficient(self, name: str) -> float:
        return dict(self.coefficients).get(name, 0.0)

    @property
    def additive(self) -> bool:
        """True when a batch's cost is the sum of per-sequence weights (plus the step)."""
        return self.layout == "unpadded"

    def sample_weights(self, lengths: np.ndarray) -> np.ndarray:
        """Per sequence: its share of an ``unpadded`` batch's cost (the step term aside).
        For the other layouts: the cost the sequence would have alone in an unpadded model
        with the same per-token and per-row coefficients (a proxy for the deals)."""
        x = np.asarray(lengths, dtype=np.float64)
        c = dict(self.coefficients)
        square = c.get("attention", 0.0) + c.get("padded_attention", 0.0) \
            + c.get("repad_attention", 0.0)
        linear = c.get("real_tokens", 0.0) + c.get("padded_tokens", 0.0) \
            + c.get("repad_tokens", 0.0)
        return linear * x + square * x ** 2 + c.get("rows", 0.0)

    def of_lengths(self, lengths: np.ndarray) -> np.ndarray:
        """Cost of unpacked batches ``lengths`` [..., b] (0 = no sequence) → [...]."""
        return length_features(self.layout, lengths) @ self.vector

    def of_rows(self, rows: Sequence[Sequence[int]]) -> float:
        """Cost of one rank batch given as rows of sequence lengths (packed or not)."""
        return float(row_features(self.layout, rows) @ self.vector)

    def of_batch(self, batch) -> float:
        """Cost of a ``loaders.collate.Batch`` (its ``sequence_lengths``, or the lengths
        read from its attention mask when a pipeline did not record them)."""
        rows = getattr(batch, "sequence_lengths", None)
        if rows is None:
            mask = np.asarray(batch.attention_mask.cpu())
            rows = [np.bincount(row[row > 0])[1:].tolist() for row in mask]
        return self.of_rows(rows)

    def per_rank(self, rank_rows: Sequence[Sequence[Sequence[int]]]) -> np.ndarray:
        """float64 [P]: the cost of each rank's batch (each given as rows)."""
        return np.array([self.of_rows(rows) for rows in rank_rows])

    def digest(self) -> str:
        """Identifies the coefficients: a saved data position needs the same deal."""
        text = json.dumps([self.layout, [[n, float(v)] for n, v in self.coefficients]])
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def describe(self) -> str:
        terms = " + ".join(f"{value:.3g}·{name}" for name, value in self.coefficients if value)
        return f"{self.layout}: t = {terms or '0'} s ({self.source or 'no source'})"

    # -- file ------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"layout": self.layout, "coefficients": dict(self.coefficients),
                "shape": dict(self.shape), "source": self.source,
                "fit_error": dict(self.fit_error), **self.extra}

    @classmethod
    def from_json(cls, data: dict, where: str = "length cost") -> "LengthCost":
        try:
            layout = data["layout"]
            coefficients = data["coefficients"]
            cost = cls(layout, tuple((f, float(coefficients[f])) for f in FEATURES[layout]),
                       tuple(sorted((k, int(v)) for k, v in data.get("shape", {}).items())),
                       str(data.get("source", "")),
                       tuple(sorted((k, float(v)) for k, v in data.get("fit_error", {}).items())))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: not a length-cost file ({e!r}); write one with "
                             "`python -m runtime.calibrate.length_cost --out FILE`") from None
        known = {"layout", "coefficients", "shape", "source", "fit_error"}
        return cls(cost.layout, cost.coefficients, cost.shape, cost.source, cost.fit_error,
                   {k: v for k, v in data.items() if k not in known})

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def load(path) -> LengthCost:
    """A coefficients file written by ``python -m runtime.calibrate.length_cost``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"data.length_cost={str(path)!r}: no such file; measure one with "
                                f"`python -m runtime.calibrate.length_cost --out {path}` or set '' for "
                                "the default of the model shape") from None
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    return LengthCost.from_json(data, str(path))


def tokens_cost() -> LengthCost:
    """Real tokens only (1 per token): the neutral cost when no model is known."""
    return LengthCost.of("unpadded", source="real tokens (no model given)", real_tokens=1.0)


# ------------------------------------------------------------------------------ defaults

def flops_cost(shape: dict, layout: str) -> LengthCost:
    """Forward+backward FLOPs (3 × forward, ``forward_flops_per_unit``) per feature, at
    ``NOMINAL_FLOPS``: the dense layers per token the layout computes on, the attention per
    score, the MLM head on ``MASKED_FRACTION`` of the real tokens; no per-row or per-step
    cost, and the per-sequence pooler and NSP head left out (under 2 % of a one-token
    sequence's work, about 0.01 % of a 128-token one). Ratios, not seconds: a default for shapes
    nobody measured. tests/unit/test_length_cost.py holds it to runtime.model.arithmetic."""
    per = forward_flops_per_unit(shape)
    dense = 3 * per["token"] / NOMINAL_FLOPS
    attention = 3 * per["score"] / NOMINAL_FLOPS
    head = 3 * MASKED_FRACTION * per["masked"] / NOMINAL_FLOPS
    source = "FLOP count (relative: 1 TFLOP/s nominal)"
    if layout == "padded":
        return LengthCost.of(layout, shape, source, real_tokens=head, padded_tokens=dense,
                             padded_attention=attention)
    if layout == "unpadded":
        return LengthCost.of(layout, shape, source, real_tokens=head + dense,
                             attention=attention)
    return LengthCost.of(layout, shape, source, real_tokens=head + dense,
                         repad_attention=attention)


def measured_defaults(path=DEFAULTS_FILE) -> list[LengthCost]:
    if not Path(path).is_file():
        return []
    entries = json.loads(Path(path).read_text())
    return [LengthCost.from_json(e, f"{path} entry {i}") for i, e in enumerate(entries)]


def default_cost(shape: dict, layout: str) -> LengthCost:
    """The coefficients measured on this machine for exactly this shape and layout
    (``length_costs.json``), else the FLOP-count model."""
    want = tuple(sorted((k, int(shape[k])) for k in SHAPE_KEYS))
    for cost in measured_defaults():
        if cost.layout == layout and cost.shape == want:
            return cost
    return flops_cost(dict(want), layout)


def resolve(path: str, shape: dict, layout: str) -> LengthCost:
    """What ``data.length_cost`` names: a coefficients file, or '' for ``default_cost``.
    A file measured for another layout or shape is an error."""
    if not path:
        return default_cost(shape, layout)
    cost = load(path)
    want = tuple(sorted((k, int(shape[k])) for k in SHAPE_KEYS))
    if cost.layout != layout:
        raise ValueError(f"data.length_cost={path!r} was measured for layout {cost.layout!r} "
                         f"but this model computes as {layout!r}: measure it with "
                         f"`python -m runtime.calibrate.length_cost --layout {layout}`")
    if cost.shape and cost.shape != want:
        raise ValueError(f"data.length_cost={path!r} was measured for model shape "
                         f"{dict(cost.shape)}, this model is {dict(want)}: measure it again")
    return cost


# ----------------------------------------------------------------------------------- fit

def fit(layout: str, batches: Sequence[Sequence[Sequence[int]]], seconds: Sequence[float],
        shape: dict | None = None, source: str = "") -> LengthCost:
    """Least-squares coefficients of ``layout`` from measured ``seconds`` of ``batches``
    (each a list of rows of sequence lengths). Minimises the *relative* error (each equation
    divided by its time: short and long steps count alike) with non-negative coefficients
    (a coefficient that comes out negative is fixed at 0 and the rest refitted). The result
    carries its fit error: mean/max relative error and R² on these points."""
    x = np.stack([row_features(layout, rows) for rows in batches])
    t = np.asarray(seconds, dtype=np.float64)
    if len(t) != len(x):
        raise ValueError(f"fit: {len(x)} batches but {len(t)} times")
    if len(t) < x.shape[1]:
        raise ValueError(f"fit: {len(t)} measurements cannot determine the {x.shape[1]} "
                         f"coefficients of layout {layout!r}; measure more batch shapes")
    if (t <= 0).any():
        raise ValueError("fit: every measured time must be > 0")
    coef = _nonnegative_lstsq(x / t[:, None], np.ones_like(t))
    cost = LengthCost(layout, tuple(zip(FEATURES[layout], coef.tolist())),
                      tuple(sorted((shape or {}).items())), source)
    return _with_error(cost, x, t)


def fit_error(cost: LengthCost, batches, seconds) -> dict:
    """Relative errors of ``cost`` on other measurements (a held-out check)."""
    x = np.stack([row_features(cost.layout, rows) for rows in batches])
    return dict(_with_error(cost, x, np.asarray(seconds, dtype=np.float64)).fit_error)


def _with_error(cost: LengthCost, x: np.ndarray, t: np.ndarray) -> LengthCost:
    pred = x @ cost.vector
    rel = np.abs(pred - t) / t
    r2 = 1.0 - ((pred - t) ** 2).sum() / max(((t - t.mean()) ** 2).sum(), 1e-300)
    err = {"mean_rel_error": float(rel.mean()), "max_rel_error": float(rel.max()),
           "r2": float(r2), "points": float(len(t))}
    return LengthCost(cost.layout, cost.coefficients, cost.shape, cost.source,
                      tuple(sorted(err.items())), cost.extra)


def _nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min ‖a·c − y‖ with c ≥ 0: drop the most negative coefficient and refit until none is
    negative (an active-set method; exact when at most a few coefficients hit 0)."""
    active = list(range(a.shape[1]))
    scale = np.abs(a).max(0)
    scale[scale == 0] = 1.0
    while True:
        c = np.zeros(a.shape[1])
        if active:
            c[active] = np.linalg.lstsq(a[:, active] / scale[active], y, rcond=None)[0] \
                / scale[active]
        if (c >= 0).all():
            return c
        active.remove(int(np.argmin(c)))


# ----------------------------------------------------------------------------- statistics

def imbalance(costs: np.ndarray) -> float:
    """Mean over steps of max / mean over ranks; ``costs`` [ranks] or [ranks, steps]."""
    c = np.asarray(costs, dtype=np.float64)
    if c.ndim == 1:
        c = c[:, None]
    mean = c.mean(0)
    return float(np.mean(np.where(mean > 0, c.max(0) / np.where(mean > 0, mean, 1), 1.0)))


def now_stamp() -> str:
    return datetime.datetime.now().isoformat(timespec="seconds")
