"""The stages at the cluster projection's small local batches (3, 4 and 16 sequences):
``tune_profile`` (the bucket tuner's per-GPU profile, measured) and ``small_batches``
(Presto's step back to back beside the host's time to enqueue it).

Owns: the batches measured and what each record keeps of the tuner's profile and of the
host's work.
Never: simulates a cluster (runtime.calibrate.tune does, from this profile).
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.gpu.harness import (CPU_CONFIG, DGX_CONFIG, LARGE_SHAPE, ROOT, SMOKE_EAGER, TINY, Run,
                               _config, _max_pred, _seq, _synchronize, _world_of_one)


def stage_tune_profile(run: Run) -> dict:
    """``python -m runtime.calibrate.tune --profile-only`` at the local batches the cluster projection
    uses (3, 4 and 16 sequences: 3,072, 4,096 and 16,384 over 1,024 GPUs), so its per-GPU
    profile can come from a measurement instead of published throughput."""
    batches = (2,) if run.smoke else (3, 4, 16)
    per_batch_s = 100 if run.smoke else 75
    shape = TINY + SMOKE_EAGER if run.smoke else [f"model.{k}={v}"
                                                 for k, v in LARGE_SHAPE.items()]
    out: dict[str, Any] = {"batches": list(batches)}
    for b in batches:
        path = run.work / f"tune_profile_b{b}.json"
        cmd = [sys.executable, "-m", "runtime.calibrate.tune", "--config",
               str(DGX_CONFIG if not run.smoke else CPU_CONFIG), "--profile-only", str(path),
               "--steps", "3" if run.smoke else "5", "--warmup", "2"]
        for o in [f"data.data_dir={run.data('seq512')}", f"train.global_batch_size={b}",
                  "system.nodes=1", "system.ranks_per_node=1", f"system.device={run.device}",
                  "data.balance=random", "data.verify_checksums=false", "model.init=scratch",
                  f"data.max_seq_length={_seq(run)}",
                  f"data.max_predictions_per_seq={_max_pred(run)}", *shape]:
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


def stage_small_batches(run: Run) -> dict:
    """Presto's own step at the projection's small local batches, timed as training runs it
    (steps enqueued back to back, one synchronisation at the end) beside the host's time to
    enqueue one step (``train_step`` never waits for the device, so its return time is the
    host's work) and the host functions that take it (cProfile of one step): where the host
    is slower than the device, a step costs the host's time, whatever the GPU."""
    import cProfile
    import io
    import pstats
    from loaders.dataset import TrainLoader
    from runtime.train.trainer import Trainer

    batches = (2,) if run.smoke else (3, 4, 16)
    shape = TINY + SMOKE_EAGER if run.smoke else [f"model.{k}={v}"
                                                 for k, v in LARGE_SHAPE.items()]
    ctx = _world_of_one(run.device)
    cfg = _config(run, DGX_CONFIG if not run.smoke else CPU_CONFIG,
                  f"data.data_dir={run.data('seq512')}", *shape, "model.init=scratch",
                  "train.global_batch_size=8",
                  "system.nodes=1", "system.ranks_per_node=1", f"system.device={run.device}",
                  "data.balance=random", f"data.max_seq_length={_seq(run)}",
                  f"data.max_predictions_per_seq={_max_pred(run)}",
                  "train.log_every_steps=100000")
    trainer = Trainer(cfg, ctx)
    trainer.setup()
    out: dict[str, Any] = {"attention": cfg.model.attention, "precision": cfg.train.precision}
    try:
        for b in batches:
            loader = TrainLoader(cfg.data.data_dir, 0, 1, b, 11, verify=False)
            it = iter(loader)
            try:
                for _ in range(3):
                    trainer.train_step(it)
                n, host = (3 if run.smoke else 10), []
                _synchronize()
                t0 = time.perf_counter()
                for _ in range(n):
                    h = time.perf_counter()
                    trainer.train_step(it)
                    host.append(time.perf_counter() - h)
                _synchronize()
                chained = (time.perf_counter() - t0) / n
                prof = cProfile.Profile()
                prof.enable()
                trainer.train_step(it)
                prof.disable()
                _synchronize()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
                top = [ln.strip() for ln in text.getvalue().splitlines()
                       if ln.strip() and ln.strip()[0].isdigit()][:12]
                out[f"b{b}"] = {"step_s": chained, "host_s": statistics.median(host),
                                "sequences_per_s": b / chained, "host_top": top}
            finally:
                loader.close()
                trainer.step_log.flush()
    finally:
        trainer.close()
    return out
