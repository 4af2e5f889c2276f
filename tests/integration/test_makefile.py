"""The Makefile's user targets, as `make -n` prints them (nothing run): `make run` passes
ARGS through as run_and_time.sh's config overrides, and `make mlperf-demo` runs
docs/MLPERF.md's fixture commands from a fresh directory (what those commands do:
tests/e2e/test_mlperf_walkthrough.py)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.support.launch import ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make here")


def recipe(*args: str) -> list[str]:
    """The recipe lines `make -n` prints for ``args`` (prerequisites' lines included)."""
    proc = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
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
