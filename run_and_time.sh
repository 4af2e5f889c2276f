#!/usr/bin/env bash
# MLPerf entry point: check the variables, launch the ranks of one training run, time it and
# print the MLPerf RESULT line.
#
#   [CONFIG=FILE] [SEED=N] [LOGDIR=DIR] ./run_and_time.sh [-- section.key=value ...]
#
# Environment (every one optional):
#   CONFIG     config TOML              default submission/configs/config_CPU_1x2x32x1.toml
#   SEED       overrides train.seed     default: train.seed of CONFIG (0 .. 4294967295)
#   LOGDIR     where run directories go default results/ (in the repository)
#   RUN_DIR    this run's train.output_dir (the MLPerf log is RUN_DIR/mlperf_bert.log); the
#              same as `-- train.output_dir=DIR` (giving both, different, is an error).
#              Default: the newest LOGDIR/<config name>_seed<SEED>_* holding an interrupted
#              run with a checkpoint (it resumes; RESUME=0 skips this) - with
#              train.checkpoint_dir set, the interrupted run whose checkpoints it holds (its
#              run.json names the run directory) -, else a new
#              LOGDIR/<config name>_seed<SEED>_<date>[_N] (_N: two runs in one second get
#              two directories); LOGDIR/<config name>_seed<SEED>_job<id>.<step> under srun
#   RESUME     1 (default) | 0: whether the default RUN_DIR may be an interrupted run
#   PYTHON     interpreter              default .venv/bin/python beside this script, else python3
#   MPIEXEC, MPIRUN, SRUN, TORCHRUN, HOSTFILE, MASTER_ADDR, ...: the launcher's own, below
#   MODE       train (default) | tune: run the bucket tuner (python -m runtime.calibrate.tune) with the
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
# Launch per system.launcher: one row each in submission/launchers.py - the command, the
# variables it reads, the stop signal it gets - listed after this text by --help.
#
# Output, as in the MLPerf reference scripts: STARTING/ENDING TIMING RUN lines, then on success
#   RESULT,bert,SEED,SECONDS,USER,START      (START like "2025-01-31 02:03:04 PM")
# printed once (by SLURM_PROCID 0 when every task runs this script). Otherwise no RESULT line:
# a run its budget ended (train.max_steps, train.max_samples_termination; exit 1, "target not
# reached" - a smoke, profile or tuning run) says "stopped at the step budget: N steps, no
# target: ..." and is no failure; a run its ranks stopped on a signal (exit 4) says "stopped by
# a signal"; a failure says FAILED on stderr, then a summary naming the rank that failed or
# vanished and the last
# completed step (python -m submission.rank_status, from each rank's RUN_DIR/ranks/ file and
# the launcher's output, kept in RUN_DIR/launcher.log), and the run's exit status:
#   0 success   1 target not reached   2 bad input (config, data, launch, run directory)
#   3 runtime failure (a rank raised or died; divergence)   4 stopped by a signal
# (the ranks' own status: launchers that fold it - torchrun reports 1 for any failure - are
# corrected from the ranks' records). A reader of the output that goes away (`| head`, a
# `| tee` that died) stops nothing: the run goes on to its end, its output into launcher.log
# (docs/RESILIENCE.md says why); Ctrl-C on `... | tee LOG` is a stop request as below.
#
# Signals: TERM, INT, HUP and USR1 to this script - once or repeated, to it alone or to its
# whole process group (Ctrl-C twice, a closed terminal, systemd) - are one stop request. Before
# the launch the script stops (exit 4, nothing ran). After it the request goes to the ranks
# once, as soon as every rank can take it (a rank killed by a stop signal that comes before
# its handlers are in would fail the run): as the launcher's row says, USR1 through mpiexec,
# mpirun and srun, which forward it, TERM through torchrun, whose agent gives workers 30 s
# before SIGKILL. The launcher runs in a session of its own, so the terminal's signals reach
# this script alone, and gets the stop request by itself if this script is killed (its
# parent-death signal). Every rank checkpoints (train.checkpoint_every_samples > 0) at its
# next logging point and exits 4; the script waits for the launcher; nothing is left running.
# Once the launcher has ended there is nothing left to stop: later signals are ignored, by the
# script and the helpers that write its summary (a helper killed by a Ctrl-C meant for the run
# once made the script exit 129 instead of the ranks' 4).
# Rerun the same command to resume. To end a run at once, without a checkpoint, SIGKILL its
# ranks (their PIDs are in RUN_DIR/ranks/rank_*.json).
#
# Locks: RUN_DIR, and train.checkpoint_dir when checkpoints go elsewhere, are held by one live
# run (an flock on DIR/.lock, taken here before anything is launched or written, kept by the
# launcher and the ranks until the last of them ends): another run on either is refused with
# exit 2 naming the run that holds it.
set -euo pipefail

# -- stop requests, from the first line on (see "Signals" above) -----------------------------
GOT_SIGNAL="" LAUNCH_PID="" FORWARDED=0 CREATED_RUN_DIR="" HELD=""
# A closed terminal (EIO) or a reader gone (`| head`, a `| tee` killed by Ctrl-C: EPIPE) fails
# writes to stdout/stderr: our own lines are lost then, never the run (see "Output" above).
# SIGPIPE is caught, not ignored, so that the programs started here get it at its default.
trap : PIPE
say() { printf 'run_and_time.sh: %s\n' "$*" >&2 2>/dev/null || true; }
out() { printf '%s\n' "$*" 2>/dev/null; }
on_signal() {
    if [[ -n "$GOT_SIGNAL" ]]; then
        say "got SIG$1 again: the stop request (SIG$GOT_SIGNAL) stands; nothing more is sent"
        return 0
    fi
    GOT_SIGNAL="$1"
    say "got SIG$1: asking the ranks to checkpoint and stop at their next logging point"
    return 0
}
for sig in TERM INT HUP USR1; do trap "on_signal $sig" "$sig"; done

forget_run_dir() {   # a run directory this script made and nothing but its own files in it
    [[ -n "$CREATED_RUN_DIR" && -d "$CREATED_RUN_DIR" ]] || return 0
    if [[ -n "$HELD" ]]; then   # its files, then; never another run's lock
        rm -rf -- "$CREATED_RUN_DIR/.armed" "$CREATED_RUN_DIR/ranks"
        rm -f -- "$CREATED_RUN_DIR/.lock" "$CREATED_RUN_DIR/launcher.log"
    fi
    rmdir -- "$CREATED_RUN_DIR" 2>/dev/null || true
}
stopped_before_launch() {
    say "stopped by SIG$GOT_SIGNAL before the launch: nothing ran"
    forget_run_dir
    exit 4
}
die() {
    [[ -z "$GOT_SIGNAL" ]] || stopped_before_launch   # a step the signal itself cut short
    say "$*"
    forget_run_dir
    exit 2
}
# A stop request that reaches the script's process group kills the command running in the
# foreground (a date, a config helper), and set -e ends the script with that command's status:
# before the launch that is a stop like any other (exit 4, nothing ran).
on_exit() {
    local rc=$?
    if ((rc != 0 && rc != 4)) && [[ -n "$GOT_SIGNAL" && -z "$LAUNCH_PID" ]]; then
        stopped_before_launch
    fi
}
trap on_exit EXIT
usage() {
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
    local py="${PYTHON:-$HERE/.venv/bin/python}"
    [[ -n "${PYTHON:-}" || -x "$py" ]] || py=python3
    echo
    (cd "$HERE" && "$py" -m submission.launchers describe) \
        || echo "(the launchers: python -m submission.launchers describe, from $HERE)"
}
abspath() { case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s/%s\n' "$PWD" "$1" ;; esac; }

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# -- arguments: optional `--`, then section.key=value overrides --------------------------------
case "${1-}" in -h|--help) trap - PIPE; usage; exit 0 ;; --) shift ;; esac   # | head: as any filter
OVERRIDES=()
OUT_OVERRIDE=""
for arg in "$@"; do
    # One argument, one key: TOML would read a second line as a second key, and drop it.
    [[ "$arg" != *[$'\n\r']* ]] \
        || die "argument $(printf %q "$arg") holds a line break: give each section.key=value as its own argument"
    [[ "$arg" == *.*=* && "$arg" != -* ]] \
        || die "argument '$arg' is not a section.key=value override (usage: $0 [-- section.key=value ...])"
    if [[ "$arg" == train.output_dir=* ]]; then   # one place for the run: RUN_DIR
        OUT_OVERRIDE="${arg#train.output_dir=}"
        OUT_OVERRIDE="${OUT_OVERRIDE#[\"\']}"; OUT_OVERRIDE="${OUT_OVERRIDE%[\"\']}"
        continue
    fi
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
if [[ -n "$OUT_OVERRIDE" ]]; then
    OUT_OVERRIDE="$(abspath "$OUT_OVERRIDE")"
    if [[ -n "${RUN_DIR:-}" && "$(abspath "$RUN_DIR")" != "$OUT_OVERRIDE" ]]; then
        die "RUN_DIR='$RUN_DIR' and -- train.output_dir='$OUT_OVERRIDE' name two places for one run: give one"
    fi
    RUN_DIR="$OUT_OVERRIDE"
fi
# The launchers' HOSTFILE too is the caller's: resolve it before leaving the caller's directory.
[[ -z "${HOSTFILE:-}" ]] || HOSTFILE="$(abspath "$HOSTFILE")"
cd "$HERE"   # python -m submission.train needs the repository on the path: run from its root

# -- launch values from the config (one line per --get, in order) ------------------------------
SEED_SET=()
if [[ -n "${SEED:-}" ]]; then   # numpy's and torch's generators take 0 .. 2^32-1
    [[ "$SEED" =~ ^[0-9]{1,10}$ ]] && ((10#$SEED <= 4294967295)) \
        || die "SEED='$SEED' is not a whole number from 0 to 4294967295 (it sets train.seed; unset SEED for the config's)"
    SEED_SET=(--set "train.seed=$SEED")
fi
# (an array that may be empty is expanded as ${A[@]+"${A[@]}"}: bash before 4.4 - RHEL 7's
# 4.2 - takes an empty "${A[@]}" for an unbound variable under set -u)
if ! VALUES="$("$PYTHON" -m runtime.config "$CONFIG" ${SEED_SET[@]+"${SEED_SET[@]}"} \
        ${OVERRIDES[@]+"${OVERRIDES[@]}"} \
        --get system.nodes --get system.ranks_per_node --get system.launcher --get train.seed \
        --get train.checkpoint_dir --get train.checkpoint_every_samples \
        --get train.max_steps --get train.max_samples_termination \
        --get train.target_mlm_accuracy)"; then
    # The headline says which input was refused: the file, or what came after `--` (the file
    # checked alone, again, only on this path).
    if ((${#OVERRIDES[@]})) && "$PYTHON" -m runtime.config "$CONFIG" ${SEED_SET[@]+"${SEED_SET[@]}"} \
            --get train.seed >/dev/null 2>&1; then
        die "an override after -- was refused (the config error above names it); CONFIG '$CONFIG' alone is valid"
    fi
    die "CONFIG '$CONFIG' was refused (the config error is above)"
fi
mapfile -t V <<<"$VALUES"
NODES="${V[0]-}" RANKS="${V[1]-}" LAUNCHER="${V[2]-}" SEED="${V[3]-}" CKPT_DIR="${V[4]-}"
CKPT_EVERY="${V[5]-0}"
BUDGET=("${V[6]-0}" "${V[7]-0}" "${V[8]-0}")   # max steps, max samples, target: a budget's line
: "${NODES:?system.nodes missing from the config output}"
: "${RANKS:?system.ranks_per_node missing from the config output}"
: "${LAUNCHER:?system.launcher missing from the config output}"
: "${SEED:?train.seed missing from the config output}"
NP=$((NODES * RANKS))
MODE="${MODE:-train}"
[[ "$MODE" == train || "$MODE" == tune ]] || die "MODE='$MODE' is not train | tune"
# Can it start here? The launcher's checks (found, srun inside an allocation, HOSTFILE...), will
# it fit (an estimate), and where the ranks run on this host the device and a writable Inductor
# cache: each a sentence and exit 2, before anything is written (python -m submission.preflight)
"$PYTHON" -m submission.preflight "$CONFIG" ${SEED_SET[@]+"${SEED_SET[@]}"} \
    ${OVERRIDES[@]+"${OVERRIDES[@]}"} --mode "$MODE" --python "$PYTHON" || exit 2
resumable() {   # the newest LOGDIR/$1_* holding an interrupted run with a checkpoint, if any
    local d dirs
    dirs="$(ls -1dt "$LOGDIR/$1"_* 2>/dev/null)" || true
    while IFS= read -r d; do
        [[ -n "$d" && -f "$d/mlperf_bert.log" ]] || continue
        grep -qs '"key": "run_stop"' "$d/mlperf_bert.log" && continue
        compgen -G "$d/checkpoints/step_*/checkpoint.json" >/dev/null || continue
        if command -v flock >/dev/null && [[ -f "$d/.lock" ]]; then
            flock -n "$d/.lock" true || continue   # a live run holds it
        fi
        printf '%s\n' "$d"; return 0
    done <<<"$dirs"
}
owner_run() {   # the interrupted run that checkpoint directory $1 belongs to (its run.json), if any
    local d
    [[ -f "$1/run.json" ]] || return 0
    d="$("$PYTHON" -c 'import json, sys; print(json.load(open(sys.argv[1]))["run_dir"])' "$1/run.json" 2>/dev/null)" || return 0
    [[ -n "$d" && -f "$d/mlperf_bert.log" ]] || return 0
    grep -qs '"key": "run_stop"' "$d/mlperf_bert.log" && return 0
    compgen -G "$1/step_*/checkpoint.json" >/dev/null || return 0
    if command -v flock >/dev/null && [[ -f "$d/.lock" ]]; then
        flock -n "$d/.lock" true || return 0   # a live run holds it
    fi
    printf '%s\n' "$d"
}
fresh_dir() {   # mkdir is atomic: two runs started in the same second get _2, _3 ...
    local base="$1" d="$1" n=1 why
    why="$(mkdir -p -- "$(dirname "$base")" 2>&1)" \
        || die "cannot create LOGDIR '$(dirname "$base")': ${why##*: } (set LOGDIR to a writable directory)"
    until why="$(mkdir -- "$d" 2>&1)"; do
        [[ -e "$d" ]] || die "cannot create a run directory in '$(dirname "$base")': ${why##*: } (set LOGDIR to a writable directory)"
        n=$((n + 1)); d="${base}_$n"
        ((n < 1000)) || die "cannot create a run directory next to '$base': 1000 names taken"
    done
    printf '%s\n' "$d"
}
if [[ -z "${RUN_DIR:-}" ]]; then
    NAME="$(basename "$CONFIG" .toml)_seed${SEED}"
    [[ "$MODE" == tune ]] && NAME="tune_$(basename "$CONFIG" .toml)"
    if [[ -n "${SLURM_JOB_ID:-}" ]]; then   # the same on every task of the step
        RUN_DIR="$LOGDIR/${NAME}_job${SLURM_JOB_ID}.${SLURM_STEP_ID:-0}"
    else
        if [[ "$MODE" == train && "${RESUME:-1}" != 0 && -z "$CKPT_DIR" ]]; then
            RUN_DIR="$(resumable "$NAME")"
            [[ -z "$RUN_DIR" ]] || say "resuming the interrupted run in $RUN_DIR (RESUME=0 starts a new one)"
        elif [[ "$MODE" == train && "${RESUME:-1}" != 0 ]]; then
            RUN_DIR="$(owner_run "$CKPT_DIR")"
            [[ -z "$RUN_DIR" ]] || say "resuming the interrupted run in $RUN_DIR, whose checkpoints train.checkpoint_dir $CKPT_DIR holds (RESUME=0 starts a new one)"
        fi
        if [[ -z "${RUN_DIR:-}" ]]; then
            RUN_DIR="$(fresh_dir "$LOGDIR/${NAME}_$(date +%Y%m%d_%H%M%S)")"
            CREATED_RUN_DIR="$RUN_DIR"
        fi
    fi
fi
RUN_DIR="$(abspath "$RUN_DIR")"
[[ -z "$CREATED_RUN_DIR" ]] || CREATED_RUN_DIR="$RUN_DIR"

# -- the run directory, usable before anything launches: a rank would fail later, and worse ---
if [[ -e "$RUN_DIR" && ! -d "$RUN_DIR" ]]; then
    die "RUN_DIR '$RUN_DIR' exists and is not a directory: name a directory (or leave RUN_DIR unset for a fresh one in LOGDIR)"
fi
if [[ ! -e "$RUN_DIR" ]]; then
    WHY="$(mkdir -p -- "$RUN_DIR" 2>&1)" \
        || die "cannot create RUN_DIR '$RUN_DIR': ${WHY##*: } (choose a writable place for RUN_DIR or LOGDIR)"
    CREATED_RUN_DIR="$RUN_DIR"
fi
# The locks' line: who holds them, for the message of a run they refuse; rank 0 accepts the
# locks held under it as this run's.
HOLDER="run_and_time.sh pid $$ on $(hostname) since $(date +'%Y-%m-%d %H:%M:%S') for run directory $RUN_DIR"
ARMED_DIR="$RUN_DIR/.armed/$(hostname).$$"   # where this launch's ranks say they can stop
SHM_NOTES="$ARMED_DIR.shm"   # where its ranks note MPICH's /dev/shm files (submission.shm)
TRAIN=("$PYTHON" -m submission.train --config "$CONFIG" --set "train.seed=$SEED"
       --set "train.output_dir=$RUN_DIR" --lock-holder "$HOLDER" --signals-ready "$ARMED_DIR"
       --shm-notes "$SHM_NOTES" ${OVERRIDES[@]+"${OVERRIDES[@]}"})
if [[ "$MODE" == tune ]]; then   # the bucket tuner, launched exactly as training would be
    TRAIN=("$PYTHON" -m runtime.calibrate.tune --config "$CONFIG" --set "train.seed=$SEED"
           --out "$RUN_DIR" ${OVERRIDES[@]+"${OVERRIDES[@]}"})
fi

# -- the launch command ----------------------------------------------------------------------
# Each launcher's command line, fail-fast checks, stop signal and whether this task is itself a
# rank are one row of submission/launchers.py. It prints NUL-ended items (an argument may hold
# spaces or newlines): the signal to forward, this task's rank when it is one (srun inside a
# job step; else empty), how many ranks the launch starts, then the launch argv. On a bad value
# it prints our message and exits 2.
mapfile -d '' -t LAUNCH < <("$PYTHON" -m submission.launchers argv --launcher "$LAUNCHER" \
    --nodes "$NODES" --ranks "$RANKS" --config "$CONFIG" -- "${TRAIN[@]}")
if ! wait "$!"; then   # < <(...) hides the status from set -e; the message is on stderr
    [[ -z "$GOT_SIGNAL" ]] || stopped_before_launch
    forget_run_dir
    exit 2
fi
((${#LAUNCH[@]} > 3)) || die "python -m submission.launchers printed no launch command"
FORWARD="${LAUNCH[0]}" SELF_RANK="${LAUNCH[1]}" STARTS="${LAUNCH[2]}" CMD=("${LAUNCH[@]:3}")
PRINT_RESULT=1
[[ -z "$SELF_RANK" || "$SELF_RANK" == 0 ]] || PRINT_RESULT=0   # every task runs this script

# -- the locks: held from here until the last process of this run ends ------------------------
# The lock file stays open (no close-on-exec) in this script, so the launcher and every rank
# it starts inherit it: a run whose script was killed still holds its directories while its
# ranks stop. Only a launch that starts every rank (or the task that is rank 0) holds them: a
# run started node by node (torchrun on several nodes) leaves them to its rank 0. Without
# flock(1) rank 0 takes them itself, a few seconds later.
hold() {   # hold DIR WHAT: DIR/.lock for this run, or exit 2 naming the run that holds it
    local dir="$1" what="$2" fd line why
    why="$( { : >> "$dir/.lock"; } 2>&1)" \
        || die "cannot write in $what '$dir': ${why##*: } (choose a writable place for $what)"
    exec {fd}>>"$dir/.lock"
    if ! flock -n "$fd"; then
        exec {fd}>&-
        line="$(head -n 1 "$dir/.lock" 2>/dev/null)" || true
        die "$what '$dir' is in use by another run (${line:-a live process}): wait for it to end, or choose another $what; nothing was written there"
    fi
    printf '%s\n' "$HOLDER" > "$dir/.lock"
}
CKPT_OWN=""   # the checkpoint directory when it is not inside the run directory
if [[ "$MODE" == train && -n "$CKPT_DIR" && "$CKPT_EVERY" != 0 ]]; then
    CKPT_OWN="$(abspath "$CKPT_DIR")"
    case "$(realpath -m -- "$CKPT_OWN")/" in
        "$(realpath -m -- "$RUN_DIR")"/*) CKPT_OWN="" ;;
    esac
fi
if command -v flock >/dev/null && { [[ -z "$SELF_RANK" && "$STARTS" == "$NP" ]] || [[ "$SELF_RANK" == 0 ]]; }; then
    hold "$RUN_DIR" RUN_DIR
    HELD=1
    # Ours now: what killed attempts left there goes (not with a task of a step: the other
    # tasks of the step, this run's too, announce their ranks there already).
    [[ -n "$SELF_RANK" ]] || rm -rf -- "$RUN_DIR/.armed"
    if [[ -n "$CKPT_OWN" ]]; then
        WHY="$(mkdir -p -- "$CKPT_OWN" 2>&1)" \
            || die "cannot create train.checkpoint_dir '$CKPT_OWN': ${WHY##*: } (choose a writable place)"
        hold "$CKPT_OWN" train.checkpoint_dir
    fi
fi
[[ -z "$GOT_SIGNAL" ]] || stopped_before_launch
rm -rf -- "$ARMED_DIR" "$SHM_NOTES"
mkdir -p -- "$ARMED_DIR" "$SHM_NOTES"

# -- run and time ----------------------------------------------------------------------------
START=$(date +%s)
START_FMT="$(LC_ALL=C date +'%Y-%m-%d %r')"   # %r in the C locale: 02:03:04 PM
out "STARTING TIMING RUN AT $START_FMT" || true
say "$NP ranks via $LAUNCHER, seed $SEED, output $RUN_DIR"
say "launching:$(printf ' %q' "${CMD[@]}")"

# The launcher runs in the background so that this shell can hold and pass a stop request on
# (a foreground child would hold a trap until it ended) and wait for it: nothing outlives this
# script. submission.session makes it a session of its own with the stop request as its
# parent-death signal (a task that is itself a rank stays in Slurm's session).
SESSION=("$PYTHON" -m submission.session --stop-signal "$FORWARD" --parent "$$")
[[ -z "$SELF_RANK" ]] || SESSION+=(--same-session)
STOP_HOLD_S=60   # at most this long after a stop request for the ranks to say they can take it
armed() {   # every rank this launch started can take a stop request (or tune: no such word)
    [[ "$MODE" != train ]] && return 0
    local said=("$ARMED_DIR"/*)
    [[ -e "${said[0]}" ]] && ((${#said[@]} >= STARTS))
}
running() {   # the launcher has not ended (a zombie has: kill -0 would say it runs)
    local stat
    stat="$(cat "/proc/$1/stat" 2>/dev/null)" || { kill -0 "$1" 2>/dev/null; return; }
    stat="${stat##*) }"
    [[ "${stat%% *}" != Z ]]
}
HOLD_UNTIL=""
pass_stop_on() {   # true once the stop request has gone to the launcher (or may not yet)
    if armed || { [[ -n "$HOLD_UNTIL" ]] && ((SECONDS >= HOLD_UNTIL)); }; then
        [[ -n "$HOLD_UNTIL" ]] && ! armed \
            && say "not every rank said it can take a stop request within ${STOP_HOLD_S} s: passing it on anyway"
        say "passing the stop request on: SIG$FORWARD to $LAUNCHER pid $LAUNCH_PID"
        kill -s "$FORWARD" "$LAUNCH_PID" 2>/dev/null || true
        FORWARDED=1
        return 0
    fi
    if [[ -z "$HOLD_UNTIL" ]]; then
        HOLD_UNTIL=$((SECONDS + STOP_HOLD_S))
        say "the ranks are still starting: the stop request goes to them as soon as they can take it"
    fi
    return 1
}

set +e
LAUNCH_LOG="" TEES=()
if [[ -n "$SELF_RANK" ]]; then   # CMD is this task's rank
    "${SESSION[@]}" -- "${CMD[@]}" < /dev/null &
else
    LAUNCH_LOG="$RUN_DIR/launcher.log"   # the launcher's word on a dead rank, for the summary
    # The launcher's output goes to launcher.log and on to ours through two tees, which must
    # outlive whatever reads ours: if one died, the launcher and the ranks would die of SIGPIPE
    # at their next line - in the middle of a checkpoint, or with nothing saved since the
    # last. So they ignore the stop signals (Ctrl-C is INT to the whole process group,
    # systemd's TERM goes to every process) and, with -p (GNU tee), a reader that goes away
    # (`| head`, a `| tee` that Ctrl-C ended): they go on writing launcher.log to the end.
    # Opened here, not on the launcher's line, so that this script can close them and wait
    # for them (bash would leave them behind as zombies).
    exec {TO_OUT}> >(trap '' INT TERM HUP USR1; exec tee -p -a "$LAUNCH_LOG")
    TEES+=("$!")
    exec {TO_ERR}> >(trap '' INT TERM HUP USR1; exec tee -p -a "$LAUNCH_LOG" >&2)
    TEES+=("$!")
    "${SESSION[@]}" -- "${CMD[@]}" < /dev/null >&"$TO_OUT" 2>&"$TO_ERR" {TO_OUT}>&- {TO_ERR}>&- &
fi
LAUNCH_PID=$!
WATCH_PID=""
if [[ "$MODE" == train && -z "$SELF_RANK" ]]; then
    # Which rank ended first, for the summary of a run whose ranks were killed (the launcher
    # kills the others, and its report may name one of those): submission.rank_ends watches
    # this host's ranks end. It ignores the stop signals as the tees do, and ends with them.
    ( trap '' INT TERM HUP USR1
      exec "$PYTHON" -m submission.rank_ends "$RUN_DIR" --armed "$ARMED_DIR" --ranks "$STARTS" \
          --launcher-pid "$LAUNCH_PID" --parent "$$" ) < /dev/null > /dev/null 2>&1 \
        {TO_OUT}>&- {TO_ERR}>&- &
    WATCH_PID=$!
fi
while :; do
    if [[ -n "$GOT_SIGNAL" ]] && ((!FORWARDED)) && ! pass_stop_on; then
        sleep 0.1   # holding the request: the ranks are still starting
        running "$LAUNCH_PID" && continue
    fi
    wait "$LAUNCH_PID"; RC=$?
    ((RC > 128)) || break
    running "$LAUNCH_PID" && continue   # a trap ended the wait, not the launcher
    wait "$LAUNCH_PID" 2>/dev/null; R2=$?; ((R2 == 127)) || RC=$R2   # its own status
    break
done
# The launcher has ended: nothing is left to stop. Signals from here on are ignored, by this
# script and by every helper it starts (a date, rank_status, shm clean), which inherit it -
# one killed by a Ctrl-C meant for the run ended the script with 129 instead of the ranks' 4.
trap '' TERM INT HUP USR1
if ((${#TEES[@]})); then   # every line of the launcher in launcher.log, and the tees reaped
    exec {TO_OUT}>&- {TO_ERR}>&-
    for pid in "${TEES[@]}"; do   # at most 10 s: a process the launcher left may hold a pipe
        for ((i = 0; i < 100; i++)); do running "$pid" || break; sleep 0.1; done
        running "$pid" || wait "$pid" 2>/dev/null
    done
fi
if [[ -n "$WATCH_PID" ]]; then   # it ends once this host's ranks have: at most 5 s more
    for ((i = 0; i < 50; i++)); do running "$WATCH_PID" || break; sleep 0.1; done
    kill "$WATCH_PID" 2>/dev/null
    wait "$WATCH_PID" 2>/dev/null
fi
rm -rf -- "$ARMED_DIR"
# MPICH's shared-memory files of this launch's ranks here, which a job that ended without
# MPI_Finalize (a rank's failure, a kill) leaves in /dev/shm: the ranks noted them, and every
# rank of this host is gone now
"$PYTHON" -m submission.shm clean "$SHM_NOTES" 2>/dev/null
rm -rf -- "$SHM_NOTES"
rmdir -- "$RUN_DIR/.armed" 2>/dev/null
set -e

END=$(date +%s)
out "ENDING TIMING RUN AT $(LC_ALL=C date +'%Y-%m-%d %r')" || true
if ((RC != 0)); then
    LAUNCH_RC=$RC DETAIL=""   # the job's status and summary first: the headline says which
    # The job's status and summary (python -m submission.rank_status): for the whole launch,
    # or - a task that is itself a rank - for task 0, the one that speaks for a run its
    # budget ended (its rank's status is the run's; another rank's death is its own line).
    STATUS=(--rc "$RC" --launcher "$LAUNCHER" --since "$START" --budget "${BUDGET[@]}")
    if [[ -n "$SELF_RANK" ]]; then
        if ((RC > 128)); then   # this task's rank died from a signal: say which rank, where
            STEP="$(sed -n 's/.*"step": \([0-9]*\).*/\1/p' "$RUN_DIR/ranks/rank_$(printf %05d "$SELF_RANK").json" 2>/dev/null)"
            DETAIL="run_and_time.sh: rank $SELF_RANK (pid $LAUNCH_PID on $(hostname)) was killed by signal $((RC - 128)) after step ${STEP:-?}"
            RC=3
        elif ((RC == 1 && PRINT_RESULT)) && [[ "$MODE" == train ]]; then
            DETAIL="$("$PYTHON" -m submission.rank_status "$RUN_DIR" "${STATUS[@]}" 2>&1 >/dev/null)" || true
        fi
    elif [[ "$MODE" == train ]]; then
        DETAIL_FILE="$(mktemp 2>/dev/null)" || DETAIL_FILE=""   # none: straight to stderr
        CODE="$("$PYTHON" -m submission.rank_status "$RUN_DIR" "${STATUS[@]}" \
                --launcher-log "$LAUNCH_LOG" 2>"${DETAIL_FILE:-/dev/stderr}")" \
            && [[ "$CODE" =~ ^[0-9]+$ ]] && RC="$CODE"
        if [[ -n "$DETAIL_FILE" ]]; then
            DETAIL="$(cat -- "$DETAIL_FILE")" || true
            rm -f -- "$DETAIL_FILE"
        fi
    fi
    if ((RC == 4)); then   # a stop request the ranks answered: no failure
        say "stopped by a signal: $LAUNCHER ended with status $LAUNCH_RC after $((END - START)) s; no RESULT line (logs in $RUN_DIR)"
    elif ((RC == 1)) && [[ "$DETAIL" == "run_and_time.sh: stopped at the "* ]]; then
        # the budget spent, the target not reached: a normal end (a smoke, profile or tuning
        # run), said as what it is - exit 1 all the same (the README's exit table)
        printf '%s\n' "$DETAIL" >&2 || true
        DETAIL=""
        say "$LAUNCHER ended after $((END - START)) s; logs in $RUN_DIR"
    else
        say "FAILED: $LAUNCHER exited with status $LAUNCH_RC after $((END - START)) s; no RESULT line (logs in $RUN_DIR)"
    fi
    [[ -z "$DETAIL" ]] || printf '%s\n' "$DETAIL" >&2 || true
    if ((RC == 2)) && [[ -n "$CREATED_RUN_DIR" && ! -e "$RUN_DIR/mlperf_bert.log" ]]; then
        # Refused by the ranks (bad input): the directory this script made holds only the
        # launcher's words, said above - no empty run directory is left behind.
        forget_run_dir
        [[ -e "$RUN_DIR" ]] || say "removed $RUN_DIR: the refused run left nothing in it"
    fi
    exit "$RC"
fi
if [[ "$MODE" == tune ]]; then
    exit 0   # not a timed run: the tuner printed its table and where the plan went
fi
if ((PRINT_RESULT)); then
    RESULT="RESULT,bert,$SEED,$((END - START)),$USER,$START_FMT"
    out "$RESULT" || say "standard output is closed: $RESULT"
fi
