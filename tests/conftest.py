"""Shared fixtures.

``small_dataset``: a small real-text data set (Wikipedia lead sections, uncased BERT vocab)
built once per test session with ``loaders.prepare`` - 4 training shards, 64 eval samples,
seq 128. Built in a second or two; test files that need real shards use it read-only.
"""
from __future__ import annotations

import signal
from pathlib import Path

import pytest

# A real one-node Slurm cluster (munged, slurmctld, slurmd by PID) shared by the whole session:
# test_dist's srun tests and test_slurm use it.
from slurm_cluster import slurm_cluster  # noqa: F401,E402

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)


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


def default_stop_signals() -> None:
    """``preexec_fn`` for a script whose signal handling a test checks: the stop signals at
    their default disposition, whatever this suite inherited. A signal ignored when bash
    starts cannot be trapped (bash(1)), and the suite may run ignoring some: `nohup` ignores
    HUP, a background job of a non-interactive shell (`make test &`) ignores INT."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


# Options of the shared small set; tests that rebuild it for comparisons use the same ones.
SMALL_DATASET_OPTIONS = dict(max_docs=400, shards=4, eval_samples=64, dupe_factor=2,
                             eval_doc_fraction=0.2, seq_len=128, max_pred=20, seed=12345)
SOURCES = Path(__file__).resolve().parents[1] / ".cache" / "sources"


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
