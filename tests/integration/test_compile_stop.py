"""A stop during a compile loses nothing and poisons no cache: a rank's stop signals never
reach the processes it starts (runtime.launch.signals), and an Inductor C++ build lands in the
cache whole or not at all (runtime.model.inductor_cache). A real compiled run stopped during
its first compile, then rerun on the same cache: tests/e2e/test_signals_e2e.py."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime.model import inductor_cache
from tests.support.launch import ROOT, clean_env, default_stop_signals

RANK = textwrap.dedent("""
    import subprocess, sys, time
    from runtime.launch import signals
    signals.install()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])
    print("child", child.pid, flush=True)
    code = child.wait()
    time.sleep(0.2)
    print("child ended", code, "stop request", signals.name(signals.requested()), flush=True)
""")


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_a_stop_sent_to_the_ranks_process_group_is_the_ranks_alone(sig):
    """MPICH's hydra passes a stop on to the process group each rank leads (Slurm to every
    process of the step): a compiler the rank had started died of it half-way (CL4 of the
    reliability probe: g++ killed, CppCompileError, a 0-byte .so). Now the child ends its work
    and the rank has the request."""
    proc = subprocess.Popen([sys.executable, "-c", RANK], cwd=ROOT, env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=default_stop_signals)
    try:
        assert proc.stdout.readline().startswith("child "), proc.stderr.read()
        os.killpg(proc.pid, sig)   # as hydra does: the rank's whole group
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    assert out.strip() == f"child ended 0 stop request {sig.name}", out + err


FAKE_GXX = textwrap.dedent("""\
    #!/bin/sh
    # g++ for a test: asked for its version, the real one's; asked to build, it writes half of
    # its output and dies of SIGKILL (the OOM killer, a node lost).
    case " $* " in *" --version "*|*" -v "*|*" -dumpversion "*) exec g++ "$@" ;; esac
    while [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done
    [ "$FAKE_GXX_OK" = 1 ] && { printf 'whole' > "$out"; exit 0; }
    printf 'half' > "$out"
    kill -9 $$
    """)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_an_inductor_build_lands_in_the_cache_whole_or_not_at_all(tmp_path, monkeypatch):
    """Inductor's CppBuilder writes the kernel's .so in place, and Inductor takes a target that
    exists for a finished build: a compiler killed half-way left a 0-byte .so that every later
    run on that cache loaded ("file too short"). With whole_builds a killed build leaves
    nothing under the target's name, and a finished one is there whole."""
    from torch._inductor import cpp_builder
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "g++").write_text(FAKE_GXX)
    (bindir / "g++").chmod(0o755)
    src = tmp_path / "kernel.cpp"
    src.write_text("int f() { return 1; }\n")
    out = tmp_path / "cache"
    inductor_cache.whole_builds()

    def builder():
        return cpp_builder.CppBuilder(name="kernel", sources=str(src),
                                      BuildOption=cpp_builder.CppOptions(
                                          compiler=str(bindir / "g++")),
                                      output_dir=str(out))
    target = Path(builder().get_target_file_path())
    with pytest.raises(Exception, match="C\\+\\+ compile error|returned non-zero|signal"):
        builder().build()
    assert not target.exists(), "a killed compiler left a partial build in the cache"
    files = [p for p in out.rglob("*") if not p.is_dir()]
    assert files == [], files   # its temporary file neither (Inductor's empty build dir stays)
    monkeypatch.setenv("FAKE_GXX_OK", "1")
    builder().build()
    assert target.read_bytes() == b"whole"
    assert [p for p in out.rglob("*") if not p.is_dir()] == [target]
