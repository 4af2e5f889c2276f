"""bench.common: the one record header every benchmark writes, the atomic write and the final
JSON line; and that every benchmark that writes a record goes through it."""
from __future__ import annotations

import json
import re
from pathlib import Path

from bench import common

BENCH = Path(__file__).resolve().parents[2] / "bench"
# Not benchmarks with a record: the runtime's and baseline's helpers, the test bed.
NO_RECORD = {"__init__.py", "common.py", "baseline_ddp.py", "fault_rank.py", "netns.py",
             "harness.py",           # the benchmarks' runner: it records through common
             "same_metrics.py",      # a check of two runs' records: it measures nothing
             "compare_commits.py",   # two runs and same_metrics on them: nothing recorded
             "tf_bundle_writer.py",  # bench.convert_crc's input writer
             "cuda_dispatch.py",     # bench.kernel_count's CUDA dispatch on a CPU
             "kernel_counter.py",    # bench.kernel_count's counter and its rules
             # bench.device_time's helpers: a case counted in a child process, the model,
             # the node's projection, the tables, the cuts' before/after, each op's FLOPs
             # and bytes
             "device_cases.py", "device_model.py", "device_node.py", "device_tables.py",
             "device_cuts.py", "op_cost.py"}


def test_record_header_and_finish(tmp_path, capsys):
    rec = common.record("demo", ["--seeds", "1,2", "--set", "a.b=c d"], extra=3)
    assert list(rec)[:6] == ["benchmark", "command", "commit", "machine", "date", "extra"]
    assert rec["benchmark"] == "demo" and rec["commit"]
    assert rec["command"] == "python -m bench.demo --seeds 1,2 --set 'a.b=c d'"
    assert set(rec["machine"]) == {"cpus", "cpu_model", "python", "torch", "platform"}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+-]\d\d:\d\d", rec["date"])
    assert common.record("x", [], module="bench.tune")["command"] == "python -m bench.tune"

    out = tmp_path / "sub" / "demo.json"
    common.finish(rec, out, line={"benchmark": "demo", "short": True})
    written = json.loads(out.read_text())
    assert written["extra"] == 3 and "load_avg_1m_at_end" in written["machine"]
    assert [p.name for p in out.parent.iterdir()] == ["demo.json"]  # no temporary left
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == {"benchmark": "demo", "short": True}
    common.finish(rec, None)  # no file: the whole record is the final line
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["extra"] == 3
    assert common.fmt(None, ".1f") == "-" and common.fmt(2.25, ".1f") == "2.2"


def test_every_benchmark_writes_its_record_through_common():
    for path in sorted(BENCH.glob("*.py")):
        if path.name in NO_RECORD:
            continue
        text = path.read_text()
        assert any(f in text for f in ("from bench.common import", "from bench import common",
                                       "from bench.harness import")), path
        assert '"bench":' not in text and "platform.python_version" not in text, path


def test_a_launch_that_did_not_write_the_log_is_not_read_from_an_earlier_runs_log(
        tmp_path, monkeypatch):
    """run_and_time.sh refuses a directory that holds another run (exit 2) before it logs: the
    log there is the earlier run's, and reading it would report that run's result as this
    one's."""
    run_dir = tmp_path / "x_seed1"
    run_dir.mkdir()
    log = run_dir / "mlperf_bert.log"
    line = lambda key, value, meta: ":::MLLOG " + json.dumps(
        {"key": key, "value": value, "time_ms": 0, "metadata": meta})
    log.write_text("\n".join([line("run_start", None, {}), line("eval_accuracy", 0.5,
                                                                 {"epoch_num": 100}),
                              line("run_stop", None, {"status": "success"})]) + "\n")
    assert common.parse_mllog(log)["status"] == "success"
    monkeypatch.setattr(common, "launch", lambda *a, **k: (2, 0.1))
    rec = common.run_runtime(Path("c.toml"), 1, [], tmp_path, name="x")
    assert rec["status"] == "failed" and rec["rc"] == 2 and "earlier run's" in rec["error"]

    def writes(*a, **k):   # a launch that did log: its log is read
        log.write_text(log.read_text() + line("eval_accuracy", 0.6, {"epoch_num": 100}) + "\n")
        return 0, 0.1
    monkeypatch.setattr(common, "launch", writes)
    assert common.run_runtime(Path("c.toml"), 1, [], tmp_path, name="x")["status"] == "success"
