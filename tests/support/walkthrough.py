"""docs/MLPERF.md's fixture-scale commands, read from the page and run in its order: by hand as
`make mlperf-demo` (``python -m tests.support.walkthrough [--dir DIR]``), and by
tests/e2e/test_mlperf_walkthrough.py, which checks each step's result. The page is the one
copy of the commands: neither keeps its own.

A fixture command is a fenced block whose info string is ``bash fixture`` and tags:
``id=NAME`` (the step it is: the test finds it by name), ``exit=N`` (the status the page says
it ends with; 0 when absent), ``slurm`` / ``no-slurm`` (step 4's two forms: where a Slurm
cluster answers, and run.sub's per-experiment call without one). The block ``id=setup`` runs
at the head of every other one (the environment: PATH, DEMO), each in its own ``bash -e``
from the repository root, as a reader pastes them.

Owns: reading the blocks and running one. Never: a command of its own.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "MLPERF.md"
FENCE = re.compile(r"^```bash fixture(?P<tags>[^\n]*)\n(?P<text>.*?)^```$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    id: str
    text: str
    exit: int = 0
    when: str | None = None   # "slurm" | "no-slurm" | None (always)


def blocks(page: Path = PAGE) -> list[Block]:
    """Every fixture block of the page, in its order (the setup block first among them)."""
    out = []
    for m in FENCE.finditer(page.read_text()):
        tags = m.group("tags").split()
        named = dict(t.split("=", 1) for t in tags if "=" in t)
        when = next((t for t in tags if t in ("slurm", "no-slurm")), None)
        if "id" not in named:
            raise ValueError(f"{page}: a fixture block without id=: {m.group('text')[:80]!r}")
        out.append(Block(named["id"], m.group("text"), int(named.get("exit", 0)), when))
    return out


def script(block: Block, setup: Block) -> str:
    return f"{setup.text}\n{block.text}"


def run(block: Block, setup: Block, env: dict, timeout: float | None = None,
        capture: bool = True) -> subprocess.CompletedProcess:
    """One block after the setup block, in ``bash -e`` from the repository root."""
    return subprocess.run(["bash", "-e", "-c", script(block, setup)], cwd=ROOT, env=env,
                          timeout=timeout, text=True, capture_output=capture)


def slurm_answers(env: dict) -> bool:
    """Whether a Slurm cluster answers here (sbatch present, squeue replies)."""
    if shutil.which("sbatch", path=env.get("PATH")) is None:
        return False
    try:
        return subprocess.run(["squeue", "-h"], env=env, capture_output=True,
                              timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def chosen(all_blocks: list[Block], slurm: bool) -> list[Block]:
    """The blocks to run, setup aside: step 4 in the form this machine can run."""
    skip = "no-slurm" if slurm else "slurm"
    return [b for b in all_blocks if b.id != "setup" and b.when != skip]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.support.walkthrough",
                                 description="Run docs/MLPERF.md's fixture-scale commands, in "
                                             "order, as the page gives them.")
    ap.add_argument("--dir", type=Path, default=Path("results/mlperf_demo"),
                    help="DEMO: where they write (relative to the repository root; must not "
                         "exist or be empty)")
    a = ap.parse_args(argv)
    demo = a.dir if a.dir.is_absolute() else ROOT / a.dir
    if demo.exists() and any(demo.iterdir()):
        print(f"error: {demo} holds an earlier walkthrough: remove it or pass --dir",
              file=sys.stderr)
        return 2
    env = dict(os.environ, DEMO=str(demo))
    all_blocks = blocks()
    setup = next(b for b in all_blocks if b.id == "setup")
    slurm = slurm_answers(env)
    print(f"docs/MLPERF.md at fixture scale, into DEMO={demo}; step 4 "
          + ("under the Slurm cluster that answers here" if slurm else
             "without Slurm (none answers here): run_and_time.sh per experiment, as run.sub"),
          flush=True)
    t0 = time.monotonic()
    for b in chosen(all_blocks, slurm):
        print(f"\n== {b.id}\n" + "".join(f"$ {line}\n" for line in b.text.splitlines()),
              flush=True)
        rc = run(b, setup, env, capture=False).returncode
        if rc != b.exit:
            print(f"\nerror: step {b.id} exited {rc}, the page says {b.exit}", file=sys.stderr)
            return 1
        if b.exit:
            print(f"(exit {rc}, as the page says)")
    print(f"\nthe walkthrough ran in {time.monotonic() - t0:.0f} s; its outputs are in {demo}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
