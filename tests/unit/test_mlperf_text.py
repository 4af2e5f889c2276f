"""The MLPerf reference's text as a prepare source (loaders/mlperf_text.py), held against the
reference itself: tests/fixtures/mlperf_text/ holds a small text in its format and what its
create_pretraining_data.py and pick_eval_samples.py made of each file under TensorFlow
(``reference.npz``, written by make_reference.py there). Every instance - tokens, segments,
masked positions and labels, NSP label - and their order must be the reference's. The whole
build (shards, eval file, workers) is tests/integration/test_mlperf_inputs_integration.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from loaders import mlperf_text as mt
from loaders import pretraining, tokenization
from loaders.prepare import PrepareConfig, parse_args
from loaders.shards import DataError

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "mlperf_text"
FILES = ["part-00000-of-00003", "part-00001-of-00003", "part-00002-of-00003", "eval.txt"]


@pytest.fixture(scope="module")
def reference():
    with np.load(FIXTURE / "reference.npz") as z:
        ref = {k: z[k] for k in z.files}
    return ref, json.loads(str(ref["params"]))


@pytest.fixture(scope="module")
def vocab():
    try:
        return tokenization.load_vocab(tokenization.default_vocab_path())
    except DataError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("name", FILES)
def test_each_file_gives_the_reference_instances_in_the_reference_order(reference, vocab, name):
    ref, p = reference
    params = pretraining.InstanceParams(
        max_seq_length=p["max_seq_length"], short_seq_prob=p["short_seq_prob"],
        masked_lm_prob=p["masked_lm_prob"], max_predictions_per_seq=p["max_predictions_per_seq"],
        vocab_size=len(vocab))
    tok = tokenization.build_tokenizer(vocab, tokenization.GOOGLE_MAX_CHARS_PER_WORD)
    packed, *_ = mt.file_instances(FIXTURE / name, tok, params, p["random_seed"],
                                   p["dupe_factor"])
    if name == "eval.txt":
        packed = mt.reorder(packed, mt.eval_rows(len(packed), p["eval_samples"]))
    assert np.array_equal(packed.lengths(), ref[f"{name}|lengths"])
    assert np.array_equal(packed.input_ids, ref[f"{name}|input_ids"])
    segments = np.concatenate([packed.row(r)[1] for r in range(len(packed))])
    assert np.array_equal(segments, ref[f"{name}|segment_ids"])
    assert np.array_equal(np.diff(packed.pred_off), ref[f"{name}|npred"])
    assert np.array_equal(packed.positions, ref[f"{name}|positions"])
    assert np.array_equal(packed.labels, ref[f"{name}|labels"])
    assert np.array_equal(packed.nsp, ref[f"{name}|nsp"])


def test_hugging_faces_100_character_words_would_not_be_the_reference(reference, vocab):
    """The fixture has a 156-character word: the 200-character limit is what matches."""
    ref, p = reference
    params = pretraining.InstanceParams(max_seq_length=p["max_seq_length"],
                                        max_predictions_per_seq=p["max_predictions_per_seq"],
                                        vocab_size=len(vocab))
    tok = tokenization.build_tokenizer(vocab)          # HuggingFace's 100
    packed, *_ = mt.file_instances(FIXTURE / FILES[2], tok, params, p["random_seed"],
                                   p["dupe_factor"])
    assert len(packed) != len(ref[f"{FILES[2]}|lengths"])


def test_documents_break_at_blank_lines_only(tmp_path):
    path = tmp_path / "part-00000-of-00001"
    path.write_bytes("One.\r\nTwo. \n \n\n\t\nThree.\n\x07\nFour.\n\n".encode())
    assert mt.read_documents(path) == [["One.", "Two."], ["Three.", "\x07", "Four."]]
    path.write_bytes(b"caf\xe9\n")
    with pytest.raises(DataError, match=r"part-00000-of-00001: not UTF-8 at byte 3"):
        mt.read_documents(path)


def test_eval_rows_are_pick_eval_samples_choice():
    assert mt.eval_rows(96, 40).tolist() == [int(i * (96 / 40)) for i in range(40)]
    assert mt.eval_rows(7, 7).tolist() == list(range(7))


def test_part_files_must_be_complete(tmp_path):
    d = tmp_path / "results4"
    d.mkdir()
    with pytest.raises(DataError, match="no part-NNNNN-of-NNNNN files"):
        mt.find_parts(d)
    for i in (0, 2):
        (d / f"part-{i:05d}-of-00003").write_text("x\n")
    with pytest.raises(DataError, match=r"results4/part-00001-of-00003: missing \(1 of 3"):
        mt.find_parts(d)
    (d / "part-00001-of-00003").write_text("x\n")
    (d / "part-00000-of-00500").write_text("x\n")
    with pytest.raises(DataError, match="part files of different sets"):
        mt.find_parts(d)
    (d / "part-00000-of-00500").unlink()
    assert [p.name for p in mt.find_parts(d)] == [f"part-{i:05d}-of-00003" for i in range(3)]
    with pytest.raises(DataError, match=r"results4/eval.txt: the held-out eval text is missing"):
        mt.source_files(PrepareConfig(out=tmp_path / "o", mlperf_text=d))


def test_the_command_line_defaults_to_the_references_flags(tmp_path):
    src = tmp_path / "text"
    shutil.copytree(FIXTURE, src)
    cfg = parse_args(["--out", str(tmp_path / "o"), "--mlperf-text", str(src)])
    assert (cfg.seq_len, cfg.max_pred, cfg.dupe_factor, cfg.eval_samples, cfg.seed) == \
        (512, 76, 10, 10000, 12345)
    assert cfg.shards == 3                                # one per part file
    assert cfg.recorded()["source"] == "mlperf-text" and "eval_doc_fraction" not in \
        cfg.recorded()
    cfg = parse_args(["--out", str(tmp_path / "o"), "--mlperf-text", str(src), "--seq-len",
                      "64", "--max-pred", "10", "--shards", "2"])
    assert (cfg.seq_len, cfg.max_pred, cfg.shards, cfg.dupe_factor) == (64, 10, 2, 10)
    assert parse_args(["--out", str(tmp_path / "o")]).seq_len == 128   # the built-in sources
    with pytest.raises(DataError, match="drop --max-docs"):
        PrepareConfig(out=tmp_path / "o", mlperf_text=src, max_docs=10)


def test_an_empty_part_or_a_directory_in_a_parts_place_is_refused_by_name(tmp_path):
    """An empty part is a failed copy (no part of the reference's text is empty; accepted, it
    silently dropped a third of the fixture's sequences); a directory was a traceback."""
    d = tmp_path / "results4"
    d.mkdir()
    for i in range(3):
        (d / f"part-{i:05d}-of-00003").write_text("x\n")
    (d / "part-00001-of-00003").write_text("")
    with pytest.raises(DataError, match=r"part-00001-of-00003: empty \(0 bytes\) .* copy it again"):
        mt.find_parts(d)
    (d / "part-00001-of-00003").unlink()
    (d / "part-00001-of-00003").mkdir()
    with pytest.raises(DataError, match=r"part-00001-of-00003: not a regular file"):
        mt.find_parts(d)
    (d / "part-00001-of-00003").rmdir()
    (d / "part-00001-of-00003").write_text("x\n")
    (d / "eval.txt").mkdir()
    with pytest.raises(DataError, match=r"eval.txt: not a regular file"):
        mt.source_files(PrepareConfig(out=tmp_path / "o", mlperf_text=d))
    (d / "eval.txt").rmdir()
    (d / "eval.txt").write_text("")
    with pytest.raises(DataError, match=r"eval.txt: empty \(0 bytes\)"):
        mt.source_files(PrepareConfig(out=tmp_path / "o", mlperf_text=d))
