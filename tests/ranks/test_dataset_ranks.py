"""loaders.dataset on two real MPI ranks (tests/dist_scripts/read_epoch.py under mpiexec): the
ranks of a launch read every sample of the synthetic data set (tests/support/data.py) once.
The loader's own tests: tests/unit/test_dataset.py."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from tests.support.data import every_row, shard_rows
from tests.support.launch import needs_mpiexec, run_script, tail

pytestmark = pytest.mark.slow   # tests/ranks: every test here launches ranks


# ----------------------------------------------------------------- real multi-process run

@pytest.mark.slow  # a 2-rank mpiexec launch
@needs_mpiexec
def test_two_mpi_ranks_read_every_sample_once(synthetic_dataset, tmp_path):
    proc = run_script(2, "read_epoch.py", synthetic_dataset, tmp_path, timeout=120)
    assert proc.returncode == 0, tail(proc)
    per_rank = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [p["world_size"] for p in per_rank] == [2, 2]
    assert per_rank[0]["steps"] == per_rank[1]["steps"]
    read = Counter(tuple(ids) for p in per_rank for ids in p["input_ids"])
    shards = shard_rows(synthetic_dataset)
    everything = Counter(tuple(s.input_ids[r].tolist()) for s, r in every_row(shards))
    assert read == everything
