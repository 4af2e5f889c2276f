"""Where the ranks meet to form the process group, by ``LaunchInfo.rendezvous``.

Owns, for runtime.launch.dist.init_distributed (which joins the group on what this gives):
  "mpi"   rank 0 opens a TCPStore on port 0 (the OS picks a free port and keeps it bound, so two
          jobs on one machine never collide and there is no pick-then-bind race) on 127.0.0.1
          when every rank shares its hostname, else on its routable address (or MASTER_ADDR),
          and sends (address, port) to the others with ``MPI.COMM_WORLD.bcast``.
  "tcp"   ``tcp://MASTER_ADDR:MASTER_PORT`` (torchrun's agent store, or srun's first node).
  "file"  a FileStore in the launcher's per-job directory (Open MPI on one node, no mpi4py).
  "local" a world of one on an in-memory HashStore: no port.
Also owns ``DistError``, the error of joining the ranks: the meeting is the first half of the
join, so the error lives here, below runtime.launch.dist, which raises it too and re-exports it.
Never: reads the environment (the values arrive in a ``LaunchInfo``) or joins the group.
"""
from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

import torch.distributed as torch_dist

from runtime.launch.env import LaunchInfo


class DistError(RuntimeError):
    """Joining the ranks failed, or the ranks disagree."""


def meeting_point(info: LaunchInfo, timeout: timedelta) -> dict[str, Any]:
    """``init_process_group``'s keyword arguments that say where the ranks meet: a ``store``
    (kept alive by the caller: rank 0's TCPStore serves the others) or an ``init_method``."""
    if info.rendezvous == "local":
        if info.world_size != 1:
            raise DistError(f"rendezvous 'local' needs a world of 1, not {info.world_size}")
        return {"store": torch_dist.HashStore()}
    if info.rendezvous == "mpi":
        return {"store": _mpi_store(info, timeout)}
    if info.rendezvous == "file":
        store = torch_dist.FileStore(info.store_path, info.world_size)
        store.set_timeout(timeout)
        return {"store": store}
    if info.rendezvous == "tcp":
        host = f"[{info.master_addr}]" if ":" in info.master_addr else info.master_addr
        return {"init_method": f"tcp://{host}:{info.master_port}"}
    raise DistError(f"unknown rendezvous {info.rendezvous!r}")


def _mpi_store(info: LaunchInfo, timeout: timedelta) -> Any:
    """Rank 0 opens a TCPStore on a free port and sends (addr, port) over MPI."""
    from mpi4py import MPI  # initialised by runtime.launch.env.discover

    comm = MPI.COMM_WORLD
    hosts = comm.allgather(socket.gethostname())
    message: tuple = ("error", "rank 0 did not answer", None)
    store = None
    if info.rank == 0:
        try:
            if info.master_addr:
                addr = info.master_addr
            elif len(set(hosts)) == 1:
                addr = "127.0.0.1"  # one host: loopback needs no name resolution at all
            else:
                addr = routable_address([h for h in hosts if h != hosts[0]])
            store = torch_dist.TCPStore(addr, 0, info.world_size, is_master=True,
                                        timeout=timeout, wait_for_workers=False)
            message = ("ok", addr, store.port)
        except Exception as e:  # tell the others instead of leaving them in bcast
            message = ("error", f"{type(e).__name__}: {e}", None)
    status, addr, port = comm.bcast(message, root=0)
    if status != "ok":
        raise DistError(f"rank {info.rank}: rank 0 could not open the rendezvous store: {addr}")
    if info.rank != 0:
        store = torch_dist.TCPStore(addr, port, info.world_size, is_master=False, timeout=timeout)
    return store


def routable_address(peer_hosts: list[str]) -> str:
    """This host's IPv4 address that other hosts can reach (not a loopback one)."""
    name = socket.gethostname()
    try:
        for *_, sockaddr in socket.getaddrinfo(socket.getfqdn(name), None, socket.AF_INET,
                                                socket.SOCK_STREAM):
            if not sockaddr[0].startswith("127."):
                return sockaddr[0]
    except OSError:
        pass
    # The hostname maps to loopback (Debian's 127.0.1.1): ask the kernel which source address
    # it would use towards a peer. A UDP connect sends nothing.
    for peer in peer_hosts:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((socket.gethostbyname(peer), 9))
                addr = s.getsockname()[0]
            if not addr.startswith("127."):
                return addr
        except OSError:
            continue
    raise DistError(f"cannot find an address of {name} that other hosts can reach; "
                    f"set MASTER_ADDR to rank 0's address")
