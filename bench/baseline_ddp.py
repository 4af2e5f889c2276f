"""The plain PyTorch recipe a user would otherwise write: the baseline of bench.time_to_accuracy.
(Its GPU sibling is the ``plain`` stage of bench.gpu, bench/gpu/stages/plain.py: Hugging Face's
model and torch's fused AdamW for throughput on one GPU, where this one is time to accuracy.)

    torchrun --standalone --nproc_per_node 2 bench/baseline_ddp.py \\
        --config submission/configs/config_CPU_1x2x32x1.toml [--set section.key=value ...] \\
        [--baseline-lr 2e-3] [--out baseline.json]

Written the way the PyTorch tutorials teach it, on purpose without any of the runtime's
machinery; only what makes the comparison *fair* is shared with the runtime:

  same     config file (runtime.config), model class/size/init (runtime.train.build.build_model
           under ``torch.manual_seed(train.seed)``; always with ``model.attention=padded``: the
           plain recipe computes every padded position, whatever the config says), training
           shards, global batch, LR schedule function (runtime.optim.schedules), gradient clip norm,
           eval set/batches and accuracy (loaders.dataset.load_eval_batches, Σcorrect/Σmasked
           all-reduced), eval cadence (train.eval_cadence()), stopping rule (target or
           max_steps/max_samples_termination), threads per rank (cores // local ranks), and
           timing: the clock starts after model, data and optimizer are built and a barrier
           (MLPerf's run_start) and stops at the eval that reaches the target (run_stop).
  plain    torch.distributed gloo via env:// (torchrun's RANK/WORLD_SIZE/MASTER_*); DDP with
           default buckets; a map-style Dataset holding every shard in memory (read once, in
           init: not timed); DistributedSampler(shuffle=True, seed) + DataLoader, every batch
           padded to data.max_seq_length; torch.optim.AdamW with the usual no-decay groups
           (bias, LayerNorm.weight); LambdaLR; loss.backward() → clip_grad_norm_ → step.

Learning rate: optim.lr (with optim.lr_scaling applied, as the runtime does) when the config's
optimizer is ``adamw``; otherwise the config's lr was tuned for another optimizer (LAMB) and
means nothing for AdamW, so ``--baseline-lr`` is used (default 2e-3). betas, eps and
weight_decay always come from the config's optim section.

Dropout: seeded per rank after the model is built (``seed * 1000 + rank``, as the runtime),
so ranks draw different masks. DataLoader ``num_workers`` defaults to 0: the ranks already
take every core, and padding 32 samples is cheap next to the step.

Rank 0 prints a progress line every train.log_every_steps and writes ``--out`` (JSON):
status, time_to_target_s (None unless success), run_time_s, samples_to_target, steps, samples,
eval_history [[samples, accuracy, seconds since run start]], throughput_samples_per_s (samples
per second of training steps, evals excluded), padding_efficiency (real / computed tokens over
all ranks), and how it was run. Exit status 0 on success, 1 when aborted.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script by torchrun

from loaders.dataset import DataSetInfo, load_eval_batches  # noqa: E402
from loaders.shards import read_shard  # noqa: E402
from runtime.config import load_config  # noqa: E402
from runtime.train.build import build_model, learning_rate, schedule_of  # noqa: E402

DEFAULT_BASELINE_LR = 2e-3
IGNORE_INDEX = -100


# ------------------------------------------------------------------------------------ data

class PretrainingShards(Dataset):
    """Every training sample of the data set, in memory (this data set is small)."""

    def __init__(self, data_dir: str | Path):
        info = DataSetInfo.read(data_dir)
        self.columns = {k: [] for k in ("input_ids", "segment_ids", "masked_lm_positions",
                                        "masked_lm_ids")}
        nsp = []
        for rel in info.train_files:
            s = read_shard(info.root / rel)
            for key, col in self.columns.items():
                col.extend(getattr(s, key))
            nsp.append(np.asarray(s.next_sentence_labels))
        self.next_sentence_labels = np.concatenate(nsp)

    def __len__(self) -> int:
        return len(self.next_sentence_labels)

    def __getitem__(self, i: int) -> dict:
        item = {key: col[i] for key, col in self.columns.items()}
        item["next_sentence_labels"] = int(self.next_sentence_labels[i])
        return item


def pad_to_max_length(max_seq_length: int):
    """Collate: every batch padded to max_seq_length; MLM labels -100 where not masked."""

    def collate(items: list[dict]) -> dict:
        b, L = len(items), max_seq_length
        input_ids = torch.zeros(b, L, dtype=torch.long)
        token_type_ids = torch.zeros(b, L, dtype=torch.long)
        attention_mask = torch.zeros(b, L, dtype=torch.long)
        labels = torch.full((b, L), IGNORE_INDEX, dtype=torch.long)
        for r, it in enumerate(items):
            n = len(it["input_ids"])
            input_ids[r, :n] = torch.from_numpy(it["input_ids"].astype(np.int64))
            token_type_ids[r, :n] = torch.from_numpy(it["segment_ids"].astype(np.int64))
            attention_mask[r, :n] = 1
            pos = it["masked_lm_positions"].astype(np.int64)
            ids = it["masked_lm_ids"].astype(np.int64)
            keep = pos > 0  # position 0 ([CLS]) is never masked: 0 marks an empty slot
            labels[r, torch.from_numpy(pos[keep])] = torch.from_numpy(ids[keep])
        return {"input_ids": input_ids, "token_type_ids": token_type_ids,
                "attention_mask": attention_mask, "masked_lm_labels": labels,
                "next_sentence_labels": torch.tensor([it["next_sentence_labels"] for it in items]),
                "real_tokens": int(attention_mask.sum())}

    return collate


def batches_forever(loader: DataLoader, sampler: DistributedSampler):
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


# ------------------------------------------------------------------------------ optimizer

def adamw(model: torch.nn.Module, lr: float, cfg) -> torch.optim.AdamW:
    no_decay = ("bias", "LayerNorm.weight")  # the HF/BERT tutorial grouping
    params = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in params if not any(nd in n for nd in no_decay)],
         "weight_decay": cfg.optim.weight_decay},
        {"params": [p for n, p in params if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(cfg.optim.beta1, cfg.optim.beta2),
                             eps=cfg.optim.eps)


def baseline_lr(cfg, override: float | None) -> tuple[float, str]:
    """(lr, where it came from); see the module docstring."""
    if cfg.optim.name == "adamw":
        return learning_rate(cfg), "config optim.lr (optim.name = adamw)"
    lr = DEFAULT_BASELINE_LR if override is None else override
    return lr, f"--baseline-lr (config optimizer is {cfg.optim.name}, not adamw)"


def lr_lambda(cfg, lr: float):
    sched = schedule_of(cfg, lr)  # the runtime's schedule, from the same [schedule] fields
    return lambda step: sched(step) / lr


# The plain recipe's model computes attention (and everything else) on the padded batch; the
# runtime's "unpadded" mode would skip the padding inside the model and hide its cost.
PLAIN_ATTENTION = "model.attention=padded"


# ----------------------------------------------------------------------------------- eval

@torch.no_grad()
def evaluate(model: torch.nn.Module, eval_batches) -> float:
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64)
    for b in eval_batches:
        out = model(b.input_ids, b.token_type_ids, b.attention_mask,
                    masked_lm_labels=b.masked_lm_labels)
        counts += torch.stack([out.mlm_correct.double(), out.mlm_count.double()])
    dist.all_reduce(counts)
    model.train()
    return float(counts[0] / counts[1].clamp(min=1))


# ------------------------------------------------------------------------------------ main

def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="bench/baseline_ddp.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--baseline-lr", type=float, default=None,
                    help=f"AdamW lr when the config's optimizer is not adamw "
                         f"(default {DEFAULT_BASELINE_LR})")
    ap.add_argument("--num-workers", type=int, default=0, help="DataLoader workers per rank")
    ap.add_argument("--out", type=Path, default=None, help="summary JSON (rank 0)")
    return ap.parse_args(argv)


@dataclass
class Rank:
    """What one rank trains with: the config, the DDP model, AdamW and its schedule, the
    batches and the eval set."""

    cfg: Any
    rank: int
    world: int
    threads: int
    per_rank: int
    model: torch.nn.Module
    ddp: DDP
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.LambdaLR
    lr: float
    lr_source: str
    batches: Any
    eval_batches: Any


def build(args, cfg) -> Rank:
    """The process group, threads, model (the runtime's init), AdamW, data: not timed."""
    t = cfg.train
    dist.init_process_group("gloo", init_method="env://")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    threads = max(1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    per_rank = cfg.local_batch_size(world)  # global / (world × accumulation)
    torch.manual_seed(t.seed)  # same init as the runtime
    model = build_model(cfg)
    ddp = DDP(model)
    torch.manual_seed(t.seed * 1000 + rank)  # per-rank dropout
    lr, lr_source = baseline_lr(cfg, args.baseline_lr)
    optimizer = adamw(model, lr, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, lr))
    dataset = PretrainingShards(cfg.data.data_dir)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                 seed=t.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=per_rank, sampler=sampler, drop_last=True,
                        collate_fn=pad_to_max_length(cfg.data.max_seq_length),
                        num_workers=args.num_workers, persistent_workers=args.num_workers > 0)
    eval_batches = load_eval_batches(cfg.data.data_dir, rank, world, cfg.data.eval_batch_size)
    return Rank(cfg, rank, world, threads, per_rank, model, ddp, optimizer, scheduler, lr,
                lr_source, batches_forever(loader, sampler), eval_batches)


@dataclass
class Progress:
    """The run so far (this rank's tokens: real, computed)."""

    t0: float
    step: int = 0
    samples: int = 0
    train_s: float = 0.0
    tokens: torch.Tensor = field(default_factory=lambda: torch.zeros(2, dtype=torch.float64))
    history: list = field(default_factory=list)
    acc: Optional[float] = None


def out_of_budget(t, p: Progress) -> bool:
    return p.step >= t.max_steps or (t.max_samples_termination > 0
                                     and p.samples >= t.max_samples_termination)


def train_step(r: Rank, p: Progress):
    """One optimizer step: ``accum`` micro-batches (the last one syncs), clip, step."""
    t = r.cfg.train
    accum = t.gradient_accumulation_steps
    ts = time.perf_counter()
    r.optimizer.zero_grad(set_to_none=True)
    for i in range(accum):
        b = next(r.batches)
        sync = r.ddp.no_sync() if i < accum - 1 else contextlib.nullcontext()
        with sync:
            out = r.ddp(b["input_ids"], b["token_type_ids"], b["attention_mask"],
                        masked_lm_labels=b["masked_lm_labels"],
                        next_sentence_labels=b["next_sentence_labels"])
            (out.loss / accum).backward()
        p.tokens += torch.tensor([b["real_tokens"], b["input_ids"].numel()],
                                 dtype=torch.float64)
    if t.clip_mode != "none" and t.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(r.model.parameters(), t.max_grad_norm)
    r.optimizer.step()
    r.scheduler.step()
    p.step += 1
    p.samples += t.global_batch_size
    p.train_s += time.perf_counter() - ts
    return out


def log_eval(r: Rank, p: Progress) -> None:
    p.acc = evaluate(r.model, r.eval_batches)
    p.history.append([p.samples, p.acc, time.perf_counter() - p.t0])


def train(r: Rank) -> tuple[str, Progress]:
    """Steps to each evaluation until the target or the budget: the status and the run."""
    t = r.cfg.train
    first_eval, eval_every = t.eval_cadence()
    dist.barrier()
    p = Progress(time.perf_counter())  # run_start
    if t.eval_before_training:
        log_eval(r, p)
    next_eval, status = first_eval, None
    r.ddp.train()
    while status is None:
        while p.samples < next_eval and not out_of_budget(t, p):
            out = train_step(r, p)
            if r.rank == 0 and t.log_every_steps and p.step % t.log_every_steps == 0:
                print(f"[baseline] step {p.step} | samples {p.samples} | loss "
                      f"{out.loss.item():.3f} | lr {r.scheduler.get_last_lr()[0]:.2e} | "
                      f"{p.samples / p.train_s:.1f} samples/s", flush=True)
        log_eval(r, p)
        if r.rank == 0:
            print(f"[baseline] [eval] step {p.step} | samples {p.samples} | eval acc "
                  f"{p.acc:.4f} | elapsed {time.perf_counter() - p.t0:.1f} s", flush=True)
        next_eval += eval_every
        if p.acc >= t.target_mlm_accuracy:
            status = "success"
        elif out_of_budget(t, p):
            status = "aborted"
    return status, p


def summary(args, r: Rank, status: str, p: Progress, run_time: float) -> dict:
    """The --out record (module docstring): the run and how it was run."""
    t, cfg, ok = r.cfg.train, r.cfg, status == "success"
    return {
        "status": status, "time_to_target_s": run_time if ok else None,
        "run_time_s": run_time, "samples_to_target": p.samples if ok else None,
        "steps": p.step, "samples": p.samples, "eval_accuracy": p.acc,
        "target_mlm_accuracy": t.target_mlm_accuracy, "eval_history": p.history,
        "train_time_s": p.train_s,
        "throughput_samples_per_s": p.samples / p.train_s if p.train_s > 0 else None,
        "padding_efficiency": float(p.tokens[0] / p.tokens[1]) if p.tokens[1] > 0 else None,
        "seed": t.seed, "config": cfg.source, "overrides": args.set,
        "world_size": r.world, "threads_per_rank": r.threads, "local_batch_size": r.per_rank,
        "global_batch_size": t.global_batch_size, "optimizer": "torch.optim.AdamW",
        "lr": r.lr, "lr_source": r.lr_source, "max_seq_length": cfg.data.max_seq_length,
        "attention": cfg.model.attention,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    r = build(args, load_config(args.config, [*args.set, PLAIN_ATTENTION]))
    status, p = train(r)
    run_time = time.perf_counter() - p.t0  # run_stop
    dist.all_reduce(p.tokens)
    if r.rank == 0:
        print(f"[baseline] run stopped: status={status} after {p.step} steps, {p.samples} "
              f"samples, {run_time:.1f} s", flush=True)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(summary(args, r, status, p, run_time), indent=2)
                                + "\n")
    dist.destroy_process_group()
    return 0 if status == "success" else 1


if __name__ == "__main__":
    sys.exit(main())
