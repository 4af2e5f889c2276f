"""The MLPerf reference's text as a source of ``loaders.prepare`` (``--mlperf-text DIR``): the
Wikipedia 2020-01-01 dump cut into ``part-00000-of-00500`` ... files plus the held-out
``eval.txt``, one sentence per line and a blank line between documents - turned into shards
the way the reference's ``create_pretraining_data.py`` turns each of them into TFRecords.

Owns: finding and checking the part files, reading the text format, the reference's
procedure per input file, the eval set, and the training sequences in part order - one stage,
``create_instances``, that the builder (loaders.builder) runs. Never: pairing and masking
(pretraining.py), the tokenizer (tokenization.py), the cut into ``--shards`` shards, the
record and its fingerprint, the staging directory and the errors' exit statuses (builder.py,
build_record.py, basis), the command line (prepare.py), the HDF5 schema (shards.py).

The reference (``mlcommons/training``, ``language_model/tensorflow/bert``, README "Generate
the TFRecords"; NVIDIA's ``parallel_create_hdf5.sh`` runs it the same way) runs
``create_pretraining_data.py`` once per part file with ``--random_seed=12345
--dupe_factor=10 --max_seq_length=512 --max_predictions_per_seq=76``, and once on eval.txt
with the same flags, then ``pick_eval_samples.py --num_examples_to_pick=10000`` takes record
``int(i * n / 10000)`` for i = 0..9999. Each run, and so here each file:

1. reads lines; a line that is empty after ``strip()`` starts a new document, a line whose
   tokens are empty is dropped, empty documents are dropped;
2. ``rng = random.Random(seed)``; ``rng.shuffle(documents)``;
3. ``dupe_factor`` passes over the documents in order, ``create_instances_from_document``
   with that one ``rng`` (its random "next" sentences come from the same file);
4. ``rng.shuffle(instances)``.

This module does exactly that, with the tokenizer at Google's 200 characters per word, so a
part's instances are the reference's instances of that part, in the reference's order (held
against the reference script run under TensorFlow: tests/fixtures/mlperf_text/). That is why
the eval set here is the MLPerf eval set and not merely one like it: MLPerf requires the
seed 12345 "so that the examples on which the training is evaluated is consistent among
users". Parallel over files (each a task for ``--workers``), sequential inside one, as the
reference is: deterministic whatever ``--workers`` is. The training shards are the parts'
instances in part order, cut into ``--shards`` contiguous shards of equal size (± 1), as
NVIDIA's ``chop_hdf5_files.py`` cuts them (default: one shard per part).
"""
from __future__ import annotations

import random
import re
import time
from pathlib import Path

import numpy as np

from basis.presets import MLPERF_DEFAULTS
from loaders import pretraining, tokenization
from loaders.build_record import select_rows
from loaders.builder import STATE, Made, Source, Stage
from loaders.shards import PUBLISHED_EVAL_MD5, DataError, Samples, input_ids_md5

PART = re.compile(r"^part-(\d{5})-of-(\d{5})$")
EVAL_NAME = "eval.txt"
OFFICIAL = {**MLPERF_DEFAULTS, "masked_lm_prob": 0.15, "short_seq_prob": 0.1, "seed": 12345,
            "source": "mlperf-text"}
"""Every recorded option of the official eval set (whose hash NVIDIA publishes)."""
_ARRAYS = ("input_ids", "id_off", "len_a", "positions", "labels", "pred_off", "nsp")


# ------------------------------------------------------------------------------ the files

def find_parts(directory: Path) -> list[Path]:
    """The part files of ``directory``, in order; every one of the N a name promises."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"--mlperf-text {directory}: not a directory (the reference's results4/ "
                        "of part-00000-of-00500 ... files and eval.txt)")
    found = {}
    for p in directory.iterdir():
        m = PART.match(p.name)
        if m:
            found[p.name] = (int(m.group(1)), int(m.group(2)), p)
    if not found:
        raise DataError(f"--mlperf-text {directory}: no part-NNNNN-of-NNNNN files in it")
    totals = {t for _, t, _ in found.values()}
    if len(totals) != 1:
        raise DataError(f"--mlperf-text {directory}: part files of different sets "
                        f"(-of-{', -of-'.join(f'{t:05d}' for t in sorted(totals))}); keep one")
    total = totals.pop()
    missing = [f"part-{i:05d}-of-{total:05d}" for i in range(total)
               if f"part-{i:05d}-of-{total:05d}" not in found]
    if missing:
        raise DataError(f"{directory / missing[0]}: missing ({len(missing)} of {total} parts "
                        f"missing: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''})"
                        " - copy every part of the reference's text")
    parts = [found[f"part-{i:05d}-of-{total:05d}"][2] for i in range(total)]
    for p in parts:
        if not p.is_file():
            raise DataError(f"{p}: not a regular file - every part-NNNNN-of-NNNNN is one of the "
                            "reference's text files; copy it again")
        if p.stat().st_size == 0:
            raise DataError(f"{p}: empty (0 bytes) - no part of the reference's text is empty, "
                            "so the copy failed; copy it again (check it against its md5)")
    return parts


def eval_path(cfg) -> Path:
    path = Path(cfg.mlperf_eval) if cfg.mlperf_eval else Path(cfg.mlperf_text) / EVAL_NAME
    if path.exists() and not path.is_file():
        raise DataError(f"{path}: not a regular file - the held-out eval text (the reference's "
                        "results4/eval.txt); pass --mlperf-eval FILE")
    if path.is_file() and path.stat().st_size == 0:
        raise DataError(f"{path}: empty (0 bytes) - the held-out eval text is not empty, so the "
                        "copy failed; copy it again (check it against its md5)")
    if not path.is_file():
        raise DataError(f"{path}: the held-out eval text is missing (the reference ships it as "
                        "results4/eval.txt); pass --mlperf-eval FILE")
    return path


def source_files(cfg) -> list[tuple[str, Path]]:
    return [("mlperf-eval", eval_path(cfg))] + [("mlperf-part", p)
                                                 for p in find_parts(cfg.mlperf_text)]


def read_documents(path: Path) -> list[list[str]]:
    """Documents as lists of stripped non-empty lines, split where the reference splits: at
    lines that are empty after ``strip()``; lines end at "\\n" only (as TensorFlow's GFile
    readline), the text is UTF-8 (strict, as GFile decodes it)."""
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 at byte {e.start} ({e.reason}); the reference's "
                        "text is UTF-8 - check the file against its md5") from None
    docs: list[list[str]] = [[]]
    for line in text.split("\n"):
        line = line.strip()
        if line:
            docs[-1].append(line)
        elif docs[-1]:
            docs.append([])
    return [d for d in docs if d]


# ------------------------------------------------------------------------------ the procedure

def tokenize_documents(tokenizer, docs: list[list[str]]) -> list[list[list[int]]]:
    """Each document as its lines' token ids; lines with no tokens and then documents with no
    lines dropped (the reference keeps a line only ``if tokens``)."""
    flat = [line for d in docs for line in d]
    encoded = []
    batch = tokenization.ENCODE_BATCH
    for i in range(0, len(flat), batch):
        encoded += tokenization.encode_sentences(tokenizer, flat[i:i + batch])
    out, k = [], 0
    for d in docs:
        segs = [encoded[k + j].tolist() for j in range(len(d)) if len(encoded[k + j])]
        k += len(d)
        if segs:
            out.append(segs)
    return out


def reference_instances(documents: list, params: pretraining.InstanceParams, seed: int,
                        dupe_factor: int) -> pretraining.PackedInstances:
    """create_training_instances of the reference on one file's documents: one RNG, the
    documents shuffled, ``dupe_factor`` passes, the instances shuffled (rows in that order)."""
    rng = random.Random(seed)
    documents = list(documents)
    rng.shuffle(documents)
    parts = []
    for _ in range(dupe_factor):
        for lo in range(0, len(documents), pretraining.CHUNK_DOCS):   # packed as they come
            instances, doc_a = [], []
            for d in range(lo, min(lo + pretraining.CHUNK_DOCS, len(documents))):
                made = pretraining.create_instances_from_document(documents, d, params, rng)
                instances.extend(made)
                doc_a.extend([d] * len(made))
            parts.append(pretraining.PackedInstances.from_instances(instances, doc_a,
                                                                    params.mask_id))
    packed = pretraining.PackedInstances.concat(parts)
    order = list(range(len(packed)))
    rng.shuffle(order)                  # the same draws as shuffling the instances themselves
    return reorder(packed, np.asarray(order, dtype=np.int64))


def reorder(p: pretraining.PackedInstances, rows: np.ndarray) -> pretraining.PackedInstances:
    """Rows ``rows`` of ``p``, in that order."""
    def gather(values, off):
        sizes = np.diff(off)[rows]
        new_off = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(sizes, out=new_off[1:])
        index = np.repeat(off[:-1][rows] - new_off[:-1], sizes) + np.arange(new_off[-1])
        return values[index], new_off

    ids, id_off = gather(p.input_ids, p.id_off)
    pos, pred_off = gather(p.positions, p.pred_off)
    lab, _ = gather(p.labels, p.pred_off)
    return pretraining.PackedInstances(
        input_ids=ids, id_off=id_off, len_a=p.len_a[rows], positions=pos, labels=lab,
        pred_off=pred_off, nsp=p.nsp[rows], doc_a=p.doc_a[rows], doc_b=p.doc_b[rows],
        n_mask=p.n_mask, n_kept=p.n_kept, n_random=p.n_random)


def eval_rows(candidates: int, samples: int) -> np.ndarray:
    """pick_eval_samples.py's choice: record ``int(i * (n / k))`` for i < k (float ratio)."""
    ratio = candidates / samples
    return np.asarray([int(i * ratio) for i in range(samples)], dtype=np.int64)


def file_instances(path: Path, tokenizer, params, seed: int, dupe_factor: int):
    """(instances, documents, lines, corpus tokens) of one text file, as the reference."""
    docs = tokenize_documents(tokenizer, read_documents(path))
    packed = reference_instances(docs, params, seed, dupe_factor)
    return packed, len(docs), sum(len(d) for d in docs), sum(len(s) for d in docs for s in d)


def _task(task: tuple[str, int, str]) -> dict:
    """One file, in a worker: its instances saved under the work directory, its counts."""
    kind, index, path = task
    tok = STATE.get("tokenizer")
    if tok is None:
        tok = STATE["tokenizer"] = tokenization.build_tokenizer(
            STATE["vocab"], max_chars_per_word=tokenization.GOOGLE_MAX_CHARS_PER_WORD)
    cfg = STATE["cfg"]
    packed, docs, lines, tokens = file_instances(Path(path), tok, STATE["params"], cfg.seed,
                                                 cfg.dupe_factor)
    candidates = len(packed)
    if kind == "eval":
        if candidates < cfg.eval_samples:
            raise DataError(f"{path}: gives {candidates} sequences, fewer than --eval-samples "
                            f"{cfg.eval_samples}; lower --eval-samples")
        packed = reorder(packed, eval_rows(candidates, cfg.eval_samples))
    work = Path(STATE["work"]) / f"{kind}-{index:05d}.npz"
    np.savez(work, **{k: getattr(packed, k) for k in _ARRAYS})
    return {"file": Path(path).name, "documents": docs, "sentences": lines,
            "corpus_tokens": tokens, "candidates": candidates, "sequences": len(packed),
            "n_mask": packed.n_mask, "n_kept": packed.n_kept, "n_random": packed.n_random,
            "work": str(work)}


def _load(work: str) -> pretraining.PackedInstances:
    with np.load(work) as z:
        arrays = {k: z[k] for k in _ARRAYS}
    empty = np.zeros(len(arrays["nsp"]), np.int32)
    return pretraining.PackedInstances(**arrays, doc_a=empty, doc_b=empty)


# ------------------------------------------------------------------------------ the stage

def create_instances(build, _):
    """Every file a task (the eval text first), then the training sequences in part order and
    the eval set, for the builder."""
    cfg = build.cfg
    evalf = next(p for name, p in build.files if name == "mlperf-eval")
    parts = [p for name, p in build.files if name == "mlperf-part"]
    state = dict(vocab=build.vocab, params=build.params(), cfg=cfg, work=str(build.scratch))
    tasks = [("eval", 0, str(evalf))] + [("part", i, str(p)) for i, p in enumerate(parts)]
    results = _run_files(build, tasks, state)
    ev, part_results = results[0], results[1:]
    for s, r in zip(build.sources, results):
        s["documents"] = r["documents"]
    evals = _load(ev["work"])
    eval_set = select_rows(evals, np.arange(len(evals)))
    eval_md5 = input_ids_md5(eval_set.input_ids)
    extra = {"input_ids_md5": eval_md5}
    if {k: v for k, v in cfg.recorded().items() if k != "shards"} == OFFICIAL:
        extra["matches_published_eval"] = eval_md5 == PUBLISHED_EVAL_MD5
        build.log(f"eval set: input_ids md5 {eval_md5} "
                  + ("= NVIDIA's published part_eval_10k.hdf5 (eval_varlength.chk): the MLPerf "
                     "eval set" if eval_md5 == PUBLISHED_EVAL_MD5 else
                     f"!= NVIDIA's published {PUBLISHED_EVAL_MD5}: NOT the MLPerf eval set - "
                     "are the text and vocab.txt the official ones (check their md5s)?"))
    total = lambda key: sum(r[key] for r in part_results)   # noqa: E731
    return Made(
        train_sequences=total("sequences"), shard=_shards_of(part_results), eval=eval_set,
        eval_candidates=ev["candidates"], origin=(len(parts), "part files"),
        documents={"train": total("documents"), "eval": ev["documents"]},
        sentences={"train": total("sentences"), "eval": ev["sentences"]},
        corpus_tokens={"train": total("corpus_tokens"), "eval": ev["corpus_tokens"]},
        mask_kinds={k: total(f"n_{k}") for k in ("mask", "random", "kept")},
        eval_extra=extra, parts=[{"file": r["file"], "documents": r["documents"],
                                  "sequences": r["sequences"]} for r in part_results]), None


def _run_files(build, tasks: list, state: dict) -> list[dict]:
    """The files' tasks in ``--workers`` processes, in task order, with progress lines."""
    t0 = time.perf_counter()
    total_bytes = sum(Path(t[2]).stat().st_size for t in tasks)
    done_bytes, results = 0, []
    with build.workers(state) as pool:
        for task, res in zip(tasks, pool.imap(_task, tasks, describe=lambda t: (
                f"making the instances of {t[2]}"))):
            results.append(res)
            done_bytes += Path(task[2]).stat().st_size
            if len(results) % max(1, len(tasks) // 20) == 0 or len(results) == len(tasks):
                build.log(f"mlperf-text: {len(results)}/{len(tasks)} files, "
                          f"{done_bytes / 1e6:,.2f} of {total_bytes / 1e6:,.2f} MB in "
                          f"{time.perf_counter() - t0:.1f} s")
    return results


def _shards_of(part_results: list[dict]):
    """``shard(lo, hi)``: the training sequences [lo, hi) of the parts in part order, each
    part's instances read from its work file once (the shards are asked for in order)."""
    starts = np.cumsum([0] + [r["sequences"] for r in part_results])
    loaded: dict = {}

    def shard(lo: int, hi: int) -> Samples:
        chunks = []
        for i, r in enumerate(part_results):            # the parts these rows are in
            a, b = max(lo, starts[i]), min(hi, starts[i + 1])
            if a >= b:
                continue
            if i not in loaded:
                loaded.clear()
                loaded[i] = _load(r["work"])
            chunks.append(select_rows(loaded[i], np.arange(a - starts[i], b - starts[i])))
        merged = chunks[0]
        for extra in chunks[1:]:
            for key in ("input_ids", "segment_ids", "masked_lm_positions", "masked_lm_ids"):
                getattr(merged, key).extend(getattr(extra, key))
            merged.next_sentence_labels = np.concatenate([merged.next_sentence_labels,
                                                          extra.next_sentence_labels])
        return merged
    return shard


SOURCE = Source(
    created_by="python -m loaders.prepare --mlperf-text", files=source_files,
    stages=(Stage("create_instances", create_instances),),
    procedure="the reference's create_pretraining_data.py per file (seed each file), eval "
              "picked as pick_eval_samples.py")
