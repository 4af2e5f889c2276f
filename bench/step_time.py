"""Step time of two code trees side by side: the same config trained for a few hundred steps
on 2 MPI ranks in tree A, then in tree B, A, B, ... (interleaved rounds, so drift in the
machine's speed hits both alike), each run in its own processes.

    python -m bench.step_time --trees ../before,. --config submission/configs/C.toml \
        [--set section.key=value ...] [--steps 200] [--skip 40] [--rounds 3] --out FILE.json

What is measured: the wall time per optimizer step over steps skip+1..steps, from the
``time_s`` stamps of ``metrics.jsonl`` (time since run_start at each step record) - so every
cost of the loop counts, logging and per-step reductions included, and set-up (model build,
compile) and the first steps (the plan re-cut, warm caches) do not. No evaluation runs in the
window (the first eval is put beyond the last step). Each tree runs its own code
(``PYTHONPATH`` = the tree, working directory = the tree) with this tree's venv.

Not a test: run it alone on the machine, under the CPU lock (``flock -x
/tmp/presto_cpu.lock python -m bench.step_time ...``). Prints a table and a final JSON line;
writes the record to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import finish, git_commit, record

ROOT = Path(__file__).resolve().parents[1]


def run_once(tree: Path, config: Path, overrides: list[str], steps: int, ranks: int,
             work: Path) -> list[dict]:
    """Train ``steps`` steps in ``tree``; returns its step records."""
    out = work / "run"
    cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", str(ranks), sys.executable,
           "-m", "submission.train", "--config", str(config),
           "--set", f"train.output_dir={out}", "--set", f"train.max_steps={steps}",
           "--set", "train.eval_iter_start_samples=1000000000",
           "--set", "train.target_mlm_accuracy=1.0"]
    for o in overrides:
        cmd += ["--set", o]
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode not in (0, 1):  # 1: "target not reached", expected here
        raise RuntimeError(f"{tree}: training failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r.get("kind") == "step"]


def seconds_per_step(steps: list[dict], skip: int) -> float:
    by_step = {r["step"]: r["time_s"] for r in steps}
    last = max(by_step)
    if skip not in by_step:
        raise RuntimeError(f"no record of step {skip}: steps {min(by_step)}..{last}")
    return (by_step[last] - by_step[skip]) / (last - skip)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.step_time",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", required=True, help="A,B: two checkouts to compare")
    ap.add_argument("--config", required=True, help="config TOML (path relative to each tree)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--skip", type=int, default=40, help="steps not timed at the start")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--label", default="", help="a name for the shape, for the record")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    if len(trees) != 2 or args.skip >= args.steps:
        ap.error("give two trees, and --skip < --steps")
    names = ["A", "B"]
    rec = record("step_time", sys.argv[1:] if argv is None else argv, label=args.label,
                 config=args.config, overrides=args.set, steps=args.steps, skip=args.skip,
                 rounds=args.rounds, ranks=args.ranks,
                 trees={n: {"path": str(t), "commit": git_commit(t)}
                        for n, t in zip(names, trees)})
    times: dict[str, list[float]] = {n: [] for n in names}
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="step_time_") as tmp:
        for r in range(args.rounds):
            for name, tree in zip(names, trees):
                work = Path(tmp) / f"{name}{r}"
                work.mkdir()
                steps = run_once(tree, tree / args.config, args.set, args.steps, args.ranks, work)
                times[name].append(seconds_per_step(steps, args.skip))
                print(f"round {r + 1} {name} ({tree.name}): {times[name][-1] * 1000:.1f} ms/step",
                      flush=True)
    med = {n: statistics.median(v) for n, v in times.items()}
    ratios = [b / a for a, b in zip(times["A"], times["B"])]
    rec.update(seconds_per_step=times, median_s=med,
               ratio_B_over_A={"per_round": ratios, "median": statistics.median(ratios)},
               wall_s=round(time.time() - t0, 1))
    print(f"\n{'tree':4} {'commit':14} {'median ms/step':>15}  per round")
    for n in names:
        print(f"{n:4} {rec['trees'][n]['commit']:14} {med[n] * 1000:15.1f}  "
              + " ".join(f"{x * 1000:.1f}" for x in times[n]))
    print(f"B/A: median {rec['ratio_B_over_A']['median']:.3f} "
          f"(per round {' '.join(f'{x:.3f}' for x in ratios)})")
    finish(rec, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
