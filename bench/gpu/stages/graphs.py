"""The ``graphs_compiled``, ``graphs``, ``graphs_baseline``, ``eager_paths`` and ``graph_batches``
stages of ``python -m bench.gpu``: the small-batch step eager, with the encoder graphs and as one
whole-step CUDA graph (train.cuda_graphs, runtime/train/graphs.py), each beside the device's
busy time of one step, in each precision and compile mode.

Cases (BERT-large, sequence 512, static shapes from offline_pack, unpadded attention), each
mode a case of its own (a row of bench.kernel_count.MODES: the CPU's count of the same step
sits beside the GPU's), in the order of what the open goals need: ``graphs_compiled`` (the
verdicts, first: the best mode) ``bf16_master_layers`` (bf16 parameters with fp32 masters,
pad_vocab and qkv, model.compile = 'layers'; a stage of its own for its compiles); ``graphs``
(the verdicts) ``bf16_master_qkv`` (the one QKV GEMM, model.fusions = ["qkv"]) and
``bf16_master``; ``graphs_baseline`` (the second call, ``rest``) ``bf16_autocast`` (fp32
parameters under bf16 autocast, no fusion: the step of the 2026-11-28 record, re-measured)
and the ``b4`` cases. Each at 2 full packed rows of 512 (``rows2``: up to ``FULL_ROW_SEQS``
sequences a row, the largest local batch every step's 2 rows hold) - in ``graphs_baseline``
also at a local batch of 4 sequences (``b4``: the rows the default packing makes, 2 - the
2026-11-28 record's case), for the baseline and the uncompiled modes (the compiled mode's
compile at another shape would take that stage's budget). A case's name is the batch, then
the mode (``rows2_bf16_master``); ``bf16_autocast``'s are ``rows2`` and ``b4``.
``graph_batches``: the cluster projection's other local batches, 3 and 16 sequences, and 3
packed rows, in ``bf16_autocast``.

For each graph mode of a case - the full graph first (the verdicts' figure), then eager; the
baseline's encoder graphs between them -: the step time ``step_s`` (steps enqueued back to
back, one synchronisation at the end: wall time), the host's time to enqueue one step
``host_s`` (the median return time of ``train_step``), the device's busy time of one step
``busy_s`` (the sum of the kernel durations under torch.profiler) and the kernel count, the
step as a ratio to its busy time, every kernel with its calls a step (``kernel_calls``: the
CPU count, bench.kernel_count, is checked against it kernel by kernel), the 30 longest
(``top_kernels``: calls and µs a step, µs a call), the host's time a step in the CUDA
runtime's blocking calls (``host_wait_s``, bench/gpu/replays.py); for the full graph the host
syncs of a replay (torch's sync debug mode) and ``replays``: CUDA events around each timed
replay - a replay's device time, the device time between one replay's end and the next one's
start (``gap_mean_s``, ``gap_max_s``) and the part of it before the host had called the next
replay (``launch_gap_s``: the device idle while the host launched); how each is computed:
bench/gpu/replays.py. Where a full-graph replay is slower than 1.15x its busy time, the
kernels of a replay and of an eager step are compared name by name (what differs under
capture). A fused kernel that fell back to its reference says so in its case
(``fusion_fallbacks``, kernels.fused).

``eager_paths`` times eager steps at a local batch of 4 sequences for each path and shape
policy (unpadded, padded and packed; dynamic, bucketed and static shapes): the per-shape host
cost (cuDNN's attention plans a new shape at most steps of the dynamic padded and packed
paths) against the unpadded path, with a cProfile of the unpadded step's host work.

One trainer per case serves its graph modes in turn (the full graph, then the others on the
same parts): building BERT-large and compiling the fused optimizer once per case keeps the
stage in its budget. Each graph mode of a case is written as it ends (a stage ended at its
budget keeps the modes it finished). The goals (``GOALS``) are judged on the best mode
measured at 2 rows - ``BEST_FIRST``'s first whose full graph ran - and name it. On CPU
(``--smoke``) every case runs eager only (no capture without CUDA: the replay fields are
None) on the tiny model, each mode in a stand-in that runs in seconds - fp32, eager layers,
the foreach optimizer, the mode's fusions (``cpu_stand_in`` in its record; the CPU tests hold
the modes themselves: tests/unit/test_precision.py, tests/integration/test_compile_layers.py)
-, and the profiler counts CPU ops: the harness is what is tested.

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
                               Results, Run, free_cuda, fusion_fallbacks, max_predictions,
                               profile_step, seq_length, stage_config, synchronize, top_kernels,
                               world_of_one)
from bench.gpu.replays import NO_EVENTS, ReplayClock, host_waits
from bench.kernel_count import GOAL as GOAL_KERNELS, MODES as COUNTED_MODES

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
cases keep the record's names (``rows2``, ``b4``)."""
MODES = (BASELINE, "bf16_master", "bf16_master_qkv")
"""The uncompiled precision modes, rows of bench.kernel_count.MODES (their overrides)."""
COMPILED_MODES = ("bf16_master_layers",)
"""The compile modes of ``graphs_compiled`` (a stage of its own: minutes of compiling)."""
BEST_FIRST = ("bf16_master_layers", "bf16_master_qkv", "bf16_master", BASELINE)
"""The modes, the best first (bf16 parameters, the one QKV GEMM, compiled layers: the fewest
kernels, bench.kernel_count): the graph goals are judged on the first whose 2-row full graph
was measured."""
GRAPH_STAGES = ("graphs_compiled", "graphs", "graphs_baseline")
"""The stages whose 2-row cases the graph goals read."""
FULL_FIRST = ("full", "none")
"""The graph modes of a case, in the order they run: the full graph first (the verdicts'
figure), then eager - the baseline's encoder graphs between them (``ALL_THREE``)."""
ALL_THREE = ("full", "encoder", "none")
FULL_ROW_SEQS = 8
"""Sequences a packed row may hold in ``rows2`` (data.max_seqs_per_row): full rows of this
data set (a mean of about 128 real tokens of 512), where the default 3 (NVIDIA's
max_pack_factor, for MLPerf's longer mix) left the 2 rows of 2026-11-28 half empty."""


def _rows2_full(results: Results):
    """(mode, its 2-row case's full-graph figures) for each mode of ``BEST_FIRST`` measured,
    best first, from the graph stages' results (a stage ended at its budget included)."""
    for mode in BEST_FIRST:
        name = case_name("rows2", mode)
        for stage in GRAPH_STAGES:
            full = results(stage).get(name, {})
            full = full.get("full") if isinstance(full, dict) else None
            if isinstance(full, dict) and full.get("step_s") is not None:
                yield mode, full
                break


def _on_best(figure: str):
    """A goal on the best mode measured: its 2-row full graph's ``figure`` at most the goal's
    threshold, the mode named (None: no mode's full graph was measured)."""
    def verdict(results: Results, goal: Goal) -> dict:
        mode, full = next(_rows2_full(results), (None, {}))
        value = full.get(figure)
        return {"mode": mode, figure: value,
                "met": None if value is None else value <= goal.threshold}
    return verdict


def _no_sync(results: Results, goal: Goal) -> dict:
    """No host sync in the replay of any mode measured at 2 rows."""
    syncs = {mode: full.get("syncs_per_step") for mode, full in _rows2_full(results)
             if full.get("syncs_per_step") is not None}
    return {"syncs_per_step": syncs,
            "met": None if not syncs else all(v == 0 for v in syncs.values())}


GOALS = (Goal("best_mode_busy_2rows_under_12ms", GOAL_BUSY_S, _on_best("busy_s")),
         Goal("best_mode_full_graph_2rows_under_25ms", GOAL_STEP_S, _on_best("step_s")),
         Goal("best_mode_full_graph_2rows_within_1_15x_busy", GOAL_BUSY_RATIO,
              _on_best("step_over_busy")),
         Goal("best_mode_kernels_a_step_under_1000", GOAL_KERNELS, _on_best("kernels")),
         Goal("no_host_sync_in_a_replay", 0, _no_sync))
"""The graph goals (docs/GPU.md), judged on the best mode measured (``BEST_FIRST``), which
each names: busy time, step and step over busy of the full graph at 2 full rows, its kernels
a step (issue 50's at most 1,000, counted on the CPU by bench.kernel_count); no host sync in
a replay of any mode."""


def _reported(stage: str):
    """A goal the stage ``stage`` reports itself (``goals`` of its result): left out when it
    did not run."""
    def verdict(results: Results, goal: Goal) -> Optional[dict]:
        return results(stage).get("goals", {}).get(goal.name)
    return verdict


EAGER_GOALS = (Goal("eager_b4_within_1_2x_unpadded", GOAL_EAGER_RATIO,
                    _reported("eager_paths")),)


CPU_STAND_IN = ("smoke: fp32, eager layers, the foreach optimizer, the mode's fusions - the "
                "harness on a CPU in seconds (the mode's precision and compile run on a GPU; "
                "the CPU tests hold them)")


def mode_overrides(run: Run, mode: str) -> list[str]:
    """A mode's config overrides (bench.kernel_count.MODES); on a CPU in --smoke every mode's
    stand-in (``CPU_STAND_IN``: fp32 - autocast steps are CUDA's -, no compiled layers)."""
    if mode not in COUNTED_MODES:
        raise ValueError(f"bench.gpu graphs: unknown mode {mode!r}; the modes are rows of "
                         f"bench.kernel_count.MODES: {', '.join(COUNTED_MODES)}")
    over = list(COUNTED_MODES[mode])
    if not run.cuda:
        over = [o for o in over if not o.startswith(("train.precision=", "model.compile="))]
        over.append("train.precision=fp32")
    return over


def case_name(batch: str, mode: str) -> str:
    """``rows2`` / ``b4`` for the baseline mode (the 2026-11-28 record's names), else the
    batch then the mode."""
    return batch if mode == BASELINE else f"{batch}_{mode}"


def graph_cases(run: Run, modes, b2: int, batches=("rows2",)) -> dict:
    """{case name: (local batch, overrides)} for each mode at each of ``batches`` - 2 full
    rows (``rows2``), local batch 4 (``b4``, left out where the 2 rows hold 4: it is rows2) -
    in the order they run: every mode's first batch first, in the order of ``modes`` (a stage
    ended at its budget keeps the cases it finished)."""
    shapes = {"rows2": (b2, ["data.static_rows=2", f"data.max_seqs_per_row={FULL_ROW_SEQS}"]),
              "b4": (4, [])}
    wanted = [b for b in batches if not (b == "b4" and b2 == 4)]
    return {case_name(b, mode): (shapes[b][0], [*shapes[b][1], *mode_overrides(run, mode)])
            for b in wanted for mode in modes}


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
           "kernel_calls": kernel_calls(got.names, n),
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


def kernel_calls(names: dict, steps: int) -> dict:
    """{kernel name: calls a step} of every kernel of ``names`` ({name: [calls, µs]} over
    ``steps`` profiled steps): what the CPU count (bench.kernel_count) is checked against,
    kernel by kernel - the small ones too (split-K reduces, memsets), which a longest-first
    table leaves out."""
    return {k: round(c / steps, 3) for k, (c, _) in sorted(names.items())}


RECORD_NAME = {"none": "eager", "encoder": "encoder", "full": "full"}
"""A graph mode (train.cuda_graphs) -> its key in a case's record."""


def _modes(run: Run, trainer, graph_modes=FULL_FIRST, written=None) -> dict:
    """The graph modes of ``graph_modes`` (train.cuda_graphs values) on one trainer's parts
    and stream, in that order: the trainer's runner swapped for each (runtime.train.trainer
    ``Trainer.running_as``); ``written(modes so far)`` after each (the case's partial
    record)."""
    warm, steps = (1, 1) if run.smoke else (5, 10)
    out: dict[str, Any] = {}
    it = iter(trainer.train_loader)
    for mode in graph_modes:
        name = RECORD_NAME[mode]
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
        if written is not None:
            written(out)
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


def _graph_cases(run: Run, out, cases: dict, graph_modes=lambda name: FULL_FIRST) -> None:
    """Each case (name: (local batch, overrides)) in ``graph_modes(name)``, in their order,
    each mode written as it ends (the case's record with the modes so far)."""
    for name, (b, extra) in cases.items():
        try:
            trainer = _trainer(run, b, *STATIC, "train.cuda_graphs=full"
                               if run.cuda else "train.cuda_graphs=none", *extra)
            try:
                static = trainer.train_loader.static
                head = {"local_batch": b, "rows": static.rows,
                        "seqs_per_row": static.seqs_per_row, "overrides": list(extra)}
                if not run.cuda:
                    head["cpu_stand_in"] = CPU_STAND_IN

                def written(modes, head=head, name=name):
                    rec = {**head, **{k: {f: v for f, v in m.items() if f != "_names"}
                                      for k, m in modes.items()}, **fusion_fallbacks()}
                    out[name] = rec
                rec = {**head, **_modes(run, trainer, graph_modes(name), written)}
            finally:
                trainer.close()
        except Exception as e:  # noqa: BLE001
            rec = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        _strip_names(rec)
        out[name] = {**rec, **fusion_fallbacks()}
        free_cuda()
        print(f"graphs {name}: {_line(rec)}", flush=True)


def _strip_names(rec: dict) -> None:
    """Drop the profiler's tables of [calls, µs] (the record keeps each mode's calls a step
    of every kernel, its longest kernels and the replay-versus-eager comparison)."""
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


def stage_graphs_compiled(run: Run) -> dict:
    """The best mode first (the verdicts): ``bf16_master_layers`` (whole layers compiled,
    model.compile='layers', static shapes: runtime/model/compile.py) at 2 full rows, the full
    graph then eager - compiled in the first warm-up steps, then captured."""
    out = run.result(_head(run))
    b2 = _rows(run, out)
    _graph_cases(run, out, graph_cases(run, COMPILED_MODES, b2))
    return dict(out)


def stage_graphs(run: Run) -> dict:
    """The uncompiled bf16_master modes at 2 full rows (the verdicts), the one QKV GEMM
    first: the full graph, then eager."""
    out = run.result(_head(run))
    b2 = _rows(run, out)
    _graph_cases(run, out, graph_cases(run, ("bf16_master_qkv", "bf16_master"), b2))
    return dict(out)


def stage_graphs_baseline(run: Run) -> dict:
    """The second call's graph cases: the 2026-11-28 step re-measured (``bf16_autocast`` at 2
    full rows, with the encoder graphs too), then the ``b4`` cases - the baseline's, then
    the uncompiled bf16_master modes'. --smoke: the baseline's 2 rows (the harness)."""
    out = run.result(_head(run))
    b2 = _rows(run, out)
    cases = {**graph_cases(run, (BASELINE,), b2, ("rows2", "b4")),
             **graph_cases(run, ("bf16_master_qkv", "bf16_master"), b2, ("b4",))}
    if run.smoke:
        cases = {"rows2": cases["rows2"]}
    _graph_cases(run, out, cases, lambda name: ALL_THREE if name in ("rows2", "b4")
                 else FULL_FIRST)
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
    _graph_cases(run, out, cases, lambda name: ALL_THREE)
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
