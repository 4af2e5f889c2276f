"""One rank of tests/test_noise_scale.py, under ``mpiexec -n P``:

    python tests/dist_scripts/noise_scale.py OUT.json

Least squares with Gaussian inputs and noise, whose per-example gradient has a known mean and
covariance: with x ~ N(0, I_d), y = ε ~ N(0, σ²) and weights δ, the per-example gradient of
½(δ·x − y)² is g = (δ·x − ε)x, so G = δ and tr(Σ) = (d+1)|δ|² + dσ² - B_simple in closed form.
The weights never move (no optimizer): every step draws from the same distribution.

Each case runs the real gradient sync (the bucket engine, or DDP) for N steps and records per
step the two numbers the trainer hands the noise-scale estimator - the mean over ranks of the
local squared norm the sync reported, and the averaged gradient's squared norm - plus the
estimator's final figures. Rank 0 writes OUT.json.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from runtime.grad_sync import BucketPlan, DDPSync, GradientBuckets  # noqa: E402
from runtime.launch.dist import all_reduce_sum, init_distributed, run_guarded, shutdown  # noqa: E402
from runtime.launch.env import discover  # noqa: E402
from runtime.observe.noise_scale import NoiseScale  # noqa: E402

D, SIGMA2, LOCAL_BATCH = 16, 1.0, 8


class LeastSquares(nn.Module):
    """Two weight vectors (two buckets): prediction x[:, :8]·a + x[:, 8:]·b."""

    def __init__(self, delta: torch.Tensor):
        super().__init__()
        self.a = nn.Parameter(delta[:D // 2].clone())
        self.b = nn.Parameter(delta[D // 2:].clone())

    def forward(self, x):
        return x[:, :D // 2] @ self.a + x[:, D // 2:] @ self.b


def run_case(ctx, steps: int, accum: int, sync_kind: str, clip_mode: str, loss_scale: float,
             seed: int) -> dict:
    g = torch.Generator().manual_seed(0)
    delta = torch.randn(D, generator=g, dtype=torch.float64).float()
    delta /= delta.norm()
    model = LeastSquares(delta)
    if sync_kind == "ddp":
        sync = DDPSync(model, world_size=ctx.world_size, device=ctx.device)
    else:
        named = list(model.named_parameters())
        plan = BucketPlan.from_cap([(n, p.numel()) for n, p in named], D // 2, "test")
        sync = GradientBuckets(model, plan, world_size=ctx.world_size, clip_mode=clip_mode,
                               max_grad_norm=1e6)  # never clips: every mode averages alike
    estimator = NoiseScale(b_small=LOCAL_BATCH * accum,
                           b_big=LOCAL_BATCH * accum * ctx.world_size)
    small_sq, big_sq = [], []
    for step in range(steps):
        sync.begin_step(loss_scale)
        for micro in range(accum):
            gen = torch.Generator().manual_seed(seed * 10_000_000 + step * 10_000
                                                + ctx.rank * 100 + micro)
            x = torch.randn(LOCAL_BATCH, D, generator=gen)
            y = torch.randn(LOCAL_BATCH, generator=gen) * SIGMA2 ** 0.5
            loss = 0.5 * (sync.module(x) - y).pow(2).mean()
            ctx_sync = sync.no_sync() if micro < accum - 1 else _null()
            with ctx_sync:
                (loss * loss_scale / accum).backward()
        report = sync.finish()
        local = report.local_sq_norm.reshape(1).double()
        small = float(all_reduce_sum(local)) / ctx.world_size  # the logging point's mean
        big = float((sync.grad_norm().double() / loss_scale) ** 2)
        small_sq.append(small)
        big_sq.append(big)
        estimator.update(small, big)
        sync.zero_grad()
    sync.close()
    return {"small_sq": small_sq, "big_sq": big_sq, "figures": estimator.figures(),
            "b_small": estimator.b_small, "b_big": estimator.b_big,
            "true_noise_scale": ((D + 1) * float(delta.norm()) ** 2 + D * SIGMA2)
            / float(delta.norm()) ** 2}


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main() -> None:
    out = Path(sys.argv[1])
    cases = json.loads(sys.argv[2])
    ctx = init_distributed(discover(), device="cpu", timeout_s=60)
    torch.set_num_threads(1)
    results = {name: run_case(ctx, **spec) for name, spec in cases.items()}
    if ctx.rank == 0:
        out.write_text(json.dumps(results))
    shutdown()


if __name__ == "__main__":
    run_guarded(main)
