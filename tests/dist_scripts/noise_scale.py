"""One rank of tests/ranks/test_noise_scale_ranks.py, under ``mpiexec -n P``:

    python tests/dist_scripts/noise_scale.py OUT.json

Least squares with Gaussian inputs and noise, whose per-example gradient has a known mean and
covariance: with x ~ N(0, I_d), y = ε ~ N(0, σ²) and weights δ, the per-example gradient of
½(δ·x − y)² is g = (δ·x − ε)x, so G = δ and tr(Σ) = (d+1)|δ|² + dσ² - B_simple in closed form.
The weights never move (no optimizer): every step draws from the same distribution.

The tied case (``model="tied"``): one weight W (V × d) used twice, as BERT's word embedding is -
by a lookup (``nn.Embedding``) and by a decoder (``nn.Linear``, the attribute ``decoder`` the
split sync taps): per example, a token k uniform over V rows, inputs x, z ~ N(0, I_d) and noise
ε₁, ε₂ ~ N(0, σ²), the loss ½(W_k·x − ε₁)² + ½(u·Wz − ε₂)² with a fixed vector u. Its
gradient is g = e_k ⊗ r₁x + u ⊗ r₂z (r₁, r₂ the residuals), with a = Wᵀu:
    G      = W/V + u aᵀ
    E|g|²  = (d+2)|W|²/V + dσ² + 2|a|²/V + |u|²((d+2)|a|² + dσ²)
plus an untied scalar c (loss ½(c·s − ε₃)², s ~ N(0, 1): G_c = c, E g_c² = 3c² + σ²), so
that other buckets exist beside the tied weight's; B_simple = (E|g|² − |G|²)/|G|², again in
closed form. It runs through the split tied sync
(``tied="split"``: the decoder's share and the lookup's touched rows reduced apart), the dense
one, or DDP - the noise scale must be the whole gradient's in each.

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

from types import SimpleNamespace  # noqa: E402

from runtime.grad_sync import BucketPlan, DDPSync, GradientBuckets, build_grad_sync  # noqa: E402
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


VOCAB, DT = 8, 4  # the tied case: W is VOCAB × DT


class TiedHead(nn.Module):
    """Holds the decoder, as BERT's MLM head does (what the split sync looks for)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__()
        self.decoder = nn.Linear(DT, VOCAB, bias=False)
        self.decoder.weight = weight


class TiedLeastSquares(nn.Module):
    """W used by a lookup and a decoder; see the module docstring."""

    def __init__(self, weight: torch.Tensor, u: torch.Tensor):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, DT)
        self.embedding.weight = nn.Parameter(weight.clone())
        self.head = TiedHead(self.embedding.weight)
        self.register_buffer("u", u.clone())
        self.c = nn.Parameter(torch.full((1,), C))

    def forward(self, k, x, z, s):
        return (self.embedding(k) * x).sum(1), self.head.decoder(z) @ self.u, s * self.c


C = 0.5  # the untied scalar


def tied_truth(w: torch.Tensor, u: torch.Tensor) -> float:
    w, u = w.double(), u.double()
    a = w.T @ u
    g = w / VOCAB + torch.outer(u, a)
    eg2 = ((DT + 2) * w.square().sum() / VOCAB + DT * SIGMA2 + 2 * a.square().sum() / VOCAB
           + u.square().sum() * ((DT + 2) * a.square().sum() + DT * SIGMA2)
           + 3 * C ** 2 + SIGMA2)
    g2 = g.square().sum() + C ** 2
    return float((eg2 - g2) / g2)


def tied_sync(model, ctx, sync_kind: str, tied: str):
    """The gradient sync the trainer would build for this model (runtime.grad_sync)."""
    cfg = SimpleNamespace(grad_sync=sync_kind, tied_embedding_sync=tied, clip_mode="global_after",
                          max_grad_norm=1e6, bucket_plan="",
                          bucket_cap_mb=16 * 4 / 2 ** 20)  # 16-element buckets: W in pieces
    return build_grad_sync(model, cfg, world_size=ctx.world_size, device=ctx.device,
                           reduce_dtype=torch.float32)


def run_tied_case(ctx, steps: int, accum: int, sync_kind: str, loss_scale: float, seed: int,
                  tied: str = "split") -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(VOCAB, DT, generator=g, dtype=torch.float64).float() * 0.5
    u = torch.randn(VOCAB, generator=g, dtype=torch.float64).float()
    u /= u.norm()
    model = TiedLeastSquares(w, u)
    sync = tied_sync(model, ctx, sync_kind, tied)
    split = getattr(sync, "tied", None) is not None
    if sync_kind == "buckets" and split != (tied == "split"):
        raise SystemExit(f"asked tied_embedding_sync={tied}, got split={split}")
    b_big = LOCAL_BATCH * accum * ctx.world_size
    estimator = NoiseScale(b_small=LOCAL_BATCH * accum, b_big=b_big, horizon_samples=100 * b_big)
    small_sq, big_sq = [], []
    for step in range(steps):
        sync.begin_step(loss_scale)
        for micro in range(accum):
            gen = torch.Generator().manual_seed(seed * 10_000_000 + step * 10_000
                                                + ctx.rank * 100 + micro)
            k = torch.randint(0, VOCAB, (LOCAL_BATCH,), generator=gen)
            x = torch.randn(LOCAL_BATCH, DT, generator=gen)
            z = torch.randn(LOCAL_BATCH, DT, generator=gen)
            s = torch.randn(LOCAL_BATCH, generator=gen)
            e = torch.randn(LOCAL_BATCH, 3, generator=gen) * SIGMA2 ** 0.5
            # forward inside no_sync too: DDP decides in forward whether backward syncs
            with sync.no_sync() if micro < accum - 1 else _null():
                p1, p2, p3 = sync.module(k, x, z, s)
                loss = 0.5 * ((p1 - e[:, 0]).pow(2) + (p2 - e[:, 1]).pow(2)
                              + (p3 - e[:, 2]).pow(2)).mean()
                (loss * loss_scale / accum).backward()
        report = sync.finish()
        small = float(all_reduce_sum(report.local_sq_norm.reshape(1).double())) / ctx.world_size
        big = float((sync.grad_norm().double() / loss_scale) ** 2)
        small_sq.append(small)
        big_sq.append(big)
        estimator.update(small, big)
        sync.zero_grad()
    sync.close()
    return {"small_sq": small_sq, "big_sq": big_sq, "figures": estimator.figures(),
            "b_small": estimator.b_small, "b_big": estimator.b_big, "split": split,
            "true_noise_scale": tied_truth(w, u)}


def run_case(ctx, steps: int, accum: int, sync_kind: str, clip_mode: str, loss_scale: float,
             seed: int, model: str = "ls", tied: str = "split") -> dict:
    if model == "tied":
        return run_tied_case(ctx, steps, accum, sync_kind, loss_scale, seed, tied)
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
    b_big = LOCAL_BATCH * accum * ctx.world_size
    estimator = NoiseScale(b_small=LOCAL_BATCH * accum, b_big=b_big, horizon_samples=100 * b_big)
    small_sq, big_sq = [], []
    for step in range(steps):
        sync.begin_step(loss_scale)
        for micro in range(accum):
            gen = torch.Generator().manual_seed(seed * 10_000_000 + step * 10_000
                                                + ctx.rank * 100 + micro)
            x = torch.randn(LOCAL_BATCH, D, generator=gen)
            y = torch.randn(LOCAL_BATCH, generator=gen) * SIGMA2 ** 0.5
            with sync.no_sync() if micro < accum - 1 else _null():  # forward too (DDP)
                loss = 0.5 * (sync.module(x) - y).pow(2).mean()
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
    run_guarded(main, leave=True)
