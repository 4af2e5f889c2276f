"""bench.convert_crc's small mode: the checkpoint it writes is one the converter takes (every
name mapped, every shape the config's), both CRC implementations convert it to the same file,
and the record says how it was run."""
from __future__ import annotations

import json

from bench import convert_crc
from runtime.model import convert as cv
from basis.model_shape import parameter_count
from runtime.model.tf_bundle import Bundle


def test_small_mode_writes_a_convertible_checkpoint_and_a_record(tmp_path, capsys):
    prefix = convert_crc.write_bert_checkpoint(tmp_path, "small")
    bundle = Bundle(prefix)
    weights, state, unknown = cv.classify(bundle.entries)
    assert not unknown and not state and len(weights) == len(bundle.entries) == 5 + 2 * 16 + 9
    out = tmp_path / "out"
    cv.convert(prefix, out, log=lambda m: None)            # its own bert_config.json
    assert json.loads((out / cv.CONFIG_FILE).read_text())["vocab_size"] == 1000

    results = tmp_path / "rec.json"
    assert convert_crc.main(["--size", "small", "--repeats", "1", "--results", str(results),
                             "--dir", str(tmp_path)]) == 0
    rec = json.loads(results.read_text())
    assert rec["benchmark"] == "convert_crc" and rec["command"].startswith(
        "python -m bench.convert_crc --size small")
    assert rec["data_bytes"] == 4 * parameter_count(rec["shape"])    # every weight, float32
    assert rec["identical_outputs"] and rec["library"].startswith("google-crc32c ")
    for name in ("numpy", "library"):
        run, = rec["runs"][name]
        assert 0 <= run["crc_seconds"] <= run["seconds"]
    assert not list(tmp_path.glob("bench-convert-crc-*"))   # removed afterwards
    assert "conversion (median of 1)" in capsys.readouterr().out
