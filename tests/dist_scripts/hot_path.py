"""One rank of tests/ranks/test_hot_path.py, under ``mpiexec -n P`` (or alone):

    python tests/dist_scripts/hot_path.py CASE[,CASE...] DATA_DIR WORK_DIR

Several cases run one after the other in one launch (one start-up and one compile for all).

CASE:
  equal   the default pairing - bucket engine + fused optimizer on one shared gradient buffer
          (optim.backend auto, grad_sync buckets) - against the reference: a copy of the model
          stepped by the reference LAMB after plain averaging (each parameter's gradient
          all-reduced and divided by P) and the global clip, for several steps; with and
          without gradient accumulation and split tied-embedding sync. Also: the optimizer's
          gradient buffer *is* the sync's, before and after the first-step re-cut.
  count   what one ordinary step does, counted: collectives (every torch.distributed call),
          host reads of tensors (item / tolist / float / int / bool) and gradients copied into
          or out of the gradient buffer (a TorchFunctionMode, which torch.compile traces
          through), and allocations of half a gradient or more after backward (the profiler's
          memory events inside the sync's finish, the norm, the optimizer step, zero_grad);
          then collectives and reads at a logging point (StepLog.flush). All of it on the
          simulated device of runtime.observe.hostsync, which records what would stall or crash on a
          GPU - host syncs (nonzero, reads, blocking copies) and host tensors in collectives -
          from set-up to evaluation, for the padded, unpadded and packed paths.

Rank 0 writes WORK_DIR/CASE.json for each case.
"""
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as torch_dist  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from kernels.optim_reference import clip_coefficient  # noqa: E402
from runtime.launch import dist as dist_module  # noqa: E402
from runtime.launch.dist import init_distributed, run_guarded, shutdown  # noqa: E402
from runtime.observe.hostsync import SIM_DEVICE, HostSyncs  # noqa: E402
from runtime.launch.env import discover  # noqa: E402
from runtime.optim.optimizers import build_optimizer  # noqa: E402
from runtime.train.build import optimizer_hparams  # noqa: E402
from runtime.train.trainer import Trainer, build_model  # noqa: E402
from tests.support.capture import Collectives  # noqa: E402
from tests.support.tiny import tiny_config as support_tiny_config  # noqa: E402

TAU = 0.5
READS = ("item", "tolist", "__float__", "__int__", "__bool__", "numpy", "__index__")


def tiny_config(data_dir, *extra):
    """The tiny model of tests/support/tiny.py on the default pairing (optim.backend auto: the
    compiled fused step; grad_sync buckets), clipped at TAU, 1 MB buckets (the embedding split)."""
    return support_tiny_config(data_dir, "optim.backend=auto", f"train.max_grad_norm={TAU}",
                               "train.bucket_cap_mb=1", "optim.lr=0.02", *extra)


def reference_step(ref, opt, batches, accum, world, lr):
    """Plain data parallelism: autograd, allreduce of every gradient / P, global clip, step."""
    ref.zero_grad(set_to_none=True)
    for b in batches:
        out = ref(b.input_ids, b.token_type_ids, b.attention_mask,
                  masked_lm_labels=b.masked_lm_labels, next_sentence_labels=b.next_sentence_labels)
        (out.loss / accum).backward()
    grads = [p.grad for p in ref.parameters()]
    for g in grads:
        torch_dist.all_reduce(g)
        g.div_(world)
    coef, _ = clip_coefficient(grads, TAU)
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step(grad_scale=coef)


def case_equal(ctx, data_dir):
    results = []
    for accum, tied in ((1, "auto"), (2, "auto"), (1, "dense"), (2, "dense")):
        cfg = tiny_config(data_dir, f"train.gradient_accumulation_steps={accum}",
                          f"train.tied_embedding_sync={tied}")
        trainer = Trainer(cfg, ctx)
        trainer.setup()
        torch.manual_seed(cfg.train.seed)
        ref = build_model(cfg)
        ref.load_state_dict(trainer.model.state_dict())
        opt = build_optimizer(cfg.optim.name, list(ref.named_parameters()),
                              **{**optimizer_hparams(cfg), "backend": "reference"})
        it = iter(trainer.train_loader)
        shared, worst = [], 0.0
        for step in range(4):
            batches = [next(it) for _ in range(accum)]
            lr = trainer.schedule(step)
            trainer.train_step(iter(batches))
            reference_step(ref, opt, batches, accum, ctx.world_size, lr)
            for (n, p), q in zip(trainer.model.named_parameters(), ref.parameters()):
                if n.endswith("attention.self.key.bias"):
                    # Its gradient is zero in exact arithmetic (softmax over keys ignores the
                    # per-query constant q·b), so in floats it is rounding noise, which Adam's
                    # m/√v turns into O(lr) steps of either sign: no reference to compare with.
                    continue
                err = float((p - q).abs().max() / (q.abs().max() + 1e-12))
                worst = max(worst, err)
            binding = trainer.optimizer.flat_binding
            (part,) = binding.parts
            shared.append(part.buffers.grads is trainer.grad_sync.flat and
                          not binding.external_grads and all(
                              p.grad.data_ptr() == v.data_ptr()
                              for p, v in zip(part.params, part.grad_views)))
        results.append({"accum": accum, "tied": tied, "max_rel_err": worst, "shared": shared,
                        "split": trainer.grad_sync.tied is not None,
                        "recut": trainer.grad_sync.layout_version})
        trainer.close()
    return results


class HostReads(TorchFunctionMode):
    """Host reads of tensors, and the elements copy ops move into or out of the gradient
    buffer ``grads`` from or to other memory (a gradient copied)."""

    def __init__(self, grads: torch.Tensor):
        super().__init__()
        self.reads: list[str] = []
        self.copied = 0
        self._grads = grads.untyped_storage().data_ptr()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            self.reads.append(name)
        elif name in ("copy_", "index_copy_") and len(args) > 1:
            dst, src = args[0], args[-1]
            if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
                inside = [t.untyped_storage().data_ptr() == self._grads for t in (dst, src)]
                if inside[0] != inside[1]:
                    self.copied += src.numel()
        return func(*args, **(kwargs or {}))


AFTER_BACKWARD = "presto.test.after_backward"


def mark_after_backward(trainer) -> None:
    """Run the sync's finish, the norm, the optimizer step and zero_grad inside a profiler
    range, so allocations there can be told from the forward/backward's activations."""
    from torch.profiler import record_function

    def wrap(obj, name):
        real = getattr(obj, name)

        def marked(*a, **k):
            with record_function(AFTER_BACKWARD):
                return real(*a, **k)
        setattr(obj, name, marked)
    for obj, name in ((trainer.grad_sync, "finish"), (trainer.grad_sync, "grad_norm"),
                      (trainer.grad_sync, "zero_grad"), (trainer.optimizer, "step")):
        wrap(obj, name)


def big_allocations(prof, threshold_bytes: int) -> list[str]:
    """Allocations of at least ``threshold_bytes`` made inside an AFTER_BACKWARD range."""
    out = []
    for e in prof.events():
        if (e.cpu_memory_usage or 0) < threshold_bytes:
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name != AFTER_BACKWARD:
            parent = parent.cpu_parent
        if parent is not None:
            out.append(f"{e.name} {e.cpu_memory_usage} B")
    return out


def events(syncs, start: int) -> list[str]:
    return [str(e) for e in syncs.events[start:]]


def case_count(ctx, data_dir):
    ctx = simulated(ctx)
    with HostSyncs(SIM_DEVICE) as syncs:
        out = count_default_step(ctx, data_dir, syncs)
        out["paths"] = {name: count_path(ctx, data_dir, syncs, *extra) for name, extra in (
            ("unpadded", ["model.attention=unpadded"]), ("packed", ["data.balance=pack"]))}
    return out


def simulated(ctx):
    """This rank's context with the simulated GPU of runtime.observe.hostsync as its device."""
    ctx = dataclasses.replace(ctx, device=SIM_DEVICE, simulates_cuda=True)
    dist_module._CTX = ctx
    return ctx


def count_default_step(ctx, data_dir, syncs):
    cfg = tiny_config(data_dir, "train.log_every_steps=100")
    n = len(syncs.events)
    trainer = Trainer(cfg, ctx)
    trainer.setup()
    setup = events(syncs, n)
    it = trainer.balance_meter.wrap(iter(trainer.train_loader))
    for _ in range(2):  # the first step measures the production order and re-cuts the plan
        trainer.train_step(it)
    trainer.step_log.flush()
    batches = [next(it) for _ in range(4)]  # the data is read before the counted steps
    sync = trainer.grad_sync
    grad_elements = sync.flat.numel()
    coll = Collectives()
    mark_after_backward(trainer)
    steps = []
    for i, b in enumerate(batches):
        coll.reset()
        n = len(syncs.events)
        # The first two steps under the profiler alone (the fused passes compiled, as in a
        # run), then two under the function mode: dynamo cannot trace through it and runs the
        # passes eagerly from then on, with their temporaries, so it must come last.
        if i >= 2:
            reads = HostReads(sync.flat)
            with reads:
                trainer.train_step(iter([b]))
            steps.append({"collectives": dict(coll.calls), "reads": reads.reads,
                          "copied_elements": reads.copied})
        else:
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                trainer.train_step(iter([b]))
            steps.append({"collectives": dict(coll.calls),
                          "big_allocations": big_allocations(prof, grad_elements * 4 // 2)})
        steps[-1]["syncs"] = events(syncs, n)
    coll.reset()
    n = len(syncs.events)
    reads = HostReads(sync.flat)
    with reads:
        logged = trainer.step_log.flush()
    flush = {"collectives": dict(coll.calls), "reads": len(reads.reads), "logged": len(logged),
             "losses": [m.loss for m in logged], "syncs": events(syncs, n),
             "noise": [{k: m.extra.get(k) for k in ("noise_scale", "grad_sq_true",
                                                   "grad_trace_cov")} for m in logged]}
    n = len(syncs.events)
    trainer.evaluate()
    tied = sync.tied
    out = {"steps": steps, "flush": flush, "buckets": sync.num_buckets,
           "split": tied is not None, "grad_elements": grad_elements,
           "tied_capacity_elements": 0 if tied is None else tied.max_rows * tied.param.shape[1],
           "world": ctx.world_size, "setup_syncs": setup, "eval_syncs": events(syncs, n)}
    coll.restore()
    trainer.close()
    return out


def count_path(ctx, data_dir, syncs, *extra):
    """Another compute path under the simulated device: set-up, two steps (the re-cut), two
    counted steps, a logging point and an evaluation."""
    trainer = Trainer(tiny_config(data_dir, "train.log_every_steps=100", *extra), ctx)
    n = len(syncs.events)
    trainer.setup()
    out = {"setup_syncs": events(syncs, n)}
    it = trainer.balance_meter.wrap(iter(trainer.train_loader))
    for _ in range(2):
        trainer.train_step(it)
    batches = [next(it) for _ in range(2)]
    n = len(syncs.events)
    for b in batches:
        trainer.train_step(iter([b]))
    out["step_syncs"] = events(syncs, n)
    n = len(syncs.events)
    logged = trainer.step_log.flush()
    out["flush_syncs"], out["logged"] = events(syncs, n), len(logged)
    n = len(syncs.events)
    trainer.evaluate()
    out["eval_syncs"] = events(syncs, n)
    trainer.close()
    return out


CASES = {"equal": case_equal, "count": case_count}


def main() -> None:
    cases, data_dir, work = sys.argv[1].split(","), sys.argv[2], Path(sys.argv[3])
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    if "count" in cases:  # it puts the rank on the simulated device: after every other case
        cases = [c for c in cases if c != "count"] + ["count"]
    ctx = init_distributed(discover(), device="cpu", timeout_s=60)
    torch.set_num_threads(1)
    for case in cases:
        result = CASES[case](ctx, data_dir)
        if ctx.rank == 0:
            (work / f"{case}.json").write_text(json.dumps(result, indent=1))
    shutdown()


if __name__ == "__main__":
    run_guarded(main, leave=True)
