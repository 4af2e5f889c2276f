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

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

from bench.common import REPO, finish, fmt, record, run_runtime
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



def table(runs: list[dict]) -> str:
    head = ("| clip_mode | seed | status | time to target s | samples | eval acc | "
            "samples/s | clip mean | clipped steps | grad norm | local norm |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in runs:
        lines.append(f"| {r['clip_mode']} | {r['seed']} | {r['status']} | "
                     f"{fmt(r['time_to_target_s'], '.1f')} | {fmt(r['samples_to_target'], ',')} | "
                     f"{fmt(r['eval_accuracy'], '.4f')} | {fmt(r.get('throughput_samples_per_s'), '.1f')} | "
                     f"{fmt(r['clip_mean'], '.3f')} | {fmt(r['clipped_frac'], '.2f')} | "
                     f"{fmt(r['grad_norm_mean'], '.3f')} | {fmt(r['local_norm_mean'], '.3f')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.clip_modes",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--seeds", default="42")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=None, help="seconds per run")
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"clip_modes: unknown mode(s) {bad}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    workdir = (a.workdir or REPO / "results" / f"clip_modes_{stamp}").resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    result = record("clip_modes", sys.argv[1:] if argv is None else argv,
                    config=str(a.config), overrides=a.set)
    start = time.perf_counter()
    runs = []
    for seed in [int(s) for s in a.seeds.split(",") if s.strip()]:
        for mode in modes:
            (workdir / mode).mkdir(exist_ok=True)
            rec = run_runtime(a.config.resolve(), seed, [f"train.clip_mode={mode}", *a.set],
                              workdir / mode, a.timeout)
            rec.update(clip_mode=mode, **clip_stats(Path(rec["run_dir"]) / "metrics.jsonl"))
            runs.append(rec)
            print(f"{mode} seed {seed}: {rec['status']} {fmt(rec['time_to_target_s'], '.1f')} s",
                  flush=True)
    result.update(wall_s=round(time.perf_counter() - start, 1), runs=runs)
    print(table(runs))
    finish(result, a.out, line=dict(result, runs=[
        {k: r.get(k) for k in ("clip_mode", "seed", "status", "time_to_target_s",
                               "samples_to_target", "clip_mean")} for r in runs]))
    return 0 if all(r["status"] == "success" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
