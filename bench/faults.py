"""Faults, injected and timed: is each one detected, how fast, what is lost, and does a resumed
run end where the uninterrupted one does.

    python -m bench.faults [--runs 3] [--data data/cpu128]
                           [--faults kill,sigterm,int2,hup,early,wrapper_kill,same_rundir,
                                     share_ckpt,corrupt,nan,fp16,swap,diskfull]
                           [--launchers mpiexec[,mpirun,torchrun,srun]]
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

The signal rows (issue 37), each run under every launcher of ``--launchers`` (row
``int2@torchrun``; srun needs a Slurm cluster: SLURM_CONF set, srun on PATH), the script
leading its own process group as a job in a terminal does; then the same command again:
  int2          SIGINT to the whole process group at step 13 and again 0.3 s later (Ctrl-C
                twice: MPICH's mpiexec aborted the job, srun killed the step)
  hup           SIGHUP to the whole process group at step 13 (a closed terminal: it killed
                mpiexec)
  early         SIGTERM to run_and_time.sh 50 ms after its launch line, while the ranks start
                (MPICH reported "BAD TERMINATION ... Segmentation fault", exit 3)
  wrapper_kill  SIGKILL to run_and_time.sh alone at step 13 (its ranks trained on as orphans);
                the seconds are to the last rank gone
and the sharing rows, under mpiexec:
  same_rundir   a second run_and_time.sh on the RUN_DIR of a run launched a moment before (it
                exited 3, wrote into the first's launcher.log and reported its ranks as killed)
  share_ckpt    a second run (seed 8), in another run directory, started at a run's launch
                with its fresh train.checkpoint_dir (two runs overwrote each other's
                checkpoints; "equal" also asks that the newest checkpoint there is the first
                run's, hashing as the uninterrupted run's)
Detected: exit 4 with a checkpoint at the stop ("stopping on signal", every rank's record 4)
and no launcher crash report; for the sharing rows exit 2 naming the live run's
run_and_time.sh, nothing of the live run touched (its launcher.log, run.json), no directory of
the refused run left; the seconds are to the refusal, and "equal" asks whether the live run
then ends equal to the uninterrupted one.

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

from bench.harness import Benchmark, Goal, Stop, listed, option, out, run

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "submission" / "configs" / "config_CPU_1x2x32x1.toml"
SIGNALS = ("int2", "hup", "early", "wrapper_kill")     # run under each of --launchers
SHARING = ("same_rundir", "share_ckpt")
FAULTS = ("kill", "sigterm", *SIGNALS, *SHARING, "corrupt", "nan", "fp16", "swap", "diskfull")
EXPECT = {"kill": 3, "sigterm": 4, "corrupt": 2, "nan": 3, "fp16": 3, "swap": 2, "diskfull": 3,
          **{f: 4 for f in SIGNALS}, **{f: 2 for f in SHARING}}
LAUNCHERS = ("mpiexec", "mpirun", "torchrun", "srun")
CRASH = ("BAD TERMINATION", "Segmentation fault", "exited on signal")   # launchers' crash words
GBS, EVERY, HIT, STORM = 16, 80, 13, 23


def overrides(data: Path) -> list[str]:
    return [f'data.data_dir="{data}"', "model.num_hidden_layers=1", "model.hidden_size=64",
            "model.num_attention_heads=2", "model.intermediate_size=128",
            f"train.global_batch_size={GBS}", "train.eval_iter_start_samples=160",
            "train.eval_iter_samples=160", "train.max_steps=40", "train.log_every_steps=1",
            "data.eval_batch_size=32", "schedule.warmup_steps=5", "schedule.total_steps=200",
            "train.target_mlm_accuracy=0.99", f"train.checkpoint_every_samples={EVERY}",
            "train.max_nonfinite_steps=3", "system.dist_timeout_s=30"]


def default_stop_signals() -> None:
    """The stop signals at their defaults in run_and_time.sh, whatever this process inherited
    (bash cannot trap a signal ignored at its start: nohup, background jobs)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_DFL)


def launch(run_dir: Path, extra: list[str], data: Path,
           launcher: str = "mpiexec") -> subprocess.Popen:
    """run_and_time.sh leading its own process group (a job in a terminal)."""
    env = dict(os.environ, CONFIG=str(CONFIG), SEED="7", RUN_DIR=str(run_dir))
    if launcher == "mpirun":   # Open MPI's: the venv's mpirun is MPICH's
        env["MPIRUN"] = shutil.which("mpirun.openmpi") or "mpirun"
    if launcher != "mpiexec":
        extra = [*extra, f'system.launcher="{launcher}"']
    return subprocess.Popen(["bash", str(ROOT / "run_and_time.sh"), "--", *overrides(data),
                             *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=default_stop_signals)


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

def fault_interrupt(kind: str, launcher: str, work: Path, data: Path, ref: Path) -> dict:
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


def rank_records(run_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((run_dir / "ranks").glob("rank_*.json"))]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def fault_signal(kind: str, launcher: str, work: Path, data: Path, ref: Path) -> dict:
    """int2, hup, early, wrapper_kill under ``launcher``; then the same command (mpiexec:
    the launcher is not part of the state) must continue equal to the reference."""
    run_dir = work / "run"
    proc = launch(run_dir, [], data, launcher)
    seen = ""
    if kind == "early":
        while proc.poll() is None:
            line = proc.stderr.readline()
            seen += line
            if "launching:" in line or not line:
                break
        time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
    else:
        wait_for_step(run_dir, HIT, proc)
        if kind == "int2":
            os.killpg(proc.pid, signal.SIGINT)
            time.sleep(0.3)
            os.killpg(proc.pid, signal.SIGINT)
        elif kind == "hup":
            os.killpg(proc.pid, signal.SIGHUP)
        else:
            os.kill(proc.pid, signal.SIGKILL)
    t0 = time.time()
    rc, text, t1 = wait(proc)
    text = seen + text
    records = rank_records(run_dir)
    if kind == "wrapper_kill":   # no script left to say anything: the ranks' own words
        deadline = time.time() + 120
        while any(alive(int(r["pid"])) for r in records) and time.time() < deadline:
            time.sleep(0.05)
            records = rank_records(run_dir)
        t1 = time.time()
        text = (run_dir / "launcher.log").read_text(errors="replace")
        rc = 4 if [r.get("exit") for r in records] == [4, 4] else -1
    recs = step_records(run_dir)
    trained = max((r["step"] for r in recs), default=0)
    stopped = [r.get("exit") for r in records] == [4, 4] and "stopping on signal" in text
    crash = [w for w in CRASH if w in text]
    rc2, text2, _ = wait(launch(run_dir, [], data))
    res = resumed_from(run_dir)
    lost = (trained - int(res.get("step", 0))) * GBS
    return {"detected": rc == EXPECT[kind] and stopped and not crash, "exit": rc,
            "seconds": t1 - t0, "samples_lost": lost, "since_checkpoint": 0,
            "resumed_exit": rc2, "equal": rc2 == 1 and trajectory(run_dir) == trajectory(ref),
            "note": f"stopped at step {trained}, resumed from step {res.get('step')}"
                    + (f"; launcher crash words: {crash}" if crash else "")}


def fault_same_rundir(kind: str, launcher: str, work: Path, data: Path, ref: Path) -> dict:
    run_dir = work / "run"
    first = launch(run_dir, [], data)
    deadline = time.time() + 120
    while not (run_dir / "launcher.log").exists() and time.time() < deadline:
        time.sleep(0.01)
    t0 = time.time()
    rc, text, t1 = wait(launch(run_dir, [], data))
    first_step = max((r["step"] for r in step_records(run_dir)), default=0)
    rc1, _, _ = wait(first)
    log = (run_dir / "launcher.log").read_text(errors="replace")
    named = f"is in use by another run (run_and_time.sh pid {first.pid} on " in text
    itself = "rank 0 (pid" not in text and "rank 1 (pid" not in text
    untouched = "in use by another run" not in log and log.count("STARTING") == 0 \
        and log.count("launching:") == 0
    return {"detected": rc == EXPECT["same_rundir"] and named and itself and untouched,
            "exit": rc, "seconds": t1 - t0, "samples_lost": 0, "since_checkpoint": 0,
            "live_exit": rc1, "equal": rc1 == 1 and trajectory(run_dir) == trajectory(ref),
            "note": f"second run started at the first's launch, refused {t1 - t0:.1f} s later "
                    f"(the first at step {first_step}); the first ended with {rc1}"}


def fault_share_ckpt(kind: str, launcher: str, work: Path, data: Path, ref: Path) -> dict:
    """A second run (seed 8, another run directory) started at the first's launch with the
    same fresh train.checkpoint_dir: refused, or - as before issue 37 - both write there."""
    ckpt, a, b = work / "ckpt", work / "a", work / "b"
    extra = [f'train.checkpoint_dir="{ckpt}"']
    first = launch(a, extra, data)
    deadline = time.time() + 120
    while not (a / "launcher.log").exists() and time.time() < deadline:
        time.sleep(0.01)
    t0 = time.time()
    rc, text, t1 = wait(launch(b, [*extra, "train.seed=8"], data))
    rc1, _, _ = wait(first)
    named = f"is in use by another run (run_and_time.sh pid {first.pid} on " in text \
        and f"run directory {a}" in text
    owner = None
    with contextlib.suppress(OSError, ValueError):
        owner = json.loads((ckpt / "run.json").read_text()).get("run_dir")
    from runtime.train.checkpoint import find_latest
    last = find_latest(ckpt, warn=lambda m: None)
    mine = bool(last and same_state(last.path, ref / "checkpoints" / last.path.name))
    untouched = owner == str(a) and not b.exists()
    return {"detected": rc == EXPECT["share_ckpt"] and named and untouched, "exit": rc,
            "seconds": t1 - t0, "samples_lost": 0, "since_checkpoint": 0, "live_exit": rc1,
            "equal": rc1 == 1 and trajectory(a) == trajectory(ref) and mine,
            "note": f"second run started at the first's launch, ended {t1 - t0:.1f} s later; "
                    f"run.json names {owner}; the newest checkpoint there is "
                    f"{'the first run' if mine else 'NOT the first run'}'s; the first ended "
                    f"with {rc1}"}


def fault_corrupt(kind: str, launcher: str, work: Path, data: Path, ref: Path) -> dict:
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


def fault_swap(kind: str, launcher: str, work: Path, data: Path, ref: Path) -> dict:
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


def fault_diskfull(kind: str, launcher: str, work: Path, data: Path, ref: Path) -> dict:
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


def fault_storm(kind: str, launcher: str, work: Path, data: Path, ref: Path) -> dict:
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


MEASURE = {"kill": fault_interrupt, "sigterm": fault_interrupt,
           **{kind: fault_signal for kind in SIGNALS},
           "same_rundir": fault_same_rundir, "share_ckpt": fault_share_ckpt,
           "corrupt": fault_corrupt, "nan": fault_storm, "fp16": fault_storm,
           "swap": fault_swap, "diskfull": fault_diskfull}
"""Each fault's row: (the fault, its launcher, its work folder, the data set, the reference
run) -> its result."""
assert set(MEASURE) == set(FAULTS)


def rows(a) -> list[str]:
    """The table's rows: each fault, the signal rows once per launcher (``int2@torchrun``)."""
    return [f"{f}@{x}" if f in SIGNALS and x != "mpiexec" else f
            for f in a.faults for x in (a.launchers if f in SIGNALS else ["mpiexec"])]


@contextlib.contextmanager
def reference(r):
    """A temporary folder holding the uninterrupted reference run (every checkpoint kept)."""
    with tempfile.TemporaryDirectory(prefix="faults_") as tmp:
        tmp = Path(tmp)
        rc, text, _ = wait(launch(tmp / "reference", ["train.checkpoint_keep=100"],
                                  r.args.data.resolve()))
        if rc != 1:
            raise Stop(f"the reference run failed ({rc}):\n{text[-3000:]}")
        yield tmp


def measure(r, case) -> dict:
    """One round of one row, in a fresh work folder beside the reference."""
    round_, row = case
    work = r.state / f"{row.replace('@', '_')}{round_}"
    work.mkdir()
    kind, _, launcher = row.partition("@")
    return {"row": row, **MEASURE[kind](kind, launcher or "mpiexec", work, r.args.data.resolve(),
                                        r.state / "reference")}


def summary(r) -> dict:
    """Per row: runs, detected, seconds, samples lost, resumes equal; every result by row."""
    results: dict[str, list[dict]] = {f: [] for f in rows(r.args)}
    for res in r.results:
        results[res.pop("row")].append(res)
    table = {}
    for f, rs in results.items():
        table[f] = {"runs": len(rs), "detected": sum(bool(x["detected"]) for x in rs),
                    "seconds_median": statistics.median(x["seconds"] for x in rs),
                    "seconds_max": max(x["seconds"] for x in rs),
                    "samples_lost_max": max(x["samples_lost"] for x in rs),
                    "lost_within_checkpoint_interval": all(
                        x["samples_lost"] <= max(x["since_checkpoint"], 0) or
                        x["samples_lost"] <= EVERY for x in rs),
                    "equal": (None if all(x["equal"] is None for x in rs)
                              else sum(bool(x["equal"]) for x in rs))}
    return {"rows": table, "results": results}


def table(rec: dict) -> str:
    lines = ["", "| fault | runs | detected | s median | s max | lost max | equal to "
             "uninterrupted |", "|---|---|---|---|---|---|---|"]
    for f, row in rec["rows"].items():
        eq = "n/a" if row["equal"] is None else f"{row['equal']}/{row['runs']}"
        lines.append(f"| {f} | {row['runs']} | {row['detected']}/{row['runs']} | "
                     f"{row['seconds_median']:.1f} | {row['seconds_max']:.1f} | "
                     f"{row['samples_lost_max']} | {eq} |")
    return "\n".join(lines)


def progress(r, case, res) -> str:
    return (f"round {case[0] + 1} {case[1]:12} detected={res['detected']} exit={res['exit']} "
            f"{res['seconds']:.1f} s lost={res['samples_lost']} equal={res['equal']}"
            f"  ({res['note']})")


BENCHMARK = Benchmark(
    "faults", __doc__, measure,
    cases=lambda r: [(k, f) for k in range(r.args.runs) for f in rows(r.args)],
    options=(option("--runs", type=int, default=3),
             option("--data", type=Path, default=ROOT / "data" / "cpu128"),
             option("--faults", type=listed(FAULTS, what="fault"), default=",".join(FAULTS)),
             option("--launchers", type=listed(LAUNCHERS, what="launcher"), default="mpiexec",
                    help=f"the launchers of the signal rows ({', '.join(SIGNALS)}): any of "
                         f"{', '.join(LAUNCHERS)}"),
             out(None)),
    fields=lambda a: dict(runs=a.runs, faults=a.faults, launchers=a.launchers,
                          config=str(CONFIG.name), overrides=overrides(Path("DATA")),
                          data=str(a.data)),
    setup=reference, progress=progress, summary=summary, table=table,
    goals=(Goal("every_fault_detected", "every round of every row ends with the exit status "
                "and the words its fault must give",
                lambda rec: all(x["detected"] == x["runs"] for x in rec["rows"].values())),
           Goal("lost_within_checkpoint_interval", "no fault loses more samples than were "
                "trained since the checkpoint kept (or the interval)",
                lambda rec: all(x["lost_within_checkpoint_interval"]
                                for x in rec["rows"].values())),
           Goal("every_resume_equal", "every resumed or live run ends equal to the "
                "uninterrupted one (where one trains)",
                lambda rec: all(x["equal"] in (None, x["runs"]) for x in rec["rows"].values()))))


def main(argv=None) -> int:
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
