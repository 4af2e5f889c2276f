"""bench.harness: a benchmark as a row - options, cases, a measure function, a table, goals -
and the one run of it: the record, the partial writes, the printed verdicts, the exit status.
And that every ``python -m bench.X`` is such a row and answers ``--help``."""
from __future__ import annotations

import contextlib
import importlib
import json
import re
from pathlib import Path

import pytest

from bench import harness
from bench.harness import Benchmark, Column, Goal, Stop, listed, option, out

BENCH = Path(__file__).resolve().parents[2] / "bench"
# Not benchmarks: tools and helpers of the benchmarks (tests/unit/test_bench_common.py's list),
# and the two checks that compare runs rather than measure them.
NOT_BENCHMARKS = {"__init__.py", "common.py", "harness.py", "baseline_ddp.py", "fault_rank.py",
                  "netns.py", "same_metrics.py", "compare_commits.py", "tf_bundle_writer.py",
                  "cuda_dispatch.py", "kernel_counter.py",
                  # bench.device_time's: a case counted in a child process, the model, the
                  # node's projection, the tables, the cuts' before/after, each op's FLOPs
                  # and bytes
                  "device_cases.py", "device_model.py", "device_node.py", "device_tables.py",
                  "device_cuts.py", "op_cost.py"}
# Benchmarks another change owns right now; each becomes a row there or after it lands.
PENDING: dict[str, str] = {}
# Entry points without --help yet, in files another change owns right now.
PENDING_HELP: dict[str, str] = {}


def toy(**over) -> Benchmark:
    """Squares of --numbers, a goal on their sum, a gate on their count."""
    def measure(run, n):
        if n < 0:
            raise Stop(f"{n} is negative", 2)
        return {"n": n, "square": n * n}

    @contextlib.contextmanager
    def setup(run):
        yield {"offset": 0}

    row = dict(
        name="toy", doc="Squares of numbers, a toy benchmark.\n\nMore words.", measure=measure,
        cases=lambda run: run.args.numbers, setup=setup, results="rows",
        options=(option("--numbers", type=listed(kind=int, what="number"), default="1,2,3"),
                 option("--limit", type=int, default=20), out(None)),
        fields=lambda a: {"numbers": a.numbers},
        progress=lambda run, case, res: f"{case} squared is {res['square']}",
        summary=lambda run: {"sum": sum(r["square"] for r in run.results)},
        table=lambda rec: harness.markdown((Column("n", "n"), Column("n²", "square", ",")),
                                           rec["rows"]),
        goals=(Goal("sum_under_limit", "the squares sum under --limit",
                    lambda rec: rec["sum"] < 20),
               Goal("three_numbers", "three numbers measured",
                    lambda rec: len(rec["rows"]) == 3, gate=True)),
        line=("sum",))
    row.update(over)
    return Benchmark(**row)


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_a_run_records_prints_and_holds_to_its_goals(tmp_path, capsys):
    path = tmp_path / "toy.json"
    assert harness.run(toy(), ["--numbers", "1,2,3", "--out", str(path)]) == 0
    printed = capsys.readouterr().out
    rec = json.loads(path.read_text())
    assert list(rec)[:6] == ["benchmark", "command", "commit", "machine", "date", "numbers"]
    assert rec["command"] == f"python -m bench.toy --numbers 1,2,3 --out {path}"
    assert rec["rows"] == [{"n": 1, "square": 1}, {"n": 2, "square": 4}, {"n": 3, "square": 9}]
    assert rec["sum"] == 14 and rec["goals_met"] == {"sum_under_limit": True,
                                                     "three_numbers": True}
    assert "wall_s" in rec and "load_avg_1m_at_end" in rec["machine"]
    assert "3 squared is 9" in printed and "| 3 | 9 |" in printed
    assert "goal sum_under_limit (the squares sum under --limit): met" in printed
    assert last_json(printed) == {"benchmark": "toy", "sum": 14}


def test_a_missed_goal_is_a_finding_a_missed_gate_a_failure(tmp_path, capsys):
    assert harness.run(toy(), ["--numbers", "4,5,6"]) == 0   # sum 77: missed, exit 0
    printed = capsys.readouterr().out
    assert "goal sum_under_limit (the squares sum under --limit): MISSED" in printed
    assert harness.run(toy(), ["--numbers", "1,2"]) == 1     # the gate: three numbers
    assert "three_numbers (three numbers measured): MISSED" in capsys.readouterr().out


def test_refusals_exit_2_before_any_case(tmp_path, capsys):
    measured = []
    row = toy(measure=lambda run, n: measured.append(n) or {"n": n, "square": n})
    assert harness.run(row, ["--numbers", "1,x"]) == 2
    assert "invalid literal" in capsys.readouterr().err
    checked = toy(check=lambda a: "--limit must be positive" if a.limit <= 0 else None)
    assert harness.run(checked, ["--limit", "0"]) == 2
    assert "--limit must be positive" in capsys.readouterr().err
    assert harness.run(toy(), ["--numbers", "1,-1"]) == 2     # Stop(..., 2) from a case
    assert "bench.toy: -1 is negative" in capsys.readouterr().err
    assert measured == []


def test_help_shows_the_first_paragraph_and_the_goals(capsys):
    assert harness.run(toy(), ["--help"]) == 0
    text = capsys.readouterr().out
    assert "Squares of numbers, a toy benchmark." in text and "More words" not in text
    assert "sum_under_limit: the squares sum under --limit" in text
    assert "three_numbers: three numbers measured (exit 1 when missed)" in text


def test_the_record_is_written_after_every_case_when_partial(tmp_path):
    path = tmp_path / "toy.json"
    seen = []

    def measure(run, n):
        if path.exists():
            seen.append(len(json.loads(path.read_text())["rows"]))
        return {"n": n, "square": n * n}
    assert harness.run(toy(measure=measure, partial=True),
                       ["--numbers", "1,2,3", "--out", str(path)]) == 0
    assert seen == [1, 2]


def test_an_instead_flag_runs_in_place_of_the_benchmark_and_a_mode_picks_another_row(
        tmp_path, capsys):
    calls = []
    row = toy(instead=(("--worker", lambda a: calls.append(a.numbers) or 3),))
    assert harness.run(row, ["--worker", "--numbers", "7"]) == 3 and calls == [[7]]
    assert "squared" not in capsys.readouterr().out
    other = toy(name="other", measure=lambda run, n: [{"n": n, "square": 0}] * 2)
    row = toy(options=(*toy().options, option("--other", action="store_true")),
              mode=lambda a: other if a.other else None)
    path = tmp_path / "o.json"
    assert harness.run(row, ["--other", "--numbers", "5", "--out", str(path)]) == 1
    rec = json.loads(path.read_text())   # a measure's list: each result kept
    assert rec["benchmark"] == "other" and len(rec["rows"]) == 2


def test_listed_reads_a_comma_list_and_names_the_choices():
    assert listed(("a", "b"))("a,b,") == ["a", "b"]
    with pytest.raises(Exception, match="unknown mode.s. c; choose from a, b"):
        listed(("a", "b"), what="mode")("a,c")
    assert listed(kind=float)("1,2.5") == [1.0, 2.5]


def benchmark_modules() -> list[str]:
    return sorted(p.stem for p in BENCH.glob("*.py") if p.name not in NOT_BENCHMARKS)


def test_the_benchmarks_are_found():
    found = benchmark_modules()
    assert {"clip_modes", "noise_check", "shard", "faults", "tune", "hpo_batch"} <= set(found)
    assert len(found) >= 15, found


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(reason=PENDING[n], strict=True)) if n in PENDING
    else n for n in benchmark_modules()])
def test_every_benchmark_is_a_harness_row_and_answers_help(name, capsys):
    module = importlib.import_module(f"bench.{name}")
    row = getattr(module, "BENCHMARK", None)
    assert isinstance(row, Benchmark), f"bench/{name}.py: no BENCHMARK row (bench.harness)"
    assert module.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert re.match(rf"usage: python -m {re.escape(row.command)}\b", text), text[:200]
    for g in row.goals:
        assert g.name in text


def bench_entry_points() -> list[str]:
    from tests.unit.test_cli_help import entry_points
    return [m for m in entry_points() if m.split(".")[0] == "bench"]


@pytest.mark.parametrize("module", [
    pytest.param(m, marks=pytest.mark.xfail(reason=PENDING_HELP[m])) if m in PENDING_HELP
    else m for m in bench_entry_points()])
def test_every_python_m_bench_answers_help(module, capsys):
    """``python -m bench.X --help`` as a user types it, in this process: usage, exit 0 -
    the benchmarks, their helpers' entry points and bench.gpu alike."""
    main = importlib.import_module(module).main
    try:
        rc = main(["--help"])
    except SystemExit as e:
        rc = e.code
    assert rc in (0, None)
    assert capsys.readouterr().out.startswith("usage: ")
