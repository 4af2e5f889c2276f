"""``python -m bench.balance``: length-based load balancing on the real data set.

What it measures (each part can be skipped; every number comes from this run):

1. **Sampler arithmetic** (``--worlds``, default 8, 64, 1024; ``--modes``): for each mode
   (random, global, local, pack, offline_pack) and world size P, the plan of one epoch with
   every rank simulated in this process, on any prepared data set: rows of the data set's
   max_seq_length, local batch ``--batch`` (default 32 up to seq 128, else 16),
   ``local``/``pack`` with G = min(``--group``, P). Data sets have fewer shards than 1024
   ranks, so for P > shards each shard's rows are shuffled (seeded) and cut into P / shards
   *virtual* shards; only lengths matter here. Per step and rank:
     real      Σ len (the tokens an unpadded model computes)
     computed  rows × L, L = the rank's longest row (a padded model; packed rows when packed)
     attention Σ len² (unpadded)
     cost      the length cost (loaders/length_cost.py) of the unpadded model (varlen, Σ len²)
               and of the padded model: the CPU config model's measured defaults, or
               ``--cost-unpadded`` / ``--cost-padded`` files from python -m runtime.calibrate.length_cost
   global/local deal by the unpadded cost, pack/offline_pack by the padded one. Reported:
   padding efficiency Σ real / Σ computed (padded model; an unpadded model computes only real
   tokens, 1.0 by construction), imbalance = mean over steps of max/mean over ranks of each
   quantity, sequences per rank (offline_pack: b ± a few), the remainder (samples of the
   epoch no rank trains), in %, and the packing bound: best-fit decreasing over the *whole*
   data set into rows of the sequence length.
2. **Attention kernels** (``--attention``): one attention forward+backward at the CPU
   benchmark's shape (2 heads × 64) on real ``local`` batches, 1 thread: padded SDPA vs the
   varlen kernels of kernels/attention.py; and a whole model forward+backward (the CPU config's
   model) padded vs unpadded, the compute a training step spends on the batch.
3. **Loader throughput** (``--loader-batches``): batches/s of TrainLoader vs DaliTrainLoader
   (CPU pipeline), rank 0 of 2, per mode.
4. **Training** (``--train``): time to the CPU benchmark's target with 2 real ranks, one
   ``./run_and_time.sh`` per variant and seed (variants ``MODE`` or ``MODE+unpadded``; the
   same seed for all), timed from the MLPerf log; step time (median), padding efficiency and
   imbalance from metrics.jsonl. ``--step-time N`` instead runs N steps per variant without
   evaluation (a quick step-time comparison).

Prints a table per part and a final JSON line; writes the record to ``--out``. A benchmark,
not a test: run the timed parts alone on the machine (``flock /tmp/presto_cpu.lock ...`` on
the shared development machine).

    python -m bench.balance                                # arithmetic, kernels, loaders
    python -m bench.balance --data data/wiki512 --attention 0 --no-loaders   # seq 512 only
    python -m bench.balance --no-sim --no-loaders --attention 0 \\
        --train random,local+unpadded --seeds 42            # time to target (≈ 5 min/run)
"""
from __future__ import annotations

import contextlib
import datetime
import json
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

from bench.common import fmt, run_runtime
from bench.harness import WORKDIR, Benchmark, listed, option, out, run, seeds
from loaders.balance import MODES, PACKED_MODES, BalanceSpec, make_plan, packed_rows
from loaders.dataset import DataSetInfo, ShardPlan, TrainLoader, read_lengths
from loaders.length_cost import LengthCost, default_cost, flops_cost, imbalance, load
from basis.model_shape import shape_of
from loaders.packing import best_fit_decreasing

REPO = Path(__file__).resolve().parents[1]
CPU_CONFIG = REPO / "submission/configs/config_CPU_1x2x32x1.toml"
RESULTS = REPO / "bench/results/balance.json"
CPU_SHAPE = dict(vocab_size=30522, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=512)  # the CPU config's model (tests use it without a config)


# ------------------------------------------------------------------------ 1. arithmetic

def virtual_shards(lengths: list[np.ndarray], world: int, seed: int = 0) -> list[np.ndarray]:
    """The shards themselves when there are enough for ``world`` ranks, else each shard's
    rows shuffled and cut into ceil(world / shards) pieces."""
    pieces = -(-world // len(lengths))
    if pieces == 1:
        return list(lengths)
    rng = np.random.default_rng(seed)
    return [part for column in lengths
            for part in np.array_split(rng.permutation(column), pieces)]


def data_seq_len(info: DataSetInfo, lengths) -> int:
    """The data set's max_seq_length (stats.json), else its longest sample."""
    value = info.parameters.get("seq_len") or info.parameters.get("max_seq_length")
    return int(value) if value else int(max(int(c.max()) for c in lengths if len(c)))


def default_costs(config=CPU_CONFIG) -> dict[str, LengthCost]:
    """The length costs of ``config``'s model: measured defaults (loaders/length_costs.json)
    where they exist, else the FLOP count; 'unpadded' is the varlen (Σ len²) layout."""
    from runtime.config import load_config
    shape = shape_of(load_config(config).model)
    return {layout: default_cost(shape, layout) for layout in ("unpadded", "padded")}


def rank_rows(lengths: np.ndarray, mode: str, pack_length: int) -> list[list[int]]:
    """One rank batch's rows (lists of sequence lengths) as its model computes them: one
    sequence per row, or ``pack``'s best-fit rows."""
    if mode == "pack":
        return packed_rows(lengths, pack_length)
    return [[int(n)] for n in lengths]


def rank_costs(rows: list[list[int]], costs: dict[str, LengthCost]) -> list[float]:
    """(real, computed, Σlen², cost unpadded, cost padded) of one rank batch's rows:
    computed = rows × the longest row (a padded model)."""
    seqs = [n for row in rows for n in row]
    widest = max(sum(row) for row in rows)
    return [sum(seqs), len(rows) * widest, sum(n * n for n in seqs),
            costs["unpadded"].of_rows(rows), costs["padded"].of_rows(rows)]


def simulate(lengths: list[np.ndarray], mode: str, world: int, batch: int, group: int,
             seed: int = 42, pack_length: int = 128,
             costs: dict[str, LengthCost] | None = None) -> dict:
    """One epoch of ``mode`` at ``world`` ranks: padding efficiency, imbalance by each cost,
    sequences per rank and the remainder. The deal of global/local is by the unpadded cost
    (the model they are for), pack/offline_pack by the padded one (packed rows)."""
    costs = costs or {layout: flops_cost(CPU_SHAPE, layout) for layout in ("unpadded", "padded")}
    shards = virtual_shards(lengths, world)
    base = ShardPlan(tuple(len(s) for s in shards), world, seed)
    g = min(group, world)
    deal_cost = costs["padded" if mode in PACKED_MODES else "unpadded"]
    plan = make_plan(BalanceSpec(mode, group_size=g, pack_length=pack_length, cost=deal_cost),
                     base, shards)
    pairs = np.stack([plan.rank_batches(0, r, batch) for r in range(world)])  # [P, S, n, 2]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in shards])])
    flat = np.concatenate(shards)
    lens = np.where(pairs[..., 0] >= 0, flat[offsets[np.maximum(pairs[..., 0], 0)]
                                             + pairs[..., 1]], 0)           # [P, S, n]
    if mode in PACKED_MODES:
        rows_all = plan.all_rows(0, batch)  # offline_pack's rows; None: pack packs per batch
        table = np.empty(lens.shape[:2] + (5,))
        for r in range(world):
            for s in range(lens.shape[1]):
                real = lens[r, s] > 0
                if rows_all is None:
                    rows = rank_rows(lens[r, s][real], mode, pack_length)
                else:
                    ids = rows_all[r, s][real]
                    rows = [lens[r, s][real][ids == k].tolist() for k in range(ids.max() + 1)]
                table[r, s] = rank_costs(rows, costs)
        real, computed, attention, cost_u, cost_p = np.moveaxis(table, -1, 0)
    else:
        x = lens.astype(np.float64)
        real, attention = x.sum(-1), (x ** 2).sum(-1)
        computed = (x > 0).sum(-1) * x.max(-1)
        cost_u, cost_p = costs["unpadded"].of_lengths(x), costs["padded"].of_lengths(x)
    sequences = (lens > 0).sum(-1)
    return {"mode": mode, "world": world, "group": g if mode in ("local", "pack") else None,
            "steps": int(pairs.shape[1]), "padding_efficiency": float(real.sum() / computed.sum()),
            "imbalance_padded": imbalance(computed), "imbalance_real": imbalance(real),
            "imbalance_attention": imbalance(attention),
            "imbalance_cost_unpadded": imbalance(cost_u),
            "imbalance_cost_padded": imbalance(cost_p),
            "sequences_per_rank": [int(sequences.min()), int(sequences.max())],
            "remainder_pct": 100.0 * len(plan.remainder(0, batch)) / int(offsets[-1])}


def packing_bound(lengths: np.ndarray, pack_length: int) -> dict:
    """Best-fit decreasing over all samples at once: the best a packer of any window of
    these lengths reaches with this rule."""
    rows = len(best_fit_decreasing(np.asarray(lengths), pack_length))
    return {"rows": rows, "samples": int(len(lengths)),
            "padding_efficiency": float(lengths.sum() / (rows * pack_length)),
            "samples_longer_than_half": int((lengths > pack_length // 2).sum())}


# ---------------------------------------------------------------------- 2. attention kernels

def _time(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_attention(data_dir: Path, batches: int, batch: int, seed: int = 42) -> dict:
    import torch.nn.functional as F

    from kernels.attention import Varlen, block_diagonal, per_sequence, repad
    torch.set_num_threads(1)
    with TrainLoader(data_dir, 0, 2, batch, seed, verify=False,
                     balance=BalanceSpec("local", group_size=2)) as ld:
        samples = [next(ld) for _ in range(batches)]
    heads, d = 2, 64
    kernels = {"padded_sdpa": None, "per_sequence": per_sequence, "repad": repad,
               "block_diagonal": block_diagonal}
    out = {k: [] for k in kernels}
    for b in samples:
        lengths = b.attention_mask.sum(1)
        varlen = Varlen.from_lengths(lengths)
        qkv = [torch.randn(varlen.num_tokens, heads, d, requires_grad=True) for _ in range(3)]
        mask = b.attention_mask.bool()[:, None, None, :]
        padded = [torch.randn(b.size, heads, b.input_ids.shape[1], d, requires_grad=True)
                  for _ in range(3)]
        for name, kernel in kernels.items():
            if kernel is None:
                step = lambda: F.scaled_dot_product_attention(*padded, attn_mask=mask).sum().backward()  # noqa: E731
            else:
                step = lambda k=kernel: k(*qkv, varlen).sum().backward()  # noqa: E731
            out[name].append(_time(step, 5) * 1000)
    result = {"attention_ms": {k: statistics.median(v) for k, v in out.items()}}
    result["model_step_ms"] = bench_model(samples)
    return result


def bench_model(samples) -> dict:
    """Forward+backward of the CPU benchmark's model on the same batches, 1 thread."""
    from runtime.config import load_config
    from runtime.model.bert import BertConfig, BertForPreTraining
    m = load_config(CPU_CONFIG).model
    cfg = BertConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                     num_hidden_layers=m.num_hidden_layers,
                     num_attention_heads=m.num_attention_heads,
                     intermediate_size=m.intermediate_size,
                     max_position_embeddings=m.max_position_embeddings)
    variants = {"padded": dict(attention="padded"),
                "unpadded_repad": dict(attention="unpadded", kernel="repad"),
                "unpadded_per_sequence": dict(attention="unpadded", kernel="per_sequence")}
    out = {}
    for name, kw in variants.items():
        torch.manual_seed(0)
        model = BertForPreTraining(cfg, **kw).train()

        def step(b):
            model(b.input_ids, b.token_type_ids, b.attention_mask, b.masked_lm_labels,
                  b.next_sentence_labels).loss.backward()
            model.zero_grad(set_to_none=True)

        out[name] = statistics.median(_time(lambda b=b: step(b), 3) for b in samples) * 1000
    return out


# --------------------------------------------------------------------- 3. loader throughput

def bench_loaders(data_dir: Path, n: int, batch: int, seed: int = 42) -> list[dict]:
    rows = []
    for mode in MODES:
        kw = dict(verify=False, balance=BalanceSpec(mode, group_size=2))
        rec = {"mode": mode}
        for name in ("torch", "dali"):
            if name == "dali":
                try:
                    from loaders.dali_pipeline import DaliTrainLoader as cls
                except ImportError:
                    rec["dali_batches_per_s"] = None
                    continue
            else:
                cls = TrainLoader
            with cls(data_dir, 0, 2, batch, seed, **kw) as ld:
                for _ in range(20):
                    next(ld)
                t0 = time.perf_counter()
                for _ in range(n):
                    next(ld)
                rec[f"{name}_batches_per_s"] = n / (time.perf_counter() - t0)
        rows.append(rec)
    return rows


# ------------------------------------------------------------------------------ 4. training

def variant_overrides(variant: str) -> list[str]:
    mode, _, extra = variant.partition("+")
    if mode not in MODES or extra not in ("", "unpadded"):
        raise SystemExit(f"variant {variant!r}: use MODE or MODE+unpadded, MODE in {MODES}")
    return [f"data.balance={mode}", f"model.attention={'unpadded' if extra else 'padded'}"]


def padding_efficiency(rec: dict):
    """A training record's padding efficiency: ``padding_efficiency``, or ``pad_eff`` in the
    records written before the metrics had one name per quantity (docs/METRICS.md)."""
    return rec.get("padding_efficiency", rec.get("pad_eff"))


def parse_balance(path: Path) -> dict:
    """Median step time and the run's balance metrics from a metrics.jsonl."""
    steps = [r for r in map(json.loads, path.read_text().splitlines())
             if r.get("kind") == "step"] if path.is_file() else []
    if not steps:
        return {}
    real = sum(r.get("real_tokens_all", r["real_tokens"]) for r in steps)
    computed = sum(r.get("computed_tokens_all", r["computed_tokens"]) for r in steps)
    mean = lambda key: statistics.fmean(r[key] for r in steps if key in r)  # noqa: E731
    return {"median_step_time_s": statistics.median(r["step_time_s"] for r in steps[5:] or steps),
            "padding_efficiency": real / computed, "imbalance_tokens": mean("imbalance_tokens"),
            "imbalance_compute": mean("imbalance_compute"), "steps_measured": len(steps)}


def train(variants: list[str], seeds: list[int], workdir: Path, step_time: int,
          extra: list[str]) -> list[dict]:
    runs = []
    for seed in seeds:
        for variant in variants:
            overrides = variant_overrides(variant) + list(extra)
            if step_time:  # steps only: no evaluation, no target
                overrides += [f"train.max_steps={step_time}", "train.eval_iter_samples=10000000",
                              "train.eval_iter_start_samples=10000000"]
            vdir = workdir / variant.replace("+", "_")
            vdir.mkdir(parents=True, exist_ok=True)
            print(f"[bench.balance] {variant} seed {seed} ...", flush=True)
            rec = run_runtime(CPU_CONFIG, seed, overrides, vdir)
            rec.update(parse_balance(Path(rec["run_dir"]) / "metrics.jsonl"), variant=variant)
            runs.append(rec)
            print(f"[bench.balance] {variant} seed {seed}: {rec['status']} "
                  f"time_to_target={rec['time_to_target_s']} "
                  f"step={rec.get('median_step_time_s')}", flush=True)
    return runs


# ---------------------------------------------------------------------------------- output


def tables(rec: dict) -> str:
    """A table per part that ran."""
    out: list[str] = []
    if rec.get("simulation"):
        out.append(f"\n1. sampler arithmetic on {rec['data']} (rows of {rec['seq_len']} "
                   f"tokens), local batch {rec['batch']}, one epoch (padding efficiency of a "
                   "padded model; imbalance = mean over steps of max/mean over ranks)")
        for layout, c in rec["costs"].items():
            fit = c.get("fit_error") or {}
            err = (f"; fit: mean rel. error {fit['mean_rel_error']:.3f}, held-out "
                   f"{c['held_out_error']['mean_rel_error']:.3f}"
                   if fit and c.get("held_out_error") else "")
            out.append(f"   cost {layout}: " + " + ".join(
                f"{v:.3g}·{k}" for k, v in c["coefficients"].items() if v) + f" s ({c['source']}"
                f"{err})")
        out.append("| mode | world | G | steps | pad. eff. | imb. padded tokens | imb. real "
                   "tokens | imb. Σlen² | imb. cost unpadded | imb. cost padded | seqs/rank | "
                   "remainder % |"
                   "\n|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rec["simulation"]:
            lo, hi = r["sequences_per_rank"]
            out.append(f"| {r['mode']} | {r['world']} | {r['group'] or '-'} | {r['steps']} | "
                       f"{r['padding_efficiency']:.3f} | {r['imbalance_padded']:.4f} | "
                       f"{r['imbalance_real']:.4f} | {r['imbalance_attention']:.4f} | "
                       f"{r['imbalance_cost_unpadded']:.4f} | {r['imbalance_cost_padded']:.4f} | "
                       f"{lo if lo == hi else f'{lo}–{hi}'} | {r['remainder_pct']:.2f} |")
        b = rec["packing_bound"]
        out.append(f"packing bound (best-fit decreasing over all {b['samples']} samples into "
                   f"rows of {rec['seq_len']}): efficiency {b['padding_efficiency']:.4f} "
                   f"({b['samples_longer_than_half']} samples are longer than half a row and "
                   "cannot share one)")
    if rec.get("attention"):
        a = rec["attention"]
        out.append("\n2. attention fwd+bwd ms (2 heads × 64, 1 thread, median over batches): "
                   + ", ".join(f"{k} {v:.2f}" for k, v in a["attention_ms"].items()))
        out.append("   model fwd+bwd ms (CPU config model): "
                   + ", ".join(f"{k} {v:.1f}" for k, v in a["model_step_ms"].items()))
    if rec.get("loaders"):
        out.append("\n3. loader throughput, batches/s (rank 0 of 2)\n| mode | torch | DALI "
                   "(CPU) |\n|---|---|---|")
        for r in rec["loaders"]:
            out.append(f"| {r['mode']} | {fmt(r['torch_batches_per_s'], '.0f')} | "
                       f"{fmt(r.get('dali_batches_per_s'), '.0f')} |")
    if rec.get("training"):
        out.append("\n4. 2 real ranks, CPU benchmark\n| variant | seed | status | time to "
                   "target s | samples | median step s | pad. eff. | imb. tokens | imb. fwd time |"
                   "\n|---|---|---|---|---|---|---|---|---|")
        for r in rec["training"]:
            out.append(f"| {r['variant']} | {r['seed']} | {r['status']} | "
                       f"{fmt(r['time_to_target_s'], '.1f')} | {fmt(r.get('samples'), 'd')} | "
                       f"{fmt(r.get('median_step_time_s'), '.4f')} | "
                       f"{fmt(padding_efficiency(r), '.3f')} | "
                       f"{fmt(r.get('imbalance_tokens'), '.3f')} | "
                       f"{fmt(r.get('imbalance_compute'), '.3f')} |")
    return "\n".join(out)


def simulation(r) -> dict:
    a, info = r.args, r.state
    costs = default_costs()
    for layout, path in (("unpadded", a.cost_unpadded), ("padded", a.cost_padded)):
        if path:
            costs[layout] = load(path)
    rows = []
    for w in a.worlds:
        for mode in a.modes:
            rows.append(simulate(info.lengths, mode, w, a.batch, a.group,
                                 pack_length=info.seq_len, costs=costs))
            print(f"[bench.balance] {mode} at {w} ranks done", file=sys.stderr, flush=True)
    return {"costs": {layout: c.to_json() for layout, c in costs.items()}, "simulation": rows,
            "packing_bound": packing_bound(np.concatenate(info.lengths), info.seq_len)}


def training(r) -> dict:
    a = r.args
    workdir = a.workdir or REPO / f"results/bench_balance_{datetime.datetime.now():%Y%m%d_%H%M%S}"
    return {"training": train(a.train, a.seeds, workdir, a.step_time, a.set)}


PARTS = {
    "simulation": (lambda a: not a.no_sim, simulation),
    "attention": (lambda a: a.attention,
                  lambda r: {"attention": bench_attention(r.args.data, r.args.attention,
                                                          r.args.batch)}),
    "loaders": (lambda a: not a.no_loaders and a.loader_batches,
                lambda r: {"loaders": bench_loaders(r.args.data, r.args.loader_batches,
                                                    r.args.batch)}),
    "training": (lambda a: a.train, training),
}
"""The parts (module docstring), in order: whether the arguments ask for it, and its measure
(its fields of the record)."""


@contextlib.contextmanager
def data_set(r):
    """The data set's lengths and row length; the local batch it implies."""
    info = DataSetInfo.read(r.args.data)
    lengths = read_lengths(info)
    seq_len = data_seq_len(info, lengths)
    r.args.batch = r.args.batch or (32 if seq_len <= 128 else 16)
    r.record.update(seq_len=seq_len, batch=r.args.batch)
    yield types.SimpleNamespace(lengths=lengths, seq_len=seq_len)


def measure(r, part: str) -> dict:
    fields = PARTS[part][1](r)
    r.record.update(fields)
    return fields


BENCHMARK = Benchmark(
    "balance", __doc__, measure,
    cases=lambda r: [p for p, (wanted, _) in PARTS.items() if wanted(r.args)],
    options=(option("--data", type=Path, default=REPO / "data/cpu128"),
             option("--worlds", type=listed(kind=int, what="world size"), default="8,64,1024"),
             option("--modes", type=listed(MODES, what="mode"), default=",".join(MODES)),
             option("--batch", type=int, default=0,
                    help="local batch (0 = 32, the CPU benchmark's, up to seq 128; else 16)"),
             option("--cost-unpadded", default="", metavar="FILE",
                    help="length cost of the unpadded model (python -m "
                         "runtime.calibrate.length_cost --layout unpadded); '' = the CPU "
                         "config model's default"),
             option("--cost-padded", default="", metavar="FILE",
                    help="the same for the padded model ('' = default)"),
             option("--group", type=int, default=8, help="G of local/pack (min(G, world))"),
             option("--no-sim", action="store_true", help="skip the sampler arithmetic"),
             option("--attention", type=int, default=20, metavar="BATCHES",
                    help="attention/model timing over this many real batches (0 = skip)"),
             option("--loader-batches", type=int, default=300),
             option("--no-loaders", action="store_true"),
             option("--train", type=listed(what="variant"), default="",
                    help="variants to train, e.g. random,local+unpadded"),
             seeds("42"),
             option("--step-time", type=int, default=0, metavar="STEPS",
                    help="with --train: only this many steps per run, no eval (step time)"),
             option("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="extra override for --train runs"),
             WORKDIR, out(RESULTS)),
    fields=lambda a: {"data": str(a.data)}, setup=data_set, table=tables)


def main(argv=None) -> int:
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
