"""The projection's command line (``python -m runtime.calibrate.tune --simulate ... --samples``)
refuses a bad samples-to-target table before it simulates anything. The tables and the choice
itself: tests/unit/test_batch_choice.py."""
from __future__ import annotations

import subprocess
import sys

from runtime.calibrate.tune.project import DATA
from tests.support.launch import ROOT


def test_the_command_refuses_a_bad_table_before_simulating(tmp_path):
    """Exit 2 naming the file, before the projection's seconds of simulation (the command's
    good path: tests/integration/test_tune_integration.py::
    test_projection_runs_compares_with_published_and_picks_the_batch)."""
    bad = tmp_path / "bad.csv"
    bad.write_text("global_batch,samples\n")
    proc = subprocess.run([sys.executable, "-m", "runtime.calibrate.tune", "--simulate",
                           str(DATA / "dgx_a100_8xhdr.toml"), "--gpus", "8", "--samples",
                           str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "bad.csv: the samples table has no rows" in proc.stderr
    assert proc.stdout == ""                # refused before the projection printed anything
