"""Inductor's cache on disk, as a run uses it: where it is, whether the run can write there,
and that what Inductor's C++ builds leave there is whole.

Owns:
  * ``locations(environ)``: the directories a compiling run writes - ``$TORCHINDUCTOR_CACHE_DIR``
    or, unset, Inductor's default (``torchinductor_<user>`` in the temporary directory); and
    that default too when the variable names another, for the precompiled headers Inductor
    keeps there whatever the variable says. Worked out without importing torch (the pre-launch
    check runs before every launch): tests/unit/test_inductor_cache.py holds the default equal
    to torch's own ``default_cache_dir``;
  * ``problem(environ, why)``: the one sentence for a cache a compiling run cannot use (not a
    directory, read-only, not creatable, a path with a blank in it), naming the variable and the directory - said before
    any rank starts (runtime.train.preflight), not as a 150-line ``InductorError`` at the first
    compile;
  * ``whole_builds()``: each C++ build of Inductor (``CppBuilder.build``: ``g++`` writing a
    kernel's ``.so``, an object file or a precompiled header) goes to a temporary name beside its
    target and is renamed to it once the compiler succeeded. Inductor takes a target that exists
    for a finished build (``codecache._worker_compile_cpp``) and writes it in place, so a
    compiler that died half-way - a stop signal, the OOM killer, a node lost - left a 0-byte or
    partial ``.so`` that every later run on that cache loaded ("file too short"). With the
    rename a build is in the cache whole or not at all (a killed compiler's temporary file is
    all it leaves). runtime.launch.signals keeps the stop signals from the compilers; this is
    for everything else that kills them.
Never: compiles, clears or reads the cache's contents, or changes what Inductor generates.
"""
from __future__ import annotations

import getpass
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Mapping, Optional

VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def default_location() -> str:
    """Inductor's default cache directory (torch._inductor.runtime.cache_dir_utils's
    ``default_cache_dir`` outside fbcode)."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def locations(environ: Mapping[str, str] = os.environ) -> list[tuple[str, str]]:
    """(directory, what names it) for each directory a compiling run writes."""
    default = default_location()
    named = environ.get(VARIABLE)
    if named is None:
        return [(default, f"Inductor's default cache directory (unset {VARIABLE})")]
    out = [(os.path.abspath(named), VARIABLE)]
    if os.path.abspath(named) != default:
        out.append((default, f"Inductor's default cache directory, where its precompiled "
                             f"headers go whatever {VARIABLE} says (it is in the temporary "
                             f"directory: TMPDIR moves it)"))
    return out


def _unwritable(path: str) -> Optional[str]:
    """Why ``path`` cannot be Inductor's cache (None: it can, or can be created)."""
    p = Path(path)
    if any(c.isspace() for c in path):   # torch 2.13: its g++ command lines are split on blanks
        return ("its path holds a blank, which Inductor's compiler command lines do not quote "
                "(every C++ build there fails)")
    if p.exists() and not p.is_dir():
        return "it exists and is not a directory"
    probe = p
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"it cannot be created ({probe} is not a directory)"
    try:
        fd, name = tempfile.mkstemp(prefix=".presto-write-check-", dir=probe)
    except OSError as e:
        how = e.strerror or str(e)
        return f"cannot write in it ({how})" if probe == p else \
            f"it does not exist and cannot be created in {probe} ({how})"
    os.close(fd)
    os.unlink(name)
    return None


def problem(environ: Mapping[str, str] = os.environ, why: str = "") -> Optional[str]:
    """The sentence for the first cache directory a compiling run cannot use; None when all
    can be used. ``why``: what in the config compiles (named in the sentence)."""
    for path, name in locations(environ):
        wrong = _unwritable(path)
        if wrong is None:
            continue
        this = f"{VARIABLE}={path}" if name == VARIABLE else f"{path} ({name})"
        fix = (f"set {VARIABLE} to a writable directory (or unset it: Inductor's default is "
               f"{default_location()})" if name == VARIABLE else
               f"make it writable, or set TMPDIR to a writable directory")
        because = f", and this run compiles ({why})" if why else ""
        return f"{this}: {wrong}{because}: Inductor keeps the kernels it builds there - {fix}"
    return None


_INSTALLED = False


def whole_builds() -> None:
    """Make every Inductor C++ build in this process write its target whole or not at all
    (the module docstring). Idempotent; imports torch's Inductor."""
    global _INSTALLED
    if _INSTALLED:
        return
    from torch._inductor import cpp_builder
    original = cpp_builder.CppBuilder.build

    def build(self) -> None:
        target = getattr(self, "_target_file", "")
        output = getattr(self, "_output", "")
        if not target or getattr(self, "_use_relative_path", False) \
                or not output.endswith(target):   # (a remote build: Inductor's own way)
            return original(self)
        folder, name = os.path.split(target)
        tmp = os.path.join(folder, f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
        self._target_file, self._output = tmp, output[:-len(target)] + tmp
        try:
            original(self)
            os.replace(tmp, target)
        finally:
            self._target_file, self._output = target, output
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    build.__doc__ = original.__doc__
    build.__wrapped__ = original
    cpp_builder.CppBuilder.build = build
    _INSTALLED = True
