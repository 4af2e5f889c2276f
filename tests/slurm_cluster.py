"""A real one-node Slurm cluster for tests: Debian's slurm-wlm and munge, run by PID from a
temporary directory.

Owns: installing ``slurm-wlm`` and ``munge`` when they are missing (apt-get, root only);
writing a private munge key, munge socket and ``slurm.conf`` for this machine (slurm.conf(5)
settings, docs/REFERENCES.md §9: auth/munge, proctrack/linuxproc, task/none, select/cons_tres,
one node with ``nproc`` CPUs); starting ``munged``, ``slurmctld`` and ``slurmd`` in the
foreground as child processes on free ports; waiting until the node is idle; and tearing
down everything it started — jobs, job steps, daemons, files — also when the start itself or a
test fails.
Never: touches the system's munged (``/run/munge``) or ``/etc/slurm``, uses fixed ports (two
clusters can run side by side), or kills a process it did not start: daemons are stopped by
the PIDs it recorded (checked against their start time, so a reused PID is left alone), job
steps by the private ``SLURM_CONF`` in their environment.

From tests: the session fixture ``slurm_cluster`` (tests/conftest.py imports it); pass
``cluster.env`` to sbatch/srun/squeue. ``PRESTO_SLURM_TESTS=0`` skips the tests that use it.
By hand (README "Running on a Slurm cluster")::

    .venv/bin/python tests/slurm_cluster.py start /tmp/presto-slurm   # prints the SLURM_CONF export
    .venv/bin/python tests/slurm_cluster.py stop /tmp/presto-slurm

tests/slurm_two_nodes.py builds a two-node cluster (each slurmd in its own network namespace)
from the same pieces: ``write_files`` with several ``NodeSpec``, ``spawn`` with a command
prefix, ``SlurmCluster.netns`` for where the client commands run.
"""
from __future__ import annotations

import argparse
import fcntl
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "sinfo", "scontrol", "scancel")
APT_PACKAGES = ("slurm-wlm", "munge")
PARTITION = "debug"
START_TIMEOUT_S = 60
STATE_FILE = "cluster.json"


class ClusterError(RuntimeError):
    """The cluster could not be started; the message carries the daemons' log tails."""


# ------------------------------------------------------------------------------- installation

def _sbin_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])


def missing_binaries() -> list[str]:
    path = _sbin_path()
    return [b for b in DAEMONS + CLIENTS if shutil.which(b, path=path) is None]


def ensure_installed() -> str | None:
    """Install slurm-wlm and munge when missing. None when ready, else why not (a skip reason)."""
    if not missing_binaries():
        return None
    if os.geteuid() != 0:
        return (f"Slurm/munge missing ({', '.join(missing_binaries())}) and not root: "
                f"apt-get install {' '.join(APT_PACKAGES)} to run the Slurm tests")
    if shutil.which("apt-get") is None:
        return f"Slurm/munge missing ({', '.join(missing_binaries())}) and no apt-get to install them"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # One installer at a time (two pytest processes may start at once).
    with open(os.path.join(tempfile.gettempdir(), "presto-apt.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not missing_binaries():
            return None
        for cmd in (["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *APT_PACKAGES]):
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                return f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()[-500:]}"
    missing = missing_binaries()
    return f"still missing after apt-get install: {', '.join(missing)}" if missing else None


# ------------------------------------------------------------------------------------ cluster

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_time(pid: int) -> int | None:
    """The kernel's start time of a process (field 22 of /proc/PID/stat); None when gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


@dataclass(frozen=True)
class NodeSpec:
    """One compute node of slurm.conf: ``NodeName`` (also its hostname), ``NodeAddr`` and,
    when several slurmd share a host, its own slurmd ``Port``."""

    name: str
    addr: str = "127.0.0.1"
    port: int | None = None


@dataclass
class SlurmCluster:
    """A running cluster; ``procs`` are (name, pid, start time) of its daemons. ``host`` is the
    first (for `start`: the only) compute node. ``netns``: the network namespace the client
    commands must run in to reach slurmctld (None: this one)."""

    root: Path
    host: str
    procs: list[tuple[str, int, int]] = field(default_factory=list)
    partition: str = PARTITION
    netns: str | None = None
    started_at: float = field(default_factory=time.time)   # wall clock, for stale_mpich_shm

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a client command needs besides the caller's environment."""
        return {"SLURM_CONF": str(self.conf)}

    def client_env(self, base: dict | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), "/usr/sbin", "/sbin"])
        env.update(self.env)
        return env

    def client_argv(self, argv: list[str]) -> list[str]:
        """``argv`` as a client command of this cluster (inside ``netns`` when it has one)."""
        return ["nsenter", f"--net=/run/netns/{self.netns}", "--", *argv] if self.netns \
            else list(argv)

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(self.client_argv(list(cmd)), env=self.client_env(),
                              capture_output=True, text=True, timeout=timeout)

    def node_state(self, node: str | None = None) -> str:
        out = self.run("sinfo", "-h", "-n", node or self.host, "-o", "%T")
        return out.stdout.strip() if out.returncode == 0 else f"sinfo failed: {out.stderr.strip()}"

    def log_tails(self, lines: int = 15) -> str:
        parts = []
        logs = self.root / "log"
        for path in [logs / "munged.log", logs / "slurmctld.log", *sorted(logs.glob("slurmd*.log"))]:
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path}\n" + "\n".join(tail))
        return "\n".join(parts)

    def save(self) -> None:
        (self.root / STATE_FILE).write_text(json.dumps(
            {"host": self.host, "procs": self.procs}, indent=1))

    @classmethod
    def load(cls, root: Path) -> "SlurmCluster":
        state = json.loads((root / STATE_FILE).read_text())
        return cls(root, state["host"], [tuple(p) for p in state["procs"]])

    # -- teardown ---------------------------------------------------------------------------

    def stop(self, remove: bool = True) -> list[str]:
        """Cancel jobs, end job steps, stop the daemons (reverse order), remove the files.
        Returns notes on anything that needed force."""
        notes = []
        if self._alive("slurmctld"):
            notes += self._cancel_jobs()
        notes += self._kill_steps()
        for name, pid, started in reversed(self.procs):
            notes += _terminate(name, pid, started)
        self.procs = []
        notes += remove_stale_mpich_shm(self.started_at)
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)
        return notes

    def _alive(self, name: str) -> bool:
        return any(n == name and _start_time(p) == s for n, p, s in self.procs)

    def _cancel_jobs(self) -> list[str]:
        out = self.run("squeue", "-h", "-o", "%i")
        jobs = out.stdout.split() if out.returncode == 0 else []
        if not jobs:
            return []
        self.run("scancel", *jobs)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if not self.run("squeue", "-h", "-o", "%i").stdout.split():
                return []
            time.sleep(0.5)
        return [f"jobs {jobs} still queued 20 s after scancel"]

    def _kill_steps(self) -> list[str]:
        """slurmstepd processes (and their tasks) of this cluster: found by our SLURM_CONF."""
        marker = f"SLURM_CONF={self.conf}".encode()
        notes = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if not (d / "comm").read_text().startswith("slurmstepd"):
                    continue
                if marker not in (d / "environ").read_bytes().split(b"\0"):
                    continue
            except OSError:
                continue
            pid = int(d.name)
            notes += _terminate("slurmstepd", pid, _start_time(pid), group=True)
        return notes


def remove_stale_mpich_shm(since: float, shm: Path = Path("/dev/shm")) -> list[str]:
    """Remove MPICH's node-local shared-memory files (``mpich_shm_*``) made since ``since`` that
    no process maps any more: a rank SIGKILLed inside an ``srun --mpi=pmi2`` step leaves its
    file behind, and its name is derived from the job step - the next fresh cluster's job 1.0
    gets the same name and dies in MPI_Init ("MPIDI_POSIX_comm_bootstrap: Out of memory").
    Files of other runs (older, or still mapped) are left alone."""
    try:
        files = [f for f in shm.glob("mpich_shm_*") if f.stat().st_mtime >= since - 1]
    except OSError:
        return []
    if not files:
        return []
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split(None, 5)[-1] for line in maps.read_text().splitlines()
                          if "/mpich_shm_" in line)
        except OSError:
            continue
    removed = []
    for f in files:
        if str(f) not in mapped:
            f.unlink(missing_ok=True)
            removed.append(f.name)
    return [f"removed {len(removed)} stale MPICH shared-memory file(s) of killed ranks"] \
        if removed else []


def _terminate(name: str, pid: int, started: int | None, group: bool = False) -> list[str]:
    """SIGTERM, then SIGKILL after 10 s, only if ``pid`` is still the process we started."""
    if started is None or _start_time(pid) != started:
        return []
    kill = (lambda sig: os.killpg(pid, sig)) if group else (lambda sig: os.kill(pid, sig))
    try:
        kill(signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        kill = lambda sig: os.kill(pid, sig)  # noqa: E731 - not a group leader
        try:
            kill(signal.SIGTERM)
        except ProcessLookupError:
            return []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        _reap(pid)
        if _start_time(pid) != started or _is_zombie(pid):
            _reap(pid)
            return []
        time.sleep(0.1)
    try:
        kill(signal.SIGKILL)
    except ProcessLookupError:
        return []
    _reap(pid)
    return [f"{name} (pid {pid}) ignored SIGTERM for 10 s: killed"]


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def write_files(root: Path, controller: str, controller_addr: str, nodes: list[NodeSpec],
                extra: tuple[str, ...] = ()) -> None:
    """The munge key and ``slurm.conf``: slurmctld on ``controller`` (reached at
    ``controller_addr``), one partition of ``nodes``; ``extra`` lines override the defaults."""
    for sub in ("log", "run", "state", "spool", "munge"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for node in nodes:
        (root / "spool" / node.name).mkdir(exist_ok=True)
    os.chmod(root / "munge", 0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    (root / "plugstack.conf").write_text("")  # no site SPANK plugins (pyxis etc.) here
    user = pwd.getpwuid(os.geteuid()).pw_name
    lines = [
        "ClusterName=presto", f"SlurmctldHost={controller}({controller_addr})",
        "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge' / 'munge.socket'}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        f"SlurmUser={user}", f"SlurmdUser={user}",
        # %n: the node's name, so several slurmd on one host keep apart
        f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool' / '%n'}",
        f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}",
        f"SlurmdPidFile={root / 'run' / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={root / 'log' / 'slurmd-%n.log'}",
        f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
        f"PlugStackConfig={root / 'plugstack.conf'}",
        "MpiDefault=none", "ReturnToService=2", "KillWait=5", "MinJobAge=600",
        "InactiveLimit=0", "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
    ]
    keys = {line.split("=", 1)[0] for line in extra}
    lines = [line for line in lines if line.split("=", 1)[0] not in keys] + list(extra)
    for node in nodes:
        port = f" Port={node.port}" if node.port else ""
        lines.append(f"NodeName={node.name} NodeAddr={node.addr}{port} "
                     f"CPUs={os.cpu_count() or 1} State=UNKNOWN")
    lines.append(f"PartitionName={PARTITION} Nodes={','.join(n.name for n in nodes)} "
                 f"Default=YES MaxTime=INFINITE State=UP")
    (root / "slurm.conf").write_text("\n".join(lines) + "\n")


def spawn(cluster: SlurmCluster, name: str, argv: list[str]) -> None:
    """Start daemon ``name`` (``argv`` in the foreground, its own session, output in
    log/NAME.stdout) and record its PID and start time. ``argv`` may be a prefix that execs
    the daemon (``ip netns exec``, ``unshare``): the PID stays the daemon's."""
    log = open(cluster.root / "log" / f"{name}.stdout", "ab")
    proc = subprocess.Popen(argv, env=cluster.client_env(), stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    started = None
    for _ in range(50):
        started = _start_time(proc.pid)
        if started is not None:
            break
        time.sleep(0.02)
    cluster.procs.append((name, proc.pid, started))
    cluster.save()


def start(root: Path, timeout_s: float = START_TIMEOUT_S) -> SlurmCluster:
    """Start munged, slurmctld and slurmd with files under ``root``; wait until the node is idle.
    On failure everything started so far is stopped and ClusterError says why."""
    root = Path(root).resolve()
    host = socket.gethostname().split(".")[0]
    cluster = SlurmCluster(root, host)
    try:
        write_files(root, host, "127.0.0.1", [NodeSpec(host)])
        start_munged(cluster)
        spawn(cluster, "slurmctld", [which("slurmctld"), "-D", "-i", "-f", str(cluster.conf)])
        wait(lambda: cluster.run("scontrol", "ping").returncode == 0, timeout_s,
             "slurmctld answering `scontrol ping`", cluster)
        spawn(cluster, "slurmd", [which("slurmd"), "-D", "-f", str(cluster.conf), "-N", host])
        wait(lambda: node_up(cluster, host), timeout_s, f"node {host} idle", cluster)
    except BaseException as e:
        tails = cluster.log_tails()
        cluster.stop(remove=True)
        if isinstance(e, ClusterError):
            raise ClusterError(f"{e}\n{tails}") from None
        raise
    return cluster


def which(binary: str) -> str:
    found = shutil.which(binary, path=_sbin_path())
    if found is None:
        raise ClusterError(f"{binary} not found: apt-get install {' '.join(APT_PACKAGES)}")
    return found


def start_munged(cluster: SlurmCluster) -> None:
    """munged with the private key and socket under ``cluster.root/munge`` (a file: every
    network namespace on this host reaches it)."""
    root, munge = cluster.root, cluster.root / "munge"
    spawn(cluster, "munged", [which("munged"), "--foreground", "--force",
                              f"--key-file={munge / 'munge.key'}",
                              f"--socket={munge / 'munge.socket'}",
                              f"--pid-file={root / 'run' / 'munged.pid'}",
                              f"--log-file={root / 'log' / 'munged.log'}",
                              f"--seed-file={munge / 'munged.seed'}"])
    wait(lambda: (munge / "munge.socket").exists(), 15, "munged's socket", cluster)


def node_up(cluster: SlurmCluster, node: str) -> bool:
    return cluster.node_state(node).rstrip("*") in ("idle", "mixed", "allocated")


def wait(ready, timeout_s: float, what: str, cluster: SlurmCluster) -> None:
    """Poll ``ready()`` until true; ClusterError on timeout or when a daemon has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name, pid, started in cluster.procs:
            _reap(pid)
            if _start_time(pid) != started or _is_zombie(pid):
                raise ClusterError(f"{name} exited while waiting for {what}")
        if ready():
            return
        time.sleep(0.3)
    raise ClusterError(f"timed out after {timeout_s:.0f} s waiting for {what} "
                       f"(node state: {cluster.node_state()})")


# ------------------------------------------------------------------------------- pytest fixture

def cluster_for_tests(start_fn, why_not, prefix: str, label: str):
    """The body of a cluster fixture (this module's and tests/slurm_two_nodes.py's): skips
    with the reason where the cluster cannot be had here, fails where it can and does not
    start, and always tears down what it started."""
    import pytest
    if os.environ.get("PRESTO_SLURM_TESTS", "1") == "0":
        pytest.skip("PRESTO_SLURM_TESTS=0")
    reason = why_not()
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        cluster = start_fn(root)
    except ClusterError as e:
        pytest.fail(f"Slurm is available here but the {label} did not start: {e}")
    try:
        yield cluster
    finally:
        for note in cluster.stop(remove=True):
            print(f"{label} teardown: {note}", file=sys.stderr)


try:
    import pytest
except ImportError:  # the command line below needs no pytest
    pytest = None

if pytest is not None:
    @pytest.fixture(scope="session")
    def slurm_cluster():
        """A real one-node Slurm cluster for the whole test session (skips with the reason when
        Slurm cannot be installed here; fails when installed daemons do not come up)."""
        yield from cluster_for_tests(start, ensure_installed, "presto-slurm-",
                                     "one-node Slurm cluster")


# ------------------------------------------------------------------------------- command line

def command_line(argv, what: str, start_fn, load_fn, why_not, state_file: str,
                 started=lambda cluster: None) -> int:
    """``start DIR`` / ``stop DIR`` for a private cluster (this module's and
    tests/slurm_two_nodes.py's); ``started`` prints how to use a started one."""
    ap = argparse.ArgumentParser(description=f"start/stop a private {what}")
    ap.add_argument("action", choices=["start", "stop"])
    ap.add_argument("dir", type=Path, help="its files (created by start, removed by stop)")
    args = ap.parse_args(argv)
    if args.action == "start":
        if args.dir.exists() and any(args.dir.iterdir()):
            print(f"{args.dir} is not empty: stop that cluster or pick a new directory",
                  file=sys.stderr)
            return 2
        reason = why_not()
        if reason:
            print(reason, file=sys.stderr)
            return 1
        try:
            cluster = start_fn(args.dir)
        except ClusterError as e:
            print(e, file=sys.stderr)
            return 1
        started(cluster)
        return 0
    if not (args.dir / state_file).is_file():
        print(f"no {state_file} in {args.dir}: nothing started there", file=sys.stderr)
        return 1
    for note in load_fn(args.dir.resolve()).stop(remove=True):
        print(note, file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return command_line(argv, "one-node Slurm cluster", start, SlurmCluster.load,
                        ensure_installed, STATE_FILE,
                        lambda cluster: print(f"export SLURM_CONF={cluster.conf}"))


if __name__ == "__main__":
    sys.exit(main())
