"""Interrupted runs end to end, through run_and_time.sh with 2 MPI ranks on real shards:

* SIGTERM to run_and_time.sh (what kill, Popen.terminate() and systemd send): every rank
  checkpoints and exits 4, nothing is left running; rerunning the same command resumes, and
  the loss, gradient-norm and eval trajectory equals the uninterrupted run's bit for bit -
  with ``local`` balancing and gradient accumulation; the MLPerf log is one run with its
  interruption and resume recorded, and passes the compliance checker;
* the same through torchrun (SIGTERM to its agent, which forwards it to the workers): exit 4
  from the ranks' records although torchrun reports 1, and the rerun continues exactly;
* a rank SIGKILLed mid-run: the job ends within 60 s with exit 3 and a message naming the
  rank and the last completed step; the rerun resumes from the last checkpoint (the steps
  since are trained again) and ends equal to the uninterrupted run;
* at 4 ranks, rank 3 SIGKILLed: the summary names rank 3 as the one that ended first, not
  the rank MPICH's banner names (one it killed itself in its clean-up);
* the checkpoint of 2 ranks (the reference run's) resumed on 1: it works and says that the
  data order changes;
* a resume that changes a key that must match (the optimizer: AdamW or LARS on LAMB's state)
  is refused with exit 2 before anything is trained or logged; one that changes a key that
  may change (the step budget) resumes and records the change in both logs;
* the reference run itself, which its step budget ends: exit 1, aborted in the MLPerf log, no
  RESULT line, and the log passes the compliance checker (aborted runs are valid logs);
* a checkpoint directory outside the run directory belongs to one run: the rerun resumes into
  it, another run directory is refused its checkpoints unless it adopts them (and says so);
* results are never overwritten: a directory holding a finished run is refused (exit 2, the
  log untouched), and so are RUN_DIR and ``-- train.output_dir`` naming two places.

Every run is the tiny model of tests/support/tiny.py; the uninterrupted run they are compared
with is the session fixture ``reference_run`` (tests/support/runs.py), trained once.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from tests.support.launch import ROOT, needs_mpiexec
from runtime.observe.metrics import read_records
from tests.support.run_docs import undocumented, unlisted
from tests.support.mllog import compliance, mllog_events
from tests.support.runs import (CPU_CONFIG, SEED, STEPS, evals, finish, ranks_left, run,
                                run_and_time, start, steps, wait_for_step)
from tests.support.runs import resume_overrides as overrides

pytestmark = [pytest.mark.slow, needs_mpiexec]


@pytest.mark.slow
def test_the_budget_ends_the_reference_run_aborted_without_result_line(reference_run):
    """25 steps, target 0.99: the run stops at its budget - exit 1 (asserted by the fixture),
    status aborted, no RESULT line - and the log is a valid one. run_and_time.sh (mpiexec)
    says it as the normal end it is, not "FAILED ... no RESULT line" (the newcomer
    walkthrough: every smoke, profile and tuning run looked like a failure)."""
    assert reference_run.rc == 1
    assert "RESULT," not in reference_run.out
    assert "FAILED" not in reference_run.err, reference_run.err[-3000:]
    assert re.search(r"^run_and_time\.sh: stopped at the step budget: 25 steps \(train\."
                     r"max_steps\), 400 samples, no target: the last evaluation's accuracy "
                     r"0\.\d{4} is short of train\.target_mlm_accuracy 0\.99 \(exit 1, target not "
                     r"reached - not a failure; no RESULT line\)$", reference_run.err, re.M), \
        reference_run.err[-3000:]
    events = mllog_events(reference_run.dir / "mlperf_bert.log")
    assert [e["metadata"]["status"] for e in events if e["key"] == "run_stop"] == ["aborted"]
    assert compliance(reference_run.dir / "mlperf_bert.log").returncode == 0
    # train.plot=false (the suite's runs): no PNG, and the summary says so
    assert not (reference_run.dir / "loss_accuracy.png").exists()
    assert json.loads((reference_run.dir / "summary.json").read_text())["plot"] is None


@pytest.mark.slow
def test_sigterm_checkpoints_every_rank_and_the_rerun_continues_exactly(small_dataset,
                                                                       reference_run, tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, overrides(small_dataset))
    wait_for_step(run_dir, 12, proc)
    proc.send_signal(signal.SIGTERM)               # to run_and_time.sh only
    sent = time.time()
    rc, out, err = finish(proc)
    assert rc == 4, out[-3000:] + err[-3000:]
    assert time.time() - sent < 60
    assert "got SIGTERM" in err and "stopping on signal" in out, out[-2000:] + err[-2000:]
    assert not ranks_left(run_dir)
    status = [json.loads(p.read_text()) for p in sorted((run_dir / "ranks").glob("rank_*"))]
    assert [s["exit"] for s in status] == [4, 4] and len({s["step"] for s in status}) == 1
    stopped_at = status[0]["step"]
    events = mllog_events(run_dir / "mlperf_bert.log")
    assert [e["key"] for e in events].count("run_stop") == 0
    assert events[-1]["key"] == "presto_interrupted"

    rc, out, err = run(run_dir, overrides(small_dataset))   # the same command again
    assert rc == 1, out[-3000:] + err[-3000:]
    assert f"resuming from {run_dir / 'checkpoints'}" in out
    want, got = steps(reference_run.dir), steps(run_dir)
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    assert got == want                                    # every step, bit for bit
    assert evals(run_dir) == evals(reference_run.dir)
    assert (run_dir / "checkpoints").is_dir() and unlisted(run_dir) == []   # the README's table
    keys = [e["key"] for e in mllog_events(run_dir / "mlperf_bert.log")]
    assert keys.count("run_start") == keys.count("run_stop") == keys.count("init_start") == 1
    assert keys.index("presto_interrupted") < keys.index("presto_resumed")
    resumed = next(e for e in mllog_events(run_dir / "mlperf_bert.log")
                   if e["key"] == "presto_resumed")
    assert resumed["metadata"]["step"] == stopped_at and resumed["metadata"]["log_continued"]
    check = compliance(run_dir / "mlperf_bert.log")
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]
    # Every field of 2 ranks' records, the resume record's too, is on docs/METRICS.md.
    records = read_records(run_dir / "metrics.jsonl")
    assert "resume" in {r["kind"] for r in records} and undocumented(records) == []


@pytest.mark.slow
def test_sigterm_through_torchrun_checkpoints_and_the_rerun_continues_exactly(
        small_dataset, reference_run, tmp_path):
    """The torchrun path: run_and_time.sh passes SIGTERM to torchrun's agent, which sends it
    to its workers and waits for them; both ranks checkpoint and exit 4, and although torchrun
    itself reports 1 for a stopped run, run_and_time.sh exits 4 (from the ranks' records). The
    rerun, under mpiexec, continues bit for bit: the launcher is not part of the state."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, overrides(small_dataset, **{"system.launcher": '"torchrun"'}))
    wait_for_step(run_dir, 12, proc)
    proc.send_signal(signal.SIGTERM)
    sent = time.time()
    rc, out, err = finish(proc)
    assert rc == 4, out[-3000:] + err[-3000:]
    assert time.time() - sent < 60
    assert "got SIGTERM" in err and "SIGTERM to torchrun" in err, err[-2000:]
    assert "stopping on signal" in out + err, out[-2000:] + err[-2000:]
    assert not ranks_left(run_dir)
    status = [json.loads(p.read_text()) for p in sorted((run_dir / "ranks").glob("rank_*"))]
    assert [s["exit"] for s in status] == [4, 4] and len({s["step"] for s in status}) == 1

    rc, out, err = run(run_dir, overrides(small_dataset))
    assert rc == 1, out[-3000:] + err[-3000:]
    assert f"resuming from {run_dir / 'checkpoints'}" in out
    reference = reference_run.dir
    assert steps(run_dir) == steps(reference) and evals(run_dir) == evals(reference)
    # the log begun under torchrun and finished under mpiexec is one valid run
    check = compliance(run_dir / "mlperf_bert.log")
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]


@pytest.mark.slow
def test_a_killed_rank_is_named_and_the_rerun_resumes_from_the_last_checkpoint(
        small_dataset, reference_run, tmp_path):
    run_dir = tmp_path / "run"
    proc = start(run_dir, overrides(small_dataset))
    wait_for_step(run_dir, 13, proc)
    pid = json.loads((run_dir / "ranks" / "rank_00001.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    rc, out, err = finish(proc)
    assert time.time() - killed < 60
    assert rc == 3, out[-3000:] + err[-3000:]
    assert f"rank 1 (pid {pid}" in err and "killed by SIGKILL" in err, err[-3000:]
    assert "last completed step logged" in err
    assert not ranks_left(run_dir)
    lost_from = max(steps(run_dir))
    rc, out, err = run(run_dir, overrides(small_dataset))
    assert rc == 1, out[-3000:] + err[-3000:]
    resumed = next(e for e in mllog_events(run_dir / "mlperf_bert.log")
                   if e["key"] == "presto_resumed")["metadata"]
    assert resumed["step"] % 5 == 0 and resumed["step"] <= lost_from  # the last checkpoint
    reference = reference_run.dir
    assert steps(run_dir) == steps(reference) and evals(run_dir)[-1] == evals(reference)[-1]


@pytest.mark.slow
def test_at_4_ranks_the_rank_killed_first_is_named_not_one_the_launcher_killed_after(
        small_dataset, tmp_path):
    """mpiexec SIGKILLs the other ranks once one has died, and its banner names one process
    with a bad exit: rank 1 (or 0) of rank 3's death. The summary names rank 3, from the
    order in which the watch beside the launcher saw the ranks end."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, overrides(small_dataset, **{"system.ranks_per_node": 4,
                                                      "train.max_steps": 20}))
    wait_for_step(run_dir, 2, proc)
    pid = json.loads((run_dir / "ranks" / "rank_00003.json").read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    rc, out, err = finish(proc)
    assert rc == 3, out[-3000:] + err[-3000:]
    said = [x.removeprefix("run_and_time.sh: ") for x in err.splitlines()
            if x.startswith("run_and_time.sh: rank ")]
    assert said[0].startswith(f"rank 3 (pid {pid} on "), err[-3000:]
    assert " ended first" in said[0] and said[1].startswith(f"rank 3 (pid {pid} on "), said
    assert all(" ended first" not in x for x in said[1:] if not x.startswith("rank 3 ")), said
    assert not ranks_left(run_dir)


@pytest.mark.slow
def test_resuming_on_another_world_size_works_and_says_the_order_changes(small_dataset,
                                                                       reference_run, tmp_path):
    """The 2-rank reference run's checkpoint of step 20, continued on 1 rank."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference_run.dir / "checkpoints" / "step_00000020",
                    run_dir / "checkpoints" / "step_00000020")
    rc, out, err = run(run_dir, overrides(small_dataset, **{"system.ranks_per_node": 1}))
    assert rc == 1, out[-3000:] + err[-3000:]
    assert "world size 1 instead of the checkpoint's 2" in out
    assert "data order differs" in out
    assert "resuming from" in out and "step 20" in out
    assert min(steps(run_dir)) == 21 and max(steps(run_dir)) == STEPS


@pytest.mark.slow
def test_a_resume_that_swaps_the_optimizer_is_refused_and_a_budget_change_is_recorded(
        small_dataset, reference_run, tmp_path):
    """The reference run's LAMB checkpoint of step 20, resumed with AdamW and with LARS (which
    once loaded LAMB's moments and trained on, and crashed with KeyError 'momentum'): exit 2
    naming optim.name with both values, nothing trained or logged. Then with a smaller step
    budget - a key that may change: it resumes, and the change is in the MLPerf log's
    presto_resumed event and the metrics' resume record."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copytree(reference_run.dir / "checkpoints" / "step_00000020",
                    run_dir / "checkpoints" / "step_00000020")
    for other in ("adamw", "lars"):
        rc, out, err = run(run_dir, overrides(small_dataset, **{"optim.name": f'"{other}"'}))
        assert rc == 2, out[-3000:] + err[-3000:]
        assert f"optim.name: the checkpoint has 'lamb', this run '{other}'" in out + err
        assert "Traceback" not in out + err      # bad input: the message, not a stack
        assert 'resume with the checkpoint\'s values (optim.name="lamb")' in out + err
        assert not (run_dir / "metrics.jsonl").exists()
        assert not (run_dir / "mlperf_bert.log").exists()
    rc, out, err = run(run_dir, overrides(small_dataset, **{"train.max_steps": 22}))
    assert rc == 1, out[-3000:] + err[-3000:]
    assert "resume: the config differs from the checkpoint's: train.max_steps: 25 -> 22" in out
    assert sorted(steps(run_dir)) == [21, 22]
    resumed = [e for e in mllog_events(run_dir / "mlperf_bert.log")
               if e["key"] == "presto_resumed"]
    changes = resumed[0]["metadata"]["config_changes"]   # the copy's directory changed too
    assert changes == ["train.max_steps: 25 -> 22", f"train.output_dir: "
                       f"{str(reference_run.dir)!r} -> {str(run_dir)!r}"]
    record = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][0]
    assert record["kind"] == "resume" and record["config_changes"] == changes


@pytest.mark.slow
def test_a_checkpoint_dir_belongs_to_one_run_and_the_rerun_finds_it(small_dataset, tmp_path):
    """train.checkpoint_dir outside the run directory: the rerun of the same command (no
    RUN_DIR) resumes into the run the checkpoints belong to - one run, one MLPerf log; a new run
    directory is refused them (exit 2, naming both) unless train.adopt_checkpoints, and then
    its new log says whose they were. Once that run is finished, the refusal says so and
    offers no way to continue it, and the refused run leaves no run directory."""
    logdir, ckpt = tmp_path / "logs", tmp_path / "ckpt"
    # 25 steps: the SIGTERM follows the first checkpoint (step 5) and must land before the
    # ranks' last logging point, not race the run's end (15 left 10 steps: 0.5 s, 2026-12-02)
    extra = overrides(small_dataset, **{"train.checkpoint_dir": f'"{ckpt}"',
                                        "train.max_steps": 25})
    env = dict(os.environ, CONFIG=str(CPU_CONFIG), SEED=SEED, LOGDIR=str(logdir))
    cmd = ["bash", str(ROOT / "run_and_time.sh"), "--", *extra]
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 180
    while not list(ckpt.glob("step_*/checkpoint.json")) and time.time() < deadline:
        time.sleep(0.2)
    first.send_signal(signal.SIGTERM)
    rc, out, err = finish(first)
    assert rc == 4, out[-3000:] + err[-3000:]
    (run_a,) = list(logdir.iterdir())
    assert json.loads((ckpt / "run.json").read_text())["run_dir"] == str(run_a)

    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert again.returncode == 1, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resuming the interrupted run in {run_a}" in again.stderr
    assert list(logdir.iterdir()) == [run_a]
    keys = [e["key"] for e in mllog_events(run_a / "mlperf_bert.log")]
    assert keys.count("run_start") == 1 and keys.count("run_stop") == 1
    assert max(steps(run_a)) == 25

    # run_a is finished now: the same command starts a new run, whose ranks refuse the
    # checkpoints (exit 2) - without advice to continue the finished run, and without leaving
    # the new run directory behind.
    refused = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=240)
    said = refused.stdout + refused.stderr
    assert refused.returncode == 2, said[-3000:]
    assert f"{run_a} is a finished run" in said and "To continue that run" not in said, said
    assert list(logdir.iterdir()) == [run_a], said[-3000:]

    run_b = tmp_path / "b"
    rc, out, err = run(run_b, extra)
    assert rc == 2, out[-3000:] + err[-3000:]
    assert f"holds the checkpoints of {run_a}, not of this run ({run_b})" in out + err
    assert not run_b.exists()   # the directory the refused run was given, made for it, went too
    rc, out, err = run(run_b, [*extra, "train.adopt_checkpoints=true"])
    assert rc == 1, out[-3000:] + err[-3000:]
    events = mllog_events(run_b / "mlperf_bert.log")
    resumed = [e for e in events if e["key"] == "presto_resumed"]
    assert [e["key"] for e in events].count("run_start") == 1
    assert resumed[0]["metadata"]["adopted_from_run"] == str(run_a)
    assert json.loads((ckpt / "run.json").read_text())["run_dir"] == str(run_b)


def test_results_are_never_overwritten(small_dataset, tmp_path):
    """A finished run's directory is refused before anything is written; RUN_DIR and
    `-- train.output_dir` naming two places is refused. Quick (slow-marked only as every test in
    tests/e2e is): run_and_time.sh refuses both before any rank starts. (Distinct directories for
    runs started in the same second: tests/e2e/test_run_and_time_dirs.py; `-- train.output_dir=X`
    is the run directory of a real run - run_and_time.sh says X and the ranks write there: the
    short run of tests/e2e/test_train_e2e.py.)"""
    done = tmp_path / "done"
    done.mkdir()
    log = done / "mlperf_bert.log"
    log.write_text(':::MLLOG {"key": "run_start"}\n:::MLLOG {"key": "run_stop", '
                   '"metadata": {"status": "success"}}\n')
    before = log.read_bytes()
    rc, out, err = run(done, overrides(small_dataset, **{"train.max_steps": 2}))
    assert rc == 2, out[-2000:] + err[-2000:]
    assert "holds a finished run" in err and log.read_bytes() == before
    assert not (done / "metrics.jsonl").exists()
    target = tmp_path / "chosen"
    both = run_and_time([f"train.output_dir={target}"], timeout=60,
                        env_extra={"RUN_DIR": str(tmp_path / "other")})
    assert both.returncode == 2 and "two places for one run" in both.stderr
