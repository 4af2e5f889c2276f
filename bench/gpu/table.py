"""The stages and plans of ``python -m bench.gpu``, one row each.

A stage row: its name, the function its child process runs, its budget, the data sets it
reads, whether it captures CUDA graphs (its process then keeps the default allocator: captured
NCCL collectives and expandable segments do not mix, runtime.choices.GraphMode.allocator), what it
measures (the ``--help`` line) and the goals its figures are held to (each declared beside its
stage, in bench/gpu/stages/). A plan row: the stages one call runs, in order, and its
deadline. The orchestrator derives from these rows the stage list and order, the budgets, the
data sets to build, ``--help``, the printed plan and the goal verdicts.

Budgets are seconds on one H100, from the stages' measured times in bench/results/gpu_*.json
(2026-11-24: env 6-11 s, data 13-18, cuda_tests 43-58 before the graph tests, checks 24-28,
throughput 111-123 for 6 cases, plain 34-41, optimizer 28-58 for 6 cases, tune_profile 32-113,
short_runs 76-82 at 300 steps; 2026-11-27 on an H200: cuda_tests 92 s with the graph tests,
graphs past 120 s after 2 of its 6 eager paths (the dynamic padded step takes 1 s),
throughput 62 s for the unfused case alone at batch 904 - its memory fits a larger batch -,
optimizer past 25 s with a cold compile cache, env past 10 s installing the bundle) and the
new cases' estimated share (fusions and graphs_compiled, not yet run: five cases at one
batch without probes, about 30 s each on an H200 by the throughput record, and about 2
minutes more for each compile of a BERT-large layer; throughput's three FP8 cases, not yet
run either, 20 s: one at the largest batch after its sibling's probes, two at 2 rows; graphs'
six mode cases, estimated: the first about 70 s - as the 2-row case with its three graph modes
and the data probes of 2026-11-28 -, each after it 25 s - a trainer's build, eager and full
graph - and about 30 s more for each new optimizer layout to compile, bf16_master's and
qkv's; graphs_compiled's first compile about a minute); each plan's budgets sum to at most
1/1.2 of its deadline (``SLACK``), and ``verdicts`` - what the open goals need: the graphed
step in each precision and compile mode, the largest-batch throughput with FP8 - fits in 9
minutes: a lent GPU machine (15 minutes, 10 a call) runs it first, then ``rest`` if time is
left (the mode cases took the place of the eager paths, now in ``rest``, and of the
optimizer, now in the third call ``fusions`` with the graph batches). The estimates leave the
mode stages short: they run their 2-row cases first and keep every case they finish, so a
stage ended at its budget keeps the cases that matter most. The CUDA tests, all passing on
their first GPU run
(2026-11-27), lead ``rest``. The records say how good the estimates were (docs/GPU.md).

A new stage: its function (and goals) in a module of bench/gpu/stages/, one row here, and its
name in the plans that run it.

Owns: the rows, in the order the stages run (data before the stages that read it; the stages
whose figures decide open goals first).
Never: runs a stage (the orchestrator does, each in its own process) or imports torch.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Callable

from bench.gpu.harness import Goal, Run
from bench.gpu.stages import (attention, checks, graphs, optimizer, plain, setup, short_runs,
                              throughput, tune_profile)

SLACK = 1.2
"""A plan's deadline over the sum of its stages' budgets, at least."""


@dataclass(frozen=True)
class Stage:
    """One stage of the run."""

    name: str                       # --stages / --stage, the record's key
    run: Callable[[Run], dict]      # in the child process: the stage's JSON-able result
    budget_s: int                   # seconds on one H100 (bench/results/gpu_* and estimates)
    data: tuple[str, ...]           # the data sets it reads (setup.DATA_SETS)
    about: str                      # what it measures, for --help
    goals: tuple[Goal, ...] = ()
    captures: bool = False          # captures CUDA graphs (the default allocator then)


@dataclass(frozen=True)
class Plan:
    """The stages one call runs, in order, within its deadline."""

    name: str
    stages: tuple[str, ...]
    deadline_s: int
    about: str


STAGES = (
    Stage("env", setup.stage_env, 20, (),
          "torch / CUDA / driver versions, the GPU, which of apex, DALI, flash import"),
    Stage("data", setup.stage_data, 20, (),
          "the data sets the plan's stages read, built on the machine with loaders.prepare"),
    Stage("cuda_tests", setup.stage_cuda_tests, 100, (),
          "the suite's tests marked cuda, pass/fail each (their own data set)",
          setup.CUDA_TESTS_GOALS, captures=True),
    Stage("graphs", graphs.stage_graphs, 170, ("seq512",),
          "the small-batch step eager and as one whole-step CUDA graph (encoder graphs too in "
          "bf16 autocast) at 2 full packed rows of 512 and at local batch 4, in each precision "
          "mode (bf16 autocast, bf16_master, bf16_master with qkv): busy time, kernels and the "
          "30 longest, host syncs per replay, CUDA events between replays (launch gaps) and "
          "the host's blocking calls (host waits)", graphs.GOALS, captures=True),
    Stage("graphs_compiled", graphs.stage_graphs_compiled, 70, ("seq512",),
          "graphs' cases with whole layers compiled (bf16_master, qkv and pad_vocab, "
          "model.compile='layers'): compiled in the eager warm-up, then captured",
          captures=True),
    Stage("throughput", throughput.stage_throughput, 170, ("seq512",),
          "BERT-large at sequence 512, unpadded bf16, fused beside unfused, at the largest "
          "local batch: tokens/s, MFU from the wall time between device synchronisations, "
          "share of a measured GEMM peak, the 30 longest kernels; FP8 (model.fp8 = "
          "'tensorwise') beside bf16 at that batch and at 2 rows, with the losses of the "
          "measured steps", throughput.GOALS),
    Stage("optimizer", optimizer.stage_optimizer, 60, (),
          "fused LAMB and AdamW against the device's copy bandwidth, torch's fused AdamW; the "
          "trainer's optimizer phase sharded (a group of 1) against unsharded",
          optimizer.GOALS),
    Stage("graph_batches", graphs.stage_graph_batches, 45, ("seq512",),
          "the three modes at the cluster projection's local batches (3 and 16 sequences, "
          "3 packed rows): the measured profile of runtime.calibrate.tune --simulate",
          captures=True),
    Stage("eager_paths", graphs.stage_eager_paths, 85, ("seq512",),
          "eager steps at local batch 4 per path and shape policy (unpadded, padded and "
          "packed; dynamic, bucketed, static) against unpadded, the unpadded step's host work",
          graphs.EAGER_GOALS),
    Stage("checks", checks.stage_checks, 25, ("small",),
          "host syncs per ordinary step, the attention kernel that ran, the fused optimizer "
          "compiled (no recompile after the first-step re-cut)", (checks.NO_HOST_SYNC,)),
    Stage("throughput_paths", throughput.stage_throughput_paths, 65, ("seq512",),
          "the other paths and precisions at their largest batch (padded, packed; fp16), "
          "fused beside unfused", throughput.PATH_GOALS),
    Stage("plain", plain.stage_plain, 35, ("seq512",),
          "the plain recipe (HF BertForPreTraining, torch fused AdamW, autocast, pad 512)"),
    Stage("attention", attention.stage_attention, 25, ("seq512",),
          "the fastest attention kernel per path (padded, packed, unpadded), bf16 with "
          "dropout 0.1, forward and backward"),
    Stage("tune_profile", tune_profile.stage_tune_profile, 35, ("seq512",),
          "python -m runtime.calibrate.tune --profile-only at local batch 4: forward, backward "
          "and each gradient's ready time (the split the projection scales)"),
    Stage("short_runs", short_runs.stage_short_runs, 35, ("cpu128",),
          "the CPU benchmark config on the device in fp32 / bf16 / fp16: losses, fp16 skips, "
          "the MLPerf log through the compliance checker", (short_runs.LOSS_WITHIN,)),
    Stage("fusions", throughput.stage_fusions, 270, ("seq512",),
          "BERT-large at sequence 512, unpadded bf16, at the unfused model's largest local "
          "batch: each fusion of model.fusions alone and whole layers compiled "
          "(model.compile='layers') beside unfused, each with its 30 longest kernels"),
)

VERDICTS = ("env", "data", "graphs", "graphs_compiled", "throughput")
REST = ("env", "data", "cuda_tests", "eager_paths", "checks", "throughput_paths", "plain",
        "attention", "tune_profile", "short_runs")
THIRD = ("env", "data", "fusions", "graph_batches", "optimizer")
PLANS = (
    Plan("verdicts", VERDICTS, 540,
         "what the open GPU goals need, first on a lent machine (under 9 minutes): the graphed "
         "step in each precision and compile mode, the largest-batch throughput with FP8"),
    Plan("rest", REST, 540, "the CUDA tests first, then the other paths and checks, in a "
         "second call"),
    Plan("fusions", THIRD, 560,
         "each fusion alone at the largest batch, the cluster projection's graph batches and "
         "the optimizer, in a third call"),
    Plan("all", VERDICTS + REST[2:] + ("graph_batches", "optimizer"), 1160,
         "every stage but the fusions in one call (--smoke; a machine that allows 20 "
         "minutes)"),
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
NEEDS_DATA = {s.name for s in STAGES if s.data}
PLAN = {p.name: p for p in PLANS}


def data_sets(stages) -> tuple[str, ...]:
    """The data sets the given stages read, in setup.DATA_SETS order (the orchestrator hands
    them to the data stage in its Run)."""
    wanted = {d for s in stages for d in STAGE[s].data}
    return tuple(d for d in setup.DATA_SETS if d in wanted)


def budget_sum(plan: Plan) -> int:
    return sum(BUDGET_S[s] for s in plan.stages)


def plan_text(plan: Plan, stages=None, smoke_budget_s: int | None = None) -> str:
    """The plan as the run prints it first: each stage with its budget on one H100, and the
    sum against the deadline (``smoke_budget_s``: what each stage may take in --smoke)."""
    stages = list(stages or plan.stages)
    total = sum(BUDGET_S[s] for s in stages)
    head = (f"bench.gpu plan {plan.name}: {len(stages)} stages, budgets {total} s of the "
            f"{plan.deadline_s} s deadline ({total / plan.deadline_s:.0%}) on one H100"
            + (f"; --smoke: each stage up to {smoke_budget_s} s here" if smoke_budget_s else ""))
    return head + "\n" + "\n".join(f"  {i + 1:2d}. {s:17s} {BUDGET_S[s]:4d} s"
                                    for i, s in enumerate(stages))


def help_text(smoke_budget_s: int) -> str:
    """The plans and stages for ``--help``: each stage with its budget, what it measures and
    its goals."""
    lines = ["plans (--plan):"]
    for p in PLANS:
        lines.append(f"  {p.name:9s} deadline {p.deadline_s:4d} s, budgets {budget_sum(p):4d} s: "
                     f"{p.about}")
    lines += ["", f"stages, in the order they run (seconds: the budget on one H100; --smoke: "
                  f"{smoke_budget_s} each; * reads the data sets):"]
    for s in STAGES:
        head = f"  {s.name + (' *' if s.data else ''):18s} {s.budget_s:4d} s  "
        lines += textwrap.wrap(s.about, 96, initial_indent=head,
                               subsequent_indent=" " * len(head))
        for g in s.goals:
            figure = "" if g.threshold is None else f" ({g.threshold:g})"
            lines.append(" " * len(head) + f"goal {g.name}{figure}")
    return "\n".join(lines)
