"""Faults, injected and timed: is each one detected, how fast, what is lost, and does a resumed
run end where the uninterrupted one does.

    python -m bench.faults [--runs 3] [--data data/cpu128]
                           [--faults kill,sigterm,corrupt,nan,fp16,swap,diskfull]
                           [--out bench/results/faults.json]

A tiny BERT (1 layer, hidden 64) on 2 MPI ranks, launched by run_and_time.sh as a user would,
40 steps of 16 samples, a checkpoint every 5 steps (train.checkpoint_every_samples=80), a
logging point every step (so the step a fault hits is known exactly), evaluations every 10
steps. First one uninterrupted reference run (its checkpoints all kept); then per round:

  kill     SIGKILL to rank 1 at step 13 (a crash, the OOM killer); then the same command again
  sigterm  SIGTERM to run_and_time.sh at step 13 (kill, systemd, a scheduler); then again
  corrupt  a train shard whose checksum matches but holds a token id >= the vocabulary (row 5
           of the last shard: read late in the epoch)
  nan      NaN activations from step 23 on rank 0 (bench.fault_rank): a NaN storm in fp32
  fp16     fp16 loss scaling (simulated on CPU) with inf gradients from step 23 on rank 0: an
           overflow storm the loss scaler cannot end
  swap     SIGTERM at step 13 (a checkpoint), then the rerun with ``optim.name=adamw`` on LAMB's
           checkpoint (a careless resume: it once loaded LAMB's moments into AdamW and trained
           on); then the unchanged command
  diskfull the run directory on a 256 MiB tmpfs (``mount -t tmpfs``: root) that a filler file
           fills at step 13: the next log or checkpoint write fails; then the filler goes and
           the unchanged command runs again (a full disk used to leave half a line that the
           resume record was glued to)

For each: detected (the exit status the fault must give - 3, 4, 2, 3, 3, 2, 3 - and the message
naming the rank, the file or the divergence), seconds from the fault to the end of the run,
samples lost (trained but not in the checkpoint the run continues from, or, for the storms,
since the checkpoint kept), and whether the result equals the uninterrupted run: for kill and
sigterm every step's loss and gradient norm and every evaluation of the resumed run, bit for
bit; for the storms the checkpoint kept equals the reference's at that step (its model and
optimizer files hash the same); corrupt trains nothing, so n/a; swap must train and log
nothing (its step records and MLPerf log unchanged), and the unchanged command then resumes
equal to the uninterrupted run.

Not a test: run it under the CPU lock (``flock -x /tmp/presto_cpu.lock python -m
bench.faults``). Prints a table and a final JSON line; writes the record to ``--out``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import finish, record

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "submission" / "configs" / "config_CPU_1x2x32x1.toml"
FAULTS = ("kill", "sigterm", "corrupt", "nan", "fp16", "swap", "diskfull")
EXPECT = {"kill": 3, "sigterm": 4, "corrupt": 2, "nan": 3, "fp16": 3, "swap": 2, "diskfull": 3}
GBS, EVERY, HIT, STORM = 16, 80, 13, 23


def overrides(data: Path) -> list[str]:
    return [f'data.data_dir="{data}"', "model.num_hidden_layers=1", "model.hidden_size=64",
            "model.num_attention_heads=2", "model.intermediate_size=128",
            f"train.global_batch_size={GBS}", "train.eval_iter_start_samples=160",
            "train.eval_iter_samples=160", "train.max_steps=40", "train.log_every_steps=1",
            "data.eval_batch_size=32", "schedule.warmup_steps=5", "schedule.total_steps=200",
            "train.target_mlm_accuracy=0.99", f"train.checkpoint_every_samples={EVERY}",
            "train.max_nonfinite_steps=3", "system.dist_timeout_s=30"]


def launch(run_dir: Path, extra: list[str], data: Path) -> subprocess.Popen:
    env = dict(os.environ, CONFIG=str(CONFIG), SEED="7", RUN_DIR=str(run_dir))
    return subprocess.Popen(["bash", str(ROOT / "run_and_time.sh"), "--", *overrides(data),
                             *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def launch_faulty(run_dir: Path, fault: str, data: Path) -> subprocess.Popen:
    """mpiexec directly, with bench.fault_rank as each rank's entry point."""
    cmd = [str(Path(sys.executable).parent / "mpiexec"), "-n", "2", sys.executable, "-m",
           "bench.fault_rank", "--fault", fault, "--from-step", str(STORM), "--",
           "--config", str(CONFIG), "--set", "train.seed=7", "--set",
           f"train.output_dir={run_dir}"]
    for o in overrides(data):
        cmd += ["--set", o]
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def wait(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str, float]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return -1, out + err + "\nHUNG", time.time()
    return proc.returncode, out + err, time.time()


def step_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    whole = text[:text.rfind("\n") + 1]   # a line being written, or cut short by a full disk
    return [r for r in map(json.loads, whole.splitlines()) if r["kind"] == "step"]


def trajectory(run_dir: Path) -> tuple[dict, dict]:
    """step -> (loss, grad_norm) and samples -> eval accuracy. A step or evaluation done
    twice (a killed attempt's work after its last checkpoint, done again by the resumed one:
    a checkpoint taken right before an evaluation is evaluated again) keeps its last record."""
    steps, evals = {}, {}
    for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        if r["kind"] == "step":
            steps[r["step"]] = (r["loss"], r["grad_norm"])
        elif r["kind"] == "eval":
            evals[r["samples"]] = r["eval_accuracy"]
    return steps, evals


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout=300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        recs = step_records(run_dir)
        if recs and recs[-1]["step"] >= step:
            return
        time.sleep(0.05)
    raise RuntimeError(f"{run_dir}: step {step} never came (rc {proc.poll()})")


def resumed_from(run_dir: Path) -> dict:
    for line in (run_dir / "mlperf_bert.log").read_text().splitlines():
        if '"presto_resumed"' in line:
            return json.loads(line.split(":::MLLOG ", 1)[1])["metadata"]
    return {}


def manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / "checkpoint.json").read_text())


def same_state(a: Path, b: Path) -> bool:
    fa, fb = manifest(a)["files"], manifest(b)["files"]
    return all(fa[k]["sha256"] == fb[k]["sha256"] for k in ("model.safetensors", "optimizer.pt"))


# ------------------------------------------------------------------------------ faults

def fault_interrupt(kind: str, work: Path, data: Path, ref: Path) -> dict:
    run_dir = work / "run"
    proc = launch(run_dir, [], data)
    wait_for_step(run_dir, HIT, proc)
    if kind == "kill":
        pid = json.loads((run_dir / "ranks" / "rank_00001.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
    else:
        proc.send_signal(signal.SIGTERM)
    t0 = time.time()
    rc, text, t1 = wait(proc)
    trained = max(r["step"] for r in step_records(run_dir))
    words = (f"rank 1 (pid {pid}" in text and "killed by SIGKILL" in text) if kind == "kill" \
        else "stopping on signal" in text
    rc2, text2, _ = wait(launch(run_dir, [], data))
    res = resumed_from(run_dir)
    lost = (trained - int(res.get("step", 0))) * GBS
    want, got = trajectory(ref), trajectory(run_dir)
    return {"detected": rc == EXPECT[kind] and words, "exit": rc, "seconds": t1 - t0,
            "samples_lost": lost, "since_checkpoint": (trained % (EVERY // GBS)) * GBS,
            "resumed_exit": rc2, "equal": rc2 == 1 and got == want,
            "note": f"stopped at step {trained}, resumed from step {res.get('step')}"}


def fault_corrupt(work: Path, data: Path) -> dict:
    from loaders.shards import read_shard, write_checksums, write_shard
    bad = work / "data"
    shutil.copytree(data, bad)
    stats = json.loads((bad / "stats.json").read_text())
    rel = stats["train_shards"][-1]["file"]
    samples = read_shard(bad / rel)
    row = samples.input_ids[5].copy()
    row[-2] = 30522 + 77
    samples.input_ids[5] = row
    write_shard(bad / rel, samples)
    rels = [ln.split("  ", 1)[1] for ln in (bad / "checksums.sha256").read_text().splitlines()]
    write_checksums(bad, rels)
    run_dir = work / "run"
    t0 = time.time()
    rc, text, t1 = wait(launch(run_dir, [], bad))
    trained = len(step_records(run_dir))
    detected = rc == 2 and str(bad / rel) in text and "row 5" in text and trained == 0
    return {"detected": detected, "exit": rc, "seconds": t1 - t0, "samples_lost": 0,
            "since_checkpoint": 0, "equal": None, "note": "found at start-up, nothing trained"}


def fault_swap(work: Path, data: Path, ref: Path) -> dict:
    run_dir = work / "run"
    proc = launch(run_dir, [], data)
    wait_for_step(run_dir, HIT, proc)
    proc.send_signal(signal.SIGTERM)
    wait(proc)
    before = (len(step_records(run_dir)), (run_dir / "mlperf_bert.log").read_bytes())
    t0 = time.time()
    rc, text, t1 = wait(launch(run_dir, ["optim.name=adamw"], data))
    after = (len(step_records(run_dir)), (run_dir / "mlperf_bert.log").read_bytes())
    named = "optim.name: the checkpoint has 'lamb', this run 'adamw'" in text
    rc2, _, _ = wait(launch(run_dir, [], data))
    equal = rc2 == 1 and trajectory(run_dir) == trajectory(ref)
    return {"detected": rc == EXPECT["swap"] and named and after == before, "exit": rc,
            "seconds": t1 - t0, "samples_lost": 0, "since_checkpoint": 0,
            "resumed_exit": rc2, "equal": equal,
            "note": "refused before any rank trained" + ("" if after == before else
                                                          " - BUT the run directory changed")}


def fault_diskfull(work: Path, data: Path, ref: Path) -> dict:
    """The run directory's disk fills at step HIT; space freed, the same command again: exit 3
    naming the file and the checkpoint a rerun resumes from, then a resumed log whose every
    line parses and which the compliance checker passes, equal to the uninterrupted run."""
    disk = work / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(disk)], check=True)
    try:
        run_dir = disk / "run"
        proc = launch(run_dir, [], data)
        wait_for_step(run_dir, HIT, proc)
        with contextlib.suppress(OSError), open(disk / "filler", "wb") as f:
            while True:
                f.write(bytes(1 << 20))
        t0 = time.time()
        rc, text, t1 = wait(proc)
        trained = max(r["step"] for r in step_records(run_dir))
        words = "No space left" in text and "it resumes from" in text
        said = next((ln for ln in text.splitlines() if "No space left" in ln
                     or "no space left" in ln), text.strip().splitlines()[-1:])
        (disk / "filler").unlink()
        rc2, _, _ = wait(launch(run_dir, [], data))
        log = run_dir / "mlperf_bert.log"
        lines = [ln for ln in log.read_text().splitlines() if ":::MLLOG " in ln]
        whole = True
        for ln in lines:
            try:
                json.loads(ln.split(":::MLLOG ", 1)[1])
            except ValueError:
                whole = False
        res = resumed_from(run_dir) if whole else {}
        text_m = (run_dir / "metrics.jsonl").read_text()
        cut = [n for r in map(json.loads, text_m[:text_m.rfind("\n") + 1].splitlines())
               if r["kind"] == "resume" for n in r.get("notes", []) if "partial last" in n]
        repaired = [*([res["log_repaired"]] if res.get("log_repaired") else []), *cut]
        checker = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker",
                                  "--usage", "training", "--ruleset", "5.0.0", str(log)],
                                 capture_output=True, text=True, cwd=work)
        passed = checker.returncode == 0 and "SUCCESS" in checker.stdout + checker.stderr
        lost = (trained - int(res.get("step", 0))) * GBS
        equal = rc2 == 1 and whole and passed and trajectory(run_dir) == trajectory(ref)
        return {"detected": rc == EXPECT["diskfull"] and words, "exit": rc,
                "seconds": t1 - t0, "samples_lost": lost,
                "since_checkpoint": (trained % (EVERY // GBS)) * GBS, "resumed_exit": rc2,
                "equal": equal,
                "note": f"filled at step {trained}, resumed from step {res.get('step')}; "
                        f"log lines whole: {whole}, partial lines dropped: "
                        f"{'; '.join(repaired) or 'none'}, "
                        f"checker: {'SUCCESS' if passed else 'FAILED'}; said: {str(said)[:600]}"}
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fault_storm(kind: str, work: Path, data: Path, ref: Path) -> dict:
    run_dir = work / "run"
    rc, text, t1 = wait(launch_faulty(run_dir, kind, data))
    start = float((run_dir / "fault_start").read_text()) if (run_dir / "fault_start").exists() \
        else t1
    recs = step_records(run_dir)
    stop = recs[-1]["step"] if recs else 0
    from runtime.train.checkpoint import find_latest
    kept = find_latest(run_dir / "checkpoints")
    kept_step = kept.step if kept else 0
    reference = ref / "checkpoints" / kept.path.name if kept else None
    equal = bool(kept and reference.exists() and same_state(kept.path, reference))
    detected = rc == 3 and "divergence" in text and kept_step < STORM
    return {"detected": detected, "exit": rc, "seconds": t1 - start,
            "samples_lost": (stop - kept_step) * GBS,
            "since_checkpoint": (stop - kept_step) * GBS, "equal": equal,
            "note": f"fault from step {STORM}, stopped at step {stop} "
                    f"({stop - STORM + 1} steps), checkpoint kept: step {kept_step}"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--data", type=Path, default=ROOT / "data" / "cpu128")
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    faults = [f for f in a.faults.split(",") if f]
    unknown = set(faults) - set(FAULTS)
    if unknown:
        ap.error(f"unknown fault(s) {sorted(unknown)}; choose from {FAULTS}")
    data = a.data.resolve()
    rec = record("faults", sys.argv[1:] if argv is None else argv, runs=a.runs, faults=faults,
                 config=str(CONFIG.name), overrides=overrides(Path("DATA")), data=str(a.data))
    results: dict[str, list[dict]] = {f: [] for f in faults}
    t_start = time.time()
    with tempfile.TemporaryDirectory(prefix="faults_") as tmp:
        tmp = Path(tmp)
        ref = tmp / "reference"
        rc, text, _ = wait(launch(ref, ["train.checkpoint_keep=100"], data))
        if rc != 1:
            raise SystemExit(f"the reference run failed ({rc}):\n{text[-3000:]}")
        for r in range(a.runs):
            for f in faults:
                work = tmp / f"{f}{r}"
                work.mkdir()
                if f in ("kill", "sigterm"):
                    res = fault_interrupt(f, work, data, ref)
                elif f == "corrupt":
                    res = fault_corrupt(work, data)
                elif f == "swap":
                    res = fault_swap(work, data, ref)
                elif f == "diskfull":
                    res = fault_diskfull(work, data, ref)
                else:
                    res = fault_storm(f, work, data, ref)
                results[f].append(res)
                print(f"round {r + 1} {f:8} detected={res['detected']} exit={res['exit']} "
                      f"{res['seconds']:.1f} s lost={res['samples_lost']} equal={res['equal']}"
                      f"  ({res['note']})", flush=True)
    rows = {}
    for f, rs in results.items():
        rows[f] = {"runs": len(rs), "detected": sum(bool(x["detected"]) for x in rs),
                   "seconds_median": statistics.median(x["seconds"] for x in rs),
                   "seconds_max": max(x["seconds"] for x in rs),
                   "samples_lost_max": max(x["samples_lost"] for x in rs),
                   "lost_within_checkpoint_interval": all(
                       x["samples_lost"] <= max(x["since_checkpoint"], 0) or
                       x["samples_lost"] <= EVERY for x in rs),
                   "equal": (None if all(x["equal"] is None for x in rs)
                             else sum(bool(x["equal"]) for x in rs))}
    rec.update(wall_s=round(time.time() - t_start, 1), rows=rows, results=results)
    print(f"\n{'fault':8} {'runs':>4} {'detected':>8} {'s median':>9} {'s max':>6} "
          f"{'lost max':>8}  equal to uninterrupted")
    for f, row in rows.items():
        eq = "n/a" if row["equal"] is None else f"{row['equal']}/{row['runs']}"
        print(f"{f:8} {row['runs']:4d} {row['detected']:>4}/{row['runs']:<3} "
              f"{row['seconds_median']:9.1f} {row['seconds_max']:6.1f} "
              f"{row['samples_lost_max']:8d}  {eq}")
    finish(rec, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
