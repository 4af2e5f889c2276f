"""Named builds of ``loaders.prepare``: a data set's PrepareConfig options (besides ``out``,
``sources`` and ``workers``), for the callers that build the same set in different places.

Owns: ``MLPERF_DEFAULTS``, the MLPerf reference's flags (what ``--mlperf-text`` builds when
they are not given); ``build_hint``, the command that builds (or adopts) a data set a config
asks for, for the errors that find none; ``SMALL_DATASET_OPTIONS``, the small real-text set
(400 Wikipedia lead sections, seq 128, 4 training shards, 64 eval samples: built in a second or
two) that the test suite shares (tests/conftest.py ``small_dataset``) and that ``python -m
bench.gpu`` builds on the machine (its ``small`` set, and every set of a ``--smoke`` run); and
``SOURCES``, where ``make sources`` puts the text, from any working directory.
Never: builds anything (loaders.prepare does) or imports anything but the standard library
(basis/: no numpy, no tokenizer - the test suite imports this at collection).
"""
from __future__ import annotations

from pathlib import Path

SOURCES = Path(__file__).resolve().parents[1] / ".cache" / "sources"
"""The repository's ``.cache/sources`` (loaders.prepare.DEFAULT_SOURCES, made absolute)."""

MLPERF_DEFAULTS = {"seq_len": 512, "max_pred": 76, "dupe_factor": 10, "eval_samples": 10000}
"""The reference's flags: what --mlperf-text builds when those options are not given."""

PREPARE_DEFAULTS = {"seq_len": 128, "max_pred": 20}
"""What ``python -m loaders.prepare`` builds from the PyPI text when not told otherwise
(loaders.prepare.PrepareConfig's defaults)."""


def build_hint(out, seq_len: int, max_pred: int) -> str:
    """The command that makes a data set at ``out`` for a config of ``seq_len`` and
    ``max_pred``: MLPerf's text (or NVIDIA's HDF5 adopted) for MLPerf's seq 512 / 76
    predictions, else the PyPI text at that shape."""
    if (seq_len, max_pred) == (MLPERF_DEFAULTS["seq_len"], MLPERF_DEFAULTS["max_pred"]):
        return (f"the MLPerf seq-512 set: `python -m loaders.prepare --mlperf-text results4 "
                f"--vocab phase1/vocab.txt --out {out} --shards 4320` from the reference's "
                f"text, or `python -m loaders.adopt --train <NVIDIA's "
                f"hdf5_4320_shards_varlength> --eval <part_eval_10k.hdf5> --vocab "
                f"phase1/vocab.txt --out {out}` from NVIDIA's HDF5 (docs/MLPERF.md, step 2)")
    flags = "".join(f" --{k.replace('_', '-')} {v}" for k, v in
                    (("seq_len", seq_len), ("max_pred", max_pred)) if PREPARE_DEFAULTS[k] != v)
    return f"`python -m loaders.prepare --out {out}{flags}` (docs/DATA.md)"


SMALL_DATASET_OPTIONS = dict(max_docs=400, shards=4, eval_samples=64, dupe_factor=2,
                             eval_doc_fraction=0.2, seq_len=128, max_pred=20, seed=12345)
"""Callers copy it (``dict(SMALL_DATASET_OPTIONS)``) before adding their own keys."""
