"""``python -m bench.gpu``: check and measure the CUDA path in one call (under 9 minutes on one
H100), recording every stage's result even when a later one fails.

    python -m bench.gpu --out DIR                    on a GPU machine, as it is
    python -m bench.gpu --out DIR --stages checks,throughput     a subset, in a second call
    python -m bench.gpu --smoke --out DIR            on CPU: tiny shapes, seconds per stage
                                                     (CI runs it: the harness itself is tested)
    python -m bench.gpu --bundle .gpu_bundle         here, before: what a bare GPU machine
                                                     lacks (docs/GPU.md)

The stages, in the order they run, with their budgets and goals: ``python -m bench.gpu
--help`` (one row each in bench/gpu/table.py; what each measures: bench/gpu/stages/ and
docs/GPU.md).

Each stage is a child process (``--stage NAME``) with its own time budget, all within
``--deadline`` seconds: a crash, a hang or an out-of-memory ends that stage, not the run.
Writes to ``--out`` (at most 4 files, as few as a lent machine sends back):
  gpu_<device>_<date>.json   the record: every stage's result, its status and seconds
  summary.txt                the goals, each met or missed, with the figures
  stages.log                 every stage's output
  cuda_tests.xml             the CUDA tests' JUnit report
Exit 0 when every stage ran to the end (a missed goal is a result), 1 when one failed, ran
out of time or ran with a part failed (status ``partial``: one path or batch of it broke),
2 on bad arguments.

The package: orchestrator.py (the command line, the child processes, the record, the goal
verdicts, summary.txt), table.py (the stage rows), harness.py (what the stages share),
stages/ (the stage functions and their goals), bundle.py (--bundle).
Owns: the one-call GPU check. Never: a measurement outside a stage's own process.
"""
from __future__ import annotations

from bench.gpu.orchestrator import (SMOKE_BUDGET_S, goals, main, parse_args, part_errors,
                                    render_summary, run_all)
from bench.gpu.table import BUDGET_S, NEEDS_DATA, STAGE, STAGE_NAMES, STAGES, Stage

__all__ = ["BUDGET_S", "NEEDS_DATA", "SMOKE_BUDGET_S", "STAGE", "STAGES", "STAGE_NAMES", "Stage",
           "goals", "main", "parse_args", "part_errors", "render_summary", "run_all"]
