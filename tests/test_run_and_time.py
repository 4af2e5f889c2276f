"""run_and_time.sh: fail-fast checks, the launch command per launcher, the RESULT line.

PYTHON, MPIEXEC, MPIRUN and SRUN are stub scripts that record their argv and exit with
$STUB_RC; the PYTHON stub passes `-m runtime.config`, `-m runtime.train.memory` and `-m
submission.launchers` on to the real interpreter, so the launch values really come from the config and the launch command from
the launchers' table (whose rows tests/test_launchers.py checks one by one). Everything lives under a directory with a space in its name
to prove the quoting. The real end-to-end run is tested elsewhere (it trains).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.launch import default_stop_signals

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "run_and_time.sh"
RESULT_RE = re.compile(r"^RESULT,bert,(\d+),(\d+),(\S+),(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (AM|PM))$")

STUB = f"""#!{sys.executable}
import json, os, sys
argv = sys.argv[1:]
if argv[:2] in (["-m", "runtime.config"], ["-m", "submission.launchers"],
                ["-m", "runtime.train.memory"]):
    os.execv({sys.executable!r}, [{sys.executable!r}] + argv)
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps({{"prog": os.path.basename(sys.argv[0]), "argv": argv}}) + "\\n")
sys.exit(int(os.environ.get("STUB_RC", "0")))
"""


@pytest.fixture
def sandbox(tmp_path):
    root = tmp_path / "with space"
    bindir = root / "bin dir"
    bindir.mkdir(parents=True)
    stubs = {}
    for name in ("python", "mpiexec", "mpirun", "srun"):
        path = bindir / name
        path.write_text(STUB)
        path.chmod(0o755)
        stubs[name] = str(path)
    return root, stubs


def write_config(root: Path, launcher: str, nodes: int = 1, ranks: int = 2, seed: int = 7,
                 name: str = "config_TEST_1x2x8x1.toml") -> Path:
    path = root / "my configs" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'[system]\nlauncher = "{launcher}"\nnodes = {nodes}\nranks_per_node = {ranks}\n'
                    f'device = "cpu"\n[train]\nseed = {seed}\nglobal_batch_size = 16\n'
                    f'[model]\nhidden_size = 64\nnum_hidden_layers = 1\n'
                    f'num_attention_heads = 2\nintermediate_size = 128\n')
    return path


def run(sandbox, config: Path | None, *args: str, rc: int = 0, **env_extra):
    root, stubs = sandbox
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_")) and k not in (
               "CONFIG", "SEED", "RUN_DIR", "LOGDIR", "HOSTFILE", "MASTER_ADDR", "MASTER_PORT",
               "TORCHRUN")}
    env.update(PYTHON=stubs["python"], MPIEXEC=stubs["mpiexec"], MPIRUN=stubs["mpirun"],
               SRUN=stubs["srun"], STUB_LOG=str(root / "calls.jsonl"), STUB_RC=str(rc),
               LOGDIR=str(root / "log dir"), USER="tester")
    if config is not None:
        env["CONFIG"] = str(config)
    env.update(env_extra)
    proc = subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True,
                          timeout=60, cwd=root)
    log = root / "calls.jsonl"
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    log.unlink(missing_ok=True)
    return proc, calls


def result_line(proc) -> re.Match:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT,")]
    assert len(lines) == 1, proc.stdout + proc.stderr
    m = RESULT_RE.match(lines[0])
    assert m, lines[0]
    return m


def train_args(config: Path, seed: int, argv: list[str]) -> None:
    """The submission.train part of a launch: config, seed and output dir, each one argv item."""
    i = argv.index("submission.train")
    assert argv[i - 1] == "-m"
    rest = argv[i + 1:]
    assert rest[:4] == ["--config", str(config), "--set", f"train.seed={seed}"]
    assert rest[4] == "--set" and rest[5].startswith("train.output_dir=")
    out = rest[5].split("=", 1)[1]
    assert out.startswith(str(config.parents[1] / "log dir") + "/"), out
    assert f"{config.stem}_seed{seed}" in out


def test_missing_config_fails_and_names_it(sandbox):
    root, _ = sandbox
    missing = root / "no such" / "config_X_1x1x1x1.toml"
    proc, calls = run(sandbox, missing)
    assert proc.returncode != 0
    assert str(missing) in proc.stderr and "CONFIG" in proc.stderr
    assert not calls and "RESULT" not in proc.stdout


def test_default_config_is_the_cpu_one(sandbox):
    default = REPO / "submission" / "configs" / "config_CPU_1x2x32x1.toml"
    proc, calls = run(sandbox, None)
    if not default.exists():
        assert proc.returncode != 0 and str(default) in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    assert any(str(default) in c["argv"] for c in calls)


def test_mpiexec_command_line(sandbox):
    root, stubs = sandbox
    cfg = write_config(root, "mpiexec", ranks=2)
    proc, calls = run(sandbox, cfg, SEED="123")
    assert proc.returncode == 0, proc.stderr
    assert [c["prog"] for c in calls] == ["mpiexec"]
    argv = calls[0]["argv"]
    assert argv[:3] == ["-n", "2", stubs["python"]]
    train_args(cfg, 123, argv)
    m = result_line(proc)
    assert m.group(1) == "123" and m.group(3) == "tester"
    assert "STARTING TIMING RUN AT" in proc.stdout and "ENDING TIMING RUN AT" in proc.stdout


def test_mpirun_command_line(sandbox):
    root, stubs = sandbox
    cfg = write_config(root, "mpirun", ranks=4)
    proc, calls = run(sandbox, cfg)
    assert proc.returncode == 0, proc.stderr
    argv = calls[0]["argv"]
    assert calls[0]["prog"] == "mpirun"
    assert argv[:3] == ["-n", "4", "--oversubscribe"]
    assert ("--allow-run-as-root" in argv) == (os.geteuid() == 0)
    assert argv[argv.index("-m") - 1] == stubs["python"]
    train_args(cfg, 7, argv)
    assert result_line(proc).group(1) == "7"


def test_torchrun_command_line(sandbox):
    root, _ = sandbox
    cfg = write_config(root, "torchrun", ranks=2)
    proc, calls = run(sandbox, cfg)
    assert proc.returncode == 0, proc.stderr
    assert [c["prog"] for c in calls] == ["python"]
    argv = calls[0]["argv"]
    assert argv[:5] == ["-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
                        "--standalone"]
    assert argv[5:7] == ["-m", "submission.train"]
    train_args(cfg, 7, argv)
    result_line(proc)


def test_torchrun_multinode_needs_master_addr(sandbox):
    root, _ = sandbox
    cfg = write_config(root, "torchrun", nodes=2, ranks=2, name="config_TEST_2x2x4x1.toml")
    proc, calls = run(sandbox, cfg)
    assert proc.returncode == 2 and not calls   # bad input, with the launchers' table's words
    assert "run_and_time.sh: system.nodes=2 needs MASTER_ADDR (the rendezvous host) for " \
           "torchrun" in proc.stderr
    proc, calls = run(sandbox, cfg, MASTER_ADDR="node0", MASTER_PORT="1234")
    assert proc.returncode == 0, proc.stderr
    argv = calls[0]["argv"]
    assert "--nnodes=2" in argv and "--rdzv_endpoint=node0:1234" in argv
    assert "--standalone" not in argv


def test_srun_inside_a_job_step_runs_the_rank_directly(sandbox):
    root, _ = sandbox
    cfg = write_config(root, "srun", ranks=2)
    proc, calls = run(sandbox, cfg, SLURM_PROCID="0", SLURM_JOB_ID="77", SLURM_STEP_ID="3")
    assert proc.returncode == 0, proc.stderr
    assert [c["prog"] for c in calls] == ["python"]
    argv = calls[0]["argv"]
    assert argv[:2] == ["-m", "submission.train"]
    train_args(cfg, 7, argv)
    out = next(a for a in argv if a.startswith("train.output_dir="))
    assert out.endswith("_job77.3")   # the same output dir on every task of the step
    result_line(proc)
    # Other tasks train but leave the RESULT line to task 0.
    proc, calls = run(sandbox, cfg, SLURM_PROCID="1", SLURM_JOB_ID="77", SLURM_STEP_ID="3")
    assert proc.returncode == 0 and calls and "RESULT," not in proc.stdout


@pytest.mark.parametrize("batch_shell", [False, True])
def test_srun_outside_a_job_step_launches_tasks(sandbox, batch_shell):
    """Also from an sbatch script's own shell, which has SLURM_PROCID=0 but is no task."""
    root, stubs = sandbox
    cfg = write_config(root, "srun", nodes=2, ranks=4, name="config_TEST_2x4x2x1.toml")
    env = {"SLURM_PROCID": "0", "SLURM_JOB_ID": "77"} if batch_shell else {}
    proc, calls = run(sandbox, cfg, **env)
    assert proc.returncode == 0, proc.stderr
    assert [c["prog"] for c in calls] == ["srun"]
    argv = calls[0]["argv"]
    # --kill-on-bad-exit: a task that dies (even before the runtime's guard) ends the step
    assert argv[:4] == ["--nodes=2", "--ntasks-per-node=4", "--kill-on-bad-exit=1", stubs["python"]]
    train_args(cfg, 7, argv)
    result_line(proc)


def test_launcher_failure_exits_nonzero_without_result(sandbox):
    root, _ = sandbox
    cfg = write_config(root, "mpiexec")
    proc, calls = run(sandbox, cfg, rc=1)
    assert proc.returncode == 1
    assert calls and "RESULT" not in proc.stdout
    assert "FAILED" in proc.stderr and "status 1" in proc.stderr


def test_extra_overrides_are_passed_and_validated(sandbox):
    root, _ = sandbox
    cfg = write_config(root, "mpiexec")
    proc, calls = run(sandbox, cfg, "--", "optim.lr=0.001", "train.log_every_steps=5")
    assert proc.returncode == 0, proc.stderr
    argv = calls[0]["argv"]
    assert argv[-4:] == ["--set", "optim.lr=0.001", "--set", "train.log_every_steps=5"]
    # An override can change the launch itself: it is applied before the values are read.
    proc, calls = run(sandbox, cfg, "--", "system.launcher=mpirun")
    assert proc.returncode == 0 and calls[0]["prog"] == "mpirun"
    # A misspelt key stops before anything launches, with runtime.config's message.
    proc, calls = run(sandbox, cfg, "--", "optim.lrr=1")
    assert proc.returncode != 0 and not calls and "optim.lrr" in proc.stderr
    # Not an override at all.
    proc, calls = run(sandbox, cfg, "--", "lr")
    assert proc.returncode != 0 and not calls and "'lr'" in proc.stderr


def test_multinode_mpi_needs_hostfile(sandbox):
    root, _ = sandbox
    cfg = write_config(root, "mpiexec", nodes=2, ranks=2, name="config_TEST_2x2x4x1.toml")
    proc, calls = run(sandbox, cfg)
    assert proc.returncode == 2 and "HOSTFILE" in proc.stderr and not calls
    hosts = root / "hosts file"
    hosts.write_text("a\nb\n")
    proc, calls = run(sandbox, cfg, HOSTFILE=str(hosts))
    assert proc.returncode == 0, proc.stderr
    assert calls[0]["argv"][:4] == ["-n", "4", "-f", str(hosts)]
    # Relative to the directory run_and_time.sh is called from (run() calls it from root).
    proc, calls = run(sandbox, cfg, HOSTFILE="hosts file")
    assert proc.returncode == 0, proc.stderr
    assert calls[0]["argv"][:4] == ["-n", "4", "-f", str(hosts)]


def test_unknown_launcher_is_refused(sandbox):
    root, _ = sandbox
    cfg = write_config(root, "ssh")
    proc, calls = run(sandbox, cfg)
    assert proc.returncode != 0 and not calls and "system.launcher='ssh'" in proc.stderr


# ------------------------------------------------------------------ run directories, signals

def test_runs_started_in_the_same_second_get_distinct_directories(sandbox):
    root, _ = sandbox
    cfg = write_config(root, "mpiexec")
    procs, dirs = [], set()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_"))
           and k not in ("RUN_DIR", "SEED")}
    _, stubs = sandbox
    env.update(PYTHON=stubs["python"], MPIEXEC=stubs["mpiexec"], CONFIG=str(cfg),
               LOGDIR=str(root / "log dir"), STUB_LOG=str(root / "calls.jsonl"))
    for _ in range(3):
        procs.append(subprocess.Popen([str(SCRIPT)], env=env, cwd=root, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        dirs.add(re.search(r", output (.+)$", err, re.M).group(1))
    assert len(dirs) == 3 and all(Path(d).is_dir() for d in dirs)


def test_train_output_dir_override_is_the_run_directory(sandbox):
    root, _ = sandbox
    cfg = write_config(root, "mpiexec")
    proc, calls = run(sandbox, cfg, "--", f'train.output_dir="{root}/mine"')
    assert proc.returncode == 0, proc.stderr
    argv = calls[0]["argv"]
    outs = [a for a in argv if a.startswith("train.output_dir=")]
    assert outs == [f"train.output_dir={root}/mine"], argv   # one place, not two
    assert f"output {root}/mine" in proc.stderr
    proc, calls = run(sandbox, cfg, "--", "train.output_dir=/a", RUN_DIR="/b")
    assert proc.returncode == 2 and not calls and "two places for one run" in proc.stderr


SIGNAL_STUB = f"""#!{sys.executable}
import os, signal, sys, time
got = []
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
    signal.signal(s, lambda n, f: got.append(signal.Signals(n).name))
open(os.environ["STUB_READY"], "w").close()
deadline = time.time() + 30
while not got and time.time() < deadline:
    time.sleep(0.05)
time.sleep(0.5)   # "checkpointing": run_and_time.sh must wait for us
for i in range(2000):   # the ranks still talk after the signal (through the launcher's pipes)
    print(f"stub still writing {{i}}", flush=True)
with open(os.environ["STUB_SIGNALS"], "a") as f:
    f.write(" ".join(got) + "\\n")
sys.exit(4)
"""


@pytest.mark.parametrize("sig,launcher,forwarded,group", [
    ("TERM", "mpiexec", "SIGUSR1", False), ("INT", "mpiexec", "SIGUSR1", False),
    ("HUP", "mpirun", "SIGUSR1", False), ("USR1", "mpiexec", "SIGUSR1", False),
    ("INT", "mpiexec", "SIGINT SIGUSR1", True), ("TERM", "mpiexec", "SIGTERM SIGUSR1", True)])
def test_signals_reach_the_launcher_and_the_script_waits_for_it(sandbox, sig, launcher,
                                                                forwarded, group):
    """TERM/INT/HUP/USR1 to run_and_time.sh: the launcher gets the stop request (USR1, which
    mpiexec, mpirun and srun forward to every rank), the script waits for it to finish and
    exits with its status (4: stopped after a checkpoint); no RESULT line. ``group``: the
    signal goes to every process of the script's group (Ctrl-C in a terminal, systemd's
    TERM): the launcher's output, still flowing after it, reaches the terminal and
    launcher.log - nothing in the pipeline died of the signal."""
    root, stubs = sandbox
    stub = root / "bin dir" / "launcher"
    stub.write_text(SIGNAL_STUB)
    stub.chmod(0o755)
    cfg = write_config(root, launcher)
    ready = root / "ready"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_"))
           and k not in ("RUN_DIR", "SEED")}
    env.update(PYTHON=stubs["python"], MPIEXEC=str(stub), MPIRUN=str(stub), CONFIG=str(cfg),
               LOGDIR=str(root / "log dir"), STUB_LOG=str(root / "calls.jsonl"),
               STUB_SIGNALS=str(root / "got"), STUB_READY=str(ready))
    proc = subprocess.Popen([str(SCRIPT)], env=env, cwd=root, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=default_stop_signals)
    deadline = time.time() + 30
    while not ready.exists() and time.time() < deadline:
        time.sleep(0.05)
    if group:
        os.killpg(proc.pid, getattr(signal, f"SIG{sig}"))
    else:
        proc.send_signal(getattr(signal, f"SIG{sig}"))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 4, err[-3000:]
    assert sorted((root / "got").read_text().split()) == sorted(forwarded.split())
    assert f"got SIG{sig}" in err and "RESULT," not in out
    assert "stub still writing 1999" in out
    (log,) = (root / "log dir").glob("*/launcher.log")
    assert "stub still writing 1999" in log.read_text()


@pytest.fixture
def read_only_dir(tmp_path):
    """A read-only file system (a tmpfs mounted ro: as root, permission bits stop nothing)."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs",
                                            str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    yield path
    subprocess.run(["umount", str(path)], capture_output=True)


def test_a_run_directory_that_cannot_take_the_run_stops_the_script_before_launch(
        sandbox, tmp_path, read_only_dir):
    """RUN_DIR naming a file, RUN_DIR or LOGDIR on a read-only file system, and RUN_DIR held
    by a live run: exit 2 with the reason (the OS's words), the launcher never started, and
    nothing written into the live run's directory."""
    import fcntl
    root, _ = sandbox
    config = write_config(root, "mpiexec")
    a_file = tmp_path / "a file"
    a_file.write_text("mine\n")
    proc, calls = run(sandbox, config, RUN_DIR=str(a_file))
    assert proc.returncode == 2 and "exists and is not a directory" in proc.stderr, proc.stderr
    assert calls == [] and a_file.read_text() == "mine\n"
    proc, calls = run(sandbox, config, RUN_DIR=str(read_only_dir / "run"))
    assert proc.returncode == 2 and calls == [], proc.stderr
    assert "cannot create RUN_DIR" in proc.stderr and "Read-only file system" in proc.stderr
    proc, calls = run(sandbox, config, LOGDIR=str(read_only_dir / "logs"))
    assert proc.returncode == 2 and calls == [], proc.stderr
    assert "cannot create LOGDIR" in proc.stderr and "Read-only file system" in proc.stderr
    live = tmp_path / "live run"
    live.mkdir()
    (live / "launcher.log").write_text("the live run's own lines\n")
    with open(live / ".lock", "a+") as lock:
        lock.write("pid 4242 on node7 since 2026-11-24 10:00:00\n")
        lock.flush()
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        proc, calls = run(sandbox, config, RUN_DIR=str(live))
    assert proc.returncode == 2 and calls == [], proc.stderr
    assert "is in use by another run (pid 4242 on node7" in proc.stderr, proc.stderr
    assert sorted(p.name for p in live.iterdir()) == [".lock", "launcher.log"]
    assert (live / "launcher.log").read_text() == "the live run's own lines\n"


def test_a_run_that_cannot_fit_in_memory_is_refused_before_launch(sandbox):
    """BERT-base at a local batch of 224 (what an almost empty config once meant): exit 2
    with the estimate and the largest micro-batch that fits; no launcher started."""
    root, _ = sandbox
    config = write_config(root, "mpiexec")
    big = ["model.hidden_size=768", "model.num_hidden_layers=12",
           "model.num_attention_heads=12", "model.intermediate_size=3072",
           "train.global_batch_size=448"]
    proc, calls = run(sandbox, config, "--", *big)
    assert proc.returncode == 2 and calls == [], proc.stderr
    assert "this run cannot fit in memory: each rank needs about" in proc.stderr, proc.stderr
    assert "largest micro-batch that fits is about" in proc.stderr


# ------------------------------------------------------------------ bad input, nothing left

@pytest.mark.parametrize("seed", ["-1", "abc", "1.5", "4294967296", "99999999999999999999"])
def test_a_seed_that_is_not_a_whole_number_in_range_is_refused_naming_seed(sandbox, seed):
    """SEED=-1 reached numpy in every rank: exit 3 with a traceback."""
    root, _ = sandbox
    cfg = write_config(root, "mpiexec")
    proc, calls = run(sandbox, cfg, SEED=seed)
    assert proc.returncode == 2 and f"SEED='{seed}'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not calls
    assert not (root / "log dir").exists()
    proc, calls = run(sandbox, cfg, SEED="4294967295")   # the largest numpy takes
    assert proc.returncode == 0 and calls, proc.stderr


def test_an_override_holding_a_line_break_is_refused_naming_it(sandbox):
    """`-- $'train.log_every_steps=5\\ntrain.max_steps=2'` is one argument: TOML read it as
    two lines and the second key was silently dropped."""
    root, _ = sandbox
    cfg = write_config(root, "mpiexec")
    proc, calls = run(sandbox, cfg, "--", "train.log_every_steps=5\ntrain.max_steps=2")
    assert proc.returncode == 2 and not calls, proc.stderr
    assert "train.max_steps" in proc.stderr and "line break" in proc.stderr, proc.stderr
    assert not (root / "log dir").exists()
    proc, calls = run(sandbox, cfg, "--", 'train.output_dir="a\nb"')
    assert proc.returncode == 2 and not calls and "line break" in proc.stderr, proc.stderr


def test_a_refused_run_leaves_no_empty_run_directory(sandbox):
    """A run refused after run_and_time.sh made its directory - by the launchers' checks or
    by the ranks (exit 2: another run's checkpoints, a bad data set) - leaves no empty run
    directory behind; a directory that held something before is kept as it was."""
    root, _ = sandbox
    logdir = root / "log dir"
    cfg = write_config(root, "mpiexec")
    proc, calls = run(sandbox, cfg, rc=2)          # the ranks refused their input
    assert proc.returncode == 2 and calls, proc.stderr
    assert list(logdir.iterdir()) == [], proc.stderr
    assert "removed the run directory" in proc.stderr, proc.stderr
    wide = write_config(root, "mpiexec", nodes=2, ranks=2, name="config_TEST_2x2x4x1.toml")
    proc, calls = run(sandbox, wide)               # refused by the launcher's row: no HOSTFILE
    assert proc.returncode == 2 and not calls and "HOSTFILE" in proc.stderr
    assert list(logdir.iterdir()) == [], proc.stderr
    mine = root / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    proc, calls = run(sandbox, cfg, rc=2, RUN_DIR=str(mine))
    assert proc.returncode == 2 and (mine / "notes.txt").read_text() == "mine"
    proc, calls = run(sandbox, cfg, rc=3)          # a failed run's directory is evidence
    assert proc.returncode == 3 and len(list(logdir.iterdir())) == 1
