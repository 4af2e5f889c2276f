"""Eval accuracy aggregated across real ranks: sum of correct over sum of masked on 2 and 4 ranks
(mpiexec on tests/dist_scripts/eval_counts.py, the tiny model of tests/support/tiny.py) equals
the truth read from the eval file (``eval_truth``, tests/support/data.py). The same in one
process and the other trainer pieces: tests/unit/test_trainer.py."""
from __future__ import annotations

import json

import pytest

from tests.support.data import assert_eval_counts
from tests.support.launch import needs_mpiexec, run_script, tail

pytestmark = pytest.mark.slow   # tests/ranks: every test here launches ranks


@pytest.mark.slow  # mpiexec launches
@needs_mpiexec
@pytest.mark.parametrize("ranks", [2, 4])
def test_eval_accuracy_is_sum_correct_over_sum_masked_across_ranks(small_dataset, tmp_path,
                                                                   eval_truth, ranks):
    out = tmp_path / f"counts{ranks}.json"
    proc = run_script(ranks, "eval_counts.py", small_dataset, out, timeout=180)
    assert proc.returncode == 0, tail(proc)
    got = json.loads(out.read_text())
    assert got["world"] == ranks
    assert_eval_counts(got, eval_truth, ranks)
