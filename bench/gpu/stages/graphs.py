"""The ``graphs`` and ``graph_batches`` stages of ``python -m bench.gpu``: the small-batch step
eager, with the encoder graphs and as one whole-step CUDA graph (train.cuda_graphs,
runtime/train/graphs.py), each beside the device's busy time of one step.

Cases (BERT-large, sequence 512, bf16, static shapes from offline_pack, unpadded attention):
``graphs`` (the verdicts) 2 packed rows of 512 per rank (the local batch the rows hold on
average) and a local batch of 4 sequences; ``graph_batches`` the cluster projection's other
local batches, 3 and 16 sequences, and 3 packed rows. For each mode: the step time (steps
enqueued back to back, one synchronisation at the end), the host's time to enqueue one step
(the median return time of ``train_step``), the device's busy time of one step (the sum of
the kernel durations under torch.profiler) and the kernel count, and the step as a ratio to
its busy time; for the full graph the host syncs of a replay (torch's sync debug mode).
Where a full-graph replay is slower than 1.15x its busy time, the kernels of a replay and of
an eager step are compared name by name (what differs under capture).

``graphs`` also times eager steps at a local batch of 4 sequences for each path and shape
policy (unpadded, padded and packed; dynamic, bucketed and static shapes): the per-shape host
cost (cuDNN's attention plans a new shape at most steps of the dynamic padded and packed
paths) against the unpadded path, with a cProfile of the unpadded step's host work. Each step
is timed once in the whole run (the tuner's stage measures gradient ready times only).

One trainer per case serves its three modes in turn (eager, then the encoder graphs, then the
full graph on the same parts): building BERT-large and compiling the fused optimizer once per
case keeps the stage in its budget. Each case is written as it finishes. On CPU
(``--smoke``) the tiny model runs the eager modes only (no capture without CUDA) and the
profiler counts CPU ops: the harness is what is tested.

``graphs_compiled`` runs the 2-row case with whole layers compiled (model.compile = 'layers'),
in a call of its own (the ``fusions`` plan) until it has GPU figures.

Owns: the cases and modes measured, the replay-versus-eager kernel comparison, the stage's
goals (the thresholds its figures are held to).
Never: captures a graph itself (runtime/train/graphs.py does, as training would).
"""
from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Optional

from bench.gpu.harness import (DGX_CONFIG, CPU_CONFIG, LARGE_SHAPE, SMOKE_EAGER, TINY, Goal,
                               Results, Run, free_cuda, max_predictions, profile_kernels,
                               seq_length, stage_config, synchronize, world_of_one)

STATIC = ["data.shapes=static", "data.balance=offline_pack", "model.attention=unpadded",
          "data.bin_edges=[]"]
EAGER_PATHS = {  # local batch 4, eager: the per-shape cost of each path and shape policy
    "unpadded_dynamic": ["model.attention=unpadded", "data.balance=random"],
    "padded_dynamic": ["model.attention=padded", "data.balance=random"],
    "padded_bucketed": ["model.attention=padded", "data.balance=random",
                        "data.shapes=bucketed"],
    "packed_dynamic": ["model.attention=padded", "data.balance=pack", "data.bin_edges=[]"],
    "packed_bucketed": ["model.attention=padded", "data.balance=pack", "data.bin_edges=[]",
                        "data.shapes=bucketed"],
    "packed_static": ["model.attention=padded", *STATIC[:2], "data.bin_edges=[]"],
}
GOAL_BUSY_RATIO, GOAL_STEP_S, GOAL_EAGER_RATIO, GOAL_BUSY_S = 1.15, 0.025, 1.2, 0.012


def _reported(results: Results, goal: Goal) -> Optional[dict]:
    """The goal as the stage reported it (``goals`` of its result): left out when it did not run."""
    return results("graphs").get("goals", {}).get(goal.name)


# The stage holds its figures to these itself (_goals); the record takes its verdicts.
GOALS = (Goal("full_graph_2rows_within_1_15x_busy", GOAL_BUSY_RATIO, _reported),
         Goal("full_graph_2rows_under_25ms", GOAL_STEP_S, _reported),
         Goal("busy_2rows_under_12ms", GOAL_BUSY_S, _reported),
         Goal("no_host_sync_in_a_replay", 0, _reported),
         Goal("eager_b4_within_1_2x_unpadded", GOAL_EAGER_RATIO, _reported))


def _trainer(run: Run, b: int, *extra: str):
    from runtime.train.trainer import Trainer
    shape = TINY + SMOKE_EAGER if run.smoke else [f"model.{k}={v}"
                                                  for k, v in LARGE_SHAPE.items()]
    cfg = stage_config(run, DGX_CONFIG if not run.smoke else CPU_CONFIG,
                       f"data.data_dir={run.data('seq512')}", *shape, "model.init=scratch",
                       f"train.global_batch_size={b}", "system.nodes=1", "system.ranks_per_node=1",
                       f"system.device={run.device}",
                       f"train.precision={'bf16' if run.cuda else 'fp32'}",
                       f"data.max_seq_length={seq_length(run)}",
                       f"data.max_predictions_per_seq={max_predictions(run)}",
                       "train.log_every_steps=100000", "train.max_steps=100000", *extra)
    trainer = Trainer(cfg, world_of_one(run.device))
    trainer.setup()
    return trainer


def _measure(run: Run, trainer, it, warmup: int, steps: int, syncs: bool = False,
             host_top: bool = False) -> dict:
    """Step time, host enqueue time, busy time, kernels of ``trainer.train_step``; with
    ``syncs`` the host syncs per step under torch's sync debug mode (CUDA), with
    ``host_top`` the host functions that take one step's time (cProfile)."""
    for _ in range(warmup):
        trainer.train_step(it)
    trainer.step_log.flush()
    synchronize()
    host = []
    t0 = time.perf_counter()
    for _ in range(steps):
        h = time.perf_counter()
        trainer.train_step(it)
        host.append(time.perf_counter() - h)
    synchronize()
    step_s = (time.perf_counter() - t0) / steps
    busy, kernels, names = profile_kernels(run, lambda: trainer.train_step(it),
                                           1 if run.smoke else 3)
    out = {"step_s": step_s, "host_s": statistics.median(host), "busy_s": busy,
           "kernels": kernels, "step_over_busy": step_s / busy if busy else None,
           "_names": names}
    if syncs and run.cuda:
        from runtime.observe.hostsync import HostSyncs
        with HostSyncs(trainer.dist.device) as seen:
            for _ in range(3):
                trainer.train_step(it)
        out["syncs_per_step"] = len(seen.events) / 3
        out["syncs"] = sorted({str(e) for e in seen.events})[:8]
    if host_top:
        out["host_top"] = _host_top(trainer, it)
    trainer.step_log.flush()
    return out


def _host_top(trainer, it, n: int = 12) -> list[str]:
    """The host functions that take one step's time, by own time (cProfile)."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    trainer.train_step(it)
    prof.disable()
    synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(n)
    return [ln.strip() for ln in text.getvalue().splitlines()
            if ln.strip() and ln.strip()[0].isdigit()][:n]


def _kernel_diff(replay: dict, eager: dict, top: int = 12) -> list[dict]:
    """The kernels whose time differs most between a replay and an eager step (per step)."""
    keys = set(replay) | set(eager)
    rows = []
    for k in keys:
        r, e = replay.get(k, [0, 0.0]), eager.get(k, [0, 0.0])
        rows.append({"kernel": k, "replay_us": round(r[1], 1), "eager_us": round(e[1], 1),
                     "replay_calls": r[0], "eager_calls": e[0], "diff_us": round(r[1] - e[1], 1)})
    return sorted(rows, key=lambda x: -abs(x["diff_us"]))[:top]


def _modes(run: Run, trainer) -> dict:
    """Eager, encoder graphs and full graph on one trainer's parts and stream, in that order:
    the trainer's runner swapped for each (runtime.train.trainer ``Trainer.running_as``)."""
    warm, steps = (1, 1) if run.smoke else (5, 10)
    out: dict[str, Any] = {}
    it = iter(trainer.train_loader)
    for mode, name in (("none", "eager"), ("encoder", "encoder"), ("full", "full")):
        if mode != "none" and not run.cuda:
            out[name] = {"skipped": "CUDA graphs need a GPU (smoke: CPU)"}
            continue
        try:
            with trainer.running_as(mode):
                out[name] = _measure(run, trainer, it, warm, steps, syncs=mode == "full")
        except Exception as e:  # noqa: BLE001 - one mode failing keeps the others
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        gc.collect()  # the mode's graphs and their pools
    full = out.get("full", {})
    if full.get("step_over_busy") and full["step_over_busy"] > GOAL_BUSY_RATIO:
        out["full"]["kernels_replay_vs_eager"] = _kernel_diff(full["_names"],
                                                              out["eager"]["_names"])
    return out


def _per_row(run: Run, seq: int) -> float:
    """Sequences a packed row of ``seq`` tokens holds on average in the seq-512 data set (the
    rows only: no static plan, which a local batch the rows cannot hold would refuse)."""
    from loaders.balance import BalanceSpec
    from loaders.dataset import TrainLoader
    probe = TrainLoader(run.data("seq512"), 0, 1, 4, 1, verify=False, balance=BalanceSpec(
        mode="offline_pack", pack_length=seq, max_seqs_per_row=3, static_rows=-1))
    rows = probe.plan.epoch_rows(0)
    probe.close()
    return sum(len(r) for r in rows) / len(rows)


def _rows2_batch(run: Run, seq: int, per_row: float) -> int:
    """The local batch of the 2-row case: the largest, from what 2 rows hold on average
    down, whose every step 2 static rows of one rank can hold exactly (the plan refuses the
    others: at 2.7 sequences a row, 5 sequences need a 3-row and a 2-row every step)."""
    from loaders.balance import BalanceSpec
    from loaders.dataset import TrainLoader
    from loaders.shards import DataError
    for b in range(max(1, int(2 * per_row)), 1, -1):
        try:
            TrainLoader(run.data("seq512"), 0, 1, b, 1, verify=False, balance=BalanceSpec(
                mode="offline_pack", pack_length=seq, max_seqs_per_row=3,
                static_rows=2)).close()
            return b
        except DataError:
            continue
    return 1


def _graph_cases(run: Run, out, cases: dict) -> None:
    """Each case (name: (local batch, overrides)) in its three modes, written as it ends."""
    for name, (b, extra) in cases.items():
        try:
            trainer = _trainer(run, b, *STATIC, "train.cuda_graphs=full"
                               if run.cuda else "train.cuda_graphs=none", *extra)
            try:
                static = trainer.train_loader.static
                rec = {"local_batch": b, "rows": static.rows, **_modes(run, trainer)}
            finally:
                trainer.close()
        except Exception as e:  # noqa: BLE001
            rec = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        _strip_names(rec)
        out[name] = rec
        free_cuda()
        print(f"graphs {name}: {_line(rec)}", flush=True)


def _strip_names(rec: dict) -> None:
    """Drop the per-kernel tables the comparison used (the record keeps the comparison)."""
    for mode in rec.values() if isinstance(rec, dict) else ():
        if isinstance(mode, dict):
            mode.pop("_names", None)
    if isinstance(rec, dict):
        rec.pop("_names", None)


def stage_graphs(run: Run) -> dict:
    """The verdicts' cases: 2 packed rows and a local batch of 4 in three modes, and eager at
    local batch 4 per path and shape policy (the module docstring)."""
    seq = seq_length(run)
    per_row = _per_row(run, seq)
    out = run.result({"seq": seq, "model": "tiny" if run.smoke else "bert-large",
                      "precision": "bf16" if run.cuda else "fp32",
                      "sequences_per_packed_row": round(per_row, 3)})
    b2 = _rows2_batch(run, seq, per_row)
    out["rows2_local_batch"] = b2
    cases = {"rows2": (b2, ["data.static_rows=2"]), "b4": (4, [])}
    if run.smoke or b2 == 4:  # (smoke: the harness, in seconds; b2 == 4: b4 is rows2)
        cases = {"rows2": cases["rows2"]}
    _graph_cases(run, out, cases)
    out["goals"] = _goals(out)  # (each finished case's verdicts survive the stage's budget)
    eager = {}
    paths = {k: v for k, v in EAGER_PATHS.items() if not run.smoke or k in (
        "unpadded_dynamic", "padded_bucketed", "packed_static")}
    for name, extra in paths.items():
        try:
            trainer = _trainer(run, 4, *extra)
            try:
                it = iter(trainer.train_loader)
                eager[name] = _measure(run, trainer, it, 3 if not run.smoke else 1,
                                       10 if not run.smoke else 2,
                                       host_top=name == "unpadded_dynamic")
            finally:
                trainer.close()
        except Exception as e:  # noqa: BLE001
            eager[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        eager[name].pop("_names", None)
        out["eager_b4"] = dict(eager)
        out["goals"] = _goals(out, partial=len(eager) < len(paths))
        free_cuda()
    return dict(out)


def stage_graphs_compiled(run: Run) -> dict:
    """The 2-row case of ``graphs`` with whole layers compiled (model.compile='layers',
    static shapes: runtime/model/compile.py) in the three modes: compiled in the eager
    warm-up, then captured with the step. Its figures beside ``graphs``' rows2 (the same
    batch rule): what the compiled layers save at the local batch where records are set.
    --smoke: skipped (a compile on 2 CPU cores takes minutes; the CPU tests hold the
    compiled layers to the eager ones)."""
    seq = seq_length(run)
    out = run.result({"seq": seq, "model": "tiny" if run.smoke else "bert-large",
                      "precision": "bf16" if run.cuda else "fp32"})
    if run.smoke:
        out["rows2_compiled"] = {"skipped": "smoke: no compile on the CPU"}
        return dict(out)
    b2 = _rows2_batch(run, seq, _per_row(run, seq))
    out["rows2_local_batch"] = b2
    _graph_cases(run, out, {"rows2_compiled": (b2, ["data.static_rows=2",
                                                    "model.compile=layers"])})
    return dict(out)


def stage_graph_batches(run: Run) -> dict:
    """The cluster projection's other local batches in three modes: 3 and 16 sequences, and
    3 packed rows (NVIDIA's 3-pack configs)."""
    seq = seq_length(run)
    per_row = _per_row(run, seq)
    out = run.result({"seq": seq, "model": "tiny" if run.smoke else "bert-large",
                      "precision": "bf16" if run.cuda else "fp32",
                      "sequences_per_packed_row": round(per_row, 3)})
    cases = {"b3": (3, []), "b16": (16, []),
             "rows3": (max(1, int(3 * per_row)), ["data.static_rows=3"])}
    if run.smoke:
        cases = {"b3": cases["b3"]}
    _graph_cases(run, out, cases)
    return dict(out)


def _line(rec: dict) -> str:
    if "error" in rec:
        return "error: " + rec["error"][:120]
    parts = []
    for mode in ("eager", "encoder", "full"):
        m = rec.get(mode, {})
        if "step_s" in m:
            parts.append(f"{mode} {m['step_s'] * 1e3:.1f} ms (busy {m['busy_s'] * 1e3:.1f}, "
                         f"host {m['host_s'] * 1e3:.1f}, {m['kernels']:.0f} kernels)")
        else:
            parts.append(f"{mode} {m.get('error') or m.get('skipped')}")
    return "; ".join(parts)


def _goals(out: dict, partial: bool = True) -> dict:
    """The issue's goals from this stage's figures (None where not measured). ``partial``:
    eager paths are still to come, so the eager goal can be missed but not yet met."""
    full = out.get("rows2", {}).get("full", {})
    step, ratio, busy_s = full.get("step_s"), full.get("step_over_busy"), full.get("busy_s")
    syncs = full.get("syncs_per_step")
    eager = out.get("eager_b4", {})
    base = eager.get("unpadded_dynamic", {}).get("step_s")
    ratios = {k: v["step_s"] / base for k, v in eager.items() if base and "step_s" in v}
    worst = max((r for k, r in ratios.items() if k != "unpadded_dynamic"), default=None)
    busy, under, busy_under, no_sync, eager_goal = GOALS
    return {
        busy.name: {"goal": GOAL_BUSY_RATIO, "ratio": ratio,
                    "met": None if ratio is None else ratio <= GOAL_BUSY_RATIO},
        under.name: {"goal": GOAL_STEP_S, "step_s": step,
                     "met": None if step is None else step <= GOAL_STEP_S},
        busy_under.name: {"goal": GOAL_BUSY_S, "busy_s": busy_s,
                          "met": None if busy_s is None else busy_s <= GOAL_BUSY_S},
        no_sync.name: {"goal": 0, "syncs_per_step": syncs,
                       "met": None if syncs is None else syncs == 0},
        eager_goal.name: {"goal": GOAL_EAGER_RATIO, "ratios": ratios,
                          "met": None if worst is None or (partial and worst <= GOAL_EAGER_RATIO)
                          else worst <= GOAL_EAGER_RATIO},
    }
