"""The step-time model of gradient buckets: when each bucket's allreduce starts and ends, and
what the step waits for (docs/REFERENCES.md §6).

Owns:
  * ``Gradient`` / ``StepProfile``: the compute side of one step on one rank - forward,
    backward, optimizer, each parameter's gradient-ready time in production order, and the
    compute-thread costs of launching a bucket (the engine scales each bucket by 1/P, and for
    bucket_before takes its norm, on the main thread before the launch);
  * ``SyncSpec``: what the engine does with a plan - clip mode, tied-embedding sync, reduce
    dtype, the flat buffer's alignment, world size;
  * ``Instance``: the two combined over the padded flat buffer (``GradLayout``), as the solver
    and the simulator see it: cut positions, the issue time of a bucket ending at a position,
    forced cuts and the extra collectives of the split tied embedding;
  * ``simulate`` (a plan → a ``Timeline`` with every bucket's ready/issue/start/end and the
    step time) and ``chain_end`` (the same recurrence on bare cut positions, for the solver).
Never: measures, writes files or talks to other ranks. Pure numpy + runtime.grad_sync.plan.

The recurrence (one process group: collectives run one after another in issue order):

    issue_k = R(hi_k)                       the bucket's last gradient is final and every
                                            bucket before it (and itself) was scaled/launched
    start_k = max(issue_k, end_{k−1})       end_0 = −∞
    end_k   = start_k + T(bytes_k)

where T runs at 1/κ speed while backward computes (``StepProfile.comm_slowdown``: a
communication thread sharing cores with compute), at full speed after it - still a
non-decreasing function of the start, which is all the solver's exactness needs;
R(x) = ready(p(x)) + γ·x: ready(p) is the latest time at which a parameter up to p (the one
holding buffer element x−1) is final (measured with hooks, without any launch work) - the
engine launches buckets in order, each when its gradients are all final, so a bucket waits
for every gradient before its end; in production order (sorted by ready time,
``runtime.grad_sync.plan.production_order``) that is p's own - and γ·x the compute-thread
work of launching every bucket up to x (γ s/element: the 1/P pre-scale pass, plus the norm pass for
bucket_before). local_before launches nothing in backward: R(x) = B + norm(all) + γ·x.
Bytes include the flat buffer's row padding (the bucket that ends a parameter owns it).

Split tied embedding (train.tied_embedding_sync=split, clip_mode global_after | none):
  * the decoder's share (V×H, dense) is one more allreduce, issued when the decoder's
    backward produces it - after every bucket whose last gradient came before it, before the
    others (``Instance.dec_pos``); its copy and 1/P pass delay every later gradient;
  * the embedding's bucket (alone in the plan) sends a V-byte row mask (allreduce-max)
    instead of its rows, and after backward the touched rows (``StepProfile.touched_rows``)
    go out, blocking, after everything else.
The step: data + forward + backward (with launch work) + sync (what is left of the
communication, the split's finish work) + optimizer + tail (the loss allreduce, bookkeeping).

A sharded optimizer (``optim.shard``: ``SyncSpec.shard`` ranks share one update; runtime/
grad_sync/shard.py): each bucket's collective is ``ShardComm.bucket`` - a reduce-scatter where
the gradient goes to the shards' owners (NCCL: about half an allreduce's traffic), the
allreduce itself where the engine keeps it (gloo) -; the optimizer span is the step on 1/shard
of the parameters, two small allreduces (the gradient norm, the per-tensor partial norms:
``ShardComm.small``) and the parameters' all-gather (``ShardComm.gather`` of every parameter's
bytes), which the engine runs after the step, exposed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np

from runtime.choices import AFTER_MODES, CLIP_SPECS, clip_spec
from runtime.grad_sync.plan import BucketPlan, GradLayout, Piece
from runtime.calibrate.tune.costmodel import CommModel

CLIP_MODES = tuple(CLIP_SPECS)


@dataclass(frozen=True)
class Gradient:
    """One parameter's gradient as backward produces it."""

    name: str
    numel: int
    ready_s: float
    """seconds after backward started when the gradient is final (its post-accumulate hook)"""


@dataclass(frozen=True)
class StepProfile:
    """The compute side of one training step on one rank: measured (runtime.calibrate.tune.measure) or
    projected (runtime.calibrate.tune.project). Times in seconds."""

    grads: tuple[Gradient, ...]
    """every trainable parameter, in gradient-production order"""
    forward_s: float
    backward_s: float
    """backward without any bucket launch work (ends after the last gradient is final)"""
    optimizer_s: float
    """the optimizer span: global norm of the reduced gradient, step, zeroing the buffer"""
    data_s: float = 0.0
    """before forward: the next batch"""
    tail_s: float = 0.0
    """after the optimizer: the step's loss allreduce and bookkeeping"""
    element_bytes: int = 4
    """bytes of one gradient element (the gradients' dtype)"""
    prescale_s_per_element: float = 0.0
    """compute-thread seconds per element to scale a bucket by 1/P before its launch"""
    norm_s_per_element: float = 0.0
    """compute-thread seconds per element for a local norm (bucket_before, local_before)"""
    tied: Optional[str] = None
    """the tied word embedding's name (split sync)"""
    tied_rows: int = 0
    """its rows (vocabulary size V)"""
    decoder_ready_s: Optional[float] = None
    """when the decoder's share of the tied gradient is produced (after backward start)"""
    touched_rows: int = 0
    """rows of the tied embedding some rank's batch looked up (the split's sparse rows)"""
    tied_finish_s: float = 0.0
    """split sync's compute after backward: the row mask, gathering the rows, adding the
    decoder share"""
    comm_slowdown: float = 1.0
    """κ ≥ 1: an allreduce running while backward computes progresses κ times slower than
    alone (measured: CPU ranks whose communication threads share cores with compute; 1 on
    GPUs, where NCCL runs beside the compute)"""

    def sizes(self) -> dict[str, int]:
        return {g.name: g.numel for g in self.grads}

    def order(self) -> list[str]:
        return [g.name for g in self.grads]

    def total_elements(self) -> int:
        return sum(g.numel for g in self.grads)

    def compute_s(self) -> float:
        return self.data_s + self.forward_s + self.backward_s + self.optimizer_s + self.tail_s

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "grads"}
        d["grads"] = [[g.name, g.numel, g.ready_s] for g in self.grads]
        return d

    @classmethod
    def from_json(cls, d: dict) -> "StepProfile":
        kw = {k: v for k, v in d.items() if k != "grads"}
        return cls(grads=tuple(Gradient(n, int(s), float(r)) for n, s, r in d["grads"]), **kw)


@dataclass(frozen=True)
class ShardComm:
    """The collectives of a sharded step, each a T(n) model over the ranks that take part."""

    bucket: CommModel
    """one bucket's gradient to the shards' owners (n: the bucket's bytes)"""
    gather: CommModel
    """the parameters' all-gather after the step (n: every parameter's bytes)"""
    small: CommModel
    """an allreduce over the shard group (the norm, the per-tensor partial norms)"""

    @classmethod
    def from_allreduce(cls, comm: CommModel, reduction: str) -> "ShardComm":
        """From a measured allreduce over the same ranks: a reduce-scatter or an all-gather
        is half a ring allreduce - the same latency, half the rest: α + (T(n) − α)/2, still
        continuous and non-decreasing; 'allreduce' (gloo, runtime.grad_sync.shard.REDUCTION)
        keeps the allreduce for the buckets."""
        alpha = comm.alpha
        half = CommModel(tuple((n0, alpha + (a - alpha) / 2, b / 2)
                               for n0, a, b in comm.segments), comm.world_size, kind=comm.kind)
        return cls(comm if reduction == "allreduce" else half, half, comm)


@dataclass(frozen=True)
class SyncSpec:
    """What the gradient engine does with a plan."""

    clip_mode: str = "global_after"
    tied_sync: str = "dense"
    """'dense' | 'split' (already resolved from 'auto')"""
    reduce_bytes: int = 4
    """bytes per element in the allreduce dtype"""
    align: int = 1
    """elements each parameter's gradient is aligned to in the flat buffer (GradLayout)"""
    world_size: int = 2
    shard: int = 1
    """ranks that share one optimizer update (optim.shard; 1: unsharded)"""
    shard_comm: Optional[ShardComm] = None
    """the sharded step's collectives (needed when ``shard`` > 1)"""

    def __post_init__(self):
        if self.shard < 1 or (self.shard > 1 and self.shard_comm is None):
            raise ValueError(f"shard must be >= 1 and, above 1, come with its ShardComm; got "
                             f"{self.shard}")
        if self.clip_mode not in CLIP_MODES:
            raise ValueError(f"clip_mode must be one of {' | '.join(CLIP_MODES)}, "
                             f"got {self.clip_mode!r}")
        if self.tied_sync not in ("dense", "split"):
            raise ValueError(f"tied_sync must be dense | split, got {self.tied_sync!r}")
        if self.tied_sync == "split" and clip_spec(self.clip_mode).before_allreduce:
            raise ValueError(f"tied_embedding_sync split needs clip_mode {AFTER_MODES}")


def _padded(n: int, align: int) -> int:
    return -(-n // align) * align


@dataclass
class Instance:
    """One bucket problem: the flat buffer in production order and how its buckets run."""

    profile: StepProfile
    spec: SyncSpec
    comm: CommModel
    names: list
    numel: np.ndarray        # per parameter, production order
    start: np.ndarray        # buffer position of each parameter (aligned)
    end: np.ndarray          # start + padded size: the boundary cut after it
    ready: np.ndarray        # per parameter: the latest ready time up to it in this order
    gamma: float             # launch work per element (compute thread)
    backward_end: float      # backward incl. the launch work done inside it
    alone: Optional[int] = None    # index of the split tied embedding (a bucket of its own)
    dec_pos: Optional[int] = None  # buffer position: buckets ending at or before go first
    dec_issue_base: float = 0.0    # decoder share's issue time before launch shifts
    dec_bytes: int = 0
    mask_bytes: int = 0
    rows_bytes: int = 0
    tail_after_comm: float = 0.0   # the split's finish compute (after all comm)
    ready_own: Optional[np.ndarray] = None  # per parameter: its own ready time (shifted)
    allreduce: Optional[CommModel] = None   # the split tied embedding's collectives (always
    #   allreduces); ``comm`` is a bucket's: the allreduce, or ShardComm.bucket when sharded

    def __post_init__(self):
        if self.allreduce is None:
            self.allreduce = self.comm

    @classmethod
    def build(cls, profile: StepProfile, spec: SyncSpec, comm: CommModel) -> "Instance":
        grads = profile.grads
        names = [g.name for g in grads]
        numel = np.array([g.numel for g in grads], dtype=np.int64)
        padded = np.array([_padded(int(n), spec.align) for n in numel], dtype=np.int64)
        end = np.cumsum(padded)
        start = end - padded
        ready = np.array([g.ready_s for g in grads], dtype=np.float64)
        total = int(end[-1]) if len(end) else 0
        gamma = profile.prescale_s_per_element
        clip = clip_spec(spec.clip_mode)
        if clip.per_bucket:  # each bucket's own norm before its launch
            gamma += profile.norm_s_per_element
        alone = dec_pos = None
        dec_issue = 0.0
        dec_bytes = mask_bytes = rows_bytes = 0
        tail = 0.0
        launch_in_backward = gamma * total
        if spec.tied_sync == "split":
            if profile.tied is None or profile.decoder_ready_s is None:
                raise ValueError("tied_sync split needs a profile with the tied embedding and "
                                 "its decoder-ready time")
            alone = names.index(profile.tied)
            v = profile.tied_rows
            h = int(numel[alone]) // max(v, 1)
            dec_bytes = v * h * spec.reduce_bytes
            mask_bytes = v  # uint8 row mask, allreduce-max
            rows_bytes = profile.touched_rows * h * spec.reduce_bytes
            # decoder share: copy + 1/P pass on the compute thread when the tap fires; it
            # goes out after every bucket launched before it (the latest ready time so far)
            dec_prep = 2 * profile.prescale_s_per_element * v * h
            after = np.maximum.accumulate(ready) > profile.decoder_ready_s
            first_after = int(np.argmax(after)) if after.any() else len(grads)
            dec_pos = int(start[first_after]) if first_after < len(grads) else total
            dec_issue = profile.decoder_ready_s + dec_prep
            ready = ready + np.where(ready > profile.decoder_ready_s, dec_prep, 0.0)
            # the embedding's bucket computes a row mask instead of a 1/P pass; the mask pass
            # costs about what the 1/P pass would, so γ·x is kept for positions after it
            tail = profile.tied_finish_s
            launch_in_backward += dec_prep
        if clip.holds_launches:
            # nothing launches in backward; after it: the local norm of everything, then each
            # bucket's 1/P·coefficient pass and launch
            base = profile.backward_s + profile.norm_s_per_element * total
            ready = np.full_like(ready, base)
            backward_end = profile.backward_s
        else:
            backward_end = profile.backward_s + launch_in_backward
        # buckets launch in order, each when its last-arriving gradient is final: a bucket
        # ending at x can go at the latest ready time of everything before x, which is its
        # last gradient's only when the order follows the ready times (production order)
        bucket = spec.shard_comm.bucket if spec.shard > 1 else comm
        return cls(profile, spec, bucket, names, numel, start, end, np.maximum.accumulate(ready),
                   gamma, backward_end, alone, dec_pos, dec_issue, dec_bytes, mask_bytes,
                   rows_bytes, tail, ready, comm)

    # ---- cut positions -------------------------------------------------------------------
    @property
    def total(self) -> int:
        return int(self.end[-1]) if len(self.end) else 0

    def param_of(self, x: int) -> int:
        """Index of the parameter holding buffer element x − 1 (x > 0)."""
        return int(np.searchsorted(self.end, x, side="left"))

    def issue_time(self, x: int) -> float:
        """R(x): when a bucket ending at buffer position x is launched."""
        return float(self.ready[self.param_of(x)] + self.gamma * x)

    def forced_cuts(self) -> list[int]:
        if self.alone is None:
            return []
        return [int(self.start[self.alone]), int(self.end[self.alone])]

    def valid_cut(self, x: int) -> bool:
        """A cut may fall on a parameter boundary or inside a parameter's real elements (not in
        its padding, not inside the split tied embedding)."""
        if x <= 0 or x > self.total:
            return False
        j = self.param_of(x)
        if x == int(self.end[j]):
            return True
        if self.alone is not None and j == self.alone:
            return False
        return x < int(self.start[j] + self.numel[j])

    def crosses_forced(self, y: int, x: int) -> bool:
        return any(y < c < x for c in self.forced_cuts())

    def bucket_comm(self, y: int, x: int) -> float:
        if self.alone is not None and y == int(self.start[self.alone]) \
                and x == int(self.end[self.alone]):
            return float(self.allreduce.time(self.mask_bytes))
        return float(self.comm.time((x - y) * self.spec.reduce_bytes))

    # ---- the optimizer span ----------------------------------------------------------------
    def gather_bytes(self) -> int:
        """Bytes of the sharded step's parameter all-gather (every parameter, padded)."""
        return self.total * self.profile.element_bytes if self.spec.shard > 1 else 0

    def gather_s(self) -> float:
        return float(self.spec.shard_comm.gather.time(self.gather_bytes())) \
            if self.spec.shard > 1 else 0.0

    @property
    def optimizer_s(self) -> float:
        """The optimizer span: the update of 1/shard of the parameters; sharded, plus the
        two small allreduces (norm: 8 B; per-tensor partials: 2 x tensors x 8 B) and the
        all-gather."""
        p, spec = self.profile, self.spec
        if spec.shard == 1:
            return p.optimizer_s
        small = spec.shard_comm.small
        return (p.optimizer_s / spec.shard + float(small.time(8))
                + float(small.time(16 * len(self.names))) + self.gather_s())

    def run(self, start, work):
        """End of an allreduce that starts at ``start`` (seconds after backward start) and
        takes ``work`` seconds alone: κ times slower while backward computes (numbers or
        numpy arrays)."""
        k, B = self.profile.comm_slowdown, self.backward_end
        if k == 1.0:
            return start + work
        start = np.asarray(start, dtype=np.float64)
        inside = start + k * work
        out = np.where(start >= B, start + work,
                       np.where(inside <= B, inside, B + work - (B - start) / k))
        return float(out) if out.ndim == 0 else out

    def advance(self, e: float, y: int, x: int) -> float:
        """End of the communication after bucket [y, x), given ``e``, the end of what was
        issued before it (−inf: nothing). The decoder share goes first when its place in the
        issue order falls in this step."""
        if self.dec_pos is not None and y <= self.dec_pos < x:
            e = self.run(max(self.dec_issue_base + self.gamma * y, e),
                         float(self.allreduce.time(self.dec_bytes)))
        return self.run(max(self.issue_time(x), e), self.bucket_comm(y, x))

    def finish(self, e: float) -> float:
        """Sync end (seconds after backward start) from the end of the bucket chain."""
        if self.dec_pos is not None and self.dec_pos >= self.total:  # decoder after everything
            e = self.run(max(self.dec_issue_base + self.gamma * self.total, e),
                         float(self.allreduce.time(self.dec_bytes)))
        end = max(e, self.backward_end)
        if self.rows_bytes:
            end += float(self.allreduce.time(self.rows_bytes))
        return end + self.tail_after_comm

    def chain_end(self, cuts: Sequence[int]) -> float:
        """Sync end for a plan given as its sorted cut positions (the last = ``total``)."""
        e, y = -math.inf, 0
        for x in cuts:
            e = self.advance(e, y, int(x))
            y = int(x)
        return self.finish(e)

    def step_time(self, sync_end: float) -> float:
        p = self.profile
        return p.data_s + p.forward_s + sync_end + self.optimizer_s + p.tail_s

    # ---- plans <-> cuts ------------------------------------------------------------------
    def plan_from_cuts(self, cuts: Sequence[int], source: str = "tuned") -> BucketPlan:
        buckets, y = [], 0
        for x in cuts:
            pieces = []
            j = self.param_of(y + 1)
            while j < len(self.names) and int(self.start[j]) < x:
                lo = max(y, int(self.start[j])) - int(self.start[j])
                hi = min(x, int(self.start[j] + self.numel[j])) - int(self.start[j])
                if hi > lo:
                    pieces.append(Piece(self.names[j], int(lo), int(hi)))
                j += 1
            buckets.append(tuple(pieces))
            y = int(x)
        return BucketPlan(tuple(buckets), source)

    def cuts_from_plan(self, plan: BucketPlan) -> Optional[list[int]]:
        """The plan's cut positions when it follows production order (else None)."""
        if plan.order() != self.names:
            return None
        layout = GradLayout.of(plan, self.profile.sizes(), self.spec.align)
        return [hi for _, hi in layout.bounds]


# ---------------------------------------------------------------------------------------------
# full timelines


@dataclass
class BucketTiming:
    lane: str
    nbytes: int
    ready: float      # issue time (R(x)), seconds since step start
    start: float
    end: float


@dataclass
class Timeline:
    """A predicted step, seconds since step start."""

    name: str
    buckets: list[BucketTiming]
    spans: dict      # forward / backward / sync / optimizer: (start, end)
    step_s: float
    backward_end_s: float
    comm_end_s: float
    plan: Optional[BucketPlan] = None
    num_buckets: int = 0

    @property
    def exposed_s(self) -> float:
        """Time the step waits for communication after backward (and the split's finish)."""
        return self.spans["sync"][1] - self.spans["sync"][0]

    @property
    def comm_s(self) -> float:
        return sum(b.end - b.start for b in self.buckets)

    def to_json(self) -> dict:
        return {"name": self.name, "step_s": self.step_s, "exposed_s": self.exposed_s,
                "comm_s": self.comm_s, "buckets": self.num_buckets,
                "spans": self.spans,
                "lanes": [[b.lane, b.nbytes, b.ready, b.start, b.end] for b in self.buckets]}


def simulate(inst: Instance, plan: BucketPlan, name: str = "") -> Timeline:
    """The predicted timeline of ``plan`` (any order; launched strictly in plan order)."""
    p, spec = inst.profile, inst.spec
    sizes = p.sizes()
    plan.validate(sizes)
    if spec.tied_sync == "split":
        from runtime.grad_sync.plan import alone_bucket
        alone_bucket(plan, p.tied, sizes[p.tied])
    layout = GradLayout.of(plan, sizes, spec.align)
    index = {n: i for i, n in enumerate(inst.names)}
    t0 = p.data_s + p.forward_s           # backward starts here
    lanes: list[BucketTiming] = []
    e, latest = -math.inf, -math.inf
    dec_done = inst.dec_pos is None
    own = inst.ready_own if inst.ready_own is not None else inst.ready
    for k, (bucket, (lo, hi)) in enumerate(zip(plan.buckets, layout.bounds)):
        last = max(index[pc.name] for pc in bucket)
        if not dec_done and last >= _first_after(inst):
            issue = inst.dec_issue_base + inst.gamma * lo
            start = max(issue, e)
            e = inst.run(start, float(inst.allreduce.time(inst.dec_bytes)))
            lanes.append(BucketTiming("decoder share", inst.dec_bytes, t0 + issue, t0 + start,
                                      t0 + e))
            dec_done = True
        # launched strictly in plan order: when every gradient of this bucket and of the
        # buckets before it is final (in production order: the bucket's last gradient)
        latest = max([latest] + [float(own[index[pc.name]]) for pc in bucket])
        issue = latest + inst.gamma * hi
        start = max(issue, e)
        is_alone = inst.alone is not None and bucket[0].name == inst.names[inst.alone]
        nbytes = inst.mask_bytes if is_alone else (hi - lo) * spec.reduce_bytes
        e = inst.run(start, float((inst.allreduce if is_alone else inst.comm).time(nbytes)))
        lanes.append(BucketTiming(f"b{k}" + (" row mask" if is_alone else ""), nbytes,
                                  t0 + issue, t0 + start, t0 + e))
    if not dec_done:
        issue = inst.dec_issue_base + inst.gamma * inst.total
        start = max(issue, e)
        e = inst.run(start, float(inst.allreduce.time(inst.dec_bytes)))
        lanes.append(BucketTiming("decoder share", inst.dec_bytes, t0 + issue, t0 + start, t0 + e))
    comm_end = max(e, inst.backward_end)
    if inst.rows_bytes:
        start = comm_end
        comm_end = start + float(inst.allreduce.time(inst.rows_bytes))
        lanes.append(BucketTiming("touched rows", inst.rows_bytes, t0 + inst.backward_end,
                                  t0 + start, t0 + comm_end))
    sync_end = comm_end + inst.tail_after_comm
    bwd_end = inst.backward_end
    opt = inst.optimizer_s
    if spec.shard > 1:  # the all-gather ends the optimizer span
        end = t0 + sync_end + opt
        begin = end - inst.gather_s()
        lanes.append(BucketTiming("parameter all-gather", inst.gather_bytes(), begin, begin,
                                  end))
    spans = {"data": (0.0, p.data_s), "forward": (p.data_s, t0),
             "backward": (t0, t0 + bwd_end), "sync": (t0 + bwd_end, t0 + sync_end),
             "optimizer": (t0 + sync_end, t0 + sync_end + opt),
             "tail": (t0 + sync_end + opt, t0 + sync_end + opt + p.tail_s)}
    step = inst.step_time(sync_end)
    return Timeline(name or plan.source, lanes, spans, step, t0 + bwd_end, t0 + comm_end,
                    plan, len(plan.buckets))


def _first_after(inst: Instance) -> int:
    """Index of the first parameter produced after the decoder share."""
    return inst.param_of(inst.dec_pos + 1) if inst.dec_pos < inst.total else len(inst.names)


def replace_profile(profile: StepProfile, **kw) -> StepProfile:
    return replace(profile, **kw)
