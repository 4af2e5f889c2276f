"""run_and_time.sh and stop signals: TERM/INT/HUP/USR1, once or repeated, to the script or
its process group, a closed terminal, a stop during start-up or before the launch, kill -9 of
the script: the launcher gets one stop request, the script waits for it and exits with its
status; the ranks' /dev/shm files go once the launch ends, and nothing of the script is left in
its process group.

Under the stub launchers of tests/support/run_and_time.py (SIGNAL_STUB: records the signals it
gets and stops like a rank that checkpointed).
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.support.launch import default_stop_signals
from tests.support.run_and_time import (SCRIPT, end_stubs, hup_at_date, run,  # noqa: F401
                                        sandbox, signal_stub, start_script, stub_pids,
                                        wait_for, write_config)

pytestmark = pytest.mark.slow   # tests/e2e: every test here is slow


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


def test_a_signal_that_kills_a_helper_before_the_launch_still_stops_with_4(sandbox):
    """A closed terminal's SIGHUP to the whole process group while run_and_time.sh runs a
    command of its own before the launch (each date here): that command dies of it, and set -e
    once ended the script with its 129, unsaid. A stop before the launch like any other: 4,
    said, nothing launched, no run directory left."""
    root, _ = sandbox
    env, files = signal_stub(sandbox)
    env = hup_at_date(sandbox, env, when=root)   # every date
    proc = start_script(sandbox, env)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 4, err[-3000:]
    assert "stopped by SIGHUP before the launch" in err, err[-3000:]
    assert not stub_pids(files) and "STARTING TIMING RUN" not in out
    assert not (root / "log dir").exists() or not list((root / "log dir").iterdir())


def test_a_signal_after_the_launcher_ended_leaves_the_runs_status(sandbox):
    """Ctrl-C stops the run, and the terminal is closed while run_and_time.sh writes its
    summary (its END date here; CI caught it under srun, whose step ended 0.6 s after the
    first Ctrl-C): the launcher has ended, nothing is left to stop, and the script and its
    helpers ignore it - it exits with the ranks' 4 and its summary, not the 129 of a killed
    date."""
    env, files = signal_stub(sandbox)
    env = hup_at_date(sandbox, env, when=files / "got")   # written as the launcher ends
    try:
        proc = start_script(sandbox, env)
        wait_for(files / "ready", proc)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 4, err[-3000:]
        assert (files / "got").read_text().split() == ["SIGUSR1"], err[-3000:]
        assert "ENDING TIMING RUN" in out and "stopped by a signal: " in err, err[-3000:]
    finally:
        end_stubs(files)


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


def group_members(pgid: int) -> list[str]:
    """Every process (zombies too) in process group ``pgid``: "PID STATE COMMAND"."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue   # ended while we looked
        comm, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:]
        state, _ppid, pgrp = rest.split()[:3]
        if int(pgrp) == pgid:
            found.append(f"{stat.parent.name} {state} {comm}")
    return found


def test_nothing_of_the_run_is_left_in_its_process_group_when_the_script_returns(sandbox):
    """A tool that waits for a run's process group to empty (a timing harness, a job runner)
    found the two tees of launcher.log there after every launched run - zombies bash never
    reaped, until PID 1 did, 0.6-1.8 s later: the script waits for them before it exits."""
    env, files = signal_stub(sandbox, STUB_WAIT="0")
    try:
        proc = start_script(sandbox, env)
        out, err = proc.communicate(timeout=60)
        left = group_members(proc.pid)
        assert proc.returncode == 4, err[-3000:]
        assert left == [], left
        (log,) = (sandbox[0] / "log dir").glob("*/launcher.log")
        assert "stub still writing 1999" in log.read_text()   # every line, the last too
    finally:
        end_stubs(files)
