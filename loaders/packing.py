"""Packing sequences into rows: best-fit decreasing, and the steps of offline packing.

Owns: best-fit decreasing over any number of sequences (``best_fit_decreasing``, what
collate.py's per-batch packing and the packing bound use), packing a window of the epoch
into rows (``pack_window``) and cutting a stream of packed rows into steps that hold exactly
P·b sequences in P·R rows (``row_steps``). Never: which samples form the stream (balance.py),
reading shards, collation, or communication.

Offline packing (``offline_pack``, balance.py): sequences are packed over windows of the
epoch (whole shards, ≥ ``PACK_WINDOW`` sequences), where best-fit decreasing comes within a
few thousandths of packing the whole data set at once, instead of over one rank's batch of b
(0.85 at seq 512, b = 16). A step must still consume exactly P·b sequences (MLPerf counts
sequences; the batch size and schedule keep their meaning), and every rank must compute the
same number of rows R (a padded model's cost is rows × the longest row, so equal rows of
nearly full length are equal costs). ``row_steps`` therefore takes, per step, R = the rows
that P·b sequences fill at the front of the row stream, starts from the oldest P·R rows and
swaps rows with few sequences for rows with many (or the reverse) from the rows just behind
until the step holds exactly P·b sequences (``_exact_rows``; rows left behind come first in
the next step). Rows are then dealt R per rank balancing the sequences per rank first and
the tokens second; a rank's sequence count is b ± a few (rows hold 1 to ~15 sequences at
seq 512), the step's total is exact. The trainer's losses are means over each rank's
sequences and masked tokens, so a rank with fewer sequences weighs each a little more, as
ranks with fewer masked tokens already do in every mode.
"""
from __future__ import annotations

import heapq

import numpy as np

from loaders.partition import differencing, improve_by_swaps, sort_desc, strided

PACK_WINDOW = 4096
"""Sequences packed together at least (whole shards of the epoch order are added until the
window holds this many): best-fit decreasing over 4,096 sequences is within 0.001 of packing
the whole seq-512 data set (docs/BENCHMARKS.md)."""

LOOKAHEAD = 256
"""Rows past twice a step's that may be swapped in to make its sequence count exact."""

def best_fit_decreasing(lengths, capacity: int, order=None,
                        max_count: int = 0) -> list[list[int]]:
    """Sequences longest first (ties in ``order``, default index order), each into the open
    row with the least room that still fits it (ties: the earliest row), else a new row.
    ``max_count`` > 0: a row holding that many sequences takes no more (static shapes: a
    fixed number of sequence slots per row). Returns, per row, the sequence indices in the
    order they were placed. Deterministic; O(n · capacity) in numpy-free-list lookups."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.arange(len(lengths)) if order is None else np.asarray(order)
    ranked = order[np.argsort(-lengths[order], kind="stable")]
    if len(ranked) and lengths[ranked[0]] > capacity:
        raise ValueError(f"a sequence of length {int(lengths[ranked[0]])} does not fit a row "
                         f"of {capacity} tokens")
    open_rows = np.zeros(capacity + 1, dtype=np.int64)   # rows with exactly this much room
    by_room: list[list[int]] = [[] for _ in range(capacity + 1)]  # heaps of row indices
    rows: list[list[int]] = []
    for i in ranked.tolist():
        n = int(lengths[i])
        fits = np.flatnonzero(open_rows[n:])
        if len(fits):
            room = n + int(fits[0])
            row = heapq.heappop(by_room[room])
            open_rows[room] -= 1
        else:
            room, row = capacity, len(rows)
            rows.append([])
        rows[row].append(i)
        if room - n and len(rows[row]) != max_count:  # a full row takes nothing more
            heapq.heappush(by_room[room - n], row)
            open_rows[room - n] += 1
    return rows


def pack_window(items: np.ndarray, lengths: np.ndarray, capacity: int,
                rng: np.random.Generator, max_count: int = 0) -> list[np.ndarray]:
    """Rows of ``items`` (any ids, in stream order; ``lengths`` theirs) packed best-fit
    decreasing (ties in stream order; at most ``max_count`` per row when > 0), in a seeded
    random order."""
    rows = best_fit_decreasing(lengths, capacity, max_count=max_count)
    return [items[np.asarray(rows[r])] for r in rng.permutation(len(rows))]


def row_steps(counts: np.ndarray, tokens: np.ndarray, ranks: int, per_rank: int,
              capacity: int, set_costs=None, rows_per_rank: int = 0,
              members: list | None = None, lengths: np.ndarray | None = None
              ) -> list[np.ndarray]:
    """Steps over a stream of packed rows (``counts``: sequences per row, ``tokens``: tokens
    per row, in stream order): each step an int [ranks, R] of row indices with exactly
    ranks · per_rank sequences in all, R rows per rank (R may change between steps). Stops
    when no step can be formed from what is left (the remainder). ``rows_per_rank`` > 0
    (static shapes): R is that many rows where they can hold the step's sequences exactly,
    else fewer (the static batch completes a rank's rows with empty ones), chosen from a
    window of the oldest unused rows, so rows the steps did not want are taken up again.
    ``set_costs``: [ranks, R] row indices → [ranks] costs, to keep the deal no worse than the
    strided one.

    ``members`` (the rows' sequence ids, in placement order) and ``lengths`` (tokens per
    sequence id), with ``rows_per_rank``: where no R rows of the window hold a step exactly
    (one GPU, or a stream whose rows hold 3 sequences where a step needs 4 in 2 rows), the
    step takes the P·R rows of the window holding the most sequences and hands the surplus
    back as split-off rows (``_split_step``), which the next steps take first; ``members`` is
    extended with those rows (the returned steps index the extended list). Without them such a
    stream ends the plan early, which the caller refuses."""
    counts = _Growing(np.asarray(counts, dtype=np.int64))
    tokens = _Growing(np.asarray(tokens, dtype=np.int64))
    total = ranks * per_rank
    used = _Growing(np.zeros(len(counts), dtype=bool))
    split = members is not None and lengths is not None and rows_per_rank > 0
    pieces: list[int] = []  # split-off rows not yet taken: the front of the next windows
    left = int(counts.view.sum())
    pos, steps, stream = 0, [], len(counts)
    while left >= total:
        while pos < stream and used.view[pos]:
            pos += 1
        if rows_per_rank:  # a window of unused rows (rows left behind must not crowd it)
            want, span = 4 * (total + LOOKAHEAD), 8 * (total + LOOKAHEAD)
            ahead = np.flatnonzero(~used.view[pos:min(pos + span, stream)]) + pos
            while len(ahead) < want and pos + span < stream:
                span *= 2
                ahead = np.flatnonzero(~used.view[pos:min(pos + span, stream)]) + pos
            pieces = [r for r in pieces if not used.view[r]]
            ahead = np.concatenate([np.asarray(pieces, dtype=np.int64), ahead])[:want]
        else:
            ahead = np.flatnonzero(~used.view[pos:pos + 2 * total + LOOKAHEAD]) + pos
        chosen = _choose(counts.view, ahead, ranks, total, rows_per_rank, per_rank)
        if chosen is None and split:
            chosen = _split_step(counts, tokens, used, members, lengths, ahead,
                                 ranks * rows_per_rank, total, pieces)
        if chosen is None:
            break
        used.view[chosen] = True
        left -= total
        steps.append(_deal_rows(chosen, counts.view, tokens.view, ranks, capacity, set_costs))
    return steps


class _Growing:
    """A 1-d array that rows can be appended to in amortised O(1) (``view``: its rows)."""

    def __init__(self, a: np.ndarray):
        self._a, self._n = a.copy(), len(a)

    def __len__(self) -> int:
        return self._n

    @property
    def view(self) -> np.ndarray:
        return self._a[:self._n]

    def append(self, value) -> int:
        if self._n == len(self._a):
            grown = np.zeros(max(16, 2 * len(self._a)), dtype=self._a.dtype)
            grown[:self._n] = self._a[:self._n]
            self._a = grown
        self._a[self._n] = value
        self._n += 1
        return self._n - 1


def _split_step(counts: _Growing, tokens: _Growing, used: _Growing, members: list,
                lengths: np.ndarray, ahead: np.ndarray, n: int, total: int,
                pieces: list[int]) -> np.ndarray | None:
    """Row indices of a step of exactly ``total`` sequences in ``n`` rows made by splitting:
    the n rows of ``ahead`` holding the most sequences (oldest first on ties), or None when
    even they hold fewer than ``total``. The surplus leaves those rows last-placed first (the
    shortest of a best-fit-decreasing row), from the rows holding the most, each row keeping
    one sequence at least; what leaves one row becomes one new row (a part of a row fits its
    capacity), appended to ``members``/``counts``/``tokens`` and to ``pieces``."""
    if len(ahead) < n or total < n:  # (each row keeps a sequence: n rows hold n at least)
        return None
    k = counts.view[ahead]
    pick = ahead[np.lexsort((np.arange(len(ahead)), -k))[:n]]
    surplus = int(counts.view[pick].sum()) - total
    if surplus < 0:
        return None
    for r in pick[np.argsort(-counts.view[pick], kind="stable")].tolist():
        if surplus == 0:
            break
        take = min(surplus, int(counts.view[r]) - 1)
        if take <= 0:
            continue
        row = np.asarray(members[r])
        kept, gone = row[:len(row) - take], row[len(row) - take:]
        members[r] = kept
        counts.view[r] = len(kept)
        tokens.view[r] = int(lengths[kept].sum())
        members.append(gone)
        new = counts.append(len(gone))
        tokens.append(int(lengths[gone].sum()))
        used.append(False)
        pieces.append(new)
        surplus -= take
    return np.sort(pick) if surplus == 0 else None


def _choose(counts, ahead, ranks, total, fixed: int = 0, per_rank: int = 0):
    """Row indices of one step (exactly ``total`` sequences in ranks · R rows), or None.
    ``fixed`` > 0: R = fixed, else fewer down to the fewest rows that can hold the step."""
    k = counts[ahead]
    if fixed:
        # R from `fixed` down to the fewest rows that can hold a rank's share, the one whose
        # rows must hold what the window's rows hold on average first: the window's mix stays
        # the stream's, instead of running out of one kind of row. No R above a rank's
        # sequences (each row holds one at least) or the window's rows can be exact: they are
        # never tried (a huge `fixed` must not become a huge list).
        fewest = max(1, -(-per_rank // max(int(k.max()), 1))) if len(k) else 1
        mean = float(k.mean()) if len(k) else 1.0
        most = min(fixed, per_rank or fixed, len(k) // ranks)
        tries = sorted(range(fewest, most + 1),
                       key=lambda r: (abs(total / (ranks * r) - mean), -r))
        for rows_per_rank in tries:
            n = ranks * rows_per_rank
            picked = _exact_rows(k, n, total) if n <= len(k) else None
            if picked is not None:
                return ahead[picked]
        return None
    reach = int(np.searchsorted(np.cumsum(k), total)) + 1  # rows, in order, to hold total
    if reach > len(k):
        return None
    first = max(1, round(reach / ranks))
    for rows_per_rank in (first, first + 1, first - 1, first + 2, first - 2):
        n = ranks * rows_per_rank
        if rows_per_rank < 1 or n > len(k):
            continue
        picked = _exact_rows(k[:2 * n + LOOKAHEAD], n, total)
        if picked is not None:
            return ahead[picked]
    return None


def _exact_rows(k: np.ndarray, n: int, total: int) -> np.ndarray | None:
    """Positions of ``n`` of the rows ``k`` (sequences per row, oldest first) holding exactly
    ``total`` sequences, or None. Starts from the oldest n and swaps: to gain sequences the
    chosen rows with the fewest (newest first) for the unchosen with the most (oldest first),
    pairwise while the running gain stays within what is missing, then one swap of exactly
    the rest; to shed sequences the mirror image. Deterministic."""
    chosen = np.zeros(len(k), dtype=bool)
    chosen[:n] = True
    missing = total - int(k[:n].sum())
    if missing == 0:
        return np.arange(n)
    inside, outside = np.arange(n), np.arange(n, len(k))
    sign = 1 if missing > 0 else -1
    # leave: fewest sequences first (gaining) / most first (shedding), newest first on ties
    leave = inside[np.lexsort((-inside, sign * k[inside]))]
    # enter: most sequences first (gaining) / fewest first (shedding), oldest first on ties
    enter = outside[np.lexsort((outside, -sign * k[outside]))]
    pairs = min(len(leave), len(enter))
    gains = sign * (k[enter[:pairs]] - k[leave[:pairs]])
    gains = gains[:int(np.argmax(gains <= 0)) if (gains <= 0).any() else pairs]
    done = int(np.searchsorted(np.cumsum(gains), abs(missing), side="right"))
    chosen[leave[:done]] = False
    chosen[enter[:done]] = True
    rest = abs(missing) - int(gains[:done].sum())
    if rest:
        # one more swap gaining exactly `rest`: the first remaining leaver with a partner
        partners = {}
        for j in enter[done:].tolist():
            partners.setdefault(int(k[j]), j)
        for i in leave[done:].tolist():
            j = partners.get(int(k[i]) + sign * rest)
            if j is not None:
                chosen[i], chosen[j] = False, True
                break
        else:
            return None
    return np.flatnonzero(chosen)


def _deal_rows(chosen, counts, tokens, ranks, capacity, set_costs=None) -> np.ndarray:
    """[ranks, R] rows: sequences per rank balanced first, tokens second (one additive
    weight, sequences scaled past any token sum, then swaps of rows with equal sequence
    counts that lower the largest token sum). With ``set_costs``, never worse than the
    strided deal of the rows by tokens: if its largest rank cost is lower, swaps of any rows
    lower the largest token sum further (a few sequences move), and if that is still not
    enough the strided deal is taken."""
    per = len(chosen) // ranks
    weight = counts[chosen] * float(capacity * per + 1) + tokens[chosen]
    t = tokens[chosen].astype(np.float64)
    sets = improve_by_swaps(t, improve_by_swaps(weight, differencing(weight, ranks)),
                            classes=counts[chosen])
    if set_costs is None:
        return chosen[np.sort(sets, axis=1)]
    plain = strided(sort_desc(t), ranks)
    limit = np.max(set_costs(chosen[plain]))
    for candidate in (sets, improve_by_swaps(t, sets), plain):
        if np.max(set_costs(chosen[candidate])) <= limit:
            return chosen[np.sort(candidate, axis=1)]
    return chosen[plain]  # not reached: plain meets its own limit
