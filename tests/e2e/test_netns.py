"""The slow-network test bed (bench.netns) and the overlap benchmark on it (bench.overlap).

Real namespaces, a real veth pair, a real tc rate limit: the allreduce between the two ranks
must take as long as the limit says, everything the test bed made must be gone afterwards
(normal exit, a failing rank, SIGTERM), and bench.overlap must produce its record. Needs root
and iproute2; skipped, with the reason, only where ``ip netns`` is impossible. Slow, all of it:
every test starts ranks (or the test bed's processes) in real namespaces.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.netns import ADDRS, Testbed, unavailable
from tests.support.tiny import TINY, as_overrides

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "dist_scripts" / "netns_allreduce.py"
WHY = unavailable()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(WHY is not None, reason=f"no network namespaces here: {WHY}")]


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_rate_limit_is_real_and_everything_is_torn_down():
    mb, rate = 4.0, 100.0
    with Testbed(rate) as bed:
        assert set(bed.namespaces) <= _namespaces()
        ranks = bed.run([sys.executable, str(SCRIPT), str(mb), "3"], timeout=120)
        assert [r.returncode for r in ranks] == [0, 0], ranks[0].stderr + ranks[1].stderr
        results = [json.loads(r.stdout.strip().splitlines()[-1]) for r in ranks]
        # the peers met at the namespace address, over the runtime's env path
        assert {(r["launcher"], r["master"]) for r in results} == {("torchrun", ADDRS[0])}
        # 2 ranks: each sends ~the whole buffer once; tbf lets through `rate` bits per second
        expected = mb * 2 ** 20 * 8 / (rate * 1e6)
        seconds = min(min(r["seconds"]) for r in results)
        assert seconds > 0.8 * expected, (seconds, expected)
        assert seconds < 3 * expected + 1.0, (seconds, expected)
        bed.set_rate(None)  # unlimited: the same allreduce is far faster
        fast = bed.run([sys.executable, str(SCRIPT), str(mb), "3"], timeout=120)
        assert min(json.loads(fast[0].stdout.strip().splitlines()[-1])["seconds"]) < 0.5 * expected
    assert bed.leftovers() == []
    assert not set(bed.namespaces) & _namespaces()


def test_a_failing_rank_stops_the_other_and_the_bed_is_removed():
    with Testbed(50) as bed:
        cmd = [sys.executable, "-c", "import os, sys, time; r = int(os.environ['RANK']); "
               "time.sleep(0.5); sys.exit(3) if r == 1 else time.sleep(120)"]
        start = time.monotonic()
        ranks = bed.run(cmd, timeout=60)
        assert time.monotonic() - start < 30
        assert ranks[1].returncode == 3 and ranks[0].returncode != 0
    assert bed.leftovers() == []


def test_sigterm_tears_the_bed_down():
    proc = subprocess.Popen([sys.executable, "-m", "bench.netns", "--rate-mbit", "10", "--",
                             "sleep", "120"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    mine = {f"presto{proc.pid}a", f"presto{proc.pid}b"}
    deadline = time.monotonic() + 30
    while not mine <= _namespaces():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert not mine & _namespaces()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"pv{proc.pid}a" not in links


def test_overlap_benchmark_writes_its_record(small_dataset, tmp_path):
    out = tmp_path / "overlap.json"
    tiny = [*as_overrides(TINY), f'data.data_dir="{small_dataset}"', "data.eval_batch_size=64",
            "train.bucket_cap_mb=1"]
    cmd = [sys.executable, "-m", "bench.overlap", "--rate-mbit", "1000", "--steps", "2",
           "--warmup", "2", "--repeat", "2", "--out", str(out), "--workdir", str(tmp_path),
           "--variants", "after_backward,ddp,buckets/global_after,buckets/bucket_before,"
                         "buckets/global_after+split",
           *[a for s in tiny for a in ("--set", s)]]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record == json.loads(out.read_text())
    v = record["variants"]
    assert set(v) == {"after_backward", "ddp", "buckets/global_after", "buckets/bucket_before",
                      "buckets/global_after+split"}
    # split: the bytes left for the end of backward shrink to the touched rows of the embedding
    split, dense = v["buckets/global_after+split"], v["buckets/global_after"]
    assert split["end_bytes_frac"] < 0.5 * dense["end_bytes_frac"], (split, dense)
    assert v["after_backward"]["buckets"] == 1 and v["buckets/global_after"]["buckets"] > 1
    assert v["after_backward"]["comm_s"] > 0 and v["ddp"]["comm_s"] is None
    assert record["calibration"]["allreduce_full_s"] > 0
    assert {"exposed_le_20pct_of_a", "bucket_before_within_5pct_of_global_after",
            "runtime_at_least_as_fast_as_ddp"} <= set(record["goals"])
    assert "| after_backward |" in proc.stdout
