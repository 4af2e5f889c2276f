"""Each benchmark's row run end to end in this process, its expensive measurement (a training
run, a rank launch, a test bed, a pip resolve, a data build) replaced by a canned result: its
command line, cases, record, table, goals and exit status as ``python -m bench.X`` runs them.
The measurements themselves: each benchmark's own tests (the cheap ones run for real:
tests/unit/test_bench_convert_crc.py, test_bench_balance.py; tests/e2e/test_bench_tta_e2e.py)
and the records in bench/results/."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest


def run_record(tmp_path: Path, status: str = "success", samples: int | None = 640,
               **extra) -> dict:
    """What bench.common.run_runtime returns for a run (its run directory made)."""
    run_dir = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps(
        {"kind": "step", "step": 1, "samples": 32, "loss": 7.0, "clip_coef": 0.5,
         "grad_norm": 2.0}) + "\n")
    ok = status == "success"
    return {"status": status, "time_to_target_s": 10.0 if ok else None, "run_time_s": 10.0,
            "samples_to_target": samples if ok else None, "samples": samples or 64,
            "eval_accuracy": 0.2, "eval_history": [[320, 0.05, 5.0], [640, 0.2, 10.0]],
            "throughput_samples_per_s": 64.0, "padding_efficiency": 0.5, "rc": 0 if ok else 1,
            "wall_s": 11.0, "run_dir": str(run_dir), "console": str(run_dir) + ".out",
            **extra}


def fake_runtime(tmp_path, status="success"):
    def run_runtime(config, seed, overrides, workdir, timeout=None, name="runtime"):
        return run_record(tmp_path, status, seed=seed, system=name, overrides=overrides)
    return run_runtime


def record_of(path: Path) -> dict:
    rec = json.loads(path.read_text())
    assert list(rec)[:5] == ["benchmark", "command", "commit", "machine", "date"]
    return rec


def test_clip_modes(tmp_path, monkeypatch, capsys):
    from bench import clip_modes
    monkeypatch.setattr(clip_modes, "run_runtime", fake_runtime(tmp_path))
    out = tmp_path / "rec.json"
    argv = ["--modes", "global_after,none", "--seeds", "1,2", "--workdir", str(tmp_path / "w"),
            "--out", str(out)]
    assert clip_modes.main(argv) == 0
    rec = record_of(out)
    assert [(r["seed"], r["clip_mode"]) for r in rec["runs"]] == [
        (1, "global_after"), (1, "none"), (2, "global_after"), (2, "none")]
    assert rec["runs"][0]["clip_mean"] == 0.5 and rec["goals_met"] == {
        "every_mode_reaches_the_target": True}
    assert "| none | 2 | success | 10.0 | 640 |" in capsys.readouterr().out
    monkeypatch.setattr(clip_modes, "run_runtime", fake_runtime(tmp_path, "aborted"))
    assert clip_modes.main(argv) == 1          # a run that missed the target: exit 1


def test_convergence(tmp_path, monkeypatch, capsys):
    from bench import convergence
    monkeypatch.setattr(convergence, "run_runtime", fake_runtime(tmp_path))
    out = tmp_path / "rec.json"
    assert convergence.main(["--seeds", "1,2", "--variant", "a=", "--variant",
                             "b=train.seed=3", "--workdir", str(tmp_path / "w"),
                             "--out", str(out)]) == 0
    rec = record_of(out)
    assert rec["variants"] == {"a": [], "b": ["train.seed=3"]}
    assert set(rec["runs"]) == {"a", "b"} and set(rec["runs"]["b"]) == {"1", "2"}
    assert rec["verdicts"]["b"]["verdict"] == "same" and rec["runs"]["a"]["1"]["loss_curve"]
    printed = capsys.readouterr().out
    assert "seed 2            a:  success" in printed and "b: same - seed 1" in printed
    assert json.loads(printed.strip().splitlines()[-1]) == {"benchmark": "convergence",
                                                             "verdicts": {"b": "same"}}


def test_time_to_accuracy_its_sweep_and_its_ablation(tmp_path, monkeypatch, capsys):
    from bench import time_to_accuracy as tta

    def baseline(config, seed, overrides, workdir, nproc, lr=None, timeout=None,
                 name="baseline"):
        return run_record(tmp_path, samples=704, seed=seed, system=name, lr=lr or 2e-3)
    monkeypatch.setattr(tta, "run_runtime", fake_runtime(tmp_path))
    monkeypatch.setattr(tta, "run_baseline", baseline)
    common = ["--seeds", "1,2", "--workdir", str(tmp_path / "w")]
    out = tmp_path / "tta.json"
    assert tta.main([*common, "--out", str(out)]) == 0
    rec = record_of(out)
    assert rec["benchmark"] == "time_to_accuracy" and rec["order"] == ["runtime", "baseline"]
    assert rec["ratio_samples"] == pytest.approx(1.1) and rec["runtime"]["reached"] == 2
    assert "ratio_time (baseline/runtime) = 1.000" in capsys.readouterr().out

    assert tta.main([*common, "--sweep-baseline-lr", "1e-3,2e-3", "--out", str(out)]) == 0
    rec = record_of(out)
    assert rec["benchmark"] == "baseline_lr_sweep" and rec["chosen_lr"] == 1e-3
    assert rec["command"].startswith("python -m bench.time_to_accuracy --seeds 1,2")
    assert "chosen lr: 0.001" in capsys.readouterr().out

    assert tta.main([*common, "--ablation", "best,ddp_sync", "--out", str(out)]) == 0
    rec = record_of(out)
    assert rec["benchmark"] == "ablation" and rec["order"] == [["best", "ddp_sync"],
                                                               ["ddp_sync", "best"]]
    assert rec["variants"]["ddp_sync"]["overrides"] == ["train.grad_sync=ddp"]
    assert rec["variants"]["best"]["reached"] == 2


def test_noise_check(tmp_path, monkeypatch, capsys):
    from bench import noise_check
    run_dir = tmp_path / "run"
    for step in (50, 100):
        (run_dir / "checkpoints" / f"step_{step}").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(
        {"kind": "step", "step": s, "noise_scale": 60.0, "noise_scale_window_samples": 256,
         "grad_sq_small": 2.0, "grad_sq_big": 1.2}) + "\n" for s in range(1, 101)))
    monkeypatch.setattr(noise_check, "draw", lambda data, n, seed: ([[0, 0]] * 16, {}))
    monkeypatch.setattr(noise_check, "batches", lambda pairs, shards: pairs)
    figures = {"b_simple": 50.0, "b_simple_se": 5.0, "b_simple_non_embedding": 40.0,
               "per_example_s": 0.1}
    monkeypatch.setattr(noise_check, "per_example", lambda ck, batches, check: figures)
    out = tmp_path / "rec.json"
    assert noise_check.main(["--run-dir", str(run_dir), "--horizons", "0,256",
                             "--workdir", str(tmp_path / "w"), "--out", str(out)]) == 0
    rec = record_of(out)
    assert [c["step"] for c in rec["checkpoints"]] == [50, 100]
    assert rec["checkpoints"][1]["ratio"] == pytest.approx(1.2) and rec["goal_met"]
    assert set(rec["replayed_worst_ratio"]) == {"0", "256"}
    assert rec["goals_met"] == {"within_goal_after_the_first_horizon": True}
    printed = capsys.readouterr().out
    assert "| 100 | 50.0 ± 5.0 | 40.0 | 60.0 (256) | 1.20 |" in printed
    assert noise_check.main(["--examples", "10"]) == 2     # the method needs >= 256


def test_batch_scaling_and_its_calibration(tmp_path, monkeypatch, capsys):
    from bench import batch_scaling
    monkeypatch.setattr(batch_scaling, "ensure_data", lambda path: None)
    monkeypatch.setattr(batch_scaling, "run_runtime", fake_runtime(tmp_path))
    out = tmp_path / "rec.json"
    common = ["--seeds", "1", "--optimizers", "lamb", "--workdir", str(tmp_path / "w"),
              "--out", str(out)]
    assert batch_scaling.main([*common, "--batches", "32,64", "--rules", "linear,sqrt"]) == 0
    rec = record_of(out)
    assert [(r["batch"], r["rule"]) for r in rec["runs"]] == [(32, "linear"), (64, "linear"),
                                                               (64, "sqrt")]
    assert rec["complete"] and rec["samples_table"] and rec["base_lr"]["lars"] == 2.0
    assert "| lamb | sqrt | 64 | 1/1 |" in capsys.readouterr().out
    assert batch_scaling.main([*common, "--reuse", str(out), "--batches", "32,64"]) == 0
    assert all(r.get("reused") for r in record_of(out)["runs"])
    assert batch_scaling.main([*common, "--calibrate", "--base-lr", "lamb=0.01"]) == 0
    cal = record_of(out)["calibration"]["lamb"]
    assert [s["lr"] for s in cal["sweep"]] == [0.005, 0.01, 0.02]
    assert batch_scaling.main([*common, "--rules", "cubic"]) == 2


def test_hpo_batch(tmp_path, monkeypatch, capsys):
    from bench import hpo_batch
    monkeypatch.setattr(hpo_batch, "ensure_data", lambda path: None)
    monkeypatch.setattr(hpo_batch, "run_runtime", fake_runtime(tmp_path))

    def search(o, args, workdir):
        best = {"number": 1, "value": 500.0, "params": {"optim.lr": 0.05}}
        return {"optimizer": o, "trials": [{**best, "origin": "baseline", "value": 900.0,
                                            "number": 0, "state": "COMPLETE"}, best],
                "best": best, "first_beating_default": 1}
    monkeypatch.setattr(hpo_batch, "search", search)
    out = tmp_path / "rec.json"
    assert hpo_batch.main(["--batch", "64", "--seeds", "1", "--workdir", str(tmp_path / "w"),
                           "--out", str(out)]) == 0
    rec = record_of(out)
    assert rec["complete"] and set(rec["searches"]) == {"adamw", "lamb"}
    assert set(rec["confirmation"]) == {f"{o}/{s}" for o in ("adamw", "lamb")
                                        for s in ("linear", "sqrt", "searched")}
    assert rec["answer"].startswith(("yes", "no"))
    assert "| lamb | searched | 1/1 |" in capsys.readouterr().out


def test_step_time(tmp_path, monkeypatch, capsys):
    from bench import step_time
    speed = {"a": 0.10, "b": 0.08}
    monkeypatch.setattr(step_time, "run_once", lambda tree, config, over, steps, ranks, work: [
        {"step": s, "time_s": s * speed[tree.name]} for s in range(1, steps + 1)])
    for t in speed:
        (tmp_path / t).mkdir()
    out = tmp_path / "rec.json"
    assert step_time.main(["--trees", f"{tmp_path / 'a'},{tmp_path / 'b'}", "--config", "c.toml",
                           "--steps", "20", "--skip", "5", "--rounds", "2",
                           "--out", str(out)]) == 0
    rec = record_of(out)
    assert rec["seconds_per_step"]["A"] == pytest.approx([0.1, 0.1])
    assert rec["ratio_B_over_A"]["median"] == pytest.approx(0.8)
    assert "B/A: median 0.800" in capsys.readouterr().out
    assert step_time.main(["--trees", "a", "--config", "c.toml"]) == 2


def test_shard(tmp_path, monkeypatch, capsys):
    from bench import shard
    mode = {"median_s": 0.1, "min_s": 0.09, "without_zeroing_median_s": 0.08,
            "norm_and_partials_allreduce_median_s": 0.001, "parameter_gather_median_s": 0.01,
            "memory": {"elements": 4.4e6, "optimizer_state_bytes": 2 ** 25}}
    result = {"models": {"cpu": {"none": mode, "world": mode, "ratio_median": 1.0,
                                 "ratio_min": 1.0, "ratio_without_zeroing_median": 1.0,
                                 "state_ratio": 0.5}},
              "collectives": [{"op": "allreduce", "mib": m, "median_s": 0.01, "min_s": 0.01}
                              for m in (8, 32)], "world_size": 2}
    launched, real = [], subprocess.run

    def launch(cmd, **kw):
        if cmd[0] == "git":                  # the record's commit
            return real(cmd, **kw)
        launched.append(cmd)
        return subprocess.CompletedProcess(cmd, rc, "RESULT " + json.dumps(result), "boom")
    rc = 0
    monkeypatch.setattr(shard.subprocess, "run", launch)
    out = tmp_path / "rec.json"
    assert shard.main(["--models", "cpu", "--reps", "2", "--out", str(out)]) == 0
    assert launched[0][-5:] == ["--worker", "--models", "cpu", "--reps", "2"]
    rec = record_of(out)
    assert rec["models"]["cpu"]["state_ratio"] == 0.5 and rec["world_size"] == 2
    assert "| allreduce | 10.0 | 10.0 |" in capsys.readouterr().out
    rc = 1
    assert shard.main(["--models", "cpu", "--out", str(out)]) == 1
    assert "the ranks failed (exit 1)" in capsys.readouterr().err
    assert shard.main(["--models", "gpt"]) == 2


def test_optim(tmp_path, monkeypatch, capsys):
    from bench import optim
    monkeypatch.setattr(optim, "measure_bandwidth", lambda: {
        "copy_GBps": 10.0, "inplace_scale_GBps": 12.0, "read_sum_GBps": 20.0, "threads": 2})

    def worker(model, optimizer, impl, reps):
        if impl == "timm":
            return {"model": model, "optimizer": optimizer, "impl": impl, "error": "no timm"}
        return {"model": model, "optimizer": optimizer, "impl": impl, "elements": 10 ** 6,
                "step_min_s": 0.005 if impl.startswith("presto") else 0.02,
                "step_median_s": 0.03}
    monkeypatch.setattr(optim, "run_worker", worker)
    out = tmp_path / "rec.json"
    assert optim.main(["--models", "tiny", "--only", "lamb", "--out", str(out)]) == 0
    rec = record_of(out)
    assert len(rec["results"]) == 7 and rec["bandwidth_end"]["copy_GBps"] == 10.0
    assert rec["goals"]["tiny"]["lamb_2x_faster_than_every_peer"]
    assert rec["goals_met"] == {"lamb_within_1.5x_limit": True,
                                "lamb_2x_faster_than_every_peer": True,
                                "adamw_at_least_as_fast_as_torch_fused": None}
    assert "no timm" in capsys.readouterr().out


class FakeBed:
    def __init__(self, rate=None):
        self.rates = [rate]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def set_rate(self, rate):
        self.rates.append(rate)


def test_overlap(tmp_path, monkeypatch, capsys):
    import bench.netns
    from bench import overlap
    monkeypatch.setattr(bench.netns, "Testbed", FakeBed)
    row = {"step_s": 0.2, "backward_s": 0.1, "comm_s": 0.1, "buckets": 2,
           "end_bytes_frac": 0.2, "overlap_frac": 0.9, "exposed_tl_s": 0.01}
    ranks = {"calibration": {"grad_bytes": 4e6, "allreduce_full_s": 0.1},
             "variants": {v: {"comm": dict(row, step_s=0.21), "nocomm": row}
                          for v in overlap.VARIANTS}}
    monkeypatch.setattr(overlap, "run_ranks", lambda *a, **k: ranks)
    out = tmp_path / "rec.json"
    assert overlap.main(["--rate-mbit", "100", "--workdir", str(tmp_path / "w"),
                         "--out", str(out)]) == 0
    rec = record_of(out)
    assert rec["rate_mbit"] == 100 and rec["variants"]["ddp"]["exposed_s"] == pytest.approx(0.01)
    assert rec["goals_met"]["bucket_before_within_5pct_of_global_after"] is True
    assert "| buckets/none | 2 | 210 | 200 | 10 |" in capsys.readouterr().out
    assert overlap.main(["--variants", "ddp,nccl"]) == 2


def test_tune(tmp_path, monkeypatch, capsys):
    import bench.netns
    from bench import tune
    monkeypatch.setattr(bench.netns, "Testbed", FakeBed)
    plan = tmp_path / "plan" / "plan.json"
    plan.parent.mkdir()
    plan.write_text("{}")

    def tuner(bed, args, overrides, work, tag, steps, arbitrate=True):
        return {"profile": {"backward_s": 0.5}, "plan": str(plan),
                "allreduce_model": {"segments": [[0, 1e-4, 1e-9]]}}
    goals = {"all_within_15pct": True, "recommended_never_measurably_slower": True}
    monkeypatch.setattr(tune, "tuner", tuner)
    monkeypatch.setattr(tune, "full_allreduce_s", lambda rec: 0.5)
    monkeypatch.setattr(tune, "validate", lambda *a: {})
    monkeypatch.setattr(tune, "compare", lambda rec, measured: {"rows": [], "goals": goals})
    monkeypatch.setattr(tune, "table", lambda res: f"table of {res['shape']} x{res['ratio_asked']}")
    out = tmp_path / "rec.json"
    assert tune.main(["--shapes", "cpu", "--ratios", "1,3", "--workdir", str(tmp_path / "w"),
                      "--out", str(out)]) == 0
    rec = record_of(out)
    assert rec["benchmark"] == "tune_validation" and rec["command"].startswith(
        "python -m bench.tune --shapes cpu")
    assert [(r["shape"], r["ratio_asked"], r["rate_mbit"]) for r in rec["results"]] == [
        ("cpu", 1.0, 400.0), ("cpu", 3.0, 130.0)]
    assert rec["goals_met"] == {k: True for k in goals}
    printed = capsys.readouterr().out
    assert "table of cpu x1.0" in printed and "table of cpu x3.0" in printed

    def no_bed(rate=None):
        raise bench.netns.TestbedError("the test bed needs root")
    monkeypatch.setattr(bench.netns, "Testbed", no_bed)
    assert tune.main(["--shapes", "cpu", "--workdir", str(tmp_path / "w")]) == 2
    assert "bench.tune: the test bed needs root" in capsys.readouterr().err


def test_faults(tmp_path, monkeypatch, capsys):
    from bench import faults
    monkeypatch.setattr(faults, "launch", lambda *a, **k: None)
    monkeypatch.setattr(faults, "wait", lambda proc: (1, "", 0.0))
    seen = []

    def fault(kind, launcher, work, data, ref):
        seen.append((kind, launcher, work.name))
        return {"detected": True, "exit": faults.EXPECT[kind], "seconds": 1.5,
                "samples_lost": 16, "since_checkpoint": 16, "equal": kind != "corrupt",
                "note": "canned"}
    monkeypatch.setattr(faults, "MEASURE", {k: fault for k in faults.FAULTS})
    out = tmp_path / "rec.json"
    assert faults.main(["--runs", "2", "--faults", "kill,int2,corrupt", "--launchers",
                        "mpiexec,torchrun", "--data", str(tmp_path), "--out", str(out)]) == 0
    assert seen[:4] == [("kill", "mpiexec", "kill0"), ("int2", "mpiexec", "int20"),
                        ("int2", "torchrun", "int2_torchrun0"), ("corrupt", "mpiexec",
                                                                "corrupt0")]
    rec = record_of(out)
    assert list(rec["rows"]) == ["kill", "int2", "int2@torchrun", "corrupt"]
    assert rec["rows"]["int2@torchrun"]["detected"] == 2 and len(rec["results"]["kill"]) == 2
    assert rec["goals_met"] == {"every_fault_detected": True,
                                "lost_within_checkpoint_interval": True,
                                "every_resume_equal": False}
    assert "| int2@torchrun | 2 | 2/2 | 1.5 | 1.5 | 16 | 2/2 |" in capsys.readouterr().out
    assert faults.main(["--faults", "kill,meteor"]) == 2


def test_gpu_wheels(tmp_path, monkeypatch, capsys):
    from bench import gpu_wheels
    torch = {"name": "torch", "version": "2.13.0", "file": "torch.whl"}
    cudnn = {"name": "nvidia-cudnn-cu13", "version": "9", "file": "cudnn.whl"}
    sets = {True: [torch, cudnn], False: [torch]}
    monkeypatch.setattr(gpu_wheels, "resolve", lambda req, python, glibc, deps=True: {
        "command": "pip", "returncode": 0, "packages": sets[deps], "error": ""})
    out = tmp_path / "rec.json"
    assert gpu_wheels.main(["--out", str(out)]) == 0
    rec = record_of(out)
    assert rec["resolves"] and rec["cuda_packages"] == ["nvidia-cudnn-cu13==9"]
    printed = capsys.readouterr().out
    assert "torch 2.13.0: the CUDA build (1 CUDA packages: nvidia-cudnn-cu13==9)" in printed
    assert json.loads(printed.strip().splitlines()[-1]) == {"resolves": True, "packages": 3,
                                                             "cuda_packages": 1}
    sets[True] = [torch]                               # the CPU wheel: exit 1
    assert gpu_wheels.main([]) == 1

    def no_pip(*a, **k):
        raise OSError("no pip")
    monkeypatch.setattr(gpu_wheels, "resolve", no_pip)
    assert gpu_wheels.main([]) == 2


def test_prepare_and_prepare_mlperf(tmp_path, monkeypatch, capsys):
    from bench import prepare, prepare_mlperf
    totals = iter([3.0, 2.0])
    monkeypatch.setattr(prepare, "run_once", lambda workers, sources, debian: {
        "seconds": {k: 0.5 for k in prepare.PHASES}, "total_s": next(totals),
        "train_sequences": 900, "eval_sequences": 100, "train_tokens": 10 ** 5,
        "documents": 10, "parameters": {}})
    out = tmp_path / "prepare.json"
    assert prepare.main(["--repeat", "2", "--results", str(out)]) == 0
    rec = record_of(out)
    assert rec["all_totals_s"] == [3.0, 2.0] and rec["total_s"] == 2.0
    assert rec["sequences_per_s"] == 500.0
    assert "1,000 sequences/s" not in capsys.readouterr().out

    monkeypatch.setattr(prepare_mlperf, "local_documents",
                        lambda sources: [["A sentence.", "Another one."]] * 3)
    monkeypatch.setattr(prepare_mlperf, "run_once", lambda text, workers, vocab: {
        "total_s": 2.0, "seconds": {}, "train_sequences": 1000, "eval_candidates": 50,
        "documents": 3})
    out = tmp_path / "mlperf.json"
    assert prepare_mlperf.main(["--repeat", "1", "--parts", "1", "--part-mb", "0.001",
                                "--eval-mb", "0.001", "--results", str(out)]) == 0
    rec = record_of(out)
    assert rec["median_s"] == 2.0 and rec["text_mb"] > 0 and rec["runs"][0]["documents"] == 3
    assert "at this rate:" in capsys.readouterr().out


def test_kernel_count(tmp_path, monkeypatch, capsys):
    from bench import kernel_count

    def count(*overrides, cuda_autocast=True):
        layers = int(next(o for o in overrides if o.startswith("model.num_hidden_layers="))
                     .split("=")[1])
        kernels = 100 * layers + (50 if "train.precision=bf16" in overrides else 20) \
            + (0 if cuda_autocast else 7)
        return {"kernels": kernels, "ops": kernels - 10, "by_op": {"mm": layers},
                "by_category": {"gemm": {"kernels": kernels}},
                "by_phase": {"step": {"kernels": kernels}}, "seconds": 0.1}
    monkeypatch.setattr(kernel_count, "count_step_kernels", count)
    out = tmp_path / "rec.json"
    assert kernel_count.main(["--layers", "4", "--small-layers", "2", "--widths", "256",
                              "--modes", "bf16_autocast,bf16_master", "--out", str(out)]) == 0
    rec = record_of(out)
    assert list(rec["counts"]) == ["bf16_autocast", "bf16_master"]
    c = rec["counts"]["bf16_autocast"]
    assert c["per_layer"] == 100 and c["outside_layers"] == 50
    assert c["width_checks"] == {"256": {"kernels": 450, "ops": 440, "same_ops": True}}
    assert rec["cpu_autocast_lists"]["kernels"] == 457 and rec["vs_h200"]["counted"] == 450
    assert rec["best"] == {"mode": "bf16_master", "kernels": 420, "goal": 1000, "met": True}
    printed = capsys.readouterr().out
    assert "best: bf16_master, 420 kernels (goal <= 1000)" in printed
    assert json.loads(printed.strip().splitlines()[-1]) == {
        "benchmark": "kernel_count", "kernels": {"bf16_autocast": 450, "bf16_master": 420},
        "width_checks_same": True}


def test_device_time(tmp_path, monkeypatch, capsys):
    """The row with its counting (bench.device_cases' child processes, an hour) replaced by one
    canned step: a GEMM in the encoder, LAMB's two passes, the buffer's norm - the pricing,
    the depth and batch extrapolations, a real record's validation case, the node's
    projection, the cuts, the profiles file and the tables all run."""
    from bench import device_time
    from bench.op_cost import Cost

    def rows(layers: int) -> list:
        gemm = Cost("gemm", 6e6 * layers, 2e11 * layers, "bf16", 512).to_list()
        return [["step", "gemm", "mm", 3 * layers, "encoder", [gemm] * (3 * layers)],
                ["step", "elementwise", "gelu", layers, "encoder",
                 [Cost("memory", 4e7).to_list()] * layers],
                ["step", "reduction", "linalg_vector_norm", 1, "gradbuf",
                 [Cost("memory", 6.7e8).to_list()]],
                ["optimizer", "optimizer", "cpp_fused_sum_0", 1, "",
                 [Cost("memory", 7.4e9).to_list()]],
                ["optimizer", "optimizer", "cpp_fused_sub_0", 1, "",
                 [Cost("memory", 6.05e9).to_list()]]]
    trees = []

    def count(spec, tree):
        trees.append(tree)
        return {"steps": [rows(spec.get("layers", 2))]}
    monkeypatch.setattr(device_time, "count", count)
    monkeypatch.setattr(device_time, "seq512", lambda: tmp_path)
    monkeypatch.setattr(device_time, "data_stats",
                        lambda d: {"mean": 128.0, "mean_sq": 2.0e4, "longest": 512})
    real = device_time.validation_cases
    monkeypatch.setattr(device_time, "validation_cases",
                        lambda: [v for v in real() if v.case.target is None
                                 and v.case.name.startswith("optimizer lamb")][:1])
    out, profiles = tmp_path / "rec.json", tmp_path / "profiles.json"
    assert device_time.main(["--gpus", "h100", "--modes", "bf16_master_layers", "--out",
                             str(out), "--profiles", str(profiles)]) == 0
    rec = record_of(out)
    (v,) = rec["validation"]
    assert v["gpu"] == "h200" and v["measured_ms"] > 0 and v["predicted_ms"] > 0
    assert rec["validation_cases"] == 1 and rec["validation_met"] == int(v["met"])
    p = rec["predictions"]["bf16_master_layers"]["h100"]
    assert {"encoder GEMMs", "optimizer", "gradient buffer"} <= set(p["rows2"]["by_part"])
    assert p["throughput"]["local_batch"] == device_time.THROUGHPUT_BATCH["h100"]
    assert "3f8dd61" in trees     # the cuts count the best mode in the tree before the copy
    assert rec["cuts"]["h100"]["what_if"]["lamb_stored_update_fp32_ms"] == pytest.approx(0.0,
                                                                                         abs=1e-9)
    assert rec["node8"]["nvidia_step_ms"] == 17.5
    assert "bf16_master_layers" in json.loads(profiles.read_text())["profiles"]["h100"]
    printed = capsys.readouterr().out
    assert "Validation" in printed and "The cuts" in printed and "8 GPUs of a node" in printed
