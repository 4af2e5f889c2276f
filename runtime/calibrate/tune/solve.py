"""The exact bucket partition: dynamic programming over cut points of the production-ordered
flat gradient buffer, and the reference plans users compare it with.

Owns: `solve` (the minimum-sync-end partition under ``runtime.calibrate.tune.simulate``'s recurrence,
optionally with exactly K buckets, and how exact it is), `candidate_cuts` (where a cut may
fall), `lower_bound` (the certified bound on what a coarser grid can lose), `reference_plans` (no bucketing, DDP's 25 MiB, Horovod's
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

What the grid adds, and what it can lose (Proposition 3). With a piecewise T, launch work
γ > 0 (a cut inside j launches its first piece γ·(end_j − c) earlier), communication slowed
during backward (κ > 1), or a fixed K, an interior cut can help: the candidates then add a
grid of every ``grid`` elements inside each parameter (about 3,000 positions in all). What
that can lose is not bounded a priori by the grid plan's own bucket count: rounding the
optimum's cuts to the grid costs up to a grid step's worth per cut of *the optimum*, whose
count is unknown and can exceed the grid plan's (a one-bucket grid plan, typical of
local_before, against an optimum with a second bucket ending inside a parameter). `solve`
therefore certifies the loss by a lower bound L on the optimum over every element position,
computed by the same DP over *cells* - each candidate position, and the open gap between
two consecutive ones - and reports sync_end(grid plan) − L ≥ the true loss.
The lower bound is tight because of two changes of variables. θ(t) = t/κ while backward
computes and 1 per second after it is the communication's own clock: Instance.run(s, w) =
θ⁻¹(θ(s) + w), so in θ the recurrence is end_k = max(R(x_k), end_{k−1}) + T exactly. With
λ = the smallest slope of T per element and τ(n) = T(n) − λ·n, θ̃_k = θ(end_k) − λ·x_k obeys
    θ̃_k = max(θ(R(x_k)) − λ·x_{k−1}, θ̃_{k−1}) + τ(x_k − x_{k−1})
exactly (the decoder's share enters the same way: max(θ(D(x_{k−1})) − λ·x_{k−1}, θ̃) + T).
Every term is monotone in the positions, so with x_k anywhere in cell X and x_{k−1} in cell
Y, θ(R(lo_X)) − λ·hi_Y and min_{n ≥ max(1, lo_X − hi_Y)} τ(n) bound it from below, and the
DP over cells (also over two cuts in one open cell, for a fixed K) bounds every plan. The
bytes telescope into λ·x_K, so only τ is charged per bucket: for an affine T (τ = α) and a
free bucket count, placing every cut at its cell's first position gives a plan within
κ·λ·(widest cell) of L - the bound overstates the loss by at most that, however many buckets
the optimum has. (Tests: never below the
loss against brute force on coarse grids, one-bucket grid plans and fixed K included, and
within κ·λ·w of it for affine T.) With grid = 1 the DP is exact outright.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from runtime.grad_sync.plan import MB, BucketPlan, resolve_tied_sync
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
    """elements between interior candidate cuts (None: parameter boundaries only)"""
    bound_s: float
    """a true bound on what the plan loses against the best plan over every element position
    (0 when exact; inf when none could be computed)"""
    exact: str = ""
    """why the candidates are exact ("" when they are not: then ``bound_s`` holds)"""
    lower_bound_s: Optional[float] = None
    """the certified lower bound on the best sync end over every element position (Prop. 3)"""
    num_buckets_fixed: Optional[int] = None

    @property
    def num_buckets(self) -> int:
        return len(self.cuts)

    def describe(self) -> str:
        """How exact the plan is, for the table's note."""
        head = f"exact DP over {self.candidates} cut positions"
        if self.exact:
            return f"{head} ({self.exact})"
        where = f"grid {self.grid} elements" if self.grid else "parameter boundaries"
        if not math.isfinite(self.bound_s):
            return f"{head} ({where}; no bound computed)"
        if self.bound_s == 0.0:
            return f"{head} ({where}; certified optimal over every element position)"
        return (f"{head} ({where}; within {_seconds(self.bound_s)} of every element position: "
                f"a certified bound)")


def _seconds(t: float) -> str:
    return (f"{t:.2f} s" if t >= 1 else f"{t * 1e3:.2f} ms" if t >= 1e-3
            else f"{t * 1e6:.1f} µs")


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


# ---------------------------------------------------------------------------------------------
# the certified bound (Proposition 3): a lower bound on the optimum over every element position


@dataclass
class _Cells:
    """Where the cuts of any plan can fall, as seen from a candidate set: a point cell at each
    candidate position (the start 0 included) and an open cell for the valid positions
    strictly between two consecutive candidates; ordered along the buffer."""

    lo: np.ndarray
    hi: np.ndarray
    open: np.ndarray

    @classmethod
    def of(cls, inst: Instance, cands: list[int]) -> "_Cells":
        lo, hi, op = [0], [0], [False]
        prev = 0
        for b in cands:
            j = inst.param_of(b)   # every boundary is a candidate: (prev, b) is inside j
            a, z = prev + 1, min(b - 1, int(inst.start[j] + inst.numel[j]) - 1)
            if a <= z and (inst.alone is None or j != inst.alone):
                lo.append(a), hi.append(z), op.append(True)
            lo.append(b), hi.append(b), op.append(False)
            prev = b
        return cls(np.array(lo, dtype=np.int64), np.array(hi, dtype=np.int64),
                   np.array(op, dtype=bool))


class _Relaxed:
    """The recurrence in the coordinates where a lower bound over cells is tight.

    θ(t): the communication's own clock (t/κ during backward, then 1 per second), so that
    ``Instance.run(s, w)`` = θ⁻¹(θ(s) + w): with it end_k = max(R(x_k), end_{k−1}) + T
    holds exactly in θ. λ: the smallest slope of T per element; τ(n) = T(n bytes) − λ·n.
    Then θ̃_k = θ(end_k) − λ·x_k obeys
        θ̃_k = max(θ(R(x_k)) − λ·x_{k−1}, θ̃_{k−1}) + τ(x_k − x_{k−1})
    exactly: the bytes of a chain telescope into λ·x_K and only τ, which does not grow with
    a bucket's bytes for an affine T, is charged per bucket."""

    def __init__(self, inst: Instance):
        self.inst = inst
        self.k = float(inst.profile.comm_slowdown)
        self.B = float(inst.backward_end)
        b = inst.spec.reduce_bytes
        betas = inst.comm.betas()
        self.ok = min(betas) >= 0.0
        self.lam = max(0.0, min(betas)) * b
        # segment starts in elements: τ is non-decreasing on each segment (slope β_i·b − λ
        # ≥ 0), so its minimum over n' ≥ n is at n or at a later segment start
        self.starts = np.array([math.ceil(s0 / b) for s0, _, _ in inst.comm.segments[1:]]
                               + [1], dtype=np.float64)
        self.tau_starts = self.tau(self.starts)

    def theta(self, t):
        t = np.asarray(t, dtype=np.float64)
        return t / self.k if self.k == 1.0 else np.where(t < self.B, t / self.k,
                                                         self.B / self.k + (t - self.B))

    def theta_inv(self, u: float) -> float:
        if self.k == 1.0 or u < self.B / self.k:
            return u * self.k
        return self.B + (u - self.B / self.k)

    def tau(self, n):
        n = np.asarray(n, dtype=np.float64)
        return np.asarray(self.inst.comm.time(n * self.inst.spec.reduce_bytes)) - self.lam * n

    def tau_min(self, n: np.ndarray) -> np.ndarray:
        """min τ(n') over n' ≥ n (n ≥ 1)."""
        out = self.tau(n)
        for s0, t0 in zip(self.starts, self.tau_starts):
            out = np.where(s0 >= n, np.minimum(out, t0), out)
        return out

    def issue(self, x: np.ndarray) -> np.ndarray:
        inst = self.inst
        j = np.searchsorted(inst.end, x, side="left")
        return inst.ready[j] + inst.gamma * x


def _relaxed_terms(rx: _Relaxed, cells: _Cells, n: int, X: int):
    """For buckets whose first cut lies in one of the cells 0..n−1 (Y) and whose end lies in
    cell X: the terms of a lower bound on θ̃ after them, every term at its most favourable
    position in its cell (issue at X's first position, −λ·x at Y's last, τ at the shortest
    bucket). With θ̃ ≥ S[Y] before, θ̃ ≥ max(floor, S') + add, S'[dec] = max(dec_floor,
    S[dec]) + T(decoder share) where the decoder's share goes first; add = inf where no such
    bucket is allowed. Y == X (an open cell): two cuts in one cell."""
    inst, lam = rx.inst, rx.lam
    Y = np.arange(n)
    ylo, yhi = cells.lo[Y], cells.hi[Y]
    xlo = int(cells.lo[X])
    dec = dec_floor = None
    if inst.dec_pos is not None:
        dec = (yhi <= inst.dec_pos) & (inst.dec_pos < xlo)
        dec_floor = rx.theta(inst.dec_issue_base + inst.gamma * ylo[dec]) - lam * yhi[dec]
    floor = rx.theta(rx.issue(np.array([xlo])))[0] - lam * yhi
    add = rx.tau_min(np.maximum(1, xlo - yhi))
    if inst.alone is not None:
        a0, a1 = int(inst.start[inst.alone]), int(inst.end[inst.alone])
        bad = ((yhi < a0) & (xlo > a0)) | ((yhi < a1) & (xlo > a1))
        if xlo == a1 and not cells.open[X]:
            pair = (yhi == a0) & ~cells.open[Y]
            bad = ~pair
            add = np.where(pair, float(inst.allreduce.time(inst.mask_bytes)) - lam * (a1 - a0), add)
        add = np.where(bad, np.inf, add)
    return floor, add, dec, dec_floor


def _relaxed_min(terms, S: np.ndarray, t_dec: float) -> float:
    floor, add, dec, dec_floor = terms
    if dec is not None and dec.any():
        S = S.copy()
        S[dec] = np.maximum(dec_floor, S[dec]) + t_dec
    return float(np.min(np.maximum(floor, S) + add))


def lower_bound(inst: Instance, cands: list[int], num_buckets: Optional[int] = None) -> float:
    """A lower bound on the best sync end over *every* plan - cuts at any valid element
    position, not only at ``cands`` - with exactly ``num_buckets`` buckets when given
    (Proposition 3). −inf when T has a negative slope (no bound)."""
    rx = _Relaxed(inst)
    if not rx.ok:
        return -math.inf
    cells = _Cells.of(inst, cands)
    C = len(cells.lo)
    t_dec = float(inst.allreduce.time(inst.dec_bytes)) if inst.dec_pos is not None else 0.0
    if num_buckets is None:   # S[X]: θ̃ lower bound after a bucket ending in cell X
        S = np.full(C, np.inf)
        S[0] = -np.inf
        for X in range(1, C):
            S[X] = _relaxed_min(_relaxed_terms(rx, cells, X, X), S[:X], t_dec)
        return _lower_end(rx, S[C - 1])
    # fixed K: D[k, X] after k buckets; cells in order, counts ascending, so a second cut in
    # the same open cell sees the count before it
    K = int(num_buckets)
    D = np.full((K + 1, C), np.inf)
    D[0, 0] = -np.inf
    for X in range(1, C):
        n = X + 1 if cells.open[X] else X    # an open cell can take two cuts
        terms = _relaxed_terms(rx, cells, n, X)
        for k in range(1, K + 1):
            prev = D[k - 1, :n]
            if (prev < np.inf).any():
                D[k, X] = _relaxed_min(terms, prev, t_dec)
    return _lower_end(rx, D[K, C - 1])


def _lower_end(rx: _Relaxed, last: float) -> float:
    """The sync end a θ̃ bound at the buffer's end implies."""
    if not math.isfinite(last):
        return -math.inf if last < 0 else math.inf
    return rx.inst.finish(rx.theta_inv(last + rx.lam * rx.inst.total))


def _transition(inst: Instance, D: np.ndarray, Y: np.ndarray, x: int) -> np.ndarray:
    """advance(D[y], y, x) for every y in Y (vectorised ``Instance.advance``); inf where the
    bucket [y, x) is not allowed (it would cut through the split embedding's own bucket)."""
    e = D.copy()
    if inst.dec_pos is not None:
        m = (Y <= inst.dec_pos) & (inst.dec_pos < x)
        if m.any():
            e[m] = inst.run(np.maximum(inst.dec_issue_base + inst.gamma * Y[m], e[m]),
                            float(inst.allreduce.time(inst.dec_bytes)))
    comm = inst.comm.time((x - Y) * inst.spec.reduce_bytes)
    start = np.maximum(inst.issue_time(x), e)
    val = inst.run(start, comm)
    if inst.alone is not None:
        a0, a1 = int(inst.start[inst.alone]), int(inst.end[inst.alone])
        bad = (Y < a0) & (x > a0) | (Y < a1) & (x > a1)
        if x == a1:
            bad = Y != a0
            mask = float(inst.allreduce.time(inst.mask_bytes))
            val = np.where(Y == a0, inst.run(start, mask), val)
        val = np.where(bad, np.inf, val)
    return np.asarray(val, dtype=np.float64)


def solve(inst: Instance, grid: Optional[int] = None, num_buckets: Optional[int] = None,
          max_candidates: int = MAX_CANDIDATES, bound: bool = True) -> Solution:
    """The cut positions minimising the sync end (Lemma 1), over `candidate_cuts`. With
    ``num_buckets`` exactly that many buckets (raises ValueError when impossible). Unless the
    candidates are exact (every element position, or Theorem 2), ``bound`` computes the
    certified bound on what they lose (Proposition 3; ``bound=False``: none claimed, inf)."""
    theorem = (num_buckets is None and len(inst.comm.segments) == 1 and inst.gamma == 0.0
               and inst.profile.comm_slowdown == 1.0)
    if grid is None and theorem:
        grid = 0   # Theorem 2: boundaries are exact
    cands, g = candidate_cuts(inst, grid, max_candidates)
    cuts, D_end = _dp(inst, cands, num_buckets)
    end = inst.finish(D_end)
    exact = ("parameter boundaries: exact by Theorem 2" if theorem
             else "every element position" if g == 1 else "")
    lb: Optional[float] = None
    if exact:
        gap = 0.0
    elif bound:
        lb = lower_bound(inst, cands, num_buckets)
        gap = max(0.0, end - lb) if math.isfinite(lb) else math.inf
        if gap <= 1e-12 * max(1.0, abs(end)):
            gap = 0.0
    else:
        gap = math.inf
    return Solution(cuts, end, len(cands), g, gap, exact, lb, num_buckets)


def _dp(inst: Instance, cands: list[int], num_buckets: Optional[int]) -> tuple[list[int], float]:
    """Lemma 1's DP over ``cands``: the best cuts and the chain's end (before ``finish``)."""
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
        return cuts, float(D[M - 1])
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
    return cuts, float(D[K, M - 1])


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

    tied = (profile.tied, profile.sizes()[profile.tied]) if profile.tied is not None else None

    def resolved(pays: bool = split_pays, plan: Optional[BucketPlan] = None) -> str:
        """The tied sync the engine runs for ``tied_asked`` (resolve_tied_sync, the one
        decision); dense where the model has no tied embedding to split."""
        if tied is None:
            return "dense"
        return resolve_tied_sync(tied_asked, spec_base.clip_mode, spec_base.world_size,
                                 rows=profile.tied_rows, pays=pays, plan=plan, tied=tied)[0]

    mode = resolved()
    modes = {"dense", mode}
    if try_other_tied and tied_asked == "auto" and resolved(pays=True) == "split":
        modes.add("split")   # split applies here: a row for it even where it may not pay
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
        add(config_name, config_plan, resolved(plan=config_plan), "the config's buckets now")
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
        note = (sol.describe()
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
