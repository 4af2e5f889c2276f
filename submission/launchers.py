"""The launchers, declared once: one row per value of ``system.launcher``.

Owns, for each launcher that runtime.choices.Launcher names (mpiexec, mpirun, srun, torchrun):
  * its command line for one run: from the node count, the ranks per node, the command of one
    rank (``PYTHON -m MODULE ARGS``) and the launcher's variables (``MPIEXEC``, ``MPIRUN``,
    ``SRUN``, ``TORCHRUN``, ``HOSTFILE``, ``MASTER_ADDR``, ``MASTER_PORT``), with the fail-fast
    checks run_and_time.sh makes before anything starts and their messages;
  * whether the calling process is itself one rank (srun: run.sub's ``srun ... run_and_time.sh``
    makes every task of the step run the script, so no inner launcher may start; an sbatch
    script's own shell is no task and launches);
  * the signal run_and_time.sh forwards to it as a stop request;
  * whether its exit status folds the ranks' (torchrun reports 1 for any failed worker), so
    submission.rank_status does not read a 1 as "target not reached";
  * whether one call starts the ranks of every node (torchrun starts only its own node's:
    run.sub cannot run it over several nodes from the batch shell);
  * the line it prints when a rank dies first, and the phrase rank_status's summary makes of it;
  * ``python -m submission.launchers argv ...``: the launch for run_and_time.sh (below).
Never: starts a process, discovers ranks for the runtime (runtime.launch.env does, and runtime
never imports submission; the srun row only asks it whether this process is a step's task and
takes that task's number), or imports torch - run_and_time.sh calls it before every launch.

Adding a launcher: docs/LAUNCH.md "Adding a launcher".

``python -m submission.launchers argv --launcher L --nodes N --ranks R [--config FILE] -- CMD...``
writes, each item ended by a NUL byte (an argument may hold spaces or newlines; bash reads them
with ``mapfile -d ''``): the signal to forward (``USR1``), this process's rank when it is one
(else an empty item), how many ranks this launch starts (every rank, one node's for a launcher
that does not start every node, 1 for a process that is a rank), then the launch argv. A missing variable or an unknown launcher exits 2
with run_and_time.sh's message on stderr, prefixed ``run_and_time.sh:`` as its ``die`` does.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import sys
import textwrap
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from runtime.launch.env import in_srun_step

# The message prefix of run_and_time.sh's ``die``: this module's errors are its errors.
PROG = "run_and_time.sh"
EXIT_BAD_INPUT = 2
TORCHRUN_DEFAULT_PORT = "29500"   # torchrun's own default for the c10d rendezvous


class LauncherError(ValueError):
    """A launch that cannot start: the message names the variable or value and what to set."""


@dataclass(frozen=True)
class Launch:
    """One run to launch: where, how many, what each rank runs, and the caller's environment.

    ``command`` is one rank's command, ``PYTHON -m MODULE ARGS`` (torchrun starts the
    interpreter itself and is given the rest). ``config`` names the config in messages.
    Relative paths (HOSTFILE, a launcher path with a '/') are relative to the working directory.
    """

    nodes: int
    ranks_per_node: int
    command: tuple[str, ...]
    env: Mapping[str, str]
    config: str = ""

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(frozen=True)
class LauncherSpec:
    """One launcher's row (the module docstring says what each field is for)."""

    name: str
    command: str                              # its command line in words (--help)
    variables: tuple[tuple[str, str], ...]    # (variable, what it does) it reads (--help)
    argv: Callable[[Launch], list[str]]
    forward_signal: str                       # a stop request to it: "USR1", "TERM"
    folds_exit_status: bool                   # its status says only "failed", not how
    starts_every_node: bool                   # one call starts the ranks of all nodes
    failure_line: re.Pattern                  # its report of the rank that ended first
    failure_phrase: Callable[[re.Match, Mapping[int, dict]], str]
    self_rank: Callable[[Mapping[str, str]], Optional[int]] = lambda env: None

    def culprit(self, text: str, records: Mapping[int, dict]) -> Optional[str]:
        """The rank this launcher says ended first, as a phrase; None when it says nothing.
        ``records``: rank -> its status record (submission.rank_status), to map a PID."""
        m = self.failure_line.search(text)
        return self.failure_phrase(m, records) if m else None


# ---------------------------------------------------------------------------------- helpers


def _require(env: Mapping[str, str], name: str, message: str) -> str:
    """``env[name]``, or the error run_and_time.sh gave with ``: "${NAME:?message}"``."""
    value = env.get(name, "")
    if not value:   # unset or empty, as bash's ${NAME:?}
        raise LauncherError(message)
    return value


def _found(program: str, variable: str, why: str = "") -> str:
    """``program`` when it can be run (a name on PATH or a path), else the error naming the
    variable that chooses it."""
    if shutil.which(program) is None:
        raise LauncherError(f"{variable} '{program}' not found{why or f' (set {variable})'}")
    return program


def _abspath(path: str) -> str:
    # As run_and_time.sh's abspath: joined to the working directory, not normalised.
    return path if path.startswith("/") else os.path.join(os.getcwd(), path)


def _hostfile(launch: Launch, launcher: str) -> str:
    return _abspath(_require(
        launch.env, "HOSTFILE",
        f"system.nodes={launch.nodes} needs HOSTFILE (one host per line) for {launcher}"))


def signal_phrase(code: int) -> str:
    """``9`` -> "killed by SIGKILL (kill -9, the OOM killer or a lost node)"."""
    try:
        name = signal.Signals(code).name
    except ValueError:
        return f"status {code}"
    hint = " (kill -9, the OOM killer or a lost node)" if name == "SIGKILL" else ""
    return f"killed by {name}{hint}"


# ---------------------------------------------------------------------------------- mpiexec
# MPICH's hydra (pip's mpich puts it beside the venv's python).


def _mpiexec_argv(launch: Launch) -> list[str]:
    mpiexec = launch.env.get("MPIEXEC", "")
    if not mpiexec:   # the one beside PYTHON (the venv's, matching mpi4py), else PATH's
        python = shutil.which(launch.command[0]) or launch.command[0]
        mpiexec = os.path.join(os.path.dirname(python), "mpiexec")
        if not os.access(mpiexec, os.X_OK):
            mpiexec = "mpiexec"
    argv = [_found(mpiexec, "MPIEXEC"), "-n", str(launch.world_size)]
    if launch.nodes > 1:
        argv += ["-f", _hostfile(launch, "mpiexec")]
    return argv + list(launch.command)


def _hydra_phrase(m: re.Match, records: Mapping[int, dict]) -> str:
    # hydra names the process by PID: the ranks' records map it to a rank.
    pid, host, code = int(m.group(1)), m.group(2), int(m.group(3))
    rank = {int(r.get("pid", -1)): k for k, r in records.items()}.get(pid)
    who = f"rank {rank}" if rank is not None else "a rank"
    how = signal_phrase(code) if code > 0 else f"exit status {code}"
    return f"{who} (pid {pid} on {host}) ended first: {how}"


# ----------------------------------------------------------------------------------- mpirun
# Open MPI.


def _mpirun_argv(launch: Launch) -> list[str]:
    mpirun = launch.env.get("MPIRUN") or "mpirun"
    argv = [_found(mpirun, "MPIRUN"), "-n", str(launch.world_size), "--oversubscribe"]
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")   # Open MPI refuses root without it
    if launch.nodes > 1:
        argv += ["--hostfile", _hostfile(launch, "mpirun")]
    return argv + list(launch.command)


def _openmpi_phrase(m: re.Match, records: Mapping[int, dict]) -> str:
    rank, pid = m.group(1), m.group(2)
    if pid == "0":   # Open MPI 4 often says "PID 0": the rank's own record knows better
        pid = str(records.get(int(rank), {}).get("pid", pid))
    return f"rank {rank} (pid {pid} on {m.group(3)}) ended first: {signal_phrase(int(m.group(4)))}"


# ------------------------------------------------------------------------------------- srun


def _srun_self_rank(env: Mapping[str, str]) -> Optional[int]:
    # A task of a job step (run.sub: srun ... run_and_time.sh) is that rank: no launcher. An
    # sbatch script's own shell has SLURM_PROCID=0 too, but it is no step's task: it launches.
    return int(env["SLURM_PROCID"]) if in_srun_step(env) else None


def _srun_argv(launch: Launch) -> list[str]:
    if _srun_self_rank(launch.env) is not None:
        return list(launch.command)
    srun = _found(launch.env.get("SRUN") or "srun", "SRUN", ": launcher srun needs Slurm")
    # --kill-on-bad-exit: a task that dies (even before the runtime's guard) ends the step
    return [srun, f"--nodes={launch.nodes}", f"--ntasks-per-node={launch.ranks_per_node}",
            "--kill-on-bad-exit=1", *launch.command]


def _srun_phrase(m: re.Match, records: Mapping[int, dict]) -> str:
    return f"rank {m.group(2)} (task on {m.group(1)}) ended first: {m.group(3).strip()}"


# --------------------------------------------------------------------------------- torchrun


def _torchrun_argv(launch: Launch) -> list[str]:
    torchrun = launch.env.get("TORCHRUN", "")
    # the default: torchrun's own main, whose stop (SIGTERM passed on to its workers) ends
    # in one line, not its agent's SignalException traceback (submission/torchrun.py)
    argv = [_found(torchrun, "TORCHRUN")] if torchrun else \
        [launch.command[0], "-m", "submission.torchrun"]
    argv += [f"--nnodes={launch.nodes}", f"--nproc_per_node={launch.ranks_per_node}"]
    if launch.nodes > 1:
        addr = _require(launch.env, "MASTER_ADDR", f"system.nodes={launch.nodes} needs "
                        "MASTER_ADDR (the rendezvous host) for torchrun")
        port = launch.env.get("MASTER_PORT") or TORCHRUN_DEFAULT_PORT
        argv += ["--rdzv_backend=c10d", f"--rdzv_endpoint={addr}:{port}"]
    else:
        argv.append("--standalone")
    return argv + list(launch.command[1:])   # torchrun starts the interpreter: drop PYTHON


def _torchrun_phrase(m: re.Match, records: Mapping[int, dict]) -> str:
    code = int(m.group(2))
    how = signal_phrase(-code) if code < 0 else f"exit status {code}"
    return f"rank {m.group(1)} (pid {m.group(3)}) ended first: {how}"


# ------------------------------------------------------------------------------------ table
# The sample above each failure_line has the form of a real one (whole reports, captured, are
# in tests/unit/test_launchers.py).

LAUNCHERS: dict[str, LauncherSpec] = {spec.name: spec for spec in (
    LauncherSpec(
        "mpiexec",
        "MPICH's hydra: $MPIEXEC -n NODES*RANKS [-f HOSTFILE] $PYTHON -m submission.train ARGS",
        (("MPIEXEC", "default the mpiexec beside PYTHON, else mpiexec on PATH"),
         ("HOSTFILE", "hosts, one per line: required when system.nodes > 1")),
        _mpiexec_argv, forward_signal="USR1", folds_exit_status=False,
        starts_every_node=True,
        # =   PID 2205 RUNNING AT vm
        # =   EXIT CODE: 9
        failure_line=re.compile(r"PID (\d+) RUNNING AT (\S+)\s*\n=\s*EXIT CODE: (\d+)"),
        failure_phrase=_hydra_phrase),
    LauncherSpec(
        "mpirun",
        "Open MPI: $MPIRUN -n NODES*RANKS --oversubscribe [--allow-run-as-root when root] "
        "[--hostfile HOSTFILE] $PYTHON -m submission.train ARGS",
        (("MPIRUN", "default mpirun (Open MPI) on PATH"),
         ("HOSTFILE", "hosts, one per line: required when system.nodes > 1")),
        _mpirun_argv, forward_signal="USR1", folds_exit_status=False,
        starts_every_node=True,
        # mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed).
        failure_line=re.compile(
            r"process rank (\d+) with PID (\d+) on node (\S+) exited on signal (\d+)"),
        failure_phrase=_openmpi_phrase),
    LauncherSpec(
        "srun",
        "inside a job step (SLURM_PROCID and SLURM_STEP_ID set, e.g. run.sub's "
        "`srun ... run_and_time.sh`; not an sbatch script's own shell) this task *is* one "
        "rank and runs $PYTHON -m submission.train ARGS directly; otherwise "
        "$SRUN --nodes=NODES --ntasks-per-node=RANKS --kill-on-bad-exit=1 "
        "$PYTHON -m submission.train ARGS",
        (("SRUN", "default srun"),),
        _srun_argv, forward_signal="USR1", folds_exit_status=False,
        starts_every_node=True, self_rank=_srun_self_rank,
        # srun: error: vm: task 1: Killed
        failure_line=re.compile(r"srun: error: (\S+): tasks? (\d+): (\w[\w ]*)"),
        failure_phrase=_srun_phrase),
    LauncherSpec(
        # TERM, not USR1: the agent passes TERM to its workers and gives them 30 s to stop.
        "torchrun",
        "$TORCHRUN --nnodes=NODES --nproc_per_node=RANKS, then --standalone on one node or "
        "--rdzv_backend=c10d --rdzv_endpoint=MASTER_ADDR:MASTER_PORT on several, "
        "-m submission.train ARGS; its agent gives workers 30 s after SIGTERM before SIGKILL",
        (("TORCHRUN", 'default "$PYTHON -m submission.torchrun" (torch.distributed.run, '
                      'a stop without the agent\'s traceback)'),
         ("MASTER_ADDR", "the rendezvous host: required when system.nodes > 1"),
         ("MASTER_PORT", f"its port, default {TORCHRUN_DEFAULT_PORT}")),
        _torchrun_argv, forward_signal="TERM", folds_exit_status=True,
        starts_every_node=False,
        # Root Cause (first observed failure):
        # [0]:
        #   time      : 2026-11-24_09:54:08
        #   host      : localhost
        #   rank      : 1 (local_rank: 1)
        #   exitcode  : -9 (pid: 2205)  (SIGKILL)
        # The "Failures:" block printed before it lists the workers the agent stopped after the
        # root cause (SIGTERM): the first rank/exitcode pair in the text is not the culprit.
        failure_line=re.compile(r"Root Cause[^\n]*\n(?:[^\n]*\n)*?\s*rank\s*: (\d+) "
                                r"\(local_rank: \d+\)\s*\n\s*exitcode\s*: (-?\d+) \(pid: (\d+)\)"),
        failure_phrase=_torchrun_phrase),
)}


def spec_for(name: str, config: str = "") -> LauncherSpec:
    """The row of ``name``, or the error run_and_time.sh gives for any other value."""
    if name not in LAUNCHERS:
        where = f" in '{config}'" if config else ""
        raise LauncherError(f"system.launcher='{name}'{where} is not one of "
                            f"{' | '.join(LAUNCHERS)}")
    return LAUNCHERS[name]


# ------------------------------------------------------------------- run_and_time.sh's entry


def describe() -> str:
    """The launchers in words, for ``run_and_time.sh --help``."""
    out = ["Launch per system.launcher (submission/launchers.py, one row each):"]
    for spec in LAUNCHERS.values():
        out += textwrap.wrap(spec.command, 100, initial_indent=f"  {spec.name:<10}",
                             subsequent_indent=" " * 12)
        out += [f"{'':12}{name:<13}{what}" for name, what in spec.variables]
        folds = "; exits 1 for any failed rank" if spec.folds_exit_status else ""
        out.append(f"{'':12}stop request: SIG{spec.forward_signal}{folds}")
    return "\n".join(out)


def ranks_started(spec: LauncherSpec, launch: Launch) -> int:
    """How many ranks one launch of ``spec`` starts from this process: run_and_time.sh waits
    for that many to say they can take a stop request, and holds the run's locks itself only
    when the launch starts every rank (or is rank 0)."""
    if spec.self_rank(launch.env) is not None:
        return 1
    return launch.world_size if spec.starts_every_node else launch.ranks_per_node


def ranks_run_here(spec: LauncherSpec, launch: Launch) -> bool:
    """Whether this launch runs ranks on this host, so that what they need of it (a CUDA
    device, a writable Inductor cache) can be checked here first: a task that is a rank, a
    launcher that starts only its own node's ranks, a launch of one node by mpiexec or mpirun
    - not srun starting a step (salloc's shell may be a login node) nor a hostfile's hosts."""
    if spec.self_rank(launch.env) is not None or not spec.starts_every_node:
        return True
    return spec.name != "srun" and launch.nodes == 1


def launch_items(launcher: str, launch: Launch) -> list[str]:
    """What ``argv`` prints: the signal to forward, this process's rank or '', the number of
    ranks the launch starts, the argv."""
    spec = spec_for(launcher, launch.config)
    if not launch.command:
        raise LauncherError("no rank command after '--' (PYTHON -m MODULE ARGS)")
    rank = spec.self_rank(launch.env)
    return [spec.forward_signal, "" if rank is None else str(rank),
            str(ranks_started(spec, launch)), *spec.argv(launch)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    options = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(
        prog="python -m submission.launchers",
        description="The launch of one run, for run_and_time.sh: NUL-ended items on stdout "
                    "(the signal to forward, this process's rank or '', the ranks the launch "
                    "starts, the launch argv), or the launchers in words.")
    ap.add_argument("action", choices=["argv", "describe"],
                    help="argv: the launch (needs the options below); describe: the launchers")
    ap.add_argument("--launcher", help="system.launcher")
    ap.add_argument("--nodes", type=int, help="system.nodes")
    ap.add_argument("--ranks", type=int, help="system.ranks_per_node")
    ap.add_argument("--config", default="", help="the config file, named in messages")
    a = ap.parse_args(options)
    if a.action == "describe":
        print(describe())
        return 0
    if a.launcher is None or a.nodes is None or a.ranks is None:
        ap.error("argv needs --launcher, --nodes and --ranks")
    try:
        items = launch_items(a.launcher, Launch(a.nodes, a.ranks, tuple(command), os.environ,
                                                a.config))
    except LauncherError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    sys.stdout.buffer.write(b"".join(os.fsencode(item) + b"\0" for item in items))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
