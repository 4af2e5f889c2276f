"""One rank of the gradient-bucket tests (tests/ranks/test_buckets_ranks.py), under ``mpiexec -n P``:

    python tests/dist_scripts/grad_sync.py CASE[,CASE...] DATA_DIR WORK_DIR

Every rank builds the trainer on a tiny BERT (a tied 8,192-row word embedding of 2 MiB, so
the size-cap plan splits it), takes its own batches, and computes its *local* gradient on an
independent copy of the model with plain autograd (no buckets, no communication). The local
gradients are all-gathered, and the gradient the optimizer receives (``p.grad`` times the
``grad_scale`` passed to ``optimizer.step``) must equal the formula for the
clip mode (docs/REFERENCES.md §5), computed here from the gathered gradients. Two steps per mode: the second runs on
the plan re-cut in measured production order.

Several cases run one after the other in one launch (the 2-rank ones of tests/ranks/test_buckets_ranks.py
share one start-up).

CASE:
  modes        the four clip modes, bucket_cap_mb=0.25 (the embedding split in 8 pieces), timeline
               on: formula, overlap (a bucket launched before backward ended, except
               local_before: none), gradients are views of the bucket buffer
  per-rank     the same for the two modes that clip each rank's gradient before the sum
               (local_before, bucket_before): the ones whose formula changes with the world
  accumulation global_after and bucket_before with 2 micro-batches: formula on the summed
               micro-batch gradients, nothing launched before the last micro-step
  split        train.tied_embedding_sync=split with global_after and none, and with 2
               micro-batches: formula; the decoder's share launched during backward (timeline
               lane K); the lookup's share reduced on the touched rows only
  plan         bucket_before on an explicit plan file splitting the embedding at odd offsets,
               its first piece sharing a bucket with other parameters
  order        the first-step re-cut on two branches whose gradients arrive in a different
               order on each rank (rank 1's branch ``a`` held back 0.3 s): the plan follows
               the slowest rank's ready times, not rank 0's arrival order
  plan-differs each rank reads a different plan file: every rank must stop with an error
  plan-missing rank 1's plan misses a parameter: the job must stop with an error

Rank 0 writes WORK_DIR/CASE.json for each case: what was checked, per mode.
"""
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as torch_dist  # noqa: E402

from runtime.grad_sync import reverse_registration_order  # noqa: E402
from runtime.launch.dist import init_distributed, run_guarded, shutdown  # noqa: E402
from runtime.launch.env import discover  # noqa: E402
from runtime.train.trainer import Trainer, build_model  # noqa: E402
from tests.support.tiny import tiny_config as support_tiny_config  # noqa: E402

TAU = 0.5
EPS = 1e-6  # kernels.optim_reference.CLIP_EPS, the ε of every clip coefficient
EMB = "bert.embeddings.word_embeddings.weight"


def tiny_config(data_dir, *extra):
    """The tiny model of tests/support/tiny.py (dropout off: the reference gradient must be the
    same computation), clipped at TAU, 0.25 MiB buckets (the embedding in 8), the timeline on, the tied embedding in the
    dense buckets unless a case asks for split."""
    return support_tiny_config(data_dir, f"train.max_grad_norm={TAU}", "train.bucket_cap_mb=0.25",
                               "train.timeline=true", "train.tied_embedding_sync=dense", *extra)


def local_gradient(ref, batches, accum):
    """This rank's gradient, plain autograd on ``ref``: {name: tensor}."""
    ref.zero_grad(set_to_none=True)
    for b in batches:
        out = ref(b.input_ids, b.token_type_ids, b.attention_mask,
                  masked_lm_labels=b.masked_lm_labels, next_sentence_labels=b.next_sentence_labels)
        (out.loss / accum).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def gather(grads: dict) -> list[dict]:
    """Every rank's {name: gradient}, indexed by rank."""
    names = list(grads)
    flat = torch.cat([grads[n].reshape(-1) for n in names])
    out = [torch.empty_like(flat) for _ in range(torch_dist.get_world_size())]
    torch_dist.all_gather(out, flat)
    result = []
    for f in out:
        d, o = {}, 0
        for n in names:
            d[n] = f[o:o + grads[n].numel()].view_as(grads[n])
            o += grads[n].numel()
        result.append(d)
    return result


def norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def expected(mode: str, per_rank: list[dict], plan) -> dict:
    """docs/REFERENCES.md §5, from the gathered per-rank gradients (computed in float64)."""
    P = len(per_rank)
    g = [{n: t.double() for n, t in r.items()} for r in per_rank]
    mean = {n: sum(r[n] for r in g) / P for n in g[0]}
    if mode == "none":
        return mean
    if mode == "global_after":
        c = min(1.0, TAU / (norm(mean.values()) + EPS))
        return {n: c * t for n, t in mean.items()}
    if mode == "local_before":
        cs = [min(1.0, TAU / (norm(r.values()) + EPS)) for r in g]
        return {n: sum(c * r[n] for c, r in zip(cs, g)) / P for n in g[0]}
    assert mode == "bucket_before"
    out = {n: torch.zeros_like(t).reshape(-1) for n, t in mean.items()}
    bound = TAU / math.sqrt(len(plan.buckets))
    for bucket in plan.buckets:
        pieces = [(p.name, p.start, p.stop) for p in bucket]
        for r in g:
            c = min(1.0, bound / (norm(r[n].reshape(-1)[a:b] for n, a, b in pieces) + EPS))
            for n, a, b in pieces:
                out[n][a:b] += c * r[n].reshape(-1)[a:b] / P
    return {n: out[n].view_as(mean[n]) for n in out}


class Capture:
    """Wraps optimizer.step: the effective gradient p.grad * grad_scale, by name."""

    def __init__(self, trainer):
        self.trainer, self.real = trainer, trainer.optimizer.step
        trainer.optimizer.step = self

    def __call__(self, grad_scale=1.0, **kw):
        self.grads = {n: p.grad.double() * grad_scale
                      for n, p in self.trainer.model.named_parameters()}
        return self.real(grad_scale=grad_scale, **kw)


class LaunchCounter:
    """Counts the buckets' all_reduce calls, and how many had happened at each forward."""

    def __init__(self, trainer):
        import runtime.grad_sync.buckets as rb
        import runtime.grad_sync.tied as rt
        self.calls, self.at_forward = 0, []
        self._modules = (rb, rt)
        counter = self

        class Counting:
            def all_reduce(self, *a, **k):
                counter.calls += 1
                return torch_dist.all_reduce(*a, **k)

            def __getattr__(self, name):
                return getattr(torch_dist, name)
        rb.torch_dist = rt.torch_dist = Counting()
        trainer.model.register_forward_pre_hook(lambda *_: self.at_forward.append(self.calls))

    def restore(self):
        """The modules' own torch.distributed again (the next case of this launch counts
        with a counter of its own, or not at all)."""
        for module in self._modules:
            module.torch_dist = torch_dist


def check_close(got: dict, want: dict, what: str) -> float:
    worst = 0.0
    for n in want:
        diff = float((got[n] - want[n]).abs().max())
        scale = float(want[n].abs().max()) + 1e-12
        worst = max(worst, diff / scale)
        if diff > 1e-5 * scale + 1e-9:
            raise AssertionError(f"{what}: {n} differs from the formula by {diff:.3g} "
                                 f"(max |want| {scale:.3g})")
    return worst


def run_mode(ctx, data_dir, mode, *extra, accum=1, steps=2, counter=False):
    cfg = tiny_config(data_dir, f"train.clip_mode={mode}",
                      f"train.gradient_accumulation_steps={accum}", *extra)
    trainer = Trainer(cfg, ctx)
    trainer.setup()
    torch.manual_seed(cfg.train.seed)
    ref = build_model(cfg)
    it = iter(trainer.train_loader)
    cap = Capture(trainer)
    launches = LaunchCounter(trainer) if counter else None
    rec = {"mode": mode, "steps": []}
    flat = trainer.grad_sync.flat
    for _ in range(steps):
        ref.load_state_dict(trainer.model.state_dict())
        batches = [next(it) for _ in range(accum)]
        per_rank = gather(local_gradient(ref, batches, accum))
        plan = trainer.grad_sync.plan
        want = expected(mode, per_rank, plan)
        if launches:
            launches.calls, launches.at_forward = 0, []
        m = trainer.train_step(iter(batches))
        err = check_close(cap.grads, want, f"{mode} step {m.step}")
        views = all(p.grad.untyped_storage().data_ptr() == trainer.grad_sync.flat.untyped_storage()
                    .data_ptr() for p in trainer.model.parameters())
        tl = m.extra["timeline"]
        backward_end = max(e for _, e in tl["spans"]["backward"])
        launch, ready = tl["buckets"]["launch"], tl["buckets"]["ready"]
        early = sum(1 for t in launch if t < backward_end)
        # overlap: allreduces started while backward was still producing gradients
        while_producing = sum(1 for t in launch if t < max(ready))
        step = {"step": m.step, "max_rel_err": err, "buckets": len(plan.buckets),
                "split": plan.split_parameters(), "clip_coef": m.clip_coef,
                "clip_coef_min": m.extra.get("clip_coef_min"),
                "clip_coef_mean": m.extra.get("clip_coef_mean"),
                "grad_norm": m.grad_norm, "launched_in_backward": early,
                "launched_before_last_ready": while_producing,
                "launched_in_backward_report": m.extra["buckets_launched_in_backward"],
                "grads_are_views": views, "comm_s": m.extra["comm_s"],
                "exposed_comm_s": m.extra["exposed_comm_s"],
                "launches_at_forward": launches.at_forward if launches else None,
                "launches": launches.calls if launches else None,
                "diff_from_global_after": norm((want[n] - expected("global_after", per_rank, plan)[n])
                                               for n in want),
                "lanes": len(launch), "backward_end": backward_end,
                "lane_launch": launch, "lane_bytes": tl["buckets"]["bytes"],
                "sparse_bucket": trainer.grad_sync._sparse_k,
                "tied_bytes": trainer.model.bert.embeddings.word_embeddings.weight.numel() * 4}
        rec["steps"].append(step)
    rec["plan_recut"] = trainer.grad_sync.flat is not flat
    rec["measured_order_head"] = trainer.grad_sync.measured_order[:3]
    trainer.close()
    if launches:
        launches.restore()
    return rec


def write_plan(path: Path, model, emb_cuts=(123457, 400009), shift=0):
    """A plan file: the other parameters in two buckets, the word embedding (524,288
    elements) cut at odd offsets into three pieces, the first beside the others."""
    names = reverse_registration_order(list(model.named_parameters()))
    assert names[-1] == EMB or EMB in names
    others = [n for n in names if n != EMB]
    a, b = emb_cuts
    plan = {"format": "presto-bucket-plan/1",
            "buckets": [others[:3 + shift], others[3 + shift:] + [f"{EMB}[0:{a}]"],
                        [f"{EMB}[{a}:{b}]"], [f"{EMB}[{b}:]"]]}
    path.write_text(json.dumps(plan))
    return path


class Held(torch.autograd.Function):
    """Identity whose backward waits ``seconds`` first (what reaches the layer before it is
    held back)."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class TwoBranches(torch.nn.Module):
    """``a`` and ``b`` side by side. Autograd runs the branch made last first, so rank 0
    (b then a in forward) produces a's gradients first; rank 1 makes a first, held back
    0.3 s in its backward, and produces b's first."""

    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.rank = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), rank

    def forward(self, x):
        if self.rank == 0:
            yb = self.b(x)
            ya = self.a(x)
        else:
            ya = Held.apply(self.a(x), 0.3)
            yb = self.b(x)
        return (ya + yb).pow(2).sum()


def run_order(ctx) -> dict:
    from runtime.grad_sync import BucketPlan, GradientBuckets
    model = TwoBranches(ctx.rank)
    named = list(model.named_parameters())
    plan = BucketPlan.from_cap([(n, p.numel()) for n, p in reversed(named)], 16)
    sync = GradientBuckets(model, plan, world_size=ctx.world_size, clip_mode="none",
                           cap_elements=16)
    sync.begin_step()
    model(torch.ones(2, 4)).backward()
    sync.finish()
    sync.zero_grad()  # the re-cut: a collective
    arrivals = [None] * ctx.world_size
    torch_dist.all_gather_object(arrivals, [sync.measured_order, sync.measured_ready_s])
    sync.close()
    return {"mode": "two-branches", "arrivals": arrivals, "plan_order": sync.plan.order()}


def run_case(ctx, case, data_dir, work) -> list[dict]:
    rank = ctx.rank
    results = []
    if case in ("modes", "per-rank"):
        modes = ("global_after", "local_before", "bucket_before", "none") if case == "modes" \
            else ("local_before", "bucket_before")
        for mode in modes:
            results.append(run_mode(ctx, data_dir, mode))
    elif case == "split":
        for mode, accum in (("global_after", 1), ("none", 1), ("global_after", 2)):
            rec = run_mode(ctx, data_dir, mode, "train.tied_embedding_sync=split", accum=accum,
                           steps=2 if accum == 1 else 1, counter=accum > 1)
            rec["mode"] = f"{mode}+split" + ("+accum" if accum > 1 else "")
            results.append(rec)
    elif case == "accumulation":
        for mode in ("global_after", "bucket_before"):
            results.append(run_mode(ctx, data_dir, mode, accum=2, steps=1, counter=True))
    elif case == "order":
        results.append(run_order(ctx))
    elif case in ("plan", "plan-differs", "plan-missing"):
        model = build_model(tiny_config(data_dir))
        if case == "plan":
            path = work / "plan.json"
            if rank == 0:
                write_plan(path, model)
            torch_dist.barrier()
        elif case == "plan-differs":
            path = write_plan(work / f"plan{rank}.json", model, shift=rank)
        else:
            path = write_plan(work / f"plan{rank}.json", model)
            if rank == 1:
                data = json.loads(path.read_text())
                data["buckets"][0] = data["buckets"][0][1:]  # drops a parameter
                path.write_text(json.dumps(data))
        results.append(run_mode(ctx, data_dir, "bucket_before", f'train.bucket_plan="{path}"'))
    return results


CASES = ("modes", "per-rank", "split", "accumulation", "plan", "order", "plan-differs", "plan-missing")


def main() -> None:
    cases, data_dir, work = sys.argv[1].split(","), sys.argv[2], Path(sys.argv[3])
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    ctx = init_distributed(discover(), device="cpu", timeout_s=30)
    torch.set_num_threads(1)
    for case in cases:
        results = run_case(ctx, case, data_dir, work)
        if ctx.rank == 0:
            (work / f"{case}.json").write_text(json.dumps({"world": ctx.world_size,
                                                           "results": results}, indent=1))
    shutdown()


if __name__ == "__main__":
    run_guarded(main, leave=True)
