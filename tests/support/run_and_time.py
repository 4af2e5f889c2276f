"""run_and_time.sh under stub launchers: the sandbox, the stubs and the helpers the
tests/e2e/test_run_and_time*.py files share.

PYTHON, MPIEXEC, MPIRUN and SRUN are stub scripts (``STUB``) that record their argv and exit
with $STUB_RC; the PYTHON stub passes `-m runtime.config`, `-m submission.preflight`, `-m
submission.launchers`, `-m submission.session` (which starts the launcher), `-m
submission.rank_ends` (which watches the ranks end) and `-m submission.shm` (which cleans up
after it) on to the real interpreter, so the launch values
really come from the config and the launch command from the launchers' table. Everything
lives under a directory with a space in its name to prove the quoting. ``SIGNAL_STUB`` is a
launcher that records the signals it gets and stops like a rank that checkpointed.
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
                ["-m", "submission.preflight"], ["-m", "runtime.train.memory"],
                ["-m", "submission.session"],
                ["-m", "submission.shm"], ["-m", "submission.rank_ends"]):
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


DATE_STUB = f"""#!{sys.executable}
# date(1) as the script's process group sees it when a terminal sends a stop signal at the
# wrong moment: once $STUB_DATE_HUP_WHEN exists, SIGHUP to its own process group (the script's)
# - which kills this date too unless the script has it ignored - then the real date.
import os, shutil, signal, sys
if os.path.exists(os.environ["STUB_DATE_HUP_WHEN"]):
    os.killpg(0, signal.SIGHUP)
here = os.path.dirname(os.path.abspath(sys.argv[0]))
path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if os.path.abspath(d) != here)
real = shutil.which("date", path=path)
os.execv(real, [real] + sys.argv[1:])
"""


def hup_at_date(sandbox, env: dict, when: Path) -> dict:
    """``env`` with DATE_STUB first on PATH: every date the script runs once ``when`` exists
    sends SIGHUP to the script's process group first (a terminal closed at that moment)."""
    bindir = sandbox[0] / "date dir"
    bindir.mkdir(exist_ok=True)
    (bindir / "date").write_text(DATE_STUB)
    (bindir / "date").chmod(0o755)
    return dict(env, PATH=f"{bindir}{os.pathsep}{env['PATH']}", STUB_DATE_HUP_WHEN=str(when))


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
