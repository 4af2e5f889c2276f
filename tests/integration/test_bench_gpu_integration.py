"""bench.gpu, the one-call GPU harness, run where CI runs - on CPU, in its smoke mode (tiny
shapes, the simulated device): every stage runs in its own process and records its result,
a stage that breaks is recorded as failed while the others still run, and no more files come
back than a lent GPU machine returns; the out-of-memory retry steps the batch down. The
record's goals in process: tests/unit/test_bench_gpu.py."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import gpu
from tests.support.launch import ROOT



@pytest.mark.slow
@pytest.mark.timeout(300)
def test_smoke_run_records_every_stage_and_isolates_a_failure(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu", "--smoke", "--out", str(out),
                           "--work", str(work), "--fail", "throughput"],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # a stage failed
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and set(files) <= {"summary.txt", "stages.log", "cuda_tests.xml",
                                              "gpu_cpu-smoke_" + _today() + ".json"}, files
    record = json.loads((out / f"gpu_cpu-smoke_{_today()}.json").read_text())
    assert record["benchmark"] == "gpu" and record["smoke"] and record["commit"]
    stages = record["stages"]
    assert list(stages) == list(gpu.STAGE_NAMES)
    assert stages["throughput"]["status"] == "failed"
    assert "injected failure" in stages["throughput"]["result"]["error"]
    for name in set(gpu.STAGE_NAMES) - {"throughput"}:  # the failure ended nothing else
        assert stages[name]["status"] == "ok", (name, stages[name])
    r = {name: s["result"] for name, s in stages.items()}
    assert r["env"]["torch"] and r["env"]["cuda_available"] is False
    assert r["data"]["small"]["train_sequences"] > 0
    counts = r["cuda_tests"]["counts"]  # collected and skipped here, run on a GPU
    assert counts["skipped"] >= 10 and counts["failed"] == counts["error"] == 0
    checks = r["checks"]
    assert set(checks["host_syncs"]) == {"padded_fp32", "unpadded_fp32", "packed_fp32"}
    assert all(v["per_step"] == 0 and v["optimizer_compiled"]
               for v in checks["host_syncs"].values()), checks
    assert {v["kernel"] for v in checks["attention"].values()} <= {"math", "flash", "efficient"}
    assert r["plain"]["padded_fp32"]["sequences_per_s"] > 0
    assert r["optimizer"]["lamb_presto:fused"]["ratio_to_limit"] > 0
    assert r["tune_profile"]["b2"]["forward_s"] > 0
    graphs = r["graphs"]  # the CUDA-graph stage: eager only on a CPU, graphs said skipped
    assert graphs["rows2"]["rows"] == 2 and graphs["rows2"]["eager"]["step_s"] > 0
    assert graphs["rows2"]["eager"]["kernels"] > 0 and graphs["rows2"]["eager"]["busy_s"] > 0
    assert "skipped" in graphs["rows2"]["full"] and "skipped" in graphs["b4"]["encoder"]
    assert set(graphs["eager_b4"]) == {"unpadded_dynamic", "padded_bucketed", "packed_static"}
    assert goals_of(record, "full_graph_2rows_under_25ms") is None
    assert goals_of(record, "eager_b4_within_1_2x_unpadded") in (True, False)
    att = r["attention"]  # the fastest kernel per path (math / repad on a CPU)
    assert set(att["fastest"]) == {"padded", "packed", "unpadded"} and all(att["fastest"].values())
    short = r["short_runs"]["fp32"]
    assert short["returncode"] in (0, 1) and short["compliance"]["returncode"] == 0, short
    goals = record["goals"]
    assert goals["no_host_sync_in_a_step"]["met"] is True
    assert goals["throughput_1_5x_plain"]["met"] is None  # its stage failed: not measured
    assert goals["every_cuda_test_passes"]["met"] is None  # nothing ran on a CPU
    summary = (out / "summary.txt").read_text()
    assert "throughput   failed" in summary and "not measured" in summary
    assert (out / "stages.log").read_text().count("=====") == len(gpu.STAGE_NAMES)


def goals_of(record: dict, name: str):
    return record["goals"][name]["met"]


def _today() -> str:
    import datetime
    return datetime.date.today().isoformat()


def test_an_out_of_memory_steps_the_batch_down_and_the_last_one_is_raised():
    """The largest batch, confirmed: an out-of-memory steps it down (at most 4 tries); the
    last try's out-of-memory is raised - never a figure of an earlier case, which the copied
    loops left in their result variable when every try ran out of memory."""
    from bench.gpu.harness import _largest_that_runs
    seen = []

    def measure(fits: int):
        def run(batch, steps=3, warmup=2):
            seen.append((batch, steps))
            if steps == 10 and batch > fits:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return {"peak_bytes": 1000 * batch, "batch": batch}
        return run
    # probes at 8 and 16 (1000 B per sequence) -> 92 % of 80 kB: 72, then 64, 56, 48
    batch, r, probes = _largest_that_runs(measure(48), 8, 8, 80_000, False, steps=10, warmup=3)
    assert (batch, r["batch"]) == (48, 48) and [p["batch"] for p in probes] == [8, 16]
    assert seen == [(8, 3), (16, 3), (72, 10), (64, 10), (56, 10), (48, 10)]
    with pytest.raises(RuntimeError, match="out of memory"):
        _largest_that_runs(measure(40), 8, 8, 80_000, False, steps=10, warmup=3)

    def broken(batch, steps=3, warmup=2):
        raise ValueError("not a memory error")
    seen.clear()
    with pytest.raises(ValueError):
        _largest_that_runs(broken, 8, 8, 0, True, steps=3, warmup=1)   # smoke: no probes
