"""bench.gpu, the GPU harness, run where CI runs - on CPU, in its smoke mode (tiny shapes,
the simulated device, every stage in one process): every stage records its result, a stage
that breaks is recorded as failed while the others still run; with --isolate, as on a GPU,
a stage past its budget is ended with its whole process group and keeps its finished cases; and no more files come
back than a lent GPU machine returns; the out-of-memory retry steps the batch down. The
record's goals in process: tests/unit/test_bench_gpu.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from bench import gpu
from tests.support.launch import ROOT



def test_without_a_gpu_a_full_plan_is_refused_at_once_and_says_what_to_run(tmp_path):
    """Not --smoke on a machine without NVIDIA's driver and a CUDA device: exit 2 in seconds,
    saying so (it used to run the stages until the data stage's budget ran out)."""
    from bench.gpu.orchestrator import NVIDIA_DRIVER
    if NVIDIA_DRIVER.exists():
        pytest.skip(f"{NVIDIA_DRIVER} exists: a GPU machine is never refused")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--out", str(tmp_path / "out")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "no CUDA GPU here" in proc.stderr and "--smoke" in proc.stderr, proc.stderr
    assert "GPU_QUICKSTART" in proc.stderr and time.monotonic() - t0 < 120
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.slow
@pytest.mark.timeout(600)   # a hang guard: 91 s alone, 115-223 s beside the other worker
def test_smoke_run_records_every_stage_and_isolates_a_failure(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--smoke", "--plan", "all",
                           "--out", str(out), "--work", str(work), "--fail", "plain"],
                          cwd=ROOT, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # a stage failed
    assert proc.stdout.startswith("bench.gpu plan all: 16 stages, budgets 1185 s of the 1500 s")
    assert "   1. env                 15 s  (estimate 12 s)" in proc.stdout  # the plan, first
    assert "   3. graphs_compiled    170 s" in proc.stdout  # the best mode first
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and set(files) <= {"summary.txt", "stages.log", "cuda_tests.xml",
                                              "gpu_cpu-smoke_" + _today() + ".json"}, files
    record = json.loads((out / f"gpu_cpu-smoke_{_today()}.json").read_text())
    assert record["benchmark"] == "gpu" and record["smoke"] and record["commit"]
    assert record["plan"] == "all"
    stages = record["stages"]
    assert list(stages) == list(gpu.PLAN["all"].stages)
    assert stages["plain"]["status"] == "failed"
    assert "injected failure" in stages["plain"]["result"]["error"]
    for name in set(stages) - {"plain"}:  # the failure ended nothing else
        assert stages[name]["status"] == "ok", (name, stages[name])
    r = {name: s["result"] for name, s in stages.items()}
    assert r["env"]["torch"] and r["env"]["cuda_available"] is False
    assert r["data"]["small"]["train_sequences"] > 0
    assert r["data"]["data_sets"] == ["small", "cpu128", "seq512"]  # what the plan reads
    counts = r["cuda_tests"]["counts"]  # collected and skipped here, run on a GPU
    assert counts["skipped"] >= 40 and counts["failed"] == counts["error"] == 0
    assert len(r["cuda_tests"]["returncode"]) == 2  # the graph tests in a process of their own
    assert any("test_cuda_graphs.py" in t for t in r["cuda_tests"]["tests"])
    checks = r["checks"]
    assert set(checks["host_syncs"]) == {"padded_fp32", "unpadded_fp32", "packed_fp32"}
    assert all(v["per_step"] == 0 and v["optimizer_compiled"]
               for v in checks["host_syncs"].values()), checks
    assert {v["kernel"] for v in checks["attention"].values()} <= {"math", "flash", "efficient"}
    thr = r["throughput"]  # unpadded at the largest batch, FP8 beside it, both at 2 sequences
    assert list(thr)[-4:] == ["unpadded_fp32", "unpadded_fp32_fp8", "unpadded_fp32_seqs2",
                              "unpadded_fp32_fp8_seqs2"]
    assert [thr[k]["fp8"] for k in list(thr)[-4:]] == [False, True, False, True]
    assert [thr[k]["batch"] for k in list(thr)[-4:]] == ["largest", "largest", "fixed", "fixed"]
    assert thr["unpadded_fp32_fp8"]["loss_of_sibling"] == thr["unpadded_fp32"]["loss"]
    assert r["throughput_paths"]["padded_fp32"]["sequences_per_s"] > 0
    assert r["optimizer"]["lamb_presto:fused"]["ratio_to_limit"] > 0
    phase = r["optimizer"]["phase_sharded_vs_unsharded"]
    assert phase["world"]["step_s"] > 0 and phase["sharded_over_unsharded"] > 0
    assert r["tune_profile"]["b2"]["forward_s"] > 0
    base = r["graphs_baseline"]  # the CUDA-graph stages: eager only on a CPU, graphs skipped
    assert base["rows2"]["rows"] == 2 and base["rows2"]["eager"]["step_s"] > 0
    assert base["rows2"]["eager"]["kernels"] > 0 and base["rows2"]["eager"]["busy_s"] > 0
    assert "skipped" in base["rows2"]["full"] and "skipped" in base["rows2"]["encoder"]
    assert list(base["rows2"])[-3:] == ["full", "encoder", "eager"]  # the full graph first
    top = base["rows2"]["eager"]["top_kernels"]  # the kernel table: its shape, not numbers
    assert 0 < len(top) <= 30 and set(top[0]) == {"name", "calls", "us", "mean_us"}
    assert top == sorted(top, key=lambda k: -k["us"])
    calls = base["rows2"]["eager"]["kernel_calls"]  # every kernel, with its calls a step
    assert len(calls) > len(top) and all(c > 0 for c in calls.values())
    assert {k["name"] for k in top} <= set(calls)
    # no CUDA events on a CPU: the replay and host-wait fields are there, and None
    replays = base["rows2"]["eager"]["replays"]
    assert {"gap_mean_s", "gap_max_s", "launch_gap_s", "replay_s"} <= set(replays)
    assert set(replays.values()) == {None} and base["rows2"]["eager"]["host_wait_s"] is None
    cases = {"graphs_compiled": ["rows2_bf16_master_layers"],  # each mode a case, its CPU
             "graphs": ["rows2_bf16_master_qkv", "rows2_bf16_master"]}  # stand-in eager
    for stage, names in cases.items():
        assert [k for k, v in r[stage].items() if isinstance(v, dict)] == names, r[stage].keys()
        for name in names:
            case = r[stage][name]
            assert case["eager"]["step_s"] > 0 and case["eager"]["kernel_calls"], name
            assert "skipped" in case["full"] and case["cpu_stand_in"], name
    assert "qkv" in str(r["graphs_compiled"]["rows2_bf16_master_layers"]["overrides"])
    eager = r["eager_paths"]["eager_b4"]
    assert set(eager) == {"unpadded_dynamic", "padded_bucketed", "packed_static"}
    assert eager["unpadded_dynamic"]["host_top"]  # the host's work, profiled
    assert r["graph_batches"]["b3"]["eager"]["step_s"] > 0
    assert r["throughput_paths"]["padded_fp32"]["top_kernels"][0]["mean_us"] is not None
    assert goals_of(record, "best_mode_full_graph_2rows_under_25ms") is None  # no capture
    assert goals_of(record, "eager_b4_within_1_2x_unpadded") in (True, False)
    att = r["attention"]  # the fastest kernel per path (math / repad on a CPU)
    assert set(att["fastest"]) == {"padded", "packed", "unpadded"} and all(att["fastest"].values())
    short = r["short_runs"]["fp32"]
    assert short["returncode"] in (0, 1) and short["compliance"]["returncode"] == 0, short
    goals = record["goals"]
    assert goals["no_host_sync_in_a_step"]["met"] is True
    assert goals["unpadded_bf16_200k_tokens_per_s"]["met"] is None  # no bf16 on a CPU
    assert goals["every_cuda_test_passes"]["met"] is None  # nothing ran on a CPU
    summary = (out / "summary.txt").read_text()
    assert "plain            failed" in summary and "not measured" in summary
    assert "graph case" in summary  # the per-mode table: each case and graph mode measured
    for case in ("rows2_bf16_master_layers", "rows2_bf16_master_qkv", "rows2_bf16_master"):
        assert any(ln.split()[:2] == [case, "eager"] for ln in summary.splitlines()), case
    assert (out / "stages.log").read_text().count("=====") == len(stages)


@pytest.mark.timeout(120)
def test_a_stage_past_its_budget_loses_only_its_running_case_and_its_whole_group(tmp_path):
    """A stage that hangs (as one stuck in a collective would) after finishing a case and
    starting a child: at its budget its whole process group is ended - the child too - and
    the record keeps the case it finished, status timeout; the next stage still runs."""
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--smoke", "--isolate",
                           "--out", str(out), "--work", str(work), "--stages", "env,data",
                           "--hang", "env", "--stage-budget", "8"], cwd=ROOT, capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    record = json.loads((out / f"gpu_cpu-smoke_{_today()}.json").read_text())
    env = record["stages"]["env"]
    assert env["status"] == "timeout" and "process group was ended" in env["why"]
    assert env["result"]["before_the_hang"] == "finished"  # the case it finished
    child = int((work / "hang_env.pid").read_text())
    assert env["result"]["child"] == child
    for _ in range(50):  # the child was in the stage's group: gone (reaped by init)
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child), f"the stage's child {child} survived its stage"
    assert record["stages"]["data"]["status"] == "ok"
    assert not list(work.glob("stage_*.json"))  # the orchestrator read and removed them


@pytest.mark.timeout(180)
def test_a_killed_call_keeps_every_finished_stage_and_the_running_stages_cases(tmp_path):
    """A lent machine's call ends at its limit, whatever runs: while a stage runs, --out
    already holds the record and summary.txt of the stages before it (written after each
    stage) and the running stage's finished cases (its partial file, not in the temporary
    work folder); a SIGTERM to the orchestrator ends the stage's process group and records
    it - status ended, with those cases. Before, goals and summary.txt came only at the end
    and the partials lived in --work."""
    import signal
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.Popen([sys.executable, "-m", "bench.gpu", "--smoke", "--isolate",
                             "--out", str(out), "--work", str(work), "--stages", "env,data",
                             "--hang", "data", "--stage-budget", "120"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        partial = out / "stage_data.partial.json"
        for _ in range(1200):
            if partial.is_file() and (work / "hang_data.pid").is_file():
                break
            time.sleep(0.1)
        assert partial.is_file(), "the running stage's cases are not in --out"
        assert "env              ok" in (out / "summary.txt").read_text()  # written after env
        record = json.loads((out / f"gpu_cpu-smoke_{_today()}.json").read_text())
        assert record["stages"]["env"]["status"] == "ok" and "goals" in record
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    record = json.loads((out / f"gpu_cpu-smoke_{_today()}.json").read_text())
    data = record["stages"]["data"]
    assert data["status"] == "ended" and "the call was ended" in data["why"]
    assert data["result"]["before_the_hang"] == "finished"
    assert not partial.exists()  # folded into the record
    assert "data             ended" in (out / "summary.txt").read_text()
    child = int((work / "hang_data.pid").read_text())
    for _ in range(50):
        if not _alive(child):
            break
        time.sleep(0.1)
    assert not _alive(child), f"the stage's child {child} survived the call's end"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead
        return f.read().split(")")[-1].split()[0] != "Z"


def goals_of(record: dict, name: str):
    return record["goals"][name]["met"]


def _today() -> str:
    import datetime
    return datetime.date.today().isoformat()


def test_an_out_of_memory_steps_the_batch_down_and_the_last_one_is_raised():
    """The largest batch, confirmed: an out-of-memory steps it down (at most 4 tries); the
    last try's out-of-memory is raised - never a figure of an earlier case, which the copied
    loops left in their result variable when every try ran out of memory."""
    from bench.gpu.harness import largest_that_runs
    seen = []

    def measure(fits: int):
        def run(batch, steps=3, warmup=2):
            seen.append((batch, steps))
            if steps == 10 and batch > fits:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return {"peak_bytes": 1000 * batch, "batch": batch}
        return run
    # probes at 8 and 16 (1000 B per sequence) -> 92 % of 80 kB: 72, then 64, 56, 48
    batch, r, probes = largest_that_runs(measure(48), 8, 8, 80_000, False, steps=10, warmup=3)
    assert (batch, r["batch"]) == (48, 48) and [p["batch"] for p in probes] == [8, 16]
    assert seen == [(8, 3), (16, 3), (72, 10), (64, 10), (56, 10), (48, 10)]
    with pytest.raises(RuntimeError, match="out of memory"):
        largest_that_runs(measure(40), 8, 8, 80_000, False, steps=10, warmup=3)

    def broken(batch, steps=3, warmup=2):
        raise ValueError("not a memory error")
    seen.clear()
    with pytest.raises(ValueError):
        largest_that_runs(broken, 8, 8, 0, True, steps=3, warmup=1)   # smoke: no probes
