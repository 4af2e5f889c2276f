"""Slow-network test bed: two "hosts" as network namespaces joined by a veth pair whose two
ends are rate-limited by ``tc``; one rank in each, gloo over TCP between their addresses.

    python -m bench.netns --rate-mbit 400 [--delay-ms 1] -- python -m some.rank_script ARGS

runs the command twice, as rank 0 in namespace A (10.77.0.1) and rank 1 in namespace B
(10.77.0.2), with the runtime's torchrun-style environment (RANK, WORLD_SIZE=2, LOCAL_RANK=0,
LOCAL_WORLD_SIZE=1, MASTER_ADDR=10.77.0.1, MASTER_PORT, GLOO_SOCKET_IFNAME=presto0,
PRESTO_MPI=0), and exits with the first non-zero status. From Python: ``with Testbed(400) as
bed: bed.run([...])``.

The link: ``tbf rate R`` on the egress of both veth ends (each direction limited to R; full
duplex, as a switch port), burst max(64 KiB, 10 ms of R); with ``--delay-ms`` a netem delay
qdisc sits in front of the tbf. ``set_rate`` changes R while ranks run.

Owns: making the namespaces, veth pair, addresses and qdiscs; running ranks in them; tearing
all of it down. Never: touches any interface, route or qdisc outside its own namespaces, or
any address other than the namespaces' own (10.77.0.0/24 exists only inside them).

Teardown: ``__exit__`` (also on an exception, Ctrl-C, or SIGTERM, which is turned into
SystemExit while the test bed is up) kills the ranks it started, then deletes both namespaces,
which deletes the veth pair and its qdiscs with them; an atexit hook repeats it if the
process ends some other way. Names carry the creating process id (``presto<pid>a``/``b``), so
concurrent test beds never collide and leftovers say whose they were.

Needs root (CAP_NET_ADMIN) and iproute2 (``ip``, ``tc``). `unavailable()` says why not.
"""
from __future__ import annotations

import argparse
import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

ADDRS = ("10.77.0.1", "10.77.0.2")
IFNAME = "presto0"           # the veth end's name inside each namespace
MASTER_PORT = 29531
ROOT = Path(__file__).resolve().parents[1]


class TestbedError(RuntimeError):
    """The test bed could not be made (the message says what to install or change)."""

    __test__ = False


def _ip(*args: str, ns: Optional[str] = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise TestbedError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")
    return proc


def _tc(ns: str, *args: str) -> None:
    cmd = ["ip", "netns", "exec", ns, "tc", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise TestbedError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")


def unavailable() -> Optional[str]:
    """Why a test bed cannot be made here (None when it can): tools, root, netns support."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: apt-get install iproute2"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    probe = f"presto{os.getpid()}probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not possible here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Testbed:
    """Two namespaces, one veth pair at ``rate_mbit`` each way (None: unlimited)."""

    __test__ = False  # not a pytest test class

    def __init__(self, rate_mbit: Optional[float], delay_ms: float = 0.0):
        self.rate_mbit = rate_mbit
        self.delay_ms = delay_ms
        tag = f"presto{os.getpid()}"
        self.namespaces = (f"{tag}a", f"{tag}b")
        self._veth = (f"pv{os.getpid()}a", f"pv{os.getpid()}b")
        self._procs: list[subprocess.Popen] = []
        self._up = False
        self._old_sigterm = None

    # ---- set-up and teardown --------------------------------------------------------------
    def __enter__(self) -> "Testbed":
        why = unavailable()
        if why:
            raise TestbedError(why)
        atexit.register(self.teardown)
        if hasattr(signal, "SIGTERM") and _main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, _sigterm_to_exit)
        self._up = True
        try:
            self._create()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def _create(self) -> None:
        a, b = self.namespaces
        for ns in self.namespaces:
            _ip("netns", "add", ns)
        _ip("link", "add", self._veth[0], "type", "veth", "peer", "name", self._veth[1])
        for ns, dev, addr in zip(self.namespaces, self._veth, ADDRS):
            _ip("link", "set", dev, "netns", ns)
            _ip("link", "set", dev, "name", IFNAME, ns=ns)
            _ip("addr", "add", f"{addr}/24", "dev", IFNAME, ns=ns)
            _ip("link", "set", IFNAME, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
        self.set_rate(self.rate_mbit, first=True)

    def set_rate(self, rate_mbit: Optional[float], first: bool = False) -> None:
        """(Re)shape both directions to ``rate_mbit`` (None: no limit)."""
        for ns in self.namespaces:
            if not first:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", IFNAME,
                                "root"], capture_output=True, timeout=30)
            parent = ["root"]
            if self.delay_ms > 0:
                _tc(ns, "qdisc", "add", "dev", IFNAME, "root", "handle", "1:", "netem", "delay",
                    f"{self.delay_ms}ms")
                parent = ["parent", "1:"]
            if rate_mbit:
                burst = max(64 * 1024, int(rate_mbit * 1e6 / 8 * 0.010))
                _tc(ns, "qdisc", "add", "dev", IFNAME, *parent, "handle", "2:", "tbf", "rate",
                    f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms")
        self.rate_mbit = rate_mbit

    def teardown(self) -> None:
        """Kill the ranks we started, delete both namespaces (and with them the veth pair)."""
        if not self._up:
            return
        self._up = False
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=30)
        self._procs = []
        for ns in self.namespaces:
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self._veth[0], check=False)  # only if never moved into a namespace
        if self._old_sigterm is not None and _main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
        atexit.unregister(self.teardown)

    def leftovers(self) -> list[str]:
        """Namespaces or links of this test bed that still exist (empty after teardown)."""
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        return ([ns for ns in self.namespaces if ns in names.split()]
                + [dev for dev in self._veth if f" {dev}@" in links or f" {dev}:" in links])

    # ---- ranks ----------------------------------------------------------------------------
    def rank_env(self, rank: int, extra: Optional[dict] = None) -> dict:
        env = {k: v for k, v in os.environ.items() if not _launcher_var(k)}
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   GROUP_RANK=str(rank), MASTER_ADDR=ADDRS[0], MASTER_PORT=str(MASTER_PORT),
                   GLOO_SOCKET_IFNAME=IFNAME, PRESTO_MPI="0", OMP_NUM_THREADS="1",
                   PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        env.update(extra or {})
        return env

    def run(self, cmd: Sequence[str], env: Optional[dict] = None,
            timeout: float = 600) -> list[subprocess.CompletedProcess]:
        """Run ``cmd`` on both ranks to the end, output captured (in files: a chatty rank never
        blocks on a full pipe). A rank that fails or outlives ``timeout`` takes the other down."""
        with tempfile.TemporaryDirectory(prefix="presto-netns-") as tmp:
            files = [(open(Path(tmp) / f"out{r}", "w+"), open(Path(tmp) / f"err{r}", "w+"))
                     for r in range(2)]
            procs = []
            for rank, ns in enumerate(self.namespaces):
                proc = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], cwd=ROOT,
                                        env=self.rank_env(rank, env), start_new_session=True,
                                        stdout=files[rank][0], stderr=files[rank][1], text=True)
                self._procs.append(proc)
                procs.append(proc)
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs):
                if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    for p in procs:
                        if p.poll() is None:
                            os.killpg(p.pid, signal.SIGKILL)
                    break
                time.sleep(0.1)
            out = []
            for p, (fo, fe) in zip(procs, files):
                p.wait()
                fo.seek(0), fe.seek(0)
                out.append(subprocess.CompletedProcess(p.args, p.returncode, fo.read(), fe.read()))
                fo.close(), fe.close()
        return out


def _launcher_var(name: str) -> bool:
    return name.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_", "HYDRA_", "MPI_LOCAL",
                            "TORCHELASTIC_")) or name in ("RANK", "LOCAL_RANK", "WORLD_SIZE",
                                                          "LOCAL_WORLD_SIZE", "GROUP_RANK")


def _main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def _sigterm_to_exit(signum, frame):
    raise SystemExit(128 + signum)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.netns", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate-mbit", type=float, default=None, help="link rate each way (default: "
                    "unlimited)")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay (netem)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds before both ranks are killed")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command to run as each rank")
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("give the rank command after --")
    try:
        with Testbed(args.rate_mbit, args.delay_ms) as bed:
            results = bed.run(cmd, timeout=args.timeout)
    except TestbedError as e:
        print(f"bench.netns: {e}", file=sys.stderr)
        return 2
    for rank, r in enumerate(results):
        for stream, text in ((sys.stdout, r.stdout), (sys.stderr, r.stderr)):
            for line in text.splitlines():
                print(f"[rank {rank}] {line}", file=stream)
    return next((r.returncode for r in results if r.returncode != 0), 0)


if __name__ == "__main__":
    sys.exit(main())
