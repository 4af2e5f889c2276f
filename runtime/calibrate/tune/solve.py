"""The exact bucket partition: dynamic programming over cut points of the production-ordered
flat gradient buffer, and the reference plans users compare it with.

Owns: `solve` (the minimum-sync-end partition under ``runtime.calibrate.tune.simulate``'s recurrence,
optionally with exactly K buckets), `candidate_cuts` (where a cut may fall, and the bound on
what a coarser grid can lose), `reference_plans` (no bucketing, DDP's 25 MiB, Horovod's
64 MiB, Megatron's max(40M, 1M·P) parameters, the best single size) and `brute_force` (every
subset of cuts; for tests and tiny models).
Never: measures, reads configs or writes files.

Why dynamic programming is exact (Lemma 1). A plan is a set of cut positions
0 < x_1 < … < x_K = N in the buffer. Bucket k's communication ends at
end_k = max(R(x_k), end_{k−1}) + T(x_k − x_{k−1}) (plus the decoder share where its issue
slot falls, see ``Instance.advance``), and the step's sync end is a non-decreasing function of
end_K. Every step of the recurrence is non-decreasing in end_{k−1}, so of all plans whose last
cut is x, one that ends earliest at x is as good as any for what follows:
D(x) = min_{y < x} advance(D(y), y, x), D(0) = −∞, is the optimum over every plan whose cuts
lie in the candidate set. With a bucket count fixed (bucket_before: the clip threshold τ/√K
depends on K) the state is (x, k) and the same argument holds. O(M²) (O(K·M²)) for M
candidates, vectorised over y.

Which cut positions can be optimal (Theorem 2). Let T(n) = α + β·n with α, β ≥ 0, γ = 0
(no launch work on the compute thread) and κ = 1 (communication not slowed by compute). Take an optimal plan with a cut c strictly inside
parameter j (ready time r_j), previous cut y, next cut x' with R(x') = r'. Every position of
j is final at r_j, so bucket [y, c) issues at r_j for any c in (start_j, end_j]; the next
bucket's end is
    f(c) = max(r', A + T(c − y)) + T(x' − c),  A = max(r_j, end(y)).
While A + T(c − y) ≤ r', f(c) = r' + α + β(x' − c) falls with c; after that
f(c) = A + 2α + β(x' − y) is constant. So f is non-increasing on the whole interval and
c = end_j (the parameter's boundary) is as good: some optimal plan cuts only at parameter
boundaries, and no parameter needs splitting. For that case the candidate set {boundaries}
is exact (tests check it against brute force over every element position).

What the grid adds, and what it can lose (Proposition 3). With a piecewise T (slopes
β_min..β_max per byte), launch work γ > 0 (a cut inside j launches its first piece γ·(end_j − c)
earlier), communication slowed during backward (κ > 1), or a fixed K, an interior cut can
help. Candidates then also include a grid of
every ``grid`` elements inside each parameter. Rounding an interior cut c up to the next grid
point or boundary (δ ≤ grid elements) raises f by at most δ·(γ + (β_max − β_min)·b) (b bytes
per element: region 1 of f only falls; region 2 has slope γ + b·(T'(c−y) − T'(x'−c))), and
every later end_k is 1-Lipschitz in it (with κ > 1 the slopes scale by at most κ, which the
bound includes). Hence the grid optimum is within
(K−1)·grid·(γ + (β_max − β_min)·b) of the optimum over all element positions; `solve`
reports that bound (``Solution.grid_bound_s``). With grid = 1 the DP is exact outright.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import combinations
from typing import Optional

import numpy as np

from runtime.choices import clip_spec
from runtime.grad_sync.plan import MB, BucketPlan, tied_sync_mode
from runtime.calibrate.tune.simulate import Instance

DDP_MB = 25.0          # torch DDP bucket_cap_mb default
HOROVOD_MB = 64.0      # HOROVOD_FUSION_THRESHOLD default (64 MiB)
MEGATRON_MIN_PARAMS = 40_000_000   # Megatron-LM: bucket_size = max(40M, 1M · dp) parameters
MAX_CANDIDATES = 3000


@dataclass
class Solution:
    cuts: list[int]
    sync_end_s: float
    candidates: int
    grid: Optional[int]
    grid_bound_s: float
    num_buckets_fixed: Optional[int] = None

    @property
    def num_buckets(self) -> int:
        return len(self.cuts)


def candidate_cuts(inst: Instance, grid: Optional[int] = None,
                   max_candidates: int = MAX_CANDIDATES) -> tuple[list[int], Optional[int]]:
    """Parameter boundaries, forced cuts, and every ``grid`` elements inside each parameter
    (not in padding, not in the split tied embedding). ``grid`` None: chosen so that about
    ``max_candidates`` positions result; 0: boundaries only."""
    cuts = {int(e) for e in inst.end}
    cuts.update(inst.forced_cuts())
    if grid is None:
        free = int(inst.numel.sum()) - (int(inst.numel[inst.alone]) if inst.alone is not None else 0)
        room = max(1, max_candidates - len(cuts))
        grid = max(1, -(-free // room))
    if grid:
        for j in range(len(inst.names)):
            if inst.alone is not None and j == inst.alone:
                continue
            s, n = int(inst.start[j]), int(inst.numel[j])
            cuts.update(range(s + grid, s + n, grid))
    return sorted(c for c in cuts if inst.valid_cut(c)), (grid or None)


def grid_bound(inst: Instance, grid: Optional[int], buckets: int) -> float:
    if not grid or grid <= 1:
        return 0.0
    betas = inst.comm.betas()
    k = inst.profile.comm_slowdown
    slope = inst.gamma + k * max(betas) * inst.spec.reduce_bytes if k != 1.0 else \
        inst.gamma + (max(betas) - min(betas)) * inst.spec.reduce_bytes
    return max(0, buckets - 1) * grid * slope


def _transition(inst: Instance, D: np.ndarray, Y: np.ndarray, x: int) -> np.ndarray:
    """advance(D[y], y, x) for every y in Y (vectorised ``Instance.advance``); inf where the
    bucket [y, x) is not allowed (it would cut through the split embedding's own bucket)."""
    e = D.copy()
    if inst.dec_pos is not None:
        m = (Y <= inst.dec_pos) & (inst.dec_pos < x)
        if m.any():
            e[m] = inst.run(np.maximum(inst.dec_issue_base + inst.gamma * Y[m], e[m]),
                            float(inst.comm.time(inst.dec_bytes)))
    comm = inst.comm.time((x - Y) * inst.spec.reduce_bytes)
    start = np.maximum(inst.issue_time(x), e)
    val = inst.run(start, comm)
    if inst.alone is not None:
        a0, a1 = int(inst.start[inst.alone]), int(inst.end[inst.alone])
        bad = (Y < a0) & (x > a0) | (Y < a1) & (x > a1)
        if x == a1:
            bad = Y != a0
            val = np.where(Y == a0, inst.run(start, float(inst.comm.time(inst.mask_bytes))), val)
        val = np.where(bad, np.inf, val)
    return np.asarray(val, dtype=np.float64)


def solve(inst: Instance, grid: Optional[int] = None, num_buckets: Optional[int] = None,
          max_candidates: int = MAX_CANDIDATES) -> Solution:
    """The cut positions minimising the sync end (Lemma 1), over `candidate_cuts`. With
    ``num_buckets`` exactly that many buckets (raises ValueError when impossible)."""
    if grid is None and num_buckets is None and len(inst.comm.segments) == 1 \
            and inst.gamma == 0.0 and inst.profile.comm_slowdown == 1.0:
        grid = 0   # Theorem 2: boundaries are exact
    cands, g = candidate_cuts(inst, grid, max_candidates)
    pos = np.array([0] + cands, dtype=np.int64)
    M = len(pos)
    if num_buckets is None:
        D = np.full(M, np.inf)
        D[0] = -np.inf
        back = np.zeros(M, dtype=np.int64)
        for i in range(1, M):
            vals = _transition(inst, D[:i], pos[:i], int(pos[i]))
            j = int(np.argmin(vals))
            D[i], back[i] = vals[j], j
        cuts, i = [], M - 1
        while i > 0:
            cuts.append(int(pos[i]))
            i = int(back[i])
        cuts.reverse()
        end = inst.finish(float(D[M - 1]))
        return Solution(cuts, end, M - 1, g, grid_bound(inst, g, len(cuts)))
    K = int(num_buckets)
    if K < 1 or K > M - 1:
        raise ValueError(f"cannot make {K} buckets from {M - 1} candidate cut positions")
    D = np.full((K + 1, M), np.inf)
    D[0, 0] = -np.inf
    back = np.zeros((K + 1, M), dtype=np.int64)
    for k in range(1, K + 1):
        for i in range(k, M):
            prev = D[k - 1, :i]
            if not np.isfinite(prev).any() and k > 1:
                continue
            vals = _transition(inst, prev, pos[:i], int(pos[i]))
            vals = np.where(np.isposinf(prev), np.inf, vals)
            j = int(np.argmin(vals))
            D[k, i], back[k, i] = vals[j], j
    if not np.isfinite(D[K, M - 1]):
        raise ValueError(f"no plan with exactly {K} buckets respects the forced cuts")
    cuts, i = [], M - 1
    for k in range(K, 0, -1):
        cuts.append(int(pos[i]))
        i = int(back[k, i])
    cuts.reverse()
    end = inst.finish(float(D[K, M - 1]))
    return Solution(cuts, end, M - 1, g, grid_bound(inst, g, K), K)


def brute_force(inst: Instance, positions: Optional[list[int]] = None,
                num_buckets: Optional[int] = None) -> tuple[list[int], float]:
    """Every subset of cut positions (default: every valid element position): the best plan
    and its sync end. Exponential - for tests on tiny instances only. Independent of the
    DP's argument: every plan is evaluated to its end (``Instance.advance`` folded over its
    cuts, prefixes shared - the same numbers as ``chain_end``), nothing is pruned for being
    dominated, only for breaking a rule (a forced cut skipped, the bucket count exceeded).
    Returns ([], inf) only when no plan satisfies the rules."""
    total = inst.total
    inner = sorted({c for c in (positions or range(1, total)) if 0 < c < total
                    and inst.valid_cut(c)})
    # forced cuts inside the buffer (the split embedding's bounds; one at 0 when it comes
    # first in production order is the buffer's start, not a cut)
    forced = sorted({c for c in inst.forced_cuts() if 0 < c < total})
    best: list = [[], math.inf]

    def visit(i: int, y: int, e: float, cuts: list[int]) -> None:
        # close the plan here: the last bucket [y, total)
        if (num_buckets is None or len(cuts) + 1 == num_buckets) \
                and not any(y < f for f in forced) \
                and (inst.alone is None or _alone_ok(inst, cuts + [total])):
            end = inst.finish(inst.advance(e, y, total))
            if end < best[1] - 1e-15:
                best[0], best[1] = cuts + [total], end
        if num_buckets is not None and len(cuts) + 2 > num_buckets:
            return
        for j in range(i, len(inner)):
            x = inner[j]
            if any(y < f < x for f in forced):  # every later x skips that forced cut too
                break
            visit(j + 1, x, inst.advance(e, y, x), cuts + [x])

    visit(0, 0, -math.inf, [])
    return best[0], best[1]


def _alone_ok(inst: Instance, cuts: list[int]) -> bool:
    a0, a1 = int(inst.start[inst.alone]), int(inst.end[inst.alone])
    return a0 in cuts + [0] and a1 in cuts and not any(a0 < c < a1 for c in cuts)


# ---------------------------------------------------------------------------------------------
# the plans users compare with


@dataclass
class Candidate:
    """A plan in the comparison table and the engine settings it runs with."""

    name: str
    plan: BucketPlan
    tied_sync: str
    note: str = ""
    cap_bytes: Optional[float] = None
    extra: dict = field(default_factory=dict)


def cap_plan(inst: Instance, cap_bytes: float, source: str, alone: Optional[str]) -> BucketPlan:
    """The engine's size-cap plan (``BucketPlan.from_cap``) in production order; the cap
    counts gradient bytes, as train.bucket_cap_mb does."""
    p = inst.profile
    cap = max(1, int(cap_bytes) // p.element_bytes)
    return BucketPlan.from_cap([(g.name, g.numel) for g in p.grads], cap, source, alone=alone)


def single_size_grid(total_bytes: int) -> list[float]:
    """Caps from 64 KiB to the whole gradient, ×√2 apart, plus the whole gradient."""
    caps, c = [], 64 * 1024.0
    while c < total_bytes:
        caps.append(c)
        c *= math.sqrt(2)
    caps.append(float(total_bytes))
    return caps


@dataclass
class Row:
    """One line of the comparison table: a plan, how the engine runs it, its prediction."""

    candidate: Candidate
    timeline: "object"   # runtime.calibrate.tune.simulate.Timeline

    @property
    def name(self) -> str:
        return self.candidate.name


def compare(profile, comm, spec_base, tied_asked: str = "auto",
            config_plan: Optional[BucketPlan] = None, config_name: str = "this config",
            num_buckets: Optional[int] = None, grid: Optional[int] = None,
            max_candidates: int = MAX_CANDIDATES, try_other_tied: bool = False,
            split_pays: bool = True) -> list[Row]:
    """The table: no bucketing, this config's plan, DDP 25 MiB, Horovod 64 MiB, Megatron
    max(40M, 1M·P) parameters, the best single size, and the tuned plan (with ``num_buckets``
    fixed when given) for the tied sync the engine resolves from ``tied_asked`` (and
    ``split_pays``: runtime.grad_sync.split_pays on the measured device); with
    ``try_other_tied`` (and 'auto') a row for the other tied mode too."""
    from dataclasses import replace
    from runtime.calibrate.tune.simulate import Instance, simulate

    mode = tied_sync_mode(tied_asked, spec_base.clip_mode, spec_base.world_size, split_pays)
    if profile.tied is None:
        mode = "dense"
    modes = {"dense", mode}
    if try_other_tied and tied_asked == "auto" and not clip_spec(spec_base.clip_mode).before_allreduce \
            and spec_base.world_size > 1 and profile.tied is not None:
        modes.add("split")
    specs = {m: replace(spec_base, tied_sync=m) for m in modes}
    insts = {m: Instance.build(profile, s, comm) for m, s in specs.items()}
    inst = insts[mode]
    alone = profile.tied if mode == "split" else None
    elem = profile.element_bytes
    total_bytes = profile.total_elements() * elem
    rows: list[Row] = []

    def add(name, plan, tied_mode, note="", cap=None, **extra):
        tl = simulate(insts[tied_mode], plan, name)
        rows.append(Row(Candidate(name, plan, tied_mode, note, cap, extra), tl))

    order = [(g.name, g.numel) for g in profile.grads]
    one = BucketPlan.from_cap(order, 1 << 62, "no bucketing", alone=alone if tied_asked == "split" else None)
    add("no bucketing", one, "split" if tied_asked == "split" else "dense",
        "one allreduce after backward" + (" (+ the embedding's own)" if tied_asked == "split" else ""))
    if config_plan is not None:
        cfg_mode = mode
        if mode == "split" and not _alone(config_plan, profile):
            cfg_mode = "dense" if tied_asked == "auto" else mode
        add(config_name, config_plan, cfg_mode, "the config's buckets now")
    P = spec_base.world_size
    megatron = max(MEGATRON_MIN_PARAMS, 1_000_000 * P) * elem
    for name, cap, note in (("DDP 25 MiB", DDP_MB * MB, "torch DDP bucket_cap_mb default"),
                            ("Horovod 64 MiB", HOROVOD_MB * MB, "fusion threshold default"),
                            (f"Megatron {megatron / elem / 1e6:.0f}M params", megatron,
                             "max(40M, 1M·P) parameters")):
        add(name, cap_plan(inst, cap, name, alone), mode, note, cap)
    best = None
    for cap in single_size_grid(total_bytes):
        plan = cap_plan(inst, cap, "single size", alone)
        tl = simulate(inst, plan)
        if best is None or tl.step_s < best[1].step_s - 1e-12:
            best = (cap, tl, plan)
    cap, _, plan = best
    add(f"best single size {cap / MB:.3g} MiB", plan, mode,
        f"best of {len(single_size_grid(total_bytes))} caps, 64 KiB..whole", cap)
    def tuned_row(m, name):
        sol = solve(insts[m], grid=grid, num_buckets=num_buckets, max_candidates=max_candidates)
        plan = insts[m].plan_from_cuts(sol.cuts, "tuned")
        note = (f"exact DP over {sol.candidates} cut positions"
                + (f" (grid {sol.grid} elements, bound {sol.grid_bound_s * 1e6:.1f} µs)"
                   if sol.grid else " (parameter boundaries: exact by Theorem 2)")
                + (f", K fixed = {num_buckets}" if num_buckets else "")
                + (f"; tied {m}" if profile.tied else ""))
        add(name, plan, m, note, None, solution=sol)

    # the tied sync the engine resolves from the config; the other one only as an extra row:
    # split measured faster than dense everywhere here (docs/GRADIENT_SYNC.md), and a model
    # margin of a few percent is not evidence enough to switch the engine's mode
    tuned_row(mode, "tuned")
    other = "dense" if mode == "split" else "split"
    if try_other_tied and profile.tied is not None and other in insts:
        tuned_row(other, f"tuned, tied {other}")
    return rows


def _alone(plan: BucketPlan, profile) -> bool:
    from runtime.grad_sync.plan import PlanError, alone_bucket
    try:
        alone_bucket(plan, profile.tied, profile.sizes()[profile.tied])
    except PlanError:
        return False
    return True
