"""bench.same_metrics: two runs' metrics records the same but for the clock's fields."""
import json

from bench.same_metrics import main


def _write(path, records):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_clock_fields_aside_every_value_must_match_exactly(tmp_path, capsys):
    a = [{"kind": "step", "step": 1, "loss": 10.25, "step_time_s": 0.5, "mfu": 0.1}]
    _write(tmp_path / "a", a)
    _write(tmp_path / "b", [dict(a[0], step_time_s=0.7, mfu=0.2)])
    assert main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "SAME: 1 records" in capsys.readouterr().out
    _write(tmp_path / "c", [dict(a[0], loss=10.250000000000002)])   # one ulp
    assert main([str(tmp_path / "a"), str(tmp_path / "c")]) == 1
    assert "loss 10.25 against 10.250000000000002" in capsys.readouterr().out
    _write(tmp_path / "d", a + a)
    assert main([str(tmp_path / "a"), str(tmp_path / "d")]) == 1
    assert main([str(tmp_path / "a"), str(tmp_path / "missing")]) == 2


def test_a_file_of_the_old_field_names_compares_under_todays(tmp_path):
    """Before one name per quantity a step record held ``pad_eff`` (every rank's) beside a
    ``padding_efficiency`` of rank 0's tokens: read back, the old file's every-rank value is
    today's ``padding_efficiency`` (runtime.observe.metrics.read_records), so a run from
    before the rename still compares equal."""
    new = {"kind": "step", "step": 1, "padding_efficiency": 0.774}
    _write(tmp_path / "old", [{"kind": "step", "step": 1, "padding_efficiency": 0.75,
                               "pad_eff": 0.774}])
    _write(tmp_path / "new", [new])
    assert main([str(tmp_path / "old"), str(tmp_path / "new")]) == 0
