"""Rank discovery: the one module that reads the launcher's environment.

Owns: turning what a launcher put in the environment (mpiexec/mpirun, srun, torchrun, or
nothing) into a `LaunchInfo` — rank, local rank, world size, local world size, which launcher —
plus the rendezvous hint `runtime.launch.dist` needs to join the ranks (over MPI, a TCP address, or a
file). Every other module receives these values; none reads ``os.environ`` for ranks. And, at a
rank's end, telling the launcher's PMI connection it leaves (`finalize_pmi`).
Never: creates process groups, touches torch or CUDA (``CUDA_VISIBLE_DEVICES``,
``GLOO_SOCKET_IFNAME``, ``NCCL_*`` are read by torch and NCCL themselves and left alone here).

Detection, first match wins (docs/LAUNCH.md has the commands):

1. An MPI launcher started us (``OMPI_COMM_WORLD_RANK``: Open MPI; ``PMI_RANK``/``PMI_SIZE``:
   MPICH hydra, Intel MPI, ``srun --mpi=pmi2``; ``PMIX_RANK``: ``srun --mpi=pmix``, PRRTE) and
   mpi4py is importable *and* its MPI library can talk to that launcher (mpi4py's PyPI wheel
   loads MPICH unless ``MPI4PY_LIBMPI`` points at another libmpi; MPICH cannot join an Open MPI
   or PMIx job, it aborts the process inside ``MPI_Init``). Then ranks come from
   ``MPI.COMM_WORLD`` and the local rank from ``Split_type(COMM_TYPE_SHARED)``; rank 0 sends
   the rendezvous address over MPI. ``PRESTO_MPI=0`` skips MPI, ``PRESTO_MPI=1`` forces it.
2. Otherwise the launcher's variables, innermost launcher first: torchrun (``RANK``,
   ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``), Open
   MPI (``OMPI_COMM_WORLD_*``), MPICH/PMI (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``),
   srun (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_STEP_NUM_TASKS``/``SLURM_NTASKS``,
   ``SLURM_STEP_TASKS_PER_NODE``/``SLURM_TASKS_PER_NODE`` such as ``"2(x3),1"``).
3. Nothing: a single process, rank 0 of 1.

mpi4py is imported only in case 1, so a plain ``python -m ...`` never loads an MPI library.

Also read here, because it is the batch script's word about this launch: ``PRESTO_CACHE_CLEAR``
(``cache_cleared()``), set by submission/run.sub to 1 when every node dropped its page caches
before this experiment and 0 when it could not; the MLPerf log's ``cache_clear`` says the same.
"""
from __future__ import annotations

import hashlib
import os
import re
import select
import stat
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Mapping, Optional

from runtime.choices import Launcher

# What LaunchInfo.launcher calls the launcher that started this process. From inside a rank
# the two MPI launchers look alike - MPICH's mpiexec and Intel MPI's mpirun (PMI_RANK), Open
# MPI's mpirun (OMPI_COMM_WORLD_RANK) all say "an MPI job" - so both are "mpi"; "single" is no
# launcher at all (a plain `python -m ...`).
DISCOVERED_LAUNCHERS = ("mpi", "srun", "torchrun", "single")
# Each system.launcher (runtime.choices.Launcher, one row each in submission/launchers.py) as
# discovery names it: the one place the two vocabularies meet (tests/unit/test_launchers.py).
DISCOVERED_AS: dict[Launcher, str] = {"mpiexec": "mpi", "mpirun": "mpi", "srun": "srun",
                                      "torchrun": "torchrun"}
RENDEZVOUS = ("mpi", "tcp", "file", "local")

# Ports derived from a job id stay below Linux's ephemeral range (32768-60999), so they never
# collide with sockets the OS hands out (gloo's own connections, TCPStore on port 0).
DERIVED_PORT_BASE = 15000
DERIVED_PORT_SPAN = 17000


class LaunchError(RuntimeError):
    """The launcher's environment is missing something or contradicts itself."""


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, as the launcher said.

    ``rendezvous`` tells runtime.launch.dist how ranks find each other:
      "mpi"   — rank 0 sends address and port over MPI.COMM_WORLD (MPI is initialised);
      "tcp"   — ``master_addr:master_port`` known to every rank (torchrun, srun, env override);
      "file"  — a torch FileStore at ``store_path`` (Open MPI on one node without mpi4py);
      "local" — a world of one, nothing to find.
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    launcher: str                      # one of DISCOVERED_LAUNCHERS
    node_rank: Optional[int] = None
    rendezvous: str = "local"          # one of RENDEZVOUS
    master_addr: Optional[str] = None  # "tcp": rank 0's address; "mpi": optional override
    master_port: Optional[int] = None
    store_path: Optional[str] = None
    source: str = "none"               # the variables the ranks came from, for messages
    mpi_vendor: Optional[str] = None   # set when ranks came from mpi4py
    # "JOBID.STEPID" when srun started this process as a task without MPI: a failing rank
    # asks Slurm to kill this step (runtime.launch.dist._die), as MPI_Abort does under pmi2.
    slurm_step: Optional[str] = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def __post_init__(self):
        _check_consistent(self.rank, self.local_rank, self.world_size, self.local_world_size,
                          self.source)
        if self.launcher not in DISCOVERED_LAUNCHERS:
            raise LaunchError(f"launcher {self.launcher!r} is not one of {DISCOVERED_LAUNCHERS}")
        if self.rendezvous not in RENDEZVOUS:
            raise LaunchError(f"rendezvous {self.rendezvous!r} is not one of {RENDEZVOUS}")


def discover(env: Optional[Mapping[str, str]] = None, *, use_mpi: Optional[bool] = None) -> LaunchInfo:
    """Find rank, local rank and world size from the launcher's environment.

    ``env`` defaults to ``os.environ`` (tests pass fake dicts). ``use_mpi``: None = decide from
    ``PRESTO_MPI`` and the launcher (see module docstring); False never imports mpi4py.
    """
    env = os.environ if env is None else env
    family = mpi_launcher_family(env)
    if use_mpi is None:
        use_mpi = _flag(env, "PRESTO_MPI")  # None = auto
    if family is not None and use_mpi is not False and not _is_torchrun(env):
        mpi = _load_mpi4py(family, force=use_mpi is True)
        if mpi is not None:
            if family == "pmi":
                _note_pmi_socket(env)
            return _from_mpi(mpi, env, family)
    return discover_from_env(env)


def mpi_launcher_family(env: Mapping[str, str]) -> Optional[str]:
    """"openmpi", "pmi" (MPICH hydra, Intel MPI, srun --mpi=pmi2), "pmix", or None."""
    if "OMPI_COMM_WORLD_RANK" in env:
        return "openmpi"
    if "PMI_RANK" in env or "PMI_SIZE" in env:
        return "pmi"
    if "PMIX_RANK" in env:
        return "pmix"
    return None


def _is_torchrun(env: Mapping[str, str]) -> bool:
    """torchrun's workers (innermost even when srun/mpirun started the torchrun agents)."""
    return "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE",
                                                                   "LOCAL_RANK"))


def discover_from_env(env: Mapping[str, str]) -> LaunchInfo:
    """The launcher's variables alone, no MPI (innermost launcher first)."""
    if _is_torchrun(env):
        return _from_torchrun(env)
    if "OMPI_COMM_WORLD_RANK" in env:
        return _from_openmpi(env)
    if "PMI_RANK" in env or "PMI_SIZE" in env:
        return _from_pmi(env)
    if in_srun_step(env):
        return _from_srun(env)
    return LaunchInfo(0, 0, 1, 1, "single", node_rank=0, rendezvous="local", source="none")


# ---------------------------------------------------------------------------------------------
# MPI


def _load_mpi4py(family: str, force: bool):
    """mpi4py.MPI, initialised, when its library fits the launcher; else None (no MPI_Init)."""
    try:
        import mpi4py
    except ImportError:
        return None
    if "mpi4py.MPI" not in sys.modules:
        # Initialise by hand, after the vendor check: MPI_Init of a library that does not
        # match the launcher aborts the whole process.
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = True
        mpi4py.rc.thread_level = "funneled"  # only the main thread ever calls MPI
    from mpi4py import MPI
    vendor = MPI.get_vendor()[0]
    if not force and not _vendor_fits(vendor, family):
        return None
    if not MPI.Is_initialized():
        MPI.Init_thread()
    return MPI


def _vendor_fits(vendor: str, family: str) -> bool:
    if family == "openmpi":
        return vendor == "Open MPI"
    if family == "pmi":
        return vendor != "Open MPI"
    return vendor == "Open MPI"  # PMIx: Open MPI speaks it; pip's MPICH does not


# The PMI connection the launcher gave this rank (``PMI_FD``) as (fd, st_dev, st_ino), noted
# when MPI starts on it: `finalize_pmi` speaks on it only while the descriptor is that socket.
_PMI_SOCKET: Optional[tuple[int, int, int]] = None
PMI_FINALIZE_WAIT_S = 5.0


def _note_pmi_socket(env: Mapping[str, str]) -> None:
    global _PMI_SOCKET
    if env.get("PMI_VERSION", "1").strip() != "1":
        return  # the PMI-2 wire (PMI_VERSION=2): not spoken here
    try:
        fd = int(env["PMI_FD"])
        st = os.fstat(fd)
    except (KeyError, ValueError, OSError):
        return  # no PMI_FD (hydra's -pmi-port): nothing to finalize by hand
    if stat.S_ISSOCK(st.st_mode):
        _PMI_SOCKET = (fd, st.st_dev, st.st_ino)


def finalize_pmi(timeout_s: float = PMI_FINALIZE_WAIT_S) -> bool:
    """Tell the process manager this rank is leaving (PMI-1 ``cmd=finalize``, answered by
    ``cmd=finalize_ack``) on the ``PMI_FD`` connection MPI was started on; True once it is
    acknowledged. For a rank that ends with ``os._exit``: MPICH (4.1 on, the pip wheel's 5.0)
    leaves this to a C ``atexit`` handler, which ``os._exit`` skips - and MPICH's hydra proxy
    takes a PMI connection closed without it for a crashed rank and SIGKILLs every rank still
    running (its exit status then 9, or 0 when the proxy reaps it late). Ranks that end a
    moment apart died so now and then (tests/ranks/test_noise_scale_ranks.py at 4 ranks on 2
    busy cores: mpiexec exit 9, "Killed (signal 9)", empty stderr). Call it once MPI is done
    with the connection: after MPI_Finalize (its PMI barrier uses it), or on a way out that
    never finalizes MPI (`runtime.launch.dist._die`). Does nothing (False) without such a
    connection: no MPI here, hydra's ``-pmi-port``, PMI-2, or the descriptor is no longer the
    socket noted at start (a library that closed it; its number reused). Bounded by
    ``timeout_s``; any error only means the launcher was not told."""
    sock = _PMI_SOCKET
    if sock is None:
        return False
    fd, dev, ino = sock
    try:
        st = os.fstat(fd)
        if not stat.S_ISSOCK(st.st_mode) or (st.st_dev, st.st_ino) != (dev, ino):
            return False
        os.write(fd, b"cmd=finalize\n")
        deadline = time.monotonic() + timeout_s
        reply = b""
        while True:
            while b"\n" in reply:
                line, reply = reply.split(b"\n", 1)
                if line.startswith(b"cmd=finalize_ack"):
                    return True
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return False
            chunk = os.read(fd, 4096)
            if not chunk:
                return False
            reply += chunk
    except OSError:
        return False


def _from_mpi(MPI, env: Mapping[str, str], family: str) -> LaunchInfo:
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    vendor = MPI.get_vendor()[0]
    expected = _env_world_size(env, family)
    if expected is not None and expected != size:
        raise LaunchError(
            f"mpi4py ({vendor}) sees an MPI world of {size} but the launcher started {expected} "
            f"ranks ({_family_vars(family)}): mpi4py's MPI library does not match the launcher. "
            f"Point MPI4PY_LIBMPI at the launcher's libmpi, or set PRESTO_MPI=0 to use the "
            f"launcher's variables instead.")
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = node.Get_rank(), node.Get_size()
    leaders = world.Split(0 if local_rank == 0 else MPI.UNDEFINED, key=rank)
    node_rank = leaders.Get_rank() if local_rank == 0 else None
    if leaders != MPI.COMM_NULL:
        leaders.Free()
    node_rank = node.bcast(node_rank, root=0)
    node.Free()
    addr = env.get("MASTER_ADDR") or None
    return LaunchInfo(rank, local_rank, size, local_size,
                      _launcher_name(env, family), node_rank=node_rank,
                      rendezvous="local" if size == 1 else "mpi", master_addr=addr,
                      source=f"MPI.COMM_WORLD ({_family_vars(family)})", mpi_vendor=vendor)


def _env_world_size(env: Mapping[str, str], family: str) -> Optional[int]:
    name = {"openmpi": "OMPI_COMM_WORLD_SIZE", "pmi": "PMI_SIZE"}.get(family)
    return _int(env, name) if name and name in env else None


def _family_vars(family: str) -> str:
    return {"openmpi": "OMPI_COMM_WORLD_*", "pmi": "PMI_RANK/PMI_SIZE",
            "pmix": "PMIX_RANK"}[family]


# ---------------------------------------------------------------------------------------------
# Launchers' variables


def _from_torchrun(env: Mapping[str, str]) -> LaunchInfo:
    rank = _int(env, "RANK")
    world = _int(env, "WORLD_SIZE")
    local = _int(env, "LOCAL_RANK")
    local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
    node = _int(env, "GROUP_RANK") if "GROUP_RANK" in env else None
    src = "torchrun's variables"
    _check_consistent(rank, local, world, local_world, src,
                      ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                       "LOCAL_WORLD_SIZE" if "LOCAL_WORLD_SIZE" in env else "WORLD_SIZE"))
    if world == 1:
        return LaunchInfo(rank, local, world, local_world, "torchrun", node, "local", source=src)
    addr, port = _master(env, required_by="torchrun")
    return LaunchInfo(rank, local, world, local_world, "torchrun", node, "tcp",
                      master_addr=addr, master_port=port, source=src)


def _from_openmpi(env: Mapping[str, str]) -> LaunchInfo:
    rank = _int(env, "OMPI_COMM_WORLD_RANK")
    world = _int(env, "OMPI_COMM_WORLD_SIZE")
    local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
    local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    src = "OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE"
    _check_consistent(rank, local, world, local_world, "Open MPI's variables",
                      ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
                       "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"))
    job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE")
    common = dict(launcher="mpi", node_rank=None, source=src)
    if world == 1:
        return LaunchInfo(rank, local, world, local_world, rendezvous="local", **common)
    if "MASTER_ADDR" in env:
        addr, port = _master(env, required_by="Open MPI", default_port_key=job)
        return LaunchInfo(rank, local, world, local_world, rendezvous="tcp",
                          master_addr=addr, master_port=port, **common)
    if local_world != world:
        raise LaunchError(
            f"Open MPI job over several nodes ({src}: {world} ranks, {local_world} on this node) "
            f"without an MPI library mpi4py can use: set MASTER_ADDR to rank 0's host (port: "
            f"MASTER_PORT, else derived from the job id), or point MPI4PY_LIBMPI at Open MPI's "
            f"libmpi.")
    if not job:
        raise LaunchError("Open MPI job with neither OMPI_MCA_ess_base_jobid nor PMIX_NAMESPACE "
                          "set: cannot name a rendezvous file; set MASTER_ADDR and MASTER_PORT.")
    # One node: all ranks meet in a FileStore in mpirun's own per-job session directory, so two
    # jobs never share it and no port has to be guessed.
    session = (env.get("OMPI_MCA_orte_jobfam_session_dir") or env.get("PMIX_SERVER_TMPDIR")
               or tempfile.gettempdir())
    safe_job = re.sub(r"[^A-Za-z0-9_.-]", "_", job)
    path = os.path.join(session, f"presto-rendezvous-{safe_job}")
    return LaunchInfo(rank, local, world, local_world, rendezvous="file", store_path=path,
                      **common)


def _from_pmi(env: Mapping[str, str]) -> LaunchInfo:
    if "MPI_LOCALRANKID" not in env and in_srun_step(env):
        return _from_srun(env)  # srun --mpi=pmi2: srun's own variables are complete
    rank = _int(env, "PMI_RANK")
    world = _int(env, "PMI_SIZE")
    src = "PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS"
    if "MPI_LOCALRANKID" not in env or "MPI_LOCALNRANKS" not in env:
        raise LaunchError("PMI_RANK is set but MPI_LOCALRANKID/MPI_LOCALNRANKS are not: cannot "
                          "tell the local rank; install mpi4py (requirements.txt) so MPI can.")
    local = _int(env, "MPI_LOCALRANKID")
    local_world = _int(env, "MPI_LOCALNRANKS")
    _check_consistent(rank, local, world, local_world, "PMI's variables",
                      ("PMI_RANK", "MPI_LOCALRANKID", "PMI_SIZE", "MPI_LOCALNRANKS"))
    if world == 1:
        return LaunchInfo(rank, local, world, local_world, "mpi", None, "local", source=src)
    addr, port = _master(env, required_by="an MPICH/PMI launch without mpi4py "
                         "(install mpi4py, requirements.txt, to need neither)")
    return LaunchInfo(rank, local, world, local_world, "mpi", None, "tcp",
                      master_addr=addr, master_port=port, source=src)


def _launcher_name(env: Mapping[str, str], family: str) -> str:
    """"srun" when srun itself is the MPI launcher (--mpi=pmi2/pmix), else "mpi".

    mpirun and hydra started inside an allocation launch their daemons with srun, so their
    ranks inherit SLURM_STEP_ID too; their own variables (OMPI_*, MPI_LOCALRANKID) tell them
    apart.
    """
    if not in_srun_step(env) or family == "openmpi" or "MPI_LOCALRANKID" in env:
        return "mpi"
    return "srun"


def in_srun_step(env: Mapping[str, str]) -> bool:
    """Inside a task that srun started, not merely inside an allocation (sbatch/salloc shell)."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    if step is None or "SLURM_PROCID" not in env:
        return False
    # The batch script runs as a pseudo step with a huge id (SLURM_BATCH_SCRIPT = 0xfffffffb).
    return not (step.isdigit() and int(step) >= 0xFFFFFF00)


def _from_srun(env: Mapping[str, str]) -> LaunchInfo:
    rank = _int(env, "SLURM_PROCID")
    size_var = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    world = _int(env, size_var)
    local = _int(env, "SLURM_LOCALID")
    node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
    local_world = _srun_local_world(env, node, world)
    src = f"SLURM_PROCID, SLURM_LOCALID, {size_var}"
    _check_consistent(rank, local, world, local_world, "srun's variables",
                      ("SLURM_PROCID", "SLURM_LOCALID", size_var, "tasks on this node"))
    if world == 1:
        return LaunchInfo(rank, local, world, local_world, "srun", node, "local", source=src)
    job = f"{env.get('SLURM_JOB_ID', env.get('SLURM_JOBID', ''))}.{env.get('SLURM_STEP_ID', env.get('SLURM_STEPID', ''))}"
    step = job if re.fullmatch(r"\d+\.\d+", job) else None
    if "MASTER_ADDR" in env:
        addr, port = _master(env, required_by="srun", default_port_key=job)
    else:
        nodelist = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                    or env.get("SLURM_NODELIST"))
        if not nodelist:
            raise LaunchError("srun without MPI: no SLURM_STEP_NODELIST/SLURM_JOB_NODELIST to "
                              "find rank 0's host; set MASTER_ADDR (and MASTER_PORT).")
        addr = first_host(nodelist)
        port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else derived_port(job)
    return LaunchInfo(rank, local, world, local_world, "srun", node, "tcp",
                      master_addr=addr, master_port=port, source=src, slurm_step=step)


def _srun_local_world(env: Mapping[str, str], node: int, world: int) -> int:
    for var in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if var in env:
            counts = parse_tasks_per_node(env[var], var)
            if node >= len(counts):
                raise LaunchError(f"SLURM_NODEID={node} but {var}={env[var]!r} lists only "
                                  f"{len(counts)} node(s)")
            return counts[node]
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int(env, "SLURM_NTASKS_PER_NODE")
    if env.get("SLURM_NNODES", env.get("SLURM_STEP_NUM_NODES", "1")) == "1":
        return world
    raise LaunchError("srun on several nodes without SLURM_STEP_TASKS_PER_NODE, "
                      "SLURM_TASKS_PER_NODE or SLURM_NTASKS_PER_NODE: cannot tell the local "
                      "world size")


def parse_tasks_per_node(value: str, var: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Slurm's compressed per-node counts: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise LaunchError(f"{var}={value!r}: cannot parse {part!r} "
                              f"(expected forms like '4', '2(x3)', '2(x3),1')")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def first_host(nodelist: str) -> str:
    """First host of a Slurm hostlist: ``"gpu[07-09,12],cpu1"`` -> ``"gpu07"``."""
    m = re.match(r"\s*([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        raise LaunchError(f"cannot read the first host of the Slurm node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix.strip()
    return prefix + ranges.split(",")[0].split("-")[0]


def derived_port(key: str) -> int:
    """A port every rank computes alike from a job id, in [15000, 32000) (below ephemeral)."""
    digest = int(hashlib.sha256(key.encode()).hexdigest(), 16)
    return DERIVED_PORT_BASE + digest % DERIVED_PORT_SPAN


# ---------------------------------------------------------------------------------------------
# the batch script's word on this launch

CACHE_CLEAR_VAR = "PRESTO_CACHE_CLEAR"


def cache_cleared(env: Optional[Mapping[str, str]] = None) -> Optional[bool]:
    """True/False when submission/run.sub did/could not drop the page caches on every node
    before this run (``PRESTO_CACHE_CLEAR`` = 1/0); None when unset (not launched by run.sub)."""
    env = os.environ if env is None else env
    value = env.get(CACHE_CLEAR_VAR, "").strip()
    if value == "":
        return None
    if value in ("0", "1"):
        return value == "1"
    raise LaunchError(f"{CACHE_CLEAR_VAR}={value!r}: use 1 (caches dropped) or 0 (not dropped)")


# ---------------------------------------------------------------------------------------------
# helpers


def _master(env: Mapping[str, str], required_by: str,
            default_port_key: Optional[str] = None) -> tuple[str, int]:
    addr = env.get("MASTER_ADDR")
    if not addr:
        raise LaunchError(f"MASTER_ADDR is not set but {required_by} needs it to find rank 0")
    if "MASTER_PORT" in env:
        port = _int(env, "MASTER_PORT")
    elif default_port_key:
        port = derived_port(default_port_key)
    else:
        raise LaunchError(f"MASTER_PORT is not set but {required_by} needs it to find rank 0")
    if not 0 < port < 65536:
        raise LaunchError(f"MASTER_PORT={port} is not a TCP port (1..65535)")
    return addr, port


def _int(env: Mapping[str, str], name: str) -> int:
    if name not in env:
        raise LaunchError(f"{name} is not set")
    try:
        return int(env[name])
    except ValueError:
        raise LaunchError(f"{name}={env[name]!r} is not an integer") from None


def _flag(env: Mapping[str, str], name: str) -> Optional[bool]:
    value = env.get(name, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise LaunchError(f"{name}={env[name]!r}: use 1, 0 or auto")


def _check_consistent(rank: int, local_rank: int, world: int, local_world: int, source: str,
                      names: tuple = ("rank", "local rank", "world size", "local world size")):
    """Raise naming the variables (``names``: rank, local rank, world, local world) at fault."""
    n_rank, n_local, n_world, n_local_world = names
    problems = []
    if world < 1:
        problems.append(f"{n_world}={world} < 1")
    if local_world < 1:
        problems.append(f"{n_local_world}={local_world} < 1")
    if not 0 <= rank < world:
        problems.append(f"{n_rank}={rank} is not in [0, {n_world}={world})")
    if not 0 <= local_rank < local_world:
        problems.append(f"{n_local}={local_rank} is not in [0, {n_local_world}={local_world})")
    if local_world > world:
        problems.append(f"{n_local_world}={local_world} > {n_world}={world}")
    if problems:
        raise LaunchError(f"inconsistent launch environment (from {source}): "
                          + "; ".join(problems))
