"""The Makefile's user targets, as `make -n` prints them (nothing run): `make run` passes
ARGS through as run_and_time.sh's config overrides, and `make mlperf-demo` runs
docs/MLPERF.md's fixture commands from a fresh directory (what those commands do:
tests/e2e/test_mlperf_walkthrough.py)."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.support.launch import ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make here")


def recipe(*args: str) -> list[str]:
    """The recipe lines `make -n` prints for ``args`` (prerequisites' lines included). As a
    top-level make: under `make test` the suite inherits MAKELEVEL and MAKEFLAGS, and a
    sub-make prints "Entering/Leaving directory" lines around its recipe."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    proc = subprocess.run(["make", "--no-print-directory", "-n", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_make_run_passes_its_overrides_to_run_and_time():
    assert recipe("run", 'ARGS=train.max_steps=20 train.plot=false')[-1] == (
        "CONFIG=submission/configs/config_CPU_1x2x32x1.toml ./run_and_time.sh -- "
        "train.max_steps=20 train.plot=false")
    assert recipe("run")[-1].endswith("./run_and_time.sh")          # none: no `--`
    assert recipe("run", "CONFIG=c.toml", "ARGS=train.seed=3")[-1] == \
        "CONFIG=c.toml ./run_and_time.sh -- train.seed=3"


def test_make_mlperf_demo_runs_the_pages_commands_in_a_fresh_directory():
    lines = recipe("mlperf-demo")
    assert lines[-2:] == ["rm -rf -- results/mlperf_demo",
                          f"{ROOT}/.venv/bin/python -m tests.support.walkthrough "
                          f"--dir results/mlperf_demo"]


def test_make_venv_gpu_installs_the_cuda_set_from_pypi_not_the_local_cpu_wheel():
    """requirements-gpu.txt (bench.gpu_wheels: it resolves for CPython 3.12 on manylinux
    x86_64 with torch's CUDA packages), without the --find-links of the CPU wheel directory,
    a CPU torch uninstalled first, and a last line that fails on anything but a CUDA build."""
    lines = recipe("-W", "requirements-gpu.txt", "venv-gpu")
    install = [ln for ln in lines if "pip install" in ln and "requirements-gpu.txt" in ln]
    assert len(install) == 1 and "--find-links" not in install[0]
    text = "\n".join(lines)
    assert "pip uninstall --quiet --yes torch" in text and "NOT a CUDA build" in text
    assert (ROOT / "requirements-gpu.txt").read_text().splitlines()[-1] == "-r requirements.txt"


def test_the_container_recipe_installs_the_same_set_and_names_its_base():
    """The Dockerfile (unbuildable here: no Docker daemon on the development machine): a named
    base image, requirements-gpu.txt installed as `make venv-gpu` does, the interpreter that
    run.sub's containers use given to run_and_time.sh (PYTHON)."""
    text = (ROOT / "Dockerfile").read_text()
    assert text.count("\nFROM ") == 1 and "\nFROM ubuntu:24.04\n" in text
    assert "pip install -r requirements-gpu.txt" in text and \
        "pip install --no-deps -r requirements-data.txt" in text
    assert "PYTHON=/opt/presto/.venv/bin/python" in text and "torch.version.cuda" in text
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", ".cache", "data", "results"} <= set(ignored)
