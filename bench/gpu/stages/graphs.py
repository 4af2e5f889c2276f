"""The ``graphs``, ``graphs_compiled``, ``eager_paths`` and ``graph_batches`` stages of ``python
-m bench.gpu``: the small-batch step eager, with the encoder graphs and as one whole-step CUDA
graph (train.cuda_graphs, runtime/train/graphs.py), each beside the device's busy time of one
step, in each precision and compile mode.

Cases (BERT-large, sequence 512, static shapes from offline_pack, unpadded attention), each
mode a case of its own (a row of bench.kernel_count.MODES: the CPU's count of the same step
sits beside the GPU's): ``graphs`` (the verdicts) ``bf16_autocast`` (fp32 parameters under
bf16 autocast, no fusion: the H200 record's step), ``bf16_master`` (bf16 parameters, fp32
master weights in the optimizer) and ``bf16_master_qkv`` (with the one QKV GEMM,
model.fusions = ["qkv"]); ``graphs_compiled`` (the verdicts too, a stage of its own for its
compiles) ``bf16_master_layers`` (bf16_master with pad_vocab and qkv, model.compile =
'layers'); each at 2 full packed rows of 512 (``rows2``: up to ``FULL_ROW_SEQS`` sequences a
row, the largest local batch every step's 2 rows hold) and at a local batch of 4 sequences
(``b4``: the rows the default packing makes, 2 - the 2026-11-28 record's case). A case's
name is the batch, then the mode (``rows2_bf16_master``); ``bf16_autocast``'s are ``rows2``
and ``b4``. ``graph_batches``: the cluster projection's other local batches, 3 and 16
sequences, and 3 packed rows, in ``bf16_autocast``.

For each graph mode of a case (all three for ``bf16_autocast``, eager and the full graph for
the others): the step time ``step_s`` (steps enqueued back to back, one synchronisation at
the end: wall time), the host's time to enqueue one step ``host_s`` (the median return time
of ``train_step``), the device's busy time of one step ``busy_s`` (the sum of the kernel
durations under torch.profiler) and the kernel count, the step as a ratio to its busy time,
the 30 longest kernels (``top_kernels``: calls and µs a step, µs a call), the host's time a
step in the CUDA runtime's blocking calls (``host_wait_s``, bench/gpu/replays.py); for the
full graph the host syncs of a replay (torch's sync debug mode) and ``replays``: CUDA events
around each timed replay - a replay's device time, the device time between one replay's end
and the next one's start (``gap_mean_s``, ``gap_max_s``) and the part of it before the host
had called the next replay (``launch_gap_s``: the device idle while the host launched);
how each is computed: bench/gpu/replays.py. Where a full-graph replay is slower than 1.15x
its busy time, the kernels of a replay and of an eager step are compared name by name (what
differs under capture).

``eager_paths`` times eager steps at a local batch of 4 sequences for each path and shape
policy (unpadded, padded and packed; dynamic, bucketed and static shapes): the per-shape host
cost (cuDNN's attention plans a new shape at most steps of the dynamic padded and packed
paths) against the unpadded path, with a cProfile of the unpadded step's host work.

One trainer per case serves its graph modes in turn (eager, then the encoder graphs, then the
full graph on the same parts): building BERT-large and compiling the fused optimizer once per
case keeps the stage in its budget. Each case is written as it finishes. On CPU
(``--smoke``) the tiny model runs ``bf16_autocast``'s cases in fp32, eager only (no capture
without CUDA: the replay fields are None), the profiler counts CPU ops, and the bf16_master
and compiled cases are skipped (their fused optimizer and layers compile for minutes on 2
cores; the CPU tests hold those modes): the harness is what is tested.

Owns: the cases and modes measured, the replay-versus-eager kernel comparison, the stages'
goals (the thresholds their figures are held to).
Never: captures a graph itself (runtime/train/graphs.py does, as training would) or holds a
mode's overrides (bench.kernel_count.MODES does).
"""
from __future__ import annotations

import contextlib
import gc
import statistics
import time
from typing import Any, Optional

from bench.gpu.harness import (DGX_CONFIG, CPU_CONFIG, LARGE_SHAPE, SMOKE_EAGER, TINY, Goal,
                               Results, Run, free_cuda, max_predictions, profile_step,
                               seq_length, stage_config, synchronize, top_kernels, world_of_one)
from bench.gpu.replays import NO_EVENTS, ReplayClock, host_waits
from bench.kernel_count import MODES as COUNTED_MODES

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

BASELINE = "bf16_autocast"
"""The mode of the 2026-11-28 record (fp32 parameters under bf16 autocast, no fusion): its
cases keep the record's names (``rows2``, ``b4``) and the stage's goals read them."""
MODES = (BASELINE, "bf16_master", "bf16_master_qkv")
"""The precision modes of ``graphs``, rows of bench.kernel_count.MODES (their overrides)."""
COMPILED_MODES = ("bf16_master_layers",)
"""The compile modes of ``graphs_compiled`` (a stage of its own: minutes of compiling)."""
FULL_ROW_SEQS = 8
"""Sequences a packed row may hold in ``rows2`` (data.max_seqs_per_row): full rows of this
data set (a mean of about 128 real tokens of 512), where the default 3 (NVIDIA's
max_pack_factor, for MLPerf's longer mix) left the 2 rows of 2026-11-28 half empty."""


def _reported(stage: str):
    """A goal the stage ``stage`` reports itself (``goals`` of its result): left out when it
    did not run."""
    def verdict(results: Results, goal: Goal) -> Optional[dict]:
        return results(stage).get("goals", {}).get(goal.name)
    return verdict


# The stages hold their figures to these themselves (_goals, _eager_goals); the record takes
# their verdicts.
GOALS = (Goal("full_graph_2rows_within_1_15x_busy", GOAL_BUSY_RATIO, _reported("graphs")),
         Goal("full_graph_2rows_under_25ms", GOAL_STEP_S, _reported("graphs")),
         Goal("busy_2rows_under_12ms", GOAL_BUSY_S, _reported("graphs")),
         Goal("no_host_sync_in_a_replay", 0, _reported("graphs")))
EAGER_GOALS = (Goal("eager_b4_within_1_2x_unpadded", GOAL_EAGER_RATIO,
                    _reported("eager_paths")),)


def mode_overrides(run: Run, mode: str) -> list[str]:
    """A mode's config overrides (bench.kernel_count.MODES); on a CPU the autocast mode is
    fp32 (autocast steps are CUDA's)."""
    if mode not in COUNTED_MODES:
        raise ValueError(f"bench.gpu graphs: unknown mode {mode!r}; the modes are rows of "
                         f"bench.kernel_count.MODES: {', '.join(COUNTED_MODES)}")
    over = list(COUNTED_MODES[mode])
    if not run.cuda and mode == BASELINE:
        over = [o for o in over if not o.startswith("train.precision=")]
        over.append("train.precision=fp32")
    return over


def case_name(batch: str, mode: str) -> str:
    """``rows2`` / ``b4`` for the baseline mode (the 2026-11-28 record's names), else the
    batch then the mode."""
    return batch if mode == BASELINE else f"{batch}_{mode}"


def graph_cases(run: Run, modes, b2: int) -> dict:
    """{case name: (local batch, overrides)} for each mode at 2 full rows and at local batch
    4 (b4 left out where the 2 rows hold 4: it is rows2), in the order they run: every
    mode's 2-row case first (a stage ended at its budget keeps the cases it finished)."""
    batches = {"rows2": (b2, ["data.static_rows=2", f"data.max_seqs_per_row={FULL_ROW_SEQS}"]),
               "b4": (4, [])}
    if b2 == 4:
        del batches["b4"]
    return {case_name(b, mode): (batch, [*extra, *mode_overrides(run, mode)])
            for b, (batch, extra) in batches.items() for mode in modes}


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
             host_top: bool = False, graph=None) -> dict:
    """Step time, host enqueue time, busy time, kernels and the longest of them of
    ``trainer.train_step``; the host's blocking runtime calls (CUDA); with ``graph`` (the
    runner's captured FullStepGraph, CUDA) the events around each timed replay
    (bench/gpu/replays.py); with ``syncs`` the host syncs per step under torch's sync debug
    mode (CUDA), with ``host_top`` the host functions that take one step's time (cProfile)."""
    for _ in range(warmup):
        trainer.train_step(it)
    trainer.step_log.flush()
    synchronize()
    clock = ReplayClock(graph) if graph is not None and run.cuda else None
    host = []
    with clock or contextlib.nullcontext():
        t0 = time.perf_counter()
        for _ in range(steps):
            h = time.perf_counter()
            trainer.train_step(it)
            host.append(time.perf_counter() - h)
        synchronize()
        step_s = (time.perf_counter() - t0) / steps
    n = 1 if run.smoke else 3
    got = profile_step(run, lambda: trainer.train_step(it), n)
    busy = got.busy_s
    out = {"step_s": step_s, "host_s": statistics.median(host), "busy_s": busy,
           "kernels": got.kernels, "step_over_busy": step_s / busy if busy else None,
           "top_kernels": top_kernels(got.names, n), "_names": got.names,
           "replays": clock.result() if clock else dict(NO_EVENTS)}
    waits = host_waits(got.prof, n) if run.cuda else {"host_wait_s": None, "calls": None}
    out["host_wait_s"], out["host_waits"] = waits["host_wait_s"], waits["calls"]
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


def _modes(run: Run, trainer, graph_modes=("none", "encoder", "full")) -> dict:
    """Eager, encoder graphs and full graph (those of ``graph_modes``) on one trainer's parts
    and stream, in that order: the trainer's runner swapped for each (runtime.train.trainer
    ``Trainer.running_as``)."""
    warm, steps = (1, 1) if run.smoke else (5, 10)
    out: dict[str, Any] = {}
    it = iter(trainer.train_loader)
    for mode, name in (("none", "eager"), ("encoder", "encoder"), ("full", "full")):
        if mode not in graph_modes:
            continue
        if mode != "none" and not run.cuda:
            out[name] = {"skipped": "CUDA graphs need a GPU (smoke: CPU)"}
            continue
        try:
            with trainer.running_as(mode) as runner:
                out[name] = _measure(run, trainer, it, warm, steps, syncs=mode == "full",
                                     graph=getattr(runner, "graph", None)
                                     if mode == "full" else None)
        except Exception as e:  # noqa: BLE001 - one mode failing keeps the others
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        gc.collect()  # the mode's graphs and their pools
    full = out.get("full", {})
    if full.get("step_over_busy") and full["step_over_busy"] > GOAL_BUSY_RATIO and \
            "_names" in out.get("eager", {}):
        out["full"]["kernels_replay_vs_eager"] = _kernel_diff(full["_names"],
                                                              out["eager"]["_names"])
    return out


def _per_row(run: Run, seq: int, slots: int) -> float:
    """Sequences a packed row of ``seq`` tokens and at most ``slots`` sequences holds on
    average in the seq-512 data set (the rows only: no static plan, which a local batch the
    rows cannot hold would refuse)."""
    from loaders.balance import BalanceSpec
    from loaders.dataset import TrainLoader
    probe = TrainLoader(run.data("seq512"), 0, 1, 4, 1, verify=False, balance=BalanceSpec(
        mode="offline_pack", pack_length=seq, max_seqs_per_row=slots, static_rows=-1))
    rows = probe.plan.epoch_rows(0)
    probe.close()
    return sum(len(r) for r in rows) / len(rows)


def _rows2_batch(run: Run, seq: int, per_row: float, slots: int) -> int:
    """The local batch of the 2-row case: the largest, from what 2 rows hold on average
    down, whose every step 2 static rows of one rank (at most ``slots`` sequences each) can
    hold exactly (the plan refuses the others: at 2.7 sequences a row, 5 sequences need a
    3-row and a 2-row every step)."""
    from loaders.balance import BalanceSpec
    from loaders.dataset import TrainLoader
    from loaders.shards import DataError
    for b in range(max(1, int(2 * per_row)), 1, -1):
        try:
            TrainLoader(run.data("seq512"), 0, 1, b, 1, verify=False, balance=BalanceSpec(
                mode="offline_pack", pack_length=seq, max_seqs_per_row=slots,
                static_rows=2)).close()
            return b
        except DataError:
            continue
    return 1


SMOKE_SKIPS = "smoke: this mode compiles (the fused optimizer, layers) for minutes on 2 CPU " \
              "cores; the CPU tests hold it (tests/unit/test_precision.py, " \
              "tests/integration/test_compile_layers.py)"


def _graph_cases(run: Run, out, cases: dict, graph_modes=("none", "encoder", "full")) -> None:
    """Each case (name: (local batch, overrides)) in ``graph_modes``, written as it ends
    (the baseline's cases in all three, the other modes' in eager and full)."""
    for name, (b, extra) in cases.items():
        baseline = not any(name.endswith("_" + m) for m in COUNTED_MODES)
        if run.smoke and not baseline:
            out[name] = {"skipped": SMOKE_SKIPS}
            continue
        try:
            trainer = _trainer(run, b, *STATIC, "train.cuda_graphs=full"
                               if run.cuda else "train.cuda_graphs=none", *extra)
            try:
                static = trainer.train_loader.static
                rec = {"local_batch": b, "rows": static.rows,
                       "seqs_per_row": static.seqs_per_row, "overrides": list(extra),
                       **_modes(run, trainer, graph_modes if baseline
                                else ("none", "full"))}
            finally:
                trainer.close()
        except Exception as e:  # noqa: BLE001
            rec = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        _strip_names(rec)
        out[name] = rec
        free_cuda()
        print(f"graphs {name}: {_line(rec)}", flush=True)


def _strip_names(rec: dict) -> None:
    """Drop the whole per-kernel tables (the record keeps each mode's longest kernels and
    the replay-versus-eager comparison)."""
    for mode in rec.values() if isinstance(rec, dict) else ():
        if isinstance(mode, dict):
            mode.pop("_names", None)
    if isinstance(rec, dict):
        rec.pop("_names", None)


def _rows(run: Run, out) -> int:
    """The 2-full-row case's local batch (and what a row holds, in the record)."""
    seq = seq_length(run)
    out["sequences_per_packed_row"] = round(_per_row(run, seq, 3), 3)
    per_row = _per_row(run, seq, FULL_ROW_SEQS)
    out["sequences_per_full_row"] = round(per_row, 3)
    b2 = _rows2_batch(run, seq, per_row, FULL_ROW_SEQS)
    out["rows2_local_batch"] = b2
    return b2


def _head(run: Run) -> dict:
    return {"seq": seq_length(run), "model": "tiny" if run.smoke else "bert-large",
            "full_row_seqs": FULL_ROW_SEQS}


def stage_graphs(run: Run) -> dict:
    """The verdicts' cases: each precision mode at 2 full packed rows and a local batch of 4
    in the graph modes (the module docstring); the goals from the baseline's 2-row case."""
    out = run.result(_head(run))
    b2 = _rows(run, out)
    cases = graph_cases(run, MODES, b2)
    if run.smoke:  # the harness in seconds: the baseline's 2 rows, the other modes skipped
        cases = {k: v for k, v in cases.items() if k.startswith("rows2")}
    _graph_cases(run, out, cases)
    out["goals"] = _goals(out)
    return dict(out)


def stage_graphs_compiled(run: Run) -> dict:
    """``graphs``' cases with whole layers compiled (model.compile='layers', static shapes:
    runtime/model/compile.py) in eager and the full graph: compiled in the eager warm-up,
    then captured. --smoke: skipped (a compile on 2 CPU cores takes minutes; the CPU tests
    hold the compiled layers to the eager ones)."""
    out = run.result(_head(run))
    if run.smoke:
        for mode in COMPILED_MODES:
            out[case_name("rows2", mode)] = {"skipped": SMOKE_SKIPS}
        return dict(out)
    b2 = _rows(run, out)
    _graph_cases(run, out, graph_cases(run, COMPILED_MODES, b2))
    return dict(out)


def stage_eager_paths(run: Run) -> dict:
    """Eager at local batch 4 per path and shape policy (the module docstring), bf16 autocast
    (fp32 in --smoke): the per-shape host cost against the unpadded path."""
    out = run.result(_head(run))
    eager = {}
    paths = {k: v for k, v in EAGER_PATHS.items() if not run.smoke or k in (
        "unpadded_dynamic", "padded_bucketed", "packed_static")}
    for name, extra in paths.items():
        try:
            trainer = _trainer(run, 4, *extra, 'model.fusions=[]')
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
        out["goals"] = _eager_goals(out, partial=len(eager) < len(paths))
        free_cuda()
    return dict(out)


def stage_graph_batches(run: Run) -> dict:
    """The cluster projection's other local batches in three modes: 3 and 16 sequences, and
    3 packed rows (NVIDIA's 3-pack configs), in the baseline mode."""
    seq = seq_length(run)
    per_row = _per_row(run, seq, 3)
    out = run.result({**_head(run), "sequences_per_packed_row": round(per_row, 3)})
    base = mode_overrides(run, BASELINE)
    cases = {"b3": (3, base), "b16": (16, base),
             "rows3": (max(1, int(3 * per_row)), ["data.static_rows=3", *base])}
    if run.smoke:
        cases = {"b3": cases["b3"]}
    _graph_cases(run, out, cases)
    return dict(out)


def _line(rec: dict) -> str:
    if "error" in rec or "skipped" in rec:
        return "error: " + rec["error"][:120] if "error" in rec else rec["skipped"][:80]
    parts = []
    for mode in ("eager", "encoder", "full"):
        m = rec.get(mode)
        if m is None:
            continue
        if "step_s" in m:
            gap = (m.get("replays") or {}).get("gap_mean_s")
            parts.append(f"{mode} {m['step_s'] * 1e3:.1f} ms (busy {m['busy_s'] * 1e3:.1f}, "
                         f"host {m['host_s'] * 1e3:.1f}, {m['kernels']:.0f} kernels"
                         + (f", gap {gap * 1e3:.3f}" if gap is not None else "") + ")")
        else:
            parts.append(f"{mode} {m.get('error') or m.get('skipped')}")
    return "; ".join(parts)


def _goals(out: dict) -> dict:
    """The graph goals from this stage's figures (None where not measured): the baseline's
    2-row full graph."""
    full = out.get("rows2", {}).get("full", {})
    step, ratio, busy_s = full.get("step_s"), full.get("step_over_busy"), full.get("busy_s")
    syncs = full.get("syncs_per_step")
    busy, under, busy_under, no_sync = GOALS
    return {
        busy.name: {"goal": GOAL_BUSY_RATIO, "ratio": ratio,
                    "met": None if ratio is None else ratio <= GOAL_BUSY_RATIO},
        under.name: {"goal": GOAL_STEP_S, "step_s": step,
                     "met": None if step is None else step <= GOAL_STEP_S},
        busy_under.name: {"goal": GOAL_BUSY_S, "busy_s": busy_s,
                          "met": None if busy_s is None else busy_s <= GOAL_BUSY_S},
        no_sync.name: {"goal": 0, "syncs_per_step": syncs,
                       "met": None if syncs is None else syncs == 0},
    }


def _eager_goals(out: dict, partial: bool = True) -> dict:
    """The eager goal from ``eager_paths``' figures. ``partial``: paths are still to come, so
    the goal can be missed but not yet met."""
    eager = out.get("eager_b4", {})
    base = eager.get("unpadded_dynamic", {}).get("step_s")
    ratios = {k: v["step_s"] / base for k, v in eager.items() if base and "step_s" in v}
    worst = max((r for k, r in ratios.items() if k != "unpadded_dynamic"), default=None)
    goal, = EAGER_GOALS
    return {goal.name: {"goal": GOAL_EAGER_RATIO, "ratios": ratios,
                        "met": None if worst is None or (partial and worst <= GOAL_EAGER_RATIO)
                        else worst <= GOAL_EAGER_RATIO}}
