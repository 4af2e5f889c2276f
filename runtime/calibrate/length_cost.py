"""``python -m runtime.calibrate.length_cost``: measure a model's forward+backward on batches of chosen
lengths and write the coefficients of its length cost (loaders/length_cost.py).

Owns: building the model of a config (its ``[model]`` section: shape, dropout) in the layout
asked for, the measured batch designs, timing them and calling ``loaders.length_cost.fit``,
the held-out check on real random batches, and the coefficients file. Never: the cost
formula or the fit (loaders.length_cost), balancing (loaders.balance), anything a training
run does. A benchmark-like command: run it alone on the machine
(``flock -x /tmp/presto_cpu.lock ...`` on the shared development machine).

    python -m runtime.calibrate.length_cost --layout unpadded --data data/wiki512 --out cost.json
    python -m runtime.calibrate.length_cost --layout padded --max-len 128 --repeat 5

The batches are real samples of the data set (``--data``) whose lengths are nearest to the
design's: the fit set varies rows (2…32) and length (max/16 … max) independently, has
batches of one long and many short rows (so padded and real tokens, Σ len and Σ len²,
differ) and random batches of 8, 16 and 32 samples (for ``padded`` also packed into rows and
timed on the model built with ``packed=True``, as the packing modes train it); the held-out
set is other random batches drawn the same way, never used by the fit. Times are the
fastest of ``--repeat`` (or more, up to 20, for short batches) forward+backward passes
after one warm-up, on ``--threads`` threads (1 = one rank of the CPU benchmark).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from loaders import length_cost as lc
from basis import model_shape
from loaders.collate import best_fit_rows, pad_rows, sample_rows
from loaders.dataset import DataSetInfo, ShardStore, read_lengths, take

REPO = Path(__file__).resolve().parents[2]
CPU_CONFIG = REPO / "submission/configs/config_CPU_1x2x32x1.toml"
KERNEL = {"padded": None, "unpadded": "per_sequence", "repad": "repad"}
"""The unpadded kernel each layout times: per_sequence is the plain-torch Σ len² kernel
(cuda_varlen's cost shape on a GPU); repad the CPU default."""


def model_for_layout(config_path, overrides, layout: str, packed: bool):
    """The config's model (its [model] shape and dropout) as runtime.train.build makes it,
    in ``layout``'s attention path (``packed``: as the packing modes train it); no initial
    weights are loaded - the cost does not depend on them."""
    from runtime.config import load_config
    from runtime.train.build import build_model
    attention = "padded" if layout == "padded" else "unpadded"
    cfg = load_config(config_path, [*overrides, f"model.attention={attention}",
                                    "model.init=scratch",
                                    *(["data.balance=pack"] if packed else [])])
    torch.manual_seed(0)
    model = build_model(cfg)
    if KERNEL[layout]:
        model.bert.kernel = KERNEL[layout]
    return model.train(), cfg.model.bert_config()


class Sampler:
    """Real samples of a data set by length: ``batch(rows)`` turns rows of wanted lengths
    into a Batch of the samples nearest to them (a sample is used once per batch)."""

    def __init__(self, data_dir, seed: int = 0):
        self.info = DataSetInfo.read(data_dir)
        lengths = read_lengths(self.info)
        self.flat = np.concatenate(lengths)
        self.offsets = np.concatenate([[0], np.cumsum([len(c) for c in lengths])])
        self.store = ShardStore(self.info, prefetch=False)
        self.rng = np.random.default_rng(seed)
        self.by_length = np.argsort(self.flat, kind="stable")

    @property
    def max_len(self) -> int:
        return int(self.flat.max())

    def nearest(self, length: int, taken: set) -> int:
        i = int(np.searchsorted(self.flat[self.by_length], length))
        for step in range(len(self.flat)):
            for j in (i + step, i - step - 1):
                if 0 <= j < len(self.flat) and int(self.by_length[j]) not in taken:
                    taken.add(int(self.by_length[j]))
                    return int(self.by_length[j])
        raise ValueError("not enough samples")

    def batch(self, rows: list[list[int]]):
        taken: set = set()
        ids = [[self.nearest(n, taken) for n in row] for row in rows]
        return self._collate(ids)

    def random(self, count: int, pack_length: int = 0, longest: int = 0):
        """``count`` random samples (of at most ``longest`` tokens), one per row or packed
        best-fit into rows of ``pack_length``."""
        pool = np.flatnonzero(self.flat <= longest) if longest else np.arange(len(self.flat))
        ids = self.rng.choice(pool, count, replace=False)
        if pack_length:
            rows = best_fit_rows(self.flat[ids], pack_length)
            return self._collate([[int(ids[i]) for i in row] for row in rows])
        return self._collate([[int(i)] for i in ids])

    def _collate(self, ids: list[list[int]]):
        flat = np.array([i for row in ids for i in row])
        shard = np.searchsorted(self.offsets, flat, side="right") - 1
        pairs = np.stack([shard, flat - self.offsets[shard]], 1)
        samples = take({int(s): self.store.get(int(s)) for s in np.unique(shard)}, pairs)
        positions, start = [], 0
        for row in ids:
            positions.append(list(range(start, start + len(row))))
            start += len(row)
        return pad_rows(sample_rows(samples, positions))


def designs(layout: str, max_len: int) -> list[list[list[int]]]:
    """The designed part of the fit set: rows × lengths, and one long row among short ones
    (so padded and real tokens, Σ len and Σ len², differ)."""
    lengths = sorted({max(8, max_len * f // 16) for f in (1, 2, 4, 8, 12, 16)})
    out = [[[n]] * rows for rows in (2, 4, 8, 16, 32) for n in lengths]
    for rows in (4, 16, 32):
        for big, small in ((max_len, max_len // 16), (max_len, max_len // 4),
                           (max_len // 2, max_len // 16)):
            out.append([[big]] + [[small]] * (rows - 1))
    return out


RANDOM_SIZES = (8, 16, 32)
"""Random real batches of these sizes join the fit (``--fit-random`` each) and form the
held-out set (``--held-out`` each; for ``padded`` also packed into rows)."""


def time_batch(model, batch, repeat: int, budget_s: float = 0.3) -> float:
    """Fastest of ``repeat`` forward+backward passes (more, up to 20, while they take less
    than ``budget_s`` together) after one warm-up: on a shared machine other work only ever
    adds time, so the minimum is the least disturbed estimate of the batch's own cost."""
    def step():
        out = model(batch.input_ids, batch.token_type_ids, batch.attention_mask,
                    batch.masked_lm_labels, batch.next_sentence_labels)
        out.loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    times: list[float] = []
    while len(times) < repeat or (sum(times) < budget_s and len(times) < 20):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(args) -> dict:
    torch.set_num_threads(args.threads)
    sampler = Sampler(args.data)
    max_len = min(args.max_len or sampler.max_len, sampler.max_len)
    model, cfg = model_for_layout(args.config, args.set, args.layout, packed=False)
    packed_model = (model_for_layout(args.config, args.set, args.layout, packed=True)[0]
                    if args.layout == "padded" else None)  # what pack/offline_pack train
    shape = model_shape.shape_of(cfg)
    fit_rows, fit_times = [], []
    fit_set = [("design", sampler.batch(rows)) for rows in designs(args.layout, max_len)]
    packs = [0, max_len] if args.layout == "padded" else [0]
    fit_set += [(f"{count} random{' packed' if pack else ''}",
                 sampler.random(count, pack, max_len))
                for count in RANDOM_SIZES for pack in packs for _ in range(args.fit_random)]
    for kind, batch in fit_set:
        fit_rows.append(batch.sequence_lengths)
        fit_times.append(time_batch(packed_model if batch.packed else model, batch,
                                    args.repeat, args.budget))
        print(f"  fit      {kind:18s} rows {batch.size:2d}  longest "
              f"{max(map(sum, batch.sequence_lengths)):4d}  {fit_times[-1] * 1000:8.1f} ms",
              flush=True)
    cost = lc.fit(args.layout, fit_rows, fit_times, shape,
                  source=f"measured by python -m runtime.calibrate.length_cost on {platform.node()}, "
                         f"{args.threads} thread(s), {lc.now_stamp()[:10]}")
    held_rows, held_times, held_kind = [], [], []
    for count in RANDOM_SIZES:
        for pack in packs:
            for _ in range(args.held_out):
                batch = sampler.random(count, pack, max_len)
                held_rows.append(batch.sequence_lengths)
                held_times.append(time_batch(packed_model if pack else model, batch,
                                             args.repeat, args.budget))
                held_kind.append(f"{count} random{' packed' if pack else ''}")
                print(f"  held-out {held_kind[-1]:18s} rows {batch.size:2d}  "
                      f"{held_times[-1] * 1000:8.1f} ms  predicted "
                      f"{cost.of_rows(batch.sequence_lengths) * 1000:8.1f} ms", flush=True)
    held = lc.fit_error(cost, held_rows, held_times)
    return {"cost": cost, "held_out": held, "fit_points": list(zip(fit_rows, fit_times)),
            "held_out_points": list(zip(held_kind, held_rows, held_times)),
            "max_len": max_len}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m runtime.calibrate.length_cost",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=CPU_CONFIG, help="its [model] is measured")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--layout", choices=lc.LAYOUTS, required=True,
                    help="padded | unpadded (per_sequence kernel: Σ len²) | repad")
    ap.add_argument("--data", type=Path, default=REPO / "data/wiki512",
                    help="real samples to time (its longest sample bounds --max-len)")
    ap.add_argument("--max-len", type=int, default=0, help="longest design length (0 = data's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--budget", type=float, default=0.3, metavar="SECONDS",
                    help="time a short batch more often (up to 20) until this much is spent")
    ap.add_argument("--fit-random", type=int, default=2,
                    help="random real batches per size in the fit set")
    ap.add_argument("--held-out", type=int, default=3,
                    help="random real batches per size in the held-out set")
    ap.add_argument("--out", type=Path, default=None, help="coefficients JSON to write")
    ap.add_argument("--defaults", action="store_true",
                    help=f"also put the result into {lc.DEFAULTS_FILE.relative_to(REPO)} "
                         "(replacing the entry of the same shape and layout)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    result = measure(args)
    cost = result["cost"]
    record = cost.to_json()
    record.update(held_out_error=result["held_out"], max_len=result["max_len"],
                  command=" ".join(["python -m runtime.calibrate.length_cost", *(argv or sys.argv[1:])]),
                  date=lc.now_stamp(), machine={"python": platform.python_version(),
                                                "torch": torch.__version__,
                                                "threads": args.threads},
                  seconds=round(time.perf_counter() - t0, 1))
    points = [[len(rows), max(map(sum, rows)), sum(map(sum, rows)), round(t * 1000, 2),
               round(cost.of_rows(rows) * 1000, 2)] for rows, t in result["fit_points"]]
    record["fit_points"] = {"columns": ["rows", "longest_row", "real_tokens", "measured_ms",
                                        "predicted_ms"], "values": points}
    print("\nfit points: rows, longest row, real tokens, measured ms, predicted ms")
    for p in points:
        print("  " + "  ".join(f"{v:>8}" for v in p))
    print(f"\n{cost.describe()}")
    print("fit      " + ", ".join(f"{k} {v:.4g}" for k, v in cost.fit_error))
    print("held-out " + ", ".join(f"{k} {v:.4g}" for k, v in result["held_out"].items()))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.out}")
    if args.defaults:
        entries = json.loads(lc.DEFAULTS_FILE.read_text()) if lc.DEFAULTS_FILE.is_file() else []
        entries = [e for e in entries if not (e["layout"] == cost.layout
                                               and e.get("shape") == dict(cost.shape))]
        entries.append(record)
        lc.DEFAULTS_FILE.write_text(json.dumps(entries, indent=1) + "\n")
        print(f"updated {lc.DEFAULTS_FILE}")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
