"""One rank of tests/ranks/test_tune_ranks.py's round trip: the trainer with the tuner's plan file
and the trainer with a size-cap plan take one step on the same batches from the same weights; the
gradients the optimizer receives must be equal (the plan changes when, not what).

    python tests/dist_scripts/tune_plan.py PLAN RESULT_JSON [section.key=value ...]
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from runtime.config import load_config  # noqa: E402
from runtime.launch.dist import init_distributed, run_guarded, shutdown  # noqa: E402
from runtime.launch.env import discover  # noqa: E402
from runtime.train.trainer import Trainer  # noqa: E402


def step_grads(cfg, ctx, batches):
    trainer = Trainer(cfg, ctx)
    trainer.setup()
    got = {}
    real = trainer.optimizer.step

    def capture(grad_scale=1.0, **kw):
        got.update({n: p.grad.double() * grad_scale for n, p in trainer.model.named_parameters()})
        return real(grad_scale=grad_scale, **kw)
    trainer.optimizer.step = capture
    trainer.train_step(iter(batches))
    plan = getattr(trainer.grad_sync, "plan", None)
    buckets = len(plan.buckets) if plan is not None else None
    trainer.close()
    return got, buckets


def main():
    plan, result, sets = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    ctx = init_distributed(discover(), device="cpu", timeout_s=60)
    torch.set_num_threads(1)
    base = [*sets, "train.clip_mode=global_after"]
    cfg_plan = load_config(None, base + [f'train.bucket_plan="{plan}"'])
    cfg_cap = load_config(None, base + ["train.bucket_cap_mb=0.25"])
    probe = Trainer(cfg_cap, ctx)
    probe.setup()
    batches = [next(iter(probe.train_loader))]
    probe.close()
    a, k = step_grads(cfg_plan, ctx, batches)
    b, _ = step_grads(cfg_cap, ctx, batches)
    worst = max(float((a[n] - b[n]).abs().max()) / (float(b[n].abs().max()) + 1e-12) for n in b)
    if ctx.rank == 0:
        result.write_text(json.dumps({"buckets": k, "max_rel_diff": worst}))
    shutdown()


if __name__ == "__main__":
    run_guarded(main, leave=True)
