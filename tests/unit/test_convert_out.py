"""Where ``python -m runtime.model.convert`` writes (basis/staging.py) and when a rerun
is up to date (runtime/model/convert.py), held against real directories, mounts and locks.

The truths: an existing empty directory - a mount point - is written into, never removed or
renamed onto; an --out that cannot be written (read-only, busy, full) exits 2 or 3 with one
line naming it and nothing left behind, checked before any tensor is read where it can be;
TERM, INT and HUP stop a conversion with exit 130 and nothing left (a HUP ignored at start
stays ignored); the temporary directories of killed runs are removed by the next run whether
their pid is dead or reused, and one whose lock is held is another conversion at work; a
rerun is up to date only for the same config content, and a --config that disagrees with the
checkpoint's own bert_config.json on what no shape shows is refused. The real-mount cases
need root (CI and this machine are) and skip where mount(2) is not permitted.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import signal
import threading
from pathlib import Path

import pytest

from basis import cli, staging
from runtime.model import convert as cv
from tests.support.tf_checkpoint import CONFIG, FIXTURE, PREFIX, copy_checkpoint

MS_RDONLY = 1


def _cli(capsys, *args) -> tuple[int, str, str]:
    rc = cv.main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def mount(tmp_path):
    """mount(path, options, read_only): a real tmpfs at ``path`` (unmounted after the test);
    skips where mount(2) is not permitted (not root, no CAP_SYS_ADMIN)."""
    libc = ctypes.CDLL(None, use_errno=True)
    mounted = []

    def make(path: Path, options: str = "size=4m", read_only: bool = False) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        if libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", MS_RDONLY if read_only else 0,
                      options.encode()) != 0:
            pytest.skip(f"mount(2) not permitted here ({os.strerror(ctypes.get_errno())})")
        mounted.append(path)
        return path

    yield make
    for path in reversed(mounted):
        libc.umount2(str(path).encode(), 2)            # MNT_DETACH


def _no_tensor_read(monkeypatch):
    """Fail the test if the conversion reads a tensor: the check had to come first."""
    monkeypatch.setattr(cv, "_tensor", lambda *a: pytest.fail("a tensor was read first"))


def _leftovers(*dirs: Path) -> list[Path]:
    return [p for d in dirs if d.is_dir() for p in d.glob(".*.tmp-*")]


# ----------------------------------------------------------------- C9b: mount points, full disks

def test_an_existing_empty_directory_is_written_into_never_removed(tmp_path, capsys,
                                                                   monkeypatch):
    """A mount point can be neither removed nor renamed onto (EBUSY): simulated here for any
    empty directory; the conversion writes into it and keeps the directory itself."""
    out = tmp_path / "vol"
    out.mkdir()
    inode = out.stat().st_ino
    real_rmdir, real_rename = os.rmdir, os.rename

    def rmdir(path, *a, **k):
        if Path(path) == out:
            raise OSError(errno.EBUSY, "Device or resource busy", str(path))
        return real_rmdir(path, *a, **k)

    def rename(src, dst, *a, **k):
        if Path(dst) == out:
            raise OSError(errno.EBUSY, "Device or resource busy", str(dst))
        return real_rename(src, dst, *a, **k)

    monkeypatch.setattr(os, "rmdir", rmdir)
    monkeypatch.setattr(os, "rename", rename)
    rc, stdout, err = _cli(capsys, PREFIX, "--out", out)
    assert rc == 0 and not err and f"wrote {out}" in stdout, err
    assert out.stat().st_ino == inode
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "manifest.json",
                                                     "model.safetensors"]
    assert not _leftovers(tmp_path, out)
    rc, stdout, _ = _cli(capsys, PREFIX, "--out", out)
    assert rc == 0 and "up to date" in stdout


def test_a_real_empty_mount_point_is_written_into(tmp_path, capsys, mount):
    """Its empty lost+found (a fresh ext4 volume has one) does not make it "not empty"."""
    out = mount(tmp_path / "vol")
    (out / "lost+found").mkdir()
    rc, stdout, err = _cli(capsys, PREFIX, "--out", out)
    assert rc == 0 and not err, err
    assert os.path.ismount(out) and (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["num_attention_heads"] == 2
    assert not _leftovers(tmp_path, out)
    rc, stdout, err = _cli(capsys, PREFIX, "--out", out)
    assert rc == 0 and "up to date" in stdout, err
    other = mount(tmp_path / "vol2")
    (other / "lost+found").mkdir()
    (other / "lost+found" / "x").touch()       # what fsck recovered: not empty
    rc, _, err = _cli(capsys, PREFIX, "--out", other)
    assert rc == 2 and "not empty" in err, err


def test_a_read_only_mount_point_exits_2_before_any_tensor_is_read(tmp_path, capsys, mount,
                                                                   monkeypatch):
    out = mount(tmp_path / "ro", read_only=True)
    _no_tensor_read(monkeypatch)
    rc, _, err = _cli(capsys, PREFIX, "--out", out)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{out}/.ro.tmp-" in err and "Read-only file system" in err
    assert "pick another --out" in err and not list(out.iterdir())


def test_a_disk_too_small_exits_3_before_any_tensor_is_read(tmp_path, capsys, mount,
                                                            monkeypatch):
    small = mount(tmp_path / "small", "size=40k")
    _no_tensor_read(monkeypatch)
    rc, _, err = _cli(capsys, PREFIX, "--out", small / "out")
    assert rc == 3 and err.count("\n") == 1, err
    assert f"{small}: 40,960 bytes free, the output needs " in err and "free space" in err
    assert not list(small.iterdir())


@pytest.mark.parametrize("into", [False, True])
def test_a_disk_that_fills_while_writing_exits_3_leaving_nothing(tmp_path, capsys, mount,
                                                                 monkeypatch, into):
    """The up-front check passed (another writer took the space after it): the real ENOSPC
    of safetensors' writer (a SafetensorError, not an OSError) is one line, exit 3."""
    small = mount(tmp_path / "small", "size=40k")
    monkeypatch.setattr(staging, "_free", lambda path: 1 << 40)
    out = small if into else small / "out"
    rc, _, err = _cli(capsys, PREFIX, "--out", out)
    assert rc == 3 and err.count("\n") == 1 and "Traceback" not in err, err
    assert f"--out {out}: No space left on device while writing model.safetensors" in err
    assert not list(small.iterdir())


def test_any_os_error_writing_is_one_line_with_nothing_left(tmp_path, capsys, monkeypatch):
    """Without root: the errors a mount point, a read-only place or a full disk raise, at
    each step of writing (safetensors' own error carries only its text)."""
    from safetensors import SafetensorError
    out = tmp_path / "out"
    real_rename = os.rename

    def busy(src, dst, *a, **k):
        if Path(dst) == out:
            raise OSError(errno.EBUSY, "Device or resource busy", str(dst))
        return real_rename(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", busy)
    rc, _, err = _cli(capsys, PREFIX, "--out", out)
    assert rc == 2 and err.count("\n") == 1, err
    assert f"--out {out}: Device or resource busy while moving it into place" in err
    assert not out.exists() and not _leftovers(tmp_path)
    monkeypatch.setattr(os, "rename", real_rename)

    def full(*a, **k):
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")

    monkeypatch.setattr("safetensors.torch.save_file", full)
    rc, _, err = _cli(capsys, PREFIX, "--out", out)
    assert rc == 3 and "No space left on device while writing model.safetensors" in err, err
    assert not out.exists() and not _leftovers(tmp_path)


# ------------------------------------------------------- C10b: temporary dirs of killed runs

def _dead_pid() -> int:
    pid = 4_000_000
    while Path(f"/proc/{pid}").exists() or pid == os.getpid():
        pid -= 1
    return pid


def _temp(place: Path, out: Path, pid: int, lock: bool = True) -> Path:
    """A temporary directory as a conversion killed mid-write leaves it."""
    tmp = place / staging.temp_name(out, pid)
    tmp.mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(b"half")
    if lock:
        (tmp / staging.LOCK).touch()
    return tmp


@pytest.mark.parametrize("case", ["dead pid", "reused pid", "dead pid, no lock file"])
def test_a_killed_runs_temporary_directory_is_removed_by_the_next_run(tmp_path, capsys, case):
    """Beside --out (it was absent) and inside it (an empty directory): a KILL leaves them
    (tests/integration/test_convert_signals.py kills a real run). A free lock means its
    converter is gone even when its pid names a live process now (pid reuse: our parent)."""
    pid = os.getppid() if case == "reused pid" else _dead_pid()
    lock = case != "dead pid, no lock file"
    for out, place in ((tmp_path / "a", tmp_path), (tmp_path / "b", tmp_path / "b")):
        stale = _temp(place, out, pid, lock)
        rc, stdout, err = _cli(capsys, PREFIX, "--out", out)
        assert rc == 0 and not err, err
        assert f"removed {stale}: the temporary directory of an interrupted conversion" \
            in stdout
        assert not stale.exists() and (out / "model.safetensors").is_file()


def test_a_live_conversions_temporary_directory_is_left_and_named(tmp_path, capsys):
    """A held lock is a conversion at work (here this test holds it, as another process's
    would be held): refused with its pid, its directory untouched. A directory without a
    lock file whose pid lives (a converter between its mkdir and its lock) is left too."""
    out = tmp_path / "out"
    held = _temp(tmp_path, out, 1)
    fd = os.open(held / staging.LOCK, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        rc, _, err = _cli(capsys, PREFIX, "--out", out)
    finally:
        os.close(fd)
    assert rc == 2 and f"--out {out}: another conversion (pid 1) is writing it now" in err, err
    assert (held / "model.safetensors").read_bytes() == b"half" and not out.exists()
    (held / staging.LOCK).unlink()                      # pid 1 lives: left, and refused
    rc, _, err = _cli(capsys, PREFIX, "--out", out)
    assert rc == 2 and "another conversion (pid 1)" in err and held.exists()


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT],
                         ids=lambda s: s.name)
def test_a_stop_signal_midway_exits_130_leaving_nothing(tmp_path, capsys, monkeypatch, sig):
    """The signal delivered to this process while a tensor is read (after the temporary
    directory and its lock exist): HUP, the terminal closing, as TERM and Ctrl-C - where
    HUP's default used to kill the process and leave the directory behind."""
    out = tmp_path / "out"
    real, read = cv._tensor, []

    def tensor(*a):
        read.append(a[1])
        if len(read) == 5:
            assert list(tmp_path.glob(".out.tmp-*/.lock"))
            # to the main thread: a process-directed signal taken by another thread (one an
            # earlier test's import started) reaches Python's handler only milliseconds later
            signal.pthread_kill(threading.main_thread().ident, sig)
        return real(*a)

    monkeypatch.setattr(cv, "_tensor", tensor)
    inherited = {s: signal.getsignal(s) for s in cli.STOP_SIGNALS}
    try:   # as from a terminal: a suite started in the background (`make test &`, nohup)
        for s in cli.STOP_SIGNALS:   # has INT and HUP ignored, which the converter keeps
            signal.signal(s, signal.SIG_DFL if s != signal.SIGINT else signal.default_int_handler)
        before = {s: signal.getsignal(s) for s in cli.STOP_SIGNALS}
        rc, _, err = _cli(capsys, PREFIX, "--out", out)
        after = {s: signal.getsignal(s) for s in cli.STOP_SIGNALS}
    finally:
        for s, handler in inherited.items():
            signal.signal(s, handler)
    assert rc == 130 and err == "convert: interrupted; nothing was written to --out\n", err
    assert len(read) == 5 and list(tmp_path.iterdir()) == []
    assert after == before     # restored


def test_a_hup_ignored_at_start_stays_ignored(tmp_path, capsys, monkeypatch):
    """nohup: the user asked the conversion to outlive the terminal."""
    real = cv._tensor
    monkeypatch.setattr(cv, "_tensor", lambda *a: (os.kill(os.getpid(), signal.SIGHUP),
                                                   real(*a))[1])
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        rc, stdout, err = _cli(capsys, PREFIX, "--out", tmp_path / "out")
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, old)
    assert rc == 0 and "wrote" in stdout, err
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


# ------------------------------------------------------------------ C11b: the config's content

def _config(tmp_path: Path, name: str, **change) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(dict(CONFIG, **change)))
    return path


def test_a_rerun_with_other_config_content_is_refused_naming_the_field(tmp_path, capsys):
    """Same shapes (4 heads divide 16 as 2 do), so only the config's content tells: the
    manifest's config is compared, not its path, and an --out is never overwritten - as for
    --keep-optimizer-state. No bert_config.json beside this copy, so nothing else refuses."""
    prefix = copy_checkpoint(tmp_path)
    (tmp_path / "bert_config.json").unlink()
    out = tmp_path / "out"
    rc, _, err = _cli(capsys, prefix, "--out", out, "--config", _config(tmp_path, "h2.json"))
    assert rc == 0, err
    rc, stdout, err = _cli(capsys, prefix, "--out", out, "--config",
                           _config(tmp_path, "same.json"))        # another path, same content
    assert rc == 0 and "up to date" in stdout, err
    rc, _, err = _cli(capsys, prefix, "--out", out, "--config",
                      _config(tmp_path, "h4.json", num_attention_heads=4))
    assert rc == 2 and f"--out {out}: holds the conversion of other files or options" in err
    assert "the model config's num_attention_heads: 2 there, 4 now" in err, err
    assert json.loads((out / "config.json").read_text())["num_attention_heads"] == 2


def test_a_config_that_disagrees_with_the_checkpoints_own_on_the_heads_exits_2(tmp_path,
                                                                              capsys):
    h4 = _config(tmp_path, "h4.json", num_attention_heads=4)
    own = FIXTURE / "bert_config.json"
    rc, _, err = _cli(capsys, PREFIX, "--out", tmp_path / "out", "--config", h4)
    assert rc == 2 and err.count("\n") == 1, err
    assert f"--config {h4}: num_attention_heads = 4, but the checkpoint's own {own} says " \
           "num_attention_heads = 2" in err
    assert not (tmp_path / "out").exists()
    eps = _config(tmp_path, "eps.json", layer_norm_eps=1e-5)
    rc, _, err = _cli(capsys, PREFIX, "--out", tmp_path / "out", "--config", eps)
    assert rc == 2 and "layer_norm_eps = 1e-05, but" in err and "1e-12" in err, err
    rc, _, err = _cli(capsys, PREFIX, "--out", tmp_path / "out", "--config",
                      _config(tmp_path, "dropout.json", hidden_dropout_prob=0.0))
    assert rc == 0, err                                 # training's business, not the weights'
