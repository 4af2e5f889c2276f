"""How a command-line tool's output lands in ``--out``: whole or not at all, with nothing left
behind by a failed, interrupted or killed run - for every tool that writes a directory
(``python -m runtime.model.convert``, ``loaders.prepare``, ``loaders.adopt``).

Owns: the temporary directory ``.<OUT>.tmp-<pid>`` and its lock, the removal of the ones
killed runs left, the refusal while another run of the same ``--out`` writes there
(``refuse_live``), the checks made before any input is read (the place is writable, the disk
has room), the commit, and the one-line ``OutputError`` any ``OSError`` of writing becomes
(exit 2: a place the user can change; exit 3: the disk is full, as a full disk is elsewhere in
the runtime). Never: knows what the files hold (the tool writes them), or imports anything
but the standard library (basis/: the room below loaders and runtime).

Two ways in, by what ``--out`` is when the run starts:

- absent: the output is built in ``.<OUT>.tmp-<pid>`` beside it and renamed to ``OUT`` in one
  step, so ``OUT`` is absent or complete;
- an existing empty directory - typically a mount point (``/data/bert_large`` as a container
  volume), which can be neither removed nor renamed onto, and whose parent may be read-only:
  the output is built in ``OUT/.<OUT>.tmp-<pid>`` and its entries are renamed into ``OUT``,
  the manifest last. A directory the user made keeps its owner and mode. Only a kill between
  those few renames (microseconds) could leave some files without the manifest, and the next
  run then refuses the directory as not the tool's output.

A temporary directory holds ``.lock``, flock()ed by its run while it lives; the kernel drops
the lock when the process dies, however it dies (KILL included), and a reused pid cannot
hold it. So a later run on the same ``--out`` removes every temporary directory of it
(beside and inside) whose lock it can take, and refuses to start while one is held: another
run is writing there. A directory without ``.lock`` (made before the lock, by a run caught
between its mkdir and its lock or by an older tool) is removed only when its pid is not alive.

``what`` names the tool's kind of run in the messages ("conversion", "build").
"""
from __future__ import annotations

import errno
import fcntl
import glob
import os
import re
import shutil
from pathlib import Path

LOCK = ".lock"
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
SPARE = 1 << 20
"""Bytes asked beyond the output's own: headers, config.json, the manifest - or, for a tool
that cannot tell its output's size before it runs, all it asks."""


class OutputError(Exception):
    """--out cannot be written (read-only, no permission, busy, full): one line for the user;
    ``exit_code`` 2, or 3 for a full disk."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def temp_name(out: Path, pid: int | None = None) -> str:
    return f".{out.name}.tmp-{os.getpid() if pid is None else pid}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:       # alive, another user's
        return True
    return True


def _free(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def as_os_error(e: BaseException, path: Path) -> OSError | None:
    """``e`` as an OSError: itself, or safetensors' SafetensorError, which carries the OS
    error only in its text ("... (os error 28)")."""
    if isinstance(e, OSError):
        return e
    m = re.search(r"os error (\d+)", str(e)) if type(e).__name__ == "SafetensorError" else None
    if m:
        code = int(m.group(1))
        return OSError(code, os.strerror(code), str(path))
    return None


def clear_stale(out: Path, log=print, what: str = "conversion") -> list[tuple[Path, int]]:
    """Remove the temporary directories of ``out`` that killed runs left (beside and inside
    it); return the live ones, (path, pid), which another run holds now."""
    places = [out.parent] + ([out] if out.is_dir() else [])
    live = []
    for place in places:
        try:
            found = sorted(place.glob(glob.escape(f".{out.name}.tmp-") + "*"))
        except OSError:
            continue
        for tmp in found:
            try:
                pid = int(tmp.name.rsplit("-", 1)[1])
            except ValueError:
                continue
            if pid == os.getpid() or not tmp.is_dir():
                continue
            fd = None
            try:
                fd = os.open(tmp / LOCK, os.O_RDWR)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                stale = True                   # we hold its lock: its run is gone
            except BlockingIOError:
                stale = False
            except OSError:                    # no .lock, or a filesystem without flock
                stale = not _pid_alive(pid)
            try:
                if not stale:
                    live.append((tmp, pid))
                    continue
                shutil.rmtree(tmp, ignore_errors=True)   # under its lock: nobody takes it
            finally:
                if fd is not None:
                    os.close(fd)
            if tmp.exists():
                if place == out:              # it would make --out look taken
                    raise OutputError(f"{tmp}: the temporary directory of an interrupted "
                                      f"{what}, which cannot be removed; delete it")
            else:
                log(f"removed {tmp}: the temporary directory of an interrupted {what} "
                    f"(pid {pid})")
    return live


def refuse_live(out: Path, log=print, what: str = "conversion") -> None:
    """``clear_stale``, then an ``OutputError`` (exit 2) when another run holds a temporary
    directory of ``out``: it is writing there now."""
    live = clear_stale(out, log, what)
    if live:
        tmp, pid = live[0]
        raise OutputError(f"--out {out}: another {what} (pid {pid}) is writing it now (it "
                          f"holds {tmp}); wait for it to end, or stop it")


class Staging:
    """The temporary directory of this run: ``open`` (before any input is read), files
    written into ``dir``, then ``commit`` or ``discard``."""

    def __init__(self, out: Path, what: str = "conversion"):
        self.out, self.what = out, what
        self.into = out.is_dir()               # an existing (empty: checked before) directory
        self.dir = (out if self.into else out.parent) / temp_name(out)
        self.need: int | None = None
        self.sized = False
        self._fd: int | None = None

    def open(self, need: int | None = None) -> "Staging":
        """Create and lock ``dir``; OutputError when the place is not writable or has less
        than ``need`` (+ SPARE) bytes free (``None``: a size not known before the run, only
        SPARE is asked)."""
        self.need = (need or 0) + SPARE
        self.sized = need is not None
        place = self.dir.parent
        try:
            place.mkdir(parents=True, exist_ok=True)
            for _ in range(3):
                shutil.rmtree(self.dir, ignore_errors=True)   # our pid's, from a killed run
                self.dir.mkdir()
                if self._lock():
                    break
            else:
                raise OutputError(f"{self.dir}: removed under us three times by other "
                                  f"runs on this --out; run one {self.what} at a time")
        except OSError as e:
            self.discard()
            where = "inside --out" if self.into else "next to --out"
            raise OutputError(f"{self.dir}: cannot create the output {where} "
                              f"({e.strerror or e}); pick another --out, or make "
                              f"{place} writable (nothing was written)") from None
        free = _free(place)
        if free is not None and free < self.need:
            self.discard()
            needs = f"the output needs {self.need:,}" if self.sized else \
                f"less than the {self.need:,} asked before starting"
            raise OutputError(f"{place}: {free:,} bytes free, {needs}; free space or pick "
                              "another --out (nothing was written)", exit_code=3)
        return self

    def _lock(self) -> bool:
        """Take the lock; False when a run clearing stale directories removed ours between
        our mkdir and our lock (it held the lock file first), so the caller makes it again."""
        path = self.dir / LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)     # blocks only while such a run removes it
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                os.close(fd)
                raise
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def contents(self, last: str) -> list[str]:
        """What ``dir`` holds but its lock, ``last`` (the tool's manifest) at the end: the
        order ``commit`` moves a whole directory's output in."""
        names = sorted(n for n in os.listdir(self.dir) if n not in (LOCK, last))
        return names + [last]

    def commit(self, names: list[str]) -> None:
        """Move the output into ``out``: ``names`` in order (the manifest last); the caller
        keeps signals from landing in between."""
        (self.dir / LOCK).unlink()             # the fd keeps the lock until we close it
        if self.into:
            for name in names:
                os.rename(self.dir / name, self.out / name)
            self.dir.rmdir()
        else:
            os.rename(self.dir, self.out)
        self._release()

    def error(self, e: BaseException, path: Path) -> OutputError | None:
        """The user's line for ``e`` met writing ``path`` (a file of ``dir``, or ``out`` while
        moving into place); None: not an OS error."""
        e = as_os_error(e, path)
        if e is None:
            return None
        what = e.strerror or str(e)
        doing = f"writing {path.name}" if path.parent == self.dir else "moving it into place"
        if e.errno in NO_SPACE:
            free = _free(self.dir.parent)
            if self.sized:
                room = f"the output needs {self.need:,} bytes" + (
                    f", {free:,} are free" if free is not None else "")
            else:
                room = f"{free:,} bytes are free" if free is not None else ""
            return OutputError(f"--out {self.out}: {what} while {doing}"
                               + (f" ({room})" if room else "") + "; free space or pick "
                               "another --out (nothing was written)", exit_code=3)
        return OutputError(f"--out {self.out}: {what} while {doing}; pick another --out, or "
                           "make it writable (nothing was written)")

    def discard(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
        self._release()

    def _release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
