"""torch.distributed setup, the few collectives the runtime uses, and fault handling.

Owns: joining the ranks into one process group (`init_distributed`), binding each rank's
device, small helpers (`all_reduce_sum`, `all_reduce_max`, `barrier`, `broadcast_object`,
`broadcast_tensors`, `all_gather_object`, `check_same_on_all_ranks`), and making a failure on
one rank end every rank (`run_guarded`).
Never: reads the environment (runtime.launch.env does; values arrive in a `LaunchInfo`), decides
batch sizes or touches the model.

Rendezvous, by ``LaunchInfo.rendezvous`` ("mpi", "tcp", "file", "local"): where the ranks
meet is runtime.launch.rendezvous's, and so is `DistError` (its failures and ours; callers
take it from either module). A world of one meets on an in-memory store, yet every
collective works the same as with many ranks (DDP, all_reduce, barrier), so callers never
branch on it. The helpers also work before `init_distributed`, as a world of one (handy in
unit tests).

Faults: see `run_guarded`. In short, an exception on any rank prints its traceback prefixed
with the rank, plus what the caller's failure notes add (`on_failure`: submission/train.py
adds the last completed step and which peers are gone), and ends the job with the exit status
the caller maps the exception to: ``MPI.COMM_WORLD.Abort`` under MPI (the launcher kills
every rank), else ``os._exit``; peers blocked in a gloo collective see the closed connection
at once (or time out after ``timeout_s``), raise, and exit the same way. torchrun, mpiexec
and mpirun also kill the remaining ranks once one exits non-zero or dies from a signal.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as torch_dist

from runtime.launch.env import LaunchInfo, finalize_pmi
from runtime.launch.rendezvous import DistError, meeting_point  # DistError: also ours to raise

T = TypeVar("T")

# Seconds Abort gets to kill the job before this rank exits on its own.
ABORT_GRACE_S = 10.0


class RanksDisagree(DistError):
    """Raised identically on every rank (so `run_guarded` prints it once and need not abort)."""

    raised_on_all_ranks = True


@dataclass
class DistContext:
    """This rank's place in the initialised process group."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str                     # "nccl" or "gloo"
    group: Any                       # the default (world) process group
    info: LaunchInfo
    timeout_s: float = 60.0
    simulates_cuda: bool = False     # a CPU device standing in for a GPU (tests' simulated
    #                                  device, runtime.observe.hostsync.simulated): graphs warm up
    _store: Any = field(default=None, repr=False)  # keeps rank 0's TCPStore server alive

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_CTX: Optional[DistContext] = None


def current() -> Optional[DistContext]:
    """The context `init_distributed` made, or None before it (and after `shutdown`)."""
    return _CTX


def init_distributed(info: LaunchInfo, device: str = "auto", timeout_s: float = 60) -> DistContext:
    """Bind this rank's device and join the process group; see the module docstring.

    device: "auto" (cuda when available, else cpu), "cpu", "cuda" (cuda:local_rank) or
    "cuda:N". Backend: NCCL on cuda, gloo on cpu. timeout_s bounds the rendezvous and every
    collective, so a hung peer turns into an exception rather than a hang.
    """
    global _CTX
    if _CTX is not None:
        raise DistError("init_distributed was already called in this process (call shutdown first)")
    dev = _bind_device(info, device)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    kwargs: dict[str, Any] = dict(backend=backend, rank=info.rank, world_size=info.world_size,
                                  timeout=timeout)
    if dev.type == "cuda":
        kwargs["device_id"] = dev
    kwargs.update(meeting_point(info, timeout))
    try:
        torch_dist.init_process_group(**kwargs)
    except Exception as e:
        where = (f"tcp://{info.master_addr}:{info.master_port}" if info.rendezvous == "tcp"
                 else info.store_path if info.rendezvous == "file" else info.rendezvous)
        raise DistError(f"rank {info.rank}/{info.world_size} could not join the process group "
                        f"({backend}, rendezvous {where}, timeout {timeout_s:g} s): {e}") from e
    _CTX = DistContext(rank=info.rank, world_size=info.world_size, local_rank=info.local_rank,
                       local_world_size=info.local_world_size, device=dev, backend=backend,
                       group=torch_dist.group.WORLD, info=info, timeout_s=timeout_s,
                       _store=kwargs.get("store"))
    return _CTX


def shutdown() -> None:
    """Leave the process group (success path; on failure `run_guarded` exits instead)."""
    global _CTX
    if torch_dist.is_available() and torch_dist.is_initialized():
        # Meet first: rank 0 hosts the rendezvous store, and a rank that tears its group
        # down while a peer still talks to it makes the peer's C++ threads std::terminate.
        world, rank = torch_dist.get_world_size(), torch_dist.get_rank()
        store, left = None, 0
        if world > 1:
            store = _default_store()
            left = _count_left(store, 0) if store is not None else 0  # before anyone can add
            torch_dist.barrier()
        torch_dist.destroy_process_group()
        if store is not None:
            _leave_after_peers(store, rank, world, left)
    _CTX = None


SHUTDOWN_KEY = "presto/left"
LEAVE_WAIT_S = 30.0   # rank 0 waits at most this for its peers to have left


def _default_store():
    try:
        return torch_dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - private API; without it, the barrier alone
        return None


def _count_left(store, n: int) -> int:
    return int(store.add(SHUTDOWN_KEY, n))


def _leave_after_peers(store, rank: int, world: int, left: int) -> None:
    """Rank 0 leaves last. With the barrier alone a 2-rank script that had finished its work
    still died now and then at exit in std::terminate ("terminate called without an active
    exception": twice in five test-suite runs on 2026-11-24) - a rank tearing down while its
    peer, or the store rank 0 hosts, was still being torn down. So each peer says through the
    store that it has left, and rank 0 waits for all of them (at most LEAVE_WAIT_S)."""
    try:
        if rank != 0:
            _count_left(store, 1)
            return
        deadline = time.monotonic() + LEAVE_WAIT_S
        while _count_left(store, 0) < left + world - 1 and time.monotonic() < deadline:
            time.sleep(0.005)
    except Exception:  # noqa: BLE001 - a peer or the store gone: nothing left to wait for
        pass


def _bind_device(info: LaunchInfo, device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise DistError(f"device {device!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise DistError(f"device {device!r}: only cpu and cuda are supported")
    if not torch.cuda.is_available():
        build = (f"torch {torch.__version__} built without CUDA" if torch.version.cuda is None
                 else f"torch {torch.__version__} with CUDA {torch.version.cuda}")
        raise DistError(f"rank {info.rank}: device {device!r} asked for, but torch sees no CUDA "
                        f"device here ({build}, {sys.executable}); use device=cpu or auto, or "
                        f"run with a CUDA build of torch")
    count = torch.cuda.device_count()
    if dev.index is not None:
        index = dev.index
    elif count == 1:
        index = 0  # the launcher gave this task its own GPU (srun --gpus-per-task=1, a bind script)
    elif count >= info.local_world_size:
        index = info.local_rank
    else:
        raise DistError(
            f"rank {info.rank} (local rank {info.local_rank} of {info.local_world_size} on this "
            f"node) sees {count} CUDA devices: fewer than the node's ranks and more than one, so "
            f"which is its own is ambiguous. Start at most {count} ranks per node, or give each "
            f"task one GPU (srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES per rank)")
    if index >= count:
        raise DistError(
            f"rank {info.rank} (local rank {info.local_rank} of {info.local_world_size} on this "
            f"node) needs cuda:{index}, but this node shows {count} CUDA device(s): check "
            f"system.device and CUDA_VISIBLE_DEVICES")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


# ---------------------------------------------------------------------------------------------
# collectives (a world of one before init_distributed)


def _active() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks, in place; returns it. ``tensor`` must be on this rank's
    device (`check_device`)."""
    if _active():
        check_device(tensor, "all_reduce_sum")
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(tensor: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum of ``tensor`` over ranks, in place; returns it (on this rank's
    device, as ``all_reduce_sum``)."""
    if _active():
        check_device(tensor, "all_reduce_max")
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX)
    return tensor


def check_device(tensor: torch.Tensor, what: str) -> None:
    """Refuse a tensor that is not on this rank's device: NCCL groups take CUDA tensors only
    ("No backend type associated with device type cpu"), and gloo takes CPU ones, so a
    collective that works on one fails on the other. Checked on every backend, so CPU runs
    catch it too."""
    ctx = _CTX
    if ctx is not None and tensor.device.type != ctx.device.type:
        raise DistError(f"rank {ctx.rank}: {what} got a tensor on {tensor.device}, but this "
                        f"rank's collectives run on {ctx.device} ({ctx.backend}); create it "
                        f"with device=<the rank's device>")


def barrier() -> None:
    """Wait for every rank. Under gloo a monitored barrier: a timeout names the missing ranks."""
    if not _active() or torch_dist.get_world_size() == 1:
        return
    if torch_dist.get_backend() == "gloo":
        timeout = timedelta(seconds=_CTX.timeout_s) if _CTX else None
        torch_dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
    else:
        torch_dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` from rank ``src`` (picklable), returned on every rank."""
    if not _active():
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=src)
    return box[0]


def broadcast_tensors(tensors: list[torch.Tensor], src: int = 0) -> None:
    """Overwrite ``tensors`` in place with rank ``src``'s values (e.g. the initial weights, as
    DDP does when it wraps a model)."""
    if not _active() or torch_dist.get_world_size() == 1:
        return
    for t in tensors:
        torch_dist.broadcast(t.detach(), src=src)


@dataclass(frozen=True)
class BlockGroups:
    """This rank's place when the world is cut into ``blocks`` blocks of ``size`` consecutive
    ranks: ``group`` is its block's process group (the world's when there is one block,
    None in a world of one) and ``index`` its rank in it; ``cross`` the group of the ranks at
    position ``index`` of every block (None with one block), ``block`` which block it is in."""

    size: int
    index: int
    blocks: int
    block: int
    group: Any = None
    cross: Any = None


def block_groups(size: int) -> BlockGroups:
    """Cut the world into blocks of ``size`` consecutive ranks (a collective: every rank
    creates every group, in one order, as torch.distributed.new_group requires)."""
    world = torch_dist.get_world_size() if _active() else 1
    rank = torch_dist.get_rank() if _active() else 0
    if size < 1 or world % size:
        raise DistError(f"cannot cut {world} ranks into blocks of {size}")
    if world == 1:
        return BlockGroups(1, 0, 1, 0)
    if size == world:
        return BlockGroups(size, rank, 1, 0, torch_dist.group.WORLD)
    timeout = timedelta(seconds=_CTX.timeout_s) if _CTX else None
    blocks = [torch_dist.new_group(list(range(b * size, (b + 1) * size)), timeout=timeout)
              for b in range(world // size)]
    across = [torch_dist.new_group(list(range(j, world, size)), timeout=timeout)
              for j in range(size)]
    return BlockGroups(size, rank % size, world // size, rank // size, blocks[rank // size],
                       across[rank % size])


def all_gather_object(obj: Any) -> list:
    """Every rank's ``obj``, indexed by rank."""
    if not _active():
        return [obj]
    out: list = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(out, obj)
    return out


def check_same_on_all_ranks(name: str, value: Any) -> str:
    """Raise `RanksDisagree` on every rank unless all ranks hold the same ``value``.

    ``value``: a string (e.g. a config fingerprint) or anything JSON-serialisable (compared as
    sorted-key JSON). Only a hash travels; on a mismatch the values themselves are gathered to
    name the differing keys. Returns the hash.
    """
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()
    digests = all_gather_object(digest)
    if all(d == digests[0] for d in digests):
        return digest
    groups: dict[str, list[int]] = {}
    for r, d in enumerate(digests):
        groups.setdefault(d, []).append(r)
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    parts = [f"ranks {_ranges(rs)} have {d[:12]}" for d, rs in groups.items()]
    detail = ""
    values = all_gather_object(value)  # mismatch only: worth the bytes to say what differs
    if isinstance(values[0], dict):
        keys = sorted({k for r in differ for k in _differing_keys(values[0], values[r])})
        if keys:
            detail = f"; differing keys: {', '.join(keys[:20])}" + (" …" if len(keys) > 20 else "")
    raise RanksDisagree(
        f"{name} differs between ranks: rank(s) {_ranges(differ)} disagree with rank 0 "
        f"({'; '.join(parts)}){detail}. Every rank must start with the same {name}: check "
        f"the files and overrides each rank was given.")


def _differing_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += _differing_keys(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [prefix.rstrip(".")]


def _ranges(ranks: list[int]) -> str:
    """[1, 2, 3, 7] -> "1-3,7" (keeps messages short at 1000 ranks)."""
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)


# ---------------------------------------------------------------------------------------------
# fault handling


_FAILURE_NOTES: list[Callable[[BaseException], Optional[str]]] = []
_TRACEBACK_SINK: list[Callable[[str], str]] = []


def keep_tracebacks(sink: Callable[[str], str]) -> None:
    """Where the traceback of an expected failure goes (``run_guarded``'s ``expected``):
    ``sink(text)`` keeps it (the rank's log file) and returns where; the console then gets
    the failure's one line and that place."""
    _TRACEBACK_SINK[:] = [sink]


def on_failure(note: Callable[[BaseException], Optional[str]]) -> None:
    """``note(exc)`` runs on this rank's failure path before the job is ended; the text it
    returns is printed after the traceback (it must not talk to other ranks: they may be
    gone)."""
    _FAILURE_NOTES.append(note)


def _notes(e: BaseException) -> str:
    out = []
    for note in _FAILURE_NOTES:
        try:
            text = note(e)
        except Exception as err:  # noqa: BLE001 - a note must never hide the failure
            text = f"(failure note failed: {err})"
        if text:
            out.append(text)
    return "".join(f"\n{t}" for t in out)


BAD_INPUT_EXIT = 2   # an error whose message names the file, key or rank: printed without a traceback


def run_guarded(main_fn: Callable[[], T], info: Optional[LaunchInfo] = None,
                exit_code: Optional[Callable[[BaseException], int]] = None,
                leave: bool = False,
                expected: Callable[[BaseException], bool] = lambda e: False) -> T:
    """Run ``main_fn()``; if it raises on this rank, end the whole job, never hang.

    The traceback goes to stderr with every line prefixed ``[rank N]``. Then:
      * under MPI: ``MPI.COMM_WORLD.Abort(1)`` — the launcher kills every rank;
      * a task of an srun step without MPI (``info.slurm_step``): ``scancel JOB.STEP`` first —
        Slurm ends every task, as on MPI_Abort under pmi2, and srun ends even when a node is
        gone;
      * otherwise ``os._exit(1)``: this rank's sockets close, so peers in a gloo collective
        fail at once ("Connection closed by peer") or after the process-group timeout, and
        exit the same way; torchrun/mpirun then stop any rank still running.
    ``os._exit`` rather than ``sys.exit``: atexit handlers (MPI_Finalize, process-group
    teardown) wait for peers, which may be stuck. The process group is not destroyed on this
    path for the same reason (destroying it with collectives in flight can block).
    Errors raised identically on every rank (`RanksDisagree`) exit 1 without an abort (every
    rank is leaving anyway); rank 0 prints the traceback, the others one line each - and no
    rank leaves before every rank has run its failure notes (at most ``NOTED_WAIT_S``):
    launchers end the other ranks the moment one exits non-zero, and a rank ended before its
    notes (submission/train.py's write the rank's status record) was reported as killed. Bad input
    (status 2: the message names the file, key or rank and what to do) is printed without a
    traceback on every rank. ``SystemExit(0)`` passes through; ``SystemExit(n)`` counts as a
    failure with status n. ``exit_code(exc)`` gives the status for an exception (default:
    its ``exit_code`` attribute, else 1). An ``expected(exc)`` failure (a full disk: the
    caller's word) that is not bad input prints its first line, and its traceback goes where
    ``keep_tracebacks`` says (printed as before when nothing keeps it).

    ``leave``: a rank's entry point - when ``main_fn`` returns (its value the exit status, None
    = 0), `leave_process` ends the process instead of returning.
    """
    try:
        result = main_fn()
        if leave:
            leave_process(int(result or 0))
        return result
    except SystemExit as e:
        if e.code in (None, 0):
            raise
        code = e.code if isinstance(e.code, int) else 1
        _die(code, info, f"exited with status {e.code!r}\n", everywhere=False)
    except BaseException as e:  # noqa: BLE001 — anything uncaught must end the job
        everywhere = getattr(e, "raised_on_all_ranks", False)
        code = exit_code(e) if exit_code is not None else getattr(e, "exit_code", 1)
        if code == BAD_INPUT_EXIT:
            text = f"{type(e).__name__}: {e}"  # its message says what to do: no traceback
        elif expected(e) and (where := _keep_traceback(e)):
            first = next((line for line in str(e).splitlines() if line.strip()), "")
            text = f"{type(e).__name__}: {first} (its traceback: {where})"
        elif everywhere and _rank_for_messages(info) not in (0, "?"):
            text = f"{type(e).__name__}: {e}"  # rank 0 prints the traceback
        else:
            text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        _die(code, info, text + _notes(e), everywhere=everywhere)
    raise AssertionError("unreachable")


def _keep_traceback(e: BaseException) -> Optional[str]:
    try:
        return _TRACEBACK_SINK[0]("".join(traceback.format_exception(type(e), e,
                                                                     e.__traceback__)))
    except Exception:  # noqa: BLE001 - nowhere to keep it: the console gets it
        return None


def leave_process(code: int) -> None:
    """End a rank that has finished its work and left the process group: the exit handlers
    run (logging's flush), MPI is finalized when it was started (mpi4py does it in the
    interpreter's teardown, which this skips; a rank gone without MPI_Finalize is an abnormal
    termination to Open MPI's mpirun and MPICH's mpiexec), then ``os._exit`` - skipping the
    interpreter's teardown of torch's C++ objects. That teardown raced between ranks: a 2-rank script that
    had written every result still died now and then in std::terminate ("terminate called
    without an active exception", exit 6) - twice in five suite runs on 2026-11-24, once in
    one run with two test workers on 2026-11-27, after `shutdown`'s barrier and rank 0's
    wait for its peers. MPICH's PMI finalize, which it leaves to a C exit handler, is said
    here too (`runtime.launch.env.finalize_pmi`): without it hydra took the first rank to end
    for a crashed one and SIGKILLed the others still ending. Files are closed by their owners
    before this (the trainer's close, the callbacks' end); what is still buffered in Python's
    stdio is flushed here."""
    try:
        atexit._run_exitfuncs()
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
        if mpi is not None and mpi.Is_finalized():
            finalize_pmi()   # MPICH does it in a C exit handler, which os._exit skips
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed pipe: nothing left to say
                pass
        os._exit(code)


def _die(code: int, info: Optional[LaunchInfo], text: str, everywhere: bool):
    prefix = f"[rank {_rank_for_messages(info)}] "
    lines = "".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n"))
    try:
        sys.stdout.flush()
        sys.stderr.write(lines)
        sys.stderr.flush()
    except Exception:
        pass
    if everywhere:
        _wait_for_peers_notes()
    mpi = sys.modules.get("mpi4py.MPI")
    if not everywhere and mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        # Abort should kill us; if the launcher is slow about it, leave anyway.
        timer = threading.Timer(ABORT_GRACE_S, os._exit, args=(code,))
        timer.daemon = True
        timer.start()
        mpi.COMM_WORLD.Abort(code)
    step = getattr(info, "slurm_step", None)
    if not everywhere and step is not None and code != BAD_INPUT_EXIT:
        _kill_slurm_step(step)   # (bad input: every node is alive, kill-on-bad-exit suffices)
    if everywhere:
        finalize_pmi()   # each rank leaves on its own: hydra must not SIGKILL the later ones
    os._exit(code)


NOTED_KEY = "presto/noted"
DONE_KEY = "presto/noted-done"
NOTED_WAIT_S = 10.0   # an error raised on every rank: how long each waits for the others' notes


def _wait_for_peers_notes() -> None:
    """Every rank raised the same error and ran its failure notes before coming here: say so
    through the store and wait until every rank has (bounded; best effort - a rank that never
    comes, or a store that is gone, only costs the wait). Then rank 0, which hosts the store,
    leaves last: each other rank says it is done with the store, and rank 0 waits for that -
    a rank still asking when rank 0 had gone printed c10d's "recvValue failed ... Connection
    reset by peer" and a C++ stack of 13 frames after the refusal (the probe's B3)."""
    if not (_active() and torch_dist.get_world_size() > 1):
        return
    store = _default_store()
    if store is None:
        return
    world, rank = torch_dist.get_world_size(), torch_dist.get_rank()
    try:
        deadline = time.monotonic() + NOTED_WAIT_S
        n = int(store.add(NOTED_KEY, 1))
        while n < world and time.monotonic() < deadline:
            time.sleep(0.01)
            n = int(store.add(NOTED_KEY, 0))
        if rank != 0:
            store.add(DONE_KEY, 1)   # its last word to the store
            return
        while int(store.add(DONE_KEY, 0)) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception:  # noqa: BLE001 - a peer or the store gone: nothing left to wait for
        pass


def _kill_slurm_step(step: str) -> None:
    """Cancel job step ``step`` ("JOBID.STEPID"), as Slurm's pmi2 plugin does on MPI_Abort
    (slurm_kill_job_step): every task gets SIGTERM, SIGKILL after KillWait, and srun learns
    the step is cancelled. Without it, srun --kill-on-bad-exit signals the other tasks itself
    but waits for those of a lost node until the node is declared DOWN (SlurmdTimeout, 300 s
    by default) - and Slurm requeues the job under run.sub's feet; with it srun gives up after
    KillWait + 2 s, so run.sub requeues at once (tests/e2e/test_slurm_two_nodes.py). (``scancel
    --signal=KILL`` would only signal the tasks: srun would still wait.) Best effort: no
    scancel, or a slow one, and this rank leaves anyway."""
    scancel = shutil.which("scancel")
    if scancel is None:
        return
    try:
        subprocess.run([scancel, "--quiet", step], timeout=ABORT_GRACE_S,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.SubprocessError):
        pass


def _rank_for_messages(info: Optional[LaunchInfo]):
    if _CTX is not None:
        return _CTX.rank
    if info is not None:
        return info.rank
    if _active():
        return torch_dist.get_rank()
    return "?"
