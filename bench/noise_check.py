"""``python -m bench.noise_check``: is the gradient noise scale the runtime logs the whole
gradient's B_simple? An independent recomputation from per-example gradients at checkpoints.

The run: the CPU benchmark config (2 ranks × 32 sequences, the split tied-embedding sync its
``auto`` picks on CPU) for ``--steps`` steps, a checkpoint every ``--every`` steps (the target
is set out of reach so that no run ends early; nothing else is changed), trained by
run_and_time.sh as a user would. Then at each checkpoint, in this process:

  * its weights (model.safetensors), the model in training mode (dropout as in training), fp32;
  * ``--examples`` training sequences drawn uniformly from the training shards (one fixed draw
    for every checkpoint), each one's gradient g_i of the runtime's own loss definition: the
    MLM loss is a mean over the batch's masked tokens, so sequence i contributes
    Σ_(its masked tokens) ℓ / m̄ + its NSP loss, m̄ the mean masked tokens per sequence of the
    draw - the mean of the g_i is then exactly the runtime's gradient of the draw as one batch
    (checked on a slice, dropout off: ``loss_definition_rel_err``);
  * B_simple = tr(Σ)/|G|² (McCandlish et al., appendix A's quantity, not its estimator):
    tr(Σ) = Σ|g_i − ḡ|²/(n − 1), |G|² = |ḡ|² − tr(Σ)/n (|ḡ|² is biased up by tr(Σ)/n); every
    parameter, the tied word embedding / decoder weight included (``b_simple``), and without
    it (``b_simple_non_embedding``, for comparison only); a standard error from a
    delete-one-group jackknife over 8 groups of the examples.

Compared with the B the run logged at that step (rank 0's metrics.jsonl, its window beside it)
and, from the raw per-step norms the run logged (``grad_sq_small``/``grad_sq_big``), with what
other horizons (``--horizons``) would have logged: ``ratio`` = logged / per-example. The goal
(issue 36): within 1.5× at every checkpoint after the first horizon.

    python -m bench.noise_check --out bench/results/noise_check.json

``--run-dir DIR`` takes a finished run instead of training one. About 5 minutes of training
and 2-4 minutes per checkpoint (1,024 sequences, one core) on the 2-core machine.
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from bench.common import REPO, run_runtime
from bench.harness import Benchmark, Goal, Stop, listed, option, out, run

CONFIG = REPO / "submission" / "configs" / "config_CPU_1x2x32x1.toml"
GROUPS = 8  # jackknife groups


def train(args, workdir: Path) -> Path:
    """The benchmark config's run, to ``--steps``, a checkpoint every ``--every`` steps."""
    from runtime.config import load_config
    cfg = load_config(CONFIG, [])
    batch = cfg.train.global_batch_size
    over = [f"train.max_steps={args.steps}", f"train.checkpoint_every_samples={args.every * batch}",
            f"train.checkpoint_keep={args.steps // args.every + 1}",
            "train.target_mlm_accuracy=1.0", "train.plot=false", *args.override]
    name = time.strftime("noise_check_%Y%m%d_%H%M%S")  # a fresh run directory every time
    r = run_runtime(CONFIG, args.seed, over, workdir, timeout=args.run_timeout, name=name)
    if r.get("rc") not in (0, 1):
        raise Stop(f"the training run failed (exit {r.get('rc')}): {r.get('error')}; "
                   f"its console: {workdir}/{name}_seed{args.seed}.out")
    return Path(r["run_dir"])


def logged_steps(run_dir: Path) -> dict[int, dict]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "step":
            out[rec["step"]] = rec  # a step logged twice (a resume) keeps its last record
    return out


def replay(steps: dict[int, dict], b_small: int, b_big: int, horizon: int) -> dict[int, dict]:
    """What the estimator with ``horizon`` would have logged at every step, from the raw
    per-step norms of the run."""
    from runtime.observe.noise_scale import NoiseScale
    est = NoiseScale(b_small=b_small, b_big=b_big, horizon_samples=horizon)
    out = {}
    for step in sorted(steps):
        rec = steps[step]
        small, big = rec.get("grad_sq_small"), rec.get("grad_sq_big")
        out[step] = est.figures() if small is None else est.update(small, big)
    return out


def draw(data_dir: Path, n: int, seed: int):
    """``n`` (shard, row) pairs uniformly from the training set, and the loaded shards."""
    from loaders.dataset import DataSetInfo, _read_shard
    info = DataSetInfo.read(data_dir)
    sizes = np.array(info.train_samples)
    flat = np.random.default_rng(seed).choice(sizes.sum(), size=n, replace=False)
    shard = np.searchsorted(np.cumsum(sizes), flat, side="right")
    row = flat - np.concatenate([[0], np.cumsum(sizes)[:-1]])[shard]
    pairs = np.stack([shard, row], axis=1)
    shards = {int(s): _read_shard(info.root / info.train_files[s]) for s in np.unique(shard)}
    return pairs, shards


def batches(pairs: np.ndarray, shards: dict):
    from loaders.dataset import take
    from loaders.collate import collate
    return [collate(take(shards, pairs[i:i + 1])) for i in range(len(pairs))]


def masked(batch) -> int:
    from loaders.collate import IGNORE_INDEX
    return int((batch.masked_lm_labels != IGNORE_INDEX).sum())


def b_simple(mean_sq: float, sq_sum: float, n: float) -> float:
    """tr(Σ)/|G|² from n per-example gradients: ``mean_sq`` = |ḡ|², ``sq_sum`` = Σ|g_i|².
    tr(Σ) = Σ|g_i − ḡ|²/(n − 1); |G|² = |ḡ|² − tr(Σ)/n, unbiased (E|ḡ|² = |G|² + tr(Σ)/n);
    NaN where that is not positive."""
    trace = (sq_sum - n * mean_sq) / (n - 1)
    g2 = mean_sq - trace / n
    return trace / g2 if g2 > 0 else math.nan


def example_grad(model, batch, mean_masked: float, params: list):
    """g_i of one sequence (see the module docstring), flat fp32."""
    import torch
    for p in params:
        p.grad = None
    out = model(batch.input_ids, batch.token_type_ids, batch.attention_mask,
                masked_lm_labels=batch.masked_lm_labels,
                next_sentence_labels=batch.next_sentence_labels, layout=batch.layout)
    (out.mlm_loss * (masked(batch) / mean_masked) + out.nsp_loss).backward()
    return torch.cat([p.grad.reshape(-1) for p in params])


def loss_definition_error(model, pairs: np.ndarray, shards: dict, params: list) -> float:
    """Dropout off: the mean of the g_i of the sequences ``pairs`` against the runtime's own
    gradient of them as one batch (its loss: the mean over the batch's masked tokens + the
    mean NSP loss), collated by the loaders as training collates."""
    import torch
    from loaders.collate import collate
    from loaders.dataset import take
    model.eval()
    try:
        singles = batches(pairs, shards)
        m = sum(masked(b) for b in singles) / len(singles)
        mean = sum(example_grad(model, b, m, params) for b in singles) / len(singles)
        joined = collate(take(shards, pairs))
        for p in params:
            p.grad = None
        out = model(joined.input_ids, joined.token_type_ids, joined.attention_mask,
                    masked_lm_labels=joined.masked_lm_labels,
                    next_sentence_labels=joined.next_sentence_labels, layout=joined.layout)
        out.loss.backward()
        whole = torch.cat([p.grad.reshape(-1) for p in params])
        return float((mean - whole).norm() / whole.norm())
    finally:
        model.train()


def per_example(ckpt: Path, batch_list: list, check: Optional[tuple] = None) -> dict:
    """B_simple of the whole gradient (and without the tied embedding) at ``ckpt``."""
    import torch
    from runtime.config import load_config
    from runtime.train.build import build_model
    torch.manual_seed(0)
    cfg = load_config(CONFIG, [f"model.init={ckpt}"])
    model = build_model(cfg)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    tied = model.bert.embeddings.word_embeddings.weight
    is_tied = torch.cat([torch.full((p.numel(),), p is tied) for p in params])
    mean_masked = sum(masked(b) for b in batch_list) / len(batch_list)
    n = len(batch_list)
    size = sum(p.numel() for p in params)
    group_sum = torch.zeros(GROUPS, size, dtype=torch.float64)
    group_sq = torch.zeros(GROUPS, 2, dtype=torch.float64)  # Σ|g|² (whole, tied part)
    group_n = torch.zeros(GROUPS, dtype=torch.float64)
    t0 = time.perf_counter()
    for i, b in enumerate(batch_list):
        g = example_grad(model, b, mean_masked, params).double()
        k = i % GROUPS
        group_sum[k] += g
        sq = g.square()
        group_sq[k, 0] += sq.sum()
        group_sq[k, 1] += sq[is_tied].sum()
        group_n[k] += 1
    grad_s = time.perf_counter() - t0

    def estimate(keep: torch.Tensor) -> tuple[float, float]:
        m = float(group_n[keep].sum())
        mean = group_sum[keep].sum(0) / m
        whole = float(group_sq[keep, 0].sum())
        rest = whole - float(group_sq[keep, 1].sum())
        return (b_simple(float(mean.square().sum()), whole, m),
                b_simple(float(mean[~is_tied].square().sum()), rest, m))

    everything = torch.ones(GROUPS, dtype=torch.bool)
    whole, non_emb = estimate(everything)
    jack = []
    for k in range(GROUPS):
        keep = everything.clone()
        keep[k] = False
        jack.append(estimate(keep))
    jack = np.array(jack)
    se = np.sqrt((GROUPS - 1) / GROUPS * ((jack - jack.mean(0)) ** 2).sum(0))
    mean = group_sum.sum(0) / n
    trace = (float(group_sq[:, 0].sum()) - n * float(mean.square().sum())) / (n - 1)
    rel = loss_definition_error(model, *check, params) if check else None
    return {"b_simple": whole, "b_simple_se": float(se[0]),
            "b_simple_non_embedding": non_emb, "b_simple_non_embedding_se": float(se[1]),
            "grad_sq_true": float(mean.square().sum()) - trace / n, "grad_trace_cov": trace,
            "examples": n, "mean_masked_tokens": mean_masked,
            "loss_definition_rel_err": rel, "per_example_s": round(grad_s, 1)}


@dataclass
class Checked:
    """What every checkpoint's measurement shares: the run, what it logged and the draw."""

    run_dir: Path
    steps: dict          # step -> its record in metrics.jsonl
    replays: dict        # horizon -> step -> what that horizon would have logged
    checkpoints: list    # the run's checkpoint folders, by step
    pairs: np.ndarray    # the draw: (shard, row) of every example
    shards: dict
    batch_list: list     # the draw, one batch a sequence
    b_big: int


def _step(ckpt: Path) -> int:
    return int(ckpt.name.split("_")[1])


@contextlib.contextmanager
def checked_run(r):
    """Train (or take ``--run-dir``), read its logs, replay the horizons, draw the examples."""
    import torch
    torch.set_num_threads(1)  # the machine is shared: one core for the per-example pass
    from runtime.config import load_config
    a = r.args
    cfg = load_config(CONFIG, list(a.override))
    t0 = time.perf_counter()
    a.workdir.mkdir(parents=True, exist_ok=True)
    run_dir = a.run_dir or train(a, a.workdir)
    train_s = round(time.perf_counter() - t0, 1)
    steps = logged_steps(run_dir)
    b_big = cfg.train.global_batch_size
    b_small = b_big // (cfg.system.nodes * cfg.system.ranks_per_node)
    ckpts = sorted((p for p in (run_dir / "checkpoints").glob("step_*") if p.is_dir()), key=_step)
    data = Path(cfg.data.data_dir)
    pairs, shards = draw(data if data.is_absolute() else REPO / data, a.examples, a.draw_seed)
    r.record.update(run_dir=str(run_dir), train_s=train_s, b_small=b_small, b_big=b_big)
    yield Checked(run_dir, steps, {h: replay(steps, b_small, b_big, h) for h in a.horizons},
                  ckpts, pairs, shards, batches(pairs, shards), b_big)


def measure(r, ck: Path) -> dict:
    """One checkpoint: the per-example B beside the logged and the replayed ones."""
    s: Checked = r.state
    step = _step(ck)
    first = ck == s.checkpoints[0]
    pe = per_example(ck, s.batch_list, (s.pairs[:16], s.shards) if first else None)
    log = s.steps.get(step, {})
    row = {"step": step, "samples": step * s.b_big, **pe,
           "logged": log.get("noise_scale"),
           "logged_window_samples": log.get("noise_scale_window_samples"),
           "replayed": {str(h): s.replays[h][step]["noise_scale"] for h in r.args.horizons
                        if step in s.replays[h]}}
    row["ratio"] = row["logged"] / pe["b_simple"] if row["logged"] and pe["b_simple"] else None
    return row


def progress(r, ck, row) -> str:
    return (f"  step {row['step']}: per-example B {row['b_simple']:.1f} ± "
            f"{row['b_simple_se']:.1f} (non-embedding {row['b_simple_non_embedding']:.1f}), "
            f"logged {_f(row['logged'])} over {row['logged_window_samples']} samples, ratio "
            f"{_f(row['ratio'], '.2f')}; {row['per_example_s']} s")


def summary(r) -> dict:
    """The goal (within --goal after the first horizon) and the worst ratio per horizon."""
    rows, goal = r.results, r.args.goal
    after = [x for x in rows if x["samples"] >= r.record["horizon_samples"]]
    met = None if not after else all(  # None: no checkpoint past the horizon
        x["ratio"] is not None and 1 / goal <= x["ratio"] <= goal for x in after)
    replayed = {}
    for h in r.args.horizons:
        worst = None
        for x in rows:
            v = x["replayed"].get(str(h))
            if x["samples"] < h:
                continue
            ratio = math.inf if not v else max(v / x["b_simple"], x["b_simple"] / v)
            worst = ratio if worst is None else max(worst, ratio)
        replayed[str(h)] = worst
    return {"goal_met": met,
            "worst_ratio": max((max(x["ratio"], 1 / x["ratio"]) for x in after if x["ratio"]),
                               default=None),
            "replayed_worst_ratio": replayed}


def table(rec: dict) -> str:
    horizons = list(rec["replayed_worst_ratio"])
    lines = ["", "| step | per-example B (± se) | non-embedding | logged (window) | ratio | "
             + " | ".join(f"H={h}" for h in horizons) + " |",
             "|" + "---|" * (5 + len(horizons))]
    for x in rec["checkpoints"]:
        lines.append(f"| {x['step']} | {x['b_simple']:.1f} ± {x['b_simple_se']:.1f} | "
                     f"{x['b_simple_non_embedding']:.1f} | {_f(x['logged'])} "
                     f"({x['logged_window_samples']}) | {_f(x['ratio'], '.2f')} | "
                     + " | ".join(_f(x["replayed"].get(h)) for h in horizons) + " |")
    lines.append(f"worst {_f(rec['worst_ratio'], '.2f')}x after the first horizon of "
                 f"{rec['horizon_samples']} samples; replayed worst by horizon: "
                 f"{rec['replayed_worst_ratio']}")
    return "\n".join(lines)


def fields(a) -> dict:
    from runtime.config import load_config
    cfg = load_config(CONFIG, list(a.override))
    return dict(config=str(CONFIG.relative_to(REPO)), steps=a.steps, every=a.every,
                examples=a.examples, seed=a.seed,
                horizon_samples=cfg.train.noise_scale_horizon_samples,
                tied_embedding_sync=cfg.train.tied_embedding_sync, goal=a.goal)


BENCHMARK = Benchmark(
    "noise_check", __doc__, measure, cases=lambda r: r.state.checkpoints,
    options=(option("--steps", type=int, default=300),
             option("--every", type=int, default=50, help="steps between checkpoints"),
             option("--examples", type=int, default=1024,
                    help="sequences per checkpoint (>= 256)"),
             option("--seed", type=int, default=1, help="the training run's SEED"),
             option("--draw-seed", type=int, default=12345),
             option("--horizons", type=listed(kind=int, what="horizon"),
                    default="0,256,512,1024,2048,6400",
                    help="horizons (samples) to replay from the run's raw norms"),
             option("--goal", type=float, default=1.5),
             option("--run-dir", type=Path, default=None, help="a finished run to check "
                    "instead of training one (its checkpoints and metrics.jsonl)"),
             option("--override", action="append", default=[],
                    help="a config override for the training run (repeatable)"),
             option("--run-timeout", type=float, default=1800),
             option("--workdir", type=Path, default=REPO / "results" / "noise_check"),
             out(REPO / "bench" / "results" / "noise_check.json")),
    check=lambda a: "--examples must be >= 256 (the check's method)" if a.examples < 256
    else None,
    fields=fields, setup=checked_run, results="checkpoints", progress=progress,
    summary=summary, table=table,
    goals=(Goal("within_goal_after_the_first_horizon", "the logged B within --goal (1.5x) of "
                "the per-example B at every checkpoint after the first horizon",
                lambda rec: rec["goal_met"]),),
    line=("goal_met", "worst_ratio", "wall_s"))


def main(argv=None) -> int:
    return run(BENCHMARK, argv)


def _f(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


if __name__ == "__main__":
    sys.exit(main())
