"""``python -m bench.shard``: the sharded optimizer (optim.shard) against the unsharded one on 2
CPU ranks - the optimizer phase's time and each rank's memory, in one run.

One ``mpiexec -n 2`` launch (the venv's) builds, on each rank, the real parts of a run
(runtime.train.build: model, bucket engine, fused optimizer on its gradient buffer) twice per
model - ``optim.shard=none`` and ``optim.shard=world`` - fills the gradient buffer with random
numbers, and times the trainer's optimizer phase (runtime.train.trainer ``_step``'s "optimizer"
span: the averaged gradient's norm, the clip multiplier and skip flag, the optimizer step - for
the sharded one its per-tensor partial norms' allreduce and the parameters' all-gather -, the
loss-scale update, zeroing the buffer) in alternating rounds, A B B A ..., ``--reps`` each;
medians and minima of the slower rank's times (a phase ends for the job when its last rank
ends). The sharded phase is also cut into its parts (host time of each collective call: gloo
runs them synchronously here).

Memory per rank: the optimizer's state, parameter and gradient buffers (exact bytes of the
tensors), and the resident-set growth of building each variant's parts.

It also times, on the same 2 ranks, the gloo collectives a sharded step could use for an 8 MiB
and a 32 MiB buffer (runtime/grad_sync/shard.py picks per backend): allreduce, reduce (both
halves to their owners), reduce_scatter(_tensor), broadcast (both halves from their owners),
all_gather(_into_tensor).

    python -m bench.shard [--models cpu,base] [--reps 10] [--out bench/results/shard.json]

Models: 'cpu' (the CPU benchmark config's 2-layer BERT, submission/configs/
config_CPU_1x2x32x1.toml), 'base' (BERT-base's shapes, runtime.model.arithmetic). A benchmark,
not a test: keep the machine otherwise idle (the record notes the load average at the end).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import Benchmark, Stop, listed, option, out, run

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "shard.json"
CONFIG = REPO / "submission" / "configs" / "config_CPU_1x2x32x1.toml"
MODELS = {"cpu": [], "base": None}  # base: BERT-base's shape over the CPU config's keys


def _overrides(model: str) -> list[str]:
    if MODELS[model] is not None:
        return MODELS[model]
    from basis.model_shape import SIZES
    return [f"model.{k}={v}" for k, v in SIZES[model].items()]
MODES = ("none", "world")


# ------------------------------------------------------------------------------- the worker

def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1])
    return 0


def _buffers(parts) -> dict:
    binding = parts.optimizer.flat_binding
    (part,) = binding.parts
    b = part.buffers
    return {"optimizer_state_bytes": sum(t.numel() * t.element_size() for t in b.state.values()),
            "parameter_bytes": b.params.numel() * b.params.element_size(),
            "gradient_bytes": b.grads.numel() * b.grads.element_size(),
            "elements": sum(p.numel() for p in part.params)}


class _Timers:
    """Host seconds inside the shard's collectives (wrapped for the timed rounds)."""

    def __init__(self):
        from runtime.grad_sync.shard import Shard
        self.cls, self.real = Shard, {n: getattr(Shard, n) for n in ("sum_", "gather")}
        self.sums: dict[str, float] = {n: 0.0 for n in self.real}
        for name, real in self.real.items():
            def timed(shard, *a, _real=real, _name=name):
                t0 = time.perf_counter()
                try:
                    return _real(shard, *a)
                finally:
                    self.sums[_name] += time.perf_counter() - t0
            setattr(Shard, name, timed)

    def take(self) -> dict:
        out, self.sums = self.sums, {n: 0.0 for n in self.real}
        return out

    def restore(self):
        for name, real in self.real.items():
            setattr(self.cls, name, real)


def optimizer_phase(parts, cfg, scale) -> float:
    """The trainer's optimizer span (runtime/train/trainer.py, _step); returns the seconds of
    its last part, zeroing the gradient buffer (the same full buffer in both variants: every
    rank accumulates its whole local gradient)."""
    from runtime.optim.grad_scale import step_multiplier
    sync = parts.grad_sync
    grad_scale, found_inf, _, _ = step_multiplier(sync.grad_norm(), scale.scale,
                                                  max_norm=cfg.train.max_grad_norm, clip=True)
    parts.optimizer.step(grad_scale=grad_scale, found_inf=found_inf)
    scale.update(~found_inf)
    t0 = time.perf_counter()
    sync.zero_grad()
    return time.perf_counter() - t0


def _collectives(reps: int) -> list[dict]:
    import torch
    import torch.distributed as d
    rank, world = d.get_rank(), d.get_world_size()
    out = []
    for mib in (8, 32):
        n = mib * 2 ** 20 // 4
        full = torch.randn(n)
        half = n // world
        chunks = list(full.split(half))
        ops = {
            "allreduce": lambda: d.all_reduce(full),
            "reduce to each half's owner": lambda: [d.reduce(c, dst=j)
                                                    for j, c in enumerate(chunks)],
            "reduce_scatter (list)": lambda: d.reduce_scatter(torch.empty(half), chunks),
            "reduce_scatter_tensor": lambda: d.reduce_scatter_tensor(torch.empty(half), full),
            "broadcast of each half from its owner": lambda: [d.broadcast(c, src=j)
                                                              for j, c in enumerate(chunks)],
            "all_gather (list)": lambda: d.all_gather(chunks, chunks[rank].clone()),
            "all_gather_into_tensor": lambda: d.all_gather_into_tensor(full, chunks[rank]),
        }
        for name, fn in ops.items():
            fn()
            times = []
            for _ in range(reps):
                d.barrier()
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            worst = torch.tensor(times, dtype=torch.float64)
            d.all_reduce(worst, op=d.ReduceOp.MAX)
            out.append({"op": name, "mib": mib, "median_s": statistics.median(worst.tolist()),
                        "min_s": min(worst.tolist())})
    return out


def _build(models_overrides: list[str], ctx) -> tuple[dict, dict]:
    """Both variants' parts of one model (the sharded one first: its growth is not hidden)
    and each one's memory; each variant warmed up (first touch, caches) untimed."""
    import torch
    from runtime.config import load_config
    from runtime.optim.grad_scale import DynamicLossScale
    from runtime.train.build import build_parts
    built, memory = {}, {}
    for mode in reversed(MODES):
        cfg = load_config(CONFIG, [*models_overrides, f"optim.shard={mode}"])
        rss = _rss_kib()
        parts = build_parts(cfg, ctx, train_loader=False, eval_batches=False)
        memory[mode] = {**_buffers(parts), "rss_growth_bytes": (_rss_kib() - rss) * 1024}
        built[mode] = (cfg, parts, DynamicLossScale(1.0, enabled=False))
    for mode, (cfg, parts, scale) in built.items():
        torch.manual_seed(1 + ctx.rank)
        parts.grad_sync.flat.normal_()
        for _ in range(2):
            parts.grad_sync.flat.normal_()
            optimizer_phase(parts, cfg, scale)
    for _, parts, _ in built.values():  # the step's own reference to the shard's sum
        (part,) = parts.optimizer.flat_binding.parts
        if part.shard is not None:
            part.engine.combine = part.shard.sum_
    return built, memory


def _rounds(built: dict, reps: int) -> tuple[dict, dict]:
    """Each variant's optimizer phase in alternating rounds (A B B A ...): this rank's
    seconds, and its parts' (the shard's collectives, the zeroing)."""
    import torch.distributed as d
    timers = _Timers()
    times = {m: [] for m in MODES}
    parts_of = {m: {"sum_": [], "gather": [], "zero": []} for m in MODES}
    try:
        for r in range(reps):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                cfg, parts, scale = built[mode]
                parts.grad_sync.flat.normal_()  # outside the timed phase
                d.barrier()
                t0 = time.perf_counter()
                zero = optimizer_phase(parts, cfg, scale)
                times[mode].append(time.perf_counter() - t0)
                parts_of[mode]["zero"].append(zero)
                for k, v in timers.take().items():
                    parts_of[mode][k].append(v)
    finally:
        timers.restore()
    return times, parts_of


def _slowest(values: list[float]) -> list[float]:
    """Per round, the slower rank's value (a phase ends for the job when its last rank does)."""
    import torch
    import torch.distributed as d
    worst = torch.tensor(values, dtype=torch.float64)
    d.all_reduce(worst, op=d.ReduceOp.MAX)
    return worst.tolist()


def _summary(built: dict, memory: dict, times: dict, parts_of: dict) -> dict:
    """Medians and minima of the slower rank's phases, the parts, memory, and the ratios."""
    summary = {}
    for mode in MODES:
        w = _slowest(times[mode])
        # without the zeroing: this rank's phase minus its zeroing, the slower rank's
        rest = _slowest([t - z for t, z in zip(times[mode], parts_of[mode]["zero"])])
        shard = built[mode][1].grad_sync.shard
        summary[mode] = {"median_s": statistics.median(w), "min_s": min(w),
                         "times_s": [round(x, 5) for x in w],
                         "without_zeroing_median_s": statistics.median(rest),
                         "zeroing_median_s": statistics.median(parts_of[mode]["zero"]),
                         "norm_and_partials_allreduce_median_s":
                             statistics.median(parts_of[mode]["sum_"]),
                         "parameter_gather_median_s":
                             statistics.median(parts_of[mode]["gather"]),
                         "memory": memory[mode],
                         "shard": shard.describe() if shard is not None else None}
    w, u = summary["world"], summary["none"]
    summary["ratio_median"] = w["median_s"] / u["median_s"]
    summary["ratio_without_zeroing_median"] = (w["without_zeroing_median_s"]
                                               / u["without_zeroing_median_s"])
    summary["ratio_min"] = w["min_s"] / u["min_s"]
    summary["state_ratio"] = (memory["world"]["optimizer_state_bytes"]
                              / memory["none"]["optimizer_state_bytes"])
    return summary


def worker(args) -> None:
    """One rank of the ``mpiexec -n 2`` launch: every model's variants, then the collectives;
    rank 0 prints the result as a ``RESULT`` line."""
    import warnings
    warnings.simplefilter("ignore", FutureWarning)  # gloo's deprecated collective names
    import torch
    from runtime.launch.dist import init_distributed, shutdown
    from runtime.launch.env import discover
    ctx = init_distributed(discover(), device="cpu", timeout_s=600)
    torch.set_num_threads(1)
    result = {"models": {}, "threads_per_rank": torch.get_num_threads(),
              "world_size": ctx.world_size}
    for model in args.models:
        built, memory = _build(_overrides(model), ctx)
        times, parts_of = _rounds(built, args.reps)
        result["models"][model] = _summary(built, memory, times, parts_of)
        for _, parts, _ in built.values():
            parts.grad_sync.close()
        del built
    result["collectives"] = _collectives(max(3, args.reps // 2))
    if ctx.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    shutdown()


# ------------------------------------------------------------------------------- the parent

def table(res: dict) -> str:
    lines = ["| model | parameters | optimizer phase, unsharded: median (min) ms | sharded (world, "
             "2 ranks) | ratio median (min) | without zeroing the gradient buffer: unsharded / "
             "sharded ms (ratio) | of it: norm + partials allreduce ms | parameter "
             "gather ms | optimizer state per rank MiB: unsharded / sharded (ratio) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for model, s in res["models"].items():
        u, w = s["none"], s["world"]
        mib = 2 ** 20
        lines.append(
            f"| {model} | {u['memory']['elements'] / 1e6:.1f} M | {u['median_s'] * 1e3:.1f} "
            f"({u['min_s'] * 1e3:.1f}) | {w['median_s'] * 1e3:.1f} ({w['min_s'] * 1e3:.1f}) | "
            f"{s['ratio_median']:.2f} ({s['ratio_min']:.2f}) | "
            f"{u['without_zeroing_median_s'] * 1e3:.1f} / {w['without_zeroing_median_s'] * 1e3:.1f}"
            f" ({s['ratio_without_zeroing_median']:.2f}) | "
            f"{w['norm_and_partials_allreduce_median_s'] * 1e3:.2f} | "
            f"{w['parameter_gather_median_s'] * 1e3:.1f} | "
            f"{u['memory']['optimizer_state_bytes'] / mib:.1f} / "
            f"{w['memory']['optimizer_state_bytes'] / mib:.1f} ({s['state_ratio']:.3f}) |")
    lines += ["", "| gloo collective, 2 ranks | 8 MiB median ms | 32 MiB median ms |",
              "|---|---|---|"]
    by_op: dict[str, dict] = {}
    for c in res["collectives"]:
        by_op.setdefault(c["op"], {})[c["mib"]] = c["median_s"]
    for op, v in by_op.items():
        lines.append(f"| {op} | {v[8] * 1e3:.1f} | {v[32] * 1e3:.1f} |")
    return "\n".join(lines)


def launch(r, case) -> dict:
    """The two ranks, ``mpiexec -n 2`` (the venv's): their result."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [str(mpiexec), "-n", "2", sys.executable, "-m", "bench.shard", "--worker",
           "--models", ",".join(r.args.models), "--reps", str(r.args.reps)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=3600)
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not found:
        raise Stop("the ranks failed (exit {}):\n{}".format(
            proc.returncode, proc.stdout[-3000:] + proc.stderr[-3000:]))
    return json.loads(found[-1][len("RESULT "):])


BENCHMARK = Benchmark(
    "shard", __doc__, launch,
    options=(option("--models", type=listed(MODELS, what="model"), default="cpu,base"),
             option("--reps", type=int, default=10), out(RESULTS)),
    check=lambda a: "--reps >= 2" if a.reps < 2 else None,
    instead=(("--worker", worker),),
    fields=lambda a: dict(models=a.models, reps=a.reps, ranks=2,
                          config=str(CONFIG.relative_to(REPO)),
                          load_avg_1m_at_start=round(os.getloadavg()[0], 2)),
    summary=lambda r: r.results[0], table=table,
    line=lambda rec: {"benchmark": "shard", **{
        m: {"ratio_median": s["ratio_median"], "state_ratio": s["state_ratio"]}
        for m, s in rec["models"].items()}})


def main(argv=None) -> int:
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
