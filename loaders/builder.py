"""One data build, whatever its text: a source's stages (files -> documents -> instances) run
by one runner, which owns everything around them.

A ``Source`` is its input files (``files``: named paths, hashed into the fingerprint) and its
stages, in order, each a function of the ``Build`` and what the stage before it made; the last
makes the instances, as a ``Made``: the training sequences in shard order (``shard(lo, hi)``),
the eval set, and the counts the record keeps. The two sources: the corpus
(loaders/corpus_source.py: extract, tokenize, create_instances) and the MLPerf reference's
text (loaders/mlperf_text.py: create_instances, one task per file as the reference runs it).

Owns: the order of a build - ``--out`` made ready (basis.staging: a build at work on it
refused, the leftovers of killed ones removed), the inputs' hashes and the fingerprint, "up to
date" (build_record.check_existing), the staging directory -, each stage timed and logged,
the stages' worker pools and the state their tasks read (``workers``, ``STATE``), the
instance parameters, the cut of the training sequences into ``--shards`` contiguous shards of
equal size (± 1, the larger first), the shards, the eval file and the vocabulary written, the
statistics of what was written, the record and the checksums (build_record), the commit, and
the errors: a failure or a stop leaves ``--out`` absent, untouched or complete; an OSError of
writing the output is one line (basis.staging: exit 2, a full disk 3). Never: finds a
source's files or makes its documents or instances (the sources), the command line
(loaders.prepare), the record's layout or the HDF5 schema (build_record.py, shards.py).
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from basis import cli, staging
from basis.staging import Staging
from loaders import build_record, pretraining, tokenization
from loaders.build_record import STATS_FILE, VOCAB_FILE, BuildReport
from loaders.shards import EVAL_FILE, TRAIN_DIR, DataError, Samples, sha256_file, shard_name, \
    write_shard
from loaders.workers import Workers

STATE: dict = {}
"""What a stage's tasks read (the vocabulary, the documents, the parameters ...), in each
worker and here when the tasks run inline: set by ``set_state``, cleared when a build ends."""


def set_state(state: dict) -> None:
    """In each worker (and here when the tasks run inline): the state the tasks read."""
    STATE.clear()
    STATE.update(state)


@dataclass
class Made:
    """What a source's last stage made: the instances and what the record counts of them."""

    train_sequences: int
    shard: Callable[[int, int], Samples]
    """the training sequences [lo, hi) of the shard order, as shard samples"""
    eval: Samples
    eval_candidates: int
    origin: tuple[int, str]
    """how many of what the training sequences came from (for the error when too few)"""
    documents: dict
    sentences: dict
    corpus_tokens: dict
    mask_kinds: dict
    """the training set's masked tokens by kind: mask, random, kept"""
    eval_extra: dict = field(default_factory=dict)
    parts: Optional[list] = None
    report: dict = field(default_factory=dict)
    """the BuildReport's extras (which documents went where)"""


@dataclass(frozen=True)
class Stage:
    """A stage of a source: ``run(build, made_before) -> (made, what to log or None)``; its
    seconds go to the report under ``name``."""

    name: str
    run: Callable[["Build", Any], tuple[Any, Optional[str]]]


@dataclass(frozen=True)
class Source:
    """A kind of text a build is made from (see the module docstring)."""

    created_by: str
    files: Callable[[Any], list[tuple[str, Path]]]
    stages: tuple[Stage, ...]
    procedure: Optional[str] = None


@dataclass
class Build:
    """What a stage works with: the options, the vocabulary, the inputs, the staging
    directory (``dir``) and the log."""

    cfg: Any
    vocab: dict
    vocab_path: Path
    files: list[tuple[str, Path]]
    sources: list[dict]
    """each input's record (name, file, sha256); a stage adds its ``documents``"""
    dir: Path
    log: Callable[[str], None]

    def workers(self, state: Optional[dict] = None) -> Workers:
        """A pool of ``--workers`` processes whose tasks read ``state`` (``STATE``)."""
        return Workers(self.cfg.workers, setup=None if state is None else (set_state, (state,)))

    def params(self) -> pretraining.InstanceParams:
        cfg = self.cfg
        return pretraining.InstanceParams(
            max_seq_length=cfg.seq_len, short_seq_prob=cfg.short_seq_prob,
            masked_lm_prob=cfg.masked_lm_prob, max_predictions_per_seq=cfg.max_pred,
            vocab_size=len(self.vocab))

    @property
    def scratch(self) -> Path:
        """A work directory inside the staging directory, removed before the commit."""
        path = self.dir / ".work"
        path.mkdir(exist_ok=True)
        return path


def run(cfg, source: Source, log: Callable[[str], None]) -> BuildReport:
    """Build the data set ``cfg`` describes from ``source`` (see the module docstring)."""
    t_start = time.perf_counter()
    seconds: dict[str, float] = {}
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = cfg.out.resolve()
    staging.refuse_live(out, log, "build")      # before the inputs' hashes (minutes: MLPerf's)
    vocab_path = cfg.vocab or tokenization.default_vocab_path()
    vocab = tokenization.load_vocab(vocab_path)
    files = source.files(cfg)
    sources = [{"name": n, "file": p.name, "sha256": sha256_file(p)} for n, p in files]
    fingerprint = build_record.fingerprint(cfg.recorded(), sha256_file(vocab_path), sources)
    if build_record.check_existing(out, fingerprint):
        log(f"{out} is up to date (same inputs and options; checksums verified)")
        stats = json.loads((out / STATS_FILE).read_text())
        return BuildReport(out, True, stats, {"total": time.perf_counter() - t_start})
    seconds["hash_inputs"] = time.perf_counter() - t_start

    stage = Staging(out, "build").open()
    build = Build(cfg, vocab, Path(vocab_path), files, sources, stage.dir, log)
    try:
        made = None
        for step in source.stages:
            t = time.perf_counter()
            made, said = step.run(build, made)
            seconds[step.name] = time.perf_counter() - t
            if said:
                log(f"{step.name}: {said} in {seconds[step.name]:.1f} s")
        stats = _write(build, source, made, fingerprint, seconds)
        with cli.commit_window():
            stage.commit(stage.contents(last=STATS_FILE))
    except OSError as e:
        stage.discard()
        err = _output_error(stage, e)
        if err is None:
            raise
        raise err from None
    except BaseException:
        stage.discard()
        raise
    finally:
        STATE.clear()
    seconds["total"] = time.perf_counter() - t_start
    log(f"wrote {out} in {seconds['total']:.1f} s")
    return BuildReport(out, False, stats, seconds, **made.report)


def _output_error(stage: Staging, e: OSError):
    """The user's line for an OSError met writing into the staging directory or moving it
    into place (None: another file's, an input's - its own message says it)."""
    path = Path(e.filename) if e.filename else None
    if path is not None and stage.dir in path.parents:
        return stage.error(e, stage.dir / path.name)
    if path is not None and stage.out in (path, path.parent):
        return stage.error(e, stage.out)
    return None


def _columns(samples: Samples) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lengths, predictions, NSP labels) of every sequence of ``samples``."""
    npred = np.fromiter((len(x) for x in samples.masked_lm_positions), np.int64,
                        count=len(samples))
    return samples.lengths(), npred, samples.next_sentence_labels


def _write(build: Build, source: Source, made: Made, fingerprint: dict, seconds: dict) -> dict:
    """The shards, the eval file, the vocabulary, the record and the checksums into the
    staging directory; returns the record."""
    cfg, tmp = build.cfg, build.dir
    n = made.train_sequences
    if n < cfg.shards:
        count, what = made.origin
        raise DataError(f"only {n} training sequences from {count} {what} for --shards "
                        f"{cfg.shards}; lower --shards or use more {what}")
    t = time.perf_counter()
    (tmp / TRAIN_DIR).mkdir()
    (tmp / EVAL_FILE).parent.mkdir(parents=True)
    sizes = np.full(cfg.shards, n // cfg.shards)
    sizes[: n % cfg.shards] += 1
    relpaths, train_shards, columns = [], [], []
    lo = 0
    for k, size in enumerate(sizes):
        rel = f"{TRAIN_DIR}/{shard_name(k, cfg.shards)}"
        samples = made.shard(lo, lo + int(size))
        write_shard(tmp / rel, samples)
        relpaths.append(rel)
        train_shards.append({"file": rel, "samples": int(size)})
        columns.append(_columns(samples))
        lo += int(size)
    write_shard(tmp / EVAL_FILE, made.eval)
    shutil.copyfile(build.vocab_path, tmp / VOCAB_FILE)
    shutil.rmtree(tmp / ".work", ignore_errors=True)

    train = build_record.length_stats(*(np.concatenate(c) for c in zip(*columns)),
                                      cfg.seq_len)
    eval_ = {**build_record.length_stats(*_columns(made.eval), cfg.seq_len), **made.eval_extra}
    stats = build_record.record(
        created_by=source.created_by, procedure=source.procedure,
        documents=made.documents, sentences=made.sentences,
        sequences={"train": n, "eval": cfg.eval_samples, "eval_candidates": made.eval_candidates},
        corpus_tokens=made.corpus_tokens, train=train, eval_=eval_, mask_kinds=made.mask_kinds,
        parts=made.parts, train_shards=train_shards, eval_samples=cfg.eval_samples,
        vocab={"file": VOCAB_FILE, "source": build.vocab_path.name, "size": len(build.vocab),
               "sha256": fingerprint["vocab_sha256"]},
        sources=build.sources, parameters=cfg.recorded(), fingerprint_=fingerprint)
    seconds["write"] = time.perf_counter() - t
    build.log(f"write: {cfg.shards} shards ({n} sequences) + eval ({cfg.eval_samples} of "
              f"{made.eval_candidates}) in {seconds['write']:.1f} s")
    build_record.write(tmp, stats, relpaths, seconds)
    return stats
