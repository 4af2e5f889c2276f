"""``python -m bench.optim``: optimizer step time against the memory-bandwidth limit.

For the real parameter shapes of BERT-base (110M) and BERT-large (336M) — every tensor of
``runtime.model.BertForPreTraining`` built on the meta device, the tied decoder counted once,
the MLPerf decay/no-decay grouping — it times one fp32 optimizer step of:

  * this runtime: LAMB, AdamW and LARS with each backend (reference, foreach, fused; apex
    when it imports and the device is CUDA), ``grad_scale`` folded in;
  * peers, default settings but clipping off: torch-optimizer ``Lamb``, timm ``Lamb``
    (``max_grad_norm=None``), pytorch-lamb ``Lamb``, ``torch.optim.AdamW`` with
    ``foreach=True`` and with ``fused=True``. A peer that does not import says why in the
    table (``make bench-deps`` installs them without touching torch).

Each (model, implementation) runs in its own subprocess: build, one untimed step (state
allocated; the fused backend compiled at build, its compile time reported apart), then
``--reps`` timed steps; min and median are reported.

The physical limit. In the same run the parent measures memory bandwidth as a large copy
(``dst.copy_(src)``, 2^27 fp32 elements, bytes read + written / time, best of 5), and, for
context, an in-place scale (read + write of the same buffer) and a sum (read only). A step's
limit is the bytes it must move / copy bandwidth (``ratio``; ``ratio ip`` divides by the
in-place bandwidth instead, the stricter reference: on this kind of machine an in-place
read-modify-write streams faster than a copy, whose destination costs a write-allocate read),
per parameter element in fp32:

  LAMB  (two passes) 40 B: pass 1 reads p, g, m, v (16) and writes m, v (8); the trust ratio
        needs ‖x‖ and ‖u‖ of every tensor before any parameter moves, so pass 2 reads p and
        u's inputs m, v (12) and writes p (4) — storing u in pass 1 instead costs the same
        (write 4, read 4 instead of 8).
  AdamW (one pass)  28 B: read p, g, m, v (16), write p, m, v (12).
  LARS  (two passes) 28 B: pass 1 reads p, g (8) for ‖w‖, ‖g‖; pass 2 reads p, g, buf (12)
        and writes buf, p (8).

The global-norm pass for clipping (read g, 4 B) is not counted: it is the trainer's, done
once per step for every implementation (the fused backend's ``grad_norm`` does it as one
pass over the flat gradient buffer). ratio = step time / limit; 1.0 is the bandwidth bound.

Peak memory of the step: Linux's VmHWM (peak resident set) is reset just before the timed
steps (``/proc/self/clear_refs`` ← 5) and read after them; the growth above the resident set
before them is what the steps allocated and touched (temporaries), reported in MiB. torch's
CPU allocator keeps no statistics and tracemalloc does not see it; a subprocess per
implementation keeps one's heap from hiding another's.

    python -m bench.optim [--models base,large] [--reps 3] [--only lamb,adamw,lars]
                          [--out bench/results/optim.json]

Prints a table and a final JSON line; writes the same record to ``--out``. A benchmark, not a
test: keep the machine otherwise idle (on the shared dev machine: under
``flock /tmp/presto_cpu.lock``).
"""
from __future__ import annotations

import contextlib
import importlib
import json
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

from bench.harness import Benchmark, Goal, hidden, listed, option, out, run
from kernels.optim_flat import BYTES_PER_ELEMENT  # the byte counts above, one place
from basis.model_shape import size

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "optim.json"

MODELS = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,  # CPU benchmark
                 intermediate_size=512),
    "base": size("base"), "large": size("large"),  # runtime.model.arithmetic's named sizes
}
LAMB_HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01)
ADAMW_HP = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
LARS_HP = dict(lr=1e-3, momentum=0.9, trust_coefficient=0.001, weight_decay=0.01)

# (optimizer, implementation): what runs in a worker.
CASES = [
    ("lamb", "presto:reference"), ("lamb", "presto:foreach"), ("lamb", "presto:fused"),
    ("lamb", "presto:apex"), ("lamb", "torch-optimizer"), ("lamb", "timm"),
    ("lamb", "pytorch-lamb"),
    ("adamw", "presto:reference"), ("adamw", "presto:foreach"), ("adamw", "presto:fused"),
    ("adamw", "presto:apex"), ("adamw", "torch:foreach"), ("adamw", "torch:fused"),
    ("lars", "presto:reference"), ("lars", "presto:foreach"), ("lars", "presto:fused"),
]


# --------------------------------------------------------------------------- shapes

def bert_named_shapes(model: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every trainable tensor of BERT ``model``, tied decoder once."""
    import torch
    from runtime.model.bert import BertConfig, BertForPreTraining
    with torch.device("meta"):
        net = BertForPreTraining(BertConfig(**MODELS[model]))
    return [(n, tuple(p.shape)) for n, p in net.named_parameters() if p.requires_grad]


# --------------------------------------------------------------------------- bandwidth

def measure_bandwidth(elements: int = 1 << 27, reps: int = 5) -> dict:
    """GB/s (1e9 bytes) of a copy (read + write), an in-place scale and a sum, best of reps."""
    import torch
    src = torch.randn(elements)
    dst = torch.zeros(elements)
    nbytes = 4 * elements

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    return {"copy_GBps": 2 * nbytes / best(lambda: dst.copy_(src)) / 1e9,
            "inplace_scale_GBps": 2 * nbytes / best(lambda: dst.mul_(1.0000001)) / 1e9,
            "read_sum_GBps": nbytes / best(lambda: src.sum()) / 1e9,
            "elements": elements, "threads": torch.get_num_threads()}


# --------------------------------------------------------------------------- peers

def _load_timm_lamb():
    """timm's Lamb without ``import timm`` (whose __init__ imports torchvision, which pip
    would install only with another torch): load timm/optim/lamb.py under stub packages."""
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("timm is not installed (make bench-deps)")
    note = ""
    try:
        importlib.import_module("timm")
    except Exception as e:  # expected beside torch 2.13: no torchvision
        note = f"`import timm` fails ({type(e).__name__}: {e}); timm/optim/lamb.py loaded alone"
        for name in [m for m in sys.modules if m == "timm" or m.startswith("timm.")]:
            del sys.modules[name]
        root = Path(next(iter(spec.submodule_search_locations)))
        for name, path in (("timm", root), ("timm.optim", root / "optim")):
            stub = types.ModuleType(name)
            stub.__path__ = [str(path)]
            sys.modules[name] = stub
    return importlib.import_module("timm.optim.lamb").Lamb, note


def _peer_groups(named, weight_decay):
    from runtime.optim.groups import param_groups_for_bert
    return [{"params": g["params"], "weight_decay": g["weight_decay"]}
            for g in param_groups_for_bert(named, weight_decay)]


def build_peer(impl: str, named):
    """(optimizer, note) for a peer implementation; raises ImportError when absent."""
    import torch
    hp = LAMB_HP
    betas = (hp["beta1"], hp["beta2"])
    if impl == "torch-optimizer":
        import torch_optimizer
        return torch_optimizer.Lamb(_peer_groups(named, hp["weight_decay"]), lr=hp["lr"],
                                    betas=betas, eps=hp["eps"]), "debias=False, clamp 10"
    if impl == "timm":
        Lamb, note = _load_timm_lamb()
        return Lamb(_peer_groups(named, hp["weight_decay"]), lr=hp["lr"], betas=betas,
                    eps=hp["eps"], max_grad_norm=None), note or "max_grad_norm=None"
    if impl == "pytorch-lamb":
        import pytorch_lamb
        return pytorch_lamb.Lamb(_peer_groups(named, hp["weight_decay"]), lr=hp["lr"],
                                 betas=betas, eps=hp["eps"]), "no bias correction"
    if impl.startswith("torch:"):
        a = ADAMW_HP
        flag = impl.split(":")[1]
        return torch.optim.AdamW(_peer_groups(named, a["weight_decay"]), lr=a["lr"],
                                 betas=(a["beta1"], a["beta2"]), eps=a["eps"],
                                 **{flag: True}), f"{flag}=True"
    raise ValueError(f"unknown implementation {impl!r}")


# --------------------------------------------------------------------------- worker

def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise KeyError(key)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_case(model: str, optimizer: str, impl: str, reps: int) -> dict:
    """Build, step once untimed, time ``reps`` steps; the record bench.optim reports."""
    import torch
    from runtime.optim.optimizers import build_optimizer
    torch.manual_seed(0)
    shapes = bert_named_shapes(model)
    named = [(n, (torch.randn(s) * 0.02).requires_grad_()) for n, s in shapes]
    rec = {"model": model, "optimizer": optimizer, "impl": impl,
           "elements": sum(p.numel() for _, p in named), "tensors": len(named)}
    t0 = time.perf_counter()
    kwargs = {}
    if impl.startswith("presto:"):
        hp = {"lamb": LAMB_HP, "adamw": ADAMW_HP, "lars": LARS_HP}[optimizer]
        opt = build_optimizer(optimizer, named, backend=impl.split(":")[1], **hp)
        rec["compile_s"] = round(opt.compile_seconds, 2)
        rec["note"] = ""
        kwargs = {"grad_scale": 0.5}  # clip coefficient × unscale, folded into the step
    else:
        opt, rec["note"] = build_peer(impl, named)
    rec["build_s"] = round(time.perf_counter() - t0, 2)
    for _, p in named:  # the fused backend's .grad is already a view of its buffer
        if p.grad is None:
            p.grad = torch.empty_like(p)
        p.grad.normal_()
    opt.step(**kwargs)  # untimed: lazy state, first-touch pages, caches
    peak_ok = _reset_peak()
    rss_before = _status_kib("VmRSS")
    times = []
    for _ in range(reps):
        t1 = time.perf_counter()
        opt.step(**kwargs)
        times.append(time.perf_counter() - t1)
    rec.update(step_min_s=min(times), step_median_s=statistics.median(times),
               step_times_s=[round(t, 4) for t in times],
               rss_gib=round(rss_before / 2**20, 2),
               peak_growth_mib=round((_status_kib("VmHWM") - rss_before) / 1024, 1)
               if peak_ok else None)
    if impl == "presto:fused":
        rec["compiled"] = opt.flat_binding.compiled
    return rec


def worker_main(args) -> None:
    try:
        rec = run_case(args.model, args.optimizer, args.impl, args.reps)
    except Exception as e:  # a peer that does not import / a backend not offered here
        rec = {"model": args.model, "optimizer": args.optimizer, "impl": args.impl,
               "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    print("RESULT " + json.dumps(rec), flush=True)


# --------------------------------------------------------------------------- parent

def run_worker(model: str, optimizer: str, impl: str, reps: int) -> dict:
    cmd = [sys.executable, "-m", "bench.optim", "--worker", "--model", model,
           "--optimizer", optimizer, "--impl", impl, "--reps", str(reps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"model": model, "optimizer": optimizer, "impl": impl,
            "error": f"worker exited {proc.returncode}: {tail[0][:200]}"}


def add_limits(rec: dict, copy_gbps: float, inplace_gbps: float | None = None) -> None:
    """limit_s / ratio_to_limit from the copy bandwidth (the issue's definition); with
    ``inplace_gbps`` also against the in-place bandwidth, the stricter reference for steps
    that update m, v, p in place (no write-allocate reads, unlike a copy's destination)."""
    if "error" in rec:
        return
    nbytes = rec["elements"] * BYTES_PER_ELEMENT[rec["optimizer"]]
    rec["limit_s"] = nbytes / (copy_gbps * 1e9)
    rec["ratio_to_limit"] = rec["step_min_s"] / rec["limit_s"]
    if inplace_gbps:
        rec["limit_inplace_s"] = nbytes / (inplace_gbps * 1e9)
        rec["ratio_to_limit_inplace"] = rec["step_min_s"] / rec["limit_inplace_s"]


def goals(records: list[dict]) -> dict:
    """The issue's goals per model: fastest LAMB within 1.5× of its limit and ≥ 2× faster
    than every peer LAMB; Presto's fastest AdamW at least as fast as torch's fused AdamW."""
    out = {}
    for model in sorted({r["model"] for r in records}):
        ok = [r for r in records if r["model"] == model and "error" not in r]
        lamb = [r for r in ok if r["optimizer"] == "lamb"]
        ours = [r for r in lamb if r["impl"].startswith("presto:")]
        peers = [r for r in lamb if not r["impl"].startswith("presto:")]
        g: dict = {}
        if ours:
            best = min(ours, key=lambda r: r["step_min_s"])
            g["fastest_lamb"] = best["impl"]
            g["fastest_lamb_ratio_to_limit"] = round(best["ratio_to_limit"], 3)
            g["lamb_within_1.5x_limit"] = best["ratio_to_limit"] <= 1.5
            if "ratio_to_limit_inplace" in best:
                g["fastest_lamb_ratio_to_limit_inplace"] = round(
                    best["ratio_to_limit_inplace"], 3)
            if peers:
                speedups = {r["impl"]: round(r["step_min_s"] / best["step_min_s"], 2)
                            for r in peers}
                g["lamb_speedup_over_peers"] = speedups
                g["lamb_2x_faster_than_every_peer"] = min(speedups.values()) >= 2.0
        adamw = [r for r in ok if r["optimizer"] == "adamw"]
        ours_a = [r for r in adamw if r["impl"].startswith("presto:")]
        torch_fused = [r for r in adamw if r["impl"] == "torch:fused"]
        if ours_a and torch_fused:
            best = min(ours_a, key=lambda r: r["step_min_s"])
            g["fastest_adamw"] = best["impl"]
            g["adamw_vs_torch_fused"] = round(torch_fused[0]["step_min_s"]
                                              / best["step_min_s"], 3)
            g["adamw_at_least_as_fast_as_torch_fused"] = \
                best["step_min_s"] <= torch_fused[0]["step_min_s"]
        out[model] = g
    return out


def table(rec: dict) -> str:
    """One line per (model, implementation), then each model's goals."""
    head = (f"{'model':6} {'opt':6} {'implementation':18} {'min s':>8} {'median s':>9} "
            f"{'limit s':>8} {'ratio':>6} {'ratio ip':>8} {'peak MiB':>9} {'compile s':>9}  "
            "note")
    lines = [head, "-" * len(head)]
    for r in rec["results"]:
        name = f"{r['model']:6} {r['optimizer']:6} {r['impl']:18}"
        if "error" in r:
            lines.append(f"{name} {'n/a':>8}  {r['error']}")
            continue
        peak = "-" if r.get("peak_growth_mib") is None else f"{r['peak_growth_mib']:.0f}"
        comp = f"{r['compile_s']:.1f}" if r.get("compile_s") else "-"
        ip = r.get("ratio_to_limit_inplace")
        ip = "-" if ip is None else f"{ip:.2f}"
        lines.append(f"{name} {r['step_min_s']:8.3f} {r['step_median_s']:9.3f} "
                     f"{r['limit_s']:8.3f} {r['ratio_to_limit']:6.2f} {ip:>8} {peak:>9} "
                     f"{comp:>9}  {r.get('note', '')}")
    return "\n".join(lines + [f"goals {model}: {json.dumps(g)}"
                              for model, g in rec["goals"].items()])


@contextlib.contextmanager
def bandwidth(r):
    """The copy bandwidth the limits divide by, measured before the cases."""
    bw = measure_bandwidth()
    print(f"bandwidth: copy {bw['copy_GBps']:.1f} GB/s, in-place scale "
          f"{bw['inplace_scale_GBps']:.1f}, read {bw['read_sum_GBps']:.1f} "
          f"({bw['threads']} threads)", flush=True)
    r.record["bandwidth_start"] = bw
    yield bw


def measure(r, case) -> dict:
    """One (model, optimizer, implementation) in its own process, held to the limit."""
    rec = run_worker(*case, r.args.reps)
    add_limits(rec, r.state["copy_GBps"], r.state["inplace_scale_GBps"])
    print(json.dumps(rec), file=sys.stderr, flush=True)
    return rec


def _goal(key: str):
    """Met when every model measured it met it (None when no model measured it)."""
    def met(rec: dict):
        got = [g[key] for g in rec["goals"].values() if key in g]
        return all(got) if got else None
    return met


def _threads(a) -> dict:
    import torch
    return {"threads": torch.get_num_threads(), "reps": a.reps}


BENCHMARK = Benchmark(
    "optim", __doc__, measure,
    cases=lambda r: [(m, o, i) for m in r.args.models for o, i in CASES if o in r.args.only],
    options=(option("--models", type=listed(MODELS, what="model"), default="base,large"),
             option("--only", type=listed(("lamb", "adamw", "lars"), what="optimizer"),
                    default="lamb,adamw,lars", help="optimizers to run"),
             option("--reps", type=int, default=3, help="timed steps per implementation"),
             out(RESULTS),
             hidden("--worker", action="store_true"), hidden("--model"),
             hidden("--optimizer"), hidden("--impl")),
    instead=(("--worker", worker_main),),
    fields=_threads, setup=bandwidth, results="results",
    summary=lambda r: dict(bandwidth_end=measure_bandwidth(),
                           limit_uses="bandwidth_start.copy_GBps",
                           bytes_per_element=BYTES_PER_ELEMENT, goals=goals(r.results)),
    table=table,
    goals=(Goal("lamb_within_1.5x_limit", "the fastest LAMB within 1.5x of its bandwidth "
                "limit", _goal("lamb_within_1.5x_limit")),
           Goal("lamb_2x_faster_than_every_peer", "the fastest LAMB at least 2x faster than "
                "every peer LAMB", _goal("lamb_2x_faster_than_every_peer")),
           Goal("adamw_at_least_as_fast_as_torch_fused", "the fastest AdamW at least as fast "
                "as torch's fused AdamW", _goal("adamw_at_least_as_fast_as_torch_fused"))))


def main(argv=None) -> int:
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
