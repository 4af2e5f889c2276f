"""The ``short_runs`` stage: the CPU benchmark config trained a few hundred steps on the device
in each precision as ``python -m submission.train`` runs it: losses side by side, fp16's
skipped steps, each MLPerf log through the compliance checker.

Owns: the runs' overrides, what is read from their metrics and logs, the goal on the
losses.
Never: trains in this process (each run is its own ``submission.train``).
"""
from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.gpu.harness import CPU_CONFIG, ROOT, Goal, Results, Run


def _loss_within(results: Results, goal: Goal) -> dict:
    short = results("short_runs").get("goal_within_2pct_of_fp32", {})
    return {"worst": short.get("worst"), "met": short.get("met")}


# bf16's and fp16's final losses against fp32's, relative, at most (the stage's own record
# says it too).
LOSS_WITHIN = Goal("low_precision_loss_within_2pct", 0.02, _loss_within)


def stage_short_runs(run: Run) -> dict:
    """The CPU benchmark config (config_CPU_1x2x32x1: 2 layers, hidden 128) trained for 150
    steps on one device in each precision, as ``python -m submission.train`` runs it:
    the loss trajectories side by side, fp16's skipped steps, and each MLPerf log through the
    compliance checker."""
    steps = 10 if run.smoke else 150
    out = run.result({"steps": steps})
    precisions = ["fp32"] + ([] if not run.cuda else ["bf16", "fp16"])
    # The smoke run checks the harness, not the recipe: one layer, one evaluation, the
    # uncompiled optimizer (the checks and optimizer stages compile it), no PNG.
    smoke = ["model.num_hidden_layers=1", 'optim.backend="foreach"', "train.plot=false",
             f"train.eval_iter_start_samples={64 * steps}"] if run.smoke else []
    for prec in precisions:
        dest = run.work / f"short_{prec}"
        shutil.rmtree(dest, ignore_errors=True)  # this stage's own scratch run (--work reused)
        cmd = [sys.executable, "-m", "submission.train", "--config", str(CPU_CONFIG)]
        for o in (f"train.output_dir={dest}", f"data.data_dir={run.data('cpu128')}",
                  "system.nodes=1", "system.ranks_per_node=1", f"system.device={run.device}",
                  f"train.precision={prec}", f"train.max_steps={steps}",
                  "train.target_mlm_accuracy=0.99", "train.log_every_steps=10",
                  f"train.eval_iter_start_samples={64 * steps // 2}",
                  f"train.eval_iter_samples={64 * steps // 2}", "data.verify_checksums=false",
                  *smoke):
            cmd += ["--set", o]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        rec: dict[str, Any] = {"returncode": proc.returncode,
                               "seconds": round(time.perf_counter() - t0, 1)}
        if proc.returncode not in (0, 1):  # 1: the 0.99 target not reached, as meant
            rec["error"] = f"exit {proc.returncode}: " + (proc.stderr or proc.stdout)[-800:]
        metrics = dest / "metrics.jsonl"
        if metrics.is_file():
            steps_ = [json.loads(x) for x in metrics.read_text().splitlines()]
            steps_ = [s for s in steps_ if s.get("kind") == "step"]
            losses = [s["loss"] for s in steps_]
            tail = [x for x in losses[-max(1, len(losses) // 6):] if math.isfinite(x)]
            rec.update(final_loss=statistics.mean(tail) if tail else None,
                       trajectory=[round(x, 4) for x in losses[::max(1, len(losses) // 15)]],
                       skipped_steps=sum(bool(s.get("skipped")) for s in steps_),
                       last_loss_scale=steps_[-1].get("loss_scale") if steps_ else None)
            log = dest / "mlperf_bert.log"
            chk = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker",
                                  "--usage", "training", "--ruleset", "5.0.0", str(log)],
                                 capture_output=True, text=True, cwd=ROOT)
            text = (chk.stdout + chk.stderr).strip().splitlines()
            rec["compliance"] = {"returncode": chk.returncode, "tail": text[-2:]}
        else:
            rec["error"] = (proc.stderr or proc.stdout).strip()[-800:]
        out[prec] = rec
    base = out.get("fp32", {}).get("final_loss")
    for prec in precisions[1:]:
        loss = out[prec].get("final_loss")
        if base and loss is not None:
            out[prec]["relative_to_fp32"] = loss / base - 1
    diffs = [abs(out[p]["relative_to_fp32"]) for p in precisions[1:]
             if "relative_to_fp32" in out[p]]
    out["goal_within_2pct_of_fp32"] = {"goal": LOSS_WITHIN.threshold,
                                       "worst": max(diffs) if diffs else None,
                                       "met": max(diffs) <= LOSS_WITHIN.threshold if diffs
                                       else None}
    return dict(out)
