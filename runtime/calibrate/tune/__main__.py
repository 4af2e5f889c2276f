"""The bucket tuner: ``python -m runtime.calibrate.tune`` under the launcher that trains.

    mpiexec -n 2 python -m runtime.calibrate.tune --config submission/configs/config_CPU_1x2x32x1.toml
    MODE=tune CONFIG=... ./run_and_time.sh            (same launcher and ranks as training)
    python -m runtime.calibrate.tune --simulate FABRIC.toml --profile PROFILE.toml   (cluster projection)

On the current world it measures (runtime.calibrate.tune.measure) each gradient's ready time, the
forward/backward/optimizer spans and allreduce times from 4 KiB to the whole gradient; fits
T(n) (runtime.calibrate.tune.costmodel); solves the exact partition (runtime.calibrate.tune.solve) under the
step-time model (runtime.calibrate.tune.simulate); runs the plans predicted within the model's
measured error of the tuned one side by side with the real training step and recommends the
measured fastest (runtime.calibrate.tune.arbitrate; ``--no-arbitrate``: the prediction decides);
prints the table (no bucketing, this config's buckets, DDP 25 MiB, Horovod 64 MiB, Megatron's
size, the best single size, tuned; predicted and measured) and writes, in ``--out`` (default
results/tune_<config>_<date>/):
  bucket_plan.json   the recommended plan, the format ``train.bucket_plan`` reads (meta: which
                     row, what decided, what was measured and predicted); use it with
                     ``-- train.bucket_plan=PATH``
  plans/*.json       every plan of the table (``--write-all``), for side-by-side runs
  tune.json          profile, sweep, fit, table, predicted timelines
  timeline.png       compute and communication lanes of this config's plan and the tuned one
Exit status: 0 done (also for a world of one: nothing to tune), 2 bad input (config, plan,
fabric or profile file), 1 a failure while measuring.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from runtime.choices import clip_spec, shard_scope

ROOT = Path(__file__).resolve().parents[3]


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m runtime.calibrate.tune",
                                 description="Measure this world and write an exact bucket plan "
                                             "(or, with --simulate, project a cluster).")
    ap.add_argument("--config", help="config TOML (as for training)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--out", default=None, help="output directory (default "
                    "results/tune_<config>_<date>)")
    ap.add_argument("--steps", type=int, default=6, help="measured steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2, help="steps before measuring (>= 1: the "
                    "first step records the production order)")
    ap.add_argument("--contention-steps", type=int, default=3, help="steps with an allreduce "
                    "running beside backward, to measure how much compute slows it (κ; 0: "
                    "assume none, as on GPUs)")
    ap.add_argument("--repeats", type=int, default=5, help="allreduces per message size")
    ap.add_argument("--sizes", type=int, default=None, help="message sizes to measure, spread "
                    "geometrically (default: powers of two)")
    ap.add_argument("--min-bytes", type=int, default=4096, help="smallest message (4 KiB)")
    ap.add_argument("--fit", choices=("auto", "affine", "piecewise"), default="auto")
    ap.add_argument("--num-buckets", default=None, help="bucket count of the tuned plan: a "
                    "number, 'free', or 'config' (the config plan's K; default for "
                    "clip_mode bucket_before, whose clip threshold τ/√K depends on K)")
    ap.add_argument("--grid", type=int, default=None, help="interior cut grid in elements "
                    "(default: automatic; 0: parameter boundaries only)")
    ap.add_argument("--both-tied", action="store_true", help="with tied_embedding_sync auto: "
                    "also solve for the other tied mode and show it as a row (the plan written "
                    "keeps the engine's mode)")
    ap.add_argument("--write-all", action="store_true", help="also write every plan of the "
                    "table to OUT/plans/")
    ap.add_argument("--no-arbitrate", action="store_true", help="recommend the predicted "
                    "fastest plan even when others are predicted within the model's measured "
                    "error of it (default: run those side by side with the real training step "
                    "and recommend the measured fastest)")
    ap.add_argument("--arbitrate-steps", type=int, default=12, help="at most this many "
                    "measured rounds of real steps when arbitrating (after one warm-up round); "
                    "a plan measurably slower than the leader is out, and the race ends when "
                    "one is left")
    ap.add_argument("--arbitrate-within", type=float, default=0.0, metavar="FRACTION",
                    help="also arbitrate between rows predicted within FRACTION of the tuned "
                    "plan's step, besides the model's measured error (e.g. 0.05)")
    ap.add_argument("--no-png", action="store_true")
    ap.add_argument("--simulate", metavar="FABRIC", help="project a cluster from a fabric file "
                    "(runtime.calibrate.tune.fabric) instead of measuring")
    ap.add_argument("--profile", metavar="PROFILE", help="with --simulate: the per-GPU compute "
                    "profile file (runtime.calibrate.tune.project), or model:GPU[:MODE[:CONFIG]] "
                    "for the device-time model's prediction (h100, h200, a100; "
                    "runtime.calibrate.tune.model_profile)")
    ap.add_argument("--gpus", default="8,16,32,64,128,256,512,1024",
                    help="with --simulate: GPU counts")
    ap.add_argument("--cuda-graphs", choices=("none", "encoder", "full"), default=None,
                    help="with --simulate: the step's train.cuda_graphs (default: the profile "
                         "file's; 'encoder' hands back every gradient at the end of backward, "
                         "so the allreduces are exposed)")
    ap.add_argument("--json", default=None, help="with --simulate: write the projection here")
    ap.add_argument("--samples", default=None, metavar="TABLE",
                    help="with --simulate: samples to target per global batch, a CSV "
                         "'global_batch,samples' or a bench.batch_scaling record (default: "
                         "the MLPerf reference convergence points); the projection then "
                         "picks the fastest batch per GPU count")
    ap.add_argument("--profile-only", metavar="PATH", help="measure the step profile only "
                    "(any world size, one rank too) and write it as JSON: the layer split a "
                    "projection (--simulate) scales to a GPU's throughput")
    return ap.parse_args(argv)


def set_threads(cfg, local_world_size: int) -> None:
    import torch
    n = cfg.system.threads_per_rank or max(1, (os.cpu_count() or 1) // max(local_world_size, 1))
    torch.set_num_threads(n)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.simulate:
        from runtime.calibrate.tune.project import main as project_main
        return project_main(args)
    if args.warmup < 1 or args.steps < 1 or args.arbitrate_steps < 1:
        print("runtime.calibrate.tune: --warmup, --steps and --arbitrate-steps must be >= 1",
              file=sys.stderr)
        return 2
    if not 0.0 <= args.arbitrate_within <= 10.0:
        print(f"runtime.calibrate.tune: --arbitrate-within is a fraction of the tuned plan's "
              f"predicted step (0 to 10), got {args.arbitrate_within}", file=sys.stderr)
        return 2
    if not args.config:
        print("runtime.calibrate.tune: give --config FILE (the config you train with), or --simulate "
              "FABRIC for a projection", file=sys.stderr)
        return 2
    from runtime.config import ConfigError, load_config
    from runtime.launch.env import LaunchError, discover
    try:
        cfg = load_config(args.config, args.set)
        info = discover()
        cfg.local_batch_size(info.world_size)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return 2
    except LaunchError as e:
        print(f"launch error: {e}", file=sys.stderr, flush=True)
        return 2
    if args.profile_only:
        from runtime.launch.dist import run_guarded
        return run_guarded(lambda: profile_only(cfg, info, args), info, leave=True)
    if info.world_size == 1:
        print("runtime.calibrate.tune: nothing to tune: a world of one rank sends no gradients (no "
              "allreduce to overlap). Run it under the launcher and rank count you train with, "
              "e.g. `mpiexec -n 2 python -m runtime.calibrate.tune --config C` or `MODE=tune "
              "./run_and_time.sh`.", flush=True)
        return 0
    from runtime.launch.dist import run_guarded
    return run_guarded(lambda: tune(cfg, info, args), info, leave=True)


class BadInput(Exception):
    pass


def profile_only(cfg, info, args) -> int:
    from runtime.launch.dist import init_distributed, shutdown
    from runtime.calibrate.tune import measure
    ctx = init_distributed(info, device=cfg.system.device, timeout_s=cfg.system.dist_timeout_s)
    set_threads(cfg, info.local_world_size)
    m = measure.measure_step(cfg, ctx, steps=args.steps, warmup=args.warmup,
                             contention_steps=0)
    if ctx.rank == 0:
        out = Path(args.profile_only)
        out.parent.mkdir(parents=True, exist_ok=True)
        rec = {"written_by": "python -m runtime.calibrate.tune --profile-only", "config": cfg.source,
               "overrides": args.set, "world_size": ctx.world_size,
               "date": f"{datetime.date.today()}", "steps": m.steps, "warmup": m.warmup,
               "profile": m.profile.to_json()}
        out.write_text(json.dumps(rec, indent=1))
        p = m.profile
        print(f"profile: forward {p.forward_s:.3f} s, backward {p.backward_s:.3f} s, optimizer "
              f"{p.optimizer_s:.3f} s, {len(p.grads)} gradients -> {out}", flush=True)
    shutdown()
    return 0


def tune(cfg, info, args) -> int:
    from runtime.launch.dist import init_distributed, shutdown
    from runtime.model.precision import DTYPES
    from runtime.grad_sync.plan import PlanError
    from runtime.calibrate.tune import measure
    from runtime.calibrate.tune.solve import MB

    ctx = init_distributed(info, device=cfg.system.device, timeout_s=cfg.system.dist_timeout_s)
    set_threads(cfg, info.local_world_size)
    main_rank = ctx.rank == 0
    say = (lambda *a: print(*a, flush=True)) if main_rank else (lambda *a: None)
    t_start = time.time()
    say(f"runtime.calibrate.tune: {ctx.world_size} ranks, {cfg.source}: measuring {args.warmup}+"
        f"{args.steps} steps without communication")
    m = measure.measure_step(cfg, ctx, steps=args.steps, warmup=args.warmup,
                             contention_steps=args.contention_steps)
    profile = m.profile
    numerics = cfg.numerics()   # the allreduce's dtype, as the trainer's build resolves it
    reduce_dtype, rb = DTYPES[numerics.reduce], numerics.reduce_bytes
    total = profile.total_elements() * rb
    sizes = measure.sweep_sizes(total, args.min_bytes, args.sizes)
    say(f"measuring allreduce ({numerics.reduce}) at {len(sizes)} sizes, "
        f"{args.min_bytes} B .. {total / MB:.1f} MiB, {args.repeats} repeats each")
    times = measure.measure_allreduce(sizes, reduce_dtype, ctx.device, args.repeats)
    # rank 0 solves and picks the plans to measure; every rank measures them side by side
    solved, payload = None, {"code": 0, "contenders": []}
    if main_rank:
        try:
            solved = _solve(cfg, ctx, args, m, sizes, times, rb)
            if not args.no_arbitrate:
                payload["contenders"] = solved.contenders
        except (BadInput, PlanError) as e:
            print(f"runtime.calibrate.tune: {e}", file=sys.stderr, flush=True)
            payload["code"] = 2
    from runtime.launch.dist import broadcast_object, check_same_on_all_ranks
    payload = broadcast_object(payload)
    code = payload["code"]
    if code == 0:
        from runtime.calibrate.tune import arbitrate
        contenders = payload["contenders"]
        measured = None
        if len(contenders) > 1:
            say(f"arbitration: {', '.join(c.name for c in contenders[1:])} predicted within the "
                f"model's error of the tuned plan; racing them on real training steps (after "
                f"1 warm-up, at most {args.arbitrate_steps} rounds, interleaved, order "
                f"rotated; a plan measurably slower than the leader is out)")
            measured = arbitrate.run_side_by_side(cfg, ctx, contenders, args.arbitrate_steps,
                                                  log=say)
        why = ("--no-arbitrate" if args.no_arbitrate else
               "no other plan is predicted within the model's error of the tuned plan")
        decision = arbitrate.decide(contenders, measured, why)
        # every rank decided from the same reduced times: they must agree
        check_same_on_all_ranks("the tuner's recommended plan", decision.recommended)
        if main_rank:
            code = _write(cfg, ctx, args, m, solved, decision, t_start)
    code = broadcast_object(code)
    shutdown()
    return code


@dataclass
class Solved:
    """What rank 0 solved: the table and what it was computed from."""

    rows: list
    comm: Any
    check: Any
    spec: Any
    num_buckets: Optional[int]
    sizes: list
    times: list
    error: Any                  # arbitrate.ModelError
    contenders: list            # arbitrate.Contender, the tuned plan first
    left_out: list              # rows within the error left out by arbitrate.MAX_CONTENDERS


def _solve(cfg, ctx, args, m, sizes, times, rb) -> Solved:
    from runtime.grad_sync.plan import MB, BucketPlan
    from runtime.calibrate.tune import arbitrate, measure
    from runtime.calibrate.tune.costmodel import check_sweep, fit, sweep_table
    from runtime.calibrate.tune.simulate import SyncSpec
    from runtime.calibrate.tune.solve import cap_plan, compare

    profile = m.profile
    check = check_sweep(sizes, times)
    for w in check.warnings:
        print(f"warning: {w}", flush=True)
    comm = fit(sizes, times, ctx.world_size, args.fit)
    if check.warnings:
        print("the measured allreduce times:\n" + sweep_table(sizes, times, comm), flush=True)
    spec = SyncSpec(clip_mode=cfg.train.clip_mode, tied_sync="dense", reduce_bytes=rb,
                    align=measure.engine_align(), world_size=ctx.world_size,
                    **_shard_spec(cfg, ctx, comm))
    sizes_by_name = profile.sizes()
    from runtime.grad_sync.plan import resolve_tied_sync, split_pays
    pays = split_pays(profile.tied_rows, cfg.tokens_per_step(ctx.world_size), ctx.world_size,
                      ctx.device.type)
    config_plan, config_name = None, f"this config (bucket_cap_mb={cfg.train.bucket_cap_mb:g})"
    if cfg.train.bucket_plan:
        config_plan = BucketPlan.read(cfg.train.bucket_plan, sizes_by_name)
        config_name = f"this config ({Path(cfg.train.bucket_plan).name})"
    else:
        from runtime.calibrate.tune.simulate import Instance
        mode, _ = resolve_tied_sync(cfg.train.tied_embedding_sync, cfg.train.clip_mode,
                                    ctx.world_size, rows=profile.tied_rows,
                                    tokens_per_step=cfg.tokens_per_step(ctx.world_size),
                                    device_type=ctx.device.type)
        alone = profile.tied if mode == "split" else None
        inst = Instance.build(profile, spec, comm)
        config_plan = cap_plan(inst, cfg.train.bucket_cap_mb * MB, config_name, alone)
    K = _num_buckets(args.num_buckets, cfg, config_plan)
    rows = compare(profile, comm, spec, cfg.train.tied_embedding_sync, config_plan, config_name,
                   num_buckets=K, grid=args.grid, try_other_tied=args.both_tied,
                   split_pays=pays)
    if clip_spec(cfg.train.clip_mode).per_bucket and K is not None:  # τ/√K: K is the clip's
        free = next(r for r in compare(profile, comm, spec, cfg.train.tied_embedding_sync,
                                       None, "", None, grid=args.grid) if r.name == "tuned")
        free.candidate.name = "tuned, free K"
        free.candidate.note += (f"; clip threshold τ/√{free.timeline.num_buckets} instead of "
                                f"τ/√{K}: a different clip")
        rows.append(free)
    error = arbitrate.ModelError.of(comm, m.per_step, args.arbitrate_within)
    contenders, left_out = arbitrate.pick(rows, error, sizes_by_name, cfg.train.clip_mode)
    print(profile_summary_text(profile, comm, spec, m, error), flush=True)
    print(f"allreduce sweep ({len(sizes)} sizes):\n" + sweep_table(sizes, times, comm),
          flush=True)
    return Solved(rows, comm, check, spec, K, sizes, times, error, contenders, left_out)


def _shard_spec(cfg, ctx, comm) -> dict:
    """optim.shard in the model: the ranks per update and their collectives, from the
    measured allreduce (runtime.calibrate.tune.simulate.ShardComm.from_allreduce: a
    reduce-scatter or all-gather is half of it; gloo keeps the allreduce for the buckets)."""
    from runtime.calibrate.tune.simulate import ShardComm
    from runtime.grad_sync.shard import REDUCTION
    shard = shard_scope(cfg.optim.shard).ranks_per_update(ctx.world_size, ctx.local_world_size)
    if shard <= 1:
        return {}
    backend = "nccl" if ctx.device.type == "cuda" else "gloo"
    return {"shard": shard, "shard_comm": ShardComm.from_allreduce(comm, REDUCTION[backend])}


def profile_summary_text(profile, comm, spec, m, error) -> str:
    from runtime.calibrate.tune.report import profile_summary
    return (profile_summary(profile, comm, spec) + f"\nproduction order: {m.order_source}"
            + f"\nmodel error: {error.describe()}")


def _write(cfg, ctx, args, m, solved: Solved, decision, t_start) -> int:
    from runtime.calibrate.tune import measure
    from runtime.calibrate.tune.report import arbitration_note, plot_timelines, table

    profile, rows, comm = m.profile, solved.rows, solved.comm
    out = Path(args.out or ROOT / "results" /
               f"tune_{Path(cfg.source).stem}_{datetime.datetime.now():%Y%m%d_%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    tuned = next(r for r in rows if r.name == "tuned")
    chosen = next(r for r in rows if r.name == decision.recommended)
    sol = tuned.candidate.extra["solution"]
    measured = {}   # row name -> measured median (rows sharing a measured plan too)
    for name, rec in decision.measured.items():
        for n in [name] + rec["same_as"]:
            measured[n] = rec["median_s"]
    chosen_measured = decision.measured.get(decision.recommended, {}).get("median_s")
    meta = {"written_by": "python -m runtime.calibrate.tune", "config": cfg.source,
            "overrides": args.set, "world_size": ctx.world_size,
            "clip_mode": cfg.train.clip_mode, "tied_embedding_sync": chosen.candidate.tied_sync,
            "allreduce_dtype": cfg.train.allreduce_dtype, "align": measure.engine_align(),
            "plan": chosen.name, "decided_by": decision.decided_by,
            "predicted_step_s": chosen.timeline.step_s,
            "predicted_exposed_comm_s": chosen.timeline.exposed_s,
            "measured_step_s": chosen_measured,
            "allreduce_model": comm.to_json(), "date": f"{datetime.date.today()}"}
    plan_path = out / "bucket_plan.json"
    chosen.candidate.plan.write(plan_path, profile.sizes(), meta)
    plans = {}
    if args.write_all:
        for r in rows:
            slug = re.sub(r"[^a-z0-9]+", "_", r.name.lower()).strip("_")
            path = out / "plans" / f"{slug}.json"
            r.candidate.plan.write(path, profile.sizes(), {"name": r.name,
                                                           "tied_embedding_sync": r.candidate.tied_sync,
                                                           "predicted_step_s": r.timeline.step_s})
            plans[r.name] = str(path)
    within = [c.name + "".join(f" (= {n})" for n in c.same_as)
              + f" ({(c.predicted_s / tuned.timeline.step_s - 1) * 100:+.1f} %, tolerance "
                f"{c.tolerance_s * 1e3:.0f} ms)" for c in solved.contenders[1:]]
    note = arbitration_note(solved.error.describe(), within, solved.left_out,
                            decision.decided_by, decision.reason, args.no_arbitrate)
    text = table(rows, measured=measured, recommended=decision.recommended) + "\n\n" + note
    print()
    print(text)
    print()
    png = None
    if not args.no_png:
        default = next(r for r in rows if r.name.startswith("this config"))
        drawn = [default.timeline, tuned.timeline] + ([chosen.timeline] if chosen is not tuned
                                                      and chosen is not default else [])
        png = plot_timelines(drawn, out / "timeline.png",
                             title=f"{Path(cfg.source).name}, {ctx.world_size} ranks")
    record = {"command": "python -m runtime.calibrate.tune " + " ".join(sys.argv[1:]),
              "config": cfg.source, "overrides": args.set, "world_size": ctx.world_size,
              "clip_mode": cfg.train.clip_mode, "tied_embedding_sync": cfg.train.tied_embedding_sync,
              "profile": profile.to_json(), "steps": m.steps, "warmup": m.warmup,
              "production_order": m.order_source,
              "engine_first_step_order": m.per_step.get("engine_first_step_order"),
              "contention": m.per_step.get("contention"),
              "sweep": {"bytes": solved.sizes, "seconds": solved.times,
                        "warnings": solved.check.warnings},
              "allreduce_model": comm.to_json(), "align": measure.engine_align(),
              "num_buckets_fixed": solved.num_buckets,
              "table": [{"name": r.name, "buckets": r.timeline.num_buckets,
                         "tied_sync": r.candidate.tied_sync, "note": r.candidate.note,
                         "predicted_step_s": r.timeline.step_s,
                         "predicted_exposed_s": r.timeline.exposed_s,
                         "measured_step_s": measured.get(r.name),
                         "recommended": r.name == decision.recommended,
                         "plan_file": plans.get(r.name), "timeline": r.timeline.to_json()}
                        for r in rows],
              "solver": {"candidates": sol.candidates, "grid": sol.grid,
                         "bound_s": sol.bound_s, "exact": sol.exact,
                         "lower_bound_s": sol.lower_bound_s},
              "arbitration": {"model_error": dataclasses.asdict(solved.error),
                              "contenders": [{"name": c.name, "same_as": c.same_as,
                                              "tied_sync": c.tied_sync,
                                              "predicted_step_s": c.predicted_s,
                                              "tolerance_s": c.tolerance_s}
                                             for c in solved.contenders],
                              "left_out": solved.left_out, "no_arbitrate": args.no_arbitrate,
                              "steps": args.arbitrate_steps, **decision.to_json()},
              "plan": str(plan_path), "png": str(png) if png else None,
              "wall_s": round(time.time() - t_start, 1)}
    (out / "tune.json").write_text(json.dumps(record, indent=1))
    gain = next(r for r in rows if r.name.startswith("this config")).timeline.step_s \
        / chosen.timeline.step_s
    print(f"recommended plan: {plan_path} ({chosen.name}, {chosen.timeline.num_buckets} "
          f"buckets, predicted {chosen.timeline.step_s * 1e3:.1f} ms/step"
          + (f", measured {chosen_measured * 1e3:.1f} ms" if chosen_measured else "")
          + f", {gain:.2f}× this config's buckets predicted; decided by "
          f"{decision.decided_by})\n"
          f"use it:     -- train.bucket_plan={plan_path}"
          + (f"  (train.tied_embedding_sync={chosen.candidate.tied_sync} is what it was "
             f"predicted with; 'auto' picks it from the plan)" if profile.tied else ""))
    if png:
        print(f"timeline:   {png}")
    print(f"record:     {out / 'tune.json'}", flush=True)
    return 0


def _num_buckets(asked: Optional[str], cfg, config_plan) -> Optional[int]:
    if asked is None:
        asked = "config" if clip_spec(cfg.train.clip_mode).per_bucket else "free"
    if asked == "free":
        return None
    if asked == "config":
        return len(config_plan.buckets)
    try:
        k = int(asked)
    except ValueError:
        raise BadInput(f"--num-buckets {asked!r}: give a number, 'free' or 'config'") from None
    if k < 1:
        raise BadInput(f"--num-buckets must be >= 1, got {k}")
    return k


if __name__ == "__main__":
    sys.exit(main())
