"""Kernels one training step launches on a GPU, counted on a CPU: ``python -m bench.kernel_count``.

    python -m bench.kernel_count [--layers 24] [--hidden 128] [--widths 256]
        [--small-layers 2] [--modes NAME,...] [--set SECTION.KEY=VALUE ...]
        [--out bench/results/kernel_count.json]

Each mode is counted at ``--layers`` and ``--hidden``, again at each of ``--widths`` (the
same ops, or the record says otherwise) and at ``--small-layers`` (kernels per layer from
the difference); the H200's mode also with the CPU's own autocast lists (what the
emulation changes). 13 to 40 minutes for the three modes on the 2-core dev machine (by its
load).

What is counted: the step the trainer runs (runtime.train.step ``StepBody.run``: forward,
backward, the gradient sync, the optimizer with the clip and the loss scale) as the
whole-step CUDA graph replays it (train.cuda_graphs='full', runtime.train.graphs
``FullStepGraph``): the static batch's host-to-device copy before the replay, the captured
body, the packed step values and the replay's copy-out of them - the device activities
``python -m bench.gpu``'s graphs stage counts with torch.profiler (kernels, memcpy and
memset). The shape is that stage's ``b4`` case (the 2026-11-28 record's 2 rows; its ``rows2``
packs up to 8 sequences a row: the same ops): a world of one, local batch 4 in 2 static
packed rows of 512 tokens (offline_pack), unpadded attention, bf16 autocast over fp32
parameters, the fused flat LAMB, BERT-large's 24 layers. ``MODES`` holds one row per
precision and compile mode (config overrides); a new mode is a new row.

How, on a CPU:
  * the step runs on runtime.observe.hostsync's simulated device (a CPU device the runtime
    treats as a GPU: the full-graph runner's eager warm-up, with ``warmup_steps`` never
    ending) under bench.cuda_dispatch's ``as_on_cuda``: CUDA's autocast op lists, CUDA's
    fused dropout, FlashAttention's varlen ops - the ops CUDA would dispatch where its route
    differs from the CPU's;
  * ``KernelCounter`` (bench/kernel_counter.py: a TorchDispatchMode, below autograd, what
    reaches a backend) records every op of the counted step that would launch device work. Not counted: views and
    metadata (``OpOverload.is_view``, ``NO_KERNEL``: empty, detach, set_, record_function
    markers ...), a copy of a tensor onto its own memory (ATen returns early), an op on
    empty tensors, and host work - ops whose tensors all come from the host batch (collating
    and flattening it before the copy), as on a GPU they run on the CPU;
  * each op is one launch except those ``KERNELS_PER_OP`` names, whose CUDA implementation
    launches more (flash backward 3, LayerNorm backward 2, embedding backward 2, NLL
    backward 2; the table says why), and the multi-tensor ops (``MULTI_TENSOR_DEPTH``: the
    buckets' gradient adds), counted as ATen's multi_tensor_apply splits them into launches:
    the "kernels" column. Copies count as the profiler's memcpy, fills as its memset or fill
    kernel, one each;
  * compiled regions (the fused optimizer's two passes, ``model.fusions``, later whole
    layers) run their Inductor code: each generated kernel is wrapped in the loaded wrapper
    module and counted per call (``count_inductor_kernels``), and what the wrapper hands to
    ATen (GEMMs, fallbacks) reaches the counter like any op (``ignore_compile_internals``:
    the mode sees the compiled artifact run, not its tracing).

What is not the GPU's count, and why (docs/benchmarks/kernel_count.md compares with the
H200 record): Inductor on a CPU emits C++ kernels, grouped by its CPU scheduler - Triton's
grouping can differ (a large reduction split in two kernels, a reduction and its pointwise
tail not fused); cuBLAS may launch 2 kernels for a GEMM (a split-K reduction) where this
counts 1; the multi-kernel table is read from PyTorch's CUDA sources, not measured; a
world of one launches no collective (NCCL kernels would add one per bucket, overlapping).

Why a narrow model: the count does not depend on the hidden size or the vocabulary (every
op runs once per tensor, whatever its size; ``--widths`` checks it on two widths each run),
so the bench builds BERT-large's 24 layers at hidden 128 and a 512-token vocabulary (a
count in about a minute). It does depend on the layers (about 96 kernels each), on the shapes' static plan
(rows, sequence slots), on every mode key and on the number of gradient buckets (one
multi-tensor add each): the narrow model's bucket cap is chosen so that it has as many
buckets as BERT-large (``matched_bucket_cap``).

Owns: the modes, the step's shape (its bucket cap too), the synthetic data set the step
reads, counting the step, the table and the record (bench/common.py's header). The counter
and its rules are bench/kernel_counter.py's.
Never: needs a GPU, times anything (the count is deterministic: load does not matter), or
changes what the step computes (every op runs as it would; the flash stand-in's values are
not attention's: bench.cuda_dispatch).
"""
from __future__ import annotations

import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.harness import Benchmark, Goal, Stop, option, run
from bench.kernel_counter import (CATEGORIES, PHASES, Phases, count_inductor_kernels,
                                  counting, summarize)

BASE = ("data.shapes=static", "data.balance=offline_pack", "model.attention=unpadded",
        "data.bin_edges=[]", "data.static_rows=2", "train.cuda_graphs=full",
        "train.global_batch_size=4", "system.nodes=1", "system.ranks_per_node=1",
        'system.device="auto"', "data.max_seq_length=512", "data.max_predictions_per_seq=76",
        "model.init=scratch", "train.log_every_steps=100000", "train.max_steps=100000",
        'model.size=""', "model.num_hidden_layers=24", "model.hidden_size=128",
        "model.num_attention_heads=2", "model.intermediate_size=512", "model.vocab_size=512")
"""The H200 record's 2-row case - bench/gpu/stages/graphs.py's ``b4`` now (2 rows of at most 3
sequences; its ``rows2``, up to 8 a row, runs the same ops) - on the DGX config at a narrow
width: the overrides every count starts from (later overrides win)."""

FUSED = '["bias_gelu","dropout_add_norm","pad_vocab"]'
FUSED_QKV = '["bias_gelu","dropout_add_norm","pad_vocab","qkv"]'

MODES: dict[str, tuple[str, ...]] = {
    "bf16_autocast": ("train.precision=bf16", "model.fusions=[]"),
    "bf16_autocast_fusions": ("train.precision=bf16", f"model.fusions={FUSED}"),
    "fp16_autocast": ("train.precision=fp16", "model.fusions=[]"),
    "bf16_master": ("train.precision=bf16_master", "model.fusions=[]"),
    "bf16_master_qkv": ("train.precision=bf16_master", 'model.fusions=["qkv"]'),
    "bf16_master_fusions": ("train.precision=bf16_master", f"model.fusions={FUSED_QKV}"),
    "bf16_master_layers": ("train.precision=bf16_master", 'model.fusions=["pad_vocab","qkv"]',
                           "model.compile=layers"),
}
"""One row per precision and compile mode: its config overrides (on ``BASE``; every row
names its fusions - the DGX config's own, ``qkv``, would otherwise change a row's meaning): fp32
parameters under autocast (fp16 with its dynamic loss scale), and bf16 parameters with fp32
master weights in the optimizer (train.precision bf16_master), with the fusions and the one
QKV GEMM; fp32 itself is no row: its attention is SDPA on padded heads, whose CUDA kernel
choice is not emulated (bench.cuda_dispatch)."""

H200_RECORD = {"kernels": 2643, "file": "bench/results/gpu_nvidia-h200_2026-11-28.json",
               "key": "stages.graphs.result.rows2.full.kernels",
               "mode": "bf16_autocast"}
"""The measured count this bench is compared with (torch.profiler's CUDA events of a replay,
memcpy and memset included, one H200, torch 2.11)."""

GOAL = 1000
"""Kernels a step at most, in the best mode (issue 50)."""

WARMUP_STEPS = 2
"""Steps before the counted one: the bucket engine's first-step re-cut and every compile
happen in them (runtime.train.graphs runs 3 before a capture; the op sequence is the same
from the second on - tests/integration/test_graphs_integration.py)."""

# ------------------------------------------------------------------------------- the step

def config(*overrides: str, data_dir: str | Path | None = None):
    """The DGX config with ``BASE``, its bucket cap matched to the narrow model
    (``matched_bucket_cap``), then ``overrides`` (a mode's, the caller's: a cap there wins)."""
    from bench.gpu.harness import DGX_CONFIG
    from runtime.config import load_config
    extra = [f'data.data_dir="{data_dir}"', "data.verify_checksums=false"] if data_dir else []
    cap = matched_bucket_cap(load_config(DGX_CONFIG, [*BASE, *overrides]))
    return load_config(DGX_CONFIG, [*BASE, f"train.bucket_cap_mb={cap!r}", *overrides, *extra])


def matched_bucket_cap(narrow) -> float:
    """The bucket cap (MiB) at which the narrow model's gradients are cut into as many
    buckets as the DGX config's own widths at the same depth and mode keys, with that config's
    cap (``train.bucket_cap_mb``), both in reverse registration order (the first step's cut).
    Each bucket adds its gradients into the buffer in one multi-tensor kernel
    (runtime.grad_sync.buckets), so the count depends on how many there are - on the GPU,
    BERT-large's (28 in bf16, 54 in fp32 at 25 MiB). The count of buckets falls as the cap
    grows: bisection finds where it passes BERT-large's (on the meta device: no memory, no
    weights), and the side nearer to it is taken - the narrow layers have few parameter
    sizes, so some counts no cap gives (fp32 at 24 layers: 51 or 63, not 54; 51 is taken)."""
    import dataclasses
    from bench.gpu.harness import DGX_CONFIG
    from runtime.config import load_config
    from runtime.grad_sync.plan import MB
    dgx = load_config(DGX_CONFIG, [])
    wide = dataclasses.replace(narrow, model=dataclasses.replace(
        narrow.model, **{k: getattr(dgx.model, k) for k in (
            "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")}))
    element = _grad_element_size(narrow)
    want = _bucket_count(wide, int(dgx.train.bucket_cap_mb * MB) // element)
    sizes = _grad_sizes(narrow)
    lo, hi = 1, sum(sizes)  # bucket counts at lo >= want; at hi: 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _bucket_count(narrow, mid, sizes) >= want:
            lo = mid
        else:
            hi = mid - 1
    if lo < sum(sizes) and abs(_bucket_count(narrow, lo + 1, sizes) - want) \
            < abs(_bucket_count(narrow, lo, sizes) - want):
        lo += 1  # the narrow layers' few sizes may allow no cap with exactly as many
    return (lo * element + element / 2) / MB  # build_grad_sync's int(cap * MB) // element = lo


def _grad_element_size(cfg) -> int:
    """Bytes of a gradient element: the parameters' dtype (the run's runtime.numerics)."""
    return cfg.numerics().param_bytes


def _grad_sizes(cfg) -> list[int]:
    """The trainable parameters' sizes in reverse registration order (the model as
    runtime.train.build makes it - its converters, fusion qkv's one Wqkv, applied - on the
    meta device)."""
    import torch
    from runtime.train.build import build_model
    with torch.device("meta"):
        model = build_model(cfg, torch.device("cpu"))
    return [p.numel() for p in model.parameters() if p.requires_grad][::-1]


def _bucket_count(cfg, cap_elements: int, sizes: list[int] | None = None) -> int:
    from runtime.grad_sync.plan import BucketPlan
    sizes = _grad_sizes(cfg) if sizes is None else sizes
    return len(BucketPlan.from_cap([(str(i), n) for i, n in enumerate(sizes)],
                                   cap_elements).buckets)


def synthetic_data(root: Path, cfg) -> Path:
    """A data set the step can read at ``cfg``'s shapes: equal sequences that fill the static
    rows exactly (each row holds ceil(local batch / rows) of them), random tokens below the
    vocabulary, 15 % masked. The count reads no value: only the shapes matter."""
    from loaders.dataset import STATS_FILE
    from loaders.shards import EVAL_FILE, TRAIN_DIR, Samples, shard_name, write_shard
    seq, batch = cfg.data.max_seq_length, cfg.train.global_batch_size
    rows = max(cfg.data.static_rows, 1)
    length = seq // math.ceil(batch / rows)
    vocab, rng = cfg.model.vocab_size, np.random.default_rng(0)

    def samples(n: int) -> Samples:
        cols: dict[str, list] = {"input_ids": [], "segment_ids": [], "masked_lm_positions": [],
                                 "masked_lm_ids": []}
        n_masked = min(cfg.data.max_predictions_per_seq, max(1, round(0.15 * length)))
        for _ in range(n):
            ids = rng.integers(5, vocab, size=length)
            ids[0], ids[length // 2], ids[-1] = 2, 3, 3  # [CLS] A [SEP] B [SEP]
            segments = (np.arange(length) > length // 2).astype(np.int64)
            positions = np.sort(rng.choice(np.arange(1, length - 1), n_masked, replace=False))
            for key, col in zip(cols, (ids, segments, positions, ids[positions])):
                cols[key].append(np.asarray(col, dtype=np.int16))
        return Samples(**cols, next_sentence_labels=rng.integers(0, 2, n).astype(np.int8))

    (root / TRAIN_DIR).mkdir(parents=True)
    (root / EVAL_FILE).parent.mkdir(parents=True)
    shards = []
    for i in range(2):
        rel = f"{TRAIN_DIR}/{shard_name(i, 2)}"
        write_shard(root / rel, samples(8 * batch))
        shards.append({"file": rel, "samples": 8 * batch})
    write_shard(root / EVAL_FILE, samples(batch))
    (root / STATS_FILE).write_text(json.dumps({
        "train_shards": shards, "eval_samples": batch, "vocab": {"size": vocab},
        "parameters": {"seq_len": seq, "max_pred": cfg.data.max_predictions_per_seq,
                       "masked_lm_prob": 0.15}}))
    return root


def count_step_kernels(*overrides: str, cuda_autocast: bool = True) -> dict:
    """The kernels one step of the config ``BASE`` + ``overrides`` launches (module
    docstring): totals, and counts by category, phase and op. ``cuda_autocast=False``: the
    CPU's own autocast lists instead of CUDA's (what the emulation changes)."""
    import torch
    from bench.cuda_dispatch import as_on_cuda, attention_as_on_cuda
    from bench.gpu.harness import world_of_one
    from runtime.choices import ConfigError
    from runtime.launch import dist
    from runtime.observe.hostsync import simulated
    from runtime.train.trainer import Trainer

    cfg = config(*overrides)
    if cfg.train.cuda_graphs != "full":
        raise ConfigError(f"train.cuda_graphs={cfg.train.cuda_graphs!r}: the kernel count "
                          f"counts the whole-step graph's replay; set train.cuda_graphs=full")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kernel_count_") as tmp:
        data = synthetic_data(Path(tmp) / "data", cfg)
        cfg = config(*overrides, f'train.output_dir="{Path(tmp) / "runs"}"', data_dir=data)
        ours = dist.current() is None   # a world of one made here is shut down here (a
        with as_on_cuda(autocast=cuda_autocast):   # group left behind is forked with a pool)
            trainer = Trainer(cfg, simulated(world_of_one("cpu")))
            try:
                trainer.setup()
                with attention_as_on_cuda(trainer.model):
                    records = _count_replay(trainer)
            finally:
                trainer.close()
                if ours:
                    dist.shutdown()
    out = summarize(records)
    m = cfg.model
    out.update(layers=m.num_hidden_layers, hidden_size=m.hidden_size,
               vocab_size=m.vocab_size, precision=cfg.train.precision,
               fusions=list(m.fusions), optimizer_backend=trainer.optimizer.backend,
               optimizer_compiled=trainer.state.derived.get("optimizer_compiled"),
               static_shape=str(trainer.train_loader.static), cuda_autocast=cuda_autocast,
               torch=torch.__version__, seconds=round(time.perf_counter() - t0, 1))
    return out


def _count_replay(trainer) -> list[tuple[str, str, str, int]]:
    """What one replay of the whole-step graph launches: the warm-up steps first, then a step
    counted phase by phase (``PHASES``), plus the copy-out a replay makes after it
    (``FullStepGraph.step``: ``self._out.clone()``; a warm-up step hands the values back
    without it)."""
    from runtime.train.graphs import batch_tensors
    graph = trainer.runner.graph
    graph.warmup_steps = 10 ** 9  # the simulated device captures nothing: run the step
    it = iter(trainer.train_loader)
    for _ in range(WARMUP_STEPS):
        trainer.train_step(it)
    trainer.step_log.flush()
    count_inductor_kernels()
    batches = [next(it) for _ in range(trainer.body.accum)]
    step, timeline = graph.captured_step, trainer.body.timeline
    with counting(host=[t for b in batches for t in batch_tensors(b)]) as counter:

        def counted_body(slots):
            counter.phase = "step"
            values = step(slots)
            counter.phase = "output"
            return values
        graph.captured_step, trainer.body.timeline = counted_body, Phases(counter)
        try:
            counter.phase = "input"
            graph.step(batches)
        finally:
            graph.captured_step, trainer.body.timeline = step, timeline
        counter.add("clone", "copy/fill")  # the replay's copy-out, in phase "output"
    if count_inductor_kernels():
        raise RuntimeError("the counted step compiled code (whose kernels went uncounted): "
                           "raise bench.kernel_count.WARMUP_STEPS until nothing compiles in it")
    return counter.records


# ------------------------------------------------------------------------------ the bench

def _table(counts: dict[str, dict]) -> list[str]:
    names = list(counts)
    width = max(14, *(len(n) + 2 for n in names))

    def row(label, cells):
        return f"{label:18}" + "".join(f"{c:>{width}}" for c in cells)
    lines = [row("kernels a step", names)]
    for cat in CATEGORIES:
        cells = [counts[n]["by_category"].get(cat, {}).get("kernels", 0) for n in names]
        if any(cells):
            lines.append(row(cat, cells))
    lines += [row("total kernels", [counts[n]["kernels"] for n in names]),
              row("total ops", [counts[n]["ops"] for n in names]),
              row("per layer", [counts[n].get("per_layer", "-") for n in names]), "",
              row("by phase", names)]
    lines += [row(phase, [counts[n]["by_phase"].get(phase, {}).get("kernels", 0)
                          for n in names]) for phase in PHASES]
    return lines


def table(rec: dict) -> str:
    counts, best = rec["counts"], rec["best"]
    lines = ["", *_table(counts)]
    if "vs_h200" in rec:
        v = rec["vs_h200"]
        lines.append(f"\n{H200_RECORD['mode']}: {v['counted']} counted, {v['measured']} "
                     f"measured on the H200 ({v['ratio']:.3f}); with the CPU's own autocast "
                     f"lists {rec['cpu_autocast_lists']['kernels']}")
    lines.append(f"best: {best['mode']}, {best['kernels']} kernels (goal <= {GOAL})")
    return "\n".join(lines)


def _modes(a) -> list[str]:
    return [m for m in a.modes.split(",") if m]


def _widths(a) -> list[int]:
    return [int(w) for w in a.widths.split(",") if w]


def check(a) -> str | None:
    """The flags, each refused by its own name (not by a config key it turns into)."""
    modes = _modes(a)
    if not modes:
        return (f"--modes names no mode; give one or more of {', '.join(MODES)} "
                f"(comma-separated), or leave it out for all")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        return f"--modes: unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}"
    if a.layers < 1:
        return f"--layers {a.layers}: count at least 1 encoder layer (BERT-large: 24)"
    if a.hidden < 1:
        return (f"--hidden {a.hidden}: the hidden size must be a positive number (heads of "
                f"64; 128 is the default)")
    try:
        widths = _widths(a)
    except ValueError:
        return (f"--widths {a.widths!r}: give hidden sizes as comma-separated numbers ('' for "
                f"none)")
    if any(w < 1 for w in widths):
        return f"--widths {a.widths!r}: every hidden size must be a positive number"
    if a.small_layers < 0 or a.small_layers >= a.layers:
        return (f"--small-layers {a.small_layers}: must be 0 (none) or from 1 to --layers - 1 "
                f"({a.layers - 1})")
    return None


def _count(a, mode: str, hidden: int, layers: int, **kw) -> dict:
    """One count of ``mode`` at a width and depth (the printed line as it ends)."""
    from loaders.shards import DataError
    from runtime.choices import ConfigError
    shape = [f"model.num_hidden_layers={layers}", f"model.hidden_size={hidden}",
             f"model.num_attention_heads={max(1, hidden // 64)}",
             f"model.intermediate_size={4 * hidden}", f"model.vocab_size={4 * hidden}"]
    try:
        got = count_step_kernels(*MODES[mode], *shape, *a.set, **kw)
    except (ConfigError, DataError) as e:
        raise Stop(str(e), 2) from None
    lists = "" if kw.get("cuda_autocast", True) else ", the CPU's autocast lists"
    print(f"{mode} ({layers} layers, hidden {hidden}{lists}): {got['kernels']} kernels "
          f"({got['ops']} ops), {got['seconds']} s", flush=True)
    return got


def cases(r):
    """Each mode; then the H200's mode again with the CPU's own autocast lists."""
    yield from ((mode, True) for mode in _modes(r.args))
    if H200_RECORD["mode"] in _modes(r.args):
        yield H200_RECORD["mode"], False


def measure(r, case) -> dict:
    """A mode's count, at each other width (the same ops?) and at the small depth (kernels
    per layer); or its count with the CPU's autocast lists."""
    mode, cuda_lists = case
    a = r.args
    if not cuda_lists:
        cpu = _count(a, mode, a.hidden, a.layers, cuda_autocast=False)
        return {"mode": mode, "cpu_lists": {k: cpu[k] for k in ("kernels", "ops", "by_op")}}
    c = _count(a, mode, a.hidden, a.layers)
    c["width_checks"] = {}
    for w in _widths(a):
        other = _count(a, mode, w, a.layers)
        c["width_checks"][str(w)] = {"kernels": other["kernels"], "ops": other["ops"],
                                     "same_ops": other["by_op"] == c["by_op"]}
    if a.small_layers:
        small = _count(a, mode, a.hidden, a.small_layers)
        per = (c["kernels"] - small["kernels"]) / (a.layers - a.small_layers)
        c["small"] = {"layers": a.small_layers, "kernels": small["kernels"],
                      "ops": small["ops"], "by_category": small["by_category"]}
        c["per_layer"] = round(per, 2)
        c["outside_layers"] = round(c["kernels"] - per * a.layers, 2)
    return {"mode": mode, "count": c}


def summary(r) -> dict:
    """The counts by mode, the H200 comparison, the best mode against the goal."""
    counts = {x["mode"]: x["count"] for x in r.results if "count" in x}
    out = {}
    for x in r.results:
        if "cpu_lists" in x:
            out["cpu_autocast_lists"] = {"mode": x["mode"], **x["cpu_lists"]}
    base = H200_RECORD["mode"]
    if base in counts:
        got = counts[base]["kernels"]
        out["vs_h200"] = {"counted": got, "measured": H200_RECORD["kernels"],
                          "ratio": round(got / H200_RECORD["kernels"], 3)}
    best = min(counts, key=lambda m: counts[m]["kernels"])
    return {**out, "counts": counts,
            "best": {"mode": best, "kernels": counts[best]["kernels"], "goal": GOAL,
                     "met": counts[best]["kernels"] <= GOAL}}


BENCHMARK = Benchmark(
    "kernel_count", __doc__, measure, cases,
    options=(option("--layers", type=int, default=24,
                    help="encoder layers (BERT-large: 24)"),
             option("--hidden", type=int, default=128,
                    help="hidden size counted (heads of 64, FFN and vocabulary 4x)"),
             option("--widths", default="256",
                    help="other hidden sizes each mode is counted at too: the count must not "
                         "change ('' = none)"),
             option("--small-layers", type=int, default=2,
                    help="layers of a second count per mode: kernels per layer from the "
                         "difference (the CPU test's shape; 0 = none)"),
             option("--modes", default=",".join(MODES),
                    help=f"rows of MODES to count (default: all: {', '.join(MODES)})"),
             option("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="more config overrides for every count"),
             option("--out", type=Path, help="write the JSON record here")),
    check=check,
    fields=lambda a: dict(step=list(BASE), modes={m: list(MODES[m]) for m in _modes(a)},
                          extra_overrides=a.set, h200_record=H200_RECORD, goal_kernels=GOAL),
    summary=summary, table=table,
    goals=(Goal("best_mode_under_1000", f"the best mode's step at most {GOAL} kernels",
                lambda rec: rec["best"]["met"]),),
    line=lambda rec: {"benchmark": "kernel_count",
                      "kernels": {m: c["kernels"] for m, c in rec["counts"].items()},
                      "width_checks_same": all(w["same_ops"] for c in rec["counts"].values()
                                               for w in c["width_checks"].values())})


def main(argv=None) -> int:
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
