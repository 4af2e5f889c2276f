"""``python -m bench.convert_crc``: is converting a multi-GB TensorFlow checkpoint bound by its
CRC-32C? The same conversion timed with the numpy CRC-32C (before: what the converter ran
until google-crc32c) and with the library (after).

Writes a BERT checkpoint in TensorFlow's format (bench/tf_bundle_writer.py, no TensorFlow;
``--size large``: BERT-large's weights, 335 M float32 = 1.34 GB, the shape of MLPerf's
phase-1 checkpoint without its optimizer slots, which the converter skips) into a temporary
directory, then converts it ``--repeats`` times with each implementation, alternating, in
this process (``runtime.model.convert.convert``; "before" swaps the reader's ``crc32c`` for
``crc32c_numpy``, which is exactly the old code path). Each run's seconds, the seconds spent
inside the CRC, and each implementation's MB/s on the data shard alone are printed and go to
``bench/results/convert_crc.json``. Both implementations must write the same
model.safetensors (sha256): a check, not a measurement. Everything is removed afterwards.

    python -m bench.convert_crc                      # BERT-large, 3 runs of each
    python -m bench.convert_crc --size small --repeats 1 --results /tmp/x.json   # seconds
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from basis.tf_names import variables
from bench.common import finish, record
from bench.tf_bundle_writer import write_bundle

RESULTS = Path(__file__).resolve().parent / "results" / "convert_crc.json"
SHAPES = {
    "large": dict(vocab_size=30522, hidden_size=1024, num_hidden_layers=24,
                  num_attention_heads=16, intermediate_size=4096),
    "small": dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=2, intermediate_size=128),
}
"""``large``: BERT-large (MLPerf's bert_config.json); ``small``: for the bench's own test."""


def bert_config(size: str) -> dict:
    """Google's bert_config.json for ``size``."""
    return {"attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
            "hidden_dropout_prob": 0.1, "initializer_range": 0.02,
            "max_position_embeddings": 512, "type_vocab_size": 2, **SHAPES[size]}


def write_bert_checkpoint(directory: Path, size: str, seed: int = 0) -> Path:
    """A BERT checkpoint of ``size`` (normal(0, 0.02) weights, one tensor in memory at a
    time) and its bert_config.json in ``directory``; returns the prefix."""
    cfg = bert_config(size)
    rng = np.random.default_rng(seed)
    prefix = directory / "model.ckpt-1"
    tensors = ((name, rng.standard_normal(shape, np.float32) * np.float32(0.02))
               for name, shape in variables(cfg))
    write_bundle(prefix, tensors)
    (directory / "bert_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return prefix


def crc_rate(path: Path, fn, chunk: int = 1 << 26) -> float:
    """MB/s of ``fn`` over ``path``'s bytes (read first: the disk is not timed)."""
    blocks = []
    with open(path, "rb") as f:
        while block := f.read(chunk):
            blocks.append(block)
    t0 = time.perf_counter()
    crc = 0
    for block in blocks:
        crc = fn(block, crc)
    return sum(map(len, blocks)) / 1e6 / (time.perf_counter() - t0)


def convert_once(prefix: Path, out: Path, numpy_crc: bool) -> dict:
    """One conversion: its seconds, the seconds inside the CRC, the model file's sha256."""
    from runtime.model import tf_bundle
    from runtime.model.convert import MODEL_FILE, _sha256, convert
    from runtime.model.crc32c import crc32c, crc32c_numpy
    inner = crc32c_numpy if numpy_crc else crc32c
    spent = [0.0]

    def timed(data, crc=0):
        t = time.perf_counter()
        try:
            return inner(data, crc)
        finally:
            spent[0] += time.perf_counter() - t

    tf_bundle.crc32c = timed                 # the reader's name for it (index and tensors)
    try:
        t0 = time.perf_counter()
        convert(prefix, out, log=lambda m: None)
        seconds = time.perf_counter() - t0
    finally:
        tf_bundle.crc32c = crc32c
    digest = _sha256(out / MODEL_FILE)
    shutil.rmtree(out)
    return {"seconds": round(seconds, 2), "crc_seconds": round(spent[0], 2),
            "crc_share": round(spent[0] / seconds, 3), "model_sha256": digest}


def _warm_up(size: str) -> None:
    """Imports and the model built on the meta device, once, so the first timed run does not
    pay them."""
    import safetensors.torch  # noqa: F401
    from runtime.model.config import BertConfig
    from runtime.model.convert import expected_shapes
    shape = {k: v for k, v in bert_config(size).items() if k != "hidden_act"}
    expected_shapes(BertConfig(**shape))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.convert_crc",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SHAPES), default="large")
    p.add_argument("--repeats", type=int, default=3, help="conversions with each CRC")
    p.add_argument("--dir", type=Path, help="where to write the checkpoint (default: a "
                   "temporary directory; it is removed at the end either way)")
    p.add_argument("--results", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    from runtime.model.crc32c import IMPLEMENTATION, crc32c, crc32c_numpy
    header = record("convert_crc", sys.argv[1:] if argv is None else argv)
    work = Path(tempfile.mkdtemp(prefix="bench-convert-crc-", dir=a.dir))
    try:
        t0 = time.perf_counter()
        prefix = write_bert_checkpoint(work, a.size)
        write_s = time.perf_counter() - t0
        shard = Path(f"{prefix}.data-00000-of-00001")
        data_bytes = shard.stat().st_size
        print(f"wrote {prefix} ({data_bytes / 1e9:.2f} GB, {write_s:.1f} s)")
        _warm_up(a.size)
        rates = {"numpy": round(crc_rate(shard, crc32c_numpy), 1),
                 "library": round(crc_rate(shard, crc32c), 1)}
        runs = {"numpy": [], "library": []}
        for _ in range(a.repeats):
            for name in runs:                                 # alternating: load drifts
                runs[name].append(convert_once(prefix, work / f"out_{name}", name == "numpy"))
                r = runs[name][-1]
                print(f"{name:<8} {r['seconds']:>8.2f} s  (CRC {r['crc_seconds']:.2f} s, "
                      f"{100 * r['crc_share']:.0f} %)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    digests = {r["model_sha256"] for rs in runs.values() for r in rs}
    if len(digests) != 1:
        raise SystemExit(f"the two CRC implementations gave different outputs: {digests}")
    median = {k: statistics.median(r["seconds"] for r in rs) for k, rs in runs.items()}
    crc_median = {k: statistics.median(r["crc_seconds"] for r in rs) for k, rs in runs.items()}
    print(f"CRC-32C alone: numpy {rates['numpy']:,.0f} MB/s, {IMPLEMENTATION} "
          f"{rates['library']:,.0f} MB/s")
    print(f"conversion (median of {a.repeats}): numpy {median['numpy']:.2f} s, "
          f"library {median['library']:.2f} s ({median['numpy'] / median['library']:.2f}x)")
    finish({**header, "size": a.size, "shape": bert_config(a.size), "data_bytes": data_bytes,
            "tensors": len(variables(bert_config(a.size))), "write_checkpoint_s":
            round(write_s, 1), "library": IMPLEMENTATION, "crc_mb_per_s": rates,
            "repeats": a.repeats, "runs": runs, "median_s": median,
            "median_crc_s": crc_median,
            "speedup": round(median["numpy"] / median["library"], 2),
            "identical_outputs": True}, a.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
