"""Which rank died first (submission.rank_ends.first_ended) and the summary made of it
(submission.rank_status.summary): from the ranks' records and the order in which the watch
beside the launcher saw them end - not from a launcher's report that names a rank it killed
itself (MPICH's banner named rank 1 of rank 3's death at 4 ranks). Written files only; the
watch itself: tests/integration/test_rank_ends_integration.py, and at 4 ranks
tests/e2e/test_resume_e2e.py.
"""
from __future__ import annotations

import json

import pytest

from submission import rank_status
from submission.rank_ends import ends_path, first_ended

STARTED = 100.0


def hydra(pid: int) -> str:
    return (f"=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n=   PID {pid} RUNNING AT "
            f"vm\n=   EXIT CODE: 9\n=   CLEANING UP REMAINING PROCESSES\n")


@pytest.fixture
def run_dir(tmp_path):
    """Four ranks on host vm (pids 10..13) that trained to step 10 and recorded no end."""
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    for r in range(4):
        (ranks / f"rank_{r:05d}.json").write_text(json.dumps({
            "rank": r, "world_size": 4, "host": "vm", "pid": 10 + r, "started": STARTED,
            "state": "training", "step": 10}))
    return tmp_path


def watched(run_dir, *groups, host="vm", started=STARTED):
    lines = [{"host": host, "started": started}]
    lines += [{"time": started + 1 + i, "pids": list(g)} for i, g in enumerate(groups)]
    ends_path(run_dir).write_text("".join(json.dumps(x) + "\n" for x in lines))


def summarise(run_dir, report: str = "") -> list[str]:
    log = run_dir / "launcher.log"
    log.write_text(report)
    code, lines = rank_status.summary(run_dir, 9, log, STARTED, "mpiexec")
    assert code == 3
    return lines


def test_the_rank_that_ended_first_is_named_not_the_one_the_launcher_killed_after(run_dir):
    watched(run_dir, [13], [12], [11], [10])   # rank 3 first, the others 0.1 s later
    lines = summarise(run_dir, hydra(11))       # hydra's banner names rank 1, its own victim
    assert lines[0] == ("rank 3 (pid 13 on vm) ended first, without an exit record: killed "
                        "(SIGKILL, the OOM killer, a lost node) or crashed in native code; "
                        "mpiexec's report names rank 1, which it ended itself after"), lines
    assert lines[1] == "rank 3 (pid 13 on vm): no exit record - ended first; last logged step 10"
    assert lines[2].startswith("rank 0 (pid 10 on vm): no exit record - ended after rank 3 "
                               "(the launcher ends the others)"), lines
    assert not any(x.startswith("rank 1 (pid 11 on vm) ended first") for x in lines), lines


def test_a_launcher_that_names_the_rank_that_ended_first_keeps_its_words(run_dir):
    watched(run_dir, [12], [10, 11, 13])
    lines = summarise(run_dir, hydra(12))
    assert lines[0] == ("rank 2 (pid 12 on vm) ended first: killed by SIGKILL (kill -9, the "
                        "OOM killer or a lost node)"), lines


@pytest.mark.parametrize("case,why", [
    ("tie", "ranks 1, 3 ended within one look of the watch on vm: too close together"),
    ("other host", "rank(s) 0, 1, 2, 3 ran on another host than node7, where the ranks were "
                   "watched"),
    ("earlier launch", "no watch of this launch's ranks was kept"),
    ("no watch", "no watch of this launch's ranks was kept")])
def test_when_nothing_can_tell_which_rank_ended_first_none_is_named(run_dir, case, why):
    """The launcher's report is kept as its word, marked as possibly a rank it ended itself."""
    if case == "tie":
        watched(run_dir, [13, 11], [10, 12])
    elif case == "other host":
        watched(run_dir, [13], [10, 11, 12], host="node7")
    elif case == "earlier launch":
        watched(run_dir, [13], [10, 11, 12], started=STARTED - 60)
    lines = summarise(run_dir, hydra(11))
    assert lines[0].startswith(f"which rank ended first cannot be told: {why}"), lines
    assert lines[0].endswith("mpiexec's report names rank 1 (killed by SIGKILL (kill -9, the "
                             "OOM killer or a lost node)), which may be one it ended itself "
                             "after the first"), lines
    assert not any(" ended first" in x and "cannot be told" not in x for x in lines), lines
    assert all("killed (SIGKILL, OOM, lost node) or stopped by the launcher" in x
               for x in lines[1:5]), lines


def test_first_ended_counts_only_the_ranks_without_a_record(run_dir):
    """A rank that ended by itself (its record has its end) before the others were killed is
    not the one that died."""
    watched(run_dir, [10], [12], [11, 13])
    records = rank_status.read_all(run_dir)
    assert first_ended(run_dir, records, [1, 2, 3], STARTED) == (2, "")
    assert first_ended(run_dir, records, [1, 3], STARTED)[0] is None


def fail(run_dir, rank: int, at: float, reason: str = "") -> None:
    """Rank ``rank`` recorded a runtime failure at time ``at`` (submission.rank_status.finish)."""
    path = run_dir / "ranks" / f"rank_{rank:05d}.json"
    rec = json.loads(path.read_text())
    rec.update(exit=3, state="failed", time=at, reason=reason)
    path.write_text(json.dumps(rec))


def test_a_rank_killed_before_a_peer_recorded_its_failure_is_named_first(run_dir):
    """CI, 4 ranks, rank 3 SIGKILLed: rank 0's next barrier broke at once ("Ranks 3 failed to
    pass monitoredBarrier") and rank 0 recorded that failure before mpiexec killed the
    others - the summary named hydra's victim, rank 1, and called rank 3 'stopped after rank 0
    failed'. The watch saw rank 3 end (time 101) before rank 0's record (101.5)."""
    watched(run_dir, [13], [10], [11, 12])
    fail(run_dir, 0, STARTED + 1.5, "RuntimeError: [Rank 0]: Ranks 3 failed to pass "
                                     "monitoredBarrier in 30000 ms")
    lines = summarise(run_dir, hydra(11))
    assert lines[0] == ("rank 3 (pid 13 on vm) ended first, without an exit record: killed "
                        "(SIGKILL, the OOM killer, a lost node) or crashed in native code; "
                        "rank 0 failed after it; mpiexec's report names rank 1, which it "
                        "ended itself after"), lines
    assert lines[1] == "rank 3 (pid 13 on vm): no exit record - ended first; last logged step 10"
    assert lines[2].startswith("rank 0 (pid 10 on vm): exit 3, failed after step 10: "
                               "RuntimeError"), lines
    assert lines[3].startswith("rank 1 (pid 11 on vm): stopped after rank 0 failed"), lines


def test_a_failure_recorded_before_any_rank_was_killed_stays_the_cause(run_dir):
    """Rank 0 failed on its own (recorded at 100.5), then ended (101) and mpiexec killed the
    others (102): no rank ended before the failure, so rank 0 leads the summary."""
    watched(run_dir, [10], [11, 12, 13])
    fail(run_dir, 0, STARTED + 0.5, "ValueError: a bug")
    lines = summarise(run_dir, hydra(10))
    assert lines[0].startswith("rank 0 (pid 10 on vm) ended first: "), lines
    assert lines[1].startswith("rank 0 (pid 10 on vm): exit 3, failed after step 10: "
                               "ValueError"), lines
    assert all(" stopped after rank 0 failed" in x for x in lines[2:5]), lines


def test_a_peer_the_failing_rank_found_gone_is_named_first_without_a_watch(run_dir):
    """The failing rank's own word: it looked for its peers (lost_ranks, up to
    PEER_GRACE_S) before recording its failure and found rank 3 gone - no watch needed."""
    fail(run_dir, 0, STARTED + 1.5, "RuntimeError: Connection closed by peer")
    path = run_dir / "ranks" / "rank_00000.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), lost=[3])))
    lines = summarise(run_dir, hydra(11))
    assert lines[0].startswith("rank 3 (pid 13 on vm) ended first, without an exit record"), \
        lines
    assert lines[1].startswith("rank 3 (pid 13 on vm): no exit record - ended first"), lines


def test_lost_ranks_finds_a_peer_gone_without_a_word(run_dir):
    """Rank 2's PID names no process here: gone (after step 10); the others are this test's
    own PID (alive) - and the wait ends as soon as one is found."""
    import os
    import socket
    for r in range(4):
        path = run_dir / "ranks" / f"rank_{r:05d}.json"
        rec = dict(json.loads(path.read_text()), host=socket.gethostname(),
                   pid=os.getpid() if r != 2 else 2 ** 22 + 7)
        path.write_text(json.dumps(rec))
    said, gone = rank_status.lost_ranks(run_dir, 0, wait_s=30.0)
    assert gone == [2] and len(said) == 1 and said[0].startswith("rank 2 ") and \
        "gone without a word after step 10" in said[0], said
    assert rank_status.lost_ranks(run_dir, 2) == ([], [])


def test_the_watch_asks_to_wake_first_where_the_host_allows_it():
    """SCHED_FIFO at priority 1 where permitted (root here): the watch then runs the moment a
    rank ends, before the launcher's clean-up kills the others (a loaded host otherwise shows
    the ends as a tie); where not permitted it stays as it was and says so by returning False."""
    import os

    from submission.rank_ends import wake_first
    before = os.sched_getscheduler(0), os.sched_getparam(0)
    try:
        if wake_first():
            assert os.sched_getscheduler(0) == os.SCHED_FIFO
            assert os.sched_getparam(0).sched_priority == 1
        else:
            assert (os.sched_getscheduler(0), os.sched_getparam(0)) == before
    finally:
        os.sched_setscheduler(0, *before)
