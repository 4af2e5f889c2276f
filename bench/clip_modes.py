"""``python -m bench.clip_modes``: does every gradient-clipping mode reach the CPU benchmark's
target (issue 5, item 7)?

For each ``train.clip_mode`` (global_after, local_before, bucket_before, none) and seed it runs
the real benchmark, ``SEED=s CONFIG=CFG RUN_DIR=... ./run_and_time.sh -- train.clip_mode=M
OVERRIDES`` (bench.common's runtime runner, the one bench.time_to_accuracy uses: time =
run_stop − run_start of the MLPerf log, samples = epoch_num of the last eval), one after
the other, and adds from rank 0's ``metrics.jsonl`` how hard each mode clipped:

  clip_mean       mean over steps of the applied clip coefficient (1.0 = nothing clipped;
                  for bucket_before the strongest bucket's coefficient of the step)
  clipped_frac    share of steps with a coefficient < 1
  grad_norm_mean  mean global norm of the averaged gradient the optimizer saw
  local_norm_mean mean of rank 0's local norm before clipping (the before modes)

The before modes clip each rank's (or each bucket's) *local* gradient, whose norm is larger
than the averaged one's (noise does not cancel), so they clip more often at the same
``max_grad_norm``; the table shows by how much. Prints a table and a final JSON line, writes the
record to ``--out``. A benchmark: keep the machine otherwise idle.

    python -m bench.clip_modes [--modes global_after,local_before,bucket_before,none]
        [--seeds 42] [--set section.key=value ...] [--out bench/results/clip_modes.json]
"""
from __future__ import annotations

import contextlib
import datetime
import json
import statistics
import sys
from pathlib import Path

from bench.common import REPO, fmt, run_runtime
from bench.harness import (SET, TIMEOUT, WORKDIR, Benchmark, Column, Goal, listed, markdown,
                           option, out, run, seeds)
from runtime.grad_sync import CLIP_MODES

RESULTS = REPO / "bench" / "results" / "clip_modes.json"
CONFIG = REPO / "submission" / "configs" / "config_CPU_1x2x32x1.toml"
MODES = CLIP_MODES


def clip_stats(metrics: Path) -> dict:
    """How hard a run clipped, from its step records."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
        if metrics.is_file() else []
    steps = [r for r in rows if r.get("kind") == "step"]
    if not steps:
        return {"clip_mean": None, "clipped_frac": None, "grad_norm_mean": None,
                "local_norm_mean": None}
    coefs = [r["clip_coef"] for r in steps]
    local = [r["local_grad_norm"] for r in steps if "local_grad_norm" in r]
    return {"clip_mean": statistics.fmean(coefs),
            "clipped_frac": sum(c < 1.0 for c in coefs) / len(coefs),
            "grad_norm_mean": statistics.fmean(r["grad_norm"] for r in steps),
            "local_norm_mean": statistics.fmean(local) if local else None}


COLUMNS = (Column("clip_mode", "clip_mode"), Column("seed", "seed"), Column("status", "status"),
           Column("time to target s", "time_to_target_s", ".1f"),
           Column("samples", "samples_to_target", ","), Column("eval acc", "eval_accuracy", ".4f"),
           Column("samples/s", "throughput_samples_per_s", ".1f"),
           Column("clip mean", "clip_mean", ".3f"), Column("clipped steps", "clipped_frac", ".2f"),
           Column("grad norm", "grad_norm_mean", ".3f"),
           Column("local norm", "local_norm_mean", ".3f"))


def table(runs: list[dict]) -> str:
    return markdown(COLUMNS, runs)


def cases(r):
    """Every mode on every seed, the seeds outermost."""
    return [(seed, mode) for seed in r.args.seeds for mode in r.args.modes]


@contextlib.contextmanager
def workdir(r):
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    work = (r.args.workdir or REPO / "results" / f"clip_modes_{stamp}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    yield work


def measure(r, case) -> dict:
    seed, mode = case
    (r.state / mode).mkdir(exist_ok=True)
    rec = run_runtime(r.args.config.resolve(), seed, [f"train.clip_mode={mode}", *r.args.set],
                      r.state / mode, r.args.timeout)
    rec.update(clip_mode=mode, **clip_stats(Path(rec["run_dir"]) / "metrics.jsonl"))
    return rec


BENCHMARK = Benchmark(
    "clip_modes", __doc__, measure, cases,
    options=(option("--config", type=Path, default=CONFIG),
             option("--modes", type=listed(MODES, what="mode"), default=",".join(MODES)),
             seeds("42"), SET, out(RESULTS), WORKDIR, TIMEOUT),
    fields=lambda a: {"config": str(a.config), "overrides": a.set},
    setup=workdir, results="runs",
    progress=lambda r, case, rec: f"{rec['clip_mode']} seed {rec['seed']}: {rec['status']} "
                                  f"{fmt(rec['time_to_target_s'], '.1f')} s",
    table=lambda rec: table(rec["runs"]),
    goals=(Goal("every_mode_reaches_the_target", "every run's status is success",
                lambda rec: all(r["status"] == "success" for r in rec["runs"]), gate=True),),
    line=lambda rec: dict(rec, runs=[
        {k: r.get(k) for k in ("clip_mode", "seed", "status", "time_to_target_s",
                               "samples_to_target", "clip_mean")} for r in rec["runs"]]))


def main(argv=None) -> int:
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
