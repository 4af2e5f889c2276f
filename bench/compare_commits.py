"""``python -m bench.compare_commits BASE [-- section.key=value ...]``: the behaviour-unchanged
check in one command - the same seeded run of ``run_and_time.sh`` at BASE and at this
checkout, on this machine, one after the other, then ``bench.same_metrics`` on the two
metrics.jsonl ("every metrics record bitwise equal before and after", clock fields aside).

BASE is checked out into a temporary git worktree beside the runs (``--work``, default a new
directory under /tmp) with this checkout's ``.venv``, ``.cache`` and ``data`` linked in, so
both runs use the same packages and the same data set (``make data`` first). The default run
is the CPU benchmark config's 2 ranks, SEED 7, 40 steps logged every 5 - the check every
refactor of this repository recorded (docs/DEVELOPING.md); the overrides after ``--`` replace
``--steps`` and add to it (``-- train.precision=bf16_master``). Both runs write their run
directories under ``--work``; the worktree is removed afterwards, the runs are kept.

Why not golden files in the repository (torchtitan's way): the runs' floats are bit-exact
only on one machine - another CPU's vector width changes a reduction's order - so the base
must be run beside the change, as this command does.

Exit: 0 SAME, 1 a record differs (the first differences printed), 2 bad arguments or a run
that failed (its exit status and run directory named).
Owns: the recipe (worktree, links, runs, comparison). Never: compares anything itself
(bench.same_metrics does) or touches this checkout's files.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINKED = (".venv", ".cache", "data")
DEFAULT_SEED = 7


def _run(tree: Path, run_dir: Path, seed: int, overrides: list[str]) -> int:
    env = dict(os.environ, RUN_DIR=str(run_dir), SEED=str(seed), RESUME="0")
    cmd = ["./run_and_time.sh", "--", *overrides]
    print(f"compare_commits: {tree}: RUN_DIR={run_dir} SEED={seed} {' '.join(cmd)}", flush=True)
    with open(run_dir.parent / f"{run_dir.name}.out", "w") as out:
        return subprocess.run(cmd, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT).returncode


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m bench.compare_commits",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="the commit to compare against (a hash, a branch, HEAD~1)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--steps", type=int, default=40,
                   help="train.max_steps of both runs (logged every 5 steps)")
    p.add_argument("--work", type=Path, default=None,
                   help="where the worktree and both run directories go (default: a new "
                        "directory under /tmp)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps}: give a positive number of steps")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet",
                             f"{args.base}^{{commit}}"], capture_output=True, text=True)
    if commit.returncode != 0:
        p.error(f"{args.base!r} is no commit of {ROOT}")
    missing = [name for name in LINKED if not (ROOT / name).exists()]
    if missing:
        p.error(f"{', '.join(missing)} missing in {ROOT}: run `make venv sources data` first")
    work = args.work or Path(tempfile.mkdtemp(prefix="compare_commits_"))
    work.mkdir(parents=True, exist_ok=True)
    base_tree = work / "base_tree"
    runs = [f"train.max_steps={args.steps}", "train.log_every_steps=5", *overrides]
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet",
                    str(base_tree), commit.stdout.strip()], check=True)
    try:
        for name in LINKED:
            (base_tree / name).symlink_to(ROOT / name)
        for label, tree in (("base", base_tree), ("new", ROOT)):
            rc = _run(tree, work / label, args.seed, runs)
            if rc not in (0, 1):       # 1: the step budget spent, the usual end of a check
                print(f"compare_commits: the {label} run exited {rc}: see {work / label}.out",
                      file=sys.stderr)
                return 2
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                        str(base_tree)], check=False)
    from bench.same_metrics import main as same
    print(f"compare_commits: {args.base} ({commit.stdout.strip()[:9]}) against this checkout, "
          f"runs in {work}", flush=True)
    return same([str(work / "base"), str(work / "new")])


if __name__ == "__main__":
    sys.exit(main())
