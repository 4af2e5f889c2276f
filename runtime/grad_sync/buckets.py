"""The bucket engine: the runtime's data-parallel gradient sync (``train.grad_sync = "buckets"``).

Owns:
  * the flat gradient buffer, laid out by a `GradLayout` of the plan: outside a step's
    backward every ``param.grad`` is a view into it (each parameter on a row of 1024 elements,
    as the fused optimizer's buffers, so that optimizer steps on this very buffer - one owner
    of gradient memory) and every bucket is a contiguous slice of it;
  * how gradients reach it: during a step the ``.grad`` are unset, so autograd's
    AccumulateGrad keeps each gradient where the backward made it (PyTorch "steals" a fresh
    gradient: no kernel), and when a bucket's last gradient of the micro-step has arrived
    they are added into the bucket in one ``torch._foreach_add_`` (one multi-tensor kernel on
    CUDA for up to 448 tensors) - not one ``add_`` per parameter into its view, ~12 kernels a
    BERT layer. A bucket's first gradients of a step are copied, not added: where every
    gradient of the bucket arrived, one ``torch._foreach_copy_`` writes them and zeros the
    bucket's padding rows in the same launch (no memset of the buffer after each step, one
    read fewer: 2 bytes an element less traffic a step for bf16 gradients); where one did not,
    the bucket is zeroed and the rest added; a bucket no gradient reached all step is zeroed
    at ``finish``. The values are those of accumulating into zeroed views (0 + g, then + g of
    each later micro-step, in the same order; a copied -0 stays -0 where 0 + -0 gave +0), the
    extra memory at most the gradients of the buckets not yet complete; each micro-step's
    gradients are in the buffer before the next one starts, so a backward that hands out
    gradients in memory it rewrites later (the encoder CUDA graphs' static outputs) stays
    correct. ``finish`` points the ``.grad`` back at their views; after ``zero_grad`` they
    still hold the last step's gradient (with ``optim.lamb_update = "stored"``, the update
    LAMB wrote over it) until the next step's first copy (nothing reads them in between: the
    optimizer has stepped);
  * the post-accumulate-grad hooks that launch each bucket's asynchronous allreduce
    (``async_op=True`` on the gloo/NCCL group) as soon as its last gradient is produced,
    strictly in bucket order, while backward goes on; with gradient accumulation only the
    last micro-step launches anything (the others run under ``no_sync()``);
  * the clip modes that act before the allreduce: ``bucket_before`` (each rank scales each
    bucket b to norm ≤ τ/√K by its own norm ‖g_r,b‖ just before launching it - Samsung) and
    ``local_before`` (each rank scales its whole gradient to norm ≤ τ by ‖g_r‖; that norm
    needs every gradient, so nothing is launched before backward ends - no overlap, by
    construction). Coefficients come from ``kernels.optim_reference.clip_coefficient_of_norm``,
    the one clip formula; ``global_after`` and ``none`` only average here;
  * with a sharded optimizer (``optim.shard``, runtime.grad_sync.shard): on NCCL each bucket
    is reduced to the ranks whose shards it overlaps instead of all-reduced (launched from
    the same hooks, at the same moments: the overlap and every clip mode stay as they are;
    on gloo it is all-reduced as before: ``shard.REDUCTION``), the buffer is zero-padded to
    equal shards, the optimizer is told its shard with the layout, and ``grad_norm`` is the
    averaged gradient's norm from the shards' sums of squares (one small allreduce). After
    ``finish`` only this rank's shard of the buffer is sure to hold the averaged gradient;
    with the reduce the rest is this rank's own (scaled) gradient or what the reduce left;
  * the first-step re-cut: a size-cap plan follows reverse registration order (DDP's guess)
    until the hooks have seen when gradients really arrive; at the end of the first step it
    is cut again in the production order (``plan.production_order``: parameters sorted by
    their ready time in that step, the slowest rank's - an allreduce starts when its last
    rank issues it; ties in rank 0's arrival order; the same rule the tuner applies to its
    medians over several steps), once, one plan on every rank, and the layout listeners (the
    fused optimizer) re-bind to the new buffer. A plan file is never reordered; this rank's
    arrival order and times are kept in ``measured_order`` / ``measured_ready_s``.
Never: steps the optimizer or applies the ``global_after`` coefficient (runtime.optim.grad_scale
folds it into the optimizer's multiplier), reads a tensor back to the host in a step, reads
the launcher's environment, picks sizes (the config or the tuner's plan does), or has a
switch of its own to stop communicating: a sync that averages nothing and launches nothing is
built as a world of one (``runtime.train.build.build_parts(communicate=False)``, the tuner's
and bench.overlap's), the one off-switch.

The averaged gradient each mode leaves in the buffer (g_r: rank r's gradient, P ranks):
  global_after, none   (1/P) Σ_r g_r
  local_before         (1/P) Σ_r min(1, τ/‖g_r‖) g_r
  bucket_before        per bucket b of K: (1/P) Σ_r min(1, (τ/√K)/‖g_r,b‖) g_r,b
Each rank pre-divides by P (and multiplies by its coefficient) in one pass before the sum.
Norms are per-row fp32 sums (``kernels.optim_reference.row_norms``), unscaled by the fp16
loss scale.

Ranks must agree: the plan's digest is compared across ranks when the buckets are built and
after the re-cut; a plan that differs between ranks stops every rank with a clear error
instead of mismatched collectives that would hang.

Unused parameters (no gradient in a step) leave their bucket pending; it and every bucket
after it are launched by `finish` after backward, with zeros for the missing gradient -
correct, but the overlap after that bucket is lost. BERT pre-training uses every parameter.

Precision: the allreduce runs in ``reduce_dtype``; when that differs from the gradients'
dtype the (scaled) bucket is cast once into a communication buffer and copied back after
the wait.

Why not DDP's comm hooks: a hook (``register_comm_hook``) sees DDP's own buckets, which never
split a parameter, cannot follow an explicit plan, are rebuilt after the first iteration (so
K - and τ/√K - changes under the hook), and cannot hold every launch until the local norm is
known (local_before). One runtime path serves every mode and plan instead;
``train.grad_sync = "ddp"`` (runtime.grad_sync.ddp) keeps plain DDP for comparison.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Optional, get_args

import torch
import torch.distributed as torch_dist

from kernels.optim_reference import ROW, norm_of_rows, row_norms
from runtime.choices import AFTER_MODES, ClipMode, clip_spec
from runtime.grad_sync.clip import policy_for
from runtime.launch.dist import all_reduce_max, broadcast_object, check_same_on_all_ranks
from runtime.grad_sync.plan import BucketPlan, GradLayout, alone_bucket, production_order
from runtime.grad_sync.shard import Shard
from runtime.grad_sync.protocol import SyncReport

CLIP_MODES = get_args(ClipMode)

#: Elements each parameter's gradient is aligned to in the flat buffer: the fused optimizer's
#: rows (kernels.optim_flat), so the optimizer can step on this buffer. The tuner's simulator
#: uses it too (bucket bytes include the padding).
GRAD_ALIGN = ROW


def slice_norm(flat: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """‖flat[lo:hi]‖ (0-dim fp32, no host sync): per-row norms of the whole rows inside the
    slice, the partial rows at its ends on their own."""
    a, b = -(-lo // ROW) * ROW, hi // ROW * ROW
    if a >= b:
        return norm_of_rows(row_norms(flat[lo:hi]))
    parts = [row_norms(flat[a:b])]
    for x, y in ((lo, a), (b, hi)):
        if y > x:
            parts.append(row_norms(flat[x:y]))
    return norm_of_rows(torch.cat(parts) if len(parts) > 1 else parts[0])


class GradientBuckets:
    """The runtime's gradient path for one model; see the module docstring.

    Per step: ``begin_step(loss_scale)`` → forward/backward (micro-steps but the last under
    ``no_sync()``; hooks launch buckets) → ``finish()`` (launches what is left, waits, returns
    a `SyncReport`) → ``grad_norm()`` → optimizer step → ``zero_grad()``.
    ``module`` is what the step calls (the model itself).
    """

    def __init__(self, model: torch.nn.Module, plan: BucketPlan, *, world_size: int,
                 group: Any = None, clip_mode: str = "global_after", max_grad_norm: float = 1.0,
                 reduce_dtype: Optional[torch.dtype] = None, cap_elements: Optional[int] = None,
                 timeline: Any = None, tied: Any = None, align: int = GRAD_ALIGN,
                 shard_groups: Any = None, backend: str = "gloo", shared_params: bool = False):
        self.clip = clip_spec(clip_mode)  # refuses an unknown mode
        self.policy = policy_for(self.clip, max_grad_norm)  # how the mode acts (clip.py)
        self.module = model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = dict(named)
        self.sizes = {n: p.numel() for n, p in named}
        dtypes = {p.dtype for p in self.params.values()}
        devices = {p.device for p in self.params.values()}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"gradient buckets need one dtype and device for every parameter, "
                             f"found {sorted(map(str, dtypes))} on {sorted(map(str, devices))}; "
                             f"use train.grad_sync='ddp'")
        self.dtype, self.device = dtypes.pop(), devices.pop()
        self.world_size = world_size
        self.group = group
        self.clip_mode = clip_mode
        self.max_grad_norm = max_grad_norm
        self.reduce_dtype = reduce_dtype or self.dtype
        self.timeline = timeline
        self.align = align
        self.measured_order: list[str] = []  # first step's gradient arrival order
        self.measured_ready_s: dict[str, float] = {}  # ... and times since begin_step
        self._step_t0 = 0.0
        self._measured: set[int] = set()
        self._cap_elements = cap_elements  # set: the plan may be re-cut in measured order
        self._measuring = True
        self._armed = False
        self._sync = True
        self._listeners: list[Callable[[torch.Tensor, list], None]] = []
        self._names = {id(p): n for n, p in self.params.items()}
        self.tied = tied  # a TiedEmbeddingSplit (tied_embedding_sync split) or None
        self._tied_name = self._names[id(tied.param)] if tied is not None else None
        if tied is not None and self.clip.before_allreduce:
            raise ValueError(f"tied_embedding_sync split needs clip_mode {AFTER_MODES}, "
                             f"got {clip_mode!r}")
        # optim.shard: the ranks that share one update (runtime.launch.dist.block_groups)
        self._shard_groups, self._backend = shard_groups, backend
        self._shared_params = shared_params  # one host's CPU ranks: parameters in shared memory
        self.shard: Optional[Shard] = None
        self.layout_version = 0  # +1 whenever the buffer is laid out (again)
        self._install(plan)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                         for p in self.params.values()]

    # ---- layout -------------------------------------------------------------------------
    def _install(self, plan: BucketPlan) -> None:
        plan.validate(self.sizes)
        check_same_on_all_ranks("bucket plan (train.bucket_plan / train.bucket_cap_mb)",
                                plan.digest())
        self.plan = plan
        self.layout = GradLayout.of(plan, self.sizes, self.align)
        self.bounds = list(self.layout.bounds)
        members = [{p.name for p in bucket} for bucket in plan.buckets]
        self._bucket_sizes = [len(m) for m in members]
        self._buckets_of = {id(self.params[n]): [b for b, m in enumerate(members) if n in m]
                            for n in self.params}
        self._n_buckets_of = {n: len(self._buckets_of[id(p)]) for n, p in self.params.items()}
        total = self.layout.total
        if self._shard_groups is not None:
            self.shard = Shard(total, self._shard_groups, backend=self._backend,
                               align=self.align, shared=self._shared_params)
            total = self.shard.padded_total  # a zero tail: equal shards of whole rows
        self.flat = torch.zeros(total, dtype=self.dtype, device=self.device)
        self._views = {n: self._view(n) for n in self.params}  # each .grad outside a step
        offsets = self.layout.offsets
        self._parts = []  # per bucket: (name, its part of the bucket, where that lies in name)
        gaps = []  # per bucket: its [a, b) that no parameter fills (the rows' padding)
        for m, (lo, hi) in zip(members, self.layout.bounds):
            parts, at, free = [], lo, []
            for n in sorted(m, key=offsets.get):
                a, b = max(lo, offsets[n]), min(hi, offsets[n] + self.sizes[n])
                parts.append((n, self.flat[a:b], a - offsets[n], b - offsets[n]))
                if a > at:
                    free.append((at, a))
                at = b
            if hi > at:
                free.append((at, hi))
            self._parts.append(parts)
            gaps.append(free)
        # a bucket's first copy of a step zeros its padding in the same launch, from here
        zeros = torch.zeros(max((b - a for g in gaps for a, b in g), default=0),
                            dtype=self.dtype, device=self.device)
        self._gaps = [([self.flat[a:b] for a, b in g], [zeros[:b - a] for a, b in g])
                      for g in gaps]
        self._sparse_k = (alone_bucket(plan, self._tied_name, self.sizes[self._tied_name])
                          if self.tied is not None else None)
        if self.tied is not None:
            self.tied.lane, self.tied.lookup_lane = self.num_buckets, self._sparse_k
        self._attach()
        self.layout_version += 1
        for listener in self._listeners:
            listener(self.flat, self.ordered_params(), **self._shard_kw())

    def _view(self, name: str) -> torch.Tensor:
        o = self.layout.offsets[name]
        return self.flat[o:o + self.sizes[name]].view_as(self.params[name])

    def _attach(self) -> None:
        for name, p in self.params.items():
            p.grad = self._views[name]

    def _views_attached(self) -> bool:
        base, size = self.flat.data_ptr(), self.flat.element_size()
        return all(p.grad is not None and p.grad.data_ptr() == base + self.layout.offsets[n] * size
                   for n, p in self.params.items())

    def plan_json(self) -> dict:
        """The plan in use (after the first-step re-cut: the measured order), as a plan file
        holds it."""
        return self.plan.to_json(self.sizes)

    def ordered_params(self) -> list[torch.nn.Parameter]:
        """The parameters in buffer order."""
        return [self.params[n] for n in self.layout.order]

    def on_layout(self, listener: Callable[[torch.Tensor, list], None]) -> None:
        """Call ``listener(flat, params_in_buffer_order)`` now and whenever the buffer is laid
        out again (the first-step re-cut): a fused optimizer steps on the buffer itself."""
        self._listeners.append(listener)
        listener(self.flat, self.ordered_params(), **self._shard_kw())

    def _shard_kw(self) -> dict:
        """A sharded optimizer is told its shard with the layout; others get what they did."""
        return {} if self.shard is None else {"shard": self.shard}

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of the averaged gradient (0-dim fp32, not unscaled, no host sync):
        per-row norms (``kernels.optim_reference.global_grad_norm``'s bits) of the buffer;
        sharded, of this rank's shard, their fp64 sum of squares summed over the shard group
        (the same number on every rank, so a non-finite one skips the step everywhere)."""
        if self.shard is None:
            return norm_of_rows(row_norms(self.flat))
        lo, hi = self.shard.window
        sq = row_norms(self.flat[lo:hi]).double().pow(2).sum().reshape(1)
        return self.shard.sum_(sq).sqrt().float().reshape(())

    @property
    def num_buckets(self) -> int:
        return len(self.bounds)

    def bucket_bytes(self) -> list[int]:
        size = self.reduce_dtype.itemsize
        return [(hi - lo) * size for lo, hi in self.bounds]

    # ---- one step -----------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without launching anything (all micro-steps but the last)."""
        before, self._sync = self._sync, False
        if self.tied is not None:
            self.tied.sync = False
        try:
            yield
        finally:
            self._sync = before
            if self.tied is not None:
                self.tied.sync = before
        if self._armed:  # the micro-step's backward is over: its gradients into the buffer
            self._add_arrived()

    def begin_step(self, loss_scale: Any = 1.0) -> None:
        if not self._views_attached():  # someone set grads to None: re-point them, zeroed
            self.flat.zero_()
        for p in self.params.values():  # each gradient lands where autograd makes it
            p.grad = None
        k = self.num_buckets
        self._to_add = list(self._bucket_sizes)  # per bucket: gradients of this micro-step to come
        self._fresh = [True] * k  # per bucket: it holds the last step's values (none written)
        # per parameter: its buckets that have not taken this micro-step's gradient yet
        self._parts_left = dict(self._n_buckets_of)
        self._loss_scale = loss_scale
        self._pending = list(self._bucket_sizes)
        self._ready: set[int] = set()
        self._next = 0
        self._works: list[Any] = [None] * k  # (sharded: a list of works per bucket)
        self._comm: list[Optional[torch.Tensor]] = [None] * k
        self.policy.begin_step()
        self._local_sq: list[torch.Tensor] = []  # per launched bucket: ‖what it sends‖²
        if self.tied is not None:
            self.tied.begin_step()
        if self.timeline is not None:
            extra = [self.tied.nbytes] if self.tied is not None else []
            self.timeline.start_buckets(self.bucket_bytes() + extra)  # lane K: the decoder's
        self._step_t0 = time.perf_counter()
        self._armed = True

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if not self._armed:
            return
        if self._measuring and id(param) not in self._measured:
            # host time: the hook's launch decision is the host's (on a GPU its device work
            # follows in the same order); first step only
            self._measured.add(id(param))
            name = self._names[id(param)]
            self.measured_order.append(name)
            self.measured_ready_s[name] = time.perf_counter() - self._step_t0
        for b in self._buckets_of[id(param)]:
            self._to_add[b] -= 1
            if self._to_add[b] == 0:  # the bucket's gradients of this micro-step are all here
                self._add_in(b)
        if not self._sync:
            return
        if id(param) in self._ready:
            raise RuntimeError(f"gradient of {self._names[id(param)]} produced twice in one "
                               f"synchronised step: run all micro-batches but the last under "
                               f"no_sync()")
        self._ready.add(id(param))
        now = self.timeline.now() if self.timeline is not None else None
        for b in self._buckets_of[id(param)]:
            self._pending[b] -= 1
            if self._pending[b] == 0 and self.timeline is not None:
                self.timeline.bucket_ready(b, now)
        if not self.policy.holds_launches:
            self._launch_ready()

    def _add_in(self, k: int) -> None:
        """Add the gradients autograd left in bucket k's parameters' ``.grad`` into the
        bucket (one multi-tensor add; a parameter that got none adds nothing) - the bucket's
        first of the step a copy instead (the module docstring) -, and unset the ``.grad`` of
        each parameter whose every bucket has taken it: the next micro-step's gradient lands
        apart again."""
        dst, src = [], []
        for name, part, a, b in self._parts[k]:
            g = self.params[name].grad
            if g is not None:
                dst.append(part)
                src.append(g.reshape(-1)[a:b])
        if self._fresh[k]:
            self._fresh[k] = False
            if len(dst) == len(self._parts[k]):  # every gradient of the bucket is here
                pad, zeros = self._gaps[k]
                torch._foreach_copy_(dst + pad, src + zeros)
                dst = []
            else:  # one is missing: its part must read 0
                lo, hi = self.bounds[k]
                self.flat[lo:hi].zero_()
        if dst:
            torch._foreach_add_(dst, src)
        self._to_add[k] = self._bucket_sizes[k]
        for name, *_ in self._parts[k]:
            self._parts_left[name] -= 1
            if self._parts_left[name] == 0:
                self._parts_left[name] = self._n_buckets_of[name]
                self.params[name].grad = None

    def _add_arrived(self) -> None:
        """The end of a micro-step's backward: add what arrived in the buckets still
        incomplete (a parameter without a gradient in it leaves its bucket short). Every
        gradient is then in the buffer, and every parameter's count of buckets starts afresh
        (one without a gradient counted down only in the buckets that others completed)."""
        for k in range(self.num_buckets):
            if self._to_add[k] != self._bucket_sizes[k]:
                self._add_in(k)
        self._parts_left = dict(self._n_buckets_of)

    def _launch_ready(self) -> None:
        while self._next < self.num_buckets and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _tied_rows(self) -> torch.Tensor:
        return self._views[self._tied_name].view(self.params[self._tied_name].shape[0], -1)

    def _launch(self, k: int) -> None:
        if k == self._sparse_k:
            return self.tied.launch_lookup(self._tied_rows())
        lo, hi = self.bounds[k]
        buf = self.flat[lo:hi]
        self.policy.scale_bucket(self, k, buf, 1.0 / self.world_size)  # clip, 1/P, noise tap
        timeline = self.timeline
        now = timeline.now() if timeline is not None else None
        if self.world_size == 1:  # a world of one, or build_parts(communicate=False)
            if timeline is not None:
                timeline.bucket_launched(k, now)
                timeline.bucket_done(k, now)
            return
        comm = buf if self.reduce_dtype == buf.dtype else buf.to(self.reduce_dtype)
        if self.shard is not None and self.shard.reduces:  # to the shards' owners
            works = self.shard.launch(comm, lo)
            self._works[k], self._comm[k] = works or None, comm
            if timeline is not None:
                timeline.bucket_launched(k, now, work=works[-1] if works else None)
            return
        work = torch_dist.all_reduce(comm, op=torch_dist.ReduceOp.SUM, group=self.group,
                                     async_op=True)
        self._works[k], self._comm[k] = work, comm
        if timeline is not None:  # completion stamped when the data has arrived
            timeline.bucket_launched(k, now, work=work)

    def finish(self) -> SyncReport:
        """After the last backward: launch what is left (everything, for local_before), wait
        for every allreduce in order; the buffer then holds the averaged (clipped) gradient."""
        if not self._armed:
            raise RuntimeError("finish() without begin_step()")
        backward_done_at = self.timeline.now() if self.timeline is not None else None
        launched_in_backward = self._next
        self._add_arrived()
        for k, fresh in enumerate(self._fresh):  # no gradient reached it all step
            if fresh:
                lo, hi = self.bounds[k]
                self.flat[lo:hi].zero_()
                self._fresh[k] = False
        self._attach()  # every .grad its view again, for the optimizer and anyone after
        self.policy.before_final_launches(self)  # local_before: the whole local gradient
        for k in range(self._next, self.num_buckets):
            if self.timeline is not None and self._pending[k] != 0:
                self.timeline.bucket_ready(k, backward_done_at)
            self._launch(k)
        self._next = self.num_buckets
        if self.tied is not None:
            self.tied.finish(self._tied_rows())
        if self.shard is not None and self.shard.reduces:
            self._finish_sharded()
        for k, work in enumerate(self._works):
            if work is not None:
                for w in work if isinstance(work, list) else [work]:
                    w.wait()
                if self.timeline is not None:
                    self.timeline.waited(k)
                lo, hi = self.bounds[k]
                if self._comm[k] is not None and self._comm[k].dtype != self.dtype:
                    part = (lo, hi) if self.shard is None or not self.shard.reduces \
                        else self.shard.owned(lo, hi)
                    if part is not None:  # sharded: only this rank's part means anything
                        a, b = part
                        self.flat[a:b].copy_(self._comm[k][a - lo:b - lo])
        self._armed = False
        return self._report(launched_in_backward)

    def _finish_sharded(self) -> None:
        """Several node groups: as each bucket's reduce inside the node ends, all-reduce the
        owned part across the node groups (bucket order: the same on every rank of a cross
        group, as they own the same shard)."""
        if self.shard.groups.cross is None:
            return
        for k, works in enumerate(self._works):
            comm = self._comm[k]
            if comm is None:
                continue
            for w in works or []:
                w.wait()
            across = self.shard.launch_across(comm, self.bounds[k][0])
            self._works[k] = [across] if across is not None else None

    def note_local(self, norm: torch.Tensor) -> None:
        """A part of this rank's gradient as it goes to the averaging (unscaled, clipped):
        the noise scale's small batch (the clip policy hands it over)."""
        self._local_sq.append(norm.float().square())

    def bucket_norm(self, k: int) -> torch.Tensor:
        """‖bucket k‖ of this rank's gradient as it stands (loss-scaled, 0-dim fp32)."""
        lo, hi = self.bounds[k]
        return slice_norm(self.flat, lo, hi)

    @property
    def loss_scale(self) -> Any:
        return self._loss_scale

    @property
    def fold_clip(self) -> bool:
        """Whether the optimizer step folds the global clip coefficient (global_after with a
        threshold): the sync says so, the trainer does not decide it again."""
        return self.clip.after_allreduce and self.max_grad_norm > 0

    def _report(self, launched_in_backward: int) -> SyncReport:
        report = SyncReport(buckets=self.num_buckets, launched_in_backward=launched_in_backward)
        local = list(self._local_sq)
        if self.tied is not None and self.tied.local_sq is not None:  # its two shares went
            # out apart; the split adds them up: the whole tied gradient, as a dense bucket's
            local.append((self.tied.local_sq / (self._loss_scale * self._loss_scale)).float())
        if local and self.world_size > 1:
            report.local_sq_norm = torch.stack(local).sum()
        self.policy.report(report)
        return report

    def zero_grad(self) -> None:
        """After the optimizer step: nothing to zero - the next step's first gradients are
        copied into each bucket, or it is zeroed then (the module docstring); the views stay.
        After the first step, re-cut a size-cap plan in the measured production order (a
        collective: every rank)."""
        if self._measuring and not self._armed and self.measured_order:
            self._measuring = False
            if self._cap_elements is not None:
                self._recut_in_measured_order()

    def _recut_in_measured_order(self) -> None:
        names = self.plan.order()
        # every rank's first-step times, the slowest rank's per parameter (a collective over
        # the launched world, also when this sync communicates nothing: the tuner's); read
        # back once, after the first step, beside the re-cut's own host collectives
        times = torch.tensor([self.measured_ready_s.get(n, math.inf) for n in names],
                             dtype=torch.float64, device=self.device)
        slowest = dict(zip(names, all_reduce_max(times).tolist()))
        seen = set(self.measured_order)
        order = production_order(slowest, self.measured_order
                                 + [n for n in names if n not in seen])
        order = broadcast_object(order)  # ties broken by rank 0's arrivals: one plan everywhere
        if order == self.plan.order():
            return
        self._install(BucketPlan.from_cap([(n, self.sizes[n]) for n in order],
                                          self._cap_elements, self.plan.source,
                                          alone=self._tied_name))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.tied is not None:
            self.tied.close()
