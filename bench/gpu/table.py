"""The stages and plans of ``python -m bench.gpu``, one row each.

A stage row: its name, the function its child process runs, its budget and the estimate it
covers, the data sets it reads, whether it captures CUDA graphs (its process then keeps the
default allocator: captured NCCL collectives and expandable segments do not mix,
runtime.choices.GraphMode.allocator), what it measures (the ``--help`` line) and the goals its
figures are held to (each declared beside its stage, in bench/gpu/stages/). A plan row: the
stages one call runs, in order, and its deadline. The orchestrator derives from these rows
the stage list and order, the budgets, the data sets to build, ``--help``, the printed plan
and the goal verdicts.

Budgets are seconds on one H100 or H200, each at least its row's ``estimate``: the parts of
the stage's time, each from the records where one measured it (bench/results/gpu_*.json:
2026-11-24 on an H100, 2026-11-27/28 on an H200) and estimated where none did - the new
modes' compiles above all: a fused optimizer's layout about 30 s, Inductor's cold compile of
a BERT-large layer (forward, lazy backward, Triton and autotuning) about 75 s; a compiling
stage's budget covers its compiles (tests/unit/test_bench_gpu.py holds every budget to its
estimate). Each plan's budgets sum to at most 1/1.2 of its deadline (``SLACK``). The plans
run by importance: ``verdicts`` first - what the open goals need, in under 9 minutes (a lent
GPU machine: 15 minutes, 10 a call) -: the best mode's graphed step at 2 full rows (the
compiled layers, full graph first), the uncompiled bf16_master modes, the largest-batch
throughput with FP8 beside bf16; then ``rest`` (the CUDA tests, the 2026-11-28 step
re-measured and the ``b4`` cases, the checks), ``fusions`` (each fusion, the graph batches)
and ``more`` (the other paths with the plain recipe, the eager paths, the tuner's profile,
the short runs and the optimizer: each measured on 2026-11-24/28). The records say how good
the estimates were (docs/GPU.md).

A new stage: its function (and goals) in a module of bench/gpu/stages/, one row here with its
estimate, and its name in the plans that run it.

Owns: the rows, in the order the stages run (data before the stages that read it; the stages
whose figures decide open goals first).
Never: runs a stage (the orchestrator does, each in its own process) or imports torch.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Callable, NamedTuple

from bench.gpu.harness import Goal, Run
from bench.gpu.stages import (attention, checks, graphs, optimizer, plain, setup, short_runs,
                              throughput, tune_profile)

SLACK = 1.2
"""A plan's deadline over the sum of its stages' budgets, at least."""


class Part(NamedTuple):
    """A part of a stage's time: what, its seconds on one H100/H200 (measured where a record
    has it, else estimated), and whether it is a compile."""

    what: str
    seconds: int
    compile: bool = False


@dataclass(frozen=True)
class Stage:
    """One stage of the run."""

    name: str                       # --stages / --stage, the record's key
    run: Callable[[Run], dict]      # in the child process: the stage's JSON-able result
    budget_s: int                   # seconds on one H100/H200: at least the estimate's sum
    estimate: tuple[Part, ...]      # what the budget covers
    data: tuple[str, ...]           # the data sets it reads (setup.DATA_SETS)
    about: str                      # what it measures, for --help
    goals: tuple[Goal, ...] = ()
    captures: bool = False          # captures CUDA graphs (the default allocator then)

    @property
    def estimate_s(self) -> int:
        return sum(p.seconds for p in self.estimate)


@dataclass(frozen=True)
class Plan:
    """The stages one call runs, in order, within its deadline."""

    name: str
    stages: tuple[str, ...]
    deadline_s: int
    about: str


START = Part("the process: torch imported, the data sets' row probes", 15)
BUILD = Part("BERT-large built", 5)
OPTIM = Part("the fused optimizer compiled for the mode's layout", 30, True)
LAYER = Part("Inductor's cold compile of a layer: forward, lazy backward, Triton, autotuning",
             75, True)
FULL = Part("the full graph: 3 eager steps, the capture, 15 timed, 3 profiled, 3 watched", 12)
ENCODER = Part("the encoder graphs: their capture, 15 timed, 3 profiled", 10)
EAGER = Part("eager: 15 timed steps, 3 profiled", 8)

STAGES = (
    Stage("env", setup.stage_env, 15, (Part("measured 6.4-11.4 s (2026-11-24/27)", 12),), (),
          "torch / CUDA / driver versions, the GPU, which of apex, DALI, flash, torchao and "
          "the image's packages import"),
    Stage("data", setup.stage_data, 20, (Part("measured: seq512 8.5-11.3 s, all three sets "
                                              "12.8-17.8 s", 18),), (),
          "the data sets the plan's stages read, built on the machine with loaders.prepare"),
    Stage("graphs_compiled", graphs.stage_graphs_compiled, 170,
          (START, BUILD, Part("the fused optimizer compiled for bf16_master with pad_vocab "
                              "and qkv", 30, True), LAYER, FULL, EAGER), ("seq512",),
          "the best mode first: bf16_master with pad_vocab and qkv, whole layers compiled "
          "(model.compile='layers'), at 2 full packed rows of 512: the full graph (compiled in "
          "its eager warm-up, then captured), then eager - busy time, kernels and each kernel's "
          "calls a step, host syncs per replay, launch gaps, host waits (as graphs)",
          graphs.GOALS, captures=True),
    Stage("graphs", graphs.stage_graphs, 125,
          (START, BUILD, OPTIM, FULL, EAGER, BUILD, OPTIM, FULL, EAGER), ("seq512",),
          "the small-batch step as one whole-step CUDA graph, then eager, at 2 full packed rows "
          "of 512 in the uncompiled bf16_master modes (with qkv, then without): busy time, "
          "kernels a step with every kernel's calls and the 30 longest, host syncs per "
          "replay, CUDA events between replays (launch gaps) and the host's blocking calls "
          "(host waits)", captures=True),
    Stage("throughput", throughput.stage_throughput, 120,
          (Part("the process, torch, the GEMM peak", 8), Part(
              "unpadded bf16: the fused optimizer compiled, 2 probes, the largest batch and 13 "
              "steps, a profiled step (with the fused case: 76 s on the H200, 2026-11-28)", 55,
              True), Part("FP8 beside it: the probes replayed, 13 steps, a profiled step", 35),
           Part("2 sequences, bf16 and FP8: two builds and 16 steps each", 12)), ("seq512",),
          "BERT-large at sequence 512, unpadded bf16 at the largest local batch: tokens/s, MFU "
          "from the wall time between device synchronisations, share of a measured GEMM peak, "
          "the 30 longest kernels; FP8 (model.fp8 = 'tensorwise') beside it at that batch and "
          "both at 2 sequences, with the losses of the measured steps", throughput.GOALS),
    Stage("cuda_tests", setup.stage_cuda_tests, 100,
          (Part("measured 91.5 s with the graph tests (2026-11-27); the tests added since "
                "(compiled layers, FP8) not yet run", 100),), (),
          "the suite's tests marked cuda, pass/fail each (their own data set)",
          setup.CUDA_TESTS_GOALS, captures=True),
    Stage("graphs_baseline", graphs.stage_graphs_baseline, 225,
          (START, BUILD, Part("the fused optimizer compiled for fp32 parameters", 30, True),
           FULL, ENCODER, EAGER, BUILD, FULL, ENCODER, EAGER,
           BUILD, OPTIM, FULL, EAGER, BUILD, OPTIM, FULL, EAGER), ("seq512",),
          "the 2026-11-28 step re-measured (bf16_autocast at 2 full rows: full graph, encoder "
          "graphs, eager), then the local batch of 4 (b4) in it and in the uncompiled "
          "bf16_master modes", captures=True),
    Stage("checks", checks.stage_checks, 25, (Part("measured 23.9-27.8 s (2026-11-24)", 25),),
          ("small",),
          "host syncs per ordinary step, the attention kernel that ran, the fused optimizer "
          "compiled (no recompile after the first-step re-cut)", (checks.NO_HOST_SYNC,)),
    Stage("attention", attention.stage_attention, 25,
          (Part("estimated: 3 paths, their kernels forward and backward", 25),), ("seq512",),
          "the fastest attention kernel per path (padded, packed, unpadded), bf16 with "
          "dropout 0.1, forward and backward"),
    Stage("fusions", throughput.stage_fusions, 350,
          (Part("the process, torch, the GEMM peak", 8), Part(
              "unpadded bf16: the fused optimizer compiled, probes, the largest batch", 55, True),
           Part("every fusion: the two kernels and qkv's layout compiled, measured", 70, True),
           Part("each fusion alone: 4 cases, a layout or a kernel compiled each", 120, True),
           Part("whole layers compiled", 75, True), Part("their measured steps", 20)),
          ("seq512",),
          "BERT-large at sequence 512, unpadded bf16, at the unfused model's largest local "
          "batch: every fusion of model.fusions, each alone and whole layers compiled "
          "(model.compile='layers') beside unfused, each with its 30 longest kernels"),
    Stage("graph_batches", graphs.stage_graph_batches, 45,
          (Part("estimated: 3 cases of the baseline, its optimizer compiled once", 45, True),),
          ("seq512",),
          "the three modes at the cluster projection's local batches (3 and 16 sequences, "
          "3 packed rows): the measured profile of runtime.calibrate.tune --simulate",
          captures=True),
    Stage("throughput_paths", throughput.stage_throughput_paths, 65,
          (Part("estimated from throughput's 111-123 s for 6 cases (2026-11-24)", 65),),
          ("seq512",),
          "the other paths and precisions at their largest batch (padded, packed; fp16), "
          "fused beside unfused", throughput.PATH_GOALS),
    Stage("plain", plain.stage_plain, 35, (Part("measured 34.3-41.2 s (2026-11-24)", 35),),
          ("seq512",),
          "the plain recipe (HF BertForPreTraining, torch fused AdamW, autocast, pad 512)"),
    Stage("eager_paths", graphs.stage_eager_paths, 85,
          (Part("estimated: 6 paths, 13 steps each (the dynamic padded step takes 1 s)", 85),),
          ("seq512",),
          "eager steps at local batch 4 per path and shape policy (unpadded, padded and "
          "packed; dynamic, bucketed, static) against unpadded, the unpadded step's host work",
          graphs.EAGER_GOALS),
    Stage("tune_profile", tune_profile.stage_tune_profile, 35,
          (Part("measured 32.3 s (2026-11-24; 90-113 s with the tuner's old batches)", 35),),
          ("seq512",),
          "python -m runtime.calibrate.tune --profile-only at local batch 4: forward, backward "
          "and each gradient's ready time (the split the projection scales)"),
    Stage("short_runs", short_runs.stage_short_runs, 35,
          (Part("estimated at 150 steps (75.6-81.8 s measured at 300)", 35),), ("cpu128",),
          "the CPU benchmark config on the device in fp32 / bf16 / fp16: losses, fp16 skips, "
          "the MLPerf log through the compliance checker", (short_runs.LOSS_WITHIN,)),
    Stage("optimizer", optimizer.stage_optimizer, 60,
          (Part("measured 28.1-58.2 s (2026-11-24), 50.1 s (2026-11-28)", 58, True),), (),
          "fused LAMB and AdamW against the device's copy bandwidth, torch's fused AdamW; the "
          "trainer's optimizer phase sharded (a group of 1) against unsharded",
          optimizer.GOALS),
)

VERDICTS = ("env", "data", "graphs_compiled", "graphs", "throughput")
REST = ("env", "data", "cuda_tests", "graphs_baseline", "checks", "attention")
THIRD = ("env", "data", "fusions", "graph_batches")
MORE = ("env", "data", "throughput_paths", "plain", "eager_paths", "tune_profile",
        "short_runs", "optimizer")
PLANS = (
    Plan("verdicts", VERDICTS, 540,
         "what the open GPU goals need, first on a lent machine (under 9 minutes): the best "
         "mode's graphed step at 2 full rows (compiled layers, full graph first), the "
         "uncompiled bf16_master modes, the largest-batch throughput with FP8 beside bf16"),
    Plan("rest", REST, 540, "the CUDA tests first, then the 2026-11-28 step re-measured and "
         "the b4 cases, the checks and the attention kernels, in a second call"),
    Plan("fusions", THIRD, 560,
         "every fusion, each alone and compiled layers at the largest batch, the cluster "
         "projection's graph batches, in a third call"),
    Plan("more", MORE, 540,
         "the other paths beside the plain recipe, the eager paths, the tuner's profile, the "
         "short runs and the optimizer (each measured on an H100 before), in a fourth call"),
    Plan("all", VERDICTS + REST[2:] + MORE[2:] + ("graph_batches",), 1500,
         "every stage but the fusions in one call (--smoke; a machine that allows 25 "
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


def plan_text(plan: Plan, stages=None, smoke_budget_s: int | None = None,
              deadline_s: float | None = None) -> str:
    """The plan as the run prints it first: each stage with its budget on one H100/H200 and
    the estimate it covers, and the sum against the deadline (``deadline_s``: the caller's
    --deadline, else the plan's; ``smoke_budget_s``: what each stage may take in --smoke)."""
    stages = list(stages or plan.stages)
    total = sum(BUDGET_S[s] for s in stages)
    deadline = deadline_s or plan.deadline_s
    head = (f"bench.gpu plan {plan.name}: {len(stages)} stages, budgets {total} s of the "
            f"{deadline:.0f} s deadline ({total / deadline:.0%})"
            + (f" (--deadline; the plan's is {plan.deadline_s} s)" if deadline_s else "")
            + (f"; --smoke: each stage up to {smoke_budget_s} s here" if smoke_budget_s else ""))
    return head + "\n" + "\n".join(f"  {i + 1:2d}. {s:17s} {BUDGET_S[s]:4d} s  (estimate "
                                    f"{STAGE[s].estimate_s} s)" for i, s in enumerate(stages))


def help_text(smoke_budget_s: int) -> str:
    """The plans and stages for ``--help``: each stage with its budget, what it measures and
    its goals."""
    lines = ["plans (--plan):"]
    for p in PLANS:
        lines.append(f"  {p.name:9s} deadline {p.deadline_s:4d} s, budgets {budget_sum(p):4d} s: "
                     f"{p.about}")
    lines += ["", f"stages, in the order they run (seconds: the budget on one H100/H200; "
                  f"--smoke: {smoke_budget_s} each; * reads the data sets):"]
    for s in STAGES:
        head = f"  {s.name + (' *' if s.data else ''):18s} {s.budget_s:4d} s  "
        lines += textwrap.wrap(s.about, 96, initial_indent=head,
                               subsequent_indent=" " * len(head))
        for g in s.goals:
            figure = "" if g.threshold is None else f" ({g.threshold:g})"
            lines.append(" " * len(head) + f"goal {g.name}{figure}")
    return "\n".join(lines)
