#!/usr/bin/env bash
# MLPerf entry point: check the variables, launch the ranks of one training run, time it and
# print the MLPerf RESULT line.
#
#   [CONFIG=FILE] [SEED=N] [LOGDIR=DIR] ./run_and_time.sh [-- section.key=value ...]
#
# Environment (every one optional):
#   CONFIG     config TOML              default submission/configs/config_CPU_1x2x32x1.toml
#   SEED       overrides train.seed     default: train.seed of CONFIG
#   LOGDIR     where run directories go default results/ (in the repository)
#   RUN_DIR    this run's train.output_dir (the MLPerf log is RUN_DIR/mlperf_bert.log)
#              default LOGDIR/<config name>_seed<SEED>_<date> (_job<id>.<step> under srun)
#   PYTHON     interpreter              default .venv/bin/python beside this script, else python3
#   MPIEXEC    launcher "mpiexec"       default the mpiexec beside PYTHON, else mpiexec on PATH
#   MPIRUN     launcher "mpirun"        default mpirun (Open MPI) on PATH
#   SRUN       launcher "srun"          default srun
#   TORCHRUN   launcher "torchrun"      default "$PYTHON -m torch.distributed.run"
#   HOSTFILE   hosts for mpiexec/mpirun when system.nodes > 1 (required then)
#   MASTER_ADDR, MASTER_PORT  rendezvous for torchrun when system.nodes > 1 (ADDR required)
#   MODE       train (default) | tune: run the bucket tuner (python -m runtime.tune) with the
#              same launcher, ranks and config instead of training; it writes the plan, table
#              and timeline into RUN_DIR (default LOGDIR/tune_<config>_<date>) and prints no
#              RESULT line. Use the plan with `-- train.bucket_plan=RUN_DIR/bucket_plan.json`.
#
# The launcher, node count and ranks per node come from the config (system.launcher,
# system.nodes, system.ranks_per_node). Arguments after `--` are more config overrides, passed
# to every rank as `--set section.key=value` (and applied before the launch values are read, so
# `-- system.launcher=mpirun` works). Relative CONFIG/LOGDIR/RUN_DIR/HOSTFILE are relative to
# the directory you call from; the script then runs from the repository root.
#
# Launch per system.launcher:
#   mpiexec   $MPIEXEC -n NODES*RANKS [-f HOSTFILE] $PYTHON -m submission.train ARGS
#   mpirun    $MPIRUN -n NODES*RANKS --oversubscribe [--allow-run-as-root when root]
#             [--hostfile HOSTFILE] $PYTHON -m submission.train ARGS
#   srun      inside a job step (SLURM_PROCID set, e.g. run.sub's `srun ... run_and_time.sh`):
#             this task *is* one rank and runs $PYTHON -m submission.train ARGS directly;
#             otherwise $SRUN --nodes=NODES --ntasks-per-node=RANKS $PYTHON -m submission.train ARGS
#   torchrun  $TORCHRUN --nnodes=NODES --nproc_per_node=RANKS (--standalone on one node)
#             -m submission.train ARGS
#
# Output, as in the MLPerf reference scripts: STARTING/ENDING TIMING RUN lines, then on success
#   RESULT,bert,SEED,SECONDS,USER,START      (START like "2025-01-31 02:03:04 PM")
# printed once (by SLURM_PROCID 0 when every task runs this script). On failure no RESULT line:
# a FAILED line on stderr and the launcher's exit status (submission.train exits 1 when the
# target was not reached, 2 for an invalid config).
set -euo pipefail

die() { printf 'run_and_time.sh: %s\n' "$*" >&2; exit 2; }
usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; }
abspath() { case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s/%s\n' "$PWD" "$1" ;; esac; }

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# -- arguments: optional `--`, then section.key=value overrides --------------------------------
case "${1-}" in -h|--help) usage; exit 0 ;; --) shift ;; esac
OVERRIDES=()
for arg in "$@"; do
    [[ "$arg" == *.*=* && "$arg" != -* ]] \
        || die "argument '$arg' is not a section.key=value override (usage: $0 [-- section.key=value ...])"
    OVERRIDES+=(--set "$arg")
done

# -- variables -------------------------------------------------------------------------------
: "${CONFIG:=$HERE/submission/configs/config_CPU_1x2x32x1.toml}"
: "${LOGDIR:=$HERE/results}"
CONFIG="$(abspath "$CONFIG")"
LOGDIR="$(abspath "$LOGDIR")"
[[ -f "$CONFIG" ]] || die "CONFIG file '$CONFIG' does not exist (set CONFIG to a file in submission/configs/)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$HERE/.venv/bin/python" ]]; then PYTHON="$HERE/.venv/bin/python"; else PYTHON=python3; fi
fi
command -v "$PYTHON" >/dev/null || die "PYTHON '$PYTHON' is not an executable (run 'make venv' or set PYTHON)"
USER="${USER:-$(id -un 2>/dev/null || echo unknown)}"
cd "$HERE"   # python -m submission.train needs the repository on the path: run from its root

# -- launch values from the config (one line per --get, in order) ------------------------------
SEED_SET=()
[[ -n "${SEED:-}" ]] && SEED_SET=(--set "train.seed=$SEED")
if ! VALUES="$("$PYTHON" -m runtime.config "$CONFIG" "${SEED_SET[@]}" "${OVERRIDES[@]}" \
        --get system.nodes --get system.ranks_per_node --get system.launcher --get train.seed)"; then
    die "cannot read '$CONFIG' (the config error is above)"
fi
mapfile -t V <<<"$VALUES"
NODES="${V[0]-}" RANKS="${V[1]-}" LAUNCHER="${V[2]-}" SEED="${V[3]-}"
: "${NODES:?system.nodes missing from the config output}"
: "${RANKS:?system.ranks_per_node missing from the config output}"
: "${LAUNCHER:?system.launcher missing from the config output}"
: "${SEED:?train.seed missing from the config output}"
NP=$((NODES * RANKS))

MODE="${MODE:-train}"
[[ "$MODE" == train || "$MODE" == tune ]] || die "MODE='$MODE' is not train | tune"
if [[ -z "${RUN_DIR:-}" ]]; then
    NAME="$(basename "$CONFIG" .toml)_seed${SEED}"
    [[ "$MODE" == tune ]] && NAME="tune_$(basename "$CONFIG" .toml)"
    if [[ -n "${SLURM_JOB_ID:-}" ]]; then   # the same on every task of the step
        RUN_DIR="$LOGDIR/${NAME}_job${SLURM_JOB_ID}.${SLURM_STEP_ID:-0}"
    else
        RUN_DIR="$LOGDIR/${NAME}_$(date +%Y%m%d_%H%M%S)"
    fi
fi
RUN_DIR="$(abspath "$RUN_DIR")"
TRAIN=("$PYTHON" -m submission.train --config "$CONFIG" --set "train.seed=$SEED"
       --set "train.output_dir=$RUN_DIR" "${OVERRIDES[@]}")
if [[ "$MODE" == tune ]]; then   # the bucket tuner, launched exactly as training would be
    TRAIN=("$PYTHON" -m runtime.tune --config "$CONFIG" --set "train.seed=$SEED"
           --out "$RUN_DIR" "${OVERRIDES[@]}")
fi

# -- the launch command ----------------------------------------------------------------------
PRINT_RESULT=1
case "$LAUNCHER" in
    mpiexec)
        if [[ -z "${MPIEXEC:-}" ]]; then
            MPIEXEC="$(dirname "$(command -v "$PYTHON")")/mpiexec"
            [[ -x "$MPIEXEC" ]] || MPIEXEC=mpiexec
        fi
        command -v "$MPIEXEC" >/dev/null || die "MPIEXEC '$MPIEXEC' not found (set MPIEXEC)"
        CMD=("$MPIEXEC" -n "$NP")
        if ((NODES > 1)); then
            : "${HOSTFILE:?system.nodes=$NODES needs HOSTFILE (one host per line) for mpiexec}"
            CMD+=(-f "$(abspath "$HOSTFILE")")
        fi
        CMD+=("${TRAIN[@]}") ;;
    mpirun)
        MPIRUN="${MPIRUN:-mpirun}"
        command -v "$MPIRUN" >/dev/null || die "MPIRUN '$MPIRUN' not found (set MPIRUN)"
        CMD=("$MPIRUN" -n "$NP" --oversubscribe)
        ((EUID == 0)) && CMD+=(--allow-run-as-root)   # Open MPI refuses root without it
        if ((NODES > 1)); then
            : "${HOSTFILE:?system.nodes=$NODES needs HOSTFILE (one host per line) for mpirun}"
            CMD+=(--hostfile "$(abspath "$HOSTFILE")")
        fi
        CMD+=("${TRAIN[@]}") ;;
    srun)
        if [[ -n "${SLURM_PROCID:-}" ]]; then     # already one task of a job step: no inner launcher
            CMD=("${TRAIN[@]}")
            [[ "$SLURM_PROCID" == 0 ]] || PRINT_RESULT=0
        else
            SRUN="${SRUN:-srun}"
            command -v "$SRUN" >/dev/null || die "SRUN '$SRUN' not found: launcher srun needs Slurm"
            CMD=("$SRUN" "--nodes=$NODES" "--ntasks-per-node=$RANKS" --kill-on-bad-exit=1 "${TRAIN[@]}")
        fi ;;
    torchrun)
        if [[ -n "${TORCHRUN:-}" ]]; then CMD=("$TORCHRUN"); else CMD=("$PYTHON" -m torch.distributed.run); fi
        CMD+=("--nnodes=$NODES" "--nproc_per_node=$RANKS")
        if ((NODES > 1)); then
            : "${MASTER_ADDR:?system.nodes=$NODES needs MASTER_ADDR (the rendezvous host) for torchrun}"
            CMD+=(--rdzv_backend=c10d "--rdzv_endpoint=$MASTER_ADDR:${MASTER_PORT:-29500}")
        else
            CMD+=(--standalone)
        fi
        CMD+=("${TRAIN[@]:1}") ;;   # torchrun runs "-m <module> ..." itself: drop "$PYTHON"
    *) die "system.launcher='$LAUNCHER' in '$CONFIG' is not one of mpiexec | mpirun | srun | torchrun" ;;
esac

# -- run and time ----------------------------------------------------------------------------
START=$(date +%s)
START_FMT="$(LC_ALL=C date +'%Y-%m-%d %r')"   # %r in the C locale: 02:03:04 PM
echo "STARTING TIMING RUN AT $START_FMT"
printf 'run_and_time.sh: %s ranks via %s, seed %s, output %s\n' "$NP" "$LAUNCHER" "$SEED" "$RUN_DIR" >&2
printf 'run_and_time.sh: launching:' >&2; printf ' %q' "${CMD[@]}" >&2; printf '\n' >&2

set +e
"${CMD[@]}"
RC=$?
set -e

END=$(date +%s)
echo "ENDING TIMING RUN AT $(LC_ALL=C date +'%Y-%m-%d %r')"
if ((RC != 0)); then
    printf 'run_and_time.sh: FAILED: %s exited with status %s after %s s; no RESULT line (logs in %s)\n' \
        "$LAUNCHER" "$RC" "$((END - START))" "$RUN_DIR" >&2
    exit "$RC"
fi
if [[ "$MODE" == tune ]]; then
    exit 0   # not a timed run: the tuner printed its table and where the plan went
fi
if ((PRINT_RESULT)); then
    echo "RESULT,bert,$SEED,$((END - START)),$USER,$START_FMT"
fi
