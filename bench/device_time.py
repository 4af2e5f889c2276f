"""The step's device time on a named GPU - each kernel priced from its FLOPs and bytes -
predicted on a CPU, checked against the GPU records' busy times.

    python -m bench.device_time [--no-validate] [--no-predict] [--gpus h100,h200,a100]
        [--modes NAME,...] [--depths 2,4] [--out bench/results/device_time.json]
        [--profiles runtime/calibrate/tune/systems/model_profiles.json]

Every kernel of a counted step (bench.device_cases: the step at BERT-large's widths under
CUDA's dispatch choices, bench.kernel_counter's rules) gets its FLOPs and bytes
(bench.op_cost) and a time on a GPU row (runtime.calibrate.gpus: floor + max(FLOPs/rate,
bytes/bandwidth), every number sourced); the sums by part and op, extrapolated to 24 layers
and to large batches (bench.device_model), are the step's busy time - the sum of its kernel
durations, what torch.profiler reports and the GPU records keep.

``--validate`` (default on): every case of the GPU records with a measured busy time
(``VALIDATION``), counted on the code the record measured - a ``git archive`` of its tree, with
this tool's counting files copied in (``COPIED``) - and its error; the goal is within 15 %.
``--predict`` (default on): each mode (``MODES``: bf16 autocast, bf16_master, + qkv, + compiled
layers, fp16, FP8) on each GPU at 2 full rows of 512 and at the largest-batch throughput
configuration, split by part with the kernels that cost most, and 8 GPUs of a node with the
sharded LAMB (``optim.shard = "node"``) and the gradient all-reduce priced by the tuner's
fabric model (bench.device_node); the predicted profiles go to ``--profiles``, which the tuner
reads (``python -m runtime.calibrate.tune --simulate F --profile model:h100``).

Counts are cached in results/device_time/ by spec, tree and the counting files' content (a
count takes 30-90 s on the 2-core dev machine; the whole record about an hour the first time).

A bench.harness row (``BENCHMARK``): the cases are the validation cases, then the modes; the
goal is every validation case within 15 % (a finding, not a gate: exit 0 either way).

Owns: the validation cases and their measured figures' places in the records, the prediction
modes and configurations, counting them (child processes, old trees), the record. Never: holds a GPU number (runtime.calibrate.gpus), counts in this process (the CUDA
stand-ins leave state behind), or times anything (a count is deterministic).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import REPO
from bench.harness import Benchmark, Goal, listed, option, out, run
from bench.device_model import PARTS, batch, depth, mean, price, retarget_attention, summary, top
from runtime.calibrate.gpus import GPUS, GpuRow

CACHE = REPO / "results" / "device_time"
TREES = Path(tempfile.gettempdir()) / "presto_device_time_trees"
"""Old trees (``git archive`` of a record's commit): outside the repository, whose checks walk
every Python file under it (tests/unit/test_layering.py)."""
COPIED = ("bench/device_cases.py", "bench/kernel_counter.py", "bench/op_cost.py",
          "bench/cuda_dispatch.py")
"""What a count in an older tree runs of this tree (the rest is the old code)."""
LAYERS = 24
GOAL = 0.15
"""|predicted / measured - 1| at most, every case (issue 64)."""

H200_RECORD = "bench/results/gpu_nvidia-h200_2026-11-28.json"
H200_CALL1 = "bench/results/gpu_nvidia-h200_2026-11-27.json"
H100_RUN4 = "bench/results/gpu_nvidia-h100-80gb-hbm3_2026-11-24_run4_optimizer_host.json"
H200_TREE, H100_TREE = "9ea6d5e", "999f701"
"""The trees the records measured (each record's ``tree_commit``)."""

STATIC2 = ["data.shapes=static", "data.balance=offline_pack", "model.attention=unpadded",
           "data.bin_edges=[]", "data.static_rows=2", "train.cuda_graphs=full",
           "train.global_batch_size=4"]
"""bench.gpu's graphs case rows2 (2 static packed rows a rank; local batch 4 there)."""
EAGER = ["data.balance=random", "train.cuda_graphs=none"]
THROUGHPUT = [*EAGER, "model.attention=unpadded"]
FUSED_THEN = 'model.fusions=["bias_gelu","dropout_add_norm","pad_vocab"]'
SYNTH_LEN = 128
"""Sequence length of the synthetic batches a large batch is extrapolated from (the seq-512
set's mean is 127.9)."""
SMALL_BATCHES = (8, 16)


@dataclass
class Case:
    """A step (or optimizer step) to predict: ``spec`` (bench.device_cases; ``layers`` filled
    per depth) counted in ``tree`` (None: this one); ``target``: a large batch
    {"batch", "tokens", "seq_sq", "longest"} extrapolated from SMALL_BATCHES of SYNTH_LEN."""

    name: str
    spec: dict
    tree: str | None = None
    target: dict | None = None
    real_data: bool = False


@dataclass
class Validation:
    """A measured busy time: the record, where in it, which GPU row prices it."""

    case: Case
    gpu: str
    record: str
    key: str
    kernels_key: str | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)


def _step(overrides: list[str], *, graph: str = "none", lengths=None, real=False,
          count: int = 1, skip: int = 0) -> dict:
    data = {"dir": "@seq512"} if real else {"lengths": lengths}
    return {"kind": "step", "graph": graph, "overrides": overrides, "data": data,
            "count": count, "skip": skip}


def _optimizer(name: str, impl: str) -> dict:
    return {"kind": "optimizer", "optimizer": {"name": name, "impl": impl}}


AUTOCAST_THEN = ["train.precision=bf16", "model.fusions=[]"]


def validation_cases() -> list[Validation]:
    """Every case of bench/results/gpu_* with a measured busy time (bench.gpu's stages then)."""
    rows2 = Case("rows2", _step([*STATIC2, *AUTOCAST_THEN], graph="full", real=True, count=3,
                                skip=11), H200_TREE, real_data=True)
    b4 = {p: Case(f"eager_b4 {p}", _step([*EAGER, f"model.attention={p}",
                                          "train.global_batch_size=4", *AUTOCAST_THEN],
                                         real=True, count=3, skip=11), H200_TREE, real_data=True)
          for p in ("unpadded", "padded")}
    thr = {k: Case(f"throughput {k}", _step([*THROUGHPUT, "train.precision=bf16", fus]),
                   H200_TREE, target={"record": H200_RECORD, "key": "stages.throughput.result."
                                      f"unpadded_{k}.local_batch"})
           for k, fus in (("bf16", "model.fusions=[]"), ("bf16_fused", FUSED_THEN))}
    g, o = "stages.graphs.result.", "stages.optimizer.result."
    out = [Validation(rows2, "h200", H200_RECORD, g + "rows2.full.busy_s", g + "rows2.full.kernels",
                      "the whole-step graph"),
           Validation(rows2, "h200", H200_RECORD, g + "rows2.eager.busy_s",
                      g + "rows2.eager.kernels", "eager: the graph's count (one kernel less)"),
           Validation(rows2, "h200", H200_RECORD, g + "rows2.encoder.busy_s",
                      g + "rows2.encoder.kernels", "encoder graphs: the full graph's count; "
                      "the graphed callables' 148 input/output copies not counted"),
           Validation(b4["unpadded"], "h200", H200_RECORD,
                      g + "eager_b4.unpadded_dynamic.busy_s", g + "eager_b4.unpadded_dynamic."
                      "kernels"),
           Validation(b4["padded"], "h200", H200_RECORD, g + "eager_b4.padded_dynamic.busy_s",
                      g + "eager_b4.padded_dynamic.kernels"),
           Validation(thr["bf16"], "h200", H200_RECORD,
                      "stages.throughput.result.unpadded_bf16.busy_s",
                      "stages.throughput.result.unpadded_bf16.kernels"),
           Validation(thr["bf16"], "h200", H200_CALL1,
                      "stages.throughput.result.unpadded_bf16.busy_s",
                      "stages.throughput.result.unpadded_bf16.kernels", "call 1"),
           Validation(thr["bf16_fused"], "h200", H200_RECORD,
                      "stages.throughput.result.unpadded_bf16_fused.busy_s",
                      "stages.throughput.result.unpadded_bf16_fused.kernels")]
    everything = (("lamb", "presto:fused"), ("adamw", "presto:fused"), ("adamw", "torch:fused"))
    for gpu, rec, tree, which, note in (("h200", H200_RECORD, H200_TREE, everything, ""),
                                        ("h200", H200_CALL1, H200_TREE, everything[:1], "call 1"),
                                        ("h100", H100_RUN4, H100_TREE, everything, "")):
        for name, impl in which:
            case = Case(f"optimizer {name} {impl}", _optimizer(name, impl), tree)
            out.append(Validation(case, gpu, rec, f"{o}{name}_{impl}.device_s", note=note))
    return out


# ------------------------------------------------------------------------------ prediction modes

def modes_names() -> tuple[str, ...]:
    """The prediction modes' names (``--help`` imports nothing heavy)."""
    return ("bf16_autocast", "bf16_master", "bf16_master_qkv", "bf16_master_layers",
            "fp16_autocast", "fp8")


def modes() -> dict[str, list[str]]:
    """bench.kernel_count's rows (a precision and compile mode each) and FP8 (model.fp8
    tensorwise) on the best of them - bf16_master, qkv, pad_vocab and compiled layers, which
    fuse torchao's amax and casts as torchao intends; its GEMMs are ``torch._scaled_mm`` as on
    an H100/H200 (bench.device_cases ``fp8_gemms``)."""
    from bench.kernel_count import MODES
    keep = ("bf16_autocast", "bf16_master", "bf16_master_qkv", "bf16_master_layers",
            "fp16_autocast")
    out = {m: list(MODES[m]) for m in keep}
    out["fp8"] = [*MODES["bf16_master_layers"], "model.fp8=tensorwise"]
    return out


THROUGHPUT_BATCH = {"h200": 904, "h100": 488, "a100": 488}
"""The largest local batch the GPU records measured for unpadded bf16 at sequence 512 (H200
2026-11-28: 904, 129.7 GiB; H100 2026-11-24: 488, 74.0 GiB); the A100 80GB has the H100's
memory. Every mode is predicted at this batch (bf16_master needs less memory: its own largest
batch is larger, not modelled)."""


def mode_cases(mode: str, overrides: list[str], gpu: str) -> dict[str, Case]:
    fp8 = any(o.startswith("model.fp8=") for o in overrides)
    rows2 = Case(f"{mode} rows2", _step([*STATIC2, *overrides], graph="full",
                                         lengths=[256] * 4))
    thr = Case(f"{mode} throughput", _step([*THROUGHPUT, *overrides]),
               target={"batch": THROUGHPUT_BATCH[gpu]})
    for c in (rows2, thr):
        c.spec["fp8_gemms"] = fp8
    return {"rows2": rows2, "throughput": thr}


# ----------------------------------------------------------------------------------- counting

STEP_CODE = ("runtime", ":!runtime/calibrate", "kernels", "loaders", "submission/configs",
             "bench/gpu/harness.py", "bench/kernel_count.py", "bench/optim.py")
"""What a count of this tree depends on besides ``COPIED``: a change elsewhere keeps the cache."""


def _head_state() -> str:
    """This tree's step code by content: the index's blobs and the working tree's changes."""
    def git(*a):
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True,
                              text=True).stdout
    return hashlib.sha1((git("ls-files", "-s", *STEP_CODE)
                         + git("diff", "--", *STEP_CODE)).encode()).hexdigest()


def tree_dir(commit: str | None) -> Path:
    """The tree a case is counted in: this one, or ``commit``'s files (``git archive``, once)
    with ``COPIED`` from this tree."""
    if commit is None:
        return REPO
    root = TREES / commit
    if not (root / "runtime").is_dir():
        root.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", commit],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    for f in COPIED:
        shutil.copyfile(REPO / f, root / f)
    return root


def seq512() -> Path:
    """bench.gpu's seq-512 set, built by this tree's data builder from .cache/sources: the same
    80,818 sequences (mean length 127.933) the GPUs' data stages built and read (the shard
    format is the same in the records' trees, which read it too)."""
    out = CACHE / "seq512"
    if not (out / "stats.json").is_file():
        from loaders.prepare import PrepareConfig, build
        from basis.presets import SOURCES
        if not SOURCES.is_dir():
            raise RuntimeError(f"{SOURCES} is missing: `make sources` fetches the text the "
                               f"GPU records' data was built from")
        build(PrepareConfig(out=out, sources=SOURCES, workers=2, seq_len=512, max_pred=76,
                            shards=8, eval_samples=512), log=lambda m: None)
    return out


def count(spec: dict, tree: str | None) -> dict:
    """bench.device_cases' count of ``spec`` in ``tree`` (cached, module docstring)."""
    spec = json.loads(json.dumps(spec))
    if spec.get("data", {}).get("dir") == "@seq512":
        spec["data"]["dir"] = str(seq512())
    files = "".join(hashlib.sha1((REPO / f).read_bytes()).hexdigest() for f in COPIED)
    key = hashlib.sha1((json.dumps(spec, sort_keys=True) + (tree or _head_state())
                        + files).encode()).hexdigest()[:20]
    path = CACHE / "counts" / f"{key}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            sp, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
            sp.write_text(json.dumps(spec))
            proc = subprocess.run([sys.executable, "-m", "bench.device_cases", str(sp),
                                   str(out)], cwd=tree_dir(tree), capture_output=True,
                                  text=True, timeout=3600)
            if proc.returncode != 0:
                raise RuntimeError(f"count of {spec} in {tree or 'this tree'} failed:\n"
                                   f"{proc.stderr[-3000:]}")
            shutil.copyfile(out, path)
        print(f"  counted {spec.get('kind')} at {spec.get('layers')} layers in "
              f"{tree or 'this tree'}: {json.loads(path.read_text())['meta'].get('seconds')} s",
              flush=True)
    return json.loads(path.read_text())


# --------------------------------------------------------------------------------- predicting

def data_stats(data_dir: Path) -> dict:
    """The set's mean real tokens and mean squared length a sequence (attention's Σ L²)."""
    from loaders.shards import read_shard
    lengths = []
    for f in sorted((data_dir / "train").glob("*")):
        s = read_shard(f)
        lengths += [len(x) for x in s.input_ids]
    n = len(lengths)
    return {"mean": sum(lengths) / n, "mean_sq": sum(x * x for x in lengths) / n,
            "longest": max(lengths), "sequences": n}


def real_batch(data_dir: Path, batch_size: int, seed: int = 7, index: int = 1) -> dict:
    """Tokens, Σ L² and the longest sequence of batch ``index`` of bench.gpu's throughput
    loader (TrainLoader(data, 0, 1, batch, 7), random balance: the step it profiled)."""
    from loaders.dataset import TrainLoader
    from runtime.config import load_config
    from bench.gpu.harness import DGX_CONFIG
    cfg = load_config(DGX_CONFIG, [f'data.data_dir="{data_dir}"', "data.balance=random",
                                   "data.verify_checksums=false"])
    loader = TrainLoader(data_dir, 0, 1, batch_size, seed, verify=False,
                         balance=cfg.data.balance_spec(1))
    try:
        it = iter(loader)
        for _ in range(index + 1):
            b = next(it)
    finally:
        loader.close()
    lengths = [x for row in b.sequence_lengths for x in row] if b.sequence_lengths else \
        b.attention_mask.sum(1).tolist()
    return {"batch": batch_size, "tokens": sum(lengths), "seq_sq": sum(x * x for x in lengths),
            "longest": max(lengths)}


def predict(case: Case, gpu: GpuRow, depths=(2, 4), additive: bool = True,
            target: dict | None = None) -> dict:
    """The case priced on ``gpu`` at 24 layers: each depth counted (at two small batches and
    read at the target's, for a large batch) and priced, then extrapolated in depth."""
    priced = []
    target = target or case.target
    for layers in depths:
        if target is None:
            got = count({**case.spec, "layers": layers}, case.tree)
            priced.append(mean([price(s, gpu, additive) for s in got["steps"]]))
            continue
        counts = [count({**case.spec, "layers": layers, "data": {"lengths": [SYNTH_LEN] * b},
                         "overrides": [*case.spec["overrides"],
                                       f"train.global_batch_size={b}"]}, case.tree)
                  for b in SMALL_BATCHES]
        x = target["tokens"] / SYNTH_LEN  # the batch of SYNTH_LEN sequences as many tokens
        rows = batch(counts[0]["steps"][0], counts[1]["steps"][0], *SMALL_BATCHES, x)
        rows = retarget_attention(rows, x * SYNTH_LEN ** 2, target["seq_sq"], target["longest"])
        priced.append(price(rows, gpu, additive))
    if len(depths) == 1:
        return combine_scale(priced[0], LAYERS / depths[0]) if depths[0] != LAYERS else \
            priced[0]
    return depth(priced[0], priced[1], depths[0], depths[1], LAYERS)


def combine_scale(p: dict, f: float) -> dict:
    from bench.device_model import combine
    return combine(p, {}, f, 0.0)


def _dig(path: str, key: str):
    """The value at a dotted ``key`` of a record (keys may hold dots after the stage: the
    optimizer's ``lamb_presto:fused``)."""
    d = json.loads((REPO / path).read_text())
    parts = key.split(".")
    i = 0
    while i < len(parts):
        for j in range(len(parts), i, -1):
            k = ".".join(parts[i:j])
            if isinstance(d, dict) and k in d:
                d, i = d[k], j
                break
        else:
            raise KeyError(f"{path}: no {key}")
    return d


def validate_one(v: Validation, depths=(2, 4), batches: dict | None = None) -> dict:
    """One validation case: predicted against measured, both forms of the price, the kernels
    that cost most (``batches``: the real throughput batches already read, by size)."""
    gpu = GPUS[v.gpu]
    target = None
    if v.case.target is not None:
        b = _dig(v.case.target["record"], v.case.target["key"])
        batches = {} if batches is None else batches
        if b not in batches:
            batches[b] = real_batch(seq512(), b)
        target = batches[b]
    got = predict(v.case, gpu, depths, target=target)
    alt = predict(v.case, gpu, depths, additive=False, target=target)
    measured = _dig(v.record, v.key)
    if v.kernels_key:
        kernels = _dig(v.record, v.kernels_key)
    else:  # the optimizer stage keeps its kernel table: calls a step
        table = _dig(v.record, v.key.rsplit(".", 1)[0] + ".kernels")
        kernels = sum(k["calls"] for k in table)
    err = got["s"] / measured - 1
    return {"case": v.case.name, "gpu": v.gpu, "record": v.record, "key": v.key,
            "tree": v.case.tree, "note": v.note, "measured_ms": measured * 1e3,
            "predicted_ms": got["s"] * 1e3, "error": err, "met": abs(err) <= GOAL,
            "predicted_max_form_ms": alt["s"] * 1e3,
            "error_max_form": alt["s"] / measured - 1,
            "measured_kernels": kernels, "predicted_kernels": got["kernels"],
            "batch": target, "summary": summary(got), "top": top(got, 12)}


def predict_mode(mode: str, gpus: list[str], depths=(2, 4)) -> dict:
    """``mode`` on each GPU at 2 full rows and at the throughput batch (module docstring)."""
    stats = data_stats(seq512())
    out: dict = {}
    overrides = modes()[mode]
    for g in gpus:
        gpu = GPUS[g]
        if mode == "fp8" and "fp8" not in gpu.gemm_tflops:
            out[g] = {"error": f"{gpu.name} has no FP8 GEMMs"}
            continue
        cases = mode_cases(mode, overrides, g)
        rows2 = predict(cases["rows2"], gpu, depths)
        b = THROUGHPUT_BATCH[g]
        target = {"batch": b, "tokens": b * stats["mean"], "seq_sq": b * stats["mean_sq"],
                  "longest": stats["longest"]}
        thr = predict(cases["throughput"], gpu, depths, target=target)
        out[g] = {"rows2": {**summary(rows2), "top": top(rows2, 10), "tokens": 1024,
                            "local_batch": 4},
                  "throughput": {**summary(thr), "top": top(thr, 10), "local_batch": b,
                                 "tokens": target["tokens"],
                                 "tokens_per_s": target["tokens"] / thr["s"]}}
    return out


# ------------------------------------------------------------------------------------ the bench

def _depths(a) -> tuple[int, ...]:
    return tuple(a.depths)


def check(a) -> str | None:
    if not 1 <= len(a.depths) <= 2 or min(a.depths) < 1:
        return "--depths: one or two layer counts of at least 1, e.g. 2,4 (or 24)"
    if not (a.validate or a.predict):
        return "--no-validate and --no-predict leave nothing to do"
    return None


def cases(r):
    """Every validation case, then every prediction mode."""
    if r.args.validate:
        yield from (("validate", v) for v in validation_cases())
    if r.args.predict:
        yield from (("predict", m) for m in r.args.modes)


def measure(r, case) -> dict:
    kind, x = case
    if kind == "validate":
        return {"kind": "validation", **validate_one(x, _depths(r.args),
                                                     r.state.setdefault("batches", {}))}
    return {"kind": "prediction", "mode": x, "gpus": predict_mode(x, r.args.gpus,
                                                                  _depths(r.args))}


def progress(r, case, res) -> str:
    if res["kind"] == "validation":
        return (f"{res['case']:32} {res['gpu']}  measured {res['measured_ms']:8.2f} ms  "
                f"predicted {res['predicted_ms']:8.2f} ms  {res['error']:+6.1%}  "
                f"(max form {res['predicted_max_form_ms']:8.2f})")
    return "\n".join(f"{res['mode']:20} {g}: " + (
        p["error"] if "error" in p else
        f"2 rows {p['rows2']['ms']:7.2f} ms, batch {p['throughput']['local_batch']} "
        f"{p['throughput']['ms']:8.1f} ms ({p['throughput']['tokens_per_s']:,.0f} tokens/s)")
        for g, p in res["gpus"].items())


@contextlib.contextmanager
def _shared(r):
    yield {}


def finish_summary(r) -> dict:
    """The validation's rows and count met; the predictions by mode, 8 GPUs of a node, the
    profiles file for the tuner."""
    out: dict = {}
    rows = [x for x in r.results if x["kind"] == "validation"]
    if rows:
        out.update(validation=rows, validation_met=sum(x["met"] for x in rows),
                   validation_cases=len(rows))
    pred = {x["mode"]: x["gpus"] for x in r.results if x["kind"] == "prediction"}
    if pred:
        from bench.device_node import node_predictions, write_profiles
        out["predictions"] = pred
        out["node8"] = node_predictions(pred, modes())
        if "bf16_master_layers" in pred:
            from bench.device_cuts import BEST, cuts
            out["cuts"] = cuts(r.args.gpus, _depths(r.args),
                               lambda g: mode_cases(BEST, modes()[BEST], g)["rows2"], predict)
        if r.args.profiles:
            write_profiles(pred, r.args.profiles, r.record["commit"], modes())
    return out


def _table(rec: dict) -> str:
    from bench.device_tables import tables
    return "\n" + tables(rec)


def _within(rec: dict):
    rows = rec.get("validation")
    return None if not rows else all(x["met"] for x in rows)


BENCHMARK = Benchmark(
    "device_time", __doc__, measure, cases,
    options=(option("--validate", action=argparse.BooleanOptionalAction, default=True,
                    help="predict every GPU record's measured busy time (default on)"),
             option("--predict", action=argparse.BooleanOptionalAction, default=True,
                    help="predict every mode on every GPU, 8 GPUs of a node (default on)"),
             option("--gpus", type=listed(GPUS, what="GPU"), default=",".join(GPUS),
                    help=f"GPU rows to predict on (default all: {', '.join(GPUS)})"),
             option("--modes", type=listed(list(modes_names()), what="mode"),
                    default=",".join(modes_names()),
                    help=f"prediction modes (default all: {', '.join(modes_names())})"),
             option("--depths", type=listed(kind=int, what="layer count"), default="2,4",
                    help="encoder layers counted, extrapolated to 24 ('24': count it whole)"),
             out(None),
             option("--profiles", type=Path, default=None,
                    help="write the predicted profiles the tuner reads here "
                         "(runtime/calibrate/tune/systems/model_profiles.json)")),
    fields=lambda a: {"depths": list(a.depths),
                      "gpus": {g: dict(GPUS[g].__dict__) for g in a.gpus},
                      "parts": list(PARTS), "method": "docs/benchmarks/device_time.md"},
    setup=_shared, progress=progress, summary=finish_summary, table=_table, check=check,
    goals=(Goal("every_case_within_15pct", "every validation case's predicted busy time "
                "within 15 % of the GPU record's", _within),),
    line=("validation_met", "validation_cases"))


def main(argv=None) -> int:
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
