"""One rank of tests/ranks/test_shard.py (the sharded optimizer, optim.shard), under ``mpiexec -n P``:

    python tests/dist_scripts/shard.py CASE[,CASE...] DATA_DIR WORK_DIR

Several cases run one after the other in one launch (one start-up, one compile of each shape).
Every case trains the tiny BERT of tests/support/tiny.py (dropout off) on the default pairing -
the bucket engine and the compiled fused optimizer (optim.backend auto) - clipped at TAU.

CASE:
  equal     one pairing of each optimizer (lamb, adamw, lars) with each clip mode (DIAGONAL_2),
            STEPS steps with optim.shard=world beside the same run unsharded, from the same
            weights on the same batches: with 2 micro-batches a step and an fp16-style loss
            scale whose steps POISON get a NaN gradient on the last rank only (skipped on every
            rank, the scale halves); plus a plain run (one micro-batch, no loss scale) and one
            reducing in bf16. Per run: the largest relative difference of any parameter, how
            many are bit for bit equal, the grad norms, skip flags and loss scales of both, the
            optimizer state's elements on this rank (rank 0 reports; every rank checks).
  diagonal  (4 ranks) `equal` on other pairings (DIAGONAL_4): with `node`'s two, 10 of the 12
            (optimizer, clip mode) pairs run sharded against unsharded somewhere.
  reduce    the NCCL reduction on gloo (``runtime.grad_sync.shard.REDUCTION``: each bucket's
            pieces reduced to their owners, across "nodes" too with 4 ranks): the first step's
            averaged gradient in each rank's shard against the unsharded allreduce's, and
            STEPS steps against the unsharded run (2 ranks: a + b = b + a, bit for bit; 4:
            another order of the sums, so rounding).
  noshm     /dev/shm refuses the parameters (posix_fallocate raises ENOSPC): the run falls back
            to the broadcasts, says so in its derived facts, and equals the unsharded run.
  node      (4 ranks) optim.shard=node with the ranks told they sit 2 to a node: 2 shards, a
            copy per "node" (gloo's row: each bucket all-reduced, each rank keeping its
            shard) - against the unsharded run, as equal.
            Then ranks placed out of blocks (local ranks 1, 0, 1, 0): refused on every rank
            with a ConfigError naming optim.shard='node'.
  resume    a sharded LAMB run (dropout on) interrupted by a stop request (asked at step 7) and
            resumed from its checkpoint: step for step and bit for bit the uninterrupted run;
            then the same checkpoint restored unsharded and (4 ranks: `reshard`) re-sharded:
            its state equal, bit for bit, to the shards put back together by hand.
  tamper    (after `resume`) copies of its checkpoint with the two shard files swapped, and
            with both written at another step (a stale file), each under a manifest rewritten
            to match: every rank's restore refuses it (CheckpointError naming its file).
  reshard   (after a 2-rank `resume` in the same WORK_DIR) that 2-shard checkpoint restored
            on this world's shards: the gathered state equals the hand-made one.
  count     the region a full CUDA graph would capture, sharded, on the simulated device
            (runtime.observe.hostsync, capture mode): no host read, sync or host tensor in a
            collective, the same op trace for two steps, every persistent tensor changed in
            place, and the collectives one step issues.
  kill      (last) the last rank SIGKILLs itself inside the parameters' gather of a sharded
            step (on one host: the barrier on the shared parameter buffer); it writes
            WORK_DIR/killed_at first. The launch must end (non-zero) soon after.

Rank 0 writes WORK_DIR/CASE-P.json for each case (P ranks).
"""
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as torch_dist  # noqa: E402

from runtime.grad_sync import shard as shard_module  # noqa: E402
from runtime.grad_sync.shard import Shard  # noqa: E402
from runtime.launch import dist as dist_module  # noqa: E402
from runtime.launch import signals  # noqa: E402
from runtime.launch.dist import init_distributed, run_guarded, shutdown  # noqa: E402
from runtime.launch.env import discover  # noqa: E402
from runtime.config import ConfigError  # noqa: E402
from runtime.events import CallbackList, Event  # noqa: E402
from runtime.observe.hostsync import SIM_DEVICE, HostSyncs, simulated  # noqa: E402
from runtime.optim.grad_scale import DynamicLossScale  # noqa: E402
from runtime.train.graphs import _Packed  # noqa: E402
from runtime.train.build import batch_cost, build_train_loader  # noqa: E402
from runtime.train.trainer import Trainer  # noqa: E402
from loaders.shards import Limits  # noqa: E402
from tests.support.capture import Collectives, persistent_tensors  # noqa: E402
from tests.support.tiny import tiny_config as support_tiny_config  # noqa: E402

TAU = 0.5
STEPS = 8
POISON = (3, 6)       # steps (0-based) whose gradient is NaN on the last rank
# Every optimizer and every clip mode at 2 ranks and again, paired otherwise, at 4 ranks; with
# case_node's NODE pairs, 10 of the 12 (optimizer, clip mode) pairs (the full grid cost 70 s
# of the suite's time at 2 ranks: the pairs share their code paths - the clip mode lives in
# the sync, the optimizer in the sharded step - so the diagonals carry the same evidence).
DIAGONAL_2 = (("lamb", "global_after"), ("adamw", "local_before"), ("lars", "bucket_before"),
              ("lamb", "none"))
DIAGONAL_4 = (("adamw", "global_after"), ("lars", "local_before"), ("lamb", "bucket_before"),
              ("lars", "none"))
NODE = (("lars", "global_after"), ("lamb", "local_before"))
def tiny_config(data_dir, *extra):
    """The tiny model on the default pairing, clipped at TAU, 1 MB buckets (the tied
    embedding cut into pieces, so buckets straddle shard boundaries)."""
    return support_tiny_config(data_dir, "optim.backend=auto", f"train.max_grad_norm={TAU}",
                               "train.bucket_cap_mb=1", "optim.lr=0.02",
                               "train.log_every_steps=1000", *extra)


def train(ctx, cfg, batches, fp16: bool):
    """STEPS steps of ``cfg`` on ``batches``; (parameters, per-step records, trainer facts)."""
    trainer = Trainer(cfg, ctx)
    trainer.setup()
    if fp16:  # CPU configs refuse precision=fp16: the loss scale itself is what is checked
        trainer.loss_scale = DynamicLossScale(2.0 ** 12)
    poison = trainer.model.bert.encoder.layer[0].output.dense.weight
    records = []
    accum = trainer.body.accum
    for step in range(len(batches) // accum):
        handle = None
        if fp16 and step in POISON and ctx.rank == ctx.world_size - 1:
            handle = poison.register_hook(lambda g: torch.full_like(g, float("nan")))
        records.append(trainer.train_step(iter(batches[step * accum:(step + 1) * accum])))
        if handle is not None:
            handle.remove()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    if trainer.optimizer.keeps_masters:   # (train.precision *_master: a collective if sharded)
        masters = trainer.optimizer.masters()
        params.update({f"{n}#master": masters[id(p)].clone()
                       for n, p in trainer.model.named_parameters()})
    binding = trainer.optimizer.flat_binding
    facts = {"state_elements": sum(b.numel() for part in binding.parts
                                   for b in part.buffers.state.values()),
             "grad_norms": [float(r.grad_norm) for r in records],
             "skipped": [bool(r.skipped) for r in records],
             "loss_scales": [float(r.loss_scale) for r in records],
             # the gradient noise scale's two batch sizes: this rank's ‖g_r‖² as it goes to
             # the averaging, and ‖ḡ‖² of the averaged gradient (runtime.observe.noise_scale)
             "local_sq_norms": [float(r.losses[3]) for r in records],
             "grad_sq_means": [float(r.device["grad_sq_mean"]) for r in records
                               if "grad_sq_mean" in r.device],
             "split": trainer.grad_sync.tied is not None,
             "shard": trainer.state.derived.get("optimizer_shard")}
    trainer.close()
    return params, facts


def compare(a: dict, b: dict) -> dict:
    worst, same, errs = 0.0, 0, {}
    for n in a:
        err = float((a[n] - b[n]).abs().max() / (a[n].abs().max() + 1e-30))
        errs[n] = err
        worst = max(worst, err)
        same += bool(torch.equal(a[n], b[n]))
    return {"max_rel_err": worst, "bitwise_params": same, "params": len(a),
            "rel_err": errs}


def batches_for(ctx, cfg, n):
    """``n`` of this rank's micro-batches, read once so both runs see the same ones."""
    limits = Limits(cfg.model.vocab_size, cfg.data.max_seq_length, cfg.model.type_vocab_size)
    with build_train_loader(cfg, ctx, batch_cost(cfg, "cpu"), limits) as loader:
        return [next(loader) for _ in range(n)]


def pair(ctx, data_dir, name, fp16, *extra, node_ctx=None):
    """The run with optim.shard (world, or node on ``node_ctx``) beside the unsharded one."""
    cfg = tiny_config(data_dir, *extra)
    batches = batches_for(ctx, cfg, STEPS * cfg.train.gradient_accumulation_steps)
    plain, f0 = train(ctx, cfg, batches, fp16)
    mode = "node" if node_ctx is not None else "world"
    sharded, f1 = train(node_ctx or ctx, tiny_config(data_dir, *extra, f"optim.shard={mode}"),
                        batches, fp16)
    out = {"name": name, **compare(plain, sharded), "unsharded": f0, "sharded": f1,
           "steps": STEPS}
    # every rank holds the same replica: rank 0's check is every rank's
    agree = torch.tensor([out["max_rel_err"]], dtype=torch.float64)
    torch_dist.all_reduce(agree, op=torch_dist.ReduceOp.MAX)
    out["max_rel_err_any_rank"] = float(agree)
    return out


def case_equal(ctx, data_dir, grid=DIAGONAL_2, plain=True):
    runs = [pair(ctx, data_dir, f"{opt}/{clip}/accum2/fp16", True, f"optim.name={opt}",
                 f"train.clip_mode={clip}", "train.gradient_accumulation_steps=2")
            for opt, clip in grid]
    if plain:
        runs.append(pair(ctx, data_dir, "lamb/global_after/plain", False))
        runs.append(pair(ctx, data_dir, "lamb/global_after/bf16-reduce", False,
                         "train.allreduce_dtype=bf16"))
        runs.append(pair(ctx, data_dir, "lamb/global_after/bf16_master", False,
                         "train.precision=bf16_master"))
    return runs


def case_diagonal(ctx, data_dir):
    """Every optimizer and every clip mode at 4 ranks, paired otherwise than at 2."""
    return case_equal(ctx, data_dir, DIAGONAL_4, plain=False)


def first_gradient(ctx, cfg, batch):
    """The averaged gradient the optimizer gets in the first step, and the shard's window."""
    trainer = Trainer(cfg, ctx, log=lambda m: None)
    trainer.setup()
    seen = {}
    real = trainer.optimizer.step

    def step(**kw):
        seen["flat"] = trainer.grad_sync.flat.clone()
        return real(**kw)
    trainer.optimizer.step = step
    trainer.train_step(iter([batch]))
    shard = trainer.grad_sync.shard
    window = shard.window if shard is not None else None
    total = trainer.grad_sync.layout.total
    trainer.close()
    return seen["flat"], window, total


def case_reduce(ctx, data_dir):
    shard_module.REDUCTION["gloo"] = "reduce"
    try:
        out = []
        modes = [("world", ctx)]
        if ctx.world_size == 4:
            modes.append(("node", dataclasses.replace(ctx, local_rank=ctx.rank % 2,
                                                      local_world_size=2)))
        for mode, c in modes:
            # local_before: the tied embedding in the dense buckets, some across two shards
            extra = ("optim.name=adamw", "train.clip_mode=local_before")
            cfg = tiny_config(data_dir, *extra)
            batch = batches_for(ctx, cfg, 1)[0]
            plain, _, total = first_gradient(ctx, cfg, batch)
            mine, (lo, hi), _ = first_gradient(c, tiny_config(data_dir, *extra,
                                                              f"optim.shard={mode}"), batch)
            hi = min(hi, total)
            scale = float(plain[:total].abs().max())
            first = {"mode": mode, "window": [lo, hi],
                     "max_abs_err_rel_to_max": float((plain[lo:hi] - mine[lo:hi]).abs().max())
                     / scale, "bitwise": bool(torch.equal(plain[lo:hi], mine[lo:hi]))}
            run = pair(ctx, data_dir, f"lamb/global_after/{mode}/reduce", True,
                       "train.gradient_accumulation_steps=2",
                       node_ctx=c if mode == "node" else None)
            out.append({"first_step": first, **run})
        return out
    finally:
        shard_module.REDUCTION["gloo"] = "allreduce"


def case_node(ctx, data_dir):
    # two "nodes" of two ranks: what runtime.launch.env reports on two 2-GPU nodes
    node_ctx = dataclasses.replace(ctx, local_rank=ctx.rank % 2, local_world_size=2)
    runs = [pair(ctx, data_dir, f"{opt}/{clip}/node", True, f"optim.name={opt}",
                 f"train.clip_mode={clip}", "train.gradient_accumulation_steps=2",
                 node_ctx=node_ctx)
            for opt, clip in NODE]
    mixed = dataclasses.replace(ctx, local_rank=(ctx.rank + 1) % 2, local_world_size=2)
    trainer = Trainer(tiny_config(data_dir, "optim.shard=node"), mixed, log=lambda m: None)
    try:
        trainer.setup()
        refused = None
    except ConfigError as e:
        refused = str(e)
    return {"runs": runs, "misplaced": refused}


def case_noshm(ctx, data_dir):
    real = shard_module.os.posix_fallocate

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")
    shard_module.os.posix_fallocate = full
    try:
        return pair(ctx, data_dir, "lamb/global_after/noshm", False)
    finally:
        shard_module.os.posix_fallocate = real


# ---------------------------------------------------------------------------------- resume

def resume_config(data_dir, out, *extra):
    """The resumed runs train in bf16 with fp32 master weights (train.precision bf16_master):
    the masters are optimizer state, sharded, saved, restored and re-sharded like the rest."""
    return tiny_config(data_dir, f'train.output_dir="{out}"', "train.precision=bf16_master",
                       "model.hidden_dropout_prob=0.1",
                       "model.attention_probs_dropout_prob=0.1", "train.max_steps=14",
                       "train.eval_iter_start_samples=100000", "train.log_every_steps=2",
                       "data.eval_batch_size=32", "schedule.warmup_steps=3",
                       "schedule.total_steps=40", "train.checkpoint_keep=1", *extra)


class Recorder:
    def __init__(self, stop_at=0):
        self.steps, self.stop_at = [], stop_at

    def on_event(self, event, state):
        if event is Event.LOG:
            self.steps += [(m.step, m.loss, m.grad_norm, m.skipped) for m in state.logged_steps]
            if self.stop_at and state.step >= self.stop_at:
                signals.request()


def fit(ctx, cfg, stop_at=0):
    rec = Recorder(stop_at)
    trainer = Trainer(cfg, ctx, CallbackList([rec]), log=lambda msg: None)
    try:
        state = trainer.fit()
        params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    finally:
        trainer.close()
        signals.clear()
    return state, rec, trainer, params


def saved_state(ckpt_dir: Path, names: list) -> dict:
    """The newest checkpoint's optimizer state per parameter name (``names``: by state_dict
    index), put together by hand from its shard files (independent of the runtime's
    re-sharding)."""
    from runtime.train.checkpoint import SHARD_KEY, find_latest
    from runtime.train.checkpoint_optim import shard_file
    ck = find_latest(ckpt_dir)
    meta = ck.optimizer_state()[SHARD_KEY]
    shards = [torch.load(ck.path / shard_file(j), weights_only=True)
              for j in range(meta["shards"])]
    out = {}
    for state in meta["state_names"]:
        whole = torch.cat([s["state"][state] for s in shards])
        for index, offset, numel in meta["segments"]:
            out[f"{names[index]}:{state}"] = whole[offset:offset + numel].clone()
    return out, ck


def state_of(trainer) -> dict:
    """The trainer's optimizer state per parameter name, whole: gathered from the shards
    (a collective) when sharded."""
    opt = trainer.optimizer
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    binding = opt.flat_binding
    (part,) = binding.parts
    out = {}
    b = part.buffers
    for state, buf in b.state.items():
        if part.shard is not None:
            whole = torch.zeros(b.total, dtype=buf.dtype)
            whole[b.window[0]:b.window[1]] = buf
            part.shard.gather(whole)
        else:
            whole = buf
        for i, p in enumerate(part.params):
            seg = b.layout.segments[i]
            out[f"{names[id(p)]}:{state}"] = whole[seg.offset:seg.offset + seg.numel].clone()
    return out


def same_state(a: dict, b: dict) -> dict:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    return {"tensors": len(a), "bitwise": sum(bool(torch.equal(a[k], b[k])) for k in a)}


def case_resume(ctx, data_dir, work):
    out = {}
    full_state, full, t0, p_full = fit(ctx, resume_config(data_dir, work / "full",
                                                        "optim.shard=world"))
    cfg = resume_config(data_dir, work / "cut", "optim.shard=world",
                        "train.checkpoint_every_samples=64")
    _, first, t1, _ = fit(ctx, cfg, stop_at=7)
    out["stopped_at"] = t1.checkpoints.last_saved.name
    torch_dist.barrier()  # rank 0 commits the checkpoint after the others wrote theirs
    out["files"] = sorted(p.name for p in t1.checkpoints.last_saved.iterdir())
    _, second, t2, p_resumed = fit(ctx, cfg)
    out["resumed_from"] = t2.resume_from.step if t2.resume_from else None
    out["resumed_notes"] = t2.state.resume.get("notes")
    out["steps_equal"] = first.steps + second.steps == full.steps
    out["steps"] = len(full.steps)
    out["params"] = compare(p_full, p_resumed)
    # the same checkpoint, restored unsharded: its state is the shards put back together
    by_id = {id(p): n for n, p in t2.model.named_parameters()}
    names = [by_id[id(p)] for g in t2.optimizer.param_groups for p in g["params"]]
    want, ck = saved_state(Path(cfg.train.checkpoint_path()), names)
    out["checkpoint"] = str(ck.path)
    # model.safetensors holds the fp32 masters (what HF files and model.init read)
    model_file = ck.model_state()
    out["model_file"] = {"dtypes": sorted({str(t.dtype) for t in model_file.values()}),
                         "masters": sum(bool(torch.equal(model_file[n].reshape(-1),
                                                         want[f"{n}:master"]))
                                        for n in names), "params": len(names)}
    plain = Trainer(resume_config(data_dir, work / "cut", "optim.shard=none",
                                  "train.checkpoint_every_samples=64"), ctx, log=lambda m: None)
    plain.setup()
    out["unsharded_restore"] = same_state(want, state_of(plain))
    out["unsharded_notes"] = plain.state.resume.get("notes")
    plain.close()
    torch.save({"names": names, "state": want}, work / "resume_state.pt")
    return out


def case_reshard(ctx, data_dir, work):
    saved = torch.load(work / "resume_state.pt", weights_only=True)
    trainer = Trainer(resume_config(data_dir, work / "cut", "optim.shard=world",
                                    "train.checkpoint_every_samples=64"), ctx, log=lambda m: None)
    trainer.setup()
    got = state_of(trainer)
    out = {"restore": same_state(saved["state"], got), "notes": trainer.state.resume.get("notes"),
           "shards": trainer.optimizer.shard.size, "from_world": trainer.resume_from.world_size}
    trainer.close()
    return out


def case_tamper(ctx, data_dir, work):
    import hashlib
    import shutil
    from runtime.train.checkpoint import MANIFEST, CheckpointError, find_latest
    from runtime.train.checkpoint_optim import shard_file
    out = {}
    for case in ("swapped", "stale"):
        run = work / f"tamper_{case}"
        if ctx.rank == 0:
            shutil.copytree(work / "cut", run)
            ck = find_latest(run / "checkpoints").path
            a, b = ck / shard_file(0), ck / shard_file(1)
            if case == "swapped":
                a.rename(ck / "x"), b.rename(a), (ck / "x").rename(b)
            else:
                for f in (a, b):
                    data = torch.load(f, weights_only=True)
                    torch.save(dict(data, step=data["step"] - 2), f)
            m = json.loads((ck / MANIFEST).read_text())
            for name in m["files"]:
                data = (ck / name).read_bytes()
                m["files"][name] = {"bytes": len(data),
                                    "sha256": hashlib.sha256(data).hexdigest()}
            (ck / MANIFEST).write_text(json.dumps(m))
        torch_dist.barrier()
        trainer = Trainer(resume_config(data_dir, run, "optim.shard=world",
                                        "train.checkpoint_every_samples=64"), ctx,
                          log=lambda m: None)
        try:
            trainer.setup()
            said = None
        except CheckpointError as e:
            said = str(e)
        finally:
            trainer.close()
        said_all = [None] * ctx.world_size
        torch_dist.all_gather_object(said_all, said)
        out[case] = said_all
    return out


# ----------------------------------------------------------------------------------- count

def case_count(ctx, data_dir):
    ctx = simulated(ctx)
    dist_module._CTX = ctx
    results = []
    for clip, extra, reduction in (("global_after", [], "reduce"),
                                   ("bucket_before", ["fp16"], "reduce"),
                                   ("global_after", [], "allreduce")):
        shard_module.REDUCTION["gloo"] = reduction
        try:
            results.append(count_one(ctx, data_dir, clip, extra, reduction))
        finally:
            shard_module.REDUCTION["gloo"] = "allreduce"
    return results


def count_one(ctx, data_dir, clip, extra, reduction):
    with HostSyncs(SIM_DEVICE, capture=True) as syncs:
        cfg = tiny_config(data_dir, 'system.device="auto"', "data.shapes=static",
                          "train.cuda_graphs=full", "optim.shard=world",
                          f"train.clip_mode={clip}", "train.bucket_cap_mb=0.05")
        trainer = Trainer(cfg, ctx, log=lambda m: None)
        trainer.setup()
        trainer.runner.graph.warmup_steps = 10 ** 9  # run the body, watched, never capture
        if extra:
            trainer.loss_scale = DynamicLossScale(2.0 ** 16, device=SIM_DEVICE)
        it = iter(trainer.train_loader)
        for _ in range(2):  # the first step re-cuts the buckets (and re-shards the state)
            trainer.train_step(it)
        graph = trainer.runner.graph
        before = persistent_tensors(trainer)
        traces, calls, events = [], [], []
        for _ in range(2):
            graph.inputs.load([next(it) for _ in range(trainer.body.accum)])
            n, e = len(syncs.trace), len(syncs.events)
            coll = Collectives()
            try:
                values = trainer.runner.captured_step(graph.inputs.slots)
            finally:
                coll.restore()
            events += [str(x) for x in syncs.events[e:]]
            traces.append(syncs.trace[n:])
            calls.append(coll.calls)
            _Packed(values).pack(values)
        shard = trainer.optimizer.shard
        pieces = sum(len(shard.pieces(lo, hi)) for lo, hi in trainer.grad_sync.bounds)
        out = {"clip": clip, "reduction": reduction, "events": events,
               "same_trace": traces[0] == traces[1], "trace_ops": len(traces[0]),
               "calls": calls, "pieces": pieces, "buckets": trainer.grad_sync.num_buckets,
               "shards": shard.size, "in_place": persistent_tensors(trainer) == before}
        trainer.close()
    return out


# ------------------------------------------------------------------------------------ kill

def case_kill(ctx, data_dir, work):
    cfg = tiny_config(data_dir, "optim.shard=world")
    trainer = Trainer(cfg, ctx, log=lambda m: None)
    trainer.setup()
    it = iter(trainer.train_loader)
    real = Shard.gather
    calls = {"n": 0}

    def gather(self, buf):
        calls["n"] += 1
        if calls["n"] == 3 and ctx.rank == ctx.world_size - 1:
            (work / "killed_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, buf)
    Shard.gather = gather
    for _ in range(6):
        trainer.train_step(it)
    return {"unexpected": "the run went on after a rank was killed"}


CASES = {"equal": case_equal, "diagonal": case_diagonal, "reduce": case_reduce,
         "noshm": case_noshm, "node": case_node, "resume": case_resume,
         "tamper": case_tamper, "reshard": case_reshard, "count": case_count, "kill": case_kill}
NEEDS_WORK = {"resume", "tamper", "reshard", "kill"}


def main() -> None:
    cases, data_dir, work = sys.argv[1].split(","), sys.argv[2], Path(sys.argv[3])
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
    order = [c for c in CASES if c in cases]  # count: simulated device, kill: last
    ctx = init_distributed(discover(), device="cpu", timeout_s=20)
    torch.set_num_threads(1)
    for case in order:
        t0 = time.perf_counter()
        args = (ctx, data_dir, work) if case in NEEDS_WORK else (ctx, data_dir)
        result = CASES[case](*args)
        if ctx.rank == 0:
            (work / f"{case}-{ctx.world_size}.json").write_text(json.dumps(
                {"result": result, "seconds": time.perf_counter() - t0,
                 "world": ctx.world_size}, indent=1, default=str))
        if case == "count":  # back to the CPU for whatever follows
            ctx = dataclasses.replace(ctx, device=torch.device("cpu"))
            dist_module._CTX = ctx
    shutdown()


if __name__ == "__main__":
    run_guarded(main, leave=True)
