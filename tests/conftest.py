"""Shared fixtures, and the tiers.

``small_dataset``: a small real-text data set (Wikipedia lead sections, the tiny model's
vocabulary: the first 8,192 entries of the uncased BERT vocab, tests/support/tiny.py) built
once per test session with ``loaders.prepare`` - 4 training shards, 64 eval samples, seq 128.
Built in a second or two; test files that need real shards use it read-only.

Imported from their modules so that every test file sees them: ``slurm_cluster`` (a real
one-node Slurm cluster, tests/slurm_cluster.py), ``reference_run`` (the session's
uninterrupted 2-rank run_and_time.sh run, tests/support/runs.py), ``synthetic_dataset`` and
``eval_truth`` (tests/support/data.py), ``bindir`` (executables named like the launchers,
tests/support/launch.py). Helpers the tests share are in tests/support/, never in a test file.

Tiers, one directory each (this conftest, tests/support/, tests/dist_scripts/ and the Slurm
test clusters serve them all):

  tests/unit/         pure and fast: no child process, no rank launch, no torch.compile, at
                      most a step or two of the tiny model; ``make check`` runs it alone:
                      `make check` 23 s, `make test` 11 m 11 s
                      (medians of 3 on the 2-core development machine, 2026-12-06)
  tests/integration/  one process, real components together: tiny-model training and
                      checkpoints, torch.compile, the tuner, HPO and prepare in-process, one
                      child process of a single Python command (no rank launch)
  tests/ranks/        multi-process launches (mpiexec, torchrun, Open MPI, srun) of a rank
                      script in tests/dist_scripts/ or of the trainer
  tests/e2e/          run_and_time.sh (with real or stub launchers), Slurm clusters, network
                      namespaces, HPO studies of real runs, ``python -m submission`` driving runs

Every test in tests/ranks/ and tests/e2e/ is marked ``slow`` (a module-level ``pytestmark``),
none in tests/unit/; collection refuses a test that breaks this.

The unit tier's rules are held, not only written: a unit test that compiles with
torch.compile, starts a child process, or spends more than ``UNIT_BUDGET_S`` seconds of this
process's CPU in its call (``@pytest.mark.budget(seconds)`` grants one test more, with a
reason beside it) fails and says which rule it broke - ``make check`` runs that tier as the
edit loop. CPU time, not wall time: a loaded machine slows a test down but does not make it
spend more CPU, so the budget cannot flake under load.

Rooms: each test is marked with the rooms of the house it exercises, derived from what its
file imports and names (tests/support/rooms.py), so ``pytest -m grad_sync`` runs the tests of
runtime/grad_sync across the tiers; ``python -m tests.support.rooms`` lists them. So ``pytest tests/unit``,
``pytest tests/integration``, ``pytest tests/ranks``, ``pytest tests/e2e`` run one tier,
``pytest -m "not slow"`` the unit and integration tiers (less integration's few slow tests),
and ``pytest`` (``make test``) everything.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Threads: under pytest-xdist (``make test``: two workers on two cores) each worker - and what
# it starts without choosing its own (a single-rank child, a benchmark) - gets its share of
# the cores. torch's default, a thread per core in every process, put two threads on each
# core, and OpenMP's spinning waits make oversubscribed threads cost far more than their
# share (tests/integration on 2 workers: 240 s -> 148 s wall, 7.3 -> 4.0 min CPU; docs/
# DEVELOPING.md). Rank launches set their own (runtime's threads_per_rank rule).
# Waiting: OpenMP's threads spin between parallel regions (libgomp's active wait policy).
# Beside another busy worker, a child with two threads - the compiled-vs-eager runs, a
# one-rank run, a benchmark's smoke - spun on a core the other process needed: the 30-step
# eager run of tests/integration/test_compile_layers.py took 92-130 s that way and 11-13 s
# with passive waiting (the same machine, loaded alike, 2026-12-02; docs/DEVELOPING.md).
# Every process the suite starts inherits it; set OMP_WAIT_POLICY to choose otherwise.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    import torch
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# A real one-node Slurm cluster (munged, slurmctld, slurmd by PID) shared by the whole session:
# test_dist's srun tests and test_slurm use it.
from slurm_cluster import slurm_cluster  # noqa: F401,E402
from basis.presets import SMALL_DATASET_OPTIONS, SOURCES
from tests.support.data import eval_truth, synthetic_dataset  # noqa: F401
from tests.support.launch import bindir  # noqa: F401
from tests.support.runs import reference_run  # noqa: F401


TESTS = Path(__file__).resolve().parent
SLOW_TIERS, FAST_TIERS = {"ranks", "e2e"}, {"unit"}   # every test slow / none slow
UNIT_BUDGET_S = 5.0
"""The CPU seconds a unit test's call may spend (this process's, every thread): the heaviest
unit test spends about 1.1 s with one thread on the 2-core machine (2026-12-06; two threads
and a machine twice as slow would bring it to ~4.5 s); one compile of the fused optimizer
spends 5-80."""


def pytest_configure(config):
    from tests.support.rooms import all_rooms
    config.addinivalue_line("markers", "budget(seconds): a unit test allowed more than "
                            f"UNIT_BUDGET_S = {UNIT_BUDGET_S:g} s of CPU in its call")
    for room in all_rooms():
        config.addinivalue_line("markers", f"{room}: exercises the room {room} (derived from "
                                "the test file's imports, tests/support/rooms.py)")


def slow_files_first(items: list) -> list:
    """The files holding a slow test first, each file's tests together and in their order.
    ``make test`` hands the workers whole files in this order (``--dist loadfile
    --no-loadscope-reorder``; xdist's own order puts the files with most tests first, which
    left a file of a few minutes-long tests - the compiled layers, the two-node cluster - to
    start near the end while the other worker ran out of work): the long files start early
    and the hundreds of short tests fill both workers to the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    return sorted(items, key=lambda item: item.path not in slow_files)   # stable


@pytest.hookimpl(tryfirst=True)   # before -m deselects: every collected test is checked
def pytest_collection_modifyitems(config, items):
    """The ``slow`` marker agrees with the tier directories (a test in tests/ranks/ or
    tests/e2e/ is slow, one in tests/unit/ is not), else collection stops naming the tests.
    Tests marked ``cuda`` skip cleanly where torch sees no GPU (CI, the dev machine);
    ``python -m bench.gpu`` runs them on one with ``-m cuda``."""
    wrong = []
    for item in items:
        parts = item.path.relative_to(TESTS).parts if item.path.is_relative_to(TESTS) else ()
        tier = parts[0] if len(parts) > 1 else None
        slow = item.get_closest_marker("slow") is not None
        if (tier in SLOW_TIERS and not slow) or (tier in FAST_TIERS and slow):
            wrong.append(item.nodeid)
    if wrong:
        raise pytest.UsageError(
            "tests/ranks/ and tests/e2e/ hold only tests marked slow, tests/unit/ none (move "
            "the test or fix its mark):\n  " + "\n  ".join(wrong))
    from tests.support.rooms import rooms_of
    for item in items:
        for room in sorted(rooms_of(item.path)):
            item.add_marker(room)
    items[:] = slow_files_first(items)
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


def _in_unit_tier(item) -> bool:
    parts = item.path.relative_to(TESTS).parts if item.path.is_relative_to(TESTS) else ()
    return len(parts) > 1 and parts[0] in FAST_TIERS


def _graphs_compiled() -> int:
    import sys
    if "torch._dynamo" not in sys.modules:      # nothing imported it: nothing compiled
        return 0
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


class _NoChildProcess:
    """subprocess.Popen refused for the length of a unit test's call, but for ``git`` (a
    benchmark record's header asks it for the commit: milliseconds, no torch)."""

    ALLOWED = ("git",)

    def __enter__(self):
        import subprocess
        self.popen, self.init = subprocess.Popen, subprocess.Popen.__init__

        init = self.init

        def refuse(popen, args, *a, **k):
            program = Path(str(args[0] if isinstance(args, (list, tuple)) else args).split()[0])
            if program.name in _NoChildProcess.ALLOWED:
                return init(popen, args, *a, **k)
            why = (" - torch.compile's C++ compiler: the unit tier compiles nothing"
                   if program.name in ("g++", "gcc", "cc", "c++", "clang", "clang++") else "")
            raise AssertionError(f"a unit test starts no child process (it ran {args!r}{why}): "
                                 "move it to tests/integration")
        subprocess.Popen.__init__ = refuse
        return self

    def __exit__(self, *exc):
        self.popen.__init__ = self.init


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """The unit tier's rules (this file's docstring): no compile, no child process, a CPU
    budget for the call."""
    if not _in_unit_tier(item):
        return (yield)
    import time
    marker = item.get_closest_marker("budget")
    budget = float(marker.args[0]) if marker else UNIT_BUDGET_S
    graphs, cpu = _graphs_compiled(), time.process_time()
    with _NoChildProcess():
        result = yield
    broken = broken_unit_rule(time.process_time() - cpu, budget, _graphs_compiled() - graphs)
    if broken:
        pytest.fail(broken, pytrace=False)
    return result


def broken_unit_rule(spent_s: float, budget_s: float, graphs_compiled: int) -> str | None:
    """What a unit test's call broke, given the CPU it spent and the graphs it compiled."""
    if graphs_compiled:
        return (f"this unit test compiled {graphs_compiled} graph(s) with torch.compile: move "
                "it to tests/integration (the unit tier compiles nothing)")
    if spent_s > budget_s:
        return (f"this unit test spent {spent_s:.1f} s of CPU in its call, over the unit "
                f"tier's budget of {budget_s:g} s: make it smaller, or move it to "
                "tests/integration (or grant it @pytest.mark.budget(seconds) with a reason)")
    return None


@pytest.fixture(scope="session")
def small_dataset_options(tmp_path_factory) -> dict:
    """The PrepareConfig options of ``small_dataset`` (besides out/sources/workers): the
    shared options, and the tiny model's vocabulary."""
    from tests.support.tiny import write_vocab
    vocab = write_vocab(tmp_path_factory.mktemp("tiny_vocab") / "vocab.txt")
    return dict(SMALL_DATASET_OPTIONS, vocab=vocab)


@pytest.fixture(scope="session")
def small_dataset_report(tmp_path_factory, small_dataset_options):
    """The BuildReport of the shared small set (doc ids per split, stats, timings)."""
    from loaders.prepare import PrepareConfig, build
    from loaders.corpus import WIKI_XML_NAME

    if not (SOURCES / WIKI_XML_NAME).is_file():
        pytest.skip(f"{SOURCES / WIKI_XML_NAME} missing: run `make sources`")
    out = tmp_path_factory.mktemp("small_dataset") / "data"
    return build(PrepareConfig(out=out, sources=SOURCES, workers=2, **small_dataset_options),
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


# A process group left behind is inherited, as a live C++ object with threads, by whatever the
# same pytest worker forks later: destroying it in the child waits on a condition whose owner
# thread the child does not have (a prepare pool hung 600 s that way, 2026-11-29). The data
# builders no longer fork (loaders.workers), and no test may leave a group behind for the next:
# ``single_ctx`` holds one for its module and shuts it down after it; any other test that makes
# one shuts it down itself, else it fails here (and the group is shut down for the next test).
def _group_left() -> bool:
    import sys
    td = sys.modules.get("torch.distributed")
    dist = sys.modules.get("runtime.launch.dist")
    return bool((td is not None and td.is_available() and td.is_initialized())
                or (dist is not None and dist.current() is not None))


def _shut_down_left_group() -> None:
    from runtime.launch import dist
    dist.shutdown()


@pytest.fixture(autouse=True)
def _no_process_group_left_by_a_test(request):
    before = _group_left()
    yield
    if not before and _group_left() and "single_ctx" not in request.fixturenames:
        _shut_down_left_group()
        pytest.fail("this test left a torch.distributed process group behind: shut it down "
                    "(runtime.launch.dist.shutdown()) or use the single_ctx fixture",
                    pytrace=False)


# runtime.launch.signals.install() blocks the stop signals in the process that calls it (so
# the children it starts - compilers - never get them). A test that calls it in the pytest
# worker and leaves the mask would hand blocked stop signals to every child a later test
# starts: a launcher or rank that a test stops with SIGTERM would not stop.
@pytest.fixture(autouse=True)
def _no_signal_mask_left_by_a_test():
    import signal
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    after = signal.pthread_sigmask(signal.SIG_SETMASK, before)
    if after != before:
        pytest.fail(f"this test left signals blocked in the pytest worker ({sorted(after - before)}"
                    "): restore the mask (signal.pthread_sigmask(signal.SIG_SETMASK, saved))",
                    pytrace=False)


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_left_by_a_module():
    yield
    if _group_left():
        _shut_down_left_group()
        pytest.fail("a test module left a torch.distributed process group behind after its "
                    "last test: shut it down in the fixture or test that made it",
                    pytrace=False)
