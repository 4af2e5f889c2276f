"""A real two-node Slurm cluster on one machine: one slurmctld, two slurmd ("n1", "n2"), each
in its own network namespace with its own address, hostname and slurmd port, joined through a
bridge like hosts through a switch — so a job of 2 ranks really spans two "hosts", and one of
them can be lost.

    namespace       hostname  address       runs
    presto<pid>-h   head      10.78.0.254   slurmctld, the bridge, every client command
    presto<pid>-n1  n1        10.78.0.1     slurmd -N n1 (its own Port), its job steps, ranks
    presto<pid>-n2  n2        10.78.0.2     slurmd -N n2 (its own Port), its job steps, ranks

Each node namespace reaches the head's bridge ``br0`` by a veth pair; n1 <-> n2 traffic
crosses the bridge. munged runs in the host's namespace: its socket is a file, which every
namespace reaches (they share the file system). Every daemon runs in its own UTS namespace with
its node's hostname, and in the private mount namespace that ``ip netns exec`` makes a hosts
file naming head, n1 and n2 is bind-mounted over /etc/hosts: a job step on n1 sees hostname n1
and resolves n2 to 10.78.0.2, as on a real cluster, so the runtime's rendezvous
(runtime/launch/env.py, runtime/launch/dist.py) needs nothing special. Client commands (sbatch, squeue,
scontrol, ``python -m submission``) must run in the head namespace: wrap them with
``cluster.client_argv([...])`` (``cluster.run`` does).

slurm.conf (tests/slurm_cluster.py's, plus): ``NodeName=n1 NodeAddr=10.78.0.1 Port=P1`` and
n2 alike, ``SlurmdTimeout`` short (a node that stops answering is DOWN in seconds, not
minutes), ``ReturnToService=2`` (a DOWN node whose slurmd registers again is usable again),
``JobRequeue=1`` (batch jobs on a failed node are requeued).

Node loss (`kill_node`): SIGKILL to every process in the node's namespace — its slurmd, job
steps and ranks — as a crashed host; the link stays up, so peers' sockets see the connection
close at once. `restart_node` starts its slurmd again (the host "rebooted"); the node returns
to service when it registers.

Owns: the three namespaces, the bridge and veth pairs, the hosts file, the daemons of the
cluster (by PID), killing and restarting a node, tearing all of it down — on exit, on an
exception, on SIGTERM (turned into SystemExit while the cluster is up, as bench/netns.py
does) and from an atexit hook.
Never: touches the host's own network namespace, /etc or /run/munge; kills a process outside
the cluster's namespaces or one it did not start (daemons by recorded PID and start time; a
node's processes by the namespace it alone made).

Needs root (CAP_NET_ADMIN, mounts), iproute2, util-linux ``unshare``, slurm-wlm and munge
(installed by tests/slurm_cluster.py when missing). `unavailable()` says why not.

    .venv/bin/python tests/slurm_two_nodes.py start /tmp/presto-2n   # prints how to use it
    .venv/bin/python tests/slurm_two_nodes.py stop /tmp/presto-2n
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import slurm_cluster as sc  # noqa: E402

NODES = {"n1": "10.78.0.1", "n2": "10.78.0.2"}
HEAD, HEAD_ADDR = "head", "10.78.0.254"
PREFIX = 24
BRIDGE = "br0"
NODE_IF = "presto0"          # each node's end of its veth pair
STATE_FILE = "two_nodes.json"
# A node that stops answering is DOWN after SlurmdTimeout (slurmctld pings every third of it).
EXTRA_CONF = ("SlurmdTimeout=6", "ReturnToService=2", "JobRequeue=1", "MessageTimeout=5")


def unavailable() -> str | None:
    """Why the two-node cluster cannot run here (None when it can): root, tools, namespaces."""
    if os.geteuid() != 0:
        return "network namespaces and mounts need root"
    for tool in ("ip", "nsenter", "unshare", "mount"):
        if shutil.which(tool, path=sc._sbin_path()) is None:
            return f"`{tool}` not found: apt-get install iproute2 util-linux mount"
    probe = f"presto{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` is not possible here: {made.stderr.strip()}"
    try:
        uts = subprocess.run([*netns_argv(probe), "unshare", "--uts", "--mount", "--", "sh",
                              "-c", "hostname presto-probe && mount --bind /dev/null /etc/hosts "
                              "&& hostname"], capture_output=True, text=True, timeout=30)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if uts.returncode != 0 or uts.stdout.strip() != "presto-probe":
        return (f"cannot give a namespace its own hostname and hosts file (unshare --uts "
                f"--mount, mount --bind): {uts.stderr.strip()}")
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise sc.ClusterError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def netns_argv(ns: str) -> list[str]:
    """A command prefix that runs in network namespace ``ns`` and changes nothing else."""
    return ["nsenter", f"--net=/run/netns/{ns}", "--"]


def _netns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split() if p.isdigit()]


@dataclass
class TwoNodeCluster(sc.SlurmCluster):
    """A running two-node cluster (see the module docstring); ``namespaces`` maps head/n1/n2 to
    their network namespace."""

    namespaces: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    made_tag: str = ""       # every namespace it made is named <made_tag>-<h|n1|n2>

    nodes = tuple(NODES)

    @property
    def hosts_file(self) -> Path:
        return self.root / "hosts"

    def node_states(self) -> dict[str, str]:
        return {n: self.node_state(n) for n in self.nodes}

    def daemon_argv(self, where: str, argv: list[str]) -> list[str]:
        """``argv`` run as on host ``where``: its network namespace, its hostname, its hosts."""
        # nsenter, not `ip netns exec`: that remounts /sys, and slurmd needs the cgroup
        # mounts under it. unshare --mount: the hosts file is bound in a private mount
        # namespace, so the host's /etc/hosts never changes.
        return [*netns_argv(self.namespaces[where]), "unshare", "--uts", "--mount", "--",
                "sh", "-c", 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && '
                'exec "$@"', "sh", where, str(self.hosts_file), *argv]

    def start_slurmd(self, node: str, timeout_s: float = sc.START_TIMEOUT_S) -> None:
        """Start ``node``'s slurmd (again) and wait until the node is usable."""
        sc.spawn(self, f"slurmd-{node}", self.daemon_argv(
            node, [sc.which("slurmd"), "-D", "-f", str(self.conf), "-N", node]))
        self._save()
        sc.wait(lambda: sc.node_up(self, node), timeout_s, f"node {node} idle", self)

    def kill_node(self, node: str) -> list[int]:
        """Lose ``node``: SIGKILL every process in its namespace (slurmd, job steps, ranks), at
        once, as a crashed host. Returns the PIDs killed."""
        ns = self.namespaces[node]
        pids = _netns_pids(ns)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for name, pid, _ in self.procs:
            if name == f"slurmd-{node}":
                sc._reap(pid)
        self.procs = [p for p in self.procs if p[0] != f"slurmd-{node}"]
        self._save()
        deadline = time.monotonic() + 10
        while any(sc._start_time(p) is not None and not sc._is_zombie(p)
                  for p in _netns_pids(ns)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return pids

    def processes(self, node: str, needle: str = "") -> list[int]:
        """PIDs of the live processes on ``node`` whose command line contains ``needle``."""
        pids = []
        for pid in _netns_pids(self.namespaces[node]):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if needle.encode() in cmdline and not sc._is_zombie(pid):
                pids.append(pid)
        return pids

    def restart_node(self, node: str, timeout_s: float = sc.START_TIMEOUT_S) -> None:
        """Bring a lost node back: a fresh slurmd; ReturnToService=2 makes it usable again."""
        self.start_slurmd(node, timeout_s)

    # -- state for the command line ----------------------------------------------------------
    def _save(self) -> None:
        (self.root / STATE_FILE).write_text(json.dumps(
            {"procs": self.procs, "namespaces": self.namespaces, "ports": self.ports,
             "made_tag": self.made_tag}, indent=1))

    @classmethod
    def load(cls, root: Path) -> "TwoNodeCluster":
        state = json.loads((root / STATE_FILE).read_text())
        return cls(root, "n1", [tuple(p) for p in state["procs"]], netns=state["namespaces"][HEAD],
                   namespaces=state["namespaces"], ports=state["ports"],
                   made_tag=state["made_tag"])

    # -- teardown ----------------------------------------------------------------------------
    def stop(self, remove: bool = True) -> list[str]:
        """Jobs, steps, daemons (slurm_cluster's way), then anything left in the namespaces,
        then the namespaces (with them the bridge and veth pairs) and the files."""
        notes = super().stop(remove=False) if self.namespaces else []
        for where, ns in self.namespaces.items():
            left = _netns_pids(ns)
            if left:
                notes.append(f"{len(left)} process(es) left in {where}'s namespace: killed")
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("netns", "del", ns, check=False)
        self.namespaces = {}
        notes += sc.remove_stale_mpich_shm(self.started_at)
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)
        _unguard(self)
        return notes

    def leftovers(self) -> list[str]:
        """Namespaces of this cluster, or processes carrying its SLURM_CONF (daemons, job
        steps, ranks), that still exist: empty after `stop`."""
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        listed = {line.split()[0] for line in names.splitlines() if line.strip()}
        tag = f"{self.made_tag}-"
        marker = f"SLURM_CONF={self.conf}".encode()
        procs = []
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit() and marker in (d / "environ").read_bytes().split(b"\0"):
                    procs.append(f"{(d / 'comm').read_text().strip()} (pid {d.name})")
            except OSError:
                continue
        return [ns for ns in sorted(listed) if ns.startswith(tag)] + procs


# -- SIGTERM / atexit guard (as bench/netns.py) ----------------------------------------------

_GUARDED: list[TwoNodeCluster] = []
_OLD_SIGTERM = None


def _sigterm_to_exit(signum, frame):
    raise SystemExit(128 + signum)


def _guard(cluster: TwoNodeCluster) -> None:
    global _OLD_SIGTERM
    _GUARDED.append(cluster)
    atexit.register(cluster.stop)
    if threading.current_thread() is threading.main_thread() and _OLD_SIGTERM is None:
        _OLD_SIGTERM = signal.signal(signal.SIGTERM, _sigterm_to_exit)


def _unguard(cluster: TwoNodeCluster) -> None:
    global _OLD_SIGTERM
    atexit.unregister(cluster.stop)
    if cluster in _GUARDED:
        _GUARDED.remove(cluster)
    if not _GUARDED and _OLD_SIGTERM is not None and \
            threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _OLD_SIGTERM)
        _OLD_SIGTERM = None


# -- start -----------------------------------------------------------------------------------

def _make_network(cluster: TwoNodeCluster) -> None:
    head = cluster.namespaces[HEAD]
    for ns in cluster.namespaces.values():
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
    _ip("-n", head, "link", "add", BRIDGE, "type", "bridge")
    _ip("-n", head, "addr", "add", f"{HEAD_ADDR}/{PREFIX}", "dev", BRIDGE)
    _ip("-n", head, "link", "set", BRIDGE, "up")
    for node, addr in NODES.items():
        ns = cluster.namespaces[node]
        # made inside the namespaces: no name ever exists in the host's namespace
        _ip("link", "add", f"to-{node}", "netns", head, "type", "veth",
            "peer", "name", NODE_IF, "netns", ns)
        _ip("-n", head, "link", "set", f"to-{node}", "master", BRIDGE, "up")
        _ip("-n", ns, "addr", "add", f"{addr}/{PREFIX}", "dev", NODE_IF)
        _ip("-n", ns, "link", "set", NODE_IF, "up")


def start(root: Path, timeout_s: float = sc.START_TIMEOUT_S) -> TwoNodeCluster:
    """Namespaces, network, munged, slurmctld, both slurmd; wait until both nodes are idle.
    On failure everything started so far is removed and ClusterError says why."""
    root = Path(root).resolve()
    tag = f"presto{os.getpid()}"
    spaces = {HEAD: f"{tag}-h", **{n: f"{tag}-{n}" for n in NODES}}
    cluster = TwoNodeCluster(root, "n1", netns=spaces[HEAD], namespaces=spaces,
                             ports={n: sc._free_port() for n in NODES}, made_tag=tag)
    _guard(cluster)
    try:
        root.mkdir(parents=True, exist_ok=True)
        cluster.hosts_file.write_text(
            f"127.0.0.1 localhost\n{HEAD_ADDR} {HEAD}\n"
            + "".join(f"{a} {n}\n" for n, a in NODES.items()))
        sc.write_files(root, HEAD, HEAD_ADDR,
                       [sc.NodeSpec(n, a, cluster.ports[n]) for n, a in NODES.items()],
                       extra=EXTRA_CONF)
        _make_network(cluster)
        sc.start_munged(cluster)
        sc.spawn(cluster, "slurmctld", cluster.daemon_argv(
            HEAD, [sc.which("slurmctld"), "-D", "-i", "-f", str(cluster.conf)]))
        cluster._save()
        sc.wait(lambda: cluster.run("scontrol", "ping").returncode == 0, timeout_s,
                "slurmctld answering `scontrol ping`", cluster)
        for node in NODES:
            cluster.start_slurmd(node, timeout_s)
    except BaseException as e:
        tails = cluster.log_tails()
        cluster.stop(remove=True)
        if isinstance(e, sc.ClusterError):
            raise sc.ClusterError(f"{e}\n{tails}") from None
        raise
    return cluster


# -- pytest fixture ----------------------------------------------------------------------------

try:
    import pytest
except ImportError:
    pytest = None

if pytest is not None:
    @pytest.fixture(scope="module")
    def slurm_two_nodes():
        """A real two-node cluster for one test module (skips with the reason where Slurm or
        network namespaces cannot be had; fails when they can and the cluster does not start).
        """
        yield from sc.cluster_for_tests(start, _why_not, "presto-slurm2-",
                                        "two-node Slurm cluster")


# -- command line ------------------------------------------------------------------------------

def _why_not() -> str | None:
    return unavailable() or sc.ensure_installed()


def _started(cluster: TwoNodeCluster) -> None:
    _unguard(cluster)   # it outlives this command: `stop` removes it
    print(f"export SLURM_CONF={cluster.conf}\n"
          f"# client commands run in the head namespace, e.g.:\n"
          f"ip netns exec {cluster.netns} sinfo")


def main(argv: list[str] | None = None) -> int:
    return sc.command_line(argv, "two-node Slurm cluster", start, TwoNodeCluster.load,
                           _why_not, STATE_FILE, _started)


if __name__ == "__main__":
    sys.exit(main())
