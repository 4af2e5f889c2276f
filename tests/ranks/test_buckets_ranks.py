"""Gradient buckets (runtime.grad_sync) and the clip modes through real ranks: the venv's
``mpiexec`` on tests/dist_scripts/grad_sync.py, which checks on every rank that the gradient
the optimizer receives equals the clip mode's formula (docs/REFERENCES.md §5) computed from
the all-gathered per-rank gradients, and reports what it saw (overlap, views, launches) for the
asserts here. The 2-rank cases that succeed run in one launch (the module fixture
``two_ranks``); the clip modes on 4 ranks and each bad plan (it stops the job) have their own.
In one process: tests/unit/test_buckets.py."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from runtime.grad_sync.plan import production_order
from tests.support.launch import needs_mpiexec, run_script, tail

# ---------------------------------------------------------------------------------------------
# real ranks


def run_cases(cases: str, ranks: int, data_dir: Path, work: Path, timeout=240):
    """One launch of grad_sync.py running ``cases``: (process, seconds)."""
    start = time.monotonic()
    proc = run_script(ranks, "grad_sync.py", cases, data_dir, work, timeout=timeout)
    return proc, time.monotonic() - start


def results_of(work: Path, case: str) -> dict:
    return {r["mode"]: r for r in json.loads((work / f"{case}.json").read_text())["results"]}


TWO_RANK_CASES = "modes,split,accumulation,plan,order"


@pytest.fixture(scope="module")
def two_ranks(small_dataset, tmp_path_factory) -> Path:
    """The work directory of one 2-rank launch running every case that must succeed."""
    work = tmp_path_factory.mktemp("grad_sync2")
    proc, _ = run_cases(TWO_RANK_CASES, 2, small_dataset, work, timeout=420)
    assert proc.returncode == 0, tail(proc, 6000)
    return work


@pytest.mark.slow  # mpiexec launches
@needs_mpiexec
@pytest.mark.parametrize("ranks", [2, 4])
def test_each_clip_mode_matches_the_formula_from_gathered_gradients(ranks, small_dataset, tmp_path,
                                                                    request):
    """All four modes on 2 ranks; on 4, the two that clip per rank before the sum (their
    formula is the one the world size changes; global_after and none only average)."""
    if ranks == 2:
        work, case = request.getfixturevalue("two_ranks"), "modes"
    else:
        proc, _ = run_cases("per-rank", ranks, small_dataset, tmp_path)
        assert proc.returncode == 0, tail(proc, 6000)
        work, case = tmp_path, "per-rank"
    results = results_of(work, case)
    assert set(results) == ({"global_after", "local_before", "bucket_before", "none"}
                            if ranks == 2 else {"local_before", "bucket_before"})
    for mode, rec in results.items():
        assert rec["plan_recut"]  # step 2 ran on the plan re-cut in measured order
        for step in rec["steps"]:
            assert step["max_rel_err"] < 1e-5
            assert step["grads_are_views"]
            assert step["split"] == ["bert.embeddings.word_embeddings.weight"]
            if mode != "global_after":  # the modes really differ: the check can fail
                assert step["diff_from_global_after"] > 1e-2, (mode, step)
            if mode == "local_before":  # nothing can start before the local norm is known
                assert step["launched_before_last_ready"] == 0
                assert step["launched_in_backward"] == step["launched_in_backward_report"] == 0
            else:                       # overlap: allreduces launched while backward runs
                assert step["launched_before_last_ready"] >= 1, (mode, step)
                assert step["launched_in_backward_report"] == step["buckets"]
    if "global_after" in results:
        assert results["global_after"]["steps"][0]["clip_coef"] < 1.0
    assert results["local_before"]["steps"][0]["clip_coef"] < 1.0
    bb = results["bucket_before"]["steps"][0]
    assert bb["clip_coef_min"] < bb["clip_coef_mean"] <= 1.0
    assert bb["grad_norm"] <= 0.5 * (1 + 1e-5)  # ‖ĝ‖ ≤ τ holds for the bucket-wise clip


@pytest.mark.slow  # 2 ranks under mpiexec
@needs_mpiexec
def test_split_tied_embedding_sync_is_exact_and_reduces_the_decoder_share_early(two_ranks):
    results = results_of(two_ranks, "split")
    assert set(results) == {"global_after+split", "none+split", "global_after+split+accum"}
    for label, rec in results.items():
        for step in rec["steps"]:
            assert step["max_rel_err"] < 1e-5, (label, step)  # the reference gradient
            assert step["split"] == []  # the tied embedding is one whole bucket of its own
            assert step["lanes"] == step["buckets"] + 1  # + the decoder's share
            # the decoder's share goes out while backward is still running ...
            assert step["lane_launch"][-1] < step["backward_end"], (label, step)
            # ... and the lookup's share is the touched rows only, a small part of the table
            k = step["sparse_bucket"]
            assert 0 < step["lane_bytes"][k] < 0.25 * step["tied_bytes"], (label, step)
    accum = results["global_after+split+accum"]["steps"][0]
    assert accum["launches_at_forward"] == [0, 0]  # nothing launched in micro-step 1
    # decoder share + every dense bucket + the row mask + the rows
    assert accum["launches"] == accum["buckets"] + 2


@pytest.mark.slow  # 2 ranks under mpiexec
@needs_mpiexec
def test_accumulation_reduces_only_on_the_last_micro_step(two_ranks):
    for mode, rec in results_of(two_ranks, "accumulation").items():
        step = rec["steps"][0]
        assert step["max_rel_err"] < 1e-5
        assert step["launches_at_forward"] == [0, 0]  # nothing launched in micro-step 1
        assert step["launches"] == step["buckets"]


@pytest.mark.slow  # 2 ranks under mpiexec
@needs_mpiexec
def test_explicit_plan_with_a_split_parameter(two_ranks):
    rec = results_of(two_ranks, "plan")["bucket_before"]
    assert not rec["plan_recut"]  # a plan file is never reordered
    for step in rec["steps"]:
        assert step["buckets"] == 4 and step["max_rel_err"] < 1e-5
        assert step["split"] == ["bert.embeddings.word_embeddings.weight"]


@pytest.mark.slow  # 2 ranks under mpiexec
@needs_mpiexec
def test_the_first_step_recut_follows_the_slowest_ranks_ready_times(two_ranks):
    """Gradients arrive a then b on rank 0, b then a on rank 1, whose a is 0.3 s late: the
    plan puts b first (the slowest rank's times) where rank 0's arrival order put a first."""
    rec = results_of(two_ranks, "order")["two-branches"]
    (order0, ready0), (order1, ready1) = rec["arrivals"]
    assert order0[0].startswith("a.") and order1[0].startswith("b.")
    slowest = {n: max(ready0[n], ready1[n]) for n in ready0}
    assert min(slowest[n] for n in ("a.weight", "a.bias")) >= 0.3
    assert rec["plan_order"] == production_order(slowest, order0)
    assert [n[0] for n in rec["plan_order"]] == ["b", "b", "a", "a"]


@pytest.mark.slow  # a 2-rank mpiexec launch each
@needs_mpiexec
@pytest.mark.parametrize("case,message", [
    ("plan-differs", "bucket plan (train.bucket_plan / train.bucket_cap_mb) differs between ranks"),
    ("plan-missing", "parameter(s) in no bucket: cls.seq_relationship.bias"),
])
def test_bad_plans_stop_every_rank_at_start(case, message, small_dataset, tmp_path):
    proc, elapsed = run_cases(case, 2, small_dataset, tmp_path, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert elapsed < 60
    assert not (tmp_path / f"{case}.json").exists()
