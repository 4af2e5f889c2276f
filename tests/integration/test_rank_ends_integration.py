"""The watch beside the launcher (submission.rank_ends.watch), in a thread of this process over
one real child process: it finds the rank from its ``<host>.<pid>`` file in the armed
directory, records its end as it happens (a pidfd), one the watch found already ended as
``late``, and ends once the launcher has. What the summary makes of it: tests/unit/
test_rank_ends.py; at 4 ranks under mpiexec: tests/e2e/test_resume_e2e.py.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

from submission.rank_ends import read_ends, watch


def test_the_watch_records_a_ranks_end_as_it_happens_and_one_found_ended_as_late(tmp_path):
    armed = tmp_path / ".armed"
    armed.mkdir()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (armed / f"{socket.gethostname()}.{child.pid}").touch()
        (armed / f"another-host.{os.getpid()}").touch()   # not this host's: not watched
        (armed / "stub.1.0").touch()
        thread = threading.Thread(target=watch, daemon=True, args=(
            tmp_path, armed, 2, child.pid, os.getppid()))
        thread.start()
        while not (tmp_path / "ranks" / "ends.jsonl").exists():
            thread.join(0.05)
        thread.join(0.5)
        assert thread.is_alive()   # its rank runs: the watch waits
        child.send_signal(signal.SIGKILL)
        child.wait()
        thread.join(10)   # the launcher (here the same process) has ended: so does the watch
        assert not thread.is_alive()
    finally:
        child.kill()
        child.wait()
    ends = read_ends(tmp_path)
    assert ends["host"] == socket.gethostname()
    assert [g["pids"] for g in ends["groups"]] == [[child.pid]] and "late" not in ends["groups"][0]
    watch(tmp_path, armed, 2, child.pid, os.getppid())   # found after its end: late, at once
    assert [(g["pids"], g.get("late")) for g in read_ends(tmp_path)["groups"]] == [
        ([child.pid], True)]
