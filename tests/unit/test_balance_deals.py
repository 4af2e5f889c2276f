"""loaders.partition and loaders.packing: the deals on their own (equal counts, never worse
than strided, near the lower bound on long-tailed lengths) and offline packing (best-fit
decreasing against a plain reference, steps of exactly P·b sequences in equal rows)."""
from __future__ import annotations

import numpy as np
import pytest

from loaders import length_cost as lc
from loaders.packing import best_fit_decreasing, pack_window, row_steps
from loaders.partition import (balanced_deal, differencing, improve_by_swaps, sort_desc,
                               strided, zigzag)

SHAPE = dict(vocab_size=30522, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=512)


def long_tailed(rng, n, top=512):
    """Lengths like the seq-512 set: most around 100, a few % at the maximum."""
    x = np.minimum(rng.lognormal(4.6, 0.5, n).astype(np.int64) + 8, top)
    x[rng.random(n) < 0.04] = top
    return x


def test_strided_and_zigzag_positions():
    assert strided(np.arange(12), 3).tolist() == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]
    assert zigzag(np.arange(20), 4).tolist() == [[0, 7, 8, 15, 16], [1, 6, 9, 14, 17],
                                                 [2, 5, 10, 13, 18], [3, 4, 11, 12, 19]]


@pytest.mark.parametrize("parts,m", [(2, 3), (4, 16), (8, 5), (64, 16)])
def test_differencing_is_an_equal_count_partition(parts, m):
    w = np.random.default_rng(parts).random(parts * m)
    sets = differencing(w, parts)
    assert sets.shape == (parts, m)
    assert sorted(sets.ravel().tolist()) == list(range(parts * m))


def test_swaps_never_raise_the_largest_set_and_keep_counts():
    rng = np.random.default_rng(3)
    for _ in range(20):
        w = long_tailed(rng, 64).astype(float)
        start = strided(sort_desc(w), 4)
        after = improve_by_swaps(w, start)
        assert sorted(after.ravel().tolist()) == list(range(64)) and after.shape == (4, 16)
        assert w[after].sum(1).max() <= w[start].sum(1).max()
    classes = np.arange(64) % 3  # swaps only within a class: each set's class mix stays
    after = improve_by_swaps(w, start, classes=classes)
    for a, b in zip(start, after):
        assert sorted(classes[a]) == sorted(classes[b])


@pytest.mark.parametrize("layout", ["unpadded", "padded", "repad"])
def test_deal_is_never_costlier_than_strided_on_random_lengths(layout):
    """The property the modes rely on, on 200 random length sets of several shapes."""
    cost = lc.flops_cost(SHAPE, layout)
    rng = np.random.default_rng(7)
    for trial in range(200):
        parts = int(rng.choice([2, 3, 4, 8]))
        m = int(rng.integers(1, 9))
        lengths = long_tailed(rng, parts * m) if trial % 2 else rng.integers(1, 129, parts * m)
        set_costs = None if cost.additive else (lambda s, x=lengths: cost.of_lengths(x[s]))
        sets = balanced_deal(cost.sample_weights(lengths), parts, set_costs,
                             order=sort_desc(lengths))
        assert sorted(sets.ravel().tolist()) == list(range(parts * m))
        mine = cost.of_lengths(lengths[sets]).max()
        plain = cost.of_lengths(lengths[strided(sort_desc(lengths), parts)]).max()
        assert mine <= plain * (1 + 1e-12)


def test_deal_reaches_the_lower_bound_on_long_tailed_lengths():
    """Unpadded cost, 128 long-tailed lengths into 8 ranks of 16 (the seq-512 case):
    within 1 % of max(mean, longest + 15 shortest) where strided is ~10 % above it."""
    cost = lc.flops_cost(SHAPE, "unpadded")
    rng = np.random.default_rng(11)
    ratios, strided_ratios = [], []
    for _ in range(30):
        x = long_tailed(rng, 128)
        w = cost.sample_weights(x)
        bound = max(w.sum() / 8, w.max() + np.sort(w)[:15].sum())
        ratios.append(w[balanced_deal(w, 8)].sum(1).max() / bound)
        strided_ratios.append(w[strided(sort_desc(w), 8)].sum(1).max() / bound)
    assert np.mean(ratios) < 1.01 and np.mean(strided_ratios) > 1.05


# ----------------------------------------------------------------------------- packing

def reference_best_fit(lengths, capacity):
    """The plain O(n · rows) rule: longest first (index order on ties), into the open row
    with the least room that fits (earliest row on ties), else a new row."""
    rows, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [r for r in range(len(rows)) if room[r] >= lengths[i]]
        if fits:
            r = min(fits, key=lambda r: (room[r], r))
            rows[r].append(i)
            room[r] -= lengths[i]
        else:
            rows.append([i])
            room.append(capacity - lengths[i])
    return rows


def test_best_fit_decreasing_equals_the_reference():
    rng = np.random.default_rng(5)
    for _ in range(30):
        cap = int(rng.choice([16, 128, 512]))
        lengths = rng.integers(1, cap + 1, int(rng.integers(1, 200))).tolist()
        assert best_fit_decreasing(np.array(lengths), cap) == reference_best_fit(lengths, cap)
    with pytest.raises(ValueError, match="length 20 does not fit a row of 16"):
        best_fit_decreasing(np.array([3, 20]), 16)


def test_pack_window_keeps_every_item_once_and_fits():
    rng = np.random.default_rng(2)
    items = rng.permutation(1000) + 5000
    lengths = long_tailed(rng, 1000)
    rows = pack_window(items, lengths, 512, np.random.default_rng(0))
    assert sorted(np.concatenate(rows).tolist()) == sorted(items.tolist())
    where = {int(v): i for i, v in enumerate(items)}
    assert all(lengths[[where[int(v)] for v in row]].sum() <= 512 for row in rows)
    used = sum(lengths[[where[int(v)] for v in row]].sum() for row in rows)
    assert used / (len(rows) * 512) > 0.98  # long-tailed lengths pack well over a window


@pytest.mark.parametrize("ranks,per_rank", [(2, 32), (8, 16), (64, 16)])
def test_row_steps_hold_exactly_p_b_sequences_in_equal_rows(ranks, per_rank):
    rng = np.random.default_rng(ranks)
    counts = rng.choice([1, 2, 3, 4, 5, 6, 8, 12], size=6000,
                        p=[.17, .11, .17, .2, .14, .09, .08, .04])
    tokens = rng.integers(480, 513, size=6000)
    steps = row_steps(counts, tokens, ranks, per_rank, 512)
    seen = np.concatenate([s.ravel() for s in steps])
    assert len(seen) == len(set(seen.tolist()))                 # every row at most once
    assert len(steps) >= counts.sum() // (ranks * per_rank) - 1  # a remainder under 2 steps
    for s in steps:
        assert s.shape[0] == ranks                              # R rows on every rank
        assert counts[s].sum() == ranks * per_rank              # the step's sequences: exact
    # sequences per rank: b on most ranks, b ± 1 on most others
    spread = np.concatenate([np.abs(counts[s].sum(1) - per_rank) for s in steps])
    assert np.mean(spread == 0) > 0.75 and np.mean(spread <= 1) > 0.97


def test_a_huge_static_row_count_plans_as_the_largest_that_can_hold_a_step():
    """rows_per_rank far past a rank's sequences (data.static_rows=1e9 from a rank's config,
    issue 46) built a Python list of that many row counts per planned step; now no R above
    a rank's sequences is tried (no row is empty, so none can be exact) and the plan is the
    one of R = the sequences per rank, step for step."""
    rng = np.random.default_rng(3)
    counts = rng.choice([1, 2, 3], size=3000, p=[0.3, 0.5, 0.2])
    tokens = counts * 40
    huge = row_steps(counts, tokens, ranks=4, per_rank=8, capacity=128, rows_per_rank=10**9)
    most = row_steps(counts, tokens, ranks=4, per_rank=8, capacity=128, rows_per_rank=8)
    assert len(huge) == len(most) > 0
    assert all(np.array_equal(a, b) for a, b in zip(huge, most))
