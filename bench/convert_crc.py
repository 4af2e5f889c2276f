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

import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from basis.tf_names import variables
from bench.harness import Benchmark, Stop, option, out, run
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


@dataclass
class Checkpoint:
    """The checkpoint written for the runs, in a work folder removed afterwards."""

    prefix: Path
    work: Path
    data_bytes: int
    write_s: float
    rates: dict      # MB/s of each CRC on the data shard alone


@contextlib.contextmanager
def checkpoint(r):
    """The checkpoint of ``--size``, and each CRC's rate on its data shard alone."""
    from runtime.model.crc32c import crc32c, crc32c_numpy
    a = r.args
    work = Path(tempfile.mkdtemp(prefix="bench-convert-crc-", dir=a.dir))
    try:
        t0 = time.perf_counter()
        prefix = write_bert_checkpoint(work, a.size)
        write_s = time.perf_counter() - t0
        shard = Path(f"{prefix}.data-00000-of-00001")
        data_bytes = shard.stat().st_size
        print(f"wrote {prefix} ({data_bytes / 1e9:.2f} GB, {write_s:.1f} s)")
        _warm_up(a.size)
        yield Checkpoint(prefix, work, data_bytes, write_s,
                         {"numpy": round(crc_rate(shard, crc32c_numpy), 1),
                          "library": round(crc_rate(shard, crc32c), 1)})
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure(r, case) -> dict:
    _, name = case
    return {"crc": name, **convert_once(r.state.prefix, r.state.work / f"out_{name}",
                                        name == "numpy")}


def summary(r) -> dict:
    """Both CRCs' runs, medians and speed-up; the two must have written the same file."""
    from runtime.model.crc32c import IMPLEMENTATION
    runs = {"numpy": [], "library": []}
    for x in r.results:
        runs[x.pop("crc")].append(x)
    digests = {x["model_sha256"] for rs in runs.values() for x in rs}
    if len(digests) != 1:
        raise Stop(f"the two CRC implementations gave different outputs: {digests}")
    median = {k: statistics.median(x["seconds"] for x in rs) for k, rs in runs.items()}
    size = r.args.size
    return {"size": size, "shape": bert_config(size), "data_bytes": r.state.data_bytes,
            "tensors": len(variables(bert_config(size))),
            "write_checkpoint_s": round(r.state.write_s, 1), "library": IMPLEMENTATION,
            "crc_mb_per_s": r.state.rates, "repeats": r.args.repeats,
            "runs": runs, "median_s": median,
            "median_crc_s": {k: statistics.median(x["crc_seconds"] for x in rs)
                             for k, rs in runs.items()},
            "speedup": round(median["numpy"] / median["library"], 2),
            "identical_outputs": True}


def table(rec: dict) -> str:
    rates, median = rec["crc_mb_per_s"], rec["median_s"]
    return (f"CRC-32C alone: numpy {rates['numpy']:,.0f} MB/s, {rec['library']} "
            f"{rates['library']:,.0f} MB/s\n"
            f"conversion (median of {rec['repeats']}): numpy {median['numpy']:.2f} s, "
            f"library {median['library']:.2f} s ({median['numpy'] / median['library']:.2f}x)")


BENCHMARK = Benchmark(
    "convert_crc", __doc__, measure,
    cases=lambda r: [(k, name) for k in range(r.args.repeats)
                     for name in ("numpy", "library")],   # alternating: load drifts
    options=(option("--size", choices=sorted(SHAPES), default="large"),
             option("--repeats", type=int, default=3, help="conversions with each CRC"),
             option("--dir", type=Path, help="where to write the checkpoint (default: a "
                    "temporary directory; it is removed at the end either way)"),
             out(RESULTS, "--results")),
    out_dest="results", setup=checkpoint,
    progress=lambda r, case, x: f"{case[1]:<8} {x['seconds']:>8.2f} s  (CRC "
                                f"{x['crc_seconds']:.2f} s, {100 * x['crc_share']:.0f} %)",
    summary=summary, table=table)


def main(argv=None) -> int:
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
