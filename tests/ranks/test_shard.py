"""The sharded optimizer (optim.shard): each rank updates a row shard of the flat buffers and
keeps that shard's optimizer state; the run equals the unsharded one.

Real ranks with the venv's mpiexec on tests/dist_scripts/shard.py, two launches: 2 ranks (each
optimizer and each clip mode, the reduce to the owners, exact resume, the capture-safe step, a
rank killed mid-step) and 4 ranks (each optimizer and clip mode paired otherwise, two "nodes"
of two, the 2-rank checkpoint re-sharded 4 ways). In one process: tests/unit/test_shard_unit.py,
tests/integration/test_shard_integration.py.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.support.launch import needs_mpiexec, run_script, tail

FAULT_DEADLINE_S = 60  # tests/ranks/test_dist_ranks.py: every rank gone within 60 s of a fault
KEY_BIAS = "bert.encoder.layer.0.attention.self.key.bias"


def results(work: Path, case: str, world: int = 2) -> dict:
    return json.loads((work / f"{case}-{world}.json").read_text())["result"]


@pytest.fixture(scope="module")
def two_ranks(small_dataset, tmp_path_factory) -> tuple[Path, dict]:
    """One 2-rank launch: equal, reduce, resume, tamper, count, then kill (which ends it)."""
    work = tmp_path_factory.mktemp("shard2")
    proc = run_script(2, "shard.py", "equal,reduce,noshm,resume,tamper,count,kill",
                      small_dataset, work, timeout=900)
    ended = time.time()
    return work, {"proc": proc, "ended": ended}


@pytest.fixture(scope="module")
def four_ranks(two_ranks, small_dataset) -> Path:
    """One 4-rank launch in the same work directory (reshard reads the 2-rank checkpoint)."""
    work, _ = two_ranks
    proc = run_script(4, "shard.py", "diagonal,reduce,node,reshard", small_dataset, work,
                      timeout=900)
    assert proc.returncode == 0, tail(proc, 6000)
    return work


def assert_equal_runs(runs: list, shards: int) -> None:
    for r in runs:
        # every parameter, bit for bit (the sums of the gradient are the allreduce's, the
        # per-tensor norms fp64 partial sums: fp32 results equal to the last bit)
        assert r["max_rel_err_any_rank"] == 0.0, (r["name"], sorted(
            r["rel_err"].items(), key=lambda x: -x[1])[:3])
        # (with master weights - train.precision bf16_master - the fp32 masters too)
        assert r["bitwise_params"] == r["params"] == (60 if "master" in r["name"] else 30), \
            r["name"]
        a, b = r["unsharded"], r["sharded"]
        assert a["grad_norms"] == b["grad_norms"] and a["loss_scales"] == b["loss_scales"]
        # the noise scale's tap sees the same two norms (its local ‖g_r‖² on every rank)
        assert r["steps"] >= 8
        assert a["local_sq_norms"] == b["local_sq_norms"] and len(b["local_sq_norms"]) == r["steps"]
        assert a["grad_sq_means"] == b["grad_sq_means"] and len(b["grad_sq_means"]) == r["steps"]
        assert a["skipped"] == b["skipped"]
        if "fp16" in r["name"]:  # the poisoned steps, skipped on every rank alike
            assert sum(b["skipped"]) == 2 and b["loss_scales"][-1] < b["loss_scales"][0]
        # optimizer state per rank: 1/N of the unsharded (+ at most a row per shard)
        assert b["state_elements"] <= a["state_elements"] * (1 / shards + 0.05), r["name"]
        assert b["shard"]["shards"] == shards


def every_optimizer_and_clip_mode(runs: list) -> None:
    """Each optimizer and each clip mode ran (fp16 loss scale, 2 micro-batches)."""
    names = [r["name"].split("/") for r in runs if r["name"].endswith("/accum2/fp16")]
    assert {n[0] for n in names} == {"lamb", "adamw", "lars"}
    assert {n[1] for n in names} == {"global_after", "local_before", "bucket_before", "none"}


@pytest.mark.slow  # 2 ranks under mpiexec
@needs_mpiexec
@pytest.mark.timeout(1200)
def test_sharded_equals_unsharded_for_every_optimizer_and_clip_mode_at_two_ranks(two_ranks):
    work, _ = two_ranks
    runs = results(work, "equal")
    every_optimizer_and_clip_mode(runs)
    assert {"lamb/global_after/plain", "lamb/global_after/bf16-reduce",
            "lamb/global_after/bf16_master"} <= {r["name"] for r in runs}
    assert_equal_runs(runs, 2)
    split = {r["name"]: r["sharded"]["split"] for r in runs}
    assert split["lamb/global_after/accum2/fp16"] and not split["adamw/local_before/accum2/fp16"]
    facts = runs[0]["sharded"]["shard"]
    assert "allreduce of each bucket" in facts["gradient_reduction"]  # gloo, and it says so
    # one host's CPU ranks share the parameter buffer: nothing to gather
    assert facts["parameter_gather"].startswith("none: the group's ranks share one parameter")


@pytest.mark.slow  # 2 ranks under mpiexec
@needs_mpiexec
@pytest.mark.timeout(1200)
def test_the_reduce_to_the_owners_gives_each_shard_the_averaged_gradient(two_ranks, four_ranks):
    """NCCL's path (each bucket's pieces reduced to their shards' owners), run on gloo."""
    for world in (2, 4):
        for r in results(four_ranks, "reduce", world):
            first = r["first_step"]
            assert first["max_abs_err_rel_to_max"] <= 1e-6, first
            if world == 2:  # a + b = b + a: the allreduce's sums, bit for bit
                assert first["bitwise"] and r["bitwise_params"] == 30, r["name"]
            else:
                # 4 ranks: gloo's reduce adds in another order than its allreduce (rounding).
                # Adam turns the rounding of a gradient that is 0 in exact arithmetic - the
                # attention key bias (softmax ignores it) - into steps of O(lr); everything
                # else stays close. A wrong owner or a missed piece is an O(1) error.
                others = {n: e for n, e in r["rel_err"].items() if n != KEY_BIAS}
                assert max(others.values()) < 1e-4, r["name"]
            assert r["unsharded"]["skipped"] == r["sharded"]["skipped"]


@pytest.mark.slow  # 2 ranks under mpiexec
@needs_mpiexec
@pytest.mark.timeout(1200)
def test_a_sharded_resume_is_exact_and_a_checkpoint_reshards(two_ranks, four_ranks):
    work, _ = two_ranks
    r = results(work, "resume")
    assert r["resumed_from"] is not None and r["steps_equal"], r
    assert not any("re-sharded" in n for n in r["resumed_notes"])  # its own shard file
    assert r["params"]["bitwise_params"] == r["params"]["params"], r["params"]
    assert {"optimizer_shard_00000.pt", "optimizer_shard_00001.pt",
            "model.safetensors", "optimizer.pt"} <= set(r["files"])
    # bf16 parameters with fp32 masters: model.safetensors holds the masters, in fp32
    assert r["model_file"]["dtypes"] == ["torch.float32"]
    assert r["model_file"]["masters"] == r["model_file"]["params"] == 30
    # restored unsharded: the two shards put back together, every tensor's state (two moments
    # and the master weight) bit for bit
    assert r["unsharded_restore"]["bitwise"] == r["unsharded_restore"]["tensors"] == 90
    assert any("re-sharded from 2 shard(s) to none" in n for n in r["unsharded_notes"])
    four = results(four_ranks, "reshard", 4)
    assert four["from_world"] == 2 and four["shards"] == 4
    assert four["restore"]["bitwise"] == four["restore"]["tensors"] == 90
    assert any("re-sharded from 2 shard(s) to 4" in n for n in four["notes"])


@pytest.mark.slow  # 2 ranks under mpiexec
@needs_mpiexec
@pytest.mark.timeout(1200)
def test_a_swapped_or_stale_shard_file_is_refused_on_every_rank_naming_it(two_ranks):
    """The checkpoint's two shard files swapped, or both another step's, under a manifest
    rewritten to match: each rank's restore refuses its file (exit 2's CheckpointError),
    where it used to load the other rank's optimizer rows and train on, diverged."""
    work, _ = two_ranks
    r = results(work, "tamper")
    for case, needle in (("swapped", "holds shard {other}, not shard {me}"),
                         ("stale", "a stale file from another checkpoint")):
        for rank, said in enumerate(r[case]):
            assert said and f"optimizer_shard_0000{rank}.pt: " in said, (case, said)
            assert needle.format(me=rank, other=1 - rank) in said, (case, said)


@pytest.mark.slow  # 2 ranks under mpiexec
@needs_mpiexec
@pytest.mark.timeout(1200)
def test_the_sharded_step_is_capture_safe_and_issues_only_its_collectives(two_ranks):
    work, _ = two_ranks
    for r in results(work, "count"):
        assert r["events"] == [] and r["same_trace"] and r["in_place"], r
        assert r["trace_ops"] > 100
        for calls in r["calls"]:
            # on the simulated GPU the parameters are gathered (2 broadcasts on gloo), as on
            # NCCL; + the norm's and the per-tensor partial norms' small allreduces
            if r["reduction"] == "reduce":  # one reduce per piece of a bucket in a shard
                want = {"reduce": r["pieces"], "all_reduce": 2, "broadcast": 2}
            else:
                want = {"all_reduce": r["buckets"] + 2, "broadcast": 2}
            assert calls == want, (r["clip"], calls, want)
        assert r["pieces"] > r["buckets"]  # some bucket straddles the two shards


@pytest.mark.slow  # 2 ranks under mpiexec
@needs_mpiexec
@pytest.mark.timeout(1200)
def test_a_rank_killed_in_the_sharded_step_ends_the_others(two_ranks):
    work, launch = two_ranks
    proc = launch["proc"]
    for case in ("equal", "reduce", "noshm", "resume", "tamper", "count"):  # every one before
        assert (work / f"{case}-2.json").is_file(), tail(proc, 6000)
    assert proc.returncode != 0, tail(proc, 4000)
    killed = float((work / "killed_at").read_text())
    assert launch["ended"] - killed < FAULT_DEADLINE_S, tail(proc, 4000)
    assert not (work / "kill-2.json").exists()


@pytest.mark.slow  # 4 ranks under mpiexec
@needs_mpiexec
@pytest.mark.timeout(1200)
def test_sharded_equals_unsharded_at_four_ranks_and_across_nodes(four_ranks):
    runs = results(four_ranks, "diagonal", 4)
    every_optimizer_and_clip_mode(runs)
    assert_equal_runs(runs, 4)
    node = results(four_ranks, "node", 4)
    assert_equal_runs(node["runs"], 2)  # 2 "nodes" of 2: 2 shards, one copy per node
    # the (optimizer, clip mode) pairs run sharded against unsharded, over both launches
    pairs = {tuple(r["name"].split("/")[:2]) for r in
             results(four_ranks, "equal") + runs + node["runs"]}
    assert len(pairs) == 10, sorted(pairs)
    assert "optim.shard='node' needs the same number of ranks on every node" in \
        node["misplaced"]  # local ranks 1, 0, 1, 0: refused on every rank


@pytest.mark.slow  # 2 ranks under mpiexec
@needs_mpiexec
@pytest.mark.timeout(1200)
def test_without_room_in_dev_shm_the_parameters_are_broadcast(two_ranks):
    r = results(two_ranks[0], "noshm")
    assert_equal_runs([r], 2)
    gather = r["sharded"]["shard"]["parameter_gather"]
    assert gather.startswith("one broadcast per shard (gloo); no shared memory for the "
                             "parameters (No space left on device"), gather


