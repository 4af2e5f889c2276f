"""runtime.observe.hostsync: the simulated device sees each kind of CUDA host sync and wrong-device
tensor where it happens (file and line), and nothing in code that has none; runtime.observe.clock's
host marks."""
from __future__ import annotations

import torch
import torch.distributed as torch_dist

from runtime.observe.clock import DeviceClock, Later
from runtime.observe.hostsync import SIM_DEVICE, HostSyncs, is_sync_warning

DEV = SIM_DEVICE


def kinds(syncs: HostSyncs) -> list[tuple[str, str]]:
    return [(e.kind, e.op) for e in syncs.events]


def test_each_kind_is_seen_at_its_line():
    with HostSyncs(DEV) as syncs:
        x = torch.arange(6.0, device=DEV)  # tensors are tagged where the context sees them made
        x.sum().item()                                   # read
        (x > 2).nonzero()                                # shape
        x[x > 2]                                         # shape: boolean mask
        torch.unique_consecutive(x)                      # shape
        torch.repeat_interleave(torch.ones(3, dtype=torch.long, device=DEV))  # shape
        torch.tensor(3, device=DEV)                      # h2d
        torch.ones(3).to(DEV)                            # h2d: blocking copy
        x.cpu()                                          # d2h
        x + torch.arange(6.0)                            # wrong_device
    got = kinds(syncs)
    assert [k for k, _ in got] == ["read", "shape", "shape", "shape", "shape", "h2d", "h2d",
                                   "d2h", "wrong_device"], got
    assert all(e.where.startswith("tests/unit/test_hostsync.py:") for e in syncs.events)
    lines = [int(e.where.split(":")[1].split()[0]) for e in syncs.events]
    assert lines == sorted(lines) and len(set(lines)) == len(lines)  # one line each


def test_code_without_syncs_records_nothing():
    with HostSyncs(DEV) as syncs:
        x = torch.arange(6.0, device=DEV)
        y = torch.zeros(3, device=x.device) + x[:3]     # .device keeps the device
        mask = x > 2
        idx = torch.nonzero_static(mask, size=6, fill_value=0)  # fixed size: no sync
        lengths = torch.full((3,), 2, dtype=torch.long, device=DEV)
        torch.repeat_interleave(torch.arange(3, device=DEV), lengths, output_size=6)
        torch.ones(3).to(DEV, non_blocking=True)        # a (pinned) asynchronous copy
        (x * 2).index_select(0, idx.squeeze(1))
        torch.where(mask, x, torch.zeros_like(x))
    assert syncs.events == [], syncs.report()
    assert y.device == torch.device("cpu")  # outside the context: an ordinary CPU tensor
    with HostSyncs(DEV):
        assert y.device == SIM_DEVICE


def test_a_host_tensor_in_a_collective_is_the_nccl_crash(single_ctx):
    with HostSyncs(DEV) as syncs:
        torch_dist.all_reduce(torch.ones(2))             # made without device=: host
        torch_dist.all_reduce(torch.ones(2, device=DEV))
    assert kinds(syncs) == [("wrong_device", "torch.distributed.all_reduce of a host tensor")]
    assert torch_dist.all_reduce.__name__ == "all_reduce"  # unwrapped again


def test_allowed_lines_and_plain_cpu():
    with HostSyncs(DEV, allow=["test_hostsync.py"]) as syncs:
        torch.ones(3, device=DEV).sum().item()
    assert syncs.events == [] and len(syncs.allowed) == 1
    with HostSyncs("cpu") as plain:  # no device to wait for: nothing to record
        torch.ones(3).sum().item()
    assert plain.events == [] and not plain.simulated


def test_host_clock_marks_and_callback_stamps():
    clock = DeviceClock("cpu")
    a = clock.now()
    later = Later()
    assert clock.seconds(a, later) is None  # not happened yet
    later.stamp()
    later_t = later.t
    later.stamp()                            # a second callback changes nothing
    assert later.t == later_t and clock.seconds(a, later) >= 0
    assert clock.seconds(a, clock.now()) >= 0


def test_torchs_prototype_notice_is_not_a_sync():
    """The first set_sync_debug_mode of a process warns once that the mode is a prototype; the
    first H100 run counted that notice as a sync in whichever CUDA test came first."""
    assert is_sync_warning("called a synchronizing CUDA operation (Triggered internally at "
                           "c10/cuda/CUDAFunctions.cpp:152.)")
    assert not is_sync_warning("Synchronization debug mode is a prototype feature and does not "
                               "detect all synchronizing operations")
