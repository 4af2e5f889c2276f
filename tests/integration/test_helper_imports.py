"""run_and_time.sh reads the run's config in processes of their own before any rank starts
(``python -m runtime.config`` for the values it needs, ``python -m submission.preflight`` for
the launcher, memory, device and Inductor cache checks): a few per run, so their start-up is a run's start-up. Each runs here as
the script runs it, and must not import numpy, h5py or torch - with numpy and h5py (through
the balancing modes, now loaders/balance_spec.py) each took ~0.2 s of CPU instead of ~0.07.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.launch import ROOT
from tests.support.runs import CPU_CONFIG

HEAVY = ("numpy", "h5py", "torch")

RUN_AS_MAIN = """
import runpy, sys
module, sys.argv = sys.argv[1], sys.argv[1:]
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
finally:
    print("HEAVY", sorted(m for m in {heavy!r} if m in sys.modules), file=sys.stderr)
""".format(heavy=HEAVY)


@pytest.mark.parametrize("module, args, lines", [
    ("runtime.config", ["--get", "system.nodes", "--get", "train.seed"], 2),  # the values
    ("submission.preflight", [], 0),   # the checks: silent when the run can start, exit 0
    ("runtime.train.memory", [], 0),   # (its memory check, also a command of its own)
])
def test_run_and_times_config_helpers_import_no_numpy_h5py_or_torch(module, args, lines):
    proc = subprocess.run([sys.executable, "-c", RUN_AS_MAIN, module, str(CPU_CONFIG), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(proc.stdout.splitlines()) == lines, proc.stdout
    heavy = [line for line in proc.stderr.splitlines() if line.startswith("HEAVY ")]
    assert heavy == ["HEAVY []"], proc.stderr[-3000:]
