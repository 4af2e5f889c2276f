"""``python -m bench.gpu``: check and measure the CUDA path on a GPU machine, a plan of stages
per call, recording every stage's result - and each case a stage finished - even when a later
one fails or the call is killed.

    python -m bench.gpu --out DIR                    the verdicts plan: what the open goals
                                                     need, under 9 minutes on one GPU
    python -m bench.gpu --out DIR --deadline 500     the same within the call's real limit
    python -m bench.gpu --out DIR2 --plan rest       the CUDA tests, the 2026-11-28 step
                                                     re-measured, the b4 cases: a second call
    python -m bench.gpu --out DIR3 --plan fusions    each fusion, the graph batches: a third
    python -m bench.gpu --out DIR4 --plan more       the other paths, the plain recipe, the
                                                     tuner's profile, the optimizer: a fourth
    python -m bench.gpu --out DIR --stages checks    a subset of the plan's stages
    python -m bench.gpu --smoke --out DIR --plan all on CPU: tiny shapes, seconds per stage
                                                     (CI runs it: the harness itself is tested)
    python -m bench.gpu --bundle .gpu_bundle         here, before: what a bare GPU machine
                                                     lacks (docs/GPU.md)

The plans and stages, in the order they run, with their budgets and goals: ``python -m
bench.gpu --help`` (one row each in bench/gpu/table.py; what each measures: bench/gpu/stages/
and docs/GPU.md). The run prints its plan with the budgets first.

Each stage is a child process (``--stage NAME``) in its own process group with its own time
budget, all within the plan's deadline: a crash, a hang or an out-of-memory ends that stage
(and whatever it started), not the run, and the cases it finished are kept.
Writes to ``--out`` (at most 4 files, as few as a lent machine sends back; a fifth while a
stage runs: its cases so far), the record and summary.txt again after every stage:
  gpu_<device>_<date>.json   the record: every stage's result, its status and seconds
  summary.txt                the goals, each met or missed, with the figures; the graph
                             cases mode by mode, the throughput cases
  stages.log                 every stage's output
  cuda_tests.xml             the CUDA tests' JUnit report
  stage_<name>.partial.json  while a stage runs: the cases it finished (a killed call keeps
                             it; folded into the record when the stage ends)
Exit 0 when every stage ran to the end (a missed goal is a result), 1 when one failed, ran
out of time, ran with a part failed (status ``partial``: one path or batch of it broke) or
was ended with the call (SIGTERM: status ``ended``), 2 on bad arguments.

The package: orchestrator.py (the command line, the child processes, the record, the goal
verdicts, summary.txt), table.py (the stage and plan rows), harness.py (what the stages
share), stages/ (the stage functions and their goals), case_log.py (the CUDA tests' outcomes
as they end), bundle.py (--bundle).
Owns: the GPU check. Never: a measurement outside a stage's own process.
"""
from __future__ import annotations

from bench.gpu.orchestrator import (SMOKE_BUDGET_S, goals, main, parse_args, part_errors,
                                    render_summary, run_all)
from bench.gpu.table import (BUDGET_S, NEEDS_DATA, PLAN, PLANS, SLACK, STAGE, STAGE_NAMES,
                             STAGES, Plan, Stage)

__all__ = ["BUDGET_S", "NEEDS_DATA", "PLAN", "PLANS", "SLACK", "SMOKE_BUDGET_S", "STAGE",
           "STAGES", "STAGE_NAMES", "Plan", "Stage", "goals", "main", "parse_args", "part_errors",
           "render_summary", "run_all"]
