"""Measurements on the current world, under the launcher that trains: each parameter's
gradient-ready time during backward, the step's compute spans, the compute-thread cost of
launching a bucket, and allreduce times over message sizes.

Owns: `measure_step` (→ ``StepProfile``: model and batches exactly as training builds them -
``runtime.train.trainer.build_model``, ``loaders.dataset.TrainLoader`` - gradients as views of one
flat buffer in production order as the bucket engine keeps them, the config's optimizer;
``register_post_accumulate_grad_hook`` stamps when each gradient is final; a tap on the MLM
decoder's tied weight stamps when the decoder's share is produced; medians over the steps
after warm-up, the slowest rank's for each span, since an allreduce waits for the last rank;
on a GPU every mark is a CUDA event - ``runtime.observe.clock`` - since host times there are launch
times),
`measure_allreduce` (median blocking allreduce time per size in the reduce dtype, each repeat
started together after a barrier, the slowest rank's median), `engine_align` and
`tied_embedding` (what the engine would do with this model).
Never: launches gradient allreduces during backward (what it measures is the compute alone;
runtime.calibrate.tune.simulate adds the communication), edits the model or the engine, writes files.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as torch_dist

from runtime.observe.clock import DeviceClock
from runtime.grad_sync import GRAD_ALIGN, REDUCE_DTYPES
from runtime.grad_sync.plan import BucketPlan, GradLayout
from runtime.calibrate.tune.simulate import Gradient, StepProfile

def engine_align() -> int:
    """Elements each gradient is aligned to in the engine's flat buffer."""
    return GRAD_ALIGN


def tied_embedding(model: torch.nn.Module) -> tuple[Optional[torch.nn.Module], Optional[str]]:
    """The MLM head whose decoder weight is also an embedding's weight (tied), and the
    parameter's name."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    for module in model.modules():
        decoder = getattr(module, "decoder", None)
        if isinstance(decoder, torch.nn.Linear) and id(decoder.weight) in embeddings:
            for name, param in named:
                if param is decoder.weight:
                    return module, name
    return None, None


def decoder_bias(head: Optional[torch.nn.Module], named: list) -> Optional[str]:
    """The decoder's bias parameter: its gradient comes from the same autograd node as the
    decoder's share of the tied weight, so its ready time is that share's."""
    bias = getattr(getattr(head, "decoder", None), "bias", None)
    return next((n for n, p in named if p is bias), None) if bias is not None else None


class _Tap(torch.autograd.Function):
    """Identity on the tied weight; its backward stamps when the decoder's share of the
    gradient is produced and passes it on unchanged (autograd accumulates as usual)."""

    @staticmethod
    def forward(ctx, weight, stamp):
        ctx.stamp = stamp
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        ctx.stamp()
        return grad, None


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


def optimizer_hparams(cfg) -> dict:
    """The optimizer's keyword arguments from the config (as runtime.train.trainer builds them)."""
    from runtime.optim.schedules import scaled_lr
    o = cfg.optim
    lr = scaled_lr(o.lr_scaling, o.lr, o.base_global_batch_size, cfg.train.global_batch_size) \
        if o.lr_scaling != "none" else o.lr
    common = dict(lr=lr, weight_decay=o.weight_decay, backend=o.backend)
    if o.name == "lars":
        return dict(common, momentum=o.momentum, trust_coefficient=o.trust_coefficient)
    common.update(beta1=o.beta1, beta2=o.beta2, eps=o.eps, bias_correction=o.bias_correction)
    if o.name == "lamb":
        common.update(use_nvlamb=o.use_nvlamb, trust_clamp=o.trust_clamp)
    return common


def measure_step(cfg, ctx, steps: int = 6, warmup: int = 2, contention_steps: int = 3,
                 log=print) -> StepMeasurement:
    """Run ``warmup + steps`` real training steps without communication and time them; then
    ``contention_steps`` more with one allreduce of half the gradient's size launched when
    backward starts, to see how much slower communication runs beside compute (κ)."""
    from loaders.dataset import TrainLoader
    from runtime.launch.dist import broadcast_object, broadcast_tensors
    from runtime.optim.optimizers import build_optimizer
    from runtime.train.trainer import build_model

    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg).to(ctx.device)
    broadcast_tensors(list(model.parameters()) + list(model.buffers()))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sizes = {n: p.numel() for n, p in named}
    params = dict(named)
    head, tied = tied_embedding(model)
    # gradients as views of one flat buffer (reverse registration order first, then the
    # measured order): what the bucket engine hands the optimizer
    order = [n for n, _ in reversed(named)]
    align = engine_align()

    def attach(order):
        plan = BucketPlan.from_cap([(n, sizes[n]) for n in order], 1 << 62)
        layout = GradLayout.of(plan, sizes, align)
        flat = torch.zeros(layout.total, dtype=named[0][1].dtype, device=ctx.device)
        for n, off, num in layout.segments():
            params[n].grad = flat[off:off + num].view_as(params[n])
        return flat

    flat = attach(order)
    optimizer = build_optimizer(cfg.optim.name, named, **optimizer_hparams(cfg))
    local_batch = cfg.local_batch_size(ctx.world_size)
    accum = cfg.train.gradient_accumulation_steps
    torch.manual_seed(cfg.train.seed * 1000 + ctx.rank)
    loader = TrainLoader(cfg.data.data_dir, ctx.rank, ctx.world_size, local_batch, cfg.train.seed,
                         verify=False, prefetch=cfg.data.prefetch,
                         balance=cfg.data.balance_spec(ctx.local_world_size))
    it = iter(loader)
    clock = DeviceClock(ctx.device)  # on a GPU, marks of when the work got there (events)
    stamps: dict[str, Any] = {}
    arrival: list[str] = []
    dec_stamp: list[Any] = []

    def hook(name):
        def fn(_p):
            if name not in stamps:
                stamps[name] = clock.now()
                arrival.append(name)
        return fn

    handles = [p.register_post_accumulate_grad_hook(hook(n)) for n, p in named]
    tapped = head is not None and hasattr(head, "weight_tap")
    if tapped:  # the model routes the decoder's weight through a tap: stamp it there
        head.weight_tap = lambda w: _Tap.apply(w, lambda: dec_stamp.append(clock.now()))
    bias_name = decoder_bias(head, named)
    autocast = contextlib.nullcontext()
    if cfg.train.precision != "fp32":
        dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float16
        autocast = torch.autocast(ctx.device.type, dtype=dtype)
    rows = cfg.model.vocab_size
    pad = next((m.padding_idx for m in model.modules() if isinstance(m, torch.nn.Embedding)
                and tied is not None and m.weight is params[tied]), None)
    rec: dict[str, list] = {k: [] for k in ("data_s", "forward_s", "backward_s", "optimizer_s",
                                            "tail_s", "decoder_ready_s", "touched_rows")}
    ready: dict[str, list[float]] = {n: [] for n in sizes}
    measured_order: list[str] = []
    model.train()
    names = list(sizes)
    try:
        for step in range(warmup + steps):
            if ctx.world_size > 1:
                torch_dist.barrier()  # every rank starts the step together, as after a sync
            clock.synchronize()
            t0 = clock.now()
            stamps.clear(), arrival.clear(), dec_stamp.clear()
            data = 0.0
            mask = torch.zeros(rows, dtype=torch.uint8, device=ctx.device)
            for i in range(accum):
                t = time.perf_counter()
                batch = next(it).to(ctx.device)
                clock.synchronize()  # the batch is there (a host span: loading and copying)
                data += time.perf_counter() - t
                mask[batch.input_ids.reshape(-1)] = 1
                with autocast:
                    out = model(batch.input_ids, batch.token_type_ids, batch.attention_mask,
                                masked_lm_labels=batch.masked_lm_labels,
                                next_sentence_labels=batch.next_sentence_labels,
                                layout=batch.layout)
                if i < accum - 1:
                    (out.loss / accum).backward()
                    stamps.clear(), arrival.clear(), dec_stamp.clear()
            tb = clock.now()
            (out.loss / accum).backward()
            te = clock.now()
            norm = float(flat.float().pow(2).sum().sqrt())
            coef = min(1.0, cfg.train.max_grad_norm / (norm + 1e-6)) \
                if cfg.train.max_grad_norm > 0 else 1.0
            optimizer.step(grad_scale=coef)
            flat.zero_()
            to = clock.now()
            clock.synchronize()
            if ctx.world_size > 1:
                torch_dist.barrier()  # the tail without waiting for a slower rank
            ts = time.perf_counter()
            losses = torch.stack([out.loss.detach(), out.mlm_loss.detach(),
                                  out.nsp_loss.detach()]).float()
            if ctx.world_size > 1:
                torch_dist.all_reduce(losses)
            losses.tolist()
            tt = time.perf_counter()
            if pad is not None:
                mask[pad] = 0

            def at(mark):
                return clock.seconds(t0, mark)
            # offsets from the step start, the slowest rank's each: a bucket's allreduce
            # starts when its last rank issues it
            marks = torch.tensor([data, at(tb), at(te), at(to) - at(te),
                                  at(dec_stamp[0]) if dec_stamp else -1.0]
                                 + [at(stamps.get(n, te)) for n in names], dtype=torch.float64,
                                 device=ctx.device)
            if ctx.world_size > 1:
                torch_dist.all_reduce(marks, op=torch_dist.ReduceOp.MAX)
                torch_dist.all_reduce(mask, op=torch_dist.ReduceOp.MAX)
            if step == 0:
                measured_order = broadcast_object(list(arrival))  # rank 0's, as the engine
                missing = [n for n in order if n not in set(measured_order)]
                order = measured_order + missing
                flat = attach(order)
                optimizer = build_optimizer(cfg.optim.name, named, **optimizer_hparams(cfg))
            if step < warmup:
                continue
            m = marks.tolist()
            rec["data_s"].append(m[0])
            rec["forward_s"].append(m[1] - m[0])
            rec["backward_s"].append(m[2] - m[1])
            rec["optimizer_s"].append(m[3])
            rec["tail_s"].append(tt - ts)
            rec["touched_rows"].append(int(mask.sum()))
            if m[4] >= 0:
                rec["decoder_ready_s"].append(m[4] - m[1])
            elif head is not None and bias_name is not None:  # same node as the decoder share
                rec["decoder_ready_s"].append(m[5 + names.index(bias_name)] - m[1])
            for n, r in zip(names, m[5:]):
                ready[n].append(r - m[1])
        slowdown, contention = 1.0, {}
        if ctx.world_size > 1 and contention_steps > 0:
            slowdown, contention = _contention(cfg, ctx, model, it, flat, autocast,
                                               contention_steps, clock)
    finally:
        for h in handles:
            h.remove()
        if tapped:
            head.weight_tap = None
        if hasattr(loader, "close"):
            loader.close()
    med = {k: _median_max(v) for k, v in rec.items() if v}
    rec["contention"] = contention
    ready_med = {n: _median_max(v) for n, v in ready.items()}
    # launch work on the compute thread: the engine's 1/P pass and a local norm, per element
    probe = flat
    prescale = _per_element(lambda: probe.mul_(1.0), probe.numel(), clock)
    norm_cost = _per_element(lambda: probe.float().pow(2).sum().sqrt(), probe.numel(), clock)
    tied_finish = 0.0
    if tied is not None:
        w = params[tied]
        g = torch.randn_like(w)
        dec = torch.randn_like(w)
        touched = int(med.get("touched_rows", 0))

        def finish():
            m = (g != 0).any(dim=1)
            idx = m.nonzero().squeeze(1)[:touched]
            g.index_copy_(0, idx, g.index_select(0, idx))
            g.add_(dec)
        tied_finish = _per_element(finish, 1, clock)
    profile = StepProfile(
        grads=tuple(Gradient(n, sizes[n], ready_med[n]) for n in order),
        forward_s=med["forward_s"], backward_s=med["backward_s"], optimizer_s=med["optimizer_s"],
        data_s=med["data_s"], tail_s=med["tail_s"], element_bytes=named[0][1].element_size(),
        prescale_s_per_element=_median_max([prescale]), norm_s_per_element=_median_max([norm_cost]),
        tied=tied, tied_rows=rows if tied else 0,
        decoder_ready_s=med.get("decoder_ready_s"), touched_rows=int(med.get("touched_rows", 0)),
        tied_finish_s=_median_max([tied_finish]), comm_slowdown=slowdown)
    # the production order must follow the ready times (ties keep the measured order)
    return StepMeasurement(profile, steps, warmup, {**rec, "ready": ready},
                           "measured (rank 0's, as the engine re-cuts)")


def _contention(cfg, ctx, model, it, flat, autocast, steps: int,
                clock: DeviceClock) -> tuple[float, dict]:
    """κ: how much slower an allreduce runs while backward computes than alone. One
    allreduce of half the gradient's bytes (reduce dtype) is launched as backward starts; its
    completion is stamped when its data has arrived (``runtime.observe.clock``: the future's callback
    on gloo, an event on a stream that waits for it on NCCL). With W its time alone and B the
    backward time: done at d ≤ B gives κ = d/W; done after B (the rest at full speed) gives
    κ = B / (W − (d − B))."""
    dtype = REDUCE_DTYPES[cfg.train.allreduce_dtype]
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
        batch = next(it).to(ctx.device)
        with autocast:
            out = model(batch.input_ids, batch.token_type_ids, batch.attention_mask,
                        masked_lm_labels=batch.masked_lm_labels,
                        next_sentence_labels=batch.next_sentence_labels, layout=batch.layout)
        tb = clock.now()
        work = torch_dist.all_reduce(buf, async_op=True)
        done = clock.after(work)
        out.loss.backward()
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
