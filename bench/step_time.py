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

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import git_commit
from bench.harness import SET, Benchmark, option, out, run

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


NAMES = ("A", "B")


def _trees(a) -> list[Path]:
    return [Path(t).resolve() for t in a.trees.split(",")]


def check(a) -> str | None:
    if len(_trees(a)) != 2 or a.skip >= a.steps:
        return "give two trees, and --skip < --steps"
    return None


def measure(r, case) -> dict:
    """One round's run in one tree: its seconds per step."""
    round_, name, tree = case
    work = r.state / f"{name}{round_}"
    work.mkdir()
    a = r.args
    steps = run_once(tree, tree / a.config, a.set, a.steps, a.ranks, work)
    return {"tree": name, "round": round_, "seconds_per_step": seconds_per_step(steps, a.skip)}


def summary(r) -> dict:
    times = {n: [x["seconds_per_step"] for x in r.results if x["tree"] == n] for n in NAMES}
    ratios = [b / a for a, b in zip(times["A"], times["B"])]
    return {"seconds_per_step": times,
            "median_s": {n: statistics.median(v) for n, v in times.items()},
            "ratio_B_over_A": {"per_round": ratios, "median": statistics.median(ratios)}}


def table(rec: dict) -> str:
    lines = ["", f"{'tree':4} {'commit':14} {'median ms/step':>15}  per round"]
    for n in NAMES:
        lines.append(f"{n:4} {rec['trees'][n]['commit']:14} {rec['median_s'][n] * 1000:15.1f}  "
                     + " ".join(f"{x * 1000:.1f}" for x in rec["seconds_per_step"][n]))
    ratio = rec["ratio_B_over_A"]
    lines.append(f"B/A: median {ratio['median']:.3f} "
                 f"(per round {' '.join(f'{x:.3f}' for x in ratio['per_round'])})")
    return "\n".join(lines)


@contextlib.contextmanager
def scratch(r):
    with tempfile.TemporaryDirectory(prefix="step_time_") as tmp:
        yield Path(tmp)


BENCHMARK = Benchmark(
    "step_time", __doc__, measure,
    cases=lambda r: [(k, n, t) for k in range(r.args.rounds)
                     for n, t in zip(NAMES, _trees(r.args))],
    options=(option("--trees", required=True, help="A,B: two checkouts to compare"),
             option("--config", required=True,
                    help="config TOML (path relative to each tree)"),
             SET,
             option("--steps", type=int, default=200),
             option("--skip", type=int, default=40, help="steps not timed at the start"),
             option("--rounds", type=int, default=3),
             option("--ranks", type=int, default=2),
             option("--label", default="", help="a name for the shape, for the record"),
             out(None)),
    check=check,
    fields=lambda a: dict(label=a.label, config=a.config, overrides=a.set, steps=a.steps,
                          skip=a.skip, rounds=a.rounds, ranks=a.ranks,
                          trees={n: {"path": str(t), "commit": git_commit(t)}
                                 for n, t in zip(NAMES, _trees(a))}),
    setup=scratch,
    progress=lambda r, case, res: f"round {case[0] + 1} {case[1]} ({case[2].name}): "
                                  f"{res['seconds_per_step'] * 1000:.1f} ms/step",
    summary=summary, table=table)


def main(argv=None) -> int:
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
