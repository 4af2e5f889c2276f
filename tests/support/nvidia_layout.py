"""NVIDIA's preprocessed MLPerf HDF5, stood in for: shards written the way their preparation
writes them, from a data set prepared here - what docs/MLPERF.md's step 2' adopts at
fixture scale.

    python -m tests.support.nvidia_layout PREPARED OUT

writes ``OUT/hdf5_<N>_shards_varlength/part_<k>_of_<N>.hdf5`` (every training shard of
PREPARED) and ``OUT/eval_varlength/part_eval_10k.hdf5`` (its eval set), the directory names of
NVIDIA's ``input_preprocessing/prepare_data.sh`` (mlcommons/training_results_v2.0,
NVIDIA/benchmarks/bert/implementations/pytorch). Owns: ``write_nvidia_varlength``, one
shard in their layout (tests/unit/test_nvidia_shards.py reads it back). Never: anything a run
reads (loaders.adopt makes a data set of these files).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from loaders.shards import EVAL_FILE, Samples, read_shard


def write_nvidia_varlength(path: Path, s: Samples) -> None:
    """One shard as NVIDIA's MLPerf preparation writes it (``convert_fixed2variable.py`` in
    NVIDIA/benchmarks/bert/implementations/pytorch/input_preprocessing, training_results_v2.0):
    datasets of (n,) vlen int16 - but segment_ids vlen int8 - filled row by row, and
    next_sentence_labels as 'i1'."""
    import h5py
    n = len(s)
    with h5py.File(path, "w") as f:
        cols = {key: f.create_dataset(key, (n,), dtype=h5py.vlen_dtype(np.dtype(dt)))
                for key, dt in (("input_ids", "int16"), ("segment_ids", "int8"),
                                ("masked_lm_positions", "int16"), ("masked_lm_ids", "int16"))}
        nsp = f.create_dataset("next_sentence_labels", data=np.zeros(n, dtype="int8"), dtype="i1")
        for i in range(n):
            for key, ds in cols.items():
                ds[i] = getattr(s, key)[i]
            nsp[i] = s.next_sentence_labels[i]


def write_layout(prepared: Path, out: Path) -> Path:
    """PREPARED's shards and eval set in NVIDIA's layout under ``out``; the training
    directory."""
    shards = json.loads((prepared / "stats.json").read_text())["train_shards"]
    n = len(shards)
    train = out / f"hdf5_{n}_shards_varlength"
    train.mkdir(parents=True)
    (out / "eval_varlength").mkdir()
    for k, shard in enumerate(shards):
        write_nvidia_varlength(train / f"part_{k:05d}_of_{n:05d}.hdf5",
                               read_shard(prepared / shard["file"]))
    write_nvidia_varlength(out / "eval_varlength" / "part_eval_10k.hdf5",
                           read_shard(prepared / EVAL_FILE))
    return train


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m tests.support.nvidia_layout PREPARED OUT")
    train = write_layout(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"NVIDIA's layout: {train}/ and {Path(sys.argv[2]) / 'eval_varlength'}/")
