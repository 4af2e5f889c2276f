"""``python -m bench.balance``: length-based load balancing on the real data set.

What it measures (each part can be skipped; every number comes from this run):

1. **Sampler arithmetic** (``--worlds``): for each mode (random, global, local, pack) and
   world size P, the plan of one epoch with every rank simulated in this process, local
   batch ``--batch``, ``local``/``pack`` with G = min(``--group``, P). Data sets have fewer
   shards than 1024 ranks, so for P > shards each shard's rows are shuffled (seeded) and cut
   into P / shards *virtual* shards; only lengths matter here. Per step and rank:
     real      Σ len (the tokens an unpadded model computes)
     computed  rows × L, L = the rank's longest row (a padded model; ``pack``: packed rows)
     attention Σ len² (unpadded) — the attention-aware cost proxy
   Reported: padding efficiency Σ real / Σ computed (padded model; an unpadded model computes
   only real tokens, efficiency 1.0 by construction), imbalance = mean over steps of max/mean
   over ranks of ``computed`` (padded cost), of ``real`` (unpadded cost) and of ``attention``;
   and the remainder (samples of the epoch no rank trains), in %. Also the packing bound:
   best-fit decreasing over the *whole* data set into rows of the sequence length, the best a
   packer of any batch could do on these lengths.
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
    python -m bench.balance --no-sim --no-loaders --attention 0 \\
        --train random,local+unpadded --seeds 42            # time to target (≈ 5 min/run)
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.time_to_accuracy import _f
from loaders.balance import MODES, BalanceSpec, make_plan
from loaders.collate import best_fit_rows
from loaders.dataset import DataSetInfo, ShardPlan, TrainLoader, read_lengths

REPO = Path(__file__).resolve().parents[1]
CPU_CONFIG = REPO / "submission/configs/config_CPU_1x2x32x1.toml"
RESULTS = REPO / "bench/results/balance.json"


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


def rank_costs(lengths: np.ndarray, mode: str, pack_length: int) -> tuple[int, int, int]:
    """(real, computed, attention) of one rank's batch with these sample lengths."""
    real, attention = int(lengths.sum()), int((lengths ** 2).sum())
    if mode == "pack":
        rows = best_fit_rows(lengths, pack_length)
        return real, len(rows) * max(int(lengths[r].sum()) for r in rows), attention
    return real, len(lengths) * int(lengths.max()), attention


def simulate(lengths: list[np.ndarray], mode: str, world: int, batch: int, group: int,
             seed: int = 42, pack_length: int = 128) -> dict:
    shards = virtual_shards(lengths, world)
    base = ShardPlan(tuple(len(s) for s in shards), world, seed)
    g = min(group, world)
    plan = make_plan(BalanceSpec(mode, group_size=g, pack_length=pack_length), base, shards)
    pairs = np.stack([plan.rank_batches(0, r, batch) for r in range(world)])  # [P, S, b, 2]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in shards])])
    lens = np.concatenate(shards)[offsets[pairs[..., 0]] + pairs[..., 1]]   # [P, S, b]
    costs = np.array([[rank_costs(step, mode, pack_length) for step in rank] for rank in lens])
    real, computed, attention = costs[..., 0], costs[..., 1], costs[..., 2]

    def imbalance(x):
        return float((x.max(0) / x.mean(0)).mean())

    return {"mode": mode, "world": world, "group": g if mode in ("local", "pack") else None,
            "steps": int(pairs.shape[1]), "padding_efficiency": float(real.sum() / computed.sum()),
            "imbalance_padded": imbalance(computed), "imbalance_real": imbalance(real),
            "imbalance_attention": imbalance(attention),
            "remainder_pct": 100.0 * len(plan.remainder(0, batch)) / int(offsets[-1])}


def packing_bound(lengths: np.ndarray, pack_length: int) -> dict:
    """Best-fit decreasing over all samples at once (rows tracked by their free room)."""
    rows_with_room = np.zeros(pack_length + 1, dtype=np.int64)
    for n in np.sort(lengths)[::-1].tolist():
        fits = np.flatnonzero(rows_with_room[n:])
        if len(fits):
            room = n + int(fits[0])
            rows_with_room[room] -= 1
            rows_with_room[room - n] += 1
        else:
            rows_with_room[pack_length - n] += 1
    rows = int(rows_with_room.sum())
    return {"rows": rows, "padding_efficiency": float(lengths.sum() / (rows * pack_length)),
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
    from runtime.model import BertConfig, BertForPreTraining
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
            "pad_eff": real / computed, "imbalance_tokens": mean("imbalance_tokens"),
            "imbalance_compute": mean("imbalance_compute"), "steps_measured": len(steps)}


def train(variants: list[str], seeds: list[int], workdir: Path, step_time: int,
          extra: list[str]) -> list[dict]:
    from bench.time_to_accuracy import run_runtime
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


def print_tables(rec: dict) -> None:
    if rec.get("simulation"):
        print(f"\n1. sampler arithmetic, local batch {rec['batch']}, one epoch "
              "(padding efficiency of a padded model; imbalance = mean over steps of max/mean "
              "over ranks)")
        print("| mode | world | G | steps | pad. eff. | imb. padded tokens | imb. real tokens "
              "| imb. Σlen² | remainder % |\n|---|---|---|---|---|---|---|---|---|")
        for r in rec["simulation"]:
            print(f"| {r['mode']} | {r['world']} | {r['group'] or '-'} | {r['steps']} | "
                  f"{r['padding_efficiency']:.3f} | {r['imbalance_padded']:.4f} | "
                  f"{r['imbalance_real']:.4f} | {r['imbalance_attention']:.4f} | "
                  f"{r['remainder_pct']:.2f} |")
        b = rec["packing_bound"]
        print(f"packing bound (best-fit decreasing over all samples): efficiency "
              f"{b['padding_efficiency']:.3f} ({b['samples_longer_than_half']} samples are "
              f"longer than half a row and cannot share one)")
    if rec.get("attention"):
        a = rec["attention"]
        print("\n2. attention fwd+bwd ms (2 heads × 64, 1 thread, median over batches): "
              + ", ".join(f"{k} {v:.2f}" for k, v in a["attention_ms"].items()))
        print("   model fwd+bwd ms (CPU config model): "
              + ", ".join(f"{k} {v:.1f}" for k, v in a["model_step_ms"].items()))
    if rec.get("loaders"):
        print("\n3. loader throughput, batches/s (rank 0 of 2)\n| mode | torch | DALI (CPU) |"
              "\n|---|---|---|")
        for r in rec["loaders"]:
            print(f"| {r['mode']} | {_f(r['torch_batches_per_s'], '.0f')} | "
                  f"{_f(r.get('dali_batches_per_s'), '.0f')} |")
    if rec.get("training"):
        print("\n4. 2 real ranks, CPU benchmark\n| variant | seed | status | time to target s |"
              " samples | median step s | pad. eff. | imb. tokens | imb. fwd time |"
              "\n|---|---|---|---|---|---|---|---|---|")
        for r in rec["training"]:
            print(f"| {r['variant']} | {r['seed']} | {r['status']} | "
                  f"{_f(r['time_to_target_s'], '.1f')} | {_f(r.get('samples'), 'd')} | "
                  f"{_f(r.get('median_step_time_s'), '.4f')} | {_f(r.get('pad_eff'), '.3f')} | "
                  f"{_f(r.get('imbalance_tokens'), '.3f')} | "
                  f"{_f(r.get('imbalance_compute'), '.3f')} |")


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.balance", description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=REPO / "data/cpu128")
    ap.add_argument("--worlds", default="2,8,64,1024")
    ap.add_argument("--batch", type=int, default=32, help="local batch (the CPU benchmark's)")
    ap.add_argument("--group", type=int, default=8, help="G of local/pack (min(G, world))")
    ap.add_argument("--no-sim", action="store_true", help="skip the sampler arithmetic")
    ap.add_argument("--attention", type=int, default=20, metavar="BATCHES",
                    help="attention/model timing over this many real batches (0 = skip)")
    ap.add_argument("--loader-batches", type=int, default=300)
    ap.add_argument("--no-loaders", action="store_true")
    ap.add_argument("--train", default="", help="variants to train, e.g. random,local+unpadded")
    ap.add_argument("--seeds", default="42")
    ap.add_argument("--step-time", type=int, default=0, metavar="STEPS",
                    help="with --train: only this many steps per run, no eval (step time)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="extra override for --train runs")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=RESULTS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    now = datetime.datetime.now()
    rec = {"benchmark": "bench.balance", "date": now.isoformat(timespec="seconds"),
           "command": " ".join(["python -m bench.balance", *(argv or sys.argv[1:])]),
           "machine": {"python": platform.python_version(), "torch": torch.__version__,
                       "cpus": __import__("os").cpu_count()},
           "data": str(args.data), "batch": args.batch}
    lengths = read_lengths(DataSetInfo.read(args.data))
    if not args.no_sim:
        rec["simulation"] = [simulate(lengths, mode, int(w), args.batch, args.group)
                             for w in args.worlds.split(",") for mode in MODES]
        rec["packing_bound"] = packing_bound(np.concatenate(lengths), 128)
    if args.attention:
        rec["attention"] = bench_attention(args.data, args.attention, args.batch)
    if not args.no_loaders and args.loader_batches:
        rec["loaders"] = bench_loaders(args.data, args.loader_batches, args.batch)
    if args.train:
        workdir = args.workdir or REPO / f"results/bench_balance_{now:%Y%m%d_%H%M%S}"
        rec["training"] = train(args.train.split(","), [int(s) for s in args.seeds.split(",")],
                                workdir, args.step_time, args.set)
    print_tables(rec)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rec, indent=1))
    print(json.dumps(rec, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
