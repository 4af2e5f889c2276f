"""A launch's files in /dev/shm (submission.shm): a rank notes the ones it maps, and the
cleaning after the launch removes exactly those - never a file no note lists (another run's,
tests run in parallel), one a live process still maps, one outside /dev/shm, or another
host's. Through run_and_time.sh: tests/e2e/test_run_and_time_signals.py."""
from __future__ import annotations

import mmap
import os
import socket
import uuid
from pathlib import Path

import pytest

from submission import shm


@pytest.fixture
def shm_files():
    """Unique files in /dev/shm for one test, removed after it."""
    made = []

    def make(suffix: str) -> Path:
        path = Path(f"/dev/shm/presto_test_{uuid.uuid4().hex[:12]}_{suffix}")
        path.write_bytes(b"\0" * 4096)
        made.append(path)
        return path
    yield make
    for path in made:
        path.unlink(missing_ok=True)


def write_note(notes: Path, host: str, pid: int, *paths) -> None:
    (notes / f"{host}.{pid}").write_text("".join(f"{p}\n" for p in paths))


def test_a_rank_notes_the_dev_shm_files_it_maps(tmp_path, shm_files):
    path = shm_files("mapped")
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 4096) as m:
        shm.note(str(tmp_path))
        m[0] = 1
    (note,) = tmp_path.iterdir()
    assert note.name == f"{socket.gethostname()}.{os.getpid()}"
    assert str(path) in note.read_text().splitlines()
    shm.note("")   # no directory (not run_and_time.sh's launch): nothing, no error


def test_cleaning_removes_only_what_this_hosts_notes_list_and_nobody_maps(tmp_path, shm_files):
    noted, other_run, mapped, other_host = (shm_files(s) for s in
                                            ("noted", "other_run", "mapped", "other_host"))
    outside = tmp_path / "not_in_dev_shm"
    outside.write_text("mine")
    host = socket.gethostname()
    write_note(tmp_path, host, 1, noted, mapped, outside, "/dev/shm/../etc_passwd_like")
    write_note(tmp_path, "another-host", 2, other_host)
    with open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 4096):
        removed = shm.clean(tmp_path)
    assert removed == [str(noted)]
    assert not noted.exists()
    assert other_run.exists() and mapped.exists() and other_host.exists() and outside.exists()
    assert shm.clean(tmp_path / "no notes") == []
