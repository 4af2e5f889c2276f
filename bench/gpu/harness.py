"""What the stages of ``python -m bench.gpu`` share: where a stage works (Run), the configs and
shapes they train, a process group of one rank, timing with the device synchronised, the
largest batch that fits (stepping down on out-of-memory), the profiler's kernel times; and
the Goal row, with which a stage module declares what its figures are held to.

These are the stages' public toolbox (``stage_config``, ``world_of_one``, ``seq_length``,
``max_predictions``, ``timed``, ``profile_kernels``, ``profile_step``, ``top_kernels``,
``largest_that_runs``, ``fit_largest``, ``synchronize``, ``free_cuda``, ``is_oom``,
``fusion_fallbacks``): a stage
imports them by these names; what is private to one stage stays in its own module.

Every stage runs on the device it finds: a CUDA GPU, or the CPU in ``--smoke`` mode (tiny
shapes, fp32, the simulated device of runtime.observe.hostsync for the sync checks), where it
checks the harness itself in seconds.

Owns: the shared constants (configs, BERT-large's shape, the tiny model, the attention paths)
and helpers of the stages, the Goal type.
Never: measures a stage's figures or holds a goal's threshold (bench/gpu/stages/ do), or
imports torch before a helper is called (the orchestrator imports the stage table without it).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

from basis.model_shape import size

ROOT = Path(__file__).resolve().parents[2]
DGX_CONFIG = ROOT / "submission" / "configs" / "config_DGXA100_1x8x56x1.toml"
CPU_CONFIG = ROOT / "submission" / "configs" / "config_CPU_1x2x32x1.toml"
SEQ = 512
MAX_PRED = 76
TINY = ["model.num_hidden_layers=2", "model.hidden_size=128", "model.num_attention_heads=2",
        "model.intermediate_size=256", "model.init=scratch"]
# The smoke run's stages that only time steps (tune_profile, graphs) take the uncompiled
# optimizer: the checks and optimizer stages compile it, once each is enough on a CPU.
SMOKE_EAGER = ['optim.backend="foreach"']
LARGE_SHAPE = {**size("large"), "vocab_size": 30522}  # BERT-large (runtime.model.arithmetic)


def partial_path(folder: Path, stage: str) -> Path:
    """Where a stage's cases are written as they finish (read back if it does not): the
    call's --out, so that a call killed mid-stage keeps them."""
    return folder / f"stage_{stage}.partial.json"


Results = Callable[[str], dict]
"""A stage's name -> its recorded result ({} when it did not run or failed)."""


@dataclass(frozen=True)
class Goal:
    """A goal of docs/GPU.md: its name in the record and summary.txt, the figure to meet, and
    its verdict - ``verdict(results, goal)`` reads the stages' recorded results and returns the
    figures with ``met`` (True, False, or None: not measured), or None to leave the goal out
    (a goal its stage reports itself, when that stage did not run)."""

    name: str
    threshold: Optional[float]          # None: a goal without a figure (every test passes)
    verdict: Callable[[Results, "Goal"], Optional[dict]]

    def entry(self, results: Results) -> Optional[dict]:
        """The goal as the record and summary.txt show it: its threshold, figures and verdict."""
        got = self.verdict(results, self)
        if got is None or self.threshold is None:
            return got
        return {"goal": self.threshold, **got}


class Live(dict):
    """A stage's result that writes itself to ``path`` whenever a case is set (``out[k] =
    case``; ``save()`` after changing one in place): a stage killed at its budget loses only
    the case it was in. Written whole to a temporary file and renamed over the last one, so a
    kill mid-write leaves the previous cases."""

    def __init__(self, path: Path, initial: dict):
        super().__init__(initial)
        self.path = path
        self.save()

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.save()

    def save(self) -> None:
        import json
        import os
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self, default=str))
        os.replace(tmp, self.path)


@dataclass
class Run:
    """Where a stage works and how big it may be."""

    work: Path       # the orchestrator's work directory (data sets, stage files)
    smoke: bool      # CPU: tiny shapes, seconds per stage
    plan: str = "verdicts"  # the plan the stage runs in (bench/gpu/table.py PLANS)
    stage: str = "stage"    # its name: where its cases are written as they finish
    data_sets: tuple = ()   # what this call's stages read, in order (table.data_sets): the
    #                         data stage builds them
    out: Optional[Path] = None  # the call's --out: the cases written there as they finish
    #                             (a killed call keeps them; the work folder without it)

    def partial_path(self) -> Path:
        return partial_path(self.out or self.work, self.stage)

    def result(self, initial: dict) -> Live:
        """The stage's result, written after every case (``Live``)."""
        return Live(self.partial_path(), initial)

    @property
    def device(self) -> str:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def data(self, name: str) -> Path:
        return self.work / "data" / name

    def precisions(self) -> list[str]:
        return ["bf16", "fp16"] if self.cuda else ["fp32"]


def world_of_one(device):
    """A process group of one rank on ``device`` (the stages train like a rank of a run)."""
    from runtime.launch import dist
    from runtime.launch.env import discover
    if dist.current() is None:
        dist.init_distributed(discover({}), device="cpu" if str(device).startswith("cpu")
                              else str(device))
    return dist.current()


def synchronize() -> None:
    """Wait for the device (a no-op without CUDA): a timing's ends."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_cuda() -> None:
    """Collect garbage and empty CUDA's cache: between cases, and before a smaller try."""
    import gc
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def is_oom(e: BaseException) -> bool:
    """Whether ``e`` is the device running out of memory (CUDA's error, or its message)."""
    import torch
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e)


def stage_config(run: Run, base: Path, *overrides: str):
    """The config ``base`` with ``overrides``, writing under the work directory and skipping
    the data checksums (the stage built the data itself)."""
    from runtime.config import load_config
    return load_config(base, [f"train.output_dir={run.work / 'runs'}",
                              "data.verify_checksums=false", *overrides])


def seq_length(run: Run) -> int:
    """The sequence length a stage trains: MLPerf's 512, 128 in a smoke run."""
    return SEQ if not run.smoke else 128


def max_predictions(run: Run) -> int:
    """Masked positions per sequence: MLPerf's 76, 20 in a smoke run."""
    return MAX_PRED if not run.smoke else 20


# Packing takes its strata from the data (equal slices): the DGX config's fixed bins
# [128, 256, 384, 512] suit MLPerf's length mix, not this Wikipedia set's (mean 128 of 512,
# 1.8 % in (256, 384]: no sample of that bin in a batch of 8 rows).
PATHS = {"padded": [], "unpadded": ["model.attention=unpadded"],
         "packed": ["data.balance=pack", "data.bin_edges=[]"]}


def fit_largest(measure: Callable[[int], dict], start: int, step: int, total_bytes: int,
                smoke: bool) -> tuple[int, list[dict]]:
    """The largest batch (a multiple of ``step``) that fits: peak memory measured at two
    batches, extrapolated linearly to 92 % of the device, then confirmed (stepping down on
    out-of-memory)."""
    if smoke:
        return start, []
    probes = [measure(start), measure(2 * start)]
    a = (probes[1]["peak_bytes"] - probes[0]["peak_bytes"]) / start
    c = probes[0]["peak_bytes"] - a * start
    batch = max(step, int((0.92 * total_bytes - c) / max(a, 1) // step * step))
    return batch, probes


def largest_that_runs(measure: Callable[..., dict], start: int, step: int, total_bytes: int,
                      smoke: bool, steps: int, warmup: int, tries: int = 4,
                      known: Optional[int] = None) -> tuple[int, dict, list[dict]]:
    """(batch, its measurement, the probes): the largest batch that fits (fit_largest),
    measured over ``steps`` after ``warmup``; an out-of-memory steps the batch down by ``step``
    (the cache freed between tries), at most ``tries`` times and never below ``step``. Any
    other error, and the last try's out-of-memory, is raised: the stage records it as this
    case's error. ``known``: a batch that fit a sibling case (the same model unfused),
    measured without probes - a compiled case then compiles at the batch it is measured at
    (Inductor tunes its kernels for the token count of the first call; a probe's small batch
    would set them)."""
    batch, probes = (known, []) if known else fit_largest(measure, start, step, total_bytes,
                                                          smoke)
    for attempt in range(1, tries + 1):
        try:
            return batch, measure(batch, steps=steps, warmup=warmup), probes
        except Exception as e:  # noqa: BLE001
            if not is_oom(e) or batch <= step or attempt == tries:
                raise
            free_cuda()
            batch -= step
    raise ValueError(f"tries={tries}: give at least 1")


def timed(run: Run, step_fn: Callable[[], Any], warmup: int, steps: int) -> dict:
    """``warmup`` then ``steps`` calls of ``step_fn`` (returns its real tokens, or (tokens,
    model FLOPs)), timed as a whole with the device synchronised at both ends; peak memory of
    the timed steps."""
    import torch
    for _ in range(warmup):
        step_fn()
    synchronize()
    if run.cuda:
        torch.cuda.reset_peak_memory_stats()
    tokens = flops = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        got = step_fn()
        tokens += got[0] if isinstance(got, tuple) else got
        flops += got[1] if isinstance(got, tuple) else 0
    synchronize()
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if run.cuda else 0
    return {"seconds": dt, "steps": steps, "tokens": tokens, "flops": flops,
            "peak_bytes": peak}


class Profiled(NamedTuple):
    """``profile_step``'s answer: per step, the busy seconds and kernels; over all the calls,
    the kernel table and the profile itself (what else a stage reads from it)."""

    busy_s: float
    kernels: float
    names: dict
    prof: Any


def profile_step(run: Run, step, n: int) -> Profiled:
    """``n`` calls of ``step`` under torch.profiler (CUDA activity on a GPU: the kernels, and
    the runtime calls on the host side; CPU ops' self time on CPU)."""
    from torch.profiler import ProfilerActivity, profile
    activity = ProfilerActivity.CUDA if run.cuda else ProfilerActivity.CPU
    synchronize()
    with profile(activities=[activity]) as prof:
        for _ in range(n):
            step()
        synchronize()
    from runtime.observe.profiler import kernel_table
    names = kernel_table(prof, run.cuda)
    busy = sum(t for _, t in names.values()) / n / 1e6
    kernels = sum(c for c, _ in names.values()) / n
    return Profiled(busy, kernels, names, prof)


def profile_kernels(run: Run, step, n: int) -> tuple[float, float, dict]:
    """(busy seconds per step, kernels per step, {kernel name: [calls, µs]}) over ``n``
    calls of ``step`` under the profiler (CPU ops' self time on CPU)."""
    got = profile_step(run, step, n)
    return got.busy_s, got.kernels, got.names


def fusion_fallbacks() -> dict:
    """``{"fusion_fallbacks": {fusion: why}}`` for a case's record when a fused kernel ran its
    reference in this process (kernels.fused: its compile failed), else {}: the case's
    figures are then not the fused model's."""
    from kernels import fused
    got = fused.fallbacks()
    return {"fusion_fallbacks": got} if got else {}


TOP_KERNELS = 30
"""Kernels of a case's profiled step kept in the record, longest first: what a mode, a fusion
or a compiled layer changed, kernel by kernel (the 2026-11-28 record kept only totals)."""


def top_kernels(names: dict, steps: int = 1, top: int = TOP_KERNELS) -> list[dict]:
    """A case's kernel table for the record: the ``top`` kernels by total time of ``names``
    ({name: [calls, µs]} over ``steps`` profiled steps, ``profile_step``), each with its
    calls and total µs per step and its mean µs per call."""
    rows = sorted(names.items(), key=lambda kv: (-kv[1][1], kv[0]))[:top]
    return [{"name": k, "calls": round(c / steps, 2), "us": round(us / steps, 1),
             "mean_us": round(us / c, 2) if c else None} for k, (c, us) in rows]
