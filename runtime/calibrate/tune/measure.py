"""Measurements on the current world, under the launcher that trains: each parameter's
gradient-ready time during backward, the step's compute spans, the compute-thread cost of
launching a bucket, and allreduce times over message sizes.

Owns: `measure_step` (→ ``StepProfile``: the real training step - ``runtime.train.Trainer``
on the parts ``runtime.train.build`` makes, the bucket engine's communication switched off -
timed on its own timeline; ``register_post_accumulate_grad_hook`` marks when each gradient is
final, the decoder bias's mark when the decoder's share of the tied weight is; medians over the
steps after warm-up, the slowest rank's for each span, since an allreduce waits for the last
rank; the profile's gradients in production order - sorted by those medians with
``runtime.grad_sync.plan.production_order``, the rule the engine's first-step re-cut applies
to its one step, so a plan follows the order gradients really arrive in; on a GPU every mark
is a CUDA event - ``runtime.observe.clock`` - since host times there are launch times),
`measure_allreduce` (median blocking allreduce time per size in the reduce dtype, each repeat
started together after a barrier, the slowest rank's median) and `engine_align` (the
alignment of each gradient in the engine's flat buffer). The tied embedding is the one the
engine finds (``runtime.grad_sync.tied.find_tied_head``).
Never: launches gradient allreduces during backward (what it measures is the compute alone;
runtime.calibrate.tune.simulate adds the communication), edits the model or the engine, writes
files.

``measure_step`` in named parts: ``_measuring_trainer`` (the step the tuner measures),
``_StepWatch`` (gradient-ready stamps, batch waits, looked-up rows), ``_timed_steps`` (the
per-step figures), ``_contention`` (κ) and ``_launch_costs`` (the compute thread's launch
work).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as torch_dist

from runtime.observe.clock import DeviceClock
from runtime.observe.timeline import DEFERRED
from runtime.grad_sync import GRAD_ALIGN
from runtime.model.precision import DTYPES
from runtime.grad_sync.plan import production_order
from runtime.grad_sync.tied import find_tied_head
from runtime.calibrate.tune.simulate import Gradient, StepProfile

def engine_align() -> int:
    """Elements each gradient is aligned to in the engine's flat buffer."""
    return GRAD_ALIGN


def decoder_bias(head: Optional[torch.nn.Module], named: list) -> Optional[str]:
    """The decoder's bias parameter: its gradient comes from the same autograd node as the
    decoder's share of the tied weight, so its ready time is that share's."""
    bias = getattr(getattr(head, "decoder", None), "bias", None)
    return next((n for n, p in named if p is bias), None) if bias is not None else None


def _median_max(values: list[float]) -> float:
    """The slowest rank's median (every rank passes its own list)."""
    from runtime.launch.dist import all_reduce_max, current
    ctx = current()
    med = torch.tensor([statistics.median(values)], dtype=torch.float64,
                       device=ctx.device if ctx is not None else "cpu")
    return float(all_reduce_max(med))


def _per_element(fn, numel: int, clock: DeviceClock, repeat: int = 5) -> float:
    times = []
    fn()
    for _ in range(repeat):
        clock.synchronize()
        t = time.perf_counter()
        fn()
        clock.synchronize()  # on a GPU the work, not its launch
        times.append(time.perf_counter() - t)
    return statistics.median(times) / max(numel, 1)


@dataclass
class StepMeasurement:
    profile: StepProfile
    steps: int
    warmup: int
    per_step: dict          # name -> list of per-step values (this rank), for the report
    order_source: str


def measure_step(cfg, ctx, steps: int = 6, warmup: int = 2, contention_steps: int = 3,
                 log=print) -> StepMeasurement:
    """Run ``warmup + steps`` real training steps - ``runtime.train.Trainer.train_step`` on
    the parts ``runtime.train.build`` makes, the gradient sync's communication switched off -
    and time them on the step's timeline; then ``contention_steps`` more backwards with one
    allreduce of half the gradient's size launched when backward starts, to see how much
    slower communication runs beside compute (κ).

    Per step: the batch wait (data_s), forward up to the last backward (forward_s), the last
    backward (backward_s), the sync's finish, norm and optimizer step (optimizer_s), the
    logging point's reduction spread over ``train.log_every_steps`` steps (tail_s), and when
    each gradient is final (a post-accumulate-grad hook marking the step's clock)."""
    trainer = _measuring_trainer(cfg, ctx)
    model, sync, clock = trainer.model, trainer.grad_sync, trainer.timeline.device_clock
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sizes = {n: p.numel() for n, p in named}
    found = find_tied_head(model, named, required=False)
    head, tied, lookup = found if found is not None else (None, None, None)
    watch = _StepWatch(named, clock, cfg.model.vocab_size, ctx.device,
                       pad=lookup.padding_idx if lookup is not None else None,
                       bias=decoder_bias(head, named))
    it = watch.batches(iter(trainer.train_loader))
    try:
        rec, ready = _timed_steps(cfg, ctx, trainer, watch, it, steps, warmup)
        slowdown, contention = 1.0, {}
        if ctx.world_size > 1 and contention_steps > 0:
            slowdown, contention = _contention(cfg, ctx, trainer, it, sync.flat,
                                               contention_steps, clock)
    finally:
        watch.detach()
    med = {k: _median_max(v) for k, v in rec.items() if v}
    rec["contention"] = contention
    ready_med = {n: _median_max(v) for n, v in ready.items()}
    # the production order the engine will see: by these ready times (production_order, the
    # engine's own rule for its first-step re-cut), ties in the engine's first-step order
    order = production_order(ready_med, sync.layout.order)
    first = list(sync.layout.order)
    moved = sum(a != b for a, b in zip(order, first))
    touched = int(med.get("touched_rows", 0))
    prescale, norm_cost, tied_finish = _launch_costs(sync.flat, dict(named).get(tied), touched,
                                                     clock)
    profile = StepProfile(
        grads=tuple(Gradient(n, sizes[n], ready_med[n]) for n in order),
        forward_s=med["forward_s"], backward_s=med["backward_s"], optimizer_s=med["optimizer_s"],
        data_s=med["data_s"], tail_s=med["tail_s"], element_bytes=named[0][1].element_size(),
        prescale_s_per_element=_median_max([prescale]), norm_s_per_element=_median_max([norm_cost]),
        tied=tied, tied_rows=cfg.model.vocab_size if tied else 0,
        decoder_ready_s=med.get("decoder_ready_s"), touched_rows=touched,
        tied_finish_s=_median_max([tied_finish]), comm_slowdown=slowdown)
    trainer.close()
    return StepMeasurement(profile, steps, warmup,
                           {**rec, "ready": ready, "engine_first_step_order": first},
                           f"sorted by the median ready times over {steps} steps (the slowest "
                           f"rank's); {moved} of {len(order)} positions differ from the engine's "
                           f"first-step order")


def _measuring_trainer(cfg, ctx):
    """A Trainer, set up, for the bucket engine's step as the tuner measures it: the engine's
    communication switched off by the builder (``build_parts(communicate=False)``), the
    timeline on, no checkpoints and no resume."""
    import dataclasses

    from runtime.train.build import build_parts
    from runtime.train.trainer import Trainer

    cfg = dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, grad_sync="buckets", checkpoint_every_samples=0, timeline=True))
    parts = build_parts(cfg, ctx, communicate=False, timeline=True, eval_batches=False)
    trainer = Trainer(cfg, ctx, log=lambda msg: None)
    trainer.setup(parts)
    return trainer


class _StepWatch:
    """What the measured steps are watched for, beside the timeline: when each gradient is
    final (a post-accumulate-grad hook stamping the step's own clock, so its marks compare
    with the timeline's spans), the wait for each batch, and which rows of the tied embedding
    the step's batches look up (its padding row left out: its gradient is always zero)."""

    def __init__(self, named: list, clock: DeviceClock, rows: int, device, pad: Optional[int],
                 bias: Optional[str]):
        self.clock, self.pad, self.bias = clock, pad, bias
        self.names = [n for n, _ in named]
        self.stamps: dict[str, Any] = {}
        self.waits: list[float] = []
        self.mask = torch.zeros(rows, dtype=torch.uint8, device=device)
        self.device = device
        self.handles = [p.register_post_accumulate_grad_hook(self._hook(n)) for n, p in named]

    def _hook(self, name):
        def fn(_p):
            if name not in self.stamps:
                self.stamps[name] = self.clock.now()
        return fn

    def batches(self, it):
        """The batches of ``it``, each one's wait and looked-up rows recorded."""
        while True:
            t = time.perf_counter()
            b = next(it)
            self.waits.append(time.perf_counter() - t)
            self.mask[b.input_ids.reshape(-1).to(self.device)] = 1
            yield b

    def start_step(self) -> None:
        self.stamps.clear()
        self.waits.clear()
        self.mask.zero_()

    def detach(self) -> None:
        for h in self.handles:
            h.remove()


def _timed_steps(cfg, ctx, trainer, watch: _StepWatch, it, steps: int,
                 warmup: int) -> tuple[dict[str, list], dict[str, list[float]]]:
    """``warmup + steps`` training steps, every rank starting each together; for the steps
    after the warm-up, each figure of ``measure_step``'s docstring as the slowest rank saw it
    (rec: name -> per-step values) and each gradient's ready time from the forward's end
    (ready: name -> per-step values)."""
    from runtime.launch.dist import all_reduce_max

    clock, timeline, names = watch.clock, trainer.timeline, watch.names
    rec: dict[str, list] = {k: [] for k in ("data_s", "forward_s", "backward_s", "optimizer_s",
                                            "tail_s", "decoder_ready_s", "touched_rows")}
    ready: dict[str, list[float]] = {n: [] for n in names}
    for step in range(warmup + steps):
        if ctx.world_size > 1:
            torch_dist.barrier()  # every rank starts the step together, as after a sync
        clock.synchronize()
        watch.start_step()
        record = trainer.train_step(it)
        clock.synchronize()
        spans = _figures(record)["timeline"]["spans"]
        t = time.perf_counter()
        trainer.step_log.flush()  # a logging point, spread over the steps it closes
        tail = (time.perf_counter() - t) / max(1, cfg.train.log_every_steps)
        tb, te = spans["backward"][-1]
        if watch.pad is not None:
            watch.mask[watch.pad] = 0
        # offsets from the step start, the slowest rank's each: a bucket's allreduce
        # starts when its last rank issues it
        at = {n: clock.seconds(timeline.t0, watch.stamps[n]) if n in watch.stamps else te
              for n in names}
        marks = torch.tensor([sum(watch.waits), tb, te, spans["optimizer"][-1][1] - te]
                             + [at[n] for n in names], dtype=torch.float64,
                             device=ctx.device)
        if ctx.world_size > 1:
            all_reduce_max(marks)
            all_reduce_max(watch.mask)
        if step < warmup:
            continue
        m = marks.tolist()
        rec["data_s"].append(m[0])
        rec["forward_s"].append(m[1] - m[0])
        rec["backward_s"].append(m[2] - m[1])
        rec["optimizer_s"].append(m[3])
        rec["tail_s"].append(tail)
        rec["touched_rows"].append(int(watch.mask.sum()))
        if watch.bias is not None:  # the decoder share's node
            rec["decoder_ready_s"].append(m[4 + names.index(watch.bias)] - m[1])
        for n, r in zip(names, m[4:]):
            ready[n].append(r - m[1])
    return rec, ready


def _launch_costs(flat: torch.Tensor, tied_weight: Optional[torch.Tensor], touched: int,
                  clock: DeviceClock) -> tuple[float, float, float]:
    """The launch work on the compute thread, this rank's: the engine's 1/P pass and a local
    norm per element of the flat gradient, and the tied embedding's finish (its touched rows
    gathered and the decoder's share added; 0 without a tied embedding)."""
    prescale = _per_element(lambda: flat.mul_(1.0), flat.numel(), clock)
    norm_cost = _per_element(lambda: flat.float().pow(2).sum().sqrt(), flat.numel(), clock)
    tied_finish = 0.0
    if tied_weight is not None:
        g = torch.randn_like(tied_weight)
        dec = torch.randn_like(tied_weight)

        def finish():
            m = (g != 0).any(dim=1)
            idx = m.nonzero().squeeze(1)[:touched]
            g.index_copy_(0, idx, g.index_select(0, idx))
            g.add_(dec)
        tied_finish = _per_element(finish, 1, clock)
    return prescale, norm_cost, tied_finish


def _figures(record) -> dict:
    """The step's timeline figures (read now on CUDA: the step is over)."""
    extra = record.raw_extra
    deferred = extra.get(DEFERRED)
    return deferred.resolve() if deferred is not None else extra


def _contention(cfg, ctx, trainer, it, flat, steps: int,
                clock: DeviceClock) -> tuple[float, dict]:
    """κ: how much slower an allreduce runs while backward computes than alone. One
    allreduce of half the gradient's bytes (reduce dtype) is launched as backward starts; its
    completion is stamped when its data has arrived (``runtime.clock``: the future's callback
    on gloo, an event on a stream that waits for it on NCCL). With W its time alone and B the
    backward time: done at d ≤ B gives κ = d/W; done after B (the rest at full speed) gives
    κ = B / (W − (d − B))."""
    dtype = DTYPES[trainer.body.numerics.reduce]
    buf = torch.ones(max(1, flat.numel() // 2), dtype=dtype, device=ctx.device)
    torch_dist.all_reduce(buf)
    alone = []
    for _ in range(3):
        torch_dist.barrier()
        clock.synchronize()
        t = time.perf_counter()
        torch_dist.all_reduce(buf)
        clock.synchronize()  # NCCL's all_reduce returns at enqueue
        alone.append(time.perf_counter() - t)
    W = _median_max(alone)
    ks, backward = [], []
    for _ in range(steps):
        torch_dist.barrier()
        loss, _, _ = trainer.body.forward_losses(trainer.runner.to_device(next(it)))
        tb = clock.now()
        work = torch_dist.all_reduce(buf, async_op=True)
        done = clock.after(work)
        loss.backward()
        te = clock.now()
        work.wait()
        clock.synchronize()
        for _ in range(10000):  # gloo: the callback may run just after wait() returns
            if clock.seconds(tb, done) is not None:
                break
            time.sleep(1e-4)
        flat.zero_()
        d, B = clock.seconds(tb, done), clock.seconds(tb, te)
        rest = W - (d - B)
        k = d / W if d <= B else (B / rest if rest > 0.05 * W else d / W)
        ks.append(max(1.0, k))
        backward.append(B)
    kappa = _median_max(ks)
    return kappa, {"allreduce_alone_s": W, "bytes": buf.numel() * buf.element_size(),
                   "kappa_per_step": ks, "backward_with_comm_s": backward}


def sweep_sizes(max_bytes: int, min_bytes: int = 4096, count: Optional[int] = None) -> list[int]:
    """Message sizes from ``min_bytes`` to ``max_bytes``: powers of two, or ``count`` sizes
    spread geometrically; always both ends."""
    max_bytes = max(int(max_bytes), min_bytes)
    if count is None:
        sizes, n = [], min_bytes
        while n < max_bytes:
            sizes.append(n)
            n *= 2
        sizes.append(max_bytes)
        return sizes
    count = max(2, count)
    ratio = (max_bytes / min_bytes) ** (1 / (count - 1))
    return sorted({int(round(min_bytes * ratio ** i)) for i in range(count)})


def measure_allreduce(sizes: list[int], dtype: torch.dtype, device, repeats: int = 5,
                      group: Any = None) -> list[float]:
    """Seconds per allreduce of each size (bytes, rounded to whole elements), as buckets see
    them: ``k`` allreduces issued back to back (k = 8 for messages under 1 MiB, 2 above) and
    the time to the last one's end divided by k - the cost of a message queued behind
    another, which is what a chain of buckets pays (an isolated small message can ride a
    switch's or a shaper's burst allowance and look faster than the link). Every repeat
    starts after a barrier; median per rank, the slowest rank's median."""
    out = []
    elem = torch.empty((), dtype=dtype).element_size()
    for nbytes in sizes:
        k = 8 if nbytes < 2 ** 20 else 2
        bufs = [torch.ones(max(1, nbytes // elem), dtype=dtype, device=device) for _ in range(k)]
        torch_dist.all_reduce(bufs[0], group=group)  # warm the connections and buffers
        times = []
        for _ in range(repeats):
            torch_dist.barrier(group=group)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            works = [torch_dist.all_reduce(b, group=group, async_op=True) for b in bufs]
            for w in works:
                w.wait()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t) / k)
        out.append(_median_max(times))
    return out
