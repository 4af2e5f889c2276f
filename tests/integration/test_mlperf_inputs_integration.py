"""The official MLPerf inputs, through the real components: ``python -m loaders.prepare
--mlperf-text`` building a whole data set from the reference-format fixture (the same bytes
for 1 and 2 workers; its shards the reference's instances of the parts in part order, its
eval file the reference's picks), and the converted TensorFlow checkpoint read by Hugging
Face's own ``BertForPreTraining.from_pretrained`` to the logits this runtime's model gives.
The per-file exactness and the converter's values are unit tests (test_mlperf_text.py,
test_tf_checkpoint.py)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from loaders import prepare
from loaders.shards import CHECKSUM_FILE, EVAL_FILE, DataError, input_ids_md5, read_shard
from loaders.tokenization import default_vocab_path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TEXT = FIXTURES / "mlperf_text"
PARTS = ["part-00000-of-00003", "part-00001-of-00003", "part-00002-of-00003"]


def _build(out: Path, workers: int, **kw) -> prepare.BuildReport:
    try:
        vocab = default_vocab_path()
    except DataError as e:
        pytest.skip(str(e))
    cfg = prepare.PrepareConfig(out=out, mlperf_text=TEXT, seq_len=64, max_pred=10,
                                dupe_factor=2, eval_samples=40, shards=4, workers=workers,
                                vocab=vocab, **kw)
    return prepare.build(cfg, log=lambda m: None)


def _rows(samples) -> list[tuple]:
    return [(tuple(samples.input_ids[r]), tuple(samples.segment_ids[r]),
             tuple(samples.masked_lm_positions[r]), tuple(samples.masked_lm_ids[r]),
             int(samples.next_sentence_labels[r])) for r in range(len(samples))]


def _reference_rows(ref, name: str) -> list[tuple]:
    cuts = lambda k, n: np.split(ref[f"{name}|{k}"], np.cumsum(ref[f"{name}|{n}"])[:-1])  # noqa
    return [tuple(map(tuple, cols[:4])) + (int(cols[4]),) for cols in zip(
        cuts("input_ids", "lengths"), cuts("segment_ids", "lengths"),
        cuts("positions", "npred"), cuts("labels", "npred"), ref[f"{name}|nsp"])]


def test_the_mlperf_text_build_is_the_references_and_independent_of_workers(tmp_path):
    one = _build(tmp_path / "w1", workers=1)
    two = _build(tmp_path / "w2", workers=2)
    assert (one.out / CHECKSUM_FILE).read_text() == (two.out / CHECKSUM_FILE).read_text()
    with np.load(TEXT / "reference.npz") as z:
        ref = {k: z[k] for k in z.files}
    stats = json.loads((one.out / "stats.json").read_text())
    sizes = [s["samples"] for s in stats["train_shards"]]
    assert sizes == [55, 54, 54, 54] and stats["sequences"]["eval"] == 40
    assert [p["sequences"] for p in stats["parts"]] == [81, 69, 67]
    got = [row for s in stats["train_shards"] for row in _rows(read_shard(one.out / s["file"]))]
    assert got == [row for name in PARTS for row in _reference_rows(ref, name)]
    assert _rows(read_shard(one.out / EVAL_FILE)) == _reference_rows(ref, "eval.txt")
    assert stats["eval"]["input_ids_md5"] == input_ids_md5(
        [r[0] for r in _reference_rows(ref, "eval.txt")])          # NVIDIA's hdf5_md5.py hash
    assert "matches_published_eval" not in stats["eval"]          # not the official options
    assert _build(tmp_path / "w1", workers=2).up_to_date          # same inputs: not rebuilt


def test_a_missing_part_exits_2_naming_it_and_writes_nothing(tmp_path, capsys):
    src = tmp_path / "results4"
    shutil.copytree(TEXT, src)
    (src / PARTS[1]).unlink()
    rc = prepare.main(["--out", str(tmp_path / "out"), "--mlperf-text", str(src)])
    assert rc == 2
    assert f"{src / PARTS[1]}: missing (1 of 3 parts missing" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_hugging_faces_own_model_reads_the_converted_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    from runtime.model.bert import BertForPreTraining
    from runtime.model.config import BertConfig
    from runtime.model.convert import convert
    from runtime.model.hf import load_pretrained

    out = tmp_path / "bert"
    convert(FIXTURES / "tf_bert_tiny" / "model.ckpt-3", out, log=lambda m: None)
    hf = transformers.BertForPreTraining.from_pretrained(out).eval()
    ours = BertForPreTraining(BertConfig.from_hf_json(out)).eval()
    assert not load_pretrained(ours, out).initialised
    torch.manual_seed(0)
    ids = torch.randint(104, 187, (2, 12))
    types = torch.zeros_like(ids)
    types[:, 6:] = 1
    with torch.no_grad():
        theirs = hf(input_ids=ids, token_type_ids=types, attention_mask=torch.ones_like(ids))
        mine = ours(ids, types, torch.ones_like(ids), masked_lm_labels=ids)
    torch.testing.assert_close(mine.mlm_logits, theirs.prediction_logits.reshape(-1, 187),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mine.nsp_logits, theirs.seq_relationship_logits,
                               rtol=1e-5, atol=1e-6)


def test_a_killed_worker_is_one_line_naming_the_part_it_held(tmp_path, monkeypatch, capsys):
    """The OOM killer's SIGKILL of a worker: one line naming the part file and the signal,
    exit 3, nothing written (it was a 15-line traceback naming an internal function)."""
    from loaders import mlperf_text
    from tests.support import workers as tasks
    try:
        vocab = default_vocab_path()
    except DataError as e:
        pytest.skip(str(e))
    monkeypatch.setattr(mlperf_text, "_task", tasks.dies)    # pickled by name
    code = prepare.main(["--mlperf-text", str(TEXT), "--out", str(tmp_path / "out"),
                         "--vocab", str(vocab), "--seq-len", "64", "--max-pred", "10",
                         "--dupe-factor", "2", "--eval-samples", "40", "--workers", "2"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "killed by signal 9 (SIGKILL) while making the instances of " in err
    assert "eval.txt" in err or "part-0000" in err
    assert list(tmp_path.iterdir()) == []
