"""Bad input through run_and_time.sh on 2 ranks: a shard whose checksums match but whose values
a model cannot take stops the run with exit 2 before anything is written. The checks
themselves: tests/unit/test_bad_input.py."""
from __future__ import annotations

import numpy as np
import pytest

from tests.support.data import copy_dataset, rewrite_shard, train_shards
from tests.support.launch import needs_mpiexec
from tests.support.runs import resume_overrides, run_and_time

pytestmark = pytest.mark.slow   # tests/e2e: every test here is slow


# ------------------------------------------------------------------------------ end to end

@pytest.mark.slow  # a run_and_time.sh launch of 2 ranks
@needs_mpiexec
def test_a_bad_shard_stops_run_and_time_with_exit_2_before_anything_is_written(small_dataset,
                                                                               tmp_path):
    """Through run_and_time.sh on 2 ranks: a shard with an id past the vocabulary (checksums
    re-signed) is found before the first step; exit 2 with the file named, and no MLPerf log
    or metrics file is left half-written in the run directory."""
    root = copy_dataset(small_dataset, tmp_path / "data")
    bad = rewrite_shard(root, train_shards(root)[-1],
                        lambda s: s.input_ids.__setitem__(3, np.where(
                            np.arange(len(s.input_ids[3])) == 2, 30600, s.input_ids[3])
                            .astype(np.int16)))
    run_dir = tmp_path / "run"
    proc = run_and_time(resume_overrides(root, **{"train.max_steps": 2}),
                        env_extra={"RUN_DIR": str(run_dir)})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert f"{bad}: row 3: input_ids holds 30600" in text, text[-3000:]
    assert "exit status 2 (bad input)" in proc.stderr, proc.stderr[-3000:]
    assert not (run_dir / "mlperf_bert.log").exists() and not (run_dir / "metrics.jsonl").exists()
