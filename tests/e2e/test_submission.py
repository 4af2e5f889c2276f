"""python -m submission and submission/run.sub without a Slurm cluster.

``sbatch`` and ``srun`` are stub scripts on PATH that record their argv and environment (the
sbatch stub can also run the batch script, as slurmd would); ``python`` passes
``-m runtime.config``/``-m submission.sysinfo`` on to the real interpreter. So the checks of
``submit`` (bad configs, missing data, short walltimes, hostile values), what run.sub does with
its variables (cache clear, launch, requeue) run in seconds; the scoring, packaging and status
of synthetic MLPerf logs: tests/e2e/test_submission_logs.py. The real cluster run is tests/e2e/test_slurm.py. What needs no process:
tests/unit/test_submission_unit.py; MLPerf's own checkers on synthetic logs:
tests/integration/test_submission_integration.py.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from submission import slurm
from tests.support.launch import ROOT, default_stop_signals
from tests.support.runs import CPU_CONFIG

pytestmark = pytest.mark.slow   # tests/e2e: every test here is slow

RUN_SUB = ROOT / "submission" / "run.sub"
HOSTILE = "Evil Org $(touch {d}/PWNED1); `touch {d}/PWNED2` ; touch {d}/PWNED3 'q' \"dq\" \\ $HOME"

STUB = f"""#!{sys.executable}
import json, os, subprocess, sys
prog, argv = os.path.basename(sys.argv[0]), sys.argv[1:]
if prog == "python" and argv[:2] in (["-m", "runtime.config"], ["-m", "submission.sysinfo"]):
    os.execv({sys.executable!r}, [{sys.executable!r}] + argv)
keys = ("RUN_DIR", "SEED", "PRESTO_CACHE_CLEAR", "CONFIG", "NEXP", "LOGDIR", "PRESTO_OVERRIDES",
        "PRESTO_ROOT")
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps({{"prog": prog, "argv": argv,
                        "env": {{k: os.environ[k] for k in keys if k in os.environ}}}}) + "\\n")
if prog == "sbatch":
    print("4242")
    if os.environ.get("STUB_SBATCH_RUN") == "1":      # run the script as slurmd would
        out = next(a.split("=", 1)[1] for a in argv if a.startswith("--output="))
        env = dict(os.environ, SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node1")
        with open(out.replace("%j", "4242"), "a") as log:
            subprocess.run(["bash", argv[-1]], env=env, stdout=log, stderr=log)
    sys.exit(0)
if prog == "srun" and any("drop_caches" in a for a in argv):
    sys.exit(int(os.environ.get("STUB_CACHE_RC", "0")))
if prog == "srun" and os.environ.get("STUB_WRITE_LOG") == "1":
    os.makedirs(os.environ["RUN_DIR"], exist_ok=True)
    status = os.environ.get("STUB_LOG_STATUS", "success")
    with open(os.path.join(os.environ["RUN_DIR"], "mlperf_bert.log"), "w") as f:
        f.write(':::MLLOG {{"key": "run_stop", "value": null, "metadata": {{"status": "%s"}}}}\\n'
                % status)
if os.environ.get("STUB_TAKES_S"):   # the experiment took that long: the date stub says so
    with open(os.environ["STUB_CLOCK"], "w") as f:
        f.write(os.environ["STUB_TAKES_S"])
sys.exit(int(os.environ.get("STUB_RC", "0")))
"""

DATE_STUB = f"""#!{sys.executable}
# date(1), but `date +%s` adds the seconds in $STUB_CLOCK (an experiment that took that long)
import os, shutil, sys, time
if sys.argv[1:] == ["+%s"] and os.path.exists(os.environ.get("STUB_CLOCK", "")):
    print(int(time.time()) + int(open(os.environ["STUB_CLOCK"]).read()))
    sys.exit(0)
here = os.path.dirname(os.path.abspath(sys.argv[0]))
path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if os.path.abspath(d) != here)
real = shutil.which("date", path=path)
os.execv(real, [real] + sys.argv[1:])
"""


@pytest.fixture
def stubs(tmp_path):
    """bin/ with sbatch, srun, python stubs; returns (bin dir, env, read-calls function)."""
    bindir = tmp_path / "bin dir"
    bindir.mkdir()
    for name in ("sbatch", "srun", "python"):
        (bindir / name).write_text(STUB)
        (bindir / name).chmod(0o755)
    log = tmp_path / "calls.jsonl"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PMI_", "OMPI_")) and k not in (
               "CONFIG", "NEXP", "LOGDIR", "PRESTO_OVERRIDES", "PRESTO_ROOT", "SEED_BASE")}
    env.update(PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}", STUB_LOG=str(log),
               SRUN=str(bindir / "srun"), PYTHON=str(bindir / "python"))

    def calls(prog=None):
        if not log.exists():
            return []
        out = [json.loads(line) for line in log.read_text().splitlines()]
        return [c for c in out if prog is None or c["prog"] == prog]
    return bindir, env, calls


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "data set"
    d.mkdir()
    (d / "stats.json").write_text("{}")
    return d


def cli(env, *args, cwd=ROOT):
    env = dict(env, PYTHONPATH=str(ROOT))   # the repository importable from any cwd
    return subprocess.run([sys.executable, "-m", "submission", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def submit_args(tmp_path, data_dir, *extra, nexp="2", config=CPU_CONFIG):
    return ["submit", "--config", str(config), "--nexp", nexp, "--logdir",
            str(tmp_path / "logs"), "--registry", str(tmp_path / "jobs.jsonl"),
            "--set", f'data.data_dir="{data_dir}"', *extra]


# A config file names its model size (runtime.config.REQUIRED_IN_A_FILE): the tiny one.
TINY_MODEL = ('[model]\nhidden_size = 64\nnum_hidden_layers = 1\nnum_attention_heads = 2\n'
              'intermediate_size = 128\n')


def write_config(tmp_path, text: str, name="config_T_1x2x8x1.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------ submit

def test_dry_run_prints_the_command_and_script_and_submits_nothing(stubs, tmp_path, data_dir):
    _, env, calls = stubs
    proc = cli(env, *submit_args(tmp_path, data_dir, "--partition", "debug", "--dry-run"))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    walltime = 2 * 20 + slurm.MARGIN_MINUTES          # NEXP x system.walltime_minutes + margin
    line = next(ln for ln in out.splitlines() if " sbatch --parsable " in ln)
    assert f"--time={walltime}" in line and "--nodes=1" in line and "--ntasks-per-node=2" in line
    assert "--partition=debug" in line and f"--output={tmp_path}/logs/slurm-%j.out" in line
    assert f"NEXP=2 LOGDIR={tmp_path}/logs " in line and line.endswith(str(RUN_SUB))
    assert RUN_SUB.read_text() in out                  # the exact script
    assert not calls("sbatch") and not (tmp_path / "logs").exists()


def test_submit_records_the_job_and_prints_its_id(stubs, tmp_path, data_dir):
    _, env, calls = stubs
    proc = cli(env, *submit_args(tmp_path, data_dir))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "4242"
    (call,) = calls("sbatch")
    assert call["env"]["NEXP"] == "2" and call["env"]["CONFIG"] == str(CPU_CONFIG)
    assert call["env"]["PRESTO_OVERRIDES"] == f'data.data_dir="{data_dir}"'
    job = json.loads((tmp_path / "logs" / "job.json").read_text())
    assert job["job_id"] == "4242" and job["argv"] == ["sbatch", *call["argv"]]
    reg = [json.loads(x) for x in (tmp_path / "jobs.jsonl").read_text().splitlines()]
    assert reg[0]["job_id"] == "4242" and reg[0]["logdir"] == str(tmp_path / "logs")


@pytest.mark.parametrize("make,expect", [
    (lambda t: t / "missing" / "config_X_1x1x1x1.toml", r"config .*config_X_1x1x1x1.toml does not exist"),
    (lambda t: write_config(t, "[system\nnodes = 1\n"), r"not valid TOML"),
    (lambda t: write_config(t, "[system]\nnodez = 1\n"), r"unknown key system.nodez; did you mean system.nodes"),
    (lambda t: write_config(t, "[train]\nglobal_batch_size = 15\n" + TINY_MODEL), r"global_batch_size \(15\) is not divisible"),
    (lambda t: write_config(t, '[system]\nname = "CPU; rm -rf x"\n'), r"system.name = 'CPU; rm -rf x'"),
    (lambda t: write_config(t, "[train]\nglobal_batch_size = 16\n"),
     r"names its model size and global batch; missing: model.hidden_size, "
     r"model.num_hidden_layers, model.num_attention_heads, model.intermediate_size"),
])
def test_bad_configs_fail_before_submitting(stubs, tmp_path, data_dir, make, expect):
    _, env, calls = stubs
    proc = cli(env, *submit_args(tmp_path, data_dir, config=make(tmp_path)))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(expect, proc.stderr), proc.stderr
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
    assert not calls("sbatch") and not (tmp_path / "logs").exists()


@pytest.mark.parametrize("extra,expect", [
    (["--time", "44"], r"--time 44 min is too short for 2 experiment\(s\): 2 x system.walltime_minutes \(20\) \+ 5 min margin = 45 min"),
    (["--set", 'data.data_dir="/no/such/data"'], r"data.data_dir = '/no/such/data' .* does not exist on this host"),
    (["--set", "train.seed=3"], r"run.sub sets train.seed per experiment; use --seed-base"),
    (["--set", "nokey"], r"'nokey' is not section.key=value"),
    (["--set", "submission.org=a\nb"], r"line break"),
    (["--set", "system.launcher=torchrun", "--set", "system.nodes=2"], r"torchrun.*one node"),
    (["--set", "system.cache_clear=maybe"], r"system.cache_clear='maybe': choose one of auto \| required \| off"),
])
def test_bad_submit_input_fails_before_submitting(stubs, tmp_path, data_dir, extra, expect):
    _, env, calls = stubs
    proc = cli(env, *submit_args(tmp_path, data_dir, *extra))
    assert proc.returncode == 2 and re.search(expect, proc.stderr), proc.stderr
    assert not calls("sbatch")


def test_nexp_and_existing_logdir(stubs, tmp_path, data_dir):
    _, env, calls = stubs
    proc = cli(env, *submit_args(tmp_path, data_dir, nexp="0"))
    assert proc.returncode == 2 and "--nexp 0" in proc.stderr
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "run_1").mkdir()
    proc = cli(env, *submit_args(tmp_path, data_dir))
    assert proc.returncode == 2 and "--resume" in proc.stderr
    assert not calls("sbatch")
    assert cli(env, *submit_args(tmp_path, data_dir, "--resume")).returncode == 0


@pytest.mark.parametrize("extra,expect", [
    (["--partition", "debug; touch {d}/PWNED1"], r"--partition 'debug; touch"),
    (["--account", "$(touch {d}/PWNED1)"], r"--account '\$\(touch"),
    (["--set", "system.name=CPU`touch {d}/PWNED1`"], r"system.name = 'CPU`touch"),
    (["--set", "system.container_image=img;touch {d}/PWNED1"], r"system.container_image"),
    (["--set", 'data.data_dir="/x/$(touch {d}/PWNED1)"'], r"does not exist on this host"),
])
def test_hostile_values_slurm_would_read_are_refused(stubs, tmp_path, data_dir, extra, expect):
    _, env, calls = stubs
    extra = [e.format(d=tmp_path) for e in extra]
    proc = cli(env, *submit_args(tmp_path, data_dir, *extra))
    assert proc.returncode == 2 and re.search(expect, proc.stderr), proc.stderr
    assert not calls("sbatch") and not list(tmp_path.glob("PWNED*"))


def test_hostile_override_reaches_the_ranks_verbatim_and_runs_nothing(stubs, tmp_path, data_dir):
    """A value full of shell syntax is legal for submission.org: it must arrive as one
    argument, byte for byte, through sbatch -> run.sub -> srun, and nothing in it may run."""
    bindir, env, calls = stubs
    cfg = write_config(tmp_path, CPU_CONFIG.read_text().replace('launcher = "mpiexec"',
                                                                  'launcher = "srun"'))
    hostile = HOSTILE.format(d=tmp_path)
    override = f"submission.org={hostile}"
    overrides = f'data.data_dir="{data_dir}"\n{override}'
    dry = cli(env, *submit_args(tmp_path, data_dir, "--set", override, "--dry-run", config=cfg))
    assert dry.returncode == 0, dry.stderr
    # The printed command, pasted into a shell, hands sbatch exactly these values.
    command = dry.stdout.split("\n", 1)[1].split("\n\n# walltime", 1)[0]
    assert "PRESTO_OVERRIDES='data.data_dir=" in command
    pasted = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True,
                            timeout=60, cwd=tmp_path)
    assert pasted.returncode == 0 and pasted.stdout.strip() == "4242", pasted.stderr
    (call,) = calls("sbatch")
    assert call["env"]["PRESTO_OVERRIDES"] == overrides
    assert call["env"]["LOGDIR"] == str(tmp_path / "logs")
    # The real submit, with the stub sbatch running run.sub as slurmd would.
    proc = cli(dict(env, STUB_SBATCH_RUN="1"), *submit_args(tmp_path, data_dir, "--set", override,
                                                            config=cfg))
    assert proc.returncode == 0, proc.stderr
    assert calls("sbatch")[-1]["env"]["PRESTO_OVERRIDES"] == overrides
    steps = [c for c in calls("srun") if not any("drop_caches" in a for a in c["argv"])]
    assert len(steps) == 2, (tmp_path / "logs" / "slurm-4242.out").read_text()
    for i, step in enumerate(steps, start=1):
        argv = step["argv"]
        assert argv[-4:] == [str(ROOT / "run_and_time.sh"), "--", f'data.data_dir="{data_dir}"',
                             override]
        assert step["env"]["RUN_DIR"] == str(tmp_path / "logs" / f"run_{i}")
        assert step["env"]["SEED"] == str(42 + i - 1)
    assert not list(tmp_path.glob("PWNED*")) and not list(ROOT.glob("PWNED*"))
    assert not list(bindir.glob("PWNED*"))


# ------------------------------------------------------------------------------ run.sub

def run_sub(env, tmp_path, config, nexp="2", own_session=False, **extra):
    """run.sub as job 77 (``extra``: more environment); ``own_session``: in a session of its
    own with the stop signals at their defaults, as a batch job is (a test may signal its
    whole process group)."""
    e = dict(env, CONFIG=str(config), NEXP=nexp, LOGDIR=str(tmp_path / "logs"),
             PRESTO_ROOT=str(ROOT), SLURM_JOB_ID="77")
    e.update(extra)
    session = dict(start_new_session=True, preexec_fn=default_stop_signals) if own_session \
        else {}
    return subprocess.run(["bash", str(RUN_SUB)], env=e, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, **session)


@pytest.fixture
def srun_config(tmp_path):
    return write_config(tmp_path, '[system]\nlauncher = "srun"\nranks_per_node = 2\n'
                                  'walltime_minutes = 7\n[train]\nseed = 100\n'
                                  'global_batch_size = 16\n' + TINY_MODEL)


@pytest.mark.parametrize("drop,value,expect", [
    ("CONFIG", None, "CONFIG is not set"), ("NEXP", None, "NEXP is not set"),
    ("LOGDIR", None, "LOGDIR is not set"), ("NEXP", "two", "NEXP='two' is not a whole number"),
    ("CONFIG", "relative.toml", "must be absolute paths"),
])
def test_run_sub_needs_its_variables(stubs, tmp_path, srun_config, drop, value, expect):
    _, env, calls = stubs
    e = dict(env, CONFIG=str(srun_config), NEXP="2", LOGDIR=str(tmp_path / "logs"),
             PRESTO_ROOT=str(ROOT))
    if value is None:
        del e[drop]
    else:
        e[drop] = value
    proc = subprocess.run(["bash", str(RUN_SUB)], env=e, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and expect in proc.stderr, proc.stderr
    assert not calls("srun")


def test_run_sub_srun_steps_cache_clear_and_files(stubs, tmp_path, srun_config):
    _, env, calls = stubs
    proc = run_sub(env, tmp_path, srun_config)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    srun = calls("srun")
    assert [any("drop_caches" in a for a in c["argv"]) for c in srun] == [True, False, True, False]
    clear = srun[0]["argv"]
    assert clear[:4] == ["--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    step = srun[1]["argv"]
    assert step[:6] == ["--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--mpi=none",
                        "--kill-on-bad-exit=1", "--time=7"]
    assert step[6:] == [str(ROOT / "run_and_time.sh"), "--"]
    assert [c["env"]["SEED"] for c in srun[1::2]] == ["100", "101"]
    assert all(c["env"]["PRESTO_CACHE_CLEAR"] == "1" for c in srun[1::2])
    assert "experiment 1: cache_clear done on 1 node(s)" in proc.stderr
    logs = tmp_path / "logs"
    assert (logs / "run_1.exit").read_text().strip() == "0"
    assert (logs / "run_2.out").read_text().startswith("run.sub: attempt of experiment 2")
    assert json.loads((logs / "sysinfo.json").read_text())["cpu"]["vcpus"] >= 1


def test_run_sub_cache_clear_not_permitted_is_skipped_and_said(stubs, tmp_path, srun_config):
    _, env, calls = stubs
    proc = run_sub(env, tmp_path, srun_config, nexp="1", STUB_CACHE_RC="1")
    assert proc.returncode == 0, proc.stderr
    assert "experiment 1: cache_clear NOT done (not permitted here" in proc.stderr
    (step,) = [c for c in calls("srun") if "--mpi=none" in c["argv"]]
    assert step["env"]["PRESTO_CACHE_CLEAR"] == "0"   # the MLPerf log will say cache_clear false


def test_run_sub_cache_clear_required_or_off(stubs, tmp_path, srun_config):
    _, env, calls = stubs
    proc = run_sub(env, tmp_path, srun_config, nexp="1", STUB_CACHE_RC="1",
                   PRESTO_OVERRIDES="system.cache_clear=required")
    assert proc.returncode == 1 and "NOT run: system.cache_clear=required" in proc.stdout
    assert not [c for c in calls("srun") if "--mpi=none" in c["argv"]]
    assert (tmp_path / "logs" / "run_1.exit").read_text().strip() == "3"
    proc = run_sub(env, tmp_path, srun_config, nexp="1", PRESTO_OVERRIDES="system.cache_clear=off")
    assert proc.returncode == 0 and "cache_clear skipped (system.cache_clear=off)" in proc.stderr
    last = calls("srun")[-1]
    assert not any("drop_caches" in a for a in last["argv"]) and last["env"]["PRESTO_CACHE_CLEAR"] == "0"


def test_run_sub_requeue_skips_finished_experiments(stubs, tmp_path, srun_config):
    _, env, calls = stubs
    proc = run_sub(env, tmp_path, srun_config, nexp="2", STUB_WRITE_LOG="1")
    assert proc.returncode == 0, proc.stderr
    first = len(calls("srun"))
    # A requeue: experiment 2's log lost its run_stop (it was running when the node died).
    (tmp_path / "logs" / "run_2" / "mlperf_bert.log").write_text(":::MLLOG {}\n")
    proc = run_sub(env, tmp_path, srun_config, nexp="2", SLURM_RESTART_COUNT="1")
    assert proc.returncode == 0, proc.stderr
    assert "experiment 1/2: already done" in proc.stdout
    again = calls("srun")[first:]
    assert [c["env"].get("RUN_DIR") for c in again if "--mpi=none" in c["argv"]] == \
        [str(tmp_path / "logs" / "run_2")]
    assert (tmp_path / "logs" / "run_2.out").read_text().count("run.sub: attempt") == 2


def test_run_sub_lost_rank_requeues_even_when_slurm_signals_scontrol(stubs, tmp_path,
                                                                      srun_config):
    """A launch that ends 137 (a node lost) requeues the job. Slurm answers the requeue by
    sending TERM to every process of the batch job, scontrol included when it has not exited
    yet (seen in CI: the requeue done, but scontrol killed, and run.sub said "requeue
    refused"). The scontrol stub signals its whole process group as slurmstepd would."""
    bindir, env, calls = stubs
    (bindir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path}/scontrol"\n'
                                     'kill -TERM 0\nsleep 0.2\necho "requeue accepted"\n')
    (bindir / "scontrol").chmod(0o755)
    proc = run_sub(env, tmp_path, srun_config, own_session=True,
                   SCONTROL=str(bindir / "scontrol"), STUB_RC="137")
    assert (tmp_path / "scontrol").read_text().split() == ["requeue", "77"]
    assert "requeued (restart 1 of at most 3)" in proc.stdout, proc.stdout + proc.stderr
    assert "refused" not in proc.stdout and proc.returncode == 1, proc.stdout + proc.stderr
    # one experiment launched, not two: Slurm starts the job again
    assert [c["env"].get("RUN_DIR") for c in calls("srun") if "--mpi=none" in c["argv"]] == \
        [str(tmp_path / "logs" / "run_1")]


def scontrol_stub(bindir, tmp_path) -> dict:
    (bindir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path}/scontrol"\n')
    (bindir / "scontrol").chmod(0o755)
    return {"SCONTROL": str(bindir / "scontrol")}


def test_run_sub_never_reports_a_failed_experiment_as_succeeded_after_a_requeue(
        stubs, tmp_path, srun_config):
    """The probe's sequence (R1): an attempt fails with exit 3 after writing an aborted
    run_stop (a rank's failure before the first checkpoint), run.sub requeues the job; the
    requeued job skipped the experiment as "already done" and said "all 1 experiment(s)
    succeeded", exit 0. Now the experiment the job was requeued for runs again (its failed
    attempt kept aside): it succeeds, or it is said failed and the job exits 1."""
    bindir, env, calls = stubs
    env = dict(env, **scontrol_stub(bindir, tmp_path))
    logs = tmp_path / "logs"
    failing = dict(STUB_WRITE_LOG="1", STUB_LOG_STATUS="aborted", STUB_RC="3")
    proc = run_sub(env, tmp_path, srun_config, nexp="1", **failing)
    assert proc.returncode == 1 and "job 77 requeued (restart 1 of at most 3)" in proc.stdout, \
        proc.stdout + proc.stderr
    assert (tmp_path / "scontrol").read_text().split() == ["requeue", "77"]
    # the requeued job: the experiment runs again, from scratch, and fails again: said so
    proc = run_sub(env, tmp_path, srun_config, nexp="1", SLURM_RESTART_COUNT="3", **failing)
    assert "already done" not in proc.stdout and "succeeded" not in proc.stdout, proc.stdout
    assert "experiment 1/1: the job was requeued for it: running it again" in proc.stdout
    assert "the earlier attempt ended (run_stop, exit 3) before a checkpoint it could resume " \
           f"from: kept as {logs}/run_1.attempt1, starting anew" in proc.stdout
    assert proc.returncode == 1 and proc.stdout.splitlines()[-1] == (
        f"run.sub: done: 1 of 1 experiment(s) failed: 1 (see {logs}/run_<i>.out)"), proc.stdout
    assert len([c for c in calls("srun") if "--mpi=none" in c["argv"]]) == 2
    # a job restarted after that (by hand): the ended, failed experiment stays failed
    proc = run_sub(env, tmp_path, srun_config, nexp="1", SLURM_RESTART_COUNT="4")
    assert proc.returncode == 1, proc.stdout
    assert f"experiment 1/1: already ended, failed (exit 3 in {logs}/run_1.exit" in proc.stdout
    assert len([c for c in calls("srun") if "--mpi=none" in c["argv"]]) == 2   # not rerun
    # and one the requeue lets succeed is a success
    (logs / "run_1.requeue").write_text("")
    proc = run_sub(env, tmp_path, srun_config, nexp="1", SLURM_RESTART_COUNT="1",
                   STUB_WRITE_LOG="1")
    assert proc.returncode == 0 and proc.stdout.splitlines()[-1] == \
        "run.sub: done: all 1 experiment(s) succeeded", proc.stdout
    assert not (logs / "run_1.requeue").exists() and (logs / "run_1.attempt2").is_dir()


def test_run_sub_counts_experiments_an_earlier_attempt_ended_as_they_ended(stubs, tmp_path,
                                                                           srun_config):
    """A restarted job skips experiments that ended (run_stop) - and counts each as its exit
    file says: one that did not reach its target is no success in the job's last line."""
    _, env, calls = stubs
    proc = run_sub(env, tmp_path, srun_config, nexp="2", STUB_WRITE_LOG="1", STUB_RC="1",
                   STUB_LOG_STATUS="aborted")
    assert proc.returncode == 1 and "2 of 2 experiment(s) failed: 1 2" in proc.stdout
    (tmp_path / "logs" / "run_2.exit").write_text("0\n")   # say the second one succeeded
    proc = run_sub(env, tmp_path, srun_config, nexp="2", SLURM_RESTART_COUNT="1")
    assert "experiment 1/2: already ended, failed (exit 1" in proc.stdout, proc.stdout
    assert "experiment 2/2: already done" in proc.stdout
    assert proc.returncode == 1 and "done: 1 of 2 experiment(s) failed: 1 " in proc.stdout


@pytest.mark.parametrize("launcher", ["srun", "mpiexec"])
def test_run_sub_a_walltime_kill_is_no_lost_rank_and_is_not_requeued(stubs, tmp_path, launcher):
    """Exit 137 after system.walltime_minutes (timeout's KILL 30 s after its TERM; srun
    --time's) was reported as "a rank or node was lost" and requeued: a requeue gives it no
    more time. The same exit early in the experiment is a lost rank, and requeues."""
    bindir, env, calls = stubs
    (bindir / "date").write_text(DATE_STUB)
    (bindir / "date").chmod(0o755)
    env = dict(env, **scontrol_stub(bindir, tmp_path), STUB_CLOCK=str(tmp_path / "clock"))
    root = tmp_path / "root"   # mpiexec: PRESTO_ROOT's run_and_time.sh is the stub, under timeout
    root.mkdir()
    (root / "run_and_time.sh").symlink_to(bindir / "srun")
    config = write_config(tmp_path, f'[system]\nlauncher = "{launcher}"\nranks_per_node = 2\n'
                                    'walltime_minutes = 7\n[train]\nseed = 100\n'
                                    'global_batch_size = 16\n' + TINY_MODEL)
    extra = {"PRESTO_ROOT": str(root), "PYTHONPATH": str(ROOT)} if launcher == "mpiexec" \
        else {}
    proc = run_sub(env, tmp_path, config, nexp="1", STUB_RC="137", STUB_TAKES_S="450", **extra)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "experiment 1/1: exit 137: it ran past its limit, system.walltime_minutes=7" in \
        proc.stdout and "lost" not in proc.stdout, proc.stdout
    assert not (tmp_path / "scontrol").exists()
    (tmp_path / "clock").unlink()
    proc = run_sub(env, tmp_path, config, nexp="1", STUB_RC="137", **extra)
    assert "exit 137 (a rank or node was lost): job 77 requeued" in proc.stdout, proc.stdout


NEVER_EMPTY = ("TRAIN", "CMD", "SESSION", "TEES", "step", "BUDGET", "STATUS")   # set whole


def test_run_sub_shell_pitfalls(stubs, tmp_path, srun_config):
    """Read in the probe (R2): under set -u, bash before 4.4 takes an empty "${A[@]}" for an
    unbound variable (no overrides, one node) - every array that may be empty is expanded
    guarded; scontrol is $SCONTROL; several nodes under mpiexec without SLURM_JOB_NODELIST
    (a run by hand) are one sentence, not set -u's "unbound variable"."""
    import re
    for script in (RUN_SUB, ROOT / "run_and_time.sh"):
        text = "\n".join(line for line in script.read_text().splitlines()
                         if not line.lstrip().startswith("#"))
        bare = [m.group(0) for m in re.finditer(r'(?<!\+)"\$\{(\w+)\[@\]\}"', text)
                if m.group(1) not in NEVER_EMPTY]
        assert not bare, (script.name, bare)
    assert not re.search(r"^[^#]*(?<![\w$/\"])scontrol ", RUN_SUB.read_text(), re.M)
    bindir, env, calls = stubs
    config = write_config(tmp_path, '[system]\nlauncher = "mpiexec"\nnodes = 2\n'
                                    'ranks_per_node = 2\n[train]\nseed = 100\n'
                                    'global_batch_size = 16\n' + TINY_MODEL)
    proc = run_sub(env, tmp_path, config, nexp="1")
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "run.sub: error: system.nodes=2 with launcher mpiexec needs the allocation's nodes, "
        "and SLURM_JOB_NODELIST is unset: submit it with sbatch (python -m submission submit), "
        "or run it inside salloc"), proc.stderr
    (bindir / "scontrol").write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames n[1-2]" ] && '
                                     'printf "n1\\nn2\\n"\n')
    (bindir / "scontrol").chmod(0o755)
    root = tmp_path / "root"
    root.mkdir()
    (root / "run_and_time.sh").symlink_to(bindir / "srun")   # records its environment
    proc = run_sub(env, tmp_path, config, nexp="1", SLURM_JOB_NODELIST="n[1-2]",
                   SCONTROL=str(bindir / "scontrol"), PRESTO_ROOT=str(root),
                   PYTHONPATH=str(ROOT))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "logs" / "hostfile").read_text() == "n1\nn2\n"


def test_run_sub_a_stop_during_the_cache_clearing_launches_nothing(stubs, tmp_path, srun_config):
    """A TERM that lands while the page caches are dropped (an srun over every node): the
    trap runs once that srun ends, with no launch to pass the stop to - the experiment was
    launched anyway and ran its whole walltime. Now nothing is launched, exit 4."""
    import signal
    import time
    bindir, env, calls = stubs
    slow = bindir / "srun"
    slow.write_text(STUB.replace('if prog == "srun" and any("drop_caches" in a for a in argv):',
                                 'if prog == "srun" and any("drop_caches" in a for a in argv):\n'
                                 '    open(os.environ["STUB_CLEARING"], "w").close()\n'
                                 '    import time; time.sleep(1.5)'))
    clearing = tmp_path / "clearing"
    e = dict(env, CONFIG=str(srun_config), NEXP="2", LOGDIR=str(tmp_path / "logs"),
             PRESTO_ROOT=str(ROOT), SLURM_JOB_ID="77", STUB_CLEARING=str(clearing))
    proc = subprocess.Popen(["bash", str(RUN_SUB)], env=e, cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=default_stop_signals)
    deadline = time.time() + 60
    while not clearing.exists() and time.time() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 4, out + err
    assert not [c for c in calls("srun") if "--mpi=none" in c["argv"]], out   # nothing launched
    assert "stopped by SIGTERM between experiments" in out


def test_run_sub_failed_experiment_fails_the_job_but_not_the_others(stubs, tmp_path, srun_config):
    _, env, calls = stubs
    proc = run_sub(env, tmp_path, srun_config, nexp="2", STUB_RC="1")
    assert proc.returncode == 1
    assert "2 of 2 experiment(s) failed: 1 2" in proc.stdout
    assert (tmp_path / "logs" / "run_2.exit").read_text().strip() == "1"


def test_run_sub_container_flags(stubs, tmp_path, srun_config):
    _, env, calls = stubs
    proc = run_sub(env, tmp_path, srun_config, nexp="1", PRESTO_OVERRIDES="\n".join([
        "system.container_image=nvcr.io#nvidia/pytorch:24.04-py3",
        "system.container_mounts=/scratch:/scratch:ro", 'data.data_dir="/data/bert"',
        'system.srun_mpi="pmix"']))
    assert proc.returncode == 0, proc.stderr
    step = [c for c in calls("srun") if "--mpi=pmix" in c["argv"]][0]["argv"]
    logs = tmp_path / "logs"
    assert "--container-image=nvcr.io#nvidia/pytorch:24.04-py3" in step
    assert (f"--container-mounts={ROOT}:{ROOT},{logs}:{logs},/data/bert:/data/bert,"
            "/scratch:/scratch:ro") in step
    assert f"--container-workdir={ROOT}" in step


# ------------------------------------------------------------------------------ run.sub signals

SIGNAL_LAUNCHER = f"""#!{sys.executable}
# A launcher (srun, or run_and_time.sh under timeout) that "checkpoints" on a stop request:
# it records the signals it got, takes half a second, and exits 4 as the ranks would.
import json, os, signal, sys, time
if any("drop_caches" in a for a in sys.argv):
    sys.exit(0)
got = []
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
    signal.signal(s, lambda n, f: got.append(signal.Signals(n).name))
with open(os.environ["STUB_LAUNCHES"], "a") as f:
    f.write(json.dumps({{"pid": os.getpid(), "run_dir": os.environ.get("RUN_DIR")}}) + "\\n")
deadline = time.time() + 30
while not got and time.time() < deadline:
    time.sleep(0.05)
time.sleep(0.5)
with open(os.environ["STUB_SIGNALS"], "a") as f:
    f.write(" ".join(got) + "\\n")
sys.exit(4 if got else 0)
"""


@pytest.mark.parametrize("sig,launcher", [("TERM", "srun"), ("USR1", "srun"),
                                          ("INT", "mpiexec")])
def test_run_sub_passes_a_signal_to_the_experiment_and_starts_no_other(stubs, tmp_path, sig,
                                                                       launcher):
    """TERM/INT/HUP/USR1 to the batch script: the running experiment's launcher gets USR1
    (srun passes it to every task; under mpiexec it goes to run_and_time.sh, which passes it
    on), run.sub waits for it, starts no further experiment, leaves nothing running and exits
    4. USR1 - Slurm's warning before the time limit - also requeues the job."""
    import signal
    import time
    bindir, env, calls = stubs
    stub = bindir / "launcher"
    stub.write_text(SIGNAL_LAUNCHER)
    stub.chmod(0o755)
    root = tmp_path / "root"          # PRESTO_ROOT whose run_and_time.sh is the stub (mpiexec)
    root.mkdir()
    (root / "run_and_time.sh").symlink_to(stub)
    (bindir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/scontrol\n")
    (bindir / "scontrol").chmod(0o755)
    config = write_config(tmp_path, f'[system]\nlauncher = "{launcher}"\nranks_per_node = 2\n'
                                    'walltime_minutes = 7\n[train]\nseed = 100\n'
                                    'global_batch_size = 16\n' + TINY_MODEL)
    launches, got = tmp_path / "launches", tmp_path / "got"
    e = dict(env, CONFIG=str(config), NEXP="2", LOGDIR=str(tmp_path / "logs"),
             PRESTO_ROOT=str(root if launcher == "mpiexec" else ROOT), SLURM_JOB_ID="77",
             SRUN=str(stub), SCONTROL=str(bindir / "scontrol"), PYTHONPATH=str(ROOT),
             STUB_LAUNCHES=str(launches), STUB_SIGNALS=str(got))
    proc = subprocess.Popen(["bash", str(RUN_SUB)], env=e, cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=default_stop_signals)
    deadline = time.time() + 60
    while not launches.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert launches.exists(), "the experiment never started"
    proc.send_signal(getattr(signal, f"SIG{sig}"))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 4, out + err
    (launch,) = [json.loads(x) for x in launches.read_text().splitlines()]   # one, not two
    assert launch["run_dir"] == str(tmp_path / "logs" / "run_1")
    assert got.read_text().split() == ["SIGUSR1"]
    assert not Path(f"/proc/{launch['pid']}").exists()                        # nothing left
    assert (tmp_path / "logs" / "run_1.exit").read_text().strip() == "4"
    assert f"got SIG{sig}" in out
    requeued = tmp_path / "scontrol"
    if sig == "USR1":
        assert requeued.read_text().split() == ["requeue", "77"] and "requeued" in out
    else:
        assert not requeued.exists() and "submit --resume" in out
