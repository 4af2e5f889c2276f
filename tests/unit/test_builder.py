"""loaders.builder, the one stage runner of every data build, on a toy source (one stage that
hands back seven numbered sequences, no tokenizer, no workers): the stages run in order with
their seconds and log lines, the training sequences are cut into ``--shards`` contiguous
shards of equal size (the larger first), the record counts what was written, a rebuild is
"up to date", and a failure - a stage's, or too few sequences for ``--shards`` - leaves
nothing. The two real sources: tests/integration/test_prepare_integration.py,
tests/unit/test_mlperf_text.py, tests/integration/test_mlperf_inputs_integration.py."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from loaders import builder
from loaders.shards import DataError, Samples, read_shard, verify_checksums
from tests.support.tf_checkpoint import FIXTURE

SEQ = 16


def samples(rows) -> Samples:
    """Sequences numbered by ``rows``: [CLS] row [SEP], one prediction each."""
    rows = list(rows)
    return Samples(input_ids=[np.asarray([101, 110 + r, 102], np.int16) for r in rows],
                   segment_ids=[np.zeros(3, np.int16) for _ in rows],
                   masked_lm_positions=[np.asarray([1], np.int16) for _ in rows],
                   masked_lm_ids=[np.asarray([110 + r], np.int16) for r in rows],
                   next_sentence_labels=np.asarray([r % 2 for r in rows], np.int8))


@dataclass
class Options:
    out: Path
    text: Path
    shards: int = 3
    fail: bool = False
    workers: int = 1
    seq_len: int = SEQ
    eval_samples: int = 2
    vocab: Path = FIXTURE / "vocab.txt"
    said: list = field(default_factory=list)

    def recorded(self) -> dict:
        return {"shards": self.shards, "seq_len": self.seq_len}


def make(build, before):
    assert before == "documents"                  # what the stage before made
    if build.cfg.fail:
        raise DataError("the toy text is bad")
    made = builder.Made(
        train_sequences=7, shard=lambda lo, hi: samples(range(lo, hi)), eval=samples([50, 51]),
        eval_candidates=9, origin=(1, "toy files"), documents={"train": 3, "eval": 1},
        sentences={"train": 8, "eval": 2}, corpus_tokens={"train": 30, "eval": 5},
        mask_kinds={"mask": 5, "random": 1, "kept": 1}, report={"eval_doc_ids": ["d"]})
    return made, "7 train"


TOY = builder.Source(created_by="a toy", files=lambda cfg: [("toy", cfg.text)],
                     stages=(builder.Stage("read", lambda b, _: ("documents", None)),
                             builder.Stage("make", make)))


def _run(tmp_path, **kw):
    text = tmp_path / "toy.txt"
    text.write_text("some text\n")
    cfg = Options(out=tmp_path / "set", text=text, **kw)
    return builder.run(cfg, TOY, cfg.said.append), cfg


def test_the_runner_cuts_writes_and_records_what_a_source_made(tmp_path):
    report, cfg = _run(tmp_path)
    out = report.out
    stats = json.loads((out / "stats.json").read_text())
    assert [s["samples"] for s in stats["train_shards"]] == [3, 2, 2]    # the larger first
    firsts = [[int(x[1]) - 110 for x in read_shard(out / s["file"]).input_ids]
              for s in stats["train_shards"]]
    assert firsts == [[0, 1, 2], [3, 4], [5, 6]]                          # contiguous, in order
    assert [int(x[1]) - 110 for x in read_shard(out / "eval/eval.hdf5").input_ids] == [50, 51]
    assert stats["created_by"] == "a toy" and "procedure" not in stats
    assert stats["sequences"] == {"train": 7, "eval": 2, "eval_candidates": 9}
    assert stats["train"]["sequences"] == 7 and stats["train"]["tokens"] == 21
    assert stats["train"]["nsp_random_next_fraction"] == round(3 / 7, 5)
    assert stats["sources"][0]["name"] == "toy" and stats["parameters"] == cfg.recorded()
    verify_checksums(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set", "toy.txt"]   # no .work, tmp
    assert not list(out.glob(".*"))
    assert list(report.seconds)[:3] == ["hash_inputs", "read", "make"]
    assert report.eval_doc_ids == ["d"] and not report.up_to_date
    assert [m.split(" in ")[0] for m in cfg.said] == [
        "make: 7 train", "write: 3 shards (7 sequences) + eval (2 of 9)", f"wrote {out}"]
    again, _ = _run(tmp_path)
    assert again.up_to_date and again.stats == stats


@pytest.mark.parametrize("kw,message", [
    (dict(fail=True), "the toy text is bad"),
    (dict(shards=8), "only 7 training sequences from 1 toy files for --shards 8; lower "
                     "--shards or use more toy files"),
])
def test_a_failure_leaves_nothing(tmp_path, kw, message):
    with pytest.raises(DataError, match=message):
        _run(tmp_path, **kw)
    assert [p.name for p in tmp_path.iterdir()] == ["toy.txt"]
