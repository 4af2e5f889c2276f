"""The stages of ``python -m bench.gpu``, one row each: its name, the function its child process
runs, its budget, whether it reads the data sets, what it measures (the ``--help`` line) and
the goals its figures are held to (each declared beside its stage, in bench/gpu/stages/).
The orchestrator derives from these rows the stage list and order, the budgets, the stages
that wait for data, ``--help`` and the goal verdicts of the record and summary.txt.

A new stage: its function (and goals) in a module of bench/gpu/stages/, and one row here.

Owns: the rows, in the order the stages run (data before the stages that read it).
Never: runs a stage (the orchestrator does, each in its own process) or imports torch.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Callable

from bench.gpu.harness import Goal, Run
from bench.gpu.stages import (attention, checks, graphs, optimizer, plain, setup, short_runs,
                              small_batches, throughput)


@dataclass(frozen=True)
class Stage:
    """One stage of the run."""

    name: str                       # --stages / --stage, the record's key
    run: Callable[[Run], dict]      # in the child process: the stage's JSON-able result
    budget_s: int                   # seconds on one H100 (most need far less); the deadline caps all
    needs_data: bool                # reads the data sets: skipped without the data stage or --work
    about: str                      # what it measures, for --help
    goals: tuple[Goal, ...] = ()


STAGES = (
    Stage("env", setup.stage_env, 30, False,
          "torch / CUDA / driver versions, the GPU, which of apex, DALI, flash import"),
    Stage("data", setup.stage_data, 90, False,
          "the data sets, built on the machine with loaders.prepare (seq 128 and 512)"),
    Stage("cuda_tests", setup.stage_cuda_tests, 150, True,
          "the suite's tests marked cuda, pass/fail each", setup.CUDA_TESTS_GOALS),
    Stage("checks", checks.stage_checks, 90, True,
          "host syncs per ordinary step, the attention kernel that ran, the fused optimizer "
          "compiled (no recompile after the first-step re-cut)", (checks.NO_HOST_SYNC,)),
    Stage("throughput", throughput.stage_throughput, 200, True,
          "BERT-large at sequence 512, padded / unpadded / packed, bf16 and fp16, fused beside "
          "unfused, at the largest local batch: sequences/s, tokens/s, MFU, peak memory",
          throughput.GOALS),
    Stage("plain", plain.stage_plain, 90, True,
          "the plain recipe (HF BertForPreTraining, torch fused AdamW, autocast, pad 512)"),
    Stage("optimizer", optimizer.stage_optimizer, 75, False,
          "fused LAMB / AdamW steps against the device's copy bandwidth, torch's AdamW",
          (optimizer.LAMB_WITHIN,)),
    Stage("tune_profile", small_batches.stage_tune_profile, 240, True,
          "python -m runtime.calibrate.tune --profile-only at the projection's local batches"),
    Stage("small_batches", small_batches.stage_small_batches, 90, True,
          "Presto's own step at those batches: back to back vs the host's enqueue time"),
    Stage("graphs", graphs.stage_graphs, 200, True,
          "the small-batch step eager, with encoder graphs and as one whole-step CUDA graph "
          "(2 and 3 packed rows of 512, local batch 4, 16, 96), each beside its busy time; "
          "eager at local batch 4 per path and shape policy", graphs.GOALS),
    Stage("attention", attention.stage_attention, 60, True,
          "the fastest attention kernel per path (padded, packed, unpadded), bf16 with "
          "dropout 0.1, forward and backward"),
    Stage("short_runs", short_runs.stage_short_runs, 120, True,
          "the CPU benchmark config on the device in fp32 / bf16 / fp16: losses, fp16 skips, "
          "the MLPerf log through the compliance checker", (short_runs.LOSS_WITHIN,)),
)


def _by_name(rows: tuple[Stage, ...]) -> dict[str, Stage]:
    """The rows by name; a stage or goal name used twice is refused (the record keys them)."""
    out: dict[str, Stage] = {}
    goals: set[str] = set()
    for row in rows:
        if row.name in out:
            raise ValueError(f"bench.gpu: stage {row.name!r} has two rows")
        out[row.name] = row
        for g in row.goals:
            if g.name in goals:
                raise ValueError(f"bench.gpu: goal {g.name!r} is declared twice")
            goals.add(g.name)
    return out


STAGE = _by_name(STAGES)
STAGE_NAMES = tuple(STAGE)
BUDGET_S = {s.name: s.budget_s for s in STAGES}
NEEDS_DATA = {s.name for s in STAGES if s.needs_data}


def help_text(smoke_budget_s: int) -> str:
    """The stages for ``--help``: each with its budget, what it measures and its goals."""
    lines = [f"stages, in the order they run (seconds: the budget on one H100; --smoke: "
             f"{smoke_budget_s} each; * reads the data sets):"]
    for s in STAGES:
        head = f"  {s.name + (' *' if s.needs_data else ''):15s} {s.budget_s:4d} s  "
        lines += textwrap.wrap(s.about, 96, initial_indent=head,
                               subsequent_indent=" " * len(head))
        for g in s.goals:
            figure = "" if g.threshold is None else f" ({g.threshold:g})"
            lines.append(" " * len(head) + f"goal {g.name}{figure}")
    return "\n".join(lines)
