"""run_and_time.sh: fail-fast checks, the launch command per launcher, the RESULT line.

PYTHON, MPIEXEC, MPIRUN and SRUN are stub scripts that record their argv and exit with $STUB_RC;
the PYTHON stub passes `-m runtime.config`, `-m runtime.train.memory`, `-m
submission.launchers`, `-m submission.session` (which starts the launcher) and `-m
submission.shm` (which cleans up after it) on to the real interpreter, so the launch values
really come from the config and the launch command from the launchers' table (whose rows
tests/unit/test_launchers.py checks one by one). Everything lives under a directory with a space
in its name to prove the quoting. The real end-to-end run is tested elsewhere (it trains).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.launch import default_stop_signals

pytestmark = pytest.mark.slow   # tests/e2e: every test here is slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "run_and_time.sh"
RESULT_RE = re.compile(r"^RESULT,bert,(\d+),(\d+),(\S+),(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (AM|PM))$")

STUB = f"""#!{sys.executable}
import json, os, sys
argv = sys.argv[1:]
if argv[:2] == ["-m", "runtime.config"] and os.environ.get("STUB_CONFIG_DELAY"):
    open(os.environ["STUB_CONFIG_STARTED"], "w").close()
    import time
    time.sleep(float(os.environ["STUB_CONFIG_DELAY"]))
if argv[:2] in (["-m", "runtime.config"], ["-m", "submission.launchers"],
                ["-m", "runtime.train.memory"], ["-m", "submission.session"],
                ["-m", "submission.shm"]):
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
    assert argv[:5] == ["-m", "submission.torchrun", "--nnodes=1", "--nproc_per_node=2",
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


def test_a_run_its_ranks_refuse_leaves_no_run_directory_behind(sandbox, tmp_path):
    """Exit 2 from the launch (the ranks refused the run: bad input): the fresh run directory
    run_and_time.sh made holds only its own files (launcher.log, the lock) and goes; one the
    user named and that existed stays, as does anything the ranks wrote."""
    root, _ = sandbox
    cfg = write_config(root, "mpiexec")
    proc, calls = run(sandbox, cfg, rc=2)
    assert proc.returncode == 2 and calls, proc.stderr
    assert not list((root / "log dir").iterdir()), proc.stderr
    assert "removed " in proc.stderr and "the refused run left nothing in it" in proc.stderr
    mine = tmp_path / "mine"
    mine.mkdir()
    proc, calls = run(sandbox, cfg, rc=2, RUN_DIR=str(mine))
    assert proc.returncode == 2 and mine.is_dir()


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
# A launcher that behaves like MPICH's mpiexec with two ranks: it records every signal it gets
# and, as a rank before its handlers are in, dies of a stop signal that comes too early
# ($STUB_ARM_DELAY seconds after the start). Then it says it can take a stop request as a rank
# does (a file per rank in the directory after --signals-ready), waits for one, "checkpoints"
# and exits 4 - or exits 4 after $STUB_WAIT s without one.
import os, signal, sys, time
argv = sys.argv[1:]
with open(os.environ["STUB_STARTED"], "a") as f:
    f.write(f"{{os.getpid()}}\\n")
time.sleep(float(os.environ.get("STUB_ARM_DELAY", "0")))
got = []
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
    signal.signal(s, lambda n, f: got.append(signal.Signals(n).name))
if "--signals-ready" in argv:
    ready = argv[argv.index("--signals-ready") + 1]
    for rank in range(int(argv[argv.index("-n") + 1])):
        open(os.path.join(ready, f"stub.{{os.getpid()}}.{{rank}}"), "w").close()
open(os.environ["STUB_READY"], "w").close()
deadline = time.time() + float(os.environ.get("STUB_WAIT", "30"))
while not got and time.time() < deadline:
    time.sleep(0.05)
time.sleep(0.5)   # "checkpointing": run_and_time.sh must wait for us; a repeat may come now
for i in range(2000):   # the ranks still talk after the signal (through the launcher's pipes)
    print(f"stub still writing {{i}}", flush=True)
with open(os.environ["STUB_SIGNALS"], "a") as f:
    f.write(" ".join(got) + "\\n")
sys.exit(4)
"""


def signal_stub(sandbox, launcher: str = "mpiexec", **extra) -> tuple[dict, Path]:
    """The environment of a run_and_time.sh run whose launcher is SIGNAL_STUB, and the
    directory its STUB_* files go to."""
    root, stubs = sandbox
    stub = root / "bin dir" / "launcher"
    if not stub.exists():
        stub.write_text(SIGNAL_STUB)
        stub.chmod(0o755)
    cfg = write_config(root, launcher)
    files = root / "stub files"
    files.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_"))
           and k not in ("RUN_DIR", "SEED")}
    env.update(PYTHON=stubs["python"], MPIEXEC=str(stub), MPIRUN=str(stub), CONFIG=str(cfg),
               LOGDIR=str(root / "log dir"), STUB_LOG=str(root / "calls.jsonl"),
               STUB_SIGNALS=str(files / "got"), STUB_READY=str(files / "ready"),
               STUB_STARTED=str(files / "started"), **extra)
    return env, files


def start_script(sandbox, env: dict, *args: str) -> subprocess.Popen:
    """run_and_time.sh in the background, leading its own process group (as a job in a
    terminal), the stop signals at their defaults."""
    root, _ = sandbox
    return subprocess.Popen([str(SCRIPT), *args], env=env, cwd=root, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, preexec_fn=default_stop_signals)


def wait_for(path: Path, proc: subprocess.Popen | None = None, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while not path.exists() and time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.02)
    if not path.exists():
        out, err = proc.communicate(timeout=30) if proc is not None else ("", "")
        pytest.fail(f"{path.name} never came:\n{out[-2000:]}\n{err[-3000:]}")


def stub_pids(files: Path) -> list[int]:
    started = files / "started"
    return [int(x) for x in started.read_text().split()] if started.exists() else []


def end_stubs(files: Path) -> None:
    """Kill what is left of the stub launchers this test started (by their recorded PIDs)."""
    for pid in stub_pids(files):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize("sigs,launcher,group", [
    ("TERM", "mpiexec", False), ("INT", "mpiexec", False), ("HUP", "mpirun", False),
    ("USR1", "mpiexec", False), ("TERM TERM", "mpiexec", False),
    ("INT", "mpiexec", True), ("INT INT", "mpiexec", True), ("HUP", "mpiexec", True),
    ("TERM", "mpiexec", True), ("INT HUP TERM", "mpirun", True)])
def test_signals_reach_the_launcher_once_and_the_script_waits_for_it(sandbox, sigs, launcher,
                                                                     group):
    """TERM/INT/HUP/USR1 to run_and_time.sh, once or repeated: the launcher gets exactly one
    stop request (USR1, which mpiexec, mpirun and srun forward to every rank) and nothing
    else, the script waits for it to finish and exits with its status (4: stopped after a
    checkpoint); no RESULT line. ``group``: the signals go to every process of the script's
    process group (Ctrl-C in a terminal, twice; a closed terminal's HUP; systemd's TERM): the
    launcher, in a session of its own, never sees them - MPICH's mpiexec aborts the job on a
    second SIGINT and dies of SIGHUP - and its output, still flowing after them, reaches the
    terminal and launcher.log: nothing in the pipeline died of a signal."""
    try:
        _signals_reach_the_launcher_once(sandbox, sigs, launcher, group)
    finally:
        end_stubs(sandbox[0] / "stub files")


def _signals_reach_the_launcher_once(sandbox, sigs, launcher, group):
    root, _ = sandbox
    env, files = signal_stub(sandbox, launcher)
    proc = start_script(sandbox, env)
    wait_for(files / "ready", proc)
    for sig in sigs.split():
        if group:
            os.killpg(proc.pid, getattr(signal, f"SIG{sig}"))
        else:
            proc.send_signal(getattr(signal, f"SIG{sig}"))
        time.sleep(0.1)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 4, err[-3000:]
    assert (files / "got").read_text().split() == ["SIGUSR1"], err[-3000:]
    first = sigs.split()[0]
    assert f"got SIG{first}" in err and "RESULT," not in out
    # a stop the ranks answered is no failure: no FAILED line (issue 46)
    assert "stopped by a signal: " in err and "FAILED" not in err, err[-3000:]
    assert "stub still writing 1999" in out
    (log,) = (root / "log dir").glob("*/launcher.log")
    assert "stub still writing 1999" in log.read_text()


SHM_STUB = f"""#!{sys.executable}
# A launcher whose two "ranks" each map a file in /dev/shm, as MPICH's ranks do, note it where
# run_and_time.sh says (--shm-notes: submission.shm.note's format), then die without cleaning
# up - as a job ended by MPI_Abort does - and exit 3.
import os, socket, sys
argv = sys.argv[1:]
notes = argv[argv.index("--shm-notes") + 1]
for rank in range(2):
    path = os.environ["STUB_SHM"] + f"_{{rank}}"
    open(path, "wb").write(b"\\0" * 4096)
    with open(os.path.join(notes, f"{{socket.gethostname()}}.{{os.getpid() + rank}}"), "w") as f:
        f.write(path + "\\n")
sys.exit(3)
"""


def test_the_ranks_files_in_dev_shm_are_removed_once_the_launch_ends(sandbox):
    """MPICH leaves its ranks' /dev/shm file behind when a job ends without MPI_Finalize (a
    rank's failure: 10 of 10 such runs leaked 2 MB each, issue 46): run_and_time.sh removes
    the files its ranks noted once the launcher has ended - and no other: a file beside them
    that no rank of this launch noted (another run's) stays."""
    import uuid
    root, stubs = sandbox
    stub = root / "bin dir" / "shm-launcher"
    stub.write_text(SHM_STUB)
    stub.chmod(0o755)
    tag = f"/dev/shm/mpich_shm_presto_test_{uuid.uuid4().hex[:12]}"
    other = Path(f"{tag}_other")
    other.write_bytes(b"another run's")
    try:
        proc, _ = run(sandbox, write_config(root, "mpiexec"), MPIEXEC=str(stub), STUB_SHM=tag)
        assert proc.returncode == 3, proc.stderr
        assert not Path(f"{tag}_0").exists() and not Path(f"{tag}_1").exists(), proc.stderr
        assert other.read_bytes() == b"another run's"
        assert not list((root / "log dir").glob("*/.armed")), proc.stderr   # notes gone too
    finally:
        for path in (Path(f"{tag}_0"), Path(f"{tag}_1"), other):
            path.unlink(missing_ok=True)


def test_a_closed_terminal_stops_the_run_like_one_sigterm(sandbox):
    """run_and_time.sh in a real terminal (a pty whose session it leads), which is then closed:
    the kernel sends SIGHUP to the terminal's foreground process group and every later write
    to the terminal fails (EIO). The launcher gets one stop request and nothing else, and the
    script still exits with the run's 4 (a failed write once made it exit 1 after the ranks
    had stopped)."""
    import pty
    root, _ = sandbox
    env, files = signal_stub(sandbox)
    pid, fd = pty.fork()
    if pid == 0:   # the child: the session leader of the new terminal
        try:
            default_stop_signals()
            os.chdir(root)
            os.execve(str(SCRIPT), [str(SCRIPT)], env)
        finally:
            os._exit(127)
    try:
        deadline = time.time() + 30
        while not (files / "ready").exists() and time.time() < deadline:
            with contextlib.suppress(OSError):
                os.read(fd, 65536) if select.select([fd], [], [], 0.05)[0] else None
        assert (files / "ready").exists(), "the launcher never started"
        os.close(fd)   # the terminal is closed
        fd = -1
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 4
        assert (files / "got").read_text().split() == ["SIGUSR1"]
    finally:
        if fd >= 0:
            os.close(fd)
        end_stubs(files)


def test_a_stop_request_during_start_up_waits_until_the_ranks_can_take_it(sandbox):
    """TERM 0.1 s after the launch, while the ranks are still starting (a rank dies of a stop
    signal that arrives before its handlers are in: MPICH's mpiexec then reports a BAD
    TERMINATION and the run exits 3): run_and_time.sh holds the request until every rank has
    said it can take one, then passes it on once; the run stops with 4."""
    try:
        env, files = signal_stub(sandbox, STUB_ARM_DELAY="1.5")
        proc = start_script(sandbox, env)
        wait_for(files / "started", proc)
        time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 4, err[-3000:]
        assert (files / "got").read_text().split() == ["SIGUSR1"], err[-3000:]
        assert "got SIGTERM" in err and "RESULT," not in out
    finally:
        end_stubs(files)


def test_a_signal_before_the_launch_stops_the_script_with_4_and_leaves_nothing(sandbox):
    """TERM while run_and_time.sh still reads the config (python -m runtime.config is slow
    here): exit 4, said, nothing launched and no run directory left behind."""
    root, stubs = sandbox
    env, files = signal_stub(sandbox, STUB_CONFIG_DELAY="1.5",
                             STUB_CONFIG_STARTED=str(root / "stub files" / "config"))
    proc = start_script(sandbox, env)
    wait_for(files / "config", proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 4, err[-3000:]
    assert "stopped by SIGTERM before the launch" in err, err[-3000:]
    assert not stub_pids(files) and "STARTING TIMING RUN" not in out
    assert not (root / "log dir").exists() or not list((root / "log dir").iterdir())


def test_sigkill_to_the_script_stops_its_launcher(sandbox):
    """kill -9 of run_and_time.sh alone (it cannot pass anything on): its launcher still gets
    the stop request (its parent-death signal), so the ranks checkpoint and stop rather than
    train on as orphans."""
    env, files = signal_stub(sandbox)
    try:
        proc = start_script(sandbox, env)
        wait_for(files / "ready", proc)
        (pid,) = stub_pids(files)
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        deadline = time.time() + 15
        while Path(f"/proc/{pid}").exists() and time.time() < deadline:
            time.sleep(0.1)
        assert not Path(f"/proc/{pid}").exists(), "the launcher outlived run_and_time.sh"
        assert (files / "got").read_text().split() == ["SIGUSR1"]
    finally:
        end_stubs(files)


def test_the_run_directory_is_held_from_before_the_launch(sandbox, tmp_path):
    """A second run_and_time.sh with the RUN_DIR of a run that has just launched (before any
    of its ranks could take a lock) is refused with exit 2, naming the live run; it starts no
    launcher and writes nothing there, launcher.log included."""
    env, files = signal_stub(sandbox)
    run_dir = tmp_path / "the run"
    try:
        first = start_script(sandbox, dict(env, RUN_DIR=str(run_dir)))
        wait_for(files / "started", first)
        log = run_dir / "launcher.log"
        before = sorted(p.name for p in run_dir.iterdir()), log.read_bytes()
        second = start_script(sandbox, dict(env, RUN_DIR=str(run_dir)))
        out, err = second.communicate(timeout=60)
        assert second.returncode == 2, err[-3000:]
        assert f"RUN_DIR '{run_dir}' is in use by another run (run_and_time.sh pid " \
               f"{first.pid} on " in err, err[-3000:]
        assert "STARTING TIMING RUN" not in out and len(stub_pids(files)) == 1
        assert (sorted(p.name for p in run_dir.iterdir()), log.read_bytes()) == before
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=60)
        assert first.returncode == 4, err[-3000:]
    finally:
        end_stubs(files)


def test_a_checkpoint_directory_is_held_by_one_run(sandbox, tmp_path):
    """Two runs in two run directories with one train.checkpoint_dir: the second is refused
    with exit 2 naming the run that holds it, before anything is written - in the checkpoint
    directory, or a run directory of its own left behind."""
    root, _ = sandbox
    env, files = signal_stub(sandbox)
    ckpt = tmp_path / "shared checkpoints"
    share = ["--", f'train.checkpoint_dir="{ckpt}"', "train.checkpoint_every_samples=80"]
    run_a = tmp_path / "run a"
    try:
        first = start_script(sandbox, dict(env, RUN_DIR=str(run_a)), *share)
        wait_for(files / "started", first)
        before = sorted(p.name for p in ckpt.iterdir()), (ckpt / ".lock").read_bytes()
        logdir = root / "log dir"
        second = start_script(sandbox, env, *share)   # a fresh run directory in LOGDIR
        out, err = second.communicate(timeout=60)
        assert second.returncode == 2, err[-3000:]
        assert f"train.checkpoint_dir '{ckpt}' is in use by another run (run_and_time.sh " \
               f"pid {first.pid} on " in err and f"run directory {run_a}" in err, err[-3000:]
        assert len(stub_pids(files)) == 1
        assert (sorted(p.name for p in ckpt.iterdir()), (ckpt / ".lock").read_bytes()) == before
        assert not logdir.exists() or not list(logdir.iterdir())
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 4
    finally:
        end_stubs(files)


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
    assert "the refused run left nothing in it" in proc.stderr, proc.stderr
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
