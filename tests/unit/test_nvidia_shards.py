"""NVIDIA's preprocessed MLPerf HDF5 (the variable-length layout of their prepare_data.sh,
segment ids as vlen int8) is read by this loader as it is, and ``python -m loaders.adopt``
makes a data set of such shards without copying them (tests/support/data.py writes a shard
the way NVIDIA's convert_fixed2variable.py does)."""
from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from loaders import adopt
from loaders.dataset import TrainLoader, load_eval_batches
from loaders.shards import DataError, Limits, input_ids_md5, read_shard, verify_checksums
from tests.support.data import (batch_fingerprints, raw_fingerprint, synthetic_samples,
                                write_nvidia_varlength)

VOCAB = "\n".join(["[PAD]"] + [f"[unused{i}]" for i in range(99)]
                  + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(29896)]
                  + [f"##p{i}" for i in range(522)]) + "\n"       # 30,522 entries


@pytest.fixture(scope="module")
def nvidia_dir(tmp_path_factory):
    """hdf5_4_shards_varlength/ (4 x 12 samples) + eval_varlength/part_eval_10k.hdf5 (10)."""
    root = tmp_path_factory.mktemp("nvidia")
    train = root / "hdf5_4_shards_varlength"
    train.mkdir()
    (root / "eval_varlength").mkdir()
    rng = np.random.default_rng(3)
    written = {}
    for k in range(4):
        written[k] = synthetic_samples(12 * k, 12, rng)
        write_nvidia_varlength(train / f"part_{k:05d}_of_00004.hdf5", written[k])
    evals = synthetic_samples(100, 10, rng)
    write_nvidia_varlength(root / "eval_varlength" / "part_eval_10k.hdf5", evals)
    (root / "vocab.txt").write_text(VOCAB)
    return root, written, evals


def test_a_shard_in_nvidias_layout_reads_as_written(nvidia_dir):
    root, written, _ = nvidia_dir
    path = root / "hdf5_4_shards_varlength" / "part_00002_of_00004.hdf5"
    with h5py.File(path) as f:                       # the layout is NVIDIA's, not ours
        assert h5py.check_vlen_dtype(f["segment_ids"].dtype) == np.int8
    got = read_shard(path)
    assert all(r.dtype == np.int16 for r in got.segment_ids)
    assert [raw_fingerprint(got, r) for r in range(12)] == \
        [raw_fingerprint(written[2], r) for r in range(12)]


def test_the_fixed_length_layout_is_named_and_refused(tmp_path):
    path = tmp_path / "part_00000_of_04320.hdf5"
    with h5py.File(path, "w") as f:
        for key in ("input_ids", "input_mask", "segment_ids", "masked_lm_positions",
                    "masked_lm_ids"):
            f.create_dataset(key, data=np.zeros((2, 8), np.int16))
        f.create_dataset("next_sentence_labels", data=np.zeros(2, np.int8))
    with pytest.raises(DataError, match="fixed-length .* use the \\*_varlength shards"):
        read_shard(path)


def test_adopt_makes_a_data_set_the_trainer_reads(nvidia_dir, tmp_path, capsys):
    root, written, evals = nvidia_dir
    out = tmp_path / "wiki512"
    rc = adopt.main(["--train", str(root / "hdf5_4_shards_varlength"),
                     "--eval", str(root / "eval_varlength" / "part_eval_10k.hdf5"),
                     "--vocab", str(root / "vocab.txt"), "--out", str(out), "--seq-len", "128",
                     "--max-pred", "20", "--workers", "1"])
    assert rc == 0, capsys.readouterr().err
    assert (out / "train" / "part_00000_of_00004.hdf5").is_symlink()      # not copied
    verify_checksums(out)
    stats = json.loads((out / "stats.json").read_text())
    assert stats["sequences"] == {"train": 48, "eval": 10}
    assert stats["parameters"] == {"seq_len": 128, "max_pred": 20}
    with TrainLoader(out, 0, 1, 8, seed=1, limits=Limits(30522, 128)) as loader:
        batches = [next(loader) for _ in range(loader.steps_per_epoch)]
    got = sorted(fp for b in batches for fp in batch_fingerprints(b))
    want = sorted(raw_fingerprint(s, r) for s in written.values() for r in range(12))
    assert got == want                               # every sample, once, as written
    ev = load_eval_batches(out, 0, 1, 4, limits=Limits(30522, 128))
    assert [fp for b in ev for fp in batch_fingerprints(b)] == \
        [raw_fingerprint(evals, r) for r in range(10)]


def test_adopt_writes_into_an_empty_out_and_removes_a_killed_adoptions_leftovers(
        nvidia_dir, tmp_path, capsys):
    """--out an existing empty directory (a mount point) is written into; the temporary
    directory a killed adoption left inside it (its lock free) is removed first, as the
    converter's and prepare's are (basis.staging)."""
    root, _, _ = nvidia_dir
    out = tmp_path / "mnt"
    (out / ".mnt.tmp-1" / "train").mkdir(parents=True)
    (out / ".mnt.tmp-1" / ".lock").touch()
    rc = adopt.main(["--train", str(root / "hdf5_4_shards_varlength"),
                     "--eval", str(root / "eval_varlength" / "part_eval_10k.hdf5"),
                     "--vocab", str(root / "vocab.txt"), "--out", str(out), "--seq-len", "128",
                     "--max-pred", "20", "--workers", "1"])
    assert rc == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["checksums.sha256", "eval", "stats.json",
                                                     "train", "vocab.txt"]
    verify_checksums(out)
    assert list(tmp_path.iterdir()) == [out]


def test_adopt_refuses_shards_the_model_cannot_take(nvidia_dir, tmp_path, capsys):
    root, _, _ = nvidia_dir
    args = ["--train", str(root / "hdf5_4_shards_varlength"), "--eval",
            str(root / "eval_varlength" / "part_eval_10k.hdf5"), "--vocab",
            str(root / "vocab.txt"), "--out", str(tmp_path / "out"), "--workers", "1"]
    assert adopt.main(args + ["--seq-len", "64"]) == 2       # samples of up to 100 tokens
    assert "more than data.max_seq_length = 64" in capsys.readouterr().err
    assert adopt.main(args + ["--max-pred", "5"]) == 2
    assert "more than --max-pred 5" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_input_ids_md5_is_nvidias_hdf5_md5(nvidia_dir):
    """hdf5_md5.py: md5 of str(list of md5(str(row.tolist())) per row of input_ids)."""
    import hashlib
    root, written, _ = nvidia_dir
    path = root / "hdf5_4_shards_varlength" / "part_00001_of_00004.hdf5"
    rows = []
    with h5py.File(path, "r") as f:
        for i in range(f["input_ids"].shape[0]):
            rows.append(hashlib.md5(str(f["input_ids"][i].tolist()).encode("utf-8")).hexdigest())
    want = hashlib.md5(str(rows).encode("utf-8")).hexdigest()
    assert input_ids_md5(read_shard(path).input_ids) == want
    assert input_ids_md5(written[1].input_ids) == want
