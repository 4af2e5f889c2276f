"""Shared fixtures.

``small_dataset``: a small real-text data set (Wikipedia lead sections, uncased BERT vocab)
built once per test session with ``loaders.prepare`` - 4 training shards, 64 eval samples,
seq 128. Built in a second or two; test files that need real shards use it read-only.

Imported from their modules so that every test file sees them: ``slurm_cluster`` (a real
one-node Slurm cluster, tests/slurm_cluster.py), ``reference_run`` (the session's
uninterrupted 2-rank run_and_time.sh run, tests/support/runs.py), ``synthetic_dataset`` and
``eval_truth`` (tests/support/data.py), ``bindir`` (executables named like the launchers,
tests/support/launch.py). Helpers the tests share are in tests/support/, never in a test file.

Tiers: ``-m "not slow"`` runs the unit tier - everything in this process or in a short single
process; tests that launch ranks (mpiexec, torchrun, srun, Open MPI), real clusters,
run_and_time.sh training runs or end-to-end training are marked ``slow``.
"""
from __future__ import annotations

from pathlib import Path

import pytest

# A real one-node Slurm cluster (munged, slurmctld, slurmd by PID) shared by the whole session:
# test_dist's srun tests and test_slurm use it.
from slurm_cluster import slurm_cluster  # noqa: F401,E402
from tests.support.data import SOURCES, eval_truth, synthetic_dataset  # noqa: F401
from tests.support.launch import bindir  # noqa: F401
from tests.support.runs import reference_run  # noqa: F401


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip cleanly where torch sees no GPU (CI, the dev machine);
    ``python -m bench.gpu`` runs them on one with ``-m cuda``."""
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


# Options of the shared small set; tests that rebuild it for comparisons use the same ones.
SMALL_DATASET_OPTIONS = dict(max_docs=400, shards=4, eval_samples=64, dupe_factor=2,
                             eval_doc_fraction=0.2, seq_len=128, max_pred=20, seed=12345)


@pytest.fixture(scope="session")
def small_dataset_options() -> dict:
    """The PrepareConfig options of ``small_dataset`` (besides out/sources/workers)."""
    return dict(SMALL_DATASET_OPTIONS)


@pytest.fixture(scope="session")
def small_dataset_report(tmp_path_factory):
    """The BuildReport of the shared small set (doc ids per split, stats, timings)."""
    from loaders.prepare import PrepareConfig, build
    from loaders.corpus import WIKI_XML_NAME

    if not (SOURCES / WIKI_XML_NAME).is_file():
        pytest.skip(f"{SOURCES / WIKI_XML_NAME} missing: run `make sources`")
    out = tmp_path_factory.mktemp("small_dataset") / "data"
    return build(PrepareConfig(out=out, sources=SOURCES, workers=2, **SMALL_DATASET_OPTIONS),
                 log=lambda msg: None)


@pytest.fixture(scope="session")
def small_dataset(small_dataset_report) -> Path:
    """Path of the shared small real-text data set (treat it as read-only)."""
    return small_dataset_report.out


@pytest.fixture(scope="module")
def single_ctx():
    """A world of one (gloo, CPU) for a test module. One process group per process at a time:
    reuse one that exists, else make one and shut it down after the module."""
    from runtime.launch import dist
    from runtime.launch.env import discover
    ours = dist.current() is None
    ctx = dist.init_distributed(discover({}), device="cpu") if ours else dist.current()
    yield ctx
    if ours:
        dist.shutdown()
