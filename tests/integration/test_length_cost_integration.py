"""loaders.length_cost's measuring command on the tiny model: it times real steps on
``small_dataset`` and writes a fitted file. The features, the fit and the file format:
tests/unit/test_length_cost.py."""
from __future__ import annotations

import json

from loaders import length_cost as lc
from tests.support.tiny import SHAPE as TINY_SHAPE
from tests.support.tiny import as_overrides


def test_measuring_command_writes_a_fitted_file(small_dataset, tmp_path):
    """python -m runtime.calibrate.length_cost on the tiny model of tests/support/tiny.py: a
    file ``load`` reads, for the model's shape, with the fit over every design and a held-out
    error (the numbers themselves are a benchmark's business)."""
    from runtime.calibrate.length_cost import designs, main
    out = tmp_path / "cost.json"
    assert main(["--layout", "padded", "--data", str(small_dataset), "--max-len", "64",
                 "--repeat", "1", "--budget", "0", "--held-out", "1", "--fit-random", "1",
                 "--out", str(out),
                 *[a for s in as_overrides(TINY_SHAPE) for a in ("--set", s)]]) == 0
    cost = lc.load(out)
    record = json.loads(out.read_text())
    assert cost.layout == "padded"
    assert dict(cost.shape)["hidden_size"] == TINY_SHAPE["model.hidden_size"]
    assert dict(cost.fit_error)["points"] == len(designs("padded", 64)) + 6
    assert record["held_out_error"]["points"] == 6  # 8/16/32 random, unpacked and packed
    assert (cost.vector >= 0).all() and cost.vector.sum() > 0
