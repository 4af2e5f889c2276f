"""loaders.length_cost: the features of each layout against hand-computed values, the fit
recovering known coefficients from synthetic timings, the file and its errors, the defaults,
and a Batch priced like its rows. The measuring command on the tiny model:
tests/integration/test_length_cost_integration.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from loaders import length_cost as lc
from basis import model_shape
from loaders.collate import collate_packed
from loaders.shards import Samples

SHAPE = dict(vocab_size=30522, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=512)


def test_features_by_hand():
    rows = [[100, 20], [60], [30, 30, 30]]  # packed: widths 120, 60, 90
    assert lc.row_features("padded", rows).tolist() == [270, 3 * 120, 3 * 120 ** 2, 3, 1]
    seqs = [100, 20, 60, 30, 30, 30]
    squares = sum(n * n for n in seqs)
    assert lc.row_features("unpadded", rows).tolist() == [270, squares, 6, 1]
    assert lc.row_features("repad", rows).tolist() == [270, 6 * 100, 6 * 100 ** 2, 6, 1]


def test_vectorized_lengths_equal_rows():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 513, size=(3, 5, 16))
    lengths[0, 0, 10:] = 0  # absent sequences
    for layout in lc.LAYOUTS:
        cost = lc.flops_cost(SHAPE, layout)
        vec = cost.of_lengths(lengths)
        for idx in np.ndindex(lengths.shape[:2]):
            rows = [[int(n)] for n in lengths[idx] if n > 0]
            assert vec[idx] == pytest.approx(cost.of_rows(rows), rel=1e-12)


def test_unpadded_cost_is_additive_over_sequences():
    cost = lc.LengthCost.of("unpadded", real_tokens=2.0, attention=0.5, rows=7.0, step=11.0)
    lengths = np.array([3, 10, 4])
    assert cost.additive and not lc.flops_cost(SHAPE, "padded").additive
    assert cost.of_rows([[3], [10], [4]]) == pytest.approx(cost.sample_weights(lengths).sum() + 11)


@pytest.mark.parametrize("layout", lc.LAYOUTS)
def test_fit_recovers_known_coefficients(layout):
    """Timings made from known coefficients with 1 % multiplicative noise: the fit finds
    them again (rows varied independently of lengths, as runtime.calibrate.length_cost designs do)."""
    truth = {"padded": dict(real_tokens=3e-5, padded_tokens=2e-5, padded_attention=4e-8,
                            rows=2e-4, step=1e-2),
             "unpadded": dict(real_tokens=5e-5, attention=6e-8, rows=3e-4, step=8e-3),
             "repad": dict(real_tokens=5e-5, repad_tokens=1e-5, repad_attention=5e-8,
                           rows=1e-4, step=5e-3)}[layout]
    true = lc.LengthCost.of(layout, **truth)
    rng = np.random.default_rng(1)
    batches = []
    for rows in (2, 4, 8, 16):
        for n in (32, 64, 128, 256, 384, 512):
            batches.append([[n]] * rows)
        for big, small in ((512, 32), (512, 128), (256, 32)):
            batches.append([[big]] + [[small]] * (rows - 1))
    times = [true.of_rows(b) * (1 + 0.01 * rng.standard_normal()) for b in batches]
    got = lc.fit(layout, batches, times, SHAPE)
    x = np.stack([lc.row_features(layout, b) for b in batches])
    t = x @ true.vector
    for i, name in enumerate(lc.FEATURES[layout]):  # each term within 3 % of the step times
        assert np.all(np.abs(got.vector[i] - true.vector[i]) * x[:, i] <= 0.03 * t), name
    assert got.coefficient("real_tokens") == pytest.approx(truth["real_tokens"], rel=0.1)
    err = dict(got.fit_error)
    assert err["mean_rel_error"] < 0.02 and err["r2"] > 0.99 and err["points"] == len(batches)
    # without noise the recovery is exact
    exact = lc.fit(layout, batches, [true.of_rows(b) for b in batches])
    np.testing.assert_allclose(exact.vector, true.vector, rtol=1e-6, atol=1e-15)


def test_fit_keeps_coefficients_non_negative():
    # times that fall with attention: an unconstrained fit would give a negative coefficient
    batches = [[[n]] * r for r in (2, 4, 8) for n in (32, 64, 128, 256)]
    times = [0.01 + 1e-4 * sum(n for row in b for n in row)
             - 1e-8 * sum(n * n for row in b for n in row) for b in batches]
    got = lc.fit("unpadded", batches, times)
    assert (got.vector >= 0).all() and got.coefficient("attention") == 0


def test_fit_needs_enough_points_and_positive_times():
    with pytest.raises(ValueError, match="cannot determine the 5 coefficients"):
        lc.fit("padded", [[[10]]] * 3, [1.0] * 3)
    with pytest.raises(ValueError, match="must be > 0"):
        lc.fit("unpadded", [[[10]], [[20]], [[30]], [[40]]], [1, 2, 0, 4])


def test_file_round_trip_and_errors(tmp_path):
    cost = lc.fit("unpadded", [[[n]] * r for r in (2, 4) for n in (10, 20, 40)],
                  [0.1, 0.2, 0.5, 0.2, 0.4, 1.0], SHAPE, source="test")
    path = tmp_path / "cost.json"
    cost.save(path)
    again = lc.load(path)
    assert again == cost and again.digest() == cost.digest()
    assert lc.resolve(str(path), SHAPE, "unpadded") == cost
    with pytest.raises(ValueError, match="measured for layout 'unpadded'.*--layout padded"):
        lc.resolve(str(path), SHAPE, "padded")
    with pytest.raises(ValueError, match="measured for model shape"):
        lc.resolve(str(path), {**SHAPE, "hidden_size": 256}, "unpadded")
    with pytest.raises(FileNotFoundError, match="python -m runtime.calibrate.length_cost --out"):
        lc.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text(json.dumps({"layout": "padded", "coefficients": {}}))
    with pytest.raises(ValueError, match="not a length-cost file"):
        lc.load(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="negative"):
        lc.LengthCost.of("unpadded", real_tokens=-1.0)
    with pytest.raises(ValueError, match="not features of layout"):
        lc.LengthCost.of("unpadded", padded_tokens=1.0)


def test_defaults_measured_where_shipped_else_flop_count():
    for cost in lc.measured_defaults():  # every shipped entry is found for its shape
        assert lc.default_cost(dict(cost.shape), cost.layout) == cost
        assert dict(cost.fit_error)["mean_rel_error"] < 0.25
    large = dict(vocab_size=30522, hidden_size=1024, num_hidden_layers=24,
                 num_attention_heads=16, intermediate_size=4096)
    cost = lc.default_cost(large, "unpadded")
    assert cost.source.startswith("FLOP count")
    # per token: 6·24·(4·1024² + 2·1024·4096) dense + 6·0.15·(1024² + 1024·30522) MLM head
    dense = 6 * 24 * (4 * 1024 ** 2 + 2 * 1024 * 4096)
    head = 6 * 0.15 * (1024 ** 2 + 1024 * 30522)
    assert cost.coefficient("real_tokens") == pytest.approx((dense + head) / lc.NOMINAL_FLOPS)
    assert cost.coefficient("attention") == pytest.approx(12 * 24 * 1024 / lc.NOMINAL_FLOPS)
    assert lc.resolve("", large, "unpadded") == cost


def test_a_batch_is_priced_like_its_rows():
    def sample(n):
        ids = np.arange(n, dtype=np.int16)
        return [ids], [np.zeros(n, np.int16)], [np.array([1], np.int16)], [ids[[1]]]

    parts = [sample(n) for n in (50, 70, 30, 100)]
    samples = Samples(*[sum((p[i] for p in parts), []) for i in range(4)],
                      next_sentence_labels=np.zeros(4, np.int8))
    batch = collate_packed(samples, 128)
    # best-fit decreasing: 100 | 70 + 50 | 30 (30 fits neither 28 nor 8 tokens of room)
    assert sorted(map(sorted, batch.sequence_lengths)) == [[30], [50, 70], [100]]
    cost = lc.flops_cost(SHAPE, "padded")
    assert cost.of_batch(batch) == cost.of_rows(batch.sequence_lengths)
    batch.sequence_lengths = None  # a pipeline that did not record them: read the mask
    assert cost.of_batch(batch) == pytest.approx(cost.of_rows([[100], [70, 50], [30]]))
    assert lc.imbalance(np.array([[1.0, 2.0], [3.0, 2.0]])) == pytest.approx((1.5 + 1.0) / 2)


@pytest.mark.parametrize("name", ["tiny", "base", "large"])
def test_flop_cost_agrees_with_the_step_flops(name):
    """The FLOP-count default and the FLOPs the trainer reports (runtime.model.arithmetic,
    held to torch's FlopCounterMode) are one formula: on the same shape and lengths the
    unpadded cost × NOMINAL_FLOPS is ``step_flops`` of those lengths with the MLM head on
    MASKED_FRACTION of the tokens, less the pooler and NSP head it leaves out; the padded and
    repad layouts agree with it on a batch without padding and count more with."""
    from runtime.model import arithmetic as ar
    shape = {**model_shape.size(name), "vocab_size": 30522}
    per = model_shape.forward_flops_per_unit(shape)
    rng = np.random.default_rng(1)
    lengths = rng.integers(20, 513, size=16)

    def step(lengths, sequences):
        return ar.step_flops(shape, real_tokens=int(lengths.sum()),
                             squared_lengths=int((lengths ** 2).sum()),
                             masked=lc.MASKED_FRACTION * lengths.sum(), sequences=sequences)

    unpadded = lc.flops_cost(shape, "unpadded").of_lengths(lengths) * lc.NOMINAL_FLOPS
    assert unpadded == pytest.approx(step(lengths, 0), rel=1e-12)
    assert unpadded + 3 * per["sequence"] * len(lengths) == pytest.approx(
        step(lengths, len(lengths)), rel=1e-12)
    assert unpadded == pytest.approx(step(lengths, len(lengths)), rel=1e-3)  # the pooler: small
    even = np.full(16, 128)
    for layout in lc.LAYOUTS:
        cost = lc.flops_cost(shape, layout)
        assert cost.of_lengths(even) * lc.NOMINAL_FLOPS == pytest.approx(step(even, 0), rel=1e-12)
        if layout != "unpadded":
            assert cost.of_lengths(lengths) * lc.NOMINAL_FLOPS > step(lengths, 0) * 1.01
