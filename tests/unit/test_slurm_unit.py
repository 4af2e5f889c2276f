"""The test cluster's teardown (tests/slurm_cluster.py): it removes the MPICH shared-memory files
that ranks SIGKILLed under srun left during the cluster's life, and nothing older or other.
The cluster runs themselves: tests/e2e/test_slurm.py."""
from __future__ import annotations

import time


def test_cluster_teardown_removes_only_the_stale_mpich_shm_of_its_own_run(tmp_path):
    """A rank SIGKILLed under srun --mpi=pmi2 leaves /dev/shm/mpich_shm_* named after its job
    step; the next fresh cluster's job 1.0 would die in MPI_Init on it. Teardown removes the
    files made during the cluster's life that no process maps; older ones stay."""
    import os
    from slurm_cluster import remove_stale_mpich_shm
    old, new, other = (tmp_path / n for n in ("mpich_shm_aa_0", "mpich_shm_bb_0", "other_0"))
    for f in (old, new, other):
        f.write_bytes(b"x")
    os.utime(old, (time.time() - 3600,) * 2)
    notes = remove_stale_mpich_shm(time.time() - 60, shm=tmp_path)
    assert notes == ["removed 1 stale MPICH shared-memory file(s) of killed ranks"]
    assert (old.exists(), new.exists(), other.exists()) == (True, False, True)
    assert remove_stale_mpich_shm(time.time() - 60, shm=tmp_path) == []
