"""``python -m bench.gpu``: check and measure the CUDA path in one call (under 9 minutes on one
H100), recording every stage's result even when a later one fails.

    python -m bench.gpu --out DIR                    on a GPU machine, as it is
    python -m bench.gpu --out DIR --stages checks,throughput     a subset, in a second call
    python -m bench.gpu --smoke --out DIR            on CPU: tiny shapes, seconds per stage
                                                     (CI runs it: the harness itself is tested)
    python -m bench.gpu --bundle .gpu_bundle         here, before: what a bare GPU machine
                                                     lacks (docs/GPU.md)

Stages (bench/gpu/stages/ has what each measures; docs/GPU.md the goal each figure meets):
  env           torch / CUDA / driver versions, the GPU, which of apex, DALI, flash import
  data          the data sets, built on the machine with loaders.prepare (seq 128 and 512)
  cuda_tests    the suite's tests marked cuda, pass/fail each
  checks        host syncs per ordinary step, the attention kernel that ran, the fused
                optimizer compiled (no recompile after the first-step re-cut)
  throughput    BERT-large at sequence 512, padded / unpadded / packed, bf16 and fp16, at the
                largest local batch: sequences/s, tokens/s, peak memory
  plain         the plain recipe (HF BertForPreTraining, torch fused AdamW, autocast, pad 512)
  optimizer     fused LAMB / AdamW steps against the device's copy bandwidth, torch's AdamW
  tune_profile  python -m runtime.calibrate.tune --profile-only at the projection's local batches
  small_batches Presto's own step at those batches: back to back vs the host's enqueue time
  attention     the fastest attention kernel per path (padded, packed, unpadded), bf16 with
                dropout 0.1, forward and backward (bench/gpu/stages/attention.py)
  graphs        the small-batch step eager, with encoder graphs and as one whole-step CUDA
                graph (2 and 3 packed rows of 512, local batch 4, 16, 96), each beside its
                busy time; eager at local batch 4 per path and shape policy (bench/gpu/stages/graphs.py)
  short_runs    the CPU benchmark config on the device in fp32 / bf16 / fp16: losses, fp16
                skips, the MLPerf log through the compliance checker

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
"""
from __future__ import annotations

from bench.gpu.orchestrator import (BUDGET_S, NEEDS_DATA, SMOKE_BUDGET_S, STAGE_NAMES, goals,
                                    main, parse_args, part_errors, render_summary, run_all)

__all__ = ["BUDGET_S", "NEEDS_DATA", "SMOKE_BUDGET_S", "STAGE_NAMES", "goals", "main",
           "parse_args", "part_errors", "render_summary", "run_all"]
