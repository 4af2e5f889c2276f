"""Projection to clusters (``python -m runtime.calibrate.tune --simulate FABRIC --profile PROFILE``):
step time, scaling efficiency and time-to-train of BERT from 8 to 1,024 GPUs, per clip mode
and bucket plan, and the comparison with published MLPerf results.

Owns: ``GpuProfile`` (a per-GPU compute profile: a TOML ``[profile]``, every assumption a
documented field), `gpu_step_profile` (a CPU-measured layer split - ``python -m runtime.calibrate.tune
--profile-only`` on the same model shape - scaled to the GPU's published throughput),
`rcp_samples` (samples to converge from mlperf-logging's reference convergence points),
`project` (the scaling table), `published` (the four 1,024-A100 results and their errors) and
the CLI.
Never: measures GPUs (none here; a lent GPU's measured profile replaces the file's numbers),
or claims more than its inputs: every number in the output traces to a field of the fabric or
profile file, a measurement file, or docs/REFERENCES.md §10.

The model of one step at P GPUs, local batch b (runtime.calibrate.tune.simulate with κ = 1):
  forward + backward = b / sequences_per_second, split between them, and over the gradients'
  ready times, as the CPU measurement of the same shapes splits them;
  optimizer = parameters · optimizer_bytes_per_param / (hbm_GBps · 1e9) / optimizer_shard;
  with Presto's sharded optimizer (``optim.shard``, ``shard`` GPUs per update) instead: the
  update / shard, plus its two small allreduces and the parameters' all-gather, the buckets
  reduce-scattered (runtime.calibrate.tune.fabric.Fabric.shard_comm; `shard_table`: what it
  changes for the published 1,024-GPU rows);
  launch work: a 1/P pass over each bucket (8 B/element at HBM speed), a norm pass for the
  before-clip modes (4 B/element);
  allreduce: the fabric's T(n) at P GPUs (runtime.calibrate.tune.fabric), n in the reduce dtype;
  the split tied embedding: the rows a step's tokens touch by Heaps' law (fitted to this
  machine's measurements, ≤ V: at 1,024 GPUs every row), and the tuned plan solved with the
  tied sync split and dense, the faster kept (tied_embedding_sync is a config key);
  + step_overhead_ms (the file's; 0 unless the user knows better).
Time to train = steps · step + evaluations · eval time, steps = ⌈samples / global batch⌉,
evaluations every MLPerf cadence floor(0.05·(230.23·B + 3e6)/25000)·25000 samples, each a
forward over 10,000 samples spread over the GPUs (forward share of the per-sample compute)
plus one allreduce latency. Start-up (run_start before the first step) is not modelled.
"""
from __future__ import annotations

import json
import math
import sys
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from runtime.calibrate.tune.fabric import Fabric, FabricError, from_table, load_fabric
from runtime.choices import GRAPH_MODES
from runtime.calibrate.tune.simulate import Gradient, Instance, StepProfile, SyncSpec, simulate
from runtime.grad_sync.plan import resolve_tied_sync
from runtime.calibrate.tune.solve import (DDP_MB, HOROVOD_MB, MEGATRON_MIN_PARAMS, MB, cap_plan,
                                          single_size_grid, solve)

DATA = Path(__file__).resolve().parent / "systems"
EVAL_SAMPLES = 10_000
PUBLISHED = [
    # round, system, GPUs, global batch, seconds, samples to 0.720, clip mode, fabric, profile
    ("v1.1", "NVIDIA", 1024, 3072, 33.5, 2_840_000, "local_before", "dgx_a100_8xhdr.toml",
     "a100_packed.toml", "clip before allreduce, no overlap (docs/REFERENCES.md §10)"),
    ("v2.0", "NVIDIA", 1024, 4096, 25.3, 2_790_000, "local_before", "dgx_a100_8xhdr.toml",
     "a100_packed.toml", "clip before allreduce, no overlap"),
    ("v1.1", "Samsung (open, ADAM)", 1024, 16384, 25.1, 3_100_000, "bucket_before",
     "dgx_a100_4xhdr.toml", "a100_padded.toml", "bucket clip, DDP 25 MB buckets, 4x HDR"),
    ("v2.0", "Samsung (open, ADAM)", 1024, 16384, 22.3, 2_930_000, "bucket_before",
     "dgx_a100_4xhdr.toml", "a100_padded.toml", "bucket clip, DDP 25 MB buckets, 4x HDR"),
]


@dataclass(frozen=True)
class GpuProfile:
    """Per-GPU compute of one training step (``[profile]`` of a TOML file)."""

    name: str
    """what this describes"""
    sequences_per_second: float
    """forward + backward throughput of one GPU, sequences/s (published or measured)"""
    layer_split: str
    """JSON from `python -m runtime.calibrate.tune --profile-only` on the same model shape (CPU is fine):
    how forward, backward and the gradients' ready times divide the compute; relative to this
    file's directory"""
    hbm_GBps: float
    """memory bandwidth the optimizer and the launch passes reach, GB/s"""
    optimizer_bytes_per_param: float
    """bytes the optimizer step reads and writes per parameter"""
    optimizer_shard: int = 1
    """GPUs that share one optimizer update (a distributed optimizer shards it)"""
    reduce_bytes: int = 2
    """bytes per gradient element in the allreduce (2: fp16/bf16)"""
    element_bytes: int = 4
    """bytes of one parameter and of its gradient as the model holds them (4: fp32 under
    autocast; 2: train.precision bf16_master/fp16_master): the buckets' sizes and the sharded
    step's parameter all-gather"""
    step_overhead_ms: float = 0.0
    """per-step time outside the model (data, launch, loss scaling); 0 unless known"""
    tokens_per_sequence: float = 512.0
    """real tokens per sequence (row) of a batch: the split tied embedding's touched rows grow
    with the tokens of a step"""
    heaps_k: float = 2.15
    """Heaps' law K: distinct word pieces in N tokens ≈ K·N^β (fitted to this machine's two
    measurements: 146 rows in ~256 tokens, 2,038 in ~8,200 tokens of the Wikipedia sets)"""
    heaps_beta: float = 0.76
    """Heaps' law β"""
    max_local_batch: int = 64
    """the largest local batch that fits the GPU's memory at this sequence length (NVIDIA runs
    56 at sequence 512 on an A100 80 GB): the batch chooser goes no further"""
    cuda_graphs: str = "none"
    """the step's train.cuda_graphs: 'encoder' graphs each micro-batch's forward and backward
    as one autograd node, which hands back every gradient when the whole backward ends - no
    bucket can start during backward, so the model makes every gradient ready at its end and
    charges the exposed allreduce; 'none' and 'full' (the collectives captured where backward
    launches them) keep the overlap"""
    source: str = ""
    """where the numbers come from"""


def load_profile(path: str | Path,
                 models: Optional[Path] = None) -> tuple[GpuProfile, StepProfile, dict]:
    """A profile file, or ``model:GPU[:MODE[:CONFIG]]``: the device-time model's prediction
    (runtime.calibrate.tune.model_profile; ``models``: its file, default the one beside it)."""
    from runtime.calibrate.tune.model_profile import PROFILES, is_model, model_profile_fields
    if is_model(str(path)):
        fields, split = model_profile_fields(str(path), models or PROFILES)
        rec = json.loads(split.read_text())
        return (GpuProfile(**fields), with_tied_embedding(StepProfile.from_json(rec["profile"])),
                rec)
    path = Path(path)
    if not path.is_file():
        raise FabricError(f"profile file {path} does not exist (see runtime/calibrate/tune/systems/*.toml)")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise FabricError(f"{path}: not valid TOML ({e})") from e
    gp = from_table(data.get("profile"), f"{path} [profile]", GpuProfile)
    split = Path(gp.layer_split)
    split = split if split.is_absolute() else path.parent / split
    if not split.is_file():
        raise FabricError(f"{path} [profile]: layer_split {split} does not exist; make it with "
                          f"`python -m runtime.calibrate.tune --config C --profile-only {split.name}`")
    rec = json.loads(split.read_text())
    cpu = with_tied_embedding(StepProfile.from_json(rec["profile"]))
    return gp, cpu, rec


def with_tied_embedding(cpu: StepProfile) -> StepProfile:
    """A BERT profile measured without the tied embedding marked (a model without a decoder
    tap): the word embedding is the tied parameter, V = the MLM bias's size, and the decoder's
    share is ready with the MLM bias (the same autograd node produces both)."""
    if cpu.tied is not None:
        return cpu
    sizes = cpu.sizes()
    emb = next((n for n in sizes if n.endswith("word_embeddings.weight")), None)
    bias = next((g for g in cpu.grads if g.name == "cls.predictions.bias"), None)
    if emb is None or bias is None:
        return cpu
    return replace(cpu, tied=emb, tied_rows=bias.numel, decoder_ready_s=bias.ready_s)


def touched_rows(gp: GpuProfile, vocab: int, tokens: float) -> int:
    """Rows the split tied sync reduces after backward on a GPU: the engine's fixed-size
    buffer of min(V, the step's tokens on all GPUs) rows (runtime.grad_sync.tied compacts the
    touched rows without reading their count back), not the distinct rows the tokens touch
    (Heaps' law, ``distinct_rows``: what the CPU engine sends)."""
    return int(min(vocab, tokens))


def distinct_rows(gp: GpuProfile, vocab: int, tokens: float) -> int:
    """Rows of the word embedding the step's tokens (all GPUs) look up: Heaps' law, ≤ V."""
    return int(min(vocab, gp.heaps_k * tokens ** gp.heaps_beta))


def gpu_step_profile(gp: GpuProfile, cpu: StepProfile, local_batch: int,
                     gpus: int = 1, whole_update: bool = False) -> StepProfile:
    """The CPU layer split scaled to ``local_batch`` sequences at the GPU's throughput; the
    optimizer divided by the profile's ``optimizer_shard`` unless ``whole_update`` (Presto's
    sharding is then modelled by the simulator: SyncSpec.shard)."""
    compute = local_batch / gp.sequences_per_second
    scale = compute / (cpu.forward_s + cpu.backward_s)
    params = cpu.total_elements()
    hbm = gp.hbm_GBps * 1e9
    opt = params * gp.optimizer_bytes_per_param / hbm / \
        (1 if whole_update else max(1, gp.optimizer_shard))
    if gp.cuda_graphs not in GRAPH_MODES:
        raise ValueError(f"{gp.name}: cuda_graphs must be {' | '.join(GRAPH_MODES)}, got "
                         f"{gp.cuda_graphs!r}")
    # every gradient when the graphed backward ends (runtime.choices.GraphMode)
    at_end = not GRAPH_MODES[gp.cuda_graphs].overlaps_allreduce
    backward = cpu.backward_s * scale
    return replace(
        cpu, grads=tuple(Gradient(g.name, g.numel, backward if at_end else g.ready_s * scale)
                         for g in cpu.grads),
        forward_s=cpu.forward_s * scale, backward_s=backward, optimizer_s=opt,
        data_s=0.0, tail_s=gp.step_overhead_ms * 1e-3, element_bytes=gp.element_bytes,
        prescale_s_per_element=8 / hbm, norm_s_per_element=4 / hbm,
        decoder_ready_s=None if cpu.decoder_ready_s is None else
        backward if at_end else cpu.decoder_ready_s * scale,
        touched_rows=touched_rows(gp, cpu.tied_rows, gpus * local_batch * gp.tokens_per_sequence),
        # the split's finish: row mask, gather and the decoder share's add, ~12 B/element
        tied_finish_s=cpu.sizes().get(cpu.tied, 0) * 12 / hbm if cpu.tied else 0.0,
        comm_slowdown=1.0)


def rcp_samples(global_batch: int) -> tuple[float, str]:
    """Mean samples to 0.720 of the reference convergence points (mlperf-logging
    rcp_checker/training_5.0.0/rcps_bert.json), linear between the nearest batch sizes;
    clamped to the table's range."""
    import mlperf_logging
    path = Path(mlperf_logging.__file__).parent / "rcp_checker" / "training_5.0.0" / "rcps_bert.json"
    table = sorted((v["BS"], sum(v["Epochs to converge"]) / len(v["Epochs to converge"]))
                   for v in json.loads(path.read_text()).values())
    if global_batch <= table[0][0]:
        return table[0][1], f"RCP at batch {table[0][0]} (smallest)"
    if global_batch >= table[-1][0]:
        return table[-1][1], f"RCP at batch {table[-1][0]} (largest)"
    for (b0, s0), (b1, s1) in zip(table, table[1:]):
        if b0 <= global_batch <= b1:
            s = s0 + (s1 - s0) * (global_batch - b0) / (b1 - b0) if b1 > b0 else s0
            return s, f"RCP between batch {b0} and {b1}"
    raise AssertionError


@dataclass(frozen=True)
class SamplesTable:
    """Samples to reach the target at each global batch (what the optimizer needs at that
    batch: hardware-independent), interpolated log-log between its rows. The default is the
    MLPerf reference convergence points (LAMB); a measured study (``python -m
    bench.batch_scaling``'s record) or a published point (Samsung's re-tuned ADAM: 2.93 M at
    16,384) are others."""

    rows: tuple[tuple[int, float], ...]   # (global batch, samples), batch ascending
    source: str

    def __post_init__(self):
        if not self.rows:
            raise ValueError(f"{self.source}: the samples table has no rows")
        batches = [b for b, _ in self.rows]
        if batches != sorted(set(batches)):
            dup = next(b for b in batches if batches.count(b) > 1)
            raise ValueError(f"{self.source}: global batch {dup} appears twice with different "
                             f"samples; give one row per batch (average the runs)")
        for i, (b, s) in enumerate(self.rows, 1):
            if not (b >= 1 and s > 0 and math.isfinite(s)):
                raise ValueError(f"{self.source}, row {i}: batch {b}, samples {s}: both must be "
                                 f"positive numbers")

    @property
    def batches(self) -> tuple[int, int]:
        return self.rows[0][0], self.rows[-1][0]

    def samples_at(self, batch: int) -> float:
        """Samples to target at ``batch``, interpolated in log-log between the rows; a batch
        outside the table is refused (extrapolating samples-to-target is a guess)."""
        lo, hi = self.batches
        if not lo <= batch <= hi:
            raise ValueError(f"{self.source}: global batch {batch} is outside the table "
                             f"({lo}..{hi}); measure it, or ask for batches inside the table")
        for (b0, s0), (b1, s1) in zip(self.rows, self.rows[1:]):
            if b0 <= batch <= b1:
                w = math.log(batch / b0) / math.log(b1 / b0)
                return math.exp(math.log(s0) + w * (math.log(s1) - math.log(s0)))
        return self.rows[0][1]  # one row: only its own batch

    @classmethod
    def rcp(cls) -> "SamplesTable":
        """The MLPerf BERT reference convergence points (mlperf-logging rcp_checker,
        training_5.0.0/rcps_bert.json; LAMB), mean samples to 0.720 per batch."""
        import mlperf_logging
        path = (Path(mlperf_logging.__file__).parent / "rcp_checker" / "training_5.0.0"
                / "rcps_bert.json")
        rows = sorted((int(v["BS"]), sum(v["Epochs to converge"]) / len(v["Epochs to converge"]))
                      for v in json.loads(path.read_text()).values())
        return cls(tuple(rows), "MLPerf reference convergence points (rcps_bert.json, LAMB)")

    @classmethod
    def read(cls, path: str | Path) -> "SamplesTable":
        """A CSV file with a header and columns ``global_batch,samples`` (one row per batch),
        or the JSON record of ``python -m bench.batch_scaling`` (its ``samples_table``)."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise ValueError(f"samples table {path}: cannot read it ({e.strerror})") from None
        if path.suffix == ".json":
            try:
                rows = json.loads(text)["samples_table"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"samples table {path}: not a bench.batch_scaling record (no "
                                 f"samples_table)") from None
            pairs = [(r[0], r[1]) for r in rows]
        else:
            lines = [ln.strip() for ln in text.splitlines() if ln.strip() and
                     not ln.strip().startswith("#")]
            if not lines or lines[0].replace(" ", "") != "global_batch,samples":
                raise ValueError(f"samples table {path}: the first line must be the header "
                                 f"'global_batch,samples'")
            pairs = []
            for i, ln in enumerate(lines[1:], 2):
                parts = ln.split(",")
                try:
                    pairs.append((int(parts[0]), float(parts[1])))
                except (ValueError, IndexError):
                    raise ValueError(f"samples table {path}, line {i}: {ln!r} is not "
                                     f"'<global batch>,<samples>'") from None
        return cls(tuple(sorted((int(b), float(s)) for b, s in pairs)), str(path))


def choose_batch(gp: GpuProfile, cpu: StepProfile, fabric: Fabric, gpus: int,
                 table: SamplesTable, clip_mode: str = "global_after") -> list[Point]:
    """For ``gpus`` GPUs, the predicted time to train (tuned buckets) at each global batch the
    table covers and the GPUs can run (a local batch from 1 to ``gp.max_local_batch``),
    fastest first: the trade-off between scaling efficiency (a small local batch hides less
    communication) and sample efficiency (a large global batch needs more samples)."""
    lo, hi = table.batches
    locals_ = sorted({b for b in range(1, gp.max_local_batch + 1) if lo <= b * gpus <= hi} |
                     {b // gpus for b, _ in table.rows if b % gpus == 0
                      and 1 <= b // gpus <= gp.max_local_batch})
    if len(locals_) > 12:  # a geometric spread keeps the search quick
        idx = sorted({round(i * (len(locals_) - 1) / 11) for i in range(12)})
        locals_ = sorted({locals_[i] for i in idx} | {b // gpus for b, _ in table.rows
                                                      if b // gpus in locals_})
    points = []
    for b in locals_:
        B = b * gpus
        pts = step_points(gp, cpu, fabric, gpus, b, clip_mode, table.samples_at(B), ["tuned"])
        pts[0].samples_source = table.source
        points += pts
    return sorted(points, key=lambda p: p.ttt_s)


def best_batch_table(rows: list[tuple[int, list[Point]]]) -> str:
    lines = ["| GPUs | best global batch | local batch | step ms | steps | samples | time to "
             "train s | runner-up (batch: s) |", "|---|---|---|---|---|---|---|---|"]
    for gpus, pts in rows:
        if not pts:
            lines.append(f"| {gpus} | (no batch of the table fits: local batch 1..) | | | | | | |")
            continue
        best = pts[0]
        others = ", ".join(f"{p.global_batch}: {p.ttt_s:.1f}" for p in pts[1:3])
        lines.append(f"| {gpus} | **{best.global_batch}** | {best.global_batch // gpus} | "
                     f"{best.step_s * 1e3:.1f} | {best.steps} | {best.samples / 1e6:.2f} M | "
                     f"**{best.ttt_s:.1f}** | {others} |")
    return "\n".join(lines)


def eval_interval(global_batch: int) -> int:
    return int(0.05 * (230.23 * global_batch + 3_000_000) // 25_000) * 25_000


@dataclass
class Point:
    """One projected configuration."""

    gpus: int
    global_batch: int
    clip_mode: str
    plan: str
    buckets: int
    step_s: float
    compute_s: float
    exposed_s: float
    optimizer_s: float
    samples: float
    steps: int
    evals: int
    eval_s: float
    ttt_s: float
    samples_source: str = ""
    tied_sync: str = ""
    shard: int = 0
    """Presto's optim.shard GPUs per update (0: the profile's own optimizer_shard, no
    collectives of its own)"""
    update_s: float = 0.0
    """of optimizer_s: the update itself"""
    gather_s: float = 0.0
    """of optimizer_s: the sharded step's parameter all-gather"""

    @property
    def optimizer_share(self) -> float:
        return self.optimizer_s / self.step_s

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _plans(inst: Instance, profile: StepProfile, P: int, num_buckets: Optional[int],
           wanted: Optional[list[str]] = None):
    elem = profile.element_bytes
    alone = profile.tied if inst.spec.tied_sync == "split" else None
    order = [(g.name, g.numel) for g in profile.grads]

    def want(name: str) -> bool:
        return not wanted or name in wanted

    from runtime.grad_sync.plan import BucketPlan
    plans = {}
    if want("no bucketing"):
        plans["no bucketing"] = BucketPlan.from_cap(order, 1 << 62, "no bucketing", alone=alone)
    for name, cap in (("DDP 25 MiB", DDP_MB * MB), ("Horovod 64 MiB", HOROVOD_MB * MB),
                      ("Megatron", max(MEGATRON_MIN_PARAMS, 1_000_000 * P) * elem)):
        if want(name):
            plans[name] = cap_plan(inst, cap, name, alone)
    if want("best single size"):
        best = min((simulate(inst, cap_plan(inst, c, "s", alone)).step_s, c)
                   for c in single_size_grid(profile.total_elements() * elem))
        plans["best single size"] = cap_plan(inst, best[1],
                                             f"best single {best[1] / MB:.3g} MiB", alone)
    if want("tuned"):
        sol = solve(inst, num_buckets=num_buckets, max_candidates=1500, bound=False)
        plans["tuned"] = inst.plan_from_cuts(sol.cuts, "tuned")
    return plans


def step_points(gp: GpuProfile, cpu: StepProfile, fabric: Fabric, gpus: int, local_batch: int,
                clip_mode: str, samples: Optional[float] = None,
                plans_wanted: Optional[list[str]] = None,
                num_buckets: Optional[int] = None, shard: int = 0) -> list[Point]:
    """Projected points; ``shard`` > 0: Presto's optim.shard with that many GPUs per update
    (1: unsharded, the whole update on every GPU)."""
    profile = gpu_step_profile(gp, cpu, local_batch, gpus, whole_update=shard > 0)
    comm = fabric.comm_model(gpus)
    tied, _ = resolve_tied_sync("auto", clip_mode, gpus, rows=cpu.tied_rows,
                                tokens_per_step=local_batch * gp.tokens_per_sequence,
                                device_type="cuda")
    spec = SyncSpec(clip_mode=clip_mode, tied_sync=tied, reduce_bytes=gp.reduce_bytes,
                    align=1024, world_size=gpus, shard=max(shard, 1),
                    shard_comm=fabric.shard_comm(gpus, shard) if shard > 1 else None)
    inst = Instance.build(profile, spec, comm)
    other = None
    if tied == "split":   # the tuned plan may also run with tied_embedding_sync=dense
        other = Instance.build(profile, replace(spec, tied_sync="dense"), comm)
    B = gpus * local_batch
    src = "given"
    if samples is None:
        samples, src = rcp_samples(B)
    steps = math.ceil(samples / B)
    evals = math.ceil(samples / eval_interval(B))
    fwd_per_sample = profile.forward_s / local_batch
    eval_s = math.ceil(EVAL_SAMPLES / gpus) * fwd_per_sample + comm.alpha
    out = []
    for name, plan in _plans(inst, profile, gpus, num_buckets, plans_wanted).items():
        tl = simulate(inst, plan, name)
        mode = tied
        if name == "tuned" and other is not None:
            sol = solve(other, num_buckets=num_buckets, max_candidates=1500, bound=False)
            tl2 = simulate(other, other.plan_from_cuts(sol.cuts, "tuned"), name)
            if tl2.step_s < tl.step_s:
                tl, plan, mode = tl2, tl2.plan, "dense"
        out.append(Point(gpus, B, clip_mode, name, len(plan.buckets), tl.step_s,
                         profile.forward_s + profile.backward_s, tl.exposed_s,
                         inst.optimizer_s, samples, steps, evals, eval_s,
                         steps * tl.step_s + evals * eval_s, src, mode, shard,
                         profile.optimizer_s / max(shard, 1), inst.gather_s()))
    return out


def project(gp, cpu, fabric, gpus_list, local_batch, clip_modes) -> list[Point]:
    pts = []
    for clip in clip_modes:
        for p in gpus_list:
            pts += step_points(gp, cpu, fabric, p, local_batch, clip)
    return pts


def scaling_table(points: list[Point]) -> str:
    lines = ["| clip mode | GPUs | global batch | compute ms | step ms: no bucketing | DDP 25 MiB |"
             " best single | **tuned** | tuned: buckets, tied sync | exposed comm ms (tuned) | "
             "scaling efficiency (tuned) | samples (RCP) | time to train s (tuned) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    key = {}
    for pt in points:
        key.setdefault((pt.clip_mode, pt.gpus), {})[pt.plan] = pt
    for (clip, p), d in key.items():
        t = d["tuned"]
        eff = (t.compute_s + t.optimizer_s) / t.step_s  # vs one GPU: no allreduce, no launch work
        lines.append(f"| {clip} | {p} | {t.global_batch} | {t.compute_s * 1e3:.1f} | "
                     f"{d['no bucketing'].step_s * 1e3:.1f} | {d['DDP 25 MiB'].step_s * 1e3:.1f} | "
                     f"{d['best single size'].step_s * 1e3:.1f} | **{t.step_s * 1e3:.1f}** | "
                     f"{t.buckets}, {t.tied_sync} | "
                     f"{t.exposed_s * 1e3:.1f} | {eff:.0%} | {t.samples / 1e6:.2f} M | "
                     f"{t.ttt_s:.1f} |")
    return "\n".join(lines)


def published(profiles: dict, fabrics: dict) -> list[dict]:
    rows = []
    for rnd, system, gpus, batch, secs, samples, clip, fab, prof, how in PUBLISHED:
        gp, cpu = profiles[prof]
        fabric = fabrics[fab]
        b = batch // gpus
        K = 22 if clip == "bucket_before" else None  # Samsung's hard-coded 22 buckets
        pts = step_points(gp, cpu, fabric, gpus, b, clip, samples,
                          ["DDP 25 MiB", "no bucketing", "tuned"], num_buckets=K)
        d = {pt.plan: pt for pt in pts}
        plan = "DDP 25 MiB" if clip == "bucket_before" else "no bucketing"
        theirs = d[plan]
        assumption = (f"{plan}" + (f" ({K} buckets)" if K else "") + f", {clip}, the update "
                      + (f"sharded over {gp.optimizer_shard} GPUs (the profile's "
                         f"optimizer_shard; its all-gather not modelled)"
                         if gp.optimizer_shard > 1 else "whole on every GPU"))
        rows.append({"round": rnd, "system": system, "gpus": gpus, "global_batch": batch,
                     "published_s": secs, "samples": samples, "clip_mode": clip, "fabric": fab,
                     "profile": prof, "what_they_ran": how, "assumption": assumption,
                     "predicted_s": theirs.ttt_s, "error": theirs.ttt_s / secs - 1,
                     "their_plan": theirs.to_json(), "tuned": d["tuned"].to_json(),
                     "tuned_s": d["tuned"].ttt_s})
    return rows


def shard_rows(profiles: dict, fabrics: dict, gpus_per_update: int = 8) -> list[dict]:
    """What Presto's optim.shard changes for the published 1,024-GPU rows: their tuned plan
    unsharded (every GPU runs the whole update) against optim.shard=node (``gpus_per_update``
    GPUs per update: the buckets reduce-scattered in the node, the shard all-reduced across
    nodes, 1/8 of the update, the parameters all-gathered in the node)."""
    rows = []
    for rnd, system, gpus, batch, secs, samples, clip, fab, prof, how in PUBLISHED:
        gp, cpu = profiles[prof]
        K = 22 if clip == "bucket_before" else None
        row = {"round": rnd, "system": system, "gpus": gpus, "global_batch": batch,
               "clip_mode": clip, "profile": prof, "fabric": fab}
        for key, shard in (("unsharded", 1), ("sharded", gpus_per_update)):
            (pt,) = step_points(gp, cpu, fabrics[fab], gpus, batch // gpus, clip, samples,
                                ["tuned"], num_buckets=K, shard=shard)
            row[key] = {**pt.to_json(), "optimizer_share": pt.optimizer_share}
        u, sh = row["unsharded"], row["sharded"]
        row["share_cut"] = u["optimizer_share"] / sh["optimizer_share"]
        row["update_share_cut"] = (u["update_s"] / u["step_s"]) / (sh["update_s"] / sh["step_s"])
        rows.append(row)
    return rows


def shard_table(rows: list[dict]) -> str:
    lines = ["| round | system | GPUs | optim.shard=none (the whole update on every GPU): "
             "optimizer ms (share of step) | step ms | time to train s | optim.shard=node (8): "
             "update + all-gather + small ms (share) | "
             "step ms | time to train s | optimizer share cut (update alone) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        u, s = r["unsharded"], r["sharded"]
        small = s["optimizer_s"] - s["update_s"] - s["gather_s"]
        lines.append(
            f"| {r['round']} | {r['system']} | {r['gpus']} | {u['optimizer_s'] * 1e3:.1f} "
            f"({u['optimizer_share']:.0%}) | {u['step_s'] * 1e3:.1f} | {u['ttt_s']:.1f} | "
            f"{s['update_s'] * 1e3:.2f} + {s['gather_s'] * 1e3:.2f} + {small * 1e3:.2f} = "
            f"{s['optimizer_s'] * 1e3:.1f} ({s['optimizer_share']:.0%}) | "
            f"{s['step_s'] * 1e3:.1f} | {s['ttt_s']:.1f} | {r['share_cut']:.1f}x "
            f"({r['update_share_cut']:.1f}x) |")
    return "\n".join(lines)


def published_table(rows: list[dict]) -> str:
    """One prediction per published run - of what that run did, as the model sees it - and
    the assumption it rests on."""
    lines = ["| round | system | GPUs | batch | published s | predicted s | error | the "
             "prediction assumes | steps × step ms | compute ms | exposed comm ms | optimizer ms"
             " | eval s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["their_plan"]
        lines.append(f"| {r['round']} | {r['system']} | {r['gpus']} | {r['global_batch']} | "
                     f"{r['published_s']} | {r['predicted_s']:.1f} | {r['error']:+.0%} | "
                     f"{r['assumption']} | "
                     f"{t['steps']} × {t['step_s'] * 1e3:.1f} | {t['compute_s'] * 1e3:.1f} | "
                     f"{t['exposed_s'] * 1e3:.1f} | {t['optimizer_s'] * 1e3:.1f} | "
                     f"{t['evals'] * t['eval_s']:.2f} |")
    return "\n".join(lines)


def main(args) -> int:
    try:
        fabric = load_fabric(args.simulate)
        prof_path = args.profile or DATA / "a100_packed.toml"
        gp, cpu, _ = load_profile(prof_path)
        if getattr(args, "cuda_graphs", None):
            gp = replace(gp, cuda_graphs=args.cuda_graphs)
        gpus = [int(x) for x in str(args.gpus).split(",")]
        # read (and refuse) the samples table before seconds of simulation
        table = SamplesTable.read(args.samples) if getattr(args, "samples", None) \
            else SamplesTable.rcp()
    except (FabricError, ValueError) as e:
        print(f"runtime.calibrate.tune --simulate: {e}", file=sys.stderr)
        return 2
    try:
        local = int(getattr(args, "local_batch", None) or 4)
        pts = project(gp, cpu, fabric, gpus, local, ("global_after", "bucket_before",
                                                     "local_before"))
    except FabricError as e:
        print(f"runtime.calibrate.tune --simulate: {e}", file=sys.stderr)
        return 2
    print(f"fabric: {fabric.name} ({fabric.source}); profile: {gp.name} "
          f"({gp.sequences_per_second:g} seq/s per GPU; {gp.source}); local batch {local}; "
          f"cuda_graphs {gp.cuda_graphs}\n")
    print(scaling_table(pts))
    try:
        chosen = [(p, choose_batch(gp, cpu, fabric, p, table)) for p in gpus]
    except (ValueError, FabricError) as e:
        print(f"runtime.calibrate.tune --simulate: {e}", file=sys.stderr)
        return 2
    print(f"\nthe batch that trains fastest per GPU count (samples to target: {table.source};"
          f" local batch 1..{gp.max_local_batch}; global_after, tuned buckets):\n")
    print(best_batch_table(chosen))
    profiles = {n: load_profile(DATA / n)[:2] for n in ("a100_packed.toml", "a100_padded.toml")}
    fabrics = {n: load_fabric(DATA / n) for n in ("dgx_a100_8xhdr.toml", "dgx_a100_4xhdr.toml")}
    pub = published(profiles, fabrics)
    print("\npublished 1,024-A100 results (olympic means, docs/REFERENCES.md §10) against the "
          "model: one prediction per run, of what that run did (its bucketing and clip mode, its "
          "sharded update), and the assumption it rests on:\n")
    print(published_table(pub))
    sharded = shard_rows(profiles, fabrics)
    print("\nNot those runs: what Presto would run on the same rows (its tuned buckets), with "
          "each optimizer it has - optim.shard=none, the whole update on every GPU, and "
          "optim.shard=node, 8 GPUs per update (the optimizer span is the update, the two "
          "small allreduces and the parameters' fp32 all-gather, run after the step):\n")
    print(shard_table(sharded))
    if args.json:
        Path(args.json).write_text(json.dumps({"fabric": fabric.__dict__, "profile": gp.__dict__,
                                               "local_batch": local,
                                               "points": [p.to_json() for p in pts],
                                               "samples_table": {"source": table.source,
                                                                 "rows": table.rows},
                                               "best_batch": {str(g): [p.to_json() for p in v]
                                                              for g, v in chosen},
                                               "published": pub, "sharded": sharded},
                                              indent=1))
    return 0
