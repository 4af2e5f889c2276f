"""Per-rank entry point: ``python -m submission.train --config FILE [--set section.key=value ...]``.

Started once per rank by run_and_time.sh (mpiexec/mpirun/srun/torchrun). Records stop signals
from its first line on (runtime.launch.signals), loads and validates the config (an invalid one stops
every rank before anything trains), joins the process group, checks that all ranks hold the
same config, checks the run directory (below), attaches the MLPerf logger, metrics, progress
and status callbacks, trains - resuming from the newest complete checkpoint in
``train.checkpoint_dir`` when there is one - and on rank 0 draws the plot and says where
everything went.

The run directory (``train.output_dir``) holds one run, never overwritten: a directory whose
MLPerf log has run_stop (a finished run), or a log but no checkpoint to continue it from, is
refused; so is one another live run holds - an flock on ``<dir>/.lock``, and on
``<train.checkpoint_dir>/.lock`` when checkpoints go elsewhere: a checkpoint directory is held
by one live run too. run_and_time.sh takes both locks before it launches and hands rank 0 its
holder line (``--lock-holder``): rank 0 accepts a lock held under that line, and takes the
lock itself when nobody holds it (a launch without run_and_time.sh). A log without run_stop
and a complete checkpoint: the run resumes and continues that log.

``--signals-ready DIR`` (run_and_time.sh's): once the stop-signal handlers are in - the first
thing this module does - a file in DIR says so (runtime.launch.signals.announce); the script
holds a stop request until every rank has said it, since a stop signal before the handlers
would kill the rank. ``--shm-notes DIR`` (run_and_time.sh's): once MPI has started, the
/dev/shm files it maps are noted in DIR, for the script to remove after the launch
(submission.shm: MPICH leaves them when a job ends without MPI_Finalize).

Before torch loads, the rank sets two variables of its own environment (a value the user set
wins): CUDA's allocator settings for ``train.cuda_graphs`` (``set_allocator``) and kineto's log
level, which silences torch.profiler's raw lines under ``train.profile_steps``
(``quiet_profiler``).

Exit status: 0 success, 1 target not reached, 2 bad input, 3 runtime failure, 4 stopped by a
signal - what each covers is the table in README.md, "Exit status" (run_and_time.sh and run.sub
pass the status on).
"""
from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from runtime.choices import GRAPH_MODES
from runtime.launch import signals


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m submission.train",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="config TOML (submission/configs/...)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one config key (repeatable)")
    ap.add_argument("--lock-holder", default="", metavar="LINE",
                    help="run_and_time.sh's: the line of the locks it holds for this run on "
                         "the run and checkpoint directories (rank 0 accepts them)")
    ap.add_argument("--signals-ready", default="", metavar="DIR",
                    help="run_and_time.sh's: say in DIR when the stop-signal handlers are in")
    ap.add_argument("--shm-notes", default="", metavar="DIR",
                    help="run_and_time.sh's: note in DIR the /dev/shm files MPI maps, for it "
                         "to remove once the ranks are gone (submission.shm)")
    return ap.parse_args(argv)


def set_allocator(argv, environ=os.environ) -> None:
    """CUDA's caching allocator settings for the run ``argv`` configures (growable segments
    for eager steps, the default under CUDA graphs: runtime.choices.GraphMode.allocator), set
    before torch is imported - torch reads them when it loads. A value the user set wins
    (growable segments with graphs: said to be a risk); a config that does not load leaves
    the default, and main() reports why."""
    from runtime.config import load_config
    config, sets = None, []  # (argparse would print its usage errors twice: main's is enough)
    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if not value and i + 1 < len(argv):
            value = argv[i + 1]
        if flag == "--config":
            config = value
        elif flag == "--set":
            sets.append(value)
    try:
        mode = load_config(config, sets).train.cuda_graphs
    except Exception:  # noqa: BLE001 - main() loads it again and says what is wrong
        return
    user = environ.get("PYTORCH_CUDA_ALLOC_CONF", environ.get("PYTORCH_ALLOC_CONF"))
    if user is None:
        conf = GRAPH_MODES[mode].allocator
        if conf is not None:
            environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
    elif "expandable_segments:true" in user.replace(" ", "").lower() \
            and GRAPH_MODES[mode].captures:
        print(f"warning: PYTORCH_CUDA_ALLOC_CONF={user} with train.cuda_graphs='{mode}': "
              f"replays of captured NCCL collectives have hung with expandable segments "
              f"(pytorch/pytorch#158029); unset it, or set NCCL_GRAPH_REGISTER=0",
              file=sys.stderr, flush=True)


KINETO_QUIET = "6"
"""KINETO_LOG_LEVEL for the ranks: torch.profiler's kineto prints two raw lines per profiled
step ("USDT: ... profiler_start", "... profiler_stop") at its highest level (5, USDT, above
ERROR at 4), so only a level above every message silences them - kineto's errors too; a
profiled step's record still says what it measured (0 kernels when CUPTI failed). Set
KINETO_LOG_LEVEL yourself (4: errors and those lines) to see them."""


def quiet_profiler(environ=os.environ) -> None:
    """Kineto's level for train.profile_steps, before torch loads (the user's wins)."""
    environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)


if __name__ == "__main__":
    # Before the heavy imports: a TERM while torch loads is a stop request too. Only as the
    # entry point - a module that imports this one (a test, pytest itself) keeps its own
    # handlers; main() installs them for callers that run it (bench.fault_rank).
    signals.install()
    if "--signals-ready" in sys.argv[:-1]:
        signals.announce(sys.argv[sys.argv.index("--signals-ready") + 1])
    set_allocator(sys.argv[1:])
    quiet_profiler()

import torch  # noqa: E402

from loaders.shards import DataError  # noqa: E402
from runtime.train.checkpoint import CheckpointError, find_latest  # noqa: E402
from runtime.config import ConfigError, load_config  # noqa: E402
from runtime.launch.dist import (RanksDisagree, broadcast_object, check_same_on_all_ranks,
                                 init_distributed, keep_tracebacks, on_failure, run_guarded,
                                 shutdown)
from runtime.launch.env import LaunchError, cache_cleared, discover  # noqa: E402
from runtime.model import inductor_cache  # noqa: E402
from runtime.events import CallbackList  # noqa: E402
from runtime.observe.metrics import MetricsWriter, ProgressPrinter, plot_metrics  # noqa: E402
from runtime.train.trainer import InitCheckpointError, Trainer  # noqa: E402
from submission.mllog_callback import MLPerfLogger, _logged_keys  # noqa: E402
from submission import rank_status, shm  # noqa: E402
from submission.rank_status import PEER_GRACE_S, RankStatus, lost_ranks  # noqa: E402

LOG_NAME = "mlperf_bert.log"
METRICS_NAME = "metrics.jsonl"
PLOT_NAME = "loss_accuracy.png"
LOCK_NAME = ".lock"

EXIT_SUCCESS, EXIT_NOT_REACHED, EXIT_BAD_INPUT, EXIT_FAILURE, EXIT_STOPPED = 0, 1, 2, 3, 4


class RunDirError(RuntimeError):
    """The run directory cannot take this run; the message says what to do. Raised alike on
    every rank (rank 0 decides)."""

    raised_on_all_ranks = True
    exit_code = EXIT_BAD_INPUT


BAD_INPUT = (ConfigError, DataError, LaunchError, RanksDisagree, RunDirError, CheckpointError,
             InitCheckpointError)


def exit_code_of(e: BaseException) -> int:
    """The exit status an exception ends a rank with (the table in the module docstring)."""
    if isinstance(e, BAD_INPUT):
        return EXIT_BAD_INPUT
    if isinstance(e, KeyboardInterrupt):
        return EXIT_STOPPED
    return getattr(e, "exit_code", EXIT_FAILURE)


def expected_failure(e: BaseException) -> bool:
    """A failure whose message says all there is (a full disk, a stop signal, a refusal):
    the console gets its one line, the rank's log file its traceback."""
    if isinstance(e, (*BAD_INPUT, KeyboardInterrupt)) or hasattr(type(e), "exit_code"):
        return True   # LogWriteError, CheckpointWriteError: the disk is full
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


def rank_log(out: Path, rank: int):
    """``keep_tracebacks``' sink for this rank: appends to ``<run dir>/ranks/rank_<r>.log``
    (beside its status record), or a file in the temporary directory when the run directory
    cannot take it (its disk is full); returns where it went."""
    def keep(text: str) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        body = f"--- rank {rank}, pid {os.getpid()}, {stamp}\n{text}"
        path = rank_status.status_path(out, rank).with_suffix(".log")
        existed = path.exists()
        try:
            with open(path, "a") as f:
                f.write(body)
        except OSError:
            if not existed:   # no empty file left behind on the full disk
                try:
                    path.unlink()
                except OSError:
                    pass
            fd, name = tempfile.mkstemp(prefix=f"presto_rank{rank}_", suffix=".log")
            with os.fdopen(fd, "w") as f:
                f.write(body)
            path = Path(name)
        return str(path)
    return keep


def exit_code_of_run(state) -> int:
    """The exit status of a run that ended without an exception (the module docstring's
    table), from its RUN_STOP state."""
    code = {"success": EXIT_SUCCESS, "interrupted": EXIT_STOPPED}.get(state.status)
    if code is None:  # aborted: budget spent, diverged, or stopped with nothing to resume
        code = EXIT_FAILURE if state.stop_reason == "diverged" else \
            EXIT_STOPPED if (state.stop_reason or "").startswith("signal") else EXIT_NOT_REACHED
    return code


def set_threads(cfg, local_world_size: int) -> None:
    """Give each rank its share of the cores (2 ranks on 2 cores: one thread each)."""
    n = cfg.system.threads_per_rank or max(1, (os.cpu_count() or 1) // max(local_world_size, 1))
    torch.set_num_threads(n)


# ------------------------------------------------------------------------ the run directory

_held: list = []  # the lock files rank 0 holds open (and locked) for the life of the process


def hold(directory: Path, holder: str, ours: str = "") -> str | None:
    """Hold ``directory/.lock`` for this run (rank 0): None when it is this run's - locked now
    (its first line then says ``holder``), or held for this run by run_and_time.sh under the
    line ``ours`` -, else the first line of the run that holds it."""
    directory.mkdir(parents=True, exist_ok=True)
    lock = open(directory / LOCK_NAME, "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        line = lock.readline().strip()
        lock.close()
        return None if ours and line == ours else (line or "another process")
    lock.seek(0)
    lock.truncate()
    lock.write(holder + "\n")
    lock.flush()
    _held.append(lock)
    return None


def own_checkpoint_dir(cfg) -> Path | None:
    """The checkpoint directory when it needs a lock of its own: checkpoints on and kept
    outside the run directory (inside it, the run directory's lock covers them)."""
    if cfg.train.checkpoint_every_samples <= 0 or not cfg.train.checkpoint_dir:
        return None
    out = Path(cfg.train.output_dir).resolve()
    ckpt = Path(cfg.train.checkpoint_dir).resolve()
    return None if ckpt == out or out in ckpt.parents else ckpt


def run_dir_problem(cfg, lock_holder: str = "") -> str | None:
    """Why ``train.output_dir`` (or ``train.checkpoint_dir``) cannot take this run (None: it
    can). Rank 0 only. ``lock_holder``: the line of run_and_time.sh's locks for this run."""
    out = Path(cfg.train.output_dir)
    log = out / LOG_NAME
    if log.is_file() and log.stat().st_size > 0:
        keys = _logged_keys(log)
        if "run_stop" in keys:
            return (f"{out} holds a finished run ({log} has run_stop): results are never "
                    f"overwritten - choose another train.output_dir (run_and_time.sh makes a "
                    f"fresh directory unless RUN_DIR or train.output_dir is given)")
        if cfg.train.checkpoint_every_samples <= 0:
            return (f"{out} holds the log of an interrupted run ({log}, no run_stop) and this "
                    f"run writes no checkpoints (train.checkpoint_every_samples = 0), so it "
                    f"cannot continue it: choose another train.output_dir")
        if find_latest(cfg.train.checkpoint_path(), warn=lambda m: None) is None:
            return (f"{out} holds the log of an interrupted run ({log}, no run_stop) and no "
                    f"complete checkpoint in {cfg.train.checkpoint_path()} to continue it "
                    f"from: choose another train.output_dir")
    line = (f"pid {os.getpid()} on {socket.gethostname()} since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S')} for run directory {out.resolve()}")
    holder = hold(out, line, lock_holder)
    if holder:
        return (f"{out} is in use by another run ({holder}): wait for it to end, or choose "
                f"another train.output_dir")
    ckpt = own_checkpoint_dir(cfg)
    holder = hold(ckpt, line, lock_holder) if ckpt else None
    if holder:
        return (f"train.checkpoint_dir {ckpt} is in use by another run ({holder}): two runs "
                f"writing one checkpoint directory overwrite each other's checkpoints - wait "
                f"for it to end, or choose another train.checkpoint_dir")
    rank_status.clear(out)  # an earlier attempt's rank records (a resume) are not this one's
    return None


def check_run_dir(cfg, rank: int, lock_holder: str = "") -> None:
    problem = run_dir_problem(cfg, lock_holder) if rank == 0 else None
    problem = broadcast_object(problem)
    if problem:
        raise RunDirError(problem)


# ------------------------------------------------------------------------------ the run

def train(cfg, info, cache_clear: bool | None = None, lock_holder: str = "") -> int:
    ctx = init_distributed(info, device=cfg.system.device, timeout_s=cfg.system.dist_timeout_s)
    check_same_on_all_ranks("config", cfg.fingerprint())
    set_threads(cfg, info.local_world_size)
    check_run_dir(cfg, ctx.rank, lock_holder)
    out = Path(cfg.train.output_dir)
    status = RankStatus(out, ctx.rank, ctx.world_size)
    keep_tracebacks(rank_log(out, ctx.rank))   # the run directory is this run's now
    trainer = None

    def note(e: BaseException) -> str:
        """Added to this rank's failure message: the last completed step, lost peers."""
        said, gone = lost_ranks(out, ctx.rank, PEER_GRACE_S if ctx.world_size > 1 else 0.0)
        status.finish(exit_code_of(e), "failed", f"{type(e).__name__}: {e}", lost=gone)
        st = trainer.state if trainer is not None else None
        step = f"last completed step {st.step} ({st.samples} samples)" if st else \
            "before training started"
        return "; ".join([step] + said)

    on_failure(note)
    callbacks = CallbackList([
        MLPerfLogger(out / LOG_NAME, is_main=ctx.rank == 0, cache_clear=cache_clear),
        MetricsWriter(out / METRICS_NAME, every=1),
        ProgressPrinter(every=cfg.train.log_every_steps),
        status,
    ])
    if cfg.train.tensorboard:
        from runtime.observe.tensorboard import TensorBoardWriter
        callbacks.add(TensorBoardWriter(out / "tensorboard"))
    trainer = Trainer(cfg, ctx, callbacks)
    try:
        state = trainer.fit()
    finally:
        trainer.close()
    code = exit_code_of_run(state)
    if ctx.rank == 0:
        finish(cfg, state, out)
    status.finish(code, "finished" if code in (0, 1) else "stopped",
                  state.stop_reason or state.status or "")
    shutdown()
    return code


def finish(cfg, state, out: Path) -> None:
    png = plot_metrics(out / METRICS_NAME, out / PLOT_NAME,
                       title=f"{Path(cfg.source).name} seed {cfg.train.seed}",
                       target=cfg.train.target_mlm_accuracy) if cfg.train.plot else None
    summary = {"status": state.status, "stop_reason": state.stop_reason, "steps": state.step,
               "samples": state.samples, "eval_accuracy": state.eval_accuracy,
               "seed": cfg.train.seed, "config": cfg.source, "mllog": str(out / LOG_NAME),
               "metrics": str(out / METRICS_NAME), "plot": str(png) if png else None,
               "resumed_from": state.resume,
               "optimizer": {k.removeprefix("optimizer_"): v for k, v in state.derived.items()
                             if k.startswith("optimizer_")},
               # achieved TFLOP/s per device and MFU over the run's steps (runtime.observe.mfu)
               "throughput": state.derived.get("throughput", {}),
               "attention_layout": state.derived.get("attention_layout"),
               # how the numbers were kept (runtime.numerics: precision, dtypes, masters)
               "numerics": state.derived.get("numerics"),
               # model.fp8 as built: recipe, emulated and why, Linears and roles
               "fp8": state.derived.get("fp8", {"recipe": "none"})}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"mllog log:    {out / LOG_NAME}\nmetrics:      {out / METRICS_NAME}\n"
          f"plot:         {png or 'not drawn (train.plot=false)'}", flush=True)


def main(argv=None) -> int:
    signals.install()
    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        info = discover()
        shm.note(args.shm_notes)   # MPI has started (discover): what it put in /dev/shm
        cache_clear = cache_cleared()  # run.sub's word on the page caches (None: not run.sub)
        cfg.local_batch_size(info.world_size)  # fail before any rank trains
        if cfg.compiles():   # before any compile: Inductor's C++ builds land whole, or not
            inductor_cache.whole_builds()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except LaunchError as e:
        print(f"launch error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    return run_guarded(lambda: train(cfg, info, cache_clear, args.lock_holder), info,
                       exit_code=exit_code_of, leave=True, expected=expected_failure)


if __name__ == "__main__":
    sys.exit(main())
