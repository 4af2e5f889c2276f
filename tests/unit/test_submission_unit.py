"""Pieces of ``python -m submission`` that need no process: the PRESTO_CACHE_CLEAR word run.sub
passes (runtime.launch.env.cache_cleared), olympic scoring counting failed runs as not
converged (submission.report), and Slurm's time limits parsed (submission.slurm). The command
line and run.sub with stub sbatch/srun: tests/e2e/test_submission.py."""
from __future__ import annotations

import json
import math

import pytest

from runtime.launch.env import LaunchError, cache_cleared
from submission import report as rep
from submission import slurm


# ------------------------------------------------------------------------------ the env accessor

def test_cache_cleared_reads_run_sub_word():
    assert cache_cleared({}) is None
    assert cache_cleared({"PRESTO_CACHE_CLEAR": "1"}) is True
    assert cache_cleared({"PRESTO_CACHE_CLEAR": "0"}) is False
    with pytest.raises(LaunchError, match="PRESTO_CACHE_CLEAR='yes'"):
        cache_cleared({"PRESTO_CACHE_CLEAR": "yes"})


# ------------------------------------------------------------------------------ report


def _run(name, t):
    return rep.RunResult(name, None, "success" if t is not None else "aborted",
                         time_to_train_s=t)


def test_olympic_mean_counts_failed_runs_as_not_converged():
    runs = [_run(f"r{i}", t) for i, t in enumerate([10.0, 12.0, 11.0, 30.0, 9.0])]
    o = rep.olympic_mean(runs)
    assert o["score_s"] == pytest.approx((10 + 11 + 12) / 3) and o["dropped"] == ["r4", "r3"]
    o = rep.olympic_mean(runs[:4] + [_run("bad", None)])
    assert o["score_s"] == pytest.approx((11 + 12 + 30) / 3) and o["dropped"] == ["r0", "bad"]
    o = rep.olympic_mean(runs[:3] + [_run("bad1", None), _run("bad2", None)])
    assert o["score_s"] is None and "2 of 5 runs did not converge" in o["note"]
    o = rep.olympic_mean(runs[:2])
    assert o["score_s"] is None and "2 run(s): olympic scoring needs at least 3" in o["note"]
    assert o["mean_of_converged_s"] == 11.0
    assert math.isclose(rep.olympic_mean([_run(f"r{i}", 1.0 + i) for i in range(10)])["score_s"], 5.5)


def test_a_directory_of_plain_runs_lists_the_failed_ones_with_their_reason(tmp_path):
    """`report --logs results/`: a run directory whose launch failed before the MLPerf log
    started (no mlperf_bert.log) is listed as failed - with its ranks' recorded reason, or the
    launcher's line - never skipped; what lies inside a run directory is not a run."""
    ok = tmp_path / "config_A_seed1_20261201_120000"
    ok.mkdir()
    (ok / "mlperf_bert.log").write_text(":::MLLOG " + json.dumps(
        {"key": "seed", "value": 1, "time_ms": 0, "metadata": {}}) + "\n")
    (ok / "ranks").mkdir()
    srun = tmp_path / "config_A_seed2_20261201_120100"
    srun.mkdir()
    (srun / "launcher.log").write_text("srun: error: Unable to allocate resources\n"
                                       "srun: fatal: Could not establish a configuration source\n")
    cuda = tmp_path / "config_A_seed3_20261201_120200"
    (cuda / "ranks").mkdir(parents=True)
    for r in (0, 1):
        (cuda / "ranks" / f"rank_{r:05d}.json").write_text(json.dumps(
            {"rank": r, "exit": 2, "state": "failed",
             "reason": "device 'cuda' asked for, but torch sees no CUDA device"}))
    (tmp_path / "notes").mkdir()                       # not a run directory: not listed
    runs = {r.name: r for r in rep.find_runs(tmp_path)}
    assert list(runs) == [f"{ok.name}/mlperf_bert.log", srun.name, cuda.name]   # in order
    assert runs[srun.name].status == "failed" and "srun: fatal: Could not establish" in \
        runs[srun.name].reason and runs[srun.name].log is None
    assert runs[cuda.name].exit_code == 2 and runs[cuda.name].reason.endswith(
        "rank 0 exit 2: device 'cuda' asked for, but torch sees no CUDA device")
    assert "no MLPerf log" in runs[cuda.name].reason


# ------------------------------------------------------------------------------ status


def test_parse_slurm_minutes():
    f = slurm.parse_slurm_minutes
    assert [f("30"), f("1:30:00"), f("2-00:00:00"), f("45:30"), f("1-12")] == [30, 90, 2880, 46, 2160]
    assert f("UNLIMITED") is None and f("infinite") is None


def test_the_ranks_silence_kineto_unless_the_user_set_its_level():
    from submission.train import KINETO_QUIET, quiet_profiler
    env: dict = {}
    quiet_profiler(env)
    assert env == {"KINETO_LOG_LEVEL": KINETO_QUIET} and int(KINETO_QUIET) > 5   # above USDT
    env = {"KINETO_LOG_LEVEL": "4"}
    quiet_profiler(env)
    assert env == {"KINETO_LOG_LEVEL": "4"}


def test_the_allocator_setting_follows_the_graph_mode(tmp_path, capsys):
    """Growable segments for eager runs; under CUDA graphs the default allocator (replays of
    captured NCCL collectives have hung with expandable segments) - decided from the command
    line before torch loads; a value the user set wins, with a warning under graphs."""
    from submission.train import set_allocator
    cfg = "submission/configs/config_CPU_1x2x32x1.toml"
    gpu = [f"--set={o}" for o in ("system.device=cuda", "data.shapes=static",
                                  "train.precision=bf16", "optim.backend=auto")]
    env: dict = {}
    set_allocator(["--config", cfg, *gpu], env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for mode in ("full", "encoder"):
        env = {}
        set_allocator(["--config", cfg, "--set", f"train.cuda_graphs={mode}", *gpu], env)
        assert env == {}
        set_allocator([f"--config={cfg}", f"--set=train.cuda_graphs={mode}", *gpu], env)
        assert env == {}
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    set_allocator(["--config", cfg, "--set", "train.cuda_graphs=full", *gpu], env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert "pytorch/pytorch#158029" in capsys.readouterr().err
    env = {}
    set_allocator(["--config", str(tmp_path / "missing.toml")], env)  # main() says why
    assert env == {}
