"""``python -m bench.time_to_accuracy``: time to target accuracy, this runtime vs plain PyTorch.

Side by side in one run, same config (model, data, global batch, schedule, eval cadence,
target, budget) and seeds: for each seed it trains

  runtime   ``SEED=s CONFIG=CFG RUN_DIR=... ./run_and_time.sh -- OVERRIDES``; time =
            run_stop − run_start of the run's ``mlperf_bert.log`` (MLPerf's timed region),
            samples = epoch_num of the last eval_accuracy, status from run_stop's metadata;
            throughput and padding efficiency from rank 0's ``metrics.jsonl`` step records;
  baseline  ``torchrun --standalone --nproc_per_node RANKS bench/baseline_ddp.py --config CFG
            --set train.seed=s --set OVERRIDES --out FILE`` (the recipe a user would write: DDP
            default buckets, torch AdamW, clip_grad_norm_ after backward, random batches padded
            to max length; see that file), timed the same way (init excluded).

The order alternates per seed (1st seed runtime first, 2nd baseline first, ...) so slow drift
of the machine falls on both. Then it prints a table (per seed, and the median over seeds that
reached the target), a final JSON line, and writes the same record to ``--out``.

A run that does not reach the target is kept, with its status (``aborted``; ``failed`` when it
crashed) and time_to_target_s = None. ``ratio_time`` = median baseline time / median runtime
time over the seeds where *both* reached the target (``ratio_seeds`` says which); likewise
``ratio_samples``. Above 1 means the runtime is faster.

    python -m bench.time_to_accuracy --config submission/configs/config_CPU_1x2x32x1.toml \\
        --seeds 1,2,3 [--set section.key=value ...] [--baseline-lr 2e-3] \\
        [--out bench/results/time_to_accuracy.json] [--workdir DIR]

Two more modes share the runs and the parsing:

  --sweep-baseline-lr 5e-4,1e-3,2e-3   the baseline (plain AdamW) at each lr on the first seed,
            usually with a shorter budget (--set train.max_samples_termination=N); picks the lr
            with the fewest samples to target, else the highest last accuracy — the recorded
            sweep that gives the plain recipe (and the ablation's AdamW) its lr;
  --ablation [VARIANTS]  the runtime's best configuration with one mechanism switched off at a
            time (ABLATION below: random_padded, reference_optim, ddp_sync, and adamw or lamb
            — the optimizer the config does not use; ``best`` is the config as it is), every
            variant on every seed, the order rotated per seed; a table of medians and each
            variant's time relative to ``best``.

Run directories and each run's console output (``*.out``) stay in ``--workdir`` (default
``results/time_to_accuracy_<date>/``). A benchmark, not a test: it measures whatever machine
runs it; keep the machine otherwise idle.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import shlex
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from bench.common import REPO, failed_run, fmt, launch, run_runtime, tail
from bench.harness import TIMEOUT, Benchmark, listed, option, out, run, seeds

RESULTS = REPO / "bench" / "results" / "time_to_accuracy.json"
BASELINE = REPO / "bench" / "baseline_ddp.py"


# ----------------------------------------------------------------------------- aggregation

def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[dict]) -> dict:
    """Medians of one system's runs. Time and samples to target: over runs that reached it
    (``reached`` of ``of`` say how many); throughput and padding: over every run."""
    ok = [r for r in runs if r.get("status") == "success"]
    return {"reached": len(ok), "of": len(runs),
            "median_time_to_target_s": _median(r["time_to_target_s"] for r in ok),
            "median_samples_to_target": _median(r["samples_to_target"] for r in ok),
            "median_throughput_samples_per_s": _median(r.get("throughput_samples_per_s")
                                                       for r in runs),
            "median_padding_efficiency": _median(r.get("padding_efficiency") for r in runs),
            "runs": runs}


def compare(runtime_runs: list[dict], baseline_runs: list[dict]) -> dict:
    """Ratios baseline / runtime over the seeds where both reached the target."""
    by_seed = {r["seed"]: r for r in runtime_runs}
    pairs = [(by_seed[b["seed"]], b) for b in baseline_runs
             if b["seed"] in by_seed and b.get("status") == "success"
             and by_seed[b["seed"]].get("status") == "success"]

    def ratio(key):
        rt = _median(r[key] for r, _ in pairs)
        bl = _median(b[key] for _, b in pairs)
        return bl / rt if rt and bl is not None else None

    n = len({r["seed"] for r in runtime_runs} | {b["seed"] for b in baseline_runs})
    return {"ratio_time": ratio("time_to_target_s"), "ratio_samples": ratio("samples_to_target"),
            "ratio_seeds": [r["seed"] for r, _ in pairs],
            "ratio_note": f"median baseline / median runtime over the {len(pairs)} of {n} "
                          "seeds where both reached the target"}


# ----------------------------------------------------------------------------------- runs

def run_baseline(config: Path, seed: int, overrides: list[str], workdir: Path, nproc: int,
                 baseline_lr: float | None = None, timeout: float | None = None,
                 name: str = "baseline") -> dict:
    out = workdir / f"{name}_seed{seed}.json"
    log = workdir / f"{name}_seed{seed}.out"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(BASELINE), "--config", str(config),
           "--set", f"train.seed={seed}"]
    for o in overrides:
        cmd += ["--set", o]
    if baseline_lr is not None:
        cmd += ["--baseline-lr", repr(baseline_lr)]
    cmd += ["--out", str(out)]
    rc, wall = launch(cmd, dict(os.environ), log, timeout)
    if out.is_file():
        rec = json.loads(out.read_text())
    else:
        rec = failed_run(tail(log))
    rec.update(system=name, seed=seed, rc=rc, wall_s=wall, summary=str(out),
               console=str(log), command=shlex.join(cmd))
    return rec


# ------------------------------------------------------------------------ ablation, lr sweep

# Each variant switches one mechanism of the best configuration off (issue 14's ablation);
# "{adamw_lr}" is the baseline's AdamW lr from the recorded sweep (--baseline-lr), "{lamb_lr}"
# LAMB's from its probe (--lamb-lr). The optimizer variant is the one the config does not use.
ABLATION: dict[str, tuple[str, list[str]]] = {
    "best": ("the config as it is", []),
    "random_padded": ("length balancing and unpadding off: random batches, padded attention",
                      ["data.balance=random", "model.attention=padded"]),
    "reference_optim": ("fused optimizer off: the per-tensor plain-torch reference step",
                        ["optim.backend=reference"]),
    "ddp_sync": ("overlapped buckets and split tied-embedding sync off: torch DDP, default "
                 "25 MiB buckets, dense embedding allreduce", ["train.grad_sync=ddp"]),
    "adamw": ("LAMB off: AdamW at the baseline's swept lr",
              ["optim.name=adamw", "optim.lr={adamw_lr}"]),
    "lamb": ("AdamW off: LAMB at its probed lr", ["optim.name=lamb", "optim.lr={lamb_lr}"]),
}
LR_FLAG = {"adamw": "--baseline-lr", "lamb": "--lamb-lr"}


def default_variants(optimizer: str) -> list[str]:
    """Every variant, with the optimizer swap the config's optimizer calls for."""
    other = "adamw" if optimizer != "adamw" else "lamb"
    return [v for v in ABLATION if v not in LR_FLAG or v == other]


def ablation_overrides(variant: str, adamw_lr: float | None = None,
                       lamb_lr: float | None = None) -> list[str]:
    return [o.format(adamw_lr=repr(adamw_lr), lamb_lr=repr(lamb_lr))
            for o in ABLATION[variant][1]]


def ablation_table(record: dict) -> str:
    """One row per variant: medians, and the best configuration's time as a ratio (time of the
    variant / time of best: how much slower switching that mechanism off makes the run)."""
    V = record["variants"]
    best = V.get("best", {}).get("median_time_to_target_s")
    head = (f"{'variant':<16} {'reached':>7} {'time_s':>8} {'samples':>8} {'smp/s':>7} "
            f"{'pad':>5} {'x best':>6}")
    lines = [head, "-" * len(head)]
    for v, s in V.items():
        t = s["median_time_to_target_s"]
        lines.append(f"{v:<16} {s['reached']:>3}/{s['of']:<3} {fmt(t, '.1f'):>8} "
                     f"{fmt(s['median_samples_to_target'], '.0f'):>8} "
                     f"{fmt(s['median_throughput_samples_per_s'], '.1f'):>7} "
                     f"{fmt(s['median_padding_efficiency'], '.2f'):>5} "
                     f"{fmt(t / best if t and best else None, '.2f'):>6}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- report

def run_line(seed: int, label: str, rec: dict) -> str:
    """One line per finished run (and the error's tail when it failed), as the runs go."""
    line = (f"  seed {seed} {label:<16} {rec['status']:<8} time_to_target "
            f"{fmt(rec['time_to_target_s'], '.1f')} s, samples "
            f"{fmt(rec.get('samples_to_target'), 'd')}, "
            f"{fmt(rec.get('throughput_samples_per_s'), '.1f')} samples/s, last acc "
            f"{fmt(rec.get('eval_accuracy'), '.4f')} (wall {rec['wall_s']:.0f} s)")
    if rec["status"] == "failed":
        line += (f"\n    failed (rc {rec['rc']}); see {rec['console']}:\n"
                 + "\n".join("    " + ln for ln in rec.get("error", "").splitlines()))
    return line


def table(record: dict) -> str:
    rt = {r["seed"]: r for r in record["runtime"]["runs"]}
    bl = {r["seed"]: r for r in record["baseline"]["runs"]}
    head = (f"{'seed':>6} {'first':>8} | {'runtime':>8} {'time_s':>8} {'samples':>8} "
            f"{'smp/s':>7} {'pad':>5} | {'baseline':>8} {'time_s':>8} {'samples':>8} "
            f"{'smp/s':>7} {'pad':>5} | {'t ratio':>7}")
    lines = [head, "-" * len(head)]
    for i, seed in enumerate(record["seeds"]):
        r, b = rt.get(seed, {}), bl.get(seed, {})
        ratio = (b["time_to_target_s"] / r["time_to_target_s"]
                 if r.get("time_to_target_s") and b.get("time_to_target_s") else None)
        lines.append(
            f"{seed:>6} {record['order'][i]:>8} | {r.get('status', '-'):>8} "
            f"{fmt(r.get('time_to_target_s'), '.1f'):>8} {fmt(r.get('samples_to_target'), 'd'):>8} "
            f"{fmt(r.get('throughput_samples_per_s'), '.1f'):>7} "
            f"{fmt(r.get('padding_efficiency'), '.2f'):>5} | {b.get('status', '-'):>8} "
            f"{fmt(b.get('time_to_target_s'), '.1f'):>8} {fmt(b.get('samples_to_target'), 'd'):>8} "
            f"{fmt(b.get('throughput_samples_per_s'), '.1f'):>7} "
            f"{fmt(b.get('padding_efficiency'), '.2f'):>5} | {fmt(ratio, '.2f'):>7}")
    R, B = record["runtime"], record["baseline"]

    def med(s, key, spec):
        v = s[key]
        if spec == "d" and v is not None:
            v = int(round(v))
        return fmt(v, spec)
    r_ok, b_ok = f"{R['reached']}/{R['of']} ok", f"{B['reached']}/{B['of']} ok"
    lines.append("-" * len(head))
    lines.append(
        f"{'median':>6} {'':>8} | {r_ok:>8} "
        f"{med(R, 'median_time_to_target_s', '.1f'):>8} "
        f"{med(R, 'median_samples_to_target', 'd'):>8} "
        f"{med(R, 'median_throughput_samples_per_s', '.1f'):>7} "
        f"{med(R, 'median_padding_efficiency', '.2f'):>5} | {b_ok:>8} "
        f"{med(B, 'median_time_to_target_s', '.1f'):>8} "
        f"{med(B, 'median_samples_to_target', 'd'):>8} "
        f"{med(B, 'median_throughput_samples_per_s', '.1f'):>7} "
        f"{med(B, 'median_padding_efficiency', '.2f'):>5} | {fmt(record['ratio_time'], '.2f'):>7}")
    lines.append(f"ratio_time (baseline/runtime) = {fmt(record['ratio_time'], '.3f')}, "
                 f"ratio_samples = {fmt(record['ratio_samples'], '.3f')}: {record['ratio_note']}")
    return "\n".join(lines)


COMPACT_RUN_KEYS = ("seed", "status", "time_to_target_s", "samples_to_target",
                    "throughput_samples_per_s", "padding_efficiency", "eval_accuracy")


def compact(record: dict) -> dict:
    """The record for the final JSON line: per-run details (eval history, commands, paths)
    stay in the --out file."""
    out = dict(record)
    for system in ("runtime", "baseline"):
        out[system] = dict(record[system], runs=[{k: r.get(k) for k in COMPACT_RUN_KEYS}
                                                 for r in record[system]["runs"]])
    return out


# ------------------------------------------------------------------------------------ rows

def check(a) -> str | None:
    """The config must load; an ablation's variants must exist and have their lrs. Completes
    the arguments: the config, its rank count, the work folder."""
    from runtime.config import ConfigError, load_config
    try:
        a.cfg = load_config(a.config, a.set)
    except (ValueError, ConfigError) as e:
        return str(e)
    a.nproc = a.cfg.system.nodes * a.cfg.system.ranks_per_node
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    a.workdir = (a.workdir or REPO / "results" / f"time_to_accuracy_{stamp}").resolve()
    if a.ablation and not a.sweep_baseline_lr:
        a.variants = (default_variants(a.cfg.optim.name) if a.ablation == "auto" else
                      [v.strip() for v in a.ablation.split(",") if v.strip()])
        unknown = [v for v in a.variants if v not in ABLATION]
        if unknown:
            return f"unknown ablation variant(s) {unknown}: choose from {', '.join(ABLATION)}"
        lrs = {"adamw": a.baseline_lr, "lamb": a.lamb_lr}
        for v, flag in LR_FLAG.items():
            if v in a.variants and lrs[v] is None:
                return f"the {v} variant needs {flag} (its tuned lr)"
    return None


@contextlib.contextmanager
def workdir(r):
    a = r.args
    a.workdir.mkdir(parents=True, exist_ok=True)
    print(f"time_to_accuracy: {a.config.name}, seeds {a.seeds}, {a.nproc} ranks, target "
          f"{a.cfg.train.target_mlm_accuracy}, max_steps {a.cfg.train.max_steps}; logs in "
          f"{a.workdir}", flush=True)
    yield a.workdir


def systems(r):
    """Per seed both systems, the one first alternating (1st seed runtime first, ...)."""
    for i, seed in enumerate(r.args.seeds):
        pair = ["runtime", "baseline"] if i % 2 == 0 else ["baseline", "runtime"]
        for system in pair:
            yield seed, system


def measure_system(r, case) -> dict:
    seed, system = case
    a = r.args
    if system == "runtime":
        return run_runtime(a.config.resolve(), seed, a.set, a.workdir, a.timeout)
    return run_baseline(a.config.resolve(), seed, a.set, a.workdir, a.nproc, a.baseline_lr,
                        a.timeout)


def side_by_side(r) -> dict:
    runs = {s: [x for x in r.results if x["system"] == s] for s in ("runtime", "baseline")}
    return dict(order=["runtime" if i % 2 == 0 else "baseline"
                       for i in range(len(r.args.seeds))],
                baseline_lr=runs["baseline"][0].get("lr") if runs["baseline"] else None,
                runtime=summarize(runs["runtime"]), baseline=summarize(runs["baseline"]),
                **compare(runs["runtime"], runs["baseline"]))


def fields(a) -> dict:
    return dict(config=str(a.config), overrides=a.set, seeds=a.seeds,
                target_mlm_accuracy=a.cfg.train.target_mlm_accuracy, workdir=str(a.workdir))


BENCHMARK = Benchmark(
    "time_to_accuracy", __doc__, measure_system, systems,
    options=(option("--config", type=Path,
                    default=REPO / "submission" / "configs" / "config_CPU_1x2x32x1.toml"),
             seeds("1,2,3"),
             option("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="config override for both systems (repeatable)"),
             option("--baseline-lr", type=float, default=None,
                    help="baseline AdamW lr when the config's optimizer is not adamw "
                         "(default: bench/baseline_ddp.py's)"),
             out(RESULTS),
             option("--workdir", type=Path, default=None, help="run directories and console "
                    "logs (default results/time_to_accuracy_<date>)"),
             TIMEOUT,
             option("--ablation", nargs="?", const="auto", default=None, metavar="VARIANTS",
                    help="instead of runtime vs baseline: the runtime with one mechanism "
                         "switched off at a time (comma-separated from "
                         + ", ".join(ABLATION) + "; default: all, with the optimizer swap "
                         "the config's optimizer calls for); adamw uses --baseline-lr, "
                         "lamb --lamb-lr"),
             option("--lamb-lr", type=float, default=None,
                    help="LAMB's lr for the ablation's lamb variant"),
             option("--sweep-baseline-lr", type=listed(kind=float, what="lr"), default=None,
                    metavar="LRS", help="instead: the baseline at each of these AdamW lrs "
                    "(comma-separated) on the first seed; pass a shorter budget with --set")),
    check=check, fields=fields, setup=workdir,
    progress=lambda r, case, x: run_line(case[0], case[1], x),
    summary=side_by_side, table=table, line=compact,
    mode=lambda a: SWEEP if a.sweep_baseline_lr else ABLATE if a.ablation else None)


def sweep_row(r, lr: float) -> dict:
    """The baseline (plain AdamW) at one lr, the first seed, the caller's overrides
    (typically a shorter budget)."""
    a = r.args
    rec = run_baseline(a.config.resolve(), a.seeds[0], a.set, a.workdir, a.nproc, lr,
                       a.timeout, name=f"sweep_lr{lr:g}")
    return {"lr": lr, "status": rec["status"],
            "samples_to_target": rec.get("samples_to_target"),
            "eval_accuracy": rec.get("eval_accuracy"),
            "eval_history": [h[:2] for h in rec.get("eval_history", [])],
            "console": rec.get("console")}


def sweep_pick(r) -> dict:
    """The lr reaching the target in the fewest samples; else the highest last accuracy."""
    rows = r.results
    ok = [x for x in rows if x["samples_to_target"]]
    pick = (min(ok, key=lambda x: x["samples_to_target"]) if ok
            else max(rows, key=lambda x: x["eval_accuracy"] or -1.0))
    return {"seed": r.args.seeds[0], "rows": rows, "chosen_lr": pick["lr"],
            "rule": "fewest samples to target; else highest last eval accuracy"}


def sweep_table(rec: dict) -> str:
    return "\n".join([f"lr {x['lr']:<8g} {x['status']:<8} samples_to_target "
                      f"{fmt(x['samples_to_target'], 'd'):>6}  last acc "
                      f"{fmt(x['eval_accuracy'], '.4f')}" for x in rec["rows"]]
                     + [f"chosen lr: {rec['chosen_lr']:g} ({rec['rule']})"])


SWEEP = replace(
    BENCHMARK, name="baseline_lr_sweep", module="bench.time_to_accuracy", measure=sweep_row,
    cases=lambda r: r.args.sweep_baseline_lr, summary=sweep_pick, table=sweep_table,
    progress=lambda r, lr, x: f"  sweep lr {lr:g}: {x['status']}, eval history "
                              f"{[(int(h[0]), round(h[1], 4)) for h in x['eval_history']]}",
    line=lambda rec: dict(rec, rows=[{k: x[k] for k in ("lr", "status", "samples_to_target",
                                                        "eval_accuracy")}
                                     for x in rec["rows"]]), mode=None)
"""``--sweep-baseline-lr``: the baseline's lr sweep (module docstring)."""


def ablation_cases(r):
    """Every variant on every seed, the variant order rotated per seed."""
    v = r.args.variants
    for i, seed in enumerate(r.args.seeds):
        for name in v[i % len(v):] + v[:i % len(v)]:
            yield seed, name


def ablation_run(r, case) -> dict:
    seed, v = case
    a = r.args
    return run_runtime(a.config.resolve(), seed,
                       [*a.set, *ablation_overrides(v, a.baseline_lr, a.lamb_lr)], a.workdir,
                       a.timeout, name=v)


def ablation_summary(r) -> dict:
    a, v = r.args, r.args.variants
    return {"adamw_lr": a.baseline_lr, "lamb_lr": a.lamb_lr,
            "variants": {n: dict(summarize([x for x in r.results if x["system"] == n]),
                                 what=ABLATION[n][0],
                                 overrides=ablation_overrides(n, a.baseline_lr, a.lamb_lr))
                         for n in v},
            "order": [v[i % len(v):] + v[:i % len(v)] for i in range(len(a.seeds))]}


ABLATE = replace(
    BENCHMARK, name="ablation", module="bench.time_to_accuracy", measure=ablation_run,
    cases=ablation_cases, summary=ablation_summary, table=ablation_table,
    line=lambda rec: dict(rec, variants={v: {k: x for k, x in s.items() if k != "runs"}
                                         for v, s in rec["variants"].items()}), mode=None)
"""``--ablation``: the runtime with one mechanism switched off at a time."""


def main(argv=None) -> int:
    sys.path.insert(0, str(REPO))
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
