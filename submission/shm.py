"""What a launch leaves in /dev/shm: MPICH's shared-memory files of its ranks, removed once the
ranks are gone.

MPICH's ranks share a ~2 MB file, ``/dev/shm/mpich_shm_<id>_0``, which MPI_Finalize unlinks -
and a job that ends otherwise (MPI_Abort after a rank's failure, a rank killed, ``os._exit``)
leaves behind: one per failed run, on a filesystem that is small and shared on many nodes.
The file's name says nothing of its job, and other jobs' files may be live beside it, so
nothing is removed by pattern:

  * ``note(directory)``, each rank, right after MPI started (submission.train): the /dev/shm
    files this process maps, one per line, into ``<directory>/<host>.<pid>``;
  * ``clean(directory)``, run_and_time.sh once its launcher has ended (every rank of this
    host gone): each file a note of *this host* lists is removed - if it is still there, in
    /dev/shm, and no live process maps it. Notes of other hosts (a run over several nodes
    on a shared file system) are left: their files are on those hosts.

    python -m submission.shm clean DIRECTORY

Owns: the notes and their cleaning. Never: removes a file no rank of this launch noted, one
outside /dev/shm, or one a live process still maps; never fails a run (a note or a removal
that cannot be made is skipped).
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Optional, Sequence

SHM = Path("/dev/shm")


def mapped(pid: str = "self") -> set[str]:
    """The /dev/shm files process ``pid`` maps (its /proc maps; files already unlinked,
    "(deleted)", are nobody's to clean)."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return set()
    out = set()
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith(f"{SHM}/") and \
                not parts[5].endswith(" (deleted)"):
            out.add(parts[5])
    return out


def note(directory: Optional[str]) -> None:
    """Write the /dev/shm files this process maps into ``<directory>/<host>.<pid>`` (none:
    no file). Best effort."""
    if not directory:
        return
    files = sorted(mapped())
    if not files:
        return
    try:
        path = Path(directory) / f"{socket.gethostname()}.{os.getpid()}"
        path.write_text("".join(f"{f}\n" for f in files))
    except OSError:
        pass


def clean(directory: str | Path) -> list[str]:
    """Remove what this host's notes in ``directory`` list and nobody maps; returns the files
    removed."""
    host = socket.gethostname()
    listed: set[str] = set()
    for path in Path(directory).glob(f"{host}.*"):
        try:
            listed |= {line.strip() for line in path.read_text().splitlines() if line.strip()}
        except OSError:
            continue
    candidates = []
    for name in sorted(listed):
        path = Path(name)
        if path.parent == SHM and path.name not in ("", ".", "..") and path.is_file() \
                and not path.is_symlink():
            candidates.append(name)
    if not candidates:
        return []
    live = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            live |= mapped(pid)
    removed = []
    for name in candidates:
        if name in live:
            continue
        try:
            os.unlink(name)
            removed.append(name)
        except OSError:
            pass
    return removed


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m submission.shm",
        description="Remove the /dev/shm files that this launch's ranks on this host noted "
                    "(MPICH's shared memory, which a job ended by MPI_Abort or a killed rank "
                    "leaves behind) and that no live process maps.")
    ap.add_argument("action", choices=["clean"])
    ap.add_argument("directory", help="the notes' directory (run_and_time.sh's)")
    a = ap.parse_args(argv)
    clean(a.directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
