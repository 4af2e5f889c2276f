"""Gradient buckets: where gradients live, when the ranks average them, and clipping before
the allreduce (BACKGROUND §5 and §6).

Owns:
  * the bucket plan (`BucketPlan`): which elements of which parameter go into which bucket, in
    gradient-production order - cut from a size cap (``train.bucket_cap_mb``) or read from a
    JSON plan file (``train.bucket_plan``, what the bucket tuner writes) - and its validation;
  * the flat gradient buffer: one tensor in plan order. Every ``param.grad`` is a view into
    it and every bucket is a contiguous slice of it, so autograd accumulates straight into
    bucket memory and nothing is copied before the allreduce;
  * the post-accumulate-grad hooks that launch each bucket's asynchronous allreduce
    (``async_op=True`` on the gloo/NCCL group) as soon as its last gradient is produced,
    strictly in bucket order, while backward goes on; with gradient accumulation only the
    last micro-step launches anything (the others run under ``no_sync()``);
  * the clip modes that act before the allreduce: ``bucket_before`` (each rank scales each
    bucket b to norm ≤ τ/√K by its own norm ‖g_r,b‖ just before launching it - Samsung) and
    ``local_before`` (each rank scales its whole gradient to norm ≤ τ by ‖g_r‖; that norm
    needs every gradient, so nothing is launched before backward ends - no overlap, by
    construction). ``global_after`` and ``none`` only average here.
Never: steps the optimizer or applies the ``global_after`` coefficient (the trainer folds it
into the optimizer step after `finish`), reads the launcher's environment, or picks sizes
(the config or the tuner's plan does).

The averaged gradient each mode leaves in the buffer (g_r: rank r's gradient, P ranks):
  global_after, none   (1/P) Σ_r g_r
  local_before         (1/P) Σ_r min(1, τ/‖g_r‖) g_r
  bucket_before        per bucket b of K: (1/P) Σ_r min(1, (τ/√K)/‖g_r,b‖) g_r,b
Each rank pre-divides by P (and multiplies by its coefficient) in one pass before the sum.
Norms are accumulated in fp32 and unscaled by the fp16 loss scale; coefficients use the
same ε as ``kernels.optim_reference.clip_coefficient``.

Plans and layout. A plan is a list of buckets; a bucket a list of pieces "name" (a whole
parameter) or "name[a:b]" (elements a..b-1 of the flattened parameter). The flat buffer is
the pieces in plan order, and buckets are launched in that order, so a plan should follow
the order gradients are produced. The plan file::

    {"format": "presto-bucket-plan/1",
     "buckets": [["cls.predictions.bias", "cls.predictions.transform.dense.weight", ...],
                 ["bert.embeddings.word_embeddings.weight[0:2000000]"],
                 ["bert.embeddings.word_embeddings.weight[2000000:]", ...]]}

Every element of every parameter that takes a gradient must be in exactly one bucket, and the
pieces of a split parameter must follow each other in element order (so its ``.grad`` stays
one view of the buffer); anything else is a `PlanError` naming the parameter and elements.

Split parameters. A size-cap plan cuts a parameter larger than the cap (the tied word
embedding: 89% of the CPU benchmark model) into cap-sized pieces, each in its own bucket
except the last, which the following parameters join. Its hook fires once, when its whole
gradient has been accumulated; that one call completes every bucket holding a piece of it.
Those buckets are then launched in order, one allreduce each: the first piece's bucket
(holding also whatever was produced before it), then the buckets of the middle pieces; the
last piece's bucket waits for the parameters after it in the plan.

Production order. Before the first step a size-cap plan follows reverse registration order
(DDP's guess). During the first step the hooks record the order gradients really arrive in;
at the end of that step the plan is cut again in rank 0's measured order (broadcast, so every
rank gets the same plan) - once. A plan file is never reordered; the measured order is kept
in ``measured_order`` for the tuner.

Ranks must agree: the plan's digest is compared across ranks (`check_same_on_all_ranks`)
when the buckets are built and after the rebuild. A plan that differs between ranks stops
every rank with a clear error instead of mismatched collectives that would hang.

The tied word embedding (``train.tied_embedding_sync = "split"``, clip_mode global_after |
none). Used by the lookup (the first op of forward) and the MLM decoder (tied), its gradient
is final only at the very end of backward, so a dense allreduce of it can never overlap - and
it is 88% of the CPU benchmark model's bytes. Split mode keeps the two shares apart: the
decoder multiplies by ``decoder_tap(weight)`` (the model's ``weight_tap``), whose backward hands
the decoder's share to the buckets instead of autograd; it is pre-divided by P and its
allreduce launched at once, early in backward (timeline lane K). The lookup's share reaches
``.grad`` as usual, in a bucket of its own; when it is final each rank marks the rows it
touched, an allreduce-max of that row mask gives the union, and only those rows are reduced
(rows no rank touched are zero on every rank, so the result is exact). `finish` then adds the
reduced decoder share. The sum is the same averaged gradient as the dense path (tested).

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
``train.grad_sync = "ddp"`` keeps plain DDP (global_after | none) for comparison.

The seam with flat-buffer optimizers: `layout()` gives (param, offset, numel) in flat order -
the buckets are contiguous slices of ``flat`` in that order; ``layout_version`` changes when
the first-step rebuild moves the buffer.
"""
from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
import torch.distributed as torch_dist

from kernels.optim_reference import CLIP_EPS, global_grad_norm
from runtime.dist import broadcast_object, check_same_on_all_ranks

PLAN_FORMAT = "presto-bucket-plan/1"
CLIP_MODES = ("global_after", "local_before", "bucket_before", "none")
MB = 2 ** 20  # bucket_cap_mb counts MiB, as DDP's bucket_cap_mb does

_PIECE = re.compile(r"^(?P<name>[^\[\]]+?)(?:\[(?P<start>\d*):(?P<stop>\d*)\])?$")


class PlanError(ValueError):
    """A bucket plan that misses, repeats or mangles a parameter; the message says which."""


# ---------------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of the flattened parameter ``name``."""

    name: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def text(self, param_numel: int) -> str:
        whole = self.start == 0 and self.stop == param_numel
        return self.name if whole else f"{self.name}[{self.start}:{self.stop}]"


@dataclass(frozen=True)
class BucketPlan:
    """Buckets of parameter pieces, in launch (= flat buffer) order."""

    buckets: tuple[tuple[Piece, ...], ...]
    source: str = "cap"

    @classmethod
    def from_cap(cls, order: Iterable[tuple[str, int]], cap_elements: int,
                 source: str = "cap", alone: Optional[str] = None) -> "BucketPlan":
        """Fill buckets up to ``cap_elements`` in ``order`` ((name, numel) pairs); a parameter
        larger than the cap is cut into cap-sized pieces (see the module docstring). The
        parameter ``alone`` (tied_embedding_sync split) gets one whole bucket of its own."""
        if cap_elements <= 0:
            raise PlanError(f"bucket cap must be > 0 elements, got {cap_elements}")
        buckets: list[tuple[Piece, ...]] = []
        current: list[Piece] = []
        used = 0
        for name, numel in order:
            start = 0
            if name == alone:
                if current:
                    buckets.append(tuple(current))
                buckets.append((Piece(name, 0, numel),))
                current, used = [], 0
                continue
            if numel > cap_elements or used + numel > cap_elements:
                if current:
                    buckets.append(tuple(current))
                current, used = [], 0
            while numel - start > cap_elements:
                buckets.append((Piece(name, start, start + cap_elements),))
                start += cap_elements
            current.append(Piece(name, start, numel))
            used += numel - start
        if current:
            buckets.append(tuple(current))
        return cls(tuple(buckets), source)

    @classmethod
    def from_json(cls, data: Any, sizes: dict[str, int], source: str = "plan") -> "BucketPlan":
        """Parse a plan file's content (see the module docstring) and validate it."""
        if not isinstance(data, dict) or not isinstance(data.get("buckets"), list):
            raise PlanError(f"{source}: a bucket plan is a JSON object with \"buckets\": a list "
                            f"of buckets, each a list of \"name\" or \"name[start:stop]\"")
        if data.get("format", PLAN_FORMAT) != PLAN_FORMAT:
            raise PlanError(f"{source}: format {data.get('format')!r} is not {PLAN_FORMAT!r}")
        buckets = []
        for b, bucket in enumerate(data["buckets"]):
            if not isinstance(bucket, list) or not all(isinstance(x, str) for x in bucket):
                raise PlanError(f"{source}: bucket {b} must be a list of strings, got {bucket!r}")
            buckets.append(tuple(_parse_piece(text, sizes, f"{source}: bucket {b}")
                                 for text in bucket))
        plan = cls(tuple(buckets), source)
        plan.validate(sizes)
        return plan

    @classmethod
    def read(cls, path: str | Path, sizes: dict[str, int]) -> "BucketPlan":
        path = Path(path)
        if not path.is_file():
            raise PlanError(f"train.bucket_plan: {path} does not exist (write one with the bucket "
                            f"tuner, or leave train.bucket_plan empty to cut by bucket_cap_mb)")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise PlanError(f"train.bucket_plan: {path} is not valid JSON ({e})") from e
        return cls.from_json(data, sizes, str(path))

    def to_json(self, sizes: dict[str, int]) -> dict:
        return {"format": PLAN_FORMAT,
                "buckets": [[p.text(sizes[p.name]) for p in bucket] for bucket in self.buckets]}

    def digest(self) -> str:
        text = json.dumps([[[p.name, p.start, p.stop] for p in b] for b in self.buckets])
        return hashlib.sha256(text.encode()).hexdigest()

    def order(self) -> list[str]:
        """Parameter names in flat-buffer order (each once)."""
        return list(dict.fromkeys(p.name for bucket in self.buckets for p in bucket))

    def split_parameters(self) -> list[str]:
        counts: dict[str, int] = {}
        for bucket in self.buckets:
            for p in bucket:
                counts[p.name] = counts.get(p.name, 0) + 1
        return [n for n, c in counts.items() if c > 1]

    def validate(self, sizes: dict[str, int]) -> None:
        """Every element of every parameter in ``sizes`` in exactly one bucket, the pieces of
        a parameter consecutive and in element order; else `PlanError`."""
        where: dict[str, list[tuple[int, int, Piece]]] = {}  # name -> (position, bucket, piece)
        position = 0
        for b, bucket in enumerate(self.buckets):
            if not bucket:
                raise PlanError(f"{self.source}: bucket {b} is empty; remove it")
            for piece in bucket:
                if piece.name not in sizes:
                    raise PlanError(_unknown(piece.name, sizes, f"{self.source}: bucket {b}"))
                numel = sizes[piece.name]
                if not 0 <= piece.start < piece.stop <= numel:
                    raise PlanError(f"{self.source}: bucket {b}: {piece.name}[{piece.start}:"
                                    f"{piece.stop}] is not a non-empty range of its {numel} "
                                    f"elements")
                where.setdefault(piece.name, []).append((position, b, piece))
                position += 1
        missing = [n for n in sizes if n not in where]
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise PlanError(f"{self.source}: parameter(s) in no bucket: {', '.join(missing[:5])}"
                            f"{more}; every parameter that takes a gradient must be in the plan "
                            f"(regenerate the plan for this model)")
        for name, entries in where.items():
            _check_pieces(name, sizes[name], entries, self.source)


def _parse_piece(text: str, sizes: dict[str, int], where: str) -> Piece:
    m = _PIECE.match(text.strip())
    if not m:
        raise PlanError(f"{where}: {text!r} is not \"name\" or \"name[start:stop]\"")
    name = m["name"]
    if name not in sizes:
        raise PlanError(_unknown(name, sizes, where))
    start = int(m["start"]) if m["start"] else 0
    stop = int(m["stop"]) if m["stop"] else sizes[name]
    return Piece(name, start, stop)


def _unknown(name: str, sizes: dict[str, int], where: str) -> str:
    near = difflib.get_close_matches(name, list(sizes), 1)
    hint = f"; did you mean {near[0]}?" if near else ""
    return (f"{where}: unknown parameter {name!r}{hint} (plans name each trainable parameter "
            f"once, by its first name in model.named_parameters(); tied aliases are not names)")


def _check_pieces(name: str, numel: int, entries: list, source: str) -> None:
    by_start = sorted(entries, key=lambda e: (e[2].start, e[0]))
    covered, last_bucket = 0, None
    for _, b, piece in by_start:
        if piece.start < covered:
            raise PlanError(f"{source}: parameter {name}: elements [{piece.start}:"
                            f"{min(piece.stop, covered)}] are in two buckets ({last_bucket} and "
                            f"{b}); each element must be in exactly one")
        if piece.start > covered:
            raise PlanError(f"{source}: parameter {name}: elements [{covered}:{piece.start}] are "
                            f"in no bucket")
        covered, last_bucket = piece.stop, b
    if covered < numel:
        raise PlanError(f"{source}: parameter {name}: elements [{covered}:{numel}] are in no "
                        f"bucket")
    positions = [e[0] for e in by_start]
    if positions != list(range(positions[0], positions[0] + len(positions))):
        buckets = sorted({e[1] for e in entries})
        raise PlanError(f"{source}: the pieces of split parameter {name} (buckets {buckets}) "
                        f"must follow each other in element order with nothing between, so its "
                        f"gradient stays one view of the flat buffer")


def alone_bucket(plan: BucketPlan, name: str, numel: int) -> int:
    """Index of the bucket that holds all of ``name`` and nothing else; else `PlanError`."""
    for k, bucket in enumerate(plan.buckets):
        if len(bucket) == 1 and bucket[0] == Piece(name, 0, numel):
            return k
    raise PlanError(f"{plan.source}: train.tied_embedding_sync='split' needs {name} whole and "
                    f"alone in one bucket (its lookup gradient is reduced row-sparsely); put "
                    f"[\"{name}\"] as a bucket of its own in the plan")


class _DecoderGradTap(torch.autograd.Function):
    """Identity on the tied weight in forward; in backward the decoder's share of its gradient
    goes to ``sink`` instead of into the parameter's ``.grad`` (tied_embedding_sync split)."""

    @staticmethod
    def forward(ctx, weight, sink):
        ctx.sink = sink
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        ctx.sink(grad)
        return None, None


def fp32_norm(t: torch.Tensor) -> torch.Tensor:
    """‖t‖₂ accumulated in fp32, as a 0-dim tensor (no host sync).

    Not ``torch.linalg.vector_norm``: its CPU fp32 kernel accumulates sequentially and is off
    by ~1e-4 (relative) on a few million elements; ``sum`` reduces pairwise (~1e-7).
    """
    return t.float().pow(2).sum().sqrt()


def reverse_registration_order(named_params: list[tuple[str, torch.nn.Parameter]]) -> list[str]:
    """DDP's guess of gradient-production order before anything was measured."""
    return [name for name, _ in reversed(named_params)]


# ---------------------------------------------------------------------------------------------
# the buckets at run time


@dataclass
class SyncReport:
    """What one step's gradient synchronisation did on this rank."""

    clip_mode: str
    clip_coefs: list[float] = field(default_factory=list)  # bucket_before: one per bucket;
    #                                                        local_before: this rank's one
    local_norm: Optional[float] = None  # ‖g_r‖ before clipping (the before modes), fp32
    buckets: int = 0
    launched_in_backward: int = 0       # buckets whose allreduce started before backward ended

    @property
    def clip_coef(self) -> float:
        """The strongest clip applied on this rank (1.0 = none)."""
        return min(self.clip_coefs) if self.clip_coefs else 1.0

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"buckets": self.buckets,
                                 "buckets_launched_in_backward": self.launched_in_backward}
        if self.clip_coefs:
            out.update(clip_coef_min=min(self.clip_coefs),
                       clip_coef_mean=sum(self.clip_coefs) / len(self.clip_coefs))
        if self.local_norm is not None:
            out["local_grad_norm"] = self.local_norm
        return out


class GradientBuckets:
    """The runtime's data-parallel gradient path for one model; see the module docstring.

    Per step: ``begin_step(loss_scale)`` → forward/backward (micro-steps but the last under
    ``no_sync()``; hooks launch buckets) → ``finish()`` (launches what is left, waits, returns
    a `SyncReport`) → optimizer step → ``zero_grad()``.
    """

    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], plan: BucketPlan, *,
                 world_size: int, group: Any = None, clip_mode: str = "global_after",
                 max_grad_norm: float = 1.0, reduce_dtype: Optional[torch.dtype] = None,
                 cap_elements: Optional[int] = None, timeline: Any = None,
                 tied_split: Optional[str] = None, tied_head: Optional[torch.nn.Module] = None):
        if clip_mode not in CLIP_MODES:
            raise ValueError(f"clip_mode must be one of {' | '.join(CLIP_MODES)}, got {clip_mode!r}")
        self.params = {n: p for n, p in named_params if p.requires_grad}
        self.sizes = {n: p.numel() for n, p in self.params.items()}
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
        self.skip_communication = False  # calibration only (bench.overlap): average nothing
        self.measured_order: list[str] = []  # first step's gradient arrival order
        self._measured: set[int] = set()
        self.layout_version = 0
        self._cap_elements = cap_elements  # set: the plan may be re-cut in measured order
        self._measuring = True
        self._armed = False
        self._sync = True
        self.tied_split = tied_split  # the tied embedding's name when its sync is split
        if tied_split is not None:
            if clip_mode not in ("global_after", "none"):
                raise ValueError(f"tied_embedding_sync split needs clip_mode global_after | "
                                 f"none, got {clip_mode!r}")
            tied = self.params[tied_split]
            self._dec = torch.zeros_like(tied, memory_format=torch.contiguous_format)
            self._dec_fresh = True
        self._install(plan)
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad)
                         for p in self.params.values()]
        self._head = tied_head  # its weight_tap routes the decoder's share to us (split)
        if tied_head is not None:
            tied_head.weight_tap = self.decoder_tap

    # ---- layout -------------------------------------------------------------------------
    def _install(self, plan: BucketPlan) -> None:
        plan.validate(self.sizes)
        check_same_on_all_ranks("bucket plan (train.bucket_plan / train.bucket_cap_mb)",
                                plan.digest())
        self.plan = plan
        self.offsets: dict[str, int] = {}
        self.bounds: list[tuple[int, int]] = []
        members: list[set[str]] = []
        offset = 0
        for bucket in plan.buckets:
            lo = offset
            for piece in bucket:
                if piece.start == 0:
                    self.offsets[piece.name] = offset
                offset += piece.numel
            self.bounds.append((lo, offset))
            members.append({p.name for p in bucket})
        self._bucket_sizes = [len(m) for m in members]
        self._buckets_of = {id(self.params[n]): [b for b, m in enumerate(members) if n in m]
                            for n in self.params}
        self._names = {id(p): n for n, p in self.params.items()}
        self.flat = torch.zeros(offset, dtype=self.dtype, device=self.device)
        self._sparse_k = (alone_bucket(plan, self.tied_split, self.sizes[self.tied_split])
                          if self.tied_split is not None else None)
        self._attach()
        self.layout_version += 1

    def _view(self, name: str) -> torch.Tensor:
        o = self.offsets[name]
        return self.flat[o:o + self.sizes[name]].view_as(self.params[name])

    def _attach(self) -> None:
        for name, p in self.params.items():
            p.grad = self._view(name)

    def _views_attached(self) -> bool:
        return all(p.grad is not None and p.grad.data_ptr() == self.flat.data_ptr()
                   + self.offsets[n] * self.flat.element_size() for n, p in self.params.items())

    def layout(self) -> list[tuple[torch.nn.Parameter, int, int]]:
        """(param, offset, numel) in flat order: ``param.grad`` is ``flat[offset:offset+numel]``."""
        return [(self.params[n], self.offsets[n], self.sizes[n]) for n in self.plan.order()]

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of the whole gradient buffer (fp32, not unscaled): per-row norms of each
        parameter's gradient (``kernels.optim_reference.global_grad_norm``), so the value
        does not depend on the plan that placed the gradients."""
        return global_grad_norm([self._view(n) for n in self.plan.order()])

    @property
    def num_buckets(self) -> int:
        return len(self.bounds)

    def bucket_bytes(self) -> list[int]:
        size = self.reduce_dtype.itemsize
        return [(hi - lo) * size for lo, hi in self.bounds]

    # ---- the tied embedding, split (tied_embedding_sync = "split") ------------------------
    def decoder_tap(self, weight: torch.Tensor) -> torch.Tensor:
        """What the MLM decoder multiplies by instead of the tied weight itself (the model's
        ``weight_tap``): the same values; its gradient comes to `_on_decoder_grad`."""
        return _DecoderGradTap.apply(weight, self._on_decoder_grad)

    def _on_decoder_grad(self, grad: torch.Tensor) -> None:
        if not self._armed:  # a backward outside a training step: plain autograd semantics
            param = self.params[self.tied_split]
            if param.grad is None:
                param.grad = grad.clone()
            else:
                param.grad.add_(grad)
            return
        if self._dec_fresh:
            self._dec.copy_(grad)
            self._dec_fresh = False
        else:
            self._dec.add_(grad)  # gradient accumulation: micro-steps add up
        if not self._sync:
            return
        k = self.num_buckets  # the decoder's timeline lane
        now = time.perf_counter() if self.timeline is not None else 0.0
        if self.timeline is not None:
            self.timeline.bucket_ready(k, now)
        if self.world_size > 1:
            self._dec.mul_(1.0 / self.world_size)
        if self.world_size == 1 or self.skip_communication:
            if self.timeline is not None:
                self.timeline.bucket_launched(k, now)
                self.timeline.bucket_done(k, now)
            return
        comm = self._dec if self.reduce_dtype == self._dec.dtype else self._dec.to(self.reduce_dtype)
        self._dec_work = torch_dist.all_reduce(comm, op=torch_dist.ReduceOp.SUM,
                                               group=self.group, async_op=True)
        self._dec_comm = comm
        if self.timeline is not None:
            self.timeline.bucket_launched(k, now)
            self._dec_work.get_future().add_done_callback(self.timeline.done_callback(k))

    def _launch_sparse(self, k: int) -> None:
        """The lookup's share of the tied gradient (its bucket k): first which rows any rank
        touched (an allreduce-max of a row mask; rows no rank touched are zero everywhere)."""
        now = time.perf_counter() if self.timeline is not None else 0.0
        if self.timeline is not None:
            self.timeline.bucket_launched(k, now)
        if self.world_size == 1 or self.skip_communication:
            if self.timeline is not None:
                self.timeline.bucket_done(k, now)
            return
        grad = self._tied_rows()
        self._mask = (grad != 0).any(dim=1).to(torch.uint8)
        self._works[k] = torch_dist.all_reduce(self._mask, op=torch_dist.ReduceOp.MAX,
                                               group=self.group, async_op=True)

    def _tied_rows(self) -> torch.Tensor:
        lo, hi = self.bounds[self._sparse_k]
        return self.flat[lo:hi].view(self._dec.shape[0], -1)

    def _finish_tied(self) -> None:
        """After every bucket was launched: reduce the touched rows, then add the decoder's
        reduced share. Every rank issues these collectives at the same point."""
        k, grad = self._sparse_k, self._tied_rows()
        if self._mask is not None:
            self._works[k].wait()
            self._works[k] = None
            idx = self._mask.nonzero().squeeze(1)
            rows = grad.index_select(0, idx).to(self.reduce_dtype)
            rows.mul_(1.0 / self.world_size)
            torch_dist.all_reduce(rows, op=torch_dist.ReduceOp.SUM, group=self.group)
            grad.index_copy_(0, idx, rows.to(grad.dtype))
            if self.timeline is not None:
                self.timeline.bytes[k] = rows.numel() * rows.element_size()
                self.timeline.bucket_done(k, time.perf_counter())
        if self._dec_work is not None:
            self._dec_work.wait()
            if self._dec_comm is not self._dec:
                self._dec.copy_(self._dec_comm)
        if not self._dec_fresh:  # the decoder ran in this step
            grad.add_(self._dec.view_as(grad))

    # ---- one step -----------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without launching anything (all micro-steps but the last)."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    def begin_step(self, loss_scale: float = 1.0) -> None:
        if not self._views_attached():  # someone set grads to None: re-point them, zeroed
            self.flat.zero_()
            self._attach()
        k = self.num_buckets
        self._loss_scale = loss_scale
        self._pending = list(self._bucket_sizes)
        self._ready: set[int] = set()
        self._next = 0
        self._works: list[Any] = [None] * k
        self._comm: list[Optional[torch.Tensor]] = [None] * k
        self._norms: list[Optional[torch.Tensor]] = [None] * k
        self._coefs: list[Optional[torch.Tensor]] = [None] * k
        self._local_coef: Optional[torch.Tensor] = None
        self._local_norm: Optional[torch.Tensor] = None
        self._backward_done_at: Optional[float] = None
        self._dec_work: Any = None
        self._dec_comm: Optional[torch.Tensor] = None
        self._dec_fresh = True
        self._mask: Optional[torch.Tensor] = None
        if self.timeline is not None:
            extra = [self._dec.numel() * self.reduce_dtype.itemsize] if self.tied_split else []
            self.timeline.start_buckets(self.bucket_bytes() + extra)  # lane K: the decoder's
        self._armed = True

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        if not self._armed:
            return
        if self._measuring and id(param) not in self._measured:
            self._measured.add(id(param))
            self.measured_order.append(self._names[id(param)])
        if not self._sync:
            return
        if id(param) in self._ready:
            raise RuntimeError(f"gradient of {self._names[id(param)]} produced twice in one "
                               f"synchronised step: run all micro-batches but the last under "
                               f"no_sync()")
        self._ready.add(id(param))
        now = time.perf_counter() if self.timeline is not None else 0.0
        for b in self._buckets_of[id(param)]:
            self._pending[b] -= 1
            if self._pending[b] == 0 and self.timeline is not None:
                self.timeline.bucket_ready(b, now)
        if self.clip_mode != "local_before":
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < self.num_buckets and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, k: int) -> None:
        if k == self._sparse_k:
            return self._launch_sparse(k)
        lo, hi = self.bounds[k]
        buf = self.flat[lo:hi]
        scale = 1.0 / self.world_size
        if self.clip_mode == "bucket_before" and self.max_grad_norm > 0:
            norm = fp32_norm(buf) / self._loss_scale
            bound = self.max_grad_norm / math.sqrt(self.num_buckets)
            self._norms[k] = norm
            self._coefs[k] = torch.clamp(bound / (norm + CLIP_EPS), max=1.0)
            buf.mul_(self._coefs[k] * scale)
        elif self._local_coef is not None:
            buf.mul_(self._local_coef * scale)
        elif scale != 1.0:
            buf.mul_(scale)
        timeline = self.timeline
        now = time.perf_counter() if timeline is not None else 0.0
        if self.world_size == 1 or self.skip_communication:
            if timeline is not None:
                timeline.bucket_launched(k, now)
                timeline.bucket_done(k, now)
            return
        comm = buf if self.reduce_dtype == buf.dtype else buf.to(self.reduce_dtype)
        work = torch_dist.all_reduce(comm, op=torch_dist.ReduceOp.SUM, group=self.group,
                                     async_op=True)
        self._works[k], self._comm[k] = work, comm
        if timeline is not None:
            timeline.bucket_launched(k, now)
            # the future completes on the communication thread: the true end of the allreduce
            work.get_future().add_done_callback(timeline.done_callback(k))

    def finish(self) -> SyncReport:
        """After the last backward: launch what is left (everything, for local_before), wait
        for every allreduce in order; the buffer then holds the averaged (clipped) gradient."""
        if not self._armed:
            raise RuntimeError("finish() without begin_step()")
        self._backward_done_at = time.perf_counter()
        self._launched_in_backward = self._next
        if self.clip_mode == "local_before" and self.max_grad_norm > 0:
            self._local_norm = fp32_norm(self.flat) / self._loss_scale
            self._local_coef = torch.clamp(self.max_grad_norm / (self._local_norm + CLIP_EPS),
                                           max=1.0)
        for k in range(self._next, self.num_buckets):
            if self.timeline is not None and self._pending[k] != 0:
                self.timeline.bucket_ready(k, self._backward_done_at)
            self._launch(k)
        self._next = self.num_buckets
        if self.tied_split is not None:
            self._finish_tied()
        for k, work in enumerate(self._works):
            if work is not None:
                work.wait()
                if self.timeline is not None and self.timeline.done[k] is None:
                    self.timeline.bucket_done(k, time.perf_counter())  # callback not run yet
                lo, hi = self.bounds[k]
                if self._comm[k] is not None and self._comm[k].dtype != self.dtype:
                    self.flat[lo:hi].copy_(self._comm[k])
        self._armed = False
        return self._report()

    def _report(self) -> SyncReport:
        report = SyncReport(self.clip_mode, buckets=self.num_buckets)
        if self.clip_mode == "bucket_before" and self.max_grad_norm > 0:
            report.clip_coefs = [float(c) for c in self._coefs]
            report.local_norm = math.sqrt(sum(float(n) ** 2 for n in self._norms))
        elif self._local_coef is not None:
            report.clip_coefs = [float(self._local_coef)]
            report.local_norm = float(self._local_norm)
        report.launched_in_backward = self._launched_in_backward
        return report

    def zero_grad(self) -> None:
        """After the optimizer step: zero the buffer (the views stay); after the first step,
        re-cut a size-cap plan in the measured production order (a collective: every rank)."""
        if self._measuring and not self._armed and self.measured_order:
            self._measuring = False
            if self._cap_elements is not None:
                self._recut_in_measured_order()
                return
        self.flat.zero_()

    def _recut_in_measured_order(self) -> None:
        seen = set(self.measured_order)
        order = self.measured_order + [n for n in self.plan.order() if n not in seen]
        order = broadcast_object(order)  # rank 0's order for everyone: one plan on all ranks
        if order == self.plan.order():
            self.flat.zero_()
            return
        self._install(BucketPlan.from_cap([(n, self.sizes[n]) for n in order],
                                          self._cap_elements, self.plan.source,
                                          alone=self.tied_split))

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._head is not None:
            self._head.weight_tap = None


def build_gradient_buckets(model: torch.nn.Module, train_cfg: Any, world_size: int,
                           group: Any = None, timeline: Any = None) -> GradientBuckets:
    """The buckets ``train_cfg`` (runtime.config.TrainConfig) asks for: a plan file when
    ``bucket_plan`` is set, else cut by ``bucket_cap_mb`` in reverse registration order."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sizes = {n: p.numel() for n, p in named}
    element = named[0][1].element_size() if named else 4
    asked = train_cfg.tied_embedding_sync
    head, tied = None, None
    if tied_sync_mode(asked, train_cfg.clip_mode, world_size) == "split":
        found = _tied_head(model, named, required=asked == "split")
        if found is not None:
            head, tied = found
    cap = None
    if train_cfg.bucket_plan:
        plan = BucketPlan.read(train_cfg.bucket_plan, sizes)
        if tied is not None and asked == "auto" and not _is_alone(plan, tied, sizes[tied]):
            head, tied = None, None  # the plan splits the embedding: dense for it
    else:
        cap = max(1, int(train_cfg.bucket_cap_mb * MB) // element)
        plan = BucketPlan.from_cap([(n, sizes[n]) for n in reverse_registration_order(named)],
                                   cap, source=f"bucket_cap_mb={train_cfg.bucket_cap_mb:g}",
                                   alone=tied)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16,
             "fp16": torch.float16}[train_cfg.allreduce_dtype]
    return GradientBuckets(named, plan, world_size=world_size, group=group,
                           clip_mode=train_cfg.clip_mode, max_grad_norm=train_cfg.max_grad_norm,
                           reduce_dtype=dtype, cap_elements=cap, timeline=timeline,
                           tied_split=tied, tied_head=head)


def tied_sync_mode(asked: str, clip_mode: str, world_size: int) -> str:
    """``train.tied_embedding_sync`` resolved: 'auto' is split where it can help and applies
    (several ranks; clip_mode global_after | none), dense otherwise."""
    if asked != "auto":
        return asked
    return "split" if world_size > 1 and clip_mode in ("global_after", "none") else "dense"


def _is_alone(plan: BucketPlan, name: str, numel: int) -> bool:
    try:
        alone_bucket(plan, name, numel)
    except PlanError:
        return False
    return True


def _tied_head(model: torch.nn.Module, named: list,
               required: bool = True) -> Optional[tuple[torch.nn.Module, str]]:
    """The MLM head whose decoder weight is tied to a trainable parameter, and that
    parameter's name (tied_embedding_sync split); None (or, when required, an error) if the
    model has none."""
    for module in model.modules():
        if hasattr(module, "weight_tap") and hasattr(module, "decoder"):
            weight = module.decoder.weight
            for name, param in named:
                if param is weight:
                    return module, name
    if not required:
        return None
    raise ValueError("train.tied_embedding_sync='split' needs a model whose MLM head ties its "
                     "decoder weight to a trainable parameter and takes a weight_tap "
                     "(runtime.model.BertLMPredictionHead); use tied_embedding_sync='dense'")
