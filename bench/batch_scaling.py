"""``python -m bench.batch_scaling``: how far the batch can grow - steps and samples to a target
against the global batch, per optimizer and learning-rate scaling rule, McCandlish's trade-off
fitted to them, and the gradient noise scale the runs measured beside it.

Samples-to-target is hardware-independent: what this 2-core machine measures of it is the
real thing for the proxy model measured (not of BERT-large, whose numbers are the MLPerf
reference convergence points). The proxy: the CPU benchmark config with 2 layers of hidden
64, trained on 2 ranks on a seq-64 set of the repository's Wikipedia text (``--data``, built
here with loaders.prepare when missing), to masked-LM accuracy ``--target`` (0.10: past the
unigram plateau of ~0.065, so reaching it takes context, and the accuracy still climbs
steeply there, so samples-to-target is sharply defined).

For each optimizer (LAMB, AdamW; LARS with ``--optimizers``) and batch B of ``--batches``
(≥ 6 sizes over ≥ 32×; on 2 ranks, larger batches by gradient accumulation), each rule scales
the base learning rate tuned at ``--base-batch`` B0 (``--calibrate`` sweeps it):
  linear   lr·B/B0, warm-up the same number of samples (Goyal et al.: fewer steps);
  sqrt     lr·√(B/B0) with LEGW's warm-up: warm-up samples × B/B0, i.e. the same number of
           steps (You et al., arXiv 1901.08256).
The schedule decays over the same number of samples at every batch (poly, total steps =
``decay_samples``/B), so a batch changes the step count, not the schedule's shape in samples.
Each run's budget is 4× its expected samples, at most ``--max-samples-factor`` (6) × its
optimizer's samples at the base batch: a run short of the target by then counts as not
reaching it (a batch needing 6× the samples of the base batch is far past the knee).
Each run evaluates every ~7 % of its expected samples to target (never less than a step),
and samples/steps to target are read at the eval where the accuracy first reaches the target,
linearly interpolated between it and the eval before (``resolution`` says how fine).

The fit: McCandlish et al. (arXiv 1812.06162): S = S_min + E_min/B (steps against batch;
(S/S_min − 1)(E/E_min − 1) = 1), least squares on the seed means, weighted by 1/S²;
B_crit = E_min/S_min. Beside it, B_simple: the noise scale the runs reported
(runtime.observe.noise_scale: the whole gradient's, averaged over the last
``train.noise_scale_horizon_samples`` samples) at the step they reached the target, median
over the runs. ``--remeasure-noise`` (with ``--reuse``) reruns only the runs that reached the
target - the ones with a B_simple at target - and takes every other run from the record, with
the earlier samples to target and B_simple kept beside the new ones (``before``): how the
figure was re-measured after issue 36 (before it, the split tied-embedding sync left the tied
weight out of both norms, and the averages spanned 100 steps at every batch).

    python -m bench.batch_scaling --calibrate --out bench/results/batch_scaling_cal.json
    python -m bench.batch_scaling --out bench/results/batch_scaling.json \\
        --batches 32,64,128,256,512,1024 --seeds 1,2 [--png docs/batch_scaling.png]

Writes the record (with ``samples_table``: global batch → samples, the best rule per
optimizer, which ``python -m runtime.calibrate.tune --simulate --samples`` reads), a table
and a log-log plot (samples against steps to target per optimizer and rule, the perfect
scaling line, B_crit and B_simple marked). The record is rewritten after every run
(``complete: false`` until the end); ``--reuse RECORD`` takes the runs an earlier record
already has (same overrides, an outcome the budget would not change), so an interrupted study
resumes by rerunning its command with ``--reuse`` of its own record. About 3 hours for the
default grid (44 runs); samples and steps do not depend on the machine's load, wall times do.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

from bench.common import REPO, run_runtime
from bench.harness import (WORKDIR, Benchmark, Column, listed, markdown, option, out, run,
                           seeds)
from runtime.config import load_config

CONFIG = REPO / "submission" / "configs" / "config_CPU_1x2x32x1.toml"
DATA = REPO / "data" / "scaling64"
RANKS = 2
MAX_LOCAL = 128       # sequences per rank per micro-step; more by gradient accumulation
BASE_LR = {"lamb": 2e-2, "adamw": 2e-3, "lars": 2.0}   # at the base batch (--calibrate)
WARMUP_STEPS = 20     # at the base batch
PROXY = ["model.num_hidden_layers=2", "model.hidden_size=64", "model.num_attention_heads=2",
         "model.intermediate_size=256", "model.max_position_embeddings=64",
         "data.max_seq_length=64", "data.max_predictions_per_seq=10",
         "data.eval_batch_size=500", "data.verify_checksums=false", "optim.backend=foreach",
         "train.log_every_steps=10", "system.threads_per_rank=1"]


def ensure_data(path: Path) -> None:
    if (path / "stats.json").is_file():
        return
    from loaders.prepare import PrepareConfig, build
    build(PrepareConfig(out=path, seq_len=64, max_pred=10, eval_samples=1000, shards=8),
          log=lambda msg: print(msg, flush=True))


BUDGET_KEYS = ("train.max_steps=", "train.max_samples_termination=")


def run_plan(optimizer: str, rule: str, batch: int, base_batch: int, base_lr: float,
             expected: float, target: float, decay_samples: int,
             cap: Optional[float] = None) -> list[str]:
    """The overrides of one run: lr scaled by the rule, warm-up, accumulation, cadence, and
    the budget: 4× the expected samples, at most ``cap`` samples (a run that has not reached
    the target by then is censored: "not reached within the budget")."""
    k = batch / base_batch
    lr = base_lr * (k if rule == "linear" else math.sqrt(k))
    warmup = (max(1, round(WARMUP_STEPS / k)) if rule == "linear" else WARMUP_STEPS)
    accum = max(1, math.ceil(batch / RANKS / MAX_LOCAL))
    if batch % (RANKS * accum):
        raise ValueError(f"batch {batch} does not split into {RANKS} ranks x {accum} micro-steps")
    every = max(batch, int(0.07 * expected) // batch * batch)
    budget = int(min(4 * expected, cap or math.inf)) // batch * batch + batch
    return [f"optim.name={optimizer}", f"optim.lr={lr:.6g}", f"train.global_batch_size={batch}",
            f"train.gradient_accumulation_steps={accum}", f"schedule.warmup_steps={warmup}",
            f"schedule.total_steps={max(1, decay_samples // batch)}",
            f"train.max_steps={budget // batch + 1}", f"train.max_samples_termination={budget}",
            f"train.target_mlm_accuracy={target}", f"train.eval_iter_start_samples={every}",
            f"train.eval_iter_samples={every}"]


def crossing(history: list, target: float, batch: int) -> Optional[dict]:
    """Samples and steps at which the accuracy first reaches ``target``, interpolated linearly
    between that eval and the one before; None if never."""
    prev = (0, 0.0)
    for samples, acc, _t in history:
        if acc >= target:
            s0, a0 = prev
            w = (target - a0) / (acc - a0) if acc > a0 else 1.0
            at = s0 + w * (samples - s0)
            return {"samples": at, "steps": at / batch,
                    "resolution": (samples - s0) / samples if samples else 1.0}
        prev = (samples, acc)
    return None


def noise_at(run_dir: Path, samples: float) -> tuple[Optional[float], Optional[int]]:
    """The noise scale the run logged at the step nearest ``samples``, and the samples its
    averages spanned there."""
    best = None
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None, None
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "step" and rec.get("noise_scale") is not None:
            d = abs(rec["samples"] - samples)
            if best is None or d < best[0]:
                best = (d, rec["noise_scale"], rec.get("noise_scale_window_samples"))
    return (None, None) if best is None else best[1:]


def remeasure(old: dict, noise: bool) -> bool:
    """Whether an earlier run that answers for a planned one is rerun all the same: with
    ``--remeasure-noise``, a run that reached the target (its B_simple at the target is what
    is re-measured) and was not re-measured already; a run that missed the target has no
    B_simple at target, and its outcome stands."""
    return noise and old.get("samples_to_target") is not None and not old.get("before")


def fit_tradeoff(points: list[tuple[int, float]]) -> Optional[dict]:
    """S = S_min + E_min/B by weighted least squares on (B, steps) points; B_crit."""
    if len(points) < 3:
        return None
    rows = [(1.0 / b, s, 1.0 / s) for b, s in points]  # x = 1/B, y = S, weight 1/S
    sw = sum(w * w for *_, w in rows)
    sx = sum(w * w * x for x, _, w in rows)
    sy = sum(w * w * y for _, y, w in rows)
    sxx = sum(w * w * x * x for x, _, w in rows)
    sxy = sum(w * w * x * y for x, y, w in rows)
    det = sw * sxx - sx * sx
    if det <= 0:
        return None
    e_min = (sw * sxy - sx * sy) / det
    s_min = (sy - e_min * sx) / sw
    out = {"S_min": s_min, "E_min": e_min}
    out["B_crit"] = e_min / s_min if s_min > 0 and e_min > 0 else None
    out["residual_rel"] = max(abs((s_min + e_min / b) / s - 1) for b, s in points)
    return out


def reusable(old: dict, over: list[str]) -> bool:
    """Whether an earlier run (a row of a record) answers for the planned run ``over``: the
    same overrides but for the budget, and an outcome the new budget would not change - it
    reached the target within the new budget, or it did not within a budget at least as
    large."""
    def split(o):
        keep = [x for x in o if not x.startswith(BUDGET_KEYS)]
        cap = [int(x.split("=")[1]) for x in o if x.startswith(BUDGET_KEYS[1])]
        return keep, (cap[0] if cap else None)
    (a, old_cap), (b, new_cap) = split(old["overrides"]), split(over)
    if a != b or old_cap is None or new_cap is None or old["status"] not in ("success", "aborted"):
        return False
    if old["samples_to_target"] is not None:
        return old["samples_to_target"] <= new_cap
    return old_cap >= new_cap


def load_reuse(path: Optional[Path], rec: dict) -> list[dict]:
    """The runs of an earlier record of the same study (same target, proxy, base batch and
    decay), to be taken instead of rerun; a record of another study is refused."""
    if path is None:
        return []
    try:
        old = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--reuse {path}: cannot read the record ({e}); name a JSON record "
                         "that bench.batch_scaling wrote")
    for key in ("target", "base_batch", "proxy", "decay_samples", "ranks"):
        if old.get(key) != rec.get(key):
            raise SystemExit(f"--reuse {path}: its {key} is {old.get(key)!r}, this study's is "
                             f"{rec.get(key)!r}; its runs do not answer for this study")
    return list(old.get("runs") or [])


def set_aside(run_dir: Path) -> None:
    """An earlier attempt's run directory (an interrupted study) is kept, renamed
    ``<dir>.attempt<N>``: the run gets a fresh one (a finished one is never overwritten)."""
    if not run_dir.exists():
        return
    n = 1
    while run_dir.with_name(f"{run_dir.name}.attempt{n}").exists():
        n += 1
    run_dir.rename(run_dir.with_name(f"{run_dir.name}.attempt{n}"))


def grid(r):
    """The study's runs, in order: seeds, optimizers, batches, rules (at the base batch every
    rule is the same run: one)."""
    a = r.args
    for seed in a.seeds:
        for optimizer in a.optimizers:
            for batch in a.batches:
                for rule in a.rules:
                    if batch != a.base_batch or rule == a.rules[0]:
                        yield seed, optimizer, batch, rule


def study_run(r, case) -> dict:
    """One run of the grid: taken from ``--reuse``'s record when its outcome holds, else
    trained; its samples and steps to target, and the noise scale there."""
    a, (workdir, earlier) = r.args, r.state
    seed, optimizer, batch, rule = case
    expected = a.expected[optimizer]       # samples to target at the base batch
    over = run_plan(optimizer, rule, batch, a.base_batch, a.base_lr[optimizer],
                    expected * (1 + batch / 512), a.target, a.decay_samples,
                    cap=a.max_samples_factor * expected)
    name = f"{optimizer}_{rule}_b{batch}"
    old = next((x for x in earlier if x["seed"] == seed and x["optimizer"] == optimizer
                and x["rule"] == rule and x["batch"] == batch and reusable(x, over)), None)
    if old is not None and not remeasure(old, a.remeasure_noise):
        return {**old, "overrides": over, "reused": True}
    t0 = time.perf_counter()
    set_aside(workdir / f"{name}_seed{seed}")
    run = run_runtime(CONFIG, seed, [f"data.data_dir={a.data}", *PROXY, *over], workdir,
                      timeout=a.run_timeout, name=name)
    if run.get("rc") not in (0, 1):  # not trained to its end: no data point
        run = {**run, "status": "failed", "eval_history": None}
    hit = crossing(run.get("eval_history") or [], a.target, batch)
    noise, window = noise_at(Path(run["run_dir"]), hit["samples"]) if hit else (None, None)
    row = {"optimizer": optimizer, "rule": rule, "batch": batch, "seed": seed,
           "overrides": over, "status": run["status"],
           "wall_s": round(time.perf_counter() - t0, 1),
           "samples_to_target": hit and hit["samples"], "steps_to_target": hit and hit["steps"],
           "resolution": hit and hit["resolution"], "noise_scale_at_target": noise,
           "noise_window_samples": window, "eval_history": run.get("eval_history"),
           "error": run.get("error")}
    if old is not None:  # re-measured: what the record said before
        row["before"] = {k: old.get(k) for k in (
            "samples_to_target", "steps_to_target", "noise_scale_at_target", "status",
            "wall_s")}
    return row


def study_progress(r, case, row) -> str:
    seed, optimizer, batch, rule = case
    name = f"  {optimizer}_{rule}_b{batch} seed {seed}"
    if row.get("reused"):
        return f"{name}: reused from {r.args.reuse}"
    return (f"{name}: {row['status']}, {_f(row['samples_to_target'], '.0f')} samples "
            f"({_f(row['steps_to_target'], '.1f')} steps), B_noise "
            f"{_f(row['noise_scale_at_target'], '.0f')}, {row['wall_s']} s")


def summarise(runs: list[dict], args) -> dict:
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if r["status"] == "failed":
            continue  # it did not train to its end: neither reached nor missed the target
        rules = args.rules if r["batch"] == args.base_batch else [r["rule"]]
        for rule in rules:  # the base-batch run belongs to every rule's curve
            groups.setdefault((r["optimizer"], rule, r["batch"]), []).append(r)
    table, curves = [], {}
    for (opt, rule, batch), rs in sorted(groups.items()):
        ok = [r for r in rs if r["samples_to_target"] is not None]
        row = {"optimizer": opt, "rule": rule, "batch": batch, "runs": len(rs),
               "reached": len(ok),
               "samples": statistics.mean(r["samples_to_target"] for r in ok) if ok else None,
               "steps": statistics.mean(r["steps_to_target"] for r in ok) if ok else None,
               "worst_resolution": max(r["resolution"] for r in ok) if ok else None}
        table.append(row)
        if row["steps"] is not None and row["reached"] == row["runs"]:
            curves.setdefault((opt, rule), []).append((batch, row["steps"]))
    fits = {f"{o}/{r}": fit_tradeoff(pts) for (o, r), pts in curves.items()}
    noise = [r["noise_scale_at_target"] for r in runs if r["noise_scale_at_target"]]
    b_simple = statistics.median(noise) if noise else None
    by_opt = {}
    for r in runs:
        if r["noise_scale_at_target"]:
            by_opt.setdefault(r["optimizer"], []).append(r["noise_scale_at_target"])
    samples_table = best_samples_table(table)
    return {"table": table, "fits": fits, "b_simple_median": b_simple,
            "b_simple_by_optimizer": {k: statistics.median(v) for k, v in by_opt.items()},
            "samples_table": samples_table}


def best_samples_table(table: list[dict]) -> list[list]:
    """Global batch → the fewest samples to target any optimizer and rule needed there (every
    run of it reaching the target): the input ``runtime.calibrate.tune --simulate --samples``
    reads."""
    best: dict[int, float] = {}
    for row in table:
        if row["samples"] is not None and row["reached"] == row["runs"]:
            best[row["batch"]] = min(best.get(row["batch"], math.inf), row["samples"])
    return [[b, s] for b, s in sorted(best.items())]


def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


TABLE = (Column("optimizer", "optimizer"), Column("rule", "rule"), Column("batch", "batch"),
         Column("reached", lambda x: f"{x['reached']}/{x['runs']}"),
         Column("samples to target", "samples", ",.0f"), Column("steps", "steps", ".1f"),
         Column("resolution", "worst_resolution", ".0%"))
FITS = (Column("curve", "curve"), Column("S_min", "S_min", ".1f"),
        Column("E_min", "E_min", ",.0f"), Column("B_crit", "B_crit", ".0f"),
        Column("fit residual", "residual_rel", ".0%"))
AGAIN = (Column("run", lambda x: f"{x['optimizer']} {x['rule']} {x['batch']}"),
         Column("seed", "seed"),
         Column("samples to target (before)", lambda x: f"{_f(x['samples_to_target'], ',.0f')} "
                f"({_f(x['before']['samples_to_target'], ',.0f')})"),
         Column("B_simple at target (before)", lambda x: f"{_f(x['noise_scale_at_target'], '.0f')}"
                f" ({_f(x['before']['noise_scale_at_target'], '.0f')})"))


def table(rec: dict) -> str:
    """The seed means per optimizer, rule and batch; the fits; B_simple; the re-measured."""
    fits = [{"curve": name, **f} for name, f in rec["fits"].items() if f]
    again = [r for r in rec["runs"] if r.get("before") and r.get("samples_to_target")]
    return "\n".join(["", markdown(TABLE, rec["table"]), "", markdown(FITS, fits),
                      f"\nB_simple at the target (median of the runs): "
                      f"{_f(rec['b_simple_median'], '.0f')} sequences; by optimizer: "
                      f"{rec['b_simple_by_optimizer']}"]
                     + (["", markdown(AGAIN, again)] if again else []))


def plot(rec: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    colors = {"lamb": "tab:blue", "adamw": "tab:red", "lars": "tab:green"}
    for (opt, rule) in sorted({(r["optimizer"], r["rule"]) for r in rec["table"]}):
        pts = [(r["steps"], r["samples"], r["batch"]) for r in rec["table"]
               if r["optimizer"] == opt and r["rule"] == rule and r["samples"] is not None]
        if not pts:
            continue
        s, e, b = zip(*pts)
        ax.plot(s, e, "o-" if rule == "linear" else "s--", color=colors.get(opt, "k"),
                label=f"{opt}, {rule}" + (" + LEGW" if rule == "sqrt" else ""))
        for si, ei, bi in pts:
            ax.annotate(str(bi), (si, ei), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
        fit = rec["fits"].get(f"{opt}/{rule}")
        if fit and fit["B_crit"]:
            ax.plot([2 * fit["S_min"]], [2 * fit["E_min"]], "*", ms=12,
                    color=colors.get(opt, "k"))
            ax.axhline(fit["E_min"], color=colors.get(opt, "k"), lw=0.6, ls=":")
    bs = rec.get("b_simple_median")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("steps to target")
    ax.set_ylabel("samples to target")
    horizon = rec.get("noise_scale_horizon_samples")
    ax.set_title("batch scaling: dotted = perfect scaling (E_min), * = B_crit"
                 + (f"\nB_simple at target ≈ {bs:.0f} seq (median; whole gradient, "
                    f"last {horizon} samples)" if bs else ""), fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def calibrate(r, optimizer: str) -> dict:
    """The base learning rate at the base batch: a 3-point sweep, the fewest samples to
    target wins; also what it needs there (the study's expected samples)."""
    a, (workdir, _) = r.args, r.state
    sweep = []
    for lr in (a.base_lr[optimizer] / 2, a.base_lr[optimizer], a.base_lr[optimizer] * 2):
        over = run_plan(optimizer, "linear", a.base_batch, a.base_batch, lr, 12000, a.target,
                        a.decay_samples)
        run = run_runtime(CONFIG, a.seeds[0], [f"data.data_dir={a.data}", *PROXY, *over],
                          workdir, timeout=a.run_timeout, name=f"cal_{optimizer}_{lr:g}")
        hit = crossing(run.get("eval_history") or [], a.target, a.base_batch)
        sweep.append({"lr": lr, "samples_to_target": hit and hit["samples"],
                      "wall_s": run.get("run_time_s"), "status": run["status"]})
        print(f"  calibrate {optimizer} lr {lr:g}: {_f(hit and hit['samples'], '.0f')} "
              f"samples", flush=True)
    ok = [x for x in sweep if x["samples_to_target"]]
    best = min(ok, key=lambda x: x["samples_to_target"]) if ok else None
    return {"optimizer": optimizer, "sweep": sweep, "best_lr": best and best["lr"],
            "expected_samples": best and best["samples_to_target"]}


@contextlib.contextmanager
def prepared(r):
    """The data set (built when missing), the work folder, the earlier record's runs."""
    ensure_data(r.args.data)
    workdir = r.args.workdir or (REPO / "results" / "batch_scaling")
    workdir.mkdir(parents=True, exist_ok=True)
    yield workdir, (load_reuse(r.args.reuse, r.record) if not r.args.calibrate else [])


def study_summary(r) -> dict:
    out = {"complete": True, **summarise(r.results, r.args)}
    if r.args.png:
        plot({**r.record, **out}, r.args.png)
        out["plot"] = str(r.args.png)
    return out


def fields(a) -> dict:
    return dict(target=a.target, base_batch=a.base_batch, base_lr=a.base_lr,
                batches=a.batches, optimizers=a.optimizers, rules=a.rules, seeds=a.seeds,
                ranks=RANKS, proxy=PROXY, decay_samples=a.decay_samples, data=str(a.data),
                noise_scale_horizon_samples=load_config(CONFIG, PROXY).train
                .noise_scale_horizon_samples)


def _pairs(text: str) -> dict[str, float]:
    """``optimizer=value,...`` as a dict."""
    try:
        return {k: float(v) for k, v in (p.split("=") for p in text.split(",") if p)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give optimizer=value,...") from None


BENCHMARK = Benchmark(
    "batch_scaling", __doc__, study_run, grid,
    options=(option("--batches", type=listed(kind=int, what="batch"),
                    default="32,64,128,256,512,1024"),
             option("--optimizers", type=listed(BASE_LR, what="optimizer"),
                    default="lamb,adamw"),
             option("--rules", type=listed(("linear", "sqrt"), what="rule"),
                    default="linear,sqrt"),
             seeds("1,2"),
             option("--base-batch", type=int, default=32),
             option("--base-lr", type=lambda text: {**BASE_LR, **_pairs(text)}, default="",
                    help=f"optimizer=lr,... (default: the calibrated {BASE_LR})"),
             option("--expected", type=_pairs, default="lamb=8600,adamw=13100,lars=13000",
                    help="samples to target at the base batch (sets cadence and budget)"),
             option("--target", type=float, default=0.10),
             option("--decay-samples", type=int, default=400_000),
             option("--data", type=Path, default=DATA),
             option("--calibrate", action="store_true", help="sweep the base lr at the base "
                    "batch instead of running the study"),
             option("--max-samples-factor", type=float, default=6.0,
                    help="no run trains past this many times its optimizer's --expected "
                    "samples (a run short of the target by then counts as not reaching it)"),
             option("--reuse", type=Path, default=None,
                    help="an earlier record of this study: its runs with the same overrides "
                    "(and an outcome the budget would not change) are taken, not rerun; the "
                    "record is rewritten after every run, so an interrupted study resumes so"),
             option("--remeasure-noise", action="store_true",
                    help="with --reuse: rerun the runs that reached the target (to measure "
                    "their B_simple at target again), take the others from the record"),
             option("--run-timeout", type=float, default=1800),
             WORKDIR, out(REPO / "bench" / "results" / "batch_scaling.json"),
             option("--png", type=Path, default=None)),
    fields=lambda a: {**fields(a), "complete": False}, setup=prepared, results="runs",
    partial=True, progress=study_progress, summary=study_summary, table=table,
    line=("wall_s",), mode=lambda a: CALIBRATE if a.calibrate else None)

CALIBRATE = replace(
    BENCHMARK, measure=calibrate, cases=lambda r: r.args.optimizers, fields=fields,
    results=None, partial=False, progress=None, table=None, mode=None,
    summary=lambda r: {"calibration": {c.pop("optimizer"): c for c in r.results}})
"""``--calibrate``: the base learning rate's sweep instead of the study."""


def main(argv=None) -> int:
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
