"""A synthetic data set (schema-correct, random text) and what tests compare batches with:
the fingerprint of a stored sample and of a batch row, every row of a data set, two batch
lists equal field by field. ``synthetic_dataset`` is a module fixture (tests/conftest.py
imports it): 4 shards x 24 samples, divisible by 2 and 4 ranks and by batch 4.

Also: a copy of a data set with one shard's values damaged and re-signed (the bad-input
tests), and ``eval_truth``, a module fixture the eval-accuracy tests import: the counts a
model that always predicts "the" must report on ``small_dataset``'s eval file; and one shard
written in NVIDIA's MLPerf layout (``write_nvidia_varlength``)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from loaders.collate import IGNORE_INDEX, Batch
from loaders.dataset import STATS_FILE, DataSetInfo
from basis.presets import SOURCES  # noqa: F401 - `make sources`: the tests take it from here
from loaders.shards import (CHECKSUM_FILE, EVAL_FILE, TRAIN_DIR, Samples, read_shard, shard_name,
                            write_checksums, write_shard)
from tests.support.nvidia_layout import write_nvidia_varlength  # noqa: F401 - for the tests
from tests.support.tiny import VOCAB_ROWS

CLS, SEP, MASK = 101, 102, 103
SEQ_LEN, MAX_PRED = 128, 20


def synthetic_samples(first_id: int, count: int, rng: np.random.Generator) -> Samples:
    """[CLS] A [SEP] B [SEP] with ~15 % masked, ids below the tiny model's vocabulary; token 1
    = 1000 + sample id keeps every sample distinct, and is never masked."""
    cols = {k: [] for k in ("input_ids", "segment_ids", "masked_lm_positions", "masked_lm_ids")}
    for sample_id in range(first_id, first_id + count):
        length = int(rng.integers(12, 101))
        len_a = int(rng.integers(3, length - 5))
        tokens = rng.integers(1000, VOCAB_ROWS, size=length)
        tokens[0], tokens[1], tokens[len_a], tokens[-1] = CLS, 1000 + sample_id, SEP, SEP
        segments = np.zeros(length, dtype=np.int64)
        segments[len_a + 1:] = 1
        candidates = [i for i in range(2, length - 1) if i != len_a]
        n_mask = min(MAX_PRED, max(1, round(0.15 * len(candidates))))
        positions = np.sort(rng.choice(candidates, n_mask, replace=False))
        ids = tokens[positions].copy()
        tokens[positions] = MASK
        for key, value in zip(cols, (tokens, segments, positions, ids)):
            cols[key].append(np.asarray(value, dtype=np.int16))
    nsp = rng.integers(0, 2, size=count).astype(np.int8)
    return Samples(**cols, next_sentence_labels=nsp)


def build_synthetic(root: Path, shard_sizes: list[int], eval_size: int = 30, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    (root / TRAIN_DIR).mkdir(parents=True)
    (root / "eval").mkdir()
    shards, first = [], 0
    for i, size in enumerate(shard_sizes):
        rel = f"{TRAIN_DIR}/{shard_name(i, len(shard_sizes))}"
        write_shard(root / rel, synthetic_samples(first, size, rng))
        shards.append({"file": rel, "samples": size})
        first += size
    write_shard(root / EVAL_FILE, synthetic_samples(first, eval_size, rng))
    (root / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n")
    stats = {"train_shards": shards, "eval_samples": eval_size,
             "parameters": {"seq_len": SEQ_LEN, "max_pred": MAX_PRED}}
    (root / STATS_FILE).write_text(json.dumps(stats, indent=1))
    rewrite_checksums(root)
    return root


def rewrite_checksums(root: Path) -> None:
    rels = [s["file"] for s in json.loads((root / STATS_FILE).read_text())["train_shards"]]
    write_checksums(root, rels + [EVAL_FILE, "vocab.txt", STATS_FILE])


@pytest.fixture(scope="module")
def synthetic_dataset(tmp_path_factory) -> Path:
    """4 shards × 24 samples: divisible by 2 and 4 ranks and by batch 4."""
    return build_synthetic(tmp_path_factory.mktemp("synthetic"), [24, 24, 24, 24])


def raw_fingerprint(s: Samples, row: int) -> tuple:
    pairs = sorted(zip(s.masked_lm_positions[row].tolist(), s.masked_lm_ids[row].tolist()))
    return (tuple(s.input_ids[row].tolist()), tuple(s.segment_ids[row].tolist()),
            tuple(pairs), int(s.next_sentence_labels[row]))


def batch_fingerprints(batch: Batch) -> list[tuple]:
    out = []
    for i, n in enumerate(batch.attention_mask.sum(1).tolist()):
        labels = batch.masked_lm_labels[i]
        where = torch.nonzero(labels != IGNORE_INDEX).flatten().tolist()
        out.append((tuple(batch.input_ids[i, :n].tolist()),
                    tuple(batch.token_type_ids[i, :n].tolist()),
                    tuple((p, int(labels[p])) for p in where),
                    int(batch.next_sentence_labels[i])))
    return out


def shard_rows(root: Path) -> dict[int, Samples]:
    info = DataSetInfo.read(root)
    return {i: read_shard(root / f) for i, f in enumerate(info.train_files)}


def every_row(shards: dict[int, Samples]):
    return ((s, r) for s in shards.values() for r in range(len(s)))


def assert_batches_equal(a: list[Batch], b: list[Batch]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for name in ("input_ids", "token_type_ids", "attention_mask", "masked_lm_labels",
                     "next_sentence_labels"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name
        assert (x.num_real_tokens, x.num_padded_tokens) == (y.num_real_tokens, y.num_padded_tokens)
        assert x.sequence_lengths == y.sequence_lengths
        for name in ("token_index", "cu_seqlens", "token_in_seq", "seq_of_token",
                     "masked_positions", "masked_tokens"):
            assert torch.equal(getattr(x.layout, name), getattr(y.layout, name)), name
        assert (x.layout.lengths, x.layout.max_len, x.layout.min_len) == \
            (y.layout.lengths, y.layout.max_len, y.layout.min_len)


def copy_dataset(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_shard(root: Path, rel: str, edit) -> Path:
    """Change one shard's values and re-sign it: the checksums match, the values are bad."""
    path = root / rel
    samples = read_shard(path)
    edit(samples)
    write_shard(path, samples)
    rels = [line.split("  ", 1)[1] for line in (root / CHECKSUM_FILE).read_text().splitlines()]
    write_checksums(root, rels)
    return path


def train_shards(root: Path) -> list[str]:
    return [s["file"] for s in json.loads((root / STATS_FILE).read_text())["train_shards"]]


THE = 1996  # "the" in the uncased BERT vocab


@pytest.fixture(scope="module")
def eval_truth(small_dataset) -> dict:
    """Independent truth from the eval file: the model is biased to always predict "the"."""
    ev = read_shard(small_dataset / EVAL_FILE)
    masked = np.concatenate(ev.masked_lm_ids)
    want = {"count": int(masked.size), "correct": int((masked == THE).sum()),
            "eval_samples": len(ev)}
    assert want["correct"] > 0
    return want


def assert_eval_counts(got: dict, want: dict, ranks: int) -> None:
    assert {k: got[k] for k in ("count", "correct")} == \
        {k: want[k] for k in ("count", "correct")}, (ranks, got)
    assert got["eval_samples"] == want["eval_samples"]
    assert got["accuracy"] == pytest.approx(want["correct"] / want["count"])
