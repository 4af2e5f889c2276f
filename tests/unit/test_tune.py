"""The bucket tuner (runtime.calibrate.tune): the exact partition and its certified bound against
brute force, the production order, the simulator against hand-computed timelines, the
allreduce fit, plan files, the arbitration's decisions, the fabric model, and bad input. The
command line and the side-by-side race: tests/integration/test_tune_integration.py; a real
tune on 2 CPU ranks whose plan the trainer then runs: tests/ranks/test_tune_ranks.py."""
from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from runtime.grad_sync.plan import BucketPlan, GradLayout, Piece, PlanError, production_order
from runtime.calibrate.tune.costmodel import CommModel, SweepError, check_sweep, fit, fit_affine
from runtime.calibrate.tune.fabric import Fabric, FabricError, load_fabric
from runtime.calibrate.tune.simulate import (Gradient, Instance, ShardComm, StepProfile,
                                             SyncSpec, simulate)
from runtime.calibrate.tune.solve import brute_force, compare, solve
from tests.support.launch import ROOT


CLIPS = ("global_after", "none", "bucket_before", "local_before")


def random_instance(rng: random.Random, sorted_ready: bool = False, shard: bool = False):
    """A tiny bucket problem: 2-4 parameters of 1-4 elements, ready in production order or
    not, the split tied embedding (40 %) anywhere in the order - first too - every clip mode
    (split: the two that allow it), affine or concave piecewise T, launch work γ, κ; with
    ``shard``, optim.shard over 2 ranks (buckets at the reduce-scatter's T)."""
    m = rng.randint(2, 4)
    times = [rng.uniform(0, 3 * m) for _ in range(m)]
    if sorted_ready or rng.random() < 0.5:
        times.sort()
    grads = [Gradient(f"p{j}", rng.randint(1, 4), t) for j, t in enumerate(times)]
    t = max(times)
    split = rng.random() < 0.4
    if split:
        emb = Gradient("emb", rng.randint(2, 4), rng.uniform(0, t + 1))
        grads.insert(0 if rng.random() < 0.4 else rng.randint(1, m), emb)
    prof = StepProfile(tuple(grads), 1.0, max(g.ready_s for g in grads) + 0.1, 0.5,
                       prescale_s_per_element=rng.choice([0.0, 0.05]),
                       comm_slowdown=rng.choice([1.0, 1.0, 2.5]),
                       tied="emb" if split else None, tied_rows=2 if split else 0,
                       decoder_ready_s=rng.uniform(0, t) if split else None, touched_rows=1)
    if rng.random() < 0.5:
        comm = CommModel.affine(rng.uniform(0, 2), rng.uniform(0.1, 2))
    else:
        a, b1, k = rng.uniform(0, 1), rng.uniform(0.5, 2), rng.uniform(1, 5)
        b2 = rng.uniform(0.1, b1)
        comm = CommModel(((0, a, b1), (k, a + b1 * k - b2 * k, b2)))
    clip = rng.choice(CLIPS[:2] if split else CLIPS)
    extra = {"shard": 2, "shard_comm": ShardComm.from_allreduce(comm, "reduce")} \
        if shard else {}
    spec = SyncSpec(clip_mode=clip, tied_sync="split" if split else "dense",
                    align=rng.choice([1, 2]), **extra)
    return Instance.build(prof, spec, comm)


# ---------------------------------------------------------------------------------------------
# the exact partition


def test_solver_is_never_worse_than_brute_force_on_random_small_instances():
    """The DP against every plan over every element position (brute force), on random tiny
    instances: every clip mode, the split tied embedding anywhere in the order (first too),
    ready times out of order, padding, piecewise T, launch work, slowed communication, and
    with the bucket count fixed. Grid 1 is exact: equal; the default grid (what the tuner
    runs) is never worse."""
    rng = random.Random(12)
    fixed = first = unsorted = 0
    seen_clips = set()
    for _ in range(120):
        inst = random_instance(rng)
        cuts, best = brute_force(inst)
        assert math.isfinite(best) and cuts[-1] == inst.total
        assert inst.chain_end(cuts) == pytest.approx(best, abs=1e-12)
        sol = solve(inst, grid=1)
        assert sol.sync_end_s == pytest.approx(best, abs=1e-9), (cuts, sol.cuts)
        assert inst.chain_end(sol.cuts) == pytest.approx(sol.sync_end_s, abs=1e-12)
        assert solve(inst).sync_end_s <= best + 1e-9
        first += inst.alone == 0
        unsorted += bool(np.any(np.diff([g.ready_s for g in inst.profile.grads]) < 0))
        seen_clips.add(inst.spec.clip_mode + ("+split" if inst.alone is not None else ""))
        K = rng.randint(1, 3)
        cuts_k, best_k = brute_force(inst, num_buckets=K)
        if math.isfinite(best_k):
            assert len(cuts_k) == K
            sk = solve(inst, grid=1, num_buckets=K)
            assert len(sk.cuts) == K and sk.sync_end_s == pytest.approx(best_k, abs=1e-9)
            fixed += 1
        else:   # no K-bucket plan: the solver says so too
            with pytest.raises(ValueError):
                solve(inst, grid=1, num_buckets=K)
    assert fixed > 50 and first >= 5 and unsorted >= 20
    assert seen_clips == {"global_after", "none", "bucket_before", "local_before",
                          "global_after+split", "none+split"}


def test_the_solver_stays_exact_on_sharded_instances():
    """optim.shard changes a bucket's T (a reduce-scatter: α + (T − α)/2, still concave
    piecewise and non-decreasing) and leaves the tied embedding's allreduces: grid 1 is still
    the brute force's optimum."""
    rng = random.Random(35)
    for _ in range(60):
        inst = random_instance(rng, shard=True)
        assert inst.comm is inst.spec.shard_comm.bucket and inst.allreduce is not inst.comm
        _, best = brute_force(inst)
        assert solve(inst, grid=1).sync_end_s == pytest.approx(best, abs=1e-9)


def test_brute_force_sees_the_split_embedding_first_in_the_order():
    """It used to return ([], inf) whenever the embedding came first (its forced cut at 0
    was demanded as a cut); by hand: emb (1 row × 2 elements, alone) then p (2 elements),
    T(n) = 1 s + n/4 s per byte, everything ready at 0 with no backward left: back to back the
    row mask (1 byte: 1.25 s), p (8 bytes: 3 s), the decoder's share (8 bytes: 3 s) and the
    touched row (8 bytes: 3 s)."""
    prof = StepProfile((Gradient("emb", 2, 0.0), Gradient("p", 2, 0.0)), 0.0, 0.0, 0.0,
                       tied="emb", tied_rows=1, decoder_ready_s=0.0, touched_rows=1)
    inst = Instance.build(prof, SyncSpec(tied_sync="split"), CommModel.affine(1.0, 0.25))
    assert inst.alone == 0 and inst.forced_cuts() == [0, 2]
    cuts, best = brute_force(inst)
    assert cuts == [2, 4] and best == pytest.approx(1.25 + 3.0 + 3.0 + 3.0)
    assert solve(inst, grid=1).sync_end_s == pytest.approx(best)


def test_the_bound_is_true_against_brute_force_on_coarse_grids():
    """Forced to a coarse grid (2 or 3 elements, or parameter boundaries only) the plan loses
    at most the bound the table prints, against the best plan over every element position
    (brute force) - with one-bucket grid plans (the old bound used the grid plan's count and
    printed 0 s for them) and with K fixed. For an affine T the bound is also tight: it
    overstates the loss by at most κ·λ·(widest gap between candidates)."""
    from runtime.calibrate.tune.solve import _Cells, candidate_cuts
    rng = random.Random(7)
    one_bucket_lost = bounded = fixed = 0
    for _ in range(100):
        inst = random_instance(rng)
        _, opt = brute_force(inst)
        for g in (rng.choice([2, 3]), 0):
            sol = solve(inst, grid=g)
            loss = sol.sync_end_s - opt
            assert -1e-9 <= loss <= sol.bound_s + 1e-9, (g, sol.cuts, loss, sol.bound_s)
            if sol.exact:
                continue
            bounded += 1
            assert sol.lower_bound_s <= opt + 1e-9
            if len(sol.cuts) == 1 and loss > 1e-6:
                one_bucket_lost += 1
            if len(inst.comm.segments) == 1:
                cells = _Cells.of(inst, candidate_cuts(inst, g)[0])
                w = int(np.max(cells.hi - cells.lo))
                lam = inst.comm.beta * inst.spec.reduce_bytes
                assert sol.bound_s - loss <= inst.profile.comm_slowdown * lam * w + 1e-9
        K = rng.randint(1, 3)
        _, opt_k = brute_force(inst, num_buckets=K)
        if math.isfinite(opt_k) and len(candidate_cuts(inst, 2)[0]) >= K:
            sk = solve(inst, grid=2, num_buckets=K)
            assert -1e-9 <= sk.sync_end_s - opt_k <= sk.bound_s + 1e-9
            fixed += 1
    assert bounded > 100 and one_bucket_lost >= 2 and fixed > 40


def test_one_bucket_on_the_grid_and_the_faster_plan_inside_the_parameter():
    """By hand: local_before, one parameter of 4 elements, launch work 1 s per element,
    T = 0.1 s + 1 s per element. On parameter boundaries only: one bucket, issued 4 s after
    backward, ending at 4 + 4.1 = 8.1 s. Cut at every element: buckets issued at 1, 2, 3, 4 s
    end at 2.1, 3.2, 4.3, 5.4 s. The grid plan loses 2.7 s; the old bound, (K − 1)·…, printed
    0 s for a one-bucket plan; this one may not be below 2.7 s."""
    prof = StepProfile((Gradient("p", 4, 0.0),), 0.0, 0.0, 0.0, prescale_s_per_element=1.0)
    inst = Instance.build(prof, SyncSpec(clip_mode="local_before"), CommModel.affine(0.1, 0.25))
    cuts, opt = brute_force(inst)
    assert cuts == [1, 2, 3, 4] and opt == pytest.approx(5.4)
    sol = solve(inst, grid=0)
    assert sol.cuts == [4] and sol.sync_end_s == pytest.approx(8.1) and not sol.exact
    assert 2.7 - 1e-9 <= sol.bound_s <= 2.7 + 0.25 * 4 * 3   # κ·λ·w: w = 3 elements
    assert "certified" in sol.describe()
    assert solve(inst, grid=1).sync_end_s == pytest.approx(5.4)
    assert solve(inst, grid=1).exact == "every element position"


def test_some_instance_needs_a_split_parameter():
    """The brute force really explores split points: with launch work, a cut inside a
    parameter beats every boundary plan (so the grid is not decoration)."""
    prof = StepProfile((Gradient("a", 1, 0.0), Gradient("b", 8, 1.0)), 0.0, 1.0, 0.0,
                       prescale_s_per_element=0.5)
    inst = Instance.build(prof, SyncSpec(), CommModel.affine(0.1, 0.1))
    boundary = solve(inst, grid=0)
    exact = solve(inst, grid=1)
    assert exact.sync_end_s < boundary.sync_end_s - 1e-6
    assert any(c not in {int(e) for e in inst.end} for c in exact.cuts)


def test_theorem_boundaries_suffice_for_affine_t_without_launch_work():
    rng = random.Random(5)
    n = 0
    while n < 40:
        inst = random_instance(rng)
        if len(inst.comm.segments) != 1 or inst.gamma or inst.profile.comm_slowdown != 1.0:
            continue
        _, best = brute_force(inst)
        sol = solve(inst)            # picks boundaries only for this case
        assert sol.grid is None and sol.bound_s == 0.0 and "Theorem 2" in sol.exact
        assert sol.sync_end_s == pytest.approx(best, abs=1e-9)
        n += 1


def test_local_before_wants_one_bucket():
    prof = StepProfile(tuple(Gradient(f"p{i}", 100, i * 0.1) for i in range(5)), 0.1, 0.5, 0.05)
    inst = Instance.build(prof, SyncSpec(clip_mode="local_before"), CommModel.affine(1e-3, 1e-5))
    assert len(solve(inst).cuts) == 1


# ---------------------------------------------------------------------------------------------
# the simulator


def test_simulator_reproduces_a_hand_computed_timeline():
    # three gradients, 100 elements each, ready at 0.1, 0.2, 0.3 s of a 0.35 s backward;
    # T(n) = 0.01 + 0.001·n/4 (bytes), fp32; buckets [p0], [p1, p2]
    prof = StepProfile((Gradient("p0", 100, 0.1), Gradient("p1", 100, 0.2),
                        Gradient("p2", 100, 0.3)), forward_s=0.2, backward_s=0.35,
                       optimizer_s=0.05, data_s=0.01, tail_s=0.02)
    comm = CommModel.affine(0.01, 0.001 / 4)
    inst = Instance.build(prof, SyncSpec(), comm)
    plan = BucketPlan(((Piece("p0", 0, 100),), (Piece("p1", 0, 100), Piece("p2", 0, 100))))
    tl = simulate(inst, plan)
    t0 = 0.21                                    # data + forward
    b0, b1 = tl.buckets
    assert (b0.start - t0, b0.end - t0) == pytest.approx((0.1, 0.1 + 0.01 + 0.1))
    # b1 issued at 0.3, the link is free at 0.21: 0.3 .. 0.3 + 0.01 + 0.2
    assert (b1.start - t0, b1.end - t0) == pytest.approx((0.3, 0.51))
    assert tl.exposed_s == pytest.approx(0.51 - 0.35)
    assert tl.step_s == pytest.approx(0.01 + 0.2 + 0.51 + 0.05 + 0.02)
    # one bucket: issued at 0.3, 0.01 + 0.3
    one = simulate(inst, BucketPlan.from_cap([("p0", 100), ("p1", 100), ("p2", 100)], 1000))
    assert one.step_s == pytest.approx(0.01 + 0.2 + 0.61 + 0.07)


def test_simulator_models_the_split_tied_embedding_and_slowed_communication():
    # decoder share (2 rows × 5 = 10 elements) ready at 0.05; layers after it; the
    # embedding last. T(n) = n bytes · 1 ms/4 B = 1 ms per element; κ = 2 during backward.
    prof = StepProfile((Gradient("head", 5, 0.01), Gradient("layer", 20, 0.2),
                        Gradient("emb", 10, 0.4)), forward_s=0.0, backward_s=0.4,
                       optimizer_s=0.0, tied="emb", tied_rows=2, decoder_ready_s=0.05,
                       touched_rows=1, comm_slowdown=2.0)
    comm = CommModel.affine(0.0, 0.001 / 4)
    inst = Instance.build(prof, SyncSpec(tied_sync="split"), comm)
    plan = BucketPlan(((Piece("head", 0, 5),), (Piece("layer", 0, 20),),
                       (Piece("emb", 0, 10),)))
    tl = simulate(inst, plan)
    lanes = {b.lane: b for b in tl.buckets}
    # head: 5 ms of work at half speed from 0.01 -> 0.02; decoder (10 elements) at 0.05 ->
    # 0.07; layer issued at 0.2 -> 0.24; mask (2 bytes = 0.5 ms) at 0.4 after backward ->
    # 0.4005; touched rows (1 row × 5 elements = 5 ms) -> 0.4055
    assert lanes["b0"].end == pytest.approx(0.02)
    assert lanes["decoder share"].start == pytest.approx(0.05)
    assert lanes["decoder share"].end == pytest.approx(0.07)
    assert lanes["b1"].end == pytest.approx(0.24)
    assert lanes["b2 row mask"].end == pytest.approx(0.4005)
    assert lanes["touched rows"].end == pytest.approx(0.4055)
    assert inst.chain_end(inst.cuts_from_plan(plan)) == pytest.approx(0.4055)


def test_a_bucket_waits_for_every_gradient_before_its_end():
    """Out of production order (p0 registered and laid out first but final last) a bucket
    ending after p1 still waits for p0: the engine launches buckets in order, each when its
    gradients are final. By hand: T = 0.1 s per element, ready p0 at 0.3, p1 at 0.1, one
    element each, buckets [p0], [p1]: both issue at 0.3, end 0.4 and 0.5 (not p1's 0.1)."""
    prof = StepProfile((Gradient("p0", 1, 0.3), Gradient("p1", 1, 0.1)), 0.0, 0.35, 0.0)
    comm = CommModel.affine(0.0, 0.1 / 4)
    inst = Instance.build(prof, SyncSpec(), comm)
    assert inst.issue_time(2) == pytest.approx(0.3)
    plan = BucketPlan(((Piece("p0", 0, 1),), (Piece("p1", 0, 1),)))
    tl = simulate(inst, plan)
    assert [(b.ready, b.end) for b in tl.buckets] == [pytest.approx((0.3, 0.4)),
                                                      pytest.approx((0.3, 0.5))]
    assert inst.chain_end([1, 2]) == pytest.approx(0.5)
    # in production order (p1 first) p1 goes at its own time: 0.1 -> 0.2, then p0 0.3 -> 0.4
    order = production_order({g.name: g.ready_s for g in prof.grads}, ["p0", "p1"])
    assert order == ["p1", "p0"]
    sorted_prof = StepProfile(tuple(sorted(prof.grads, key=lambda g: g.ready_s)), 0.0, 0.35, 0.0)
    inst2 = Instance.build(sorted_prof, SyncSpec(), comm)
    assert inst2.chain_end([1, 2]) == pytest.approx(0.4)
    assert solve(inst2, grid=1).sync_end_s <= solve(inst, grid=1).sync_end_s


def test_simulator_models_a_sharded_step_by_hand():
    """optim.shard over 2 ranks: the buckets at the reduce-scatter's T (half the allreduce's
    per-byte time), the optimizer span 1/2 of the update + the two small allreduces + the
    all-gather of every parameter; the split tied embedding's collectives stay allreduces."""
    prof = StepProfile((Gradient("p0", 100, 0.1), Gradient("p1", 100, 0.2),
                        Gradient("p2", 100, 0.3)), forward_s=0.2, backward_s=0.35,
                       optimizer_s=0.08, data_s=0.01, tail_s=0.02)
    comm = CommModel.affine(0.01, 0.001 / 4)         # 1 ms per element at fp32
    sc = ShardComm.from_allreduce(comm, "reduce")
    assert sc.bucket.time(400) == pytest.approx(0.01 + 0.05)  # half of the 0.1 s
    assert ShardComm.from_allreduce(comm, "allreduce").bucket == comm  # gloo keeps it
    inst = Instance.build(prof, SyncSpec(shard=2, shard_comm=sc), comm)
    plan = BucketPlan(((Piece("p0", 0, 100),), (Piece("p1", 0, 100), Piece("p2", 0, 100))))
    tl = simulate(inst, plan)
    t0 = 0.21
    b0, b1, gather = tl.buckets
    assert (b0.start - t0, b0.end - t0) == pytest.approx((0.1, 0.1 + 0.01 + 0.05))
    assert (b1.start - t0, b1.end - t0) == pytest.approx((0.3, 0.3 + 0.01 + 0.1))
    assert gather.lane == "parameter all-gather" and gather.nbytes == 1200
    # the norm (8 B) and the per-tensor partial norms (2 x 3 tensors x 8 B) at the allreduce's
    # T; the all-gather of 300 fp32 elements at the half model: 0.01 + 0.3 / 2
    opt = 0.08 / 2 + (0.01 + 0.002) + (0.01 + 0.012) + (0.01 + 0.15)
    assert inst.optimizer_s == pytest.approx(opt)
    assert tl.spans["optimizer"][1] - tl.spans["optimizer"][0] == pytest.approx(opt)
    assert gather.end == pytest.approx(tl.spans["optimizer"][1])
    assert tl.step_s == pytest.approx(0.01 + 0.2 + 0.41 + opt + 0.02)
    with pytest.raises(ValueError, match="ShardComm"):
        SyncSpec(shard=2)


def test_fabric_shard_collectives_by_hand():
    f = Fabric("x", 8, 230.0, 192.0, 10.0, 6.0)
    node = f.shard_comm(1024, 8)    # 128 nodes: reduce-scatter in the node + allreduce across
    want = 10e-6 + 2 * 7 * 6e-6 + 7 / 8 * 1e9 / 230e9 + 2 * 127 / 128 * 1e9 / 192e9
    assert node.bucket.time(1e9) == pytest.approx(want)
    assert node.gather.time(1e9) == pytest.approx(10e-6 + 7 / 8 * 1e9 / 230e9)
    assert node.small.time(8) == pytest.approx(f.comm_model(8).time(8))
    world = f.shard_comm(8, 8)      # one node: half the allreduce's per-byte time
    assert world.bucket.time(1e9) == pytest.approx(10e-6 + 7 / 8 * 1e9 / 230e9)
    with pytest.raises(FabricError, match="a shard group of 4"):
        f.shard_comm(1024, 4)


def test_production_order_sorts_by_ready_time_ties_and_unseen_by_arrival():
    ready = {"a": 0.2, "b": 0.1, "c": 0.2, "d": math.inf, "e": float("nan"), "f": 0.0}
    assert production_order(ready, ["e", "c", "d", "a", "b", "f"]) == \
        ["f", "b", "c", "a", "e", "d"]
    with pytest.raises(ValueError, match="b not in the arrival order"):
        production_order({"a": 1.0, "b": 2.0}, ["a"])


def test_bucket_bytes_include_the_flat_buffers_row_padding():
    prof = StepProfile((Gradient("a", 1000, 0.1), Gradient("b", 30, 0.2)), 0.0, 0.3, 0.0)
    inst = Instance.build(prof, SyncSpec(align=1024), CommModel.affine(0.0, 1.0))
    plan = BucketPlan(((Piece("a", 0, 1000),), (Piece("b", 0, 30),)))
    layout = GradLayout.of(plan, prof.sizes(), 1024)
    tl = simulate(inst, plan)
    assert [b.nbytes for b in tl.buckets] == [n * 4 for n in layout.bucket_elements()] \
        == [4096, 4096]


# ---------------------------------------------------------------------------------------------
# the fit and its data


def test_fit_recovers_alpha_beta_despite_a_slow_small_message():
    n = np.array([2.0 ** k for k in range(12, 26)])
    t = 50e-6 + n / 10e9
    t[1] *= 8                                     # one small message waited for a busy core
    m = fit(n, t, world_size=8)
    assert m.kind == "affine"
    assert m.alpha == pytest.approx(50e-6, rel=0.05)
    assert m.bandwidth == pytest.approx(10e9, rel=0.01)
    assert m.bus_bandwidth == pytest.approx(10e9 * 2 * 7 / 8, rel=0.01)


def test_piecewise_fit_when_one_line_is_wrong():
    n = np.array([2.0 ** k for k in range(12, 27)])
    t = np.where(n < 2 ** 19, 20e-6 + n / 1e9, 20e-6 + 2 ** 19 / 1e9 + (n - 2 ** 19) / 10e9)  # concave
    m = fit(n, t)
    assert m.kind == "piecewise" and m.mean_rel_err < 0.02
    assert fit_affine(n, t).mean_rel_err > 0.1


def test_sweep_check_warns_and_shows_the_data():
    check = check_sweep([4096, 8192], [1e-3, 2e-4])
    text = " ".join(check.warnings)
    assert "only 2 allreduce sizes" in text and "not monotonic" in text
    assert "4 KiB" in check.table and "8 KiB" in check.table
    with pytest.raises(SweepError, match="at least 2"):
        fit([4096], [1e-3])


# ---------------------------------------------------------------------------------------------
# plans, table, files


def toy_profile(tied: bool = True) -> StepProfile:
    grads = [Gradient("cls.bias", 3000, 0.01)] + [
        Gradient(f"layer{i}.w", 200_000, 0.05 + 0.05 * i) for i in range(6)]
    if tied:
        grads.append(Gradient("emb", 30_000 * 64, 0.4))
    return StepProfile(tuple(grads), forward_s=0.2, backward_s=0.4, optimizer_s=0.02,
                       tied="emb" if tied else None, tied_rows=30_000 if tied else 0,
                       decoder_ready_s=0.03 if tied else None, touched_rows=2000)


def test_table_and_written_plan_round_trip(tmp_path):
    prof = toy_profile()
    comm = CommModel.affine(1e-3, 1 / 50e6)
    rows = compare(prof, comm, SyncSpec(world_size=2), "auto",
                   BucketPlan.from_cap([(g.name, g.numel) for g in prof.grads], 2 ** 18, "cfg",
                                       alone="emb"), "this config")
    names = [r.name for r in rows]
    assert names[:2] == ["no bucketing", "this config"] and names[-1] == "tuned"
    assert any(n.startswith("best single size") for n in names)
    tuned = rows[-1]
    assert tuned.candidate.tied_sync == "split"     # auto on 2 ranks: the engine's split
    same_mode = [r for r in rows if r.candidate.tied_sync == tuned.candidate.tied_sync]
    assert tuned.timeline.step_s <= min(r.timeline.step_s for r in same_mode) + 1e-12
    both = compare(prof, comm, SyncSpec(world_size=2), "auto", try_other_tied=True)
    assert [r.name for r in both][-2:] == ["tuned", "tuned, tied dense"]
    assert both[-1].candidate.tied_sync == "dense"
    path = tmp_path / "plan.json"
    tuned.candidate.plan.write(path, prof.sizes(), {"predicted_step_s": tuned.timeline.step_s})
    back = BucketPlan.read(path, prof.sizes())
    assert back.digest() == tuned.candidate.plan.digest()
    assert json.loads(path.read_text())["meta"]["predicted_step_s"] == tuned.timeline.step_s
    if tuned.candidate.tied_sync == "split":   # the embedding whole and alone, as split needs
        from runtime.grad_sync.plan import alone_bucket
        alone_bucket(back, "emb", prof.sizes()["emb"])


# ---------------------------------------------------------------------------------------------
# arbitration by measurement


def test_the_models_error_is_the_fit_error_and_the_step_noise():
    from runtime.calibrate.tune.arbitrate import ModelError
    comm = CommModel.affine(1e-3, 1e-8, mean_rel_err=0.07)
    per_step = {"data_s": [0.0, 0.0, 0.0], "forward_s": [1.0, 1.0, 1.0],
                "backward_s": [1.0, 2.0, 1.5], "optimizer_s": [0.0, 0.0, 0.0],
                "tail_s": [0.0, 0.0, 0.0]}
    err = ModelError.of(comm, per_step, extra=0.01)   # steps 2, 3, 2.5: MAD 0.5 / 2.5
    assert (err.fit, err.noise, err.extra) == pytest.approx((0.07, 0.2, 0.01))
    tuned = simulate_stub(step=1.0, exposed=0.3)
    row = simulate_stub(step=1.1, exposed=0.5)
    assert err.tolerance(tuned, row) == pytest.approx(0.07 * 0.5 + 0.21 * 1.0)


def simulate_stub(step: float, exposed: float):
    from types import SimpleNamespace
    return SimpleNamespace(step_s=step, exposed_s=exposed)


def test_arbitration_picks_the_distinct_plans_within_the_error_that_train_the_same():
    from runtime.calibrate.tune.arbitrate import ModelError, pick
    prof = toy_profile(tied=False)
    comm = CommModel.affine(5e-3, 1 / 5e6)
    order = [(g.name, g.numel) for g in prof.grads]
    three = BucketPlan.from_cap(order, 500_000, "cfg")          # 3 buckets
    rows = compare(prof, comm, SyncSpec(world_size=2), "auto", three, "this config")
    tuned = next(r for r in rows if r.name == "tuned")
    alone, _ = pick(rows, ModelError(0.0, 0.0), prof.sizes(), "global_after")
    assert [c.name for c in alone] == ["tuned"]      # nothing predicted within 0 of it
    wide, left_out = pick(rows, ModelError(0.0, 0.0, extra=10.0), prof.sizes(), "global_after",
                          limit=3)
    distinct = {r.candidate.plan.digest() for r in rows}
    assert [c.name for c in wide][0] == "tuned" and len(wide) == 3 < len(distinct)
    assert [c.predicted_s for c in wide[1:]] == sorted(c.predicted_s for c in wide[1:])
    assert len({json.dumps(c.plan) for c in wide}) == 3 and left_out
    # rows with one plan are measured once, under the first (closest) name
    named = {n for c in wide for n in [c.name] + c.same_as} | set(left_out)
    assert named == {r.name for r in rows}
    # within the fit's tolerance: exactly the rows the formula admits
    err = ModelError(0.1, 0.01)
    picked, _ = pick(rows, err, prof.sizes(), "global_after")
    admitted = {r.candidate.plan.digest() for r in rows if r.timeline.step_s
                - tuned.timeline.step_s <= 0.1 * max(tuned.timeline.exposed_s, r.timeline.exposed_s)
                + 0.01 * tuned.timeline.step_s}
    assert {BucketPlan.from_json(c.plan, prof.sizes()).digest() for c in picked} == admitted
    assert 1 < len(admitted) < len(distinct)
    # bucket_before: τ/√K depends on K - only plans with the tuned plan's K train the same
    bb = compare(prof, comm, SyncSpec(clip_mode="bucket_before", world_size=2), "auto", three,
                 "this config", num_buckets=3)
    picked, _ = pick(bb, ModelError(0.0, 0.0, extra=10.0), prof.sizes(), "bucket_before")
    assert [c.name for c in picked] == ["tuned", "this config"]


def test_decide_recommends_the_measured_fastest_and_says_why():
    from runtime.calibrate.tune.arbitrate import Contender, decide
    cs = [Contender("tuned", {}, "dense", 1.00), Contender("A", {}, "dense", 1.01),
          Contender("B", {}, "dense", 1.02)]
    d = decide(cs, {"tuned": [1.0, 1.1, 1.2], "A": [0.9, 1.0, 1.3], "B": [1.2, 1.2, 1.2]})
    assert d.recommended == "A" and d.decided_by == "measurement"
    assert d.measured["A"]["median_s"] == 1.0 and d.measured["A"]["faster_than_tuned_rounds"] == 2
    assert "A has the lowest median of 3 plans that 3 rounds" in d.reason
    assert "faster in 2 of 3 rounds" in d.reason
    tie = decide(cs, {"tuned": [1.0], "A": [1.0], "B": [1.5]})
    assert tie.recommended == "tuned"              # a tie keeps the prediction's pick
    # B went out after 5 rounds (its list stops there): the decision is among the survivors,
    # even though B's median of its 5 rounds is the lowest of all
    raced = decide(cs, {"tuned": [1.0] * 8, "A": [1.1] * 8, "B": [0.5] * 5})
    assert raced.recommended == "tuned" and raced.measured["B"]["out_after_round"] == 5
    assert raced.measured["tuned"]["out_after_round"] is None
    assert "1 more measurably slower" in raced.reason
    alone = decide(cs, {"tuned": [1.0] * 6, "A": [1.1] * 5, "B": [1.2] * 5})
    assert alone.recommended == "tuned" and "the others measurably slower" in alone.reason
    pred = decide(cs[:1], None, "--no-arbitrate")
    assert (pred.recommended, pred.decided_by, pred.reason) == ("tuned", "prediction",
                                                                "--no-arbitrate")


def test_the_race_drops_only_what_paired_rounds_show_slower():
    """The sign test against the leader: 0 wins of 5 paired rounds is out (p = 1/32), 1 of 5
    is not (p = 6/32); a contender 2.7 % slower by its median but faster in some rounds - the
    12-layer bed's 32 MiB against DDP's 25 MiB - stays in until the rounds show it."""
    from runtime.calibrate.tune.arbitrate import sign_p, survivors
    assert sign_p(0, 5) == 1 / 32 and sign_p(1, 5) == 6 / 32 and sign_p(5, 5) == 1.0
    lead = [1.00, 1.02, 0.98, 1.01, 0.99]
    assert survivors({"t": lead, "a": [x * 1.01 for x in lead]}, ["t", "a"]) == ["t"]
    noisy = [1.03, 0.99, 1.05, 1.04, 1.02]           # faster than the leader in round 2 only
    assert survivors({"t": lead, "a": noisy}, ["t", "a"]) == ["t", "a"]
    # the leader is the lowest median, whichever comes first; fewer than 5 rounds drop nothing
    assert survivors({"t": [x * 1.1 for x in lead], "a": lead}, ["t", "a"]) == ["a"]
    assert survivors({"t": lead[:4], "a": [9.0] * 4}, ["t", "a"]) == ["t", "a"]


def test_rounds_rotate_so_each_plan_goes_first_equally_often():
    from runtime.calibrate.tune.arbitrate import rounds
    assert rounds(3, 4) == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    assert [r[0] for r in rounds(2, 6)].count(0) == 3


def test_a_plan_for_another_model_is_refused(tmp_path):
    prof = toy_profile()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"buckets": [["layer0.w", "layer9.w"]]}))
    with pytest.raises(PlanError, match="unknown parameter 'layer9.w'"):
        BucketPlan.read(path, prof.sizes())


# ---------------------------------------------------------------------------------------------
# projection


def test_fabric_allreduce_model_by_hand():
    f = Fabric("x", 8, 230.0, 192.0, 10.0, 6.0)
    node = f.comm_model(8)
    assert node.time(1e9) == pytest.approx(10e-6 + 2 * 7 / 8 * 1e9 / 230e9)
    big = f.comm_model(1024)        # 128 nodes: tree latency 2·7 hops
    want = 10e-6 + 2 * 7 * 6e-6 + 2 * 7 / 8 * 1e9 / 230e9 + 2 * 127 / 128 * 1e9 / 192e9
    assert big.time(1e9) == pytest.approx(want)
    with pytest.raises(FabricError, match="not a whole number of 8-GPU nodes"):
        f.comm_model(12)


def test_fabric_file_errors_name_the_field(tmp_path):
    bad = tmp_path / "f.toml"
    bad.write_text('[fabric]\nname = "x"\ngpus_per_node = 8\nintra_bus_bandwidth_GBps = 230\n')
    with pytest.raises(FabricError, match=r"missing field\(s\): inter_bus_bandwidth_GBps \("
                                          r"allreduce bus bandwidth between nodes"):
        load_fabric(bad)
    bad.write_text('[fabric]\nname = "x"\ngpus_per_node = "8"\n')
    with pytest.raises(FabricError, match="missing field"):
        load_fabric(bad)
    with pytest.raises(FabricError, match="does not exist"):
        load_fabric(tmp_path / "nope.toml")
    good = load_fabric(ROOT / "runtime" / "calibrate" / "tune" / "systems" / "dgx_a100_8xhdr.toml")
    assert good.inter_bus_bandwidth_GBps == 192.0
