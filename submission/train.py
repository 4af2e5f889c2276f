"""Per-rank entry point: ``python -m submission.train --config FILE [--set section.key=value ...]``.

Started once per rank by run_and_time.sh (mpiexec/mpirun/srun/torchrun). Loads and validates
the config (an invalid one stops every rank before anything trains), joins the process group,
checks that all ranks hold the same config, attaches the MLPerf logger, metrics and progress
callbacks, trains, and on rank 0 draws the plot and says where everything went.

Exit status: 0 when the target accuracy was reached, 1 when the run was aborted (budget spent)
or failed, 2 for an invalid config.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from runtime.config import ConfigError, load_config
from runtime.dist import check_same_on_all_ranks, init_distributed, run_guarded, shutdown
from runtime.env import LaunchError, cache_cleared, discover
from runtime.events import CallbackList
from runtime.metrics import MetricsWriter, ProgressPrinter, plot_metrics
from runtime.trainer import Trainer
from submission.mllog_callback import MLPerfLogger

LOG_NAME = "mlperf_bert.log"
METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "loss_accuracy.png"


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m submission.train", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="config TOML (submission/configs/...)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one config key (repeatable)")
    return ap.parse_args(argv)


def set_threads(cfg, local_world_size: int) -> None:
    """Give each rank its share of the cores (2 ranks on 2 cores: one thread each)."""
    n = cfg.system.threads_per_rank or max(1, (os.cpu_count() or 1) // max(local_world_size, 1))
    torch.set_num_threads(n)


def train(cfg, info, cache_clear: bool | None = None) -> int:
    ctx = init_distributed(info, device=cfg.system.device, timeout_s=cfg.system.dist_timeout_s)
    check_same_on_all_ranks("config", cfg.fingerprint())
    set_threads(cfg, info.local_world_size)
    out = Path(cfg.train.output_dir)
    callbacks = CallbackList([
        MLPerfLogger(out / LOG_NAME, is_main=ctx.rank == 0, cache_clear=cache_clear),
        MetricsWriter(out / METRICS_NAME, every=1),
        ProgressPrinter(every=cfg.train.log_every_steps),
    ])
    trainer = Trainer(cfg, ctx, callbacks)
    try:
        state = trainer.fit()
    finally:
        trainer.close()
    if ctx.rank == 0:
        finish(cfg, state, out)
    shutdown()
    return 0 if state.status == "success" else 1


def finish(cfg, state, out: Path) -> None:
    png = plot_metrics(out / METRICS_NAME, out / PLOT_NAME,
                       title=f"{Path(cfg.source).name} seed {cfg.train.seed}",
                       target=cfg.train.target_mlm_accuracy)
    summary = {"status": state.status, "steps": state.step, "samples": state.samples,
               "eval_accuracy": state.eval_accuracy, "seed": cfg.train.seed,
               "config": cfg.source, "mllog": str(out / LOG_NAME),
               "metrics": str(out / METRICS_NAME), "plot": str(png)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"mllog log:    {out / LOG_NAME}\nmetrics:      {out / METRICS_NAME}\n"
          f"plot:         {png}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        info = discover()
        cache_clear = cache_cleared()  # run.sub's word on the page caches (None: not run.sub)
        cfg.local_batch_size(info.world_size)  # fail before any rank trains
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return 2
    except LaunchError as e:
        print(f"launch error: {e}", file=sys.stderr, flush=True)
        return 2
    return run_guarded(lambda: train(cfg, info, cache_clear), info)


if __name__ == "__main__":
    sys.exit(main())
