"""The stages of ``python -m bench.gpu`` by name: the function each child process runs.

Owns: the name -> function table.
Never: runs a stage (the orchestrator does, each in its own process).
"""
from __future__ import annotations

from typing import Callable

from bench.gpu.harness import Run
from bench.gpu.stages import (attention, checks, graphs, optimizer, plain, setup, short_runs,
                              small_batches, throughput)

STAGES: dict[str, Callable[[Run], dict]] = {
    "env": setup.stage_env, "data": setup.stage_data, "cuda_tests": setup.stage_cuda_tests,
    "checks": checks.stage_checks, "throughput": throughput.stage_throughput,
    "plain": plain.stage_plain, "optimizer": optimizer.stage_optimizer,
    "tune_profile": small_batches.stage_tune_profile,
    "small_batches": small_batches.stage_small_batches, "graphs": graphs.stage_graphs,
    "attention": attention.stage_attention,
    "short_runs": short_runs.stage_short_runs,
}
