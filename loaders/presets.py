"""Named builds of ``loaders.prepare``: a data set's PrepareConfig options (besides ``out``,
``sources`` and ``workers``), for the callers that build the same set in different places.

Owns: ``SMALL_DATASET_OPTIONS``, the small real-text set (400 Wikipedia lead sections, seq 128,
4 training shards, 64 eval samples: built in a second or two) that the test suite shares
(tests/conftest.py ``small_dataset``) and that ``python -m bench.gpu`` builds on the machine
(its ``small`` set, and every set of a ``--smoke`` run); and ``SOURCES``, where ``make sources``
puts the text, from any working directory.
Never: builds anything (loaders.prepare does) or imports the pipeline (no numpy, no tokenizer:
the test suite imports this at collection).
"""
from __future__ import annotations

from pathlib import Path

SOURCES = Path(__file__).resolve().parents[1] / ".cache" / "sources"
"""The repository's ``.cache/sources`` (loaders.prepare.DEFAULT_SOURCES, made absolute)."""

SMALL_DATASET_OPTIONS = dict(max_docs=400, shards=4, eval_samples=64, dupe_factor=2,
                             eval_doc_fraction=0.2, seq_len=128, max_pred=20, seed=12345)
"""Callers copy it (``dict(SMALL_DATASET_OPTIONS)``) before adding their own keys."""
