"""The ``tune_profile`` stage: the bucket tuner's per-GPU profile at the cluster projection's
small local batches (3, 4 and 16 sequences) - each gradient's ready time, the split the
projection scales. The step itself at those batches, eager and graphed: the ``graphs`` and
``graph_batches`` stages (bench/gpu/stages/graphs.py), each step timed once.

Owns: the batches measured and what each record keeps of the tuner's profile.
Never: simulates a cluster (runtime.calibrate.tune does, from this profile).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from bench.gpu.harness import (CPU_CONFIG, DGX_CONFIG, LARGE_SHAPE, ROOT, SMOKE_EAGER, TINY, Run,
                               max_predictions, seq_length)


def stage_tune_profile(run: Run) -> dict:
    """``python -m runtime.calibrate.tune --profile-only`` at local batch 4 (4,096 sequences over
    1,024 GPUs, NVIDIA's v2.0 run), so the projection's split of a step into forward, backward
    and gradient ready times comes from a GPU; its step times at the projection's batches
    come from the graphs stages."""
    batches = (2,) if run.smoke else (4,)
    per_batch_s = 100 if run.smoke else 30
    shape = TINY + SMOKE_EAGER if run.smoke else [f"model.{k}={v}"
                                                 for k, v in LARGE_SHAPE.items()]
    out = run.result({"batches": list(batches)})
    for b in batches:
        path = run.work / f"tune_profile_b{b}.json"
        cmd = [sys.executable, "-m", "runtime.calibrate.tune", "--config",
               str(DGX_CONFIG if not run.smoke else CPU_CONFIG), "--profile-only", str(path),
               "--steps", "3", "--warmup", "1" if run.smoke else "2"]
        for o in [f"data.data_dir={run.data('seq512')}", f"train.global_batch_size={b}",
                  "system.nodes=1", "system.ranks_per_node=1", f"system.device={run.device}",
                  "data.balance=random", "data.verify_checksums=false", "model.init=scratch",
                  f"data.max_seq_length={seq_length(run)}",
                  f"data.max_predictions_per_seq={max_predictions(run)}", *shape]:
            cmd += ["--set", o]
        t0 = time.perf_counter()
        try:  # each batch its own time limit: one hang leaves the others measured
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                  timeout=per_batch_s)
        except subprocess.TimeoutExpired as e:
            tail = e.stderr or e.stdout or b""
            tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            out[f"b{b}"] = {"error": f"ran past {per_batch_s} s: {tail.strip()[-500:]}"}
            print(f"tune_profile b{b}: ran past {per_batch_s} s", flush=True)
            continue
        seconds = round(time.perf_counter() - t0, 1)
        print(f"tune_profile b{b}: exit {proc.returncode} after {seconds} s", flush=True)
        if proc.returncode != 0 or not path.is_file():
            out[f"b{b}"] = {"error": (proc.stderr or proc.stdout).strip()[-600:]}
            continue
        prof = json.loads(path.read_text())["profile"]
        compute = prof["forward_s"] + prof["backward_s"]
        out[f"b{b}"] = {"seconds": seconds,
                        "forward_s": prof["forward_s"], "backward_s": prof["backward_s"],
                        "optimizer_s": prof["optimizer_s"],
                        "sequences_per_s": b / compute if compute > 0 else None,
                        "profile": prof}
    return out
