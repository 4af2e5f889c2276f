"""The sharded optimizer's side of the gradient sync (``optim.shard``, a sharded scope of
runtime.choices.SHARD_SCOPES: which ranks share one update is the row's): which
rows of the flat buffers each rank updates, and the collectives that get the averaged
gradient to them and the updated parameters back to everyone.

Owns:
  * `Shard`: the flat gradient buffer (runtime.grad_sync.plan.GradLayout: every tensor on a
    row of 1024 elements), zero-padded to ``size`` equal shards of whole rows; shard j is the
    element range [j·S, (j+1)·S). A tensor may be split between two shards (or more, if it
    is larger than a shard): the fused optimizer's per-tensor norms then come from partial
    sums (kernels.optim_flat), summed over the group by `sum_` - one small collective of a
    [#tensors]-long vector per step;
  * how a bucket reaches the shards' owners, one row per backend (``REDUCTION``):
      - 'reduce' (NCCL): each piece of bucket [lo, hi) that falls in shard j is reduced to
        shard j's owner (``torch.distributed.reduce``, in place, asynchronous, launched from
        the bucket engine's hooks exactly where the allreduce was). Summed over the buckets
        that is a reduce-scatter of the buffer: half an allreduce's traffic. Not
        ``reduce_scatter_tensor``: a bucket's pieces are unequal (most buckets lie in one
        shard), and PyTorch's NCCL backend runs an uneven reduce-scatter as the same reduces.
        With several node groups (``optim.shard = node`` over several nodes) the owner's
        piece is then all-reduced with the owners of the same shard in the other nodes
        (`launch_across`): a hierarchical allreduce without its final all-gather;
      - 'allreduce' (gloo): the bucket all-reduced as without sharding, each rank keeping its
        shard. gloo has reduce and reduce_scatter, but on this machine (torch 2.13, 2 ranks,
        docs/BENCHMARKS.md) neither was faster than its allreduce (reduce_scatter 2-3x
        slower), and its reduce adds in another order than its allreduce: with 4 ranks the
        sharded run would differ from the unsharded one by rounding, which Adam's m/√v
        amplifies on parameters whose gradient is rounding noise. With the allreduce a CPU
        run is the unsharded one bit for bit at any world size. The 'reduce' row runs on gloo
        too (tests/ranks/test_shard.py sets it);
  * the parameters' all-gather after the step (`gather`): every rank keeps the whole model
    (the forward needs it), each updates its shard, then NCCL ``all_gather_into_tensor`` in
    place, gloo one broadcast per shard (gloo's all-gather measured slower than its broadcasts
    here). CPU ranks of one host (``shared``) need no gather at all: the parameter buffer is
    one shared-memory mapping that every rank of the group writes its shard into
    (`alloc_params`), and the gather is a barrier - through gloo's loopback TCP the broadcasts
    cost more than the update they follow (docs/BENCHMARKS.md).
Never: steps the optimizer (runtime.optim's fused backend does, on ``[lo, hi)``), decides
buckets, clips, or reads a device value back to the host (every collective here is fixed in
size by the layout, so a sharded step is capturable).
"""
from __future__ import annotations

import os
import uuid
from typing import Any, Optional

import torch
import torch.distributed as torch_dist

from runtime.launch.dist import BlockGroups

REDUCTION = {"nccl": "reduce", "gloo": "allreduce"}
"""How a bucket's gradient reaches the shards' owners, per backend (module docstring)."""


class Shard:
    """This rank's shard of a flat buffer of ``total`` elements (see the module docstring).

    ``groups``: the ranks that share one copy of the model's update (runtime.launch.dist.
    block_groups: the node, or the world); ``backend``: 'nccl' | 'gloo' (how the parameters
    are gathered); ``align``: elements per row (shards are whole rows)."""

    def __init__(self, total: int, groups: BlockGroups, *, backend: str = "gloo",
                 align: int = 1024, shared: bool = False):
        self.groups = groups
        self.size, self.index = groups.size, groups.index
        self.align = align
        rows = -(-total // align)
        self.rows = -(-rows // self.size)            # rows per shard
        self.elements = self.rows * align           # S
        self.padded_total = self.elements * self.size
        self.total = total
        self.lo, self.hi = self.index * self.elements, (self.index + 1) * self.elements
        self.backend = backend
        self.reduction = REDUCTION[backend]
        if self.reduction not in ("reduce", "allreduce"):
            raise ValueError(f"shard: reduction {self.reduction!r} for {backend} must be "
                             f"reduce | allreduce")
        self.first_copy = groups.block == 0         # writes this shard into a checkpoint
        # CPU ranks of one host: the parameters in one shared-memory buffer (alloc_params)
        self.shared = shared and backend == "gloo" and self.size > 1
        self.shared_note = ""
        self._shared_ptr: Optional[int] = None
        self._token: Optional[torch.Tensor] = None

    @property
    def window(self) -> tuple[int, int]:
        return self.lo, self.hi

    @property
    def reduces(self) -> bool:
        """Whether buckets go to their owners by reduce (else: allreduced, shard kept)."""
        return self.reduction == "reduce"

    def describe(self) -> dict:
        g = self.groups
        return {"shards": self.size, "shard_elements": self.elements, "copies": g.blocks,
                "padding_elements": self.padded_total - self.total,
                "gradient_reduction": (
                    "reduce of each bucket's pieces to their shard's owner"
                    + (f", then an allreduce of the shard across the {g.blocks} node groups"
                       if g.cross is not None else "")
                    if self.reduction == "reduce" else
                    f"allreduce of each bucket, each rank keeping its shard ({self.backend}: "
                    f"its reduce and reduce_scatter are no faster, and sum in another order)"),
                "parameter_gather": (
                    "none: the group's ranks share one parameter buffer (shared memory, one "
                    "host); a barrier after the step" if self._shared_ptr is not None else
                    "all_gather_into_tensor" if self.backend == "nccl" else
                    "one broadcast per shard (gloo)" + (f"; {self.shared_note}"
                                                       if self.shared_note else ""))}

    # ---- the gradient ---------------------------------------------------------------------
    def pieces(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        """(shard, a, b): the non-empty parts [a, b) of [lo, hi) in each shard."""
        out = []
        first, last = lo // self.elements, (hi - 1) // self.elements
        for j in range(first, min(last, self.size - 1) + 1):
            a, b = max(lo, j * self.elements), min(hi, (j + 1) * self.elements)
            if b > a:
                out.append((j, a, b))
        return out

    def owned(self, lo: int, hi: int) -> Optional[tuple[int, int]]:
        """The part of [lo, hi) in this rank's shard, or None."""
        a, b = max(lo, self.lo), min(hi, self.hi)
        return (a, b) if b > a else None

    def launch(self, comm: torch.Tensor, lo: int) -> list[Any]:
        """Reduce bucket ``comm`` (the buffer's elements [lo, lo + len)) to the owners of
        the shards it overlaps, in place, asynchronously; returns the works (none in a group
        of one). Afterwards only this rank's own part of ``comm`` is meaningful."""
        if self.size == 1:
            return []
        works = []
        for j, a, b in self.pieces(lo, lo + comm.numel()):
            works.append(torch_dist.reduce(comm[a - lo:b - lo], group_dst=j,
                                           op=torch_dist.ReduceOp.SUM,
                                           group=self.groups.group, async_op=True))
        return works

    def launch_across(self, comm: torch.Tensor, lo: int) -> Any:
        """After the reduce inside the node group: the owned part of ``comm`` all-reduced
        with the same shard's owners in the other node groups (None: nothing to do)."""
        if self.groups.cross is None:
            return None
        part = self.owned(lo, lo + comm.numel())
        if part is None:
            return None
        a, b = part
        return torch_dist.all_reduce(comm[a - lo:b - lo], op=torch_dist.ReduceOp.SUM,
                                     group=self.groups.cross, async_op=True)

    # ---- small sums and the parameters ------------------------------------------------------
    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` (partial norms of this rank's shard) over the shard group, in place."""
        if self.size > 1:
            torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM, group=self.groups.group)
        return t

    def alloc_params(self, numel: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The parameter buffer in shared memory, mapped by every rank of the group (a
        collective), zero-filled; None when the parameters are not shared (or /dev/shm has no
        room: then the broadcasts, and ``describe`` says why). The file is unlinked once every
        rank has mapped it: nothing is left behind, whatever ends the job."""
        if not self.shared:
            return None
        group = self.groups.group
        box: list = [None]
        if self.index == 0:
            path = f"/dev/shm/presto-shard-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:  # reserve the pages now: ENOSPC here, not SIGBUS at the first write
                    os.posix_fallocate(fd, 0, numel * dtype.itemsize)
                finally:
                    os.close(fd)
                box[0] = ("ok", path)
            except OSError as e:
                if os.path.exists(path):
                    os.unlink(path)
                box[0] = ("no", f"no shared memory for the parameters ({e.strerror}: "
                                f"{numel * dtype.itemsize:,} bytes in /dev/shm)")
        torch_dist.broadcast_object_list(box, group_src=0, group=group)
        status, what = box[0]
        if status != "ok":
            self.shared, self.shared_note = False, what
            return None
        buf = torch.from_file(what, shared=True, size=numel, dtype=dtype)
        self._token = torch.zeros(1)
        torch_dist.all_reduce(self._token, group=group)  # every rank has mapped it
        if self.index == 0:
            os.unlink(what)
        self._shared_ptr = buf.data_ptr()
        return buf

    def gather(self, buf: torch.Tensor) -> None:
        """``buf`` (``padded_total`` elements, this rank's shard up to date) made whole on
        every rank of the group: each shard from its owner, in place; the shared parameter
        buffer (`alloc_params`) only waits for every rank's shard to be written."""
        if self.size == 1:
            return
        if self._shared_ptr is not None and buf.data_ptr() == self._shared_ptr:
            torch_dist.all_reduce(self._token, group=self.groups.group)
            return
        if buf.numel() != self.padded_total:
            raise ValueError(f"shard gather: a buffer of {buf.numel()} elements, the shards "
                             f"make {self.padded_total}")
        if self.backend == "nccl":
            gather = getattr(torch_dist, "all_gather_single", None) or \
                torch_dist.all_gather_into_tensor
            gather(buf, buf[self.lo:self.hi], group=self.groups.group)
            return
        for j in range(self.size):
            torch_dist.broadcast(buf[j * self.elements:(j + 1) * self.elements],
                                 group_src=j, group=self.groups.group)
