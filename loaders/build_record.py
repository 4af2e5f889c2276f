"""The build record of a prepared data set: ``stats.json`` and the fingerprint that makes a
build "up to date", written by the one stage runner (``loaders.builder``) for every source -
the corpus (``loaders.corpus_source``) and the MLPerf reference's text
(``loaders.mlperf_text``) - and read back by the next build.

Owns: the record's file names, the fingerprint (the options that shape the content, the
vocabulary's and every source's hash, the library versions that shape the bytes), the check
of an existing ``--out`` against it, the length statistics of a split, the order of the
record's keys and its JSON layout, the rows of packed instances as shard samples, and writing
the record with the checksums as the build's last step. Never: how instances are made
(pretraining.py), the HDF5 schema or checksum format (shards.py), the order of a build
(builder.py), the command line (prepare.py), where and how ``--out`` is written
(basis.staging).
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from loaders import pretraining
from loaders.shards import (EVAL_FILE, DataError, Samples, verify_checksums, write_checksums)

FORMAT_VERSION = 1          # bump when a code change alters the bytes of a data set
STATS_FILE = "stats.json"
VOCAB_FILE = "vocab.txt"
HIST_BIN = 8


@dataclass
class BuildReport:
    """What a build did: where the set is, whether it was already there, its stats.json
    content, seconds per phase (and, from prepare's own sources, which documents went where)."""

    out: Path
    up_to_date: bool
    stats: dict
    seconds: dict                     # per phase
    train_doc_ids: list = field(default_factory=list)
    eval_doc_ids: list = field(default_factory=list)
    train_instance_docs: set = field(default_factory=set)   # doc ids used by A or B segments
    eval_instance_docs: set = field(default_factory=set)


def versions() -> dict:
    """The versions that shape a data set's bytes (part of the fingerprint)."""
    import h5py
    import tokenizers

    return {"tokenizers": tokenizers.__version__, "h5py": h5py.__version__,
            "hdf5": h5py.version.hdf5_version, "numpy": np.__version__,
            "format_version": FORMAT_VERSION}


def fingerprint(parameters: dict, vocab_sha: str, sources: list[dict]) -> dict:
    """What makes two builds the same: ``parameters`` (the options that shape the content),
    the vocabulary's sha256, each source file's name and sha256, ``versions()``."""
    return {"parameters": parameters, "vocab_sha256": vocab_sha,
            "sources": [{"name": s["name"], "file": s["file"], "sha256": s["sha256"]}
                        for s in sources],
            "versions": versions()}


def check_existing(out: Path, fingerprint_: dict, made_by: str = "loaders.prepare") -> bool:
    """True when ``out`` already holds the set of ``fingerprint_`` (its checksums verified);
    False when it is absent or an empty directory; DataError when it holds anything else."""
    if not out.exists():
        return False
    if not out.is_dir():
        raise DataError(f"{out}: exists and is not a directory; pick another --out")
    if not any(out.iterdir()):
        return False
    try:
        old = json.loads((out / STATS_FILE).read_text())["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        raise DataError(f"{out}: already exists and is not a data set made by {made_by} "
                        f"(no readable {STATS_FILE}); pick another --out or delete it") from None
    if old != fingerprint_:
        diffs = []
        for k in sorted(set(old.get("parameters", {})) | set(fingerprint_["parameters"])):
            a, b = old.get("parameters", {}).get(k), fingerprint_["parameters"].get(k)
            if a != b:
                diffs.append(f"{k}: {a!r} there, {b!r} requested")
        for key in ("vocab_sha256", "sources", "versions"):
            if old.get(key) != fingerprint_[key]:
                diffs.append(f"{key} differ")
        raise DataError(f"{out}: already holds a different data set ({'; '.join(diffs)}); "
                        "pick another --out or delete it to rebuild")
    try:
        verify_checksums(out)
    except DataError as e:
        raise DataError(f"{e}. {out} was built with these same options but is damaged; "
                        "delete it and run prepare again") from None
    return True


def length_stats(lengths: np.ndarray, npred: np.ndarray, nsp: np.ndarray, seq_len: int) -> dict:
    """A split's record from its sequences' lengths, predictions and NSP labels."""
    edges = list(range(0, seq_len, HIST_BIN)) + [seq_len]
    hist, _ = np.histogram(lengths, bins=np.asarray(edges) + 0.5)  # bins (lo, hi]
    non_special = int(lengths.sum() - 3 * len(lengths))
    return {
        "sequences": int(len(lengths)),
        "tokens": int(lengths.sum()),
        "mean_length": round(float(lengths.mean()), 3) if len(lengths) else 0.0,
        "length_histogram": {"bin_upper_edges": edges[1:], "counts": hist.tolist()},
        "masked_positions": int(npred.sum()),
        "masked_fraction": round(float(npred.sum()) / max(1, non_special), 5),
        "nsp_random_next_fraction": round(float(nsp.mean()), 5) if len(lengths) else 0.0,
    }


def packed_stats(packed: pretraining.PackedInstances, rows: np.ndarray, seq_len: int) -> dict:
    """``length_stats`` of ``rows`` of ``packed``."""
    return length_stats(packed.lengths()[rows], np.diff(packed.pred_off)[rows], packed.nsp[rows],
                        seq_len)


def select_rows(packed: pretraining.PackedInstances, rows) -> Samples:
    """``rows`` of ``packed`` as shard samples, in that order."""
    cols = [packed.row(int(r)) for r in rows]
    return Samples(input_ids=[c[0] for c in cols], segment_ids=[c[1] for c in cols],
                   masked_lm_positions=[c[2] for c in cols],
                   masked_lm_ids=[c[3] for c in cols],
                   next_sentence_labels=np.asarray([c[4] for c in cols], np.int8))


def dump_json(obj) -> str:
    """Indented JSON with lists of numbers kept on one line (histograms stay readable)."""
    text = json.dumps(obj, indent=1)
    return re.sub(r"\[\s+([-\d.,\s]+?)\s+\]",
                  lambda m: "[" + " ".join(m.group(1).split()) + "]", text) + "\n"


def record(*, created_by: str, documents: dict, sentences: dict, sequences: dict,
           corpus_tokens: dict, train: dict, eval_: dict, mask_kinds: dict,
           train_shards: list, eval_samples: int, vocab: dict, sources: list,
           parameters: dict, fingerprint_: dict, procedure: Optional[str] = None,
           parts: Optional[list] = None) -> dict:
    """stats.json's content, its keys in their one order (``procedure`` and ``parts``: the
    MLPerf text source's extras). ``mask_kinds``: counts of the train set's masked tokens
    by kind (mask, random, kept)."""
    n_masked = max(1, sum(mask_kinds[k] for k in ("mask", "random", "kept")))
    stats = {"created_by": created_by}
    if procedure is not None:
        stats["procedure"] = procedure
    stats.update({
        "documents": documents,
        "sentences": sentences,
        "sequences": sequences,
        "tokens": {"train": train["tokens"], "eval": eval_["tokens"]},
        "corpus_tokens": corpus_tokens,
        "train": train,
        "eval": eval_,
        "masked_token_kinds": {
            **{k: round(mask_kinds[k] / n_masked, 5) for k in ("mask", "random", "kept")},
            "note": "train set; a random id that equals the original counts as kept"},
    })
    if parts is not None:
        stats["parts"] = parts
    stats.update({
        "train_shards": train_shards,
        "eval_file": {"file": EVAL_FILE, "samples": eval_samples},
        "vocab": vocab,
        "sources": sources,
        "parameters": parameters,
        "versions": versions(),
        "fingerprint": fingerprint_,
    })
    return stats


def write(tmp: Path, stats: dict, shard_files: list[str], seconds: dict) -> None:
    """The build's last step in ``tmp``: stats.json, then the checksums of ``shard_files``
    (train shards relative to ``tmp``), the eval file, the vocabulary and stats.json (their
    seconds in ``seconds["checksums"]``)."""
    (tmp / STATS_FILE).write_text(dump_json(stats))
    t = time.perf_counter()
    write_checksums(tmp, list(shard_files) + [EVAL_FILE, VOCAB_FILE, STATS_FILE])
    seconds["checksums"] = time.perf_counter() - t
