"""One case of the device-time model counted on a CPU, at BERT-large's real widths: every kernel
of a training step (or of one optimizer step) with its FLOPs and bytes (bench.op_cost), by
phase, category and part of the model. ``python -m bench.device_time`` runs each case in a
child process:

    python -m bench.device_cases SPEC.json OUT.json

A spec (a JSON object) names what to count:
  kind        "step" (Trainer.train_step: forward, backward, the sync, the optimizer) or
              "optimizer" (one step of an optimizer over BERT-large's tensors, fp32: bench.gpu's
              optimizer stage)
  overrides   config overrides on the DGX config (bench.gpu.harness.DGX_CONFIG) after the
              driver's own (BERT-large's widths at ``layers`` layers, sequence 512, a world of
              one on the simulated device)
  layers      encoder layers counted (bench.device_time extrapolates to 24 from two depths)
  graph       "full": the whole-step graph's replay as bench.kernel_count counts it (the
              batch's copy in, the captured body, the values' copy out); "none": an eager step
  data        {"lengths": [...]}: a synthetic set of sequences of these lengths, one batch's
              worth repeated (15 % masked); or {"dir": PATH}: a prepared data set (the real
              sequences the GPU read: the seq-512 set bench.gpu builds)
  skip, count batches skipped after the two warm-up steps (the profiled steps' place in the
              GPU's run), steps counted (each kept apart: bench.device_time prices each and
              averages)
  optimizer   for kind "optimizer": {"name": "lamb"|"adamw", "impl": "presto:fused"|"torch:fused"}

Each op of a counted step is a row [phase, category, op, kernels, tag, [cost, ...]]: ``tag``
"encoder" for an op run inside the encoder's forward or backward (module hooks on the
encoder), "gradbuf" for an op that reads or writes the gradient buffer itself (the bucket adds,
its zeroing, the norm's read), "" otherwise.

Runs in older trees too (bench.device_time copies this file, bench.kernel_counter,
bench.op_cost and bench.cuda_dispatch into a ``git archive`` of the commit a GPU record
measured): it reads the trainer's parts through the names both spell.

Owns: the spec, the synthetic data set, counting a case. Never: prices (bench.device_time,
runtime.calibrate.gpus), needs a GPU, or changes what a step computes.
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

WIDTHS = {"hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 4096,
          "vocab_size": 30522}
"""BERT-large's widths (the counted step's tensors are the GPU's)."""
WARMUP_STEPS = 2
"""Steps before the counted ones: compiles and the buckets' first-step re-cut happen there."""


def _base(layers: int, data_dir: Path, out_dir: Path) -> list[str]:
    return [*(f"model.{k}={v}" for k, v in WIDTHS.items()),
            f"model.num_hidden_layers={layers}", "model.init=scratch", "system.nodes=1",
            "system.ranks_per_node=1", 'system.device="auto"', "data.max_seq_length=512",
            "data.max_predictions_per_seq=76", "train.log_every_steps=100000",
            "train.max_steps=100000", f'data.data_dir="{data_dir}"',
            "data.verify_checksums=false", f'train.output_dir="{out_dir}"']


def _config(overrides: list[str]):
    from bench.gpu.harness import DGX_CONFIG
    from runtime.config import load_config
    try:
        return load_config(DGX_CONFIG, ['model.size=""', *overrides])
    except Exception:  # an older tree without model.size: the widths alone say it
        return load_config(DGX_CONFIG, overrides)


def synthetic_data(root: Path, lengths: list[int], vocab: int, seq: int = 512,
                   max_pred: int = 76) -> Path:
    """A data set of sequences of ``lengths`` (repeated 16 times, two shards), random tokens,
    masked as BERT's data builder masks: round(15 % of the length), at most ``max_pred``."""
    from loaders.dataset import STATS_FILE
    from loaders.shards import EVAL_FILE, TRAIN_DIR, Samples, shard_name, write_shard
    rng = np.random.default_rng(0)

    def samples(ls: list[int]) -> Samples:
        cols: dict[str, list] = {"input_ids": [], "segment_ids": [], "masked_lm_positions": [],
                                 "masked_lm_ids": []}
        for n in ls:
            ids = rng.integers(5, vocab, size=n)
            ids[0], ids[n // 2], ids[-1] = 2, 3, 3  # [CLS] A [SEP] B [SEP]
            segments = (np.arange(n) > n // 2).astype(np.int64)
            k = min(max_pred, max(1, round(0.15 * n)))
            positions = np.sort(rng.choice(np.arange(1, n - 1), k, replace=False))
            for key, col in zip(cols, (ids, segments, positions, ids[positions])):
                cols[key].append(np.asarray(col, dtype=np.int16))
        return Samples(**cols, next_sentence_labels=rng.integers(0, 2, len(ls)).astype(np.int8))

    (root / TRAIN_DIR).mkdir(parents=True)
    (root / EVAL_FILE).parent.mkdir(parents=True)
    shards = []
    for i in range(2):
        rel = f"{TRAIN_DIR}/{shard_name(i, 2)}"
        write_shard(root / rel, samples(list(lengths) * 8))
        shards.append({"file": rel, "samples": 8 * len(lengths)})
    write_shard(root / EVAL_FILE, samples(list(lengths)))
    (root / STATS_FILE).write_text(json.dumps({
        "train_shards": shards, "eval_samples": len(lengths), "vocab": {"size": vocab},
        "parameters": {"seq_len": seq, "max_pred": max_pred, "masked_lm_prob": 0.15}}))
    return root


def _storages(x) -> set:
    from bench.op_cost import _flat
    return {t.untyped_storage().data_ptr() for t in _flat(x) if t.numel()}


class _Tagger:
    """The tag of each counted op (module docstring): the encoder's region from hooks, the
    gradient buffer by its storage."""

    def __init__(self):
        self.region = ""
        self.buffer = None   # the gradient buffer's storage address

    def __call__(self, name: str, args, kwargs, out) -> str:
        if self.buffer is not None and name[:7] not in ("triton_", "cpp_fus"):
            if self.buffer in _storages((args, kwargs, out)):
                return "gradbuf"
        return self.region

    @contextlib.contextmanager
    def hooks(self, model):
        """Forward: inside the encoder between its pre- and post-hook. Backward: from the
        gradient of its output to the gradient of its input (tensor hooks)."""
        encoder = next((m for n, m in model.named_modules() if n.endswith("encoder")), None)
        if encoder is None:
            yield
            return

        def pre(_mod, args):
            self.region = "encoder"
            for a in args:
                if getattr(a, "requires_grad", False):
                    a.register_hook(self._leave)

        def post(_mod, _args, out):
            self.region = ""
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if getattr(t, "requires_grad", False):
                    t.register_hook(self._enter)
        handles = [encoder.register_forward_pre_hook(pre),
                   encoder.register_forward_hook(post)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _enter(self, g):
        self.region = "encoder"

    def _leave(self, g):
        self.region = ""


class _Spans:
    """The trainer's timeline during a counted step: its spans set the counter's phase
    (bench.kernel_counter.Phases); every other call goes to the timeline it stands in for."""

    def __init__(self, counter, inner):
        from bench.kernel_counter import Phases
        self._phases, self._inner = Phases(counter), inner

    def span(self, name: str):
        return self._phases.span(name)

    def __getattr__(self, name: str):
        if self._inner is None:  # no train.timeline: what a step asks of one, answered empty
            return (lambda *a, **k: {}) if name == "summary" else (lambda *a, **k: None)
        return getattr(self._inner, name)

    def __bool__(self) -> bool:
        return True


def _attr(obj, *names):
    for n in names:
        parts, cur = n.split("."), obj
        try:
            for p in parts:
                cur = getattr(cur, p)
            return cur
        except AttributeError:
            continue
    return None


def count_step(spec: dict) -> dict:
    """Count a "step" spec (module docstring)."""
    import torch
    from bench.cuda_dispatch import as_on_cuda, attention_as_on_cuda, sdpa_as_on_cuda
    from bench.gpu.harness import world_of_one
    from bench.kernel_counter import count_inductor_kernels, counting
    from runtime.observe.hostsync import simulated
    from runtime.train.graphs import batch_tensors
    from runtime.train.trainer import Trainer

    t0 = time.perf_counter()
    steps: list[list] = []
    if spec.get("fp8_gemms"):
        _real_fp8_gemms()
    with tempfile.TemporaryDirectory(prefix="device_cases_") as tmp:
        data = spec["data"]
        if "dir" in data:
            data_dir = Path(data["dir"])
        else:
            data_dir = synthetic_data(Path(tmp) / "data", data["lengths"], WIDTHS["vocab_size"])
        cfg = _config([*_base(spec["layers"], data_dir, Path(tmp) / "runs"),
                       *spec["overrides"]])
        graph = spec.get("graph", "full") == "full"
        with as_on_cuda():
            trainer = Trainer(cfg, simulated(world_of_one("cpu")))
            try:
                trainer.setup()
                with attention_as_on_cuda(trainer.model), sdpa_as_on_cuda():
                    tagger = _Tagger()
                    it = iter(trainer.train_loader)
                    if graph:
                        trainer.runner.graph.warmup_steps = 10 ** 9  # no capture: the body
                    for _ in range(WARMUP_STEPS):
                        trainer.train_step(it)
                    trainer.step_log.flush()
                    for _ in range(spec.get("skip", 0)):
                        next(it)
                    count_inductor_kernels()
                    sync = _attr(trainer, "body.grad_sync", "grad_sync")
                    flat = getattr(sync, "flat", None)
                    tagger.buffer = flat.untyped_storage().data_ptr() if flat is not None \
                        else None
                    for _ in range(spec.get("count", 1)):
                        steps.append(_count_one(trainer, it, graph, tagger, counting,
                                                batch_tensors))
                    if count_inductor_kernels():
                        raise RuntimeError("the counted step compiled code: raise "
                                           "bench.device_cases.WARMUP_STEPS")
            finally:
                trainer.close()
    m = cfg.model
    return {"meta": {"layers": m.num_hidden_layers, "hidden_size": m.hidden_size,
                     "precision": cfg.train.precision, "fusions": list(m.fusions),
                     "graph": spec.get("graph", "full"), "torch": torch.__version__,
                     "optimizer_compiled": trainer.state.derived.get("optimizer_compiled"),
                     "seconds": round(time.perf_counter() - t0, 1)},
            "steps": steps}


_FP8_LIB = []


def _real_fp8_gemms() -> None:
    """model.fp8's GEMMs as a GPU of compute capability 8.9+ runs them - ``torch._scaled_mm``
    on e4m3/e5m2 tensors - not torchao's emulation (GEMMs of the dequantised values in fp32),
    which runtime.model.fp8 picks on a CPU. The CPU's own ``_scaled_mm`` takes ~0.4 s for a
    256³ product (no fast kernel), so a CPU kernel stands in for it while this process counts:
    the scaled product in fp32, the output in ``out_dtype`` - the op, shapes and dtypes the
    counter sees are the GPU's; the values are not needed. This process only."""
    import torch
    import runtime.model.fp8 as fp8
    fp8.emulation = lambda emulate, device: fp8.Emulation(
        False, "bench.device_cases: torch._scaled_mm as on a GPU of capability 8.9+")

    def scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                  use_fast_accum=False):
        out = (a.float() * scale_a.float()) @ (b.float() * scale_b.float())
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype or a.dtype)
    def scaled_mm_out(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                      use_fast_accum=False, *, out):
        return out.copy_(scaled_mm(a, b, scale_a, scale_b, bias, scale_result, out_dtype))
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_mm", scaled_mm, "CPU", allow_override=True)
    # bench.cuda_dispatch's check (CUDA's shape rules, then the CPU kernel) calls the out form
    lib.impl("_scaled_mm.out", scaled_mm_out, "CPU", allow_override=True)
    _FP8_LIB.append(lib)


def _count_one(trainer, it, graph: bool, tagger, counting, batch_tensors) -> list:
    body = _attr(trainer, "body") or trainer
    accum = getattr(body, "accum", None) or getattr(trainer, "accum", 1)
    batches = [next(it) for _ in range(accum)]
    inputs = [t for b in batches for t in batch_tensors(b)]
    # the whole-step graph copies the host batch into its static slots (counted as it runs);
    # an eager step moves the batch to the device first - a no-op on the simulated device,
    # so each tensor's copy is added here and everything after it is device work
    with counting(host=inputs if graph else (), costs=True) as counter:
        counter.tagger = tagger
        if not graph:
            from bench.op_cost import Cost, nbytes
            counter.phase = "input"
            for t in inputs:
                counter.add("copy_", "copy/fill", 1, [Cost("memory", 2 * nbytes(t))], "")
        timeline_owner = body if hasattr(body, "timeline") else trainer
        saved_timeline = timeline_owner.timeline
        timeline_owner.timeline = _Spans(counter, saved_timeline)
        try:
            with tagger.hooks(trainer.model):
                if graph:
                    g = trainer.runner.graph
                    # the step the graph captures: ``captured_step`` (``body`` in older trees)
                    name = "captured_step" if hasattr(g, "captured_step") else "body"
                    inner = getattr(g, name)

                    def counted_body(slots):
                        counter.phase = "step"
                        values = inner(slots)
                        counter.phase = "output"
                        return values
                    setattr(g, name, counted_body)
                    try:
                        counter.phase = "input"
                        g.step(batches)
                    finally:
                        setattr(g, name, inner)
                    counter.add("clone", "copy/fill")  # the replay's copy-out of the values
                else:
                    counter.phase = "step"
                    trainer.train_step(iter(batches))
        finally:
            timeline_owner.timeline = saved_timeline
    tags = counter.tags + [""] * (len(counter.records) - len(counter.tags))
    return [[*r, tag, [c.to_list() for c in cs]]
            for r, tag, cs in zip(counter.records, tags, counter.costs)]


def _named_shapes(layers: int) -> list:
    """bench.optim's BERT-large tensors (bench.gpu's optimizer stage) at ``layers`` layers."""
    import re
    from bench.optim import bert_named_shapes
    layer = re.compile(r"\.layer\.(\d+)\.")
    return [(n, s) for n, s in bert_named_shapes("large")
            if not (m := layer.search(n)) or int(m.group(1)) < layers]


def count_optimizer(spec: dict) -> dict:
    """Count an "optimizer" spec: one step of bench.gpu's optimizer stage, its setup as there
    (fp32 tensors, grad_scale 0.5 for Presto's; the step after a first one)."""
    import torch
    from bench.kernel_counter import count_inductor_kernels, counting
    from runtime.optim.optimizers import build_optimizer
    from bench.optim import ADAMW_HP, LAMB_HP
    t0 = time.perf_counter()
    o = spec["optimizer"]
    torch.manual_seed(0)
    named = [(n, (torch.randn(s) * 0.02).requires_grad_()) for n, s in
             _named_shapes(spec["layers"])]
    if o["impl"].startswith("presto:"):
        hp = LAMB_HP if o["name"] == "lamb" else ADAMW_HP
        opt = build_optimizer(o["name"], named, backend=o["impl"].split(":")[1], **hp)
        kwargs = {"grad_scale": 0.5}
    else:
        opt = torch.optim.AdamW([p for _, p in named], lr=1e-3, weight_decay=0.01, fused=True)
        kwargs = {}
    for _, p in named:
        p.grad = torch.randn_like(p)
    opt.step(**kwargs)
    count_inductor_kernels()
    with counting(costs=True) as counter:
        counter.phase = "optimizer"
        opt.step(**kwargs)
    rows = [[*r, "", [c.to_list() for c in cs]] for r, cs in zip(counter.records,
                                                                   counter.costs)]
    return {"meta": {"layers": spec["layers"], "elements": sum(p.numel() for _, p in named),
                     "torch": torch.__version__,
                     "seconds": round(time.perf_counter() - t0, 1)}, "steps": [rows]}


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="python -m bench.device_cases",
                                 description="Count one case of the device-time model (a "
                                             "step's kernels with their FLOPs and bytes): "
                                             "bench.device_time's child process.")
    ap.add_argument("spec", type=Path, help="the case, a JSON object (module docstring)")
    ap.add_argument("out", type=Path, help="where the count is written (JSON)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        spec = json.loads(args.spec.read_text())
    except (OSError, ValueError) as e:
        print(f"python -m bench.device_cases: {args.spec}: not a readable JSON spec ({e})",
              file=sys.stderr)
        return 2
    out = count_optimizer(spec) if spec["kind"] == "optimizer" else count_step(spec)
    out["spec"] = spec
    args.out.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
