"""``python -m loaders.adopt``: MLPerf BERT shards prepared elsewhere - NVIDIA's preprocessed
HDF5 - as a data set this runtime trains on, without copying them.

Owns: checking every shard of another preparation against the schema and the model's limits,
and writing the data-set files the trainer reads around them (``train/`` and ``eval/eval.hdf5``
as symbolic links or copies, ``vocab.txt``, ``stats.json``, ``checksums.sha256``), atomically.
Never: changes, re-orders or re-shards a sample; prepares text (loaders.prepare does).

NVIDIA's MLPerf BERT preparation (``input_preprocessing/prepare_data.sh`` of
``NVIDIA/benchmarks/bert/implementations/pytorch`` in ``mlcommons/training_results_v2.0``)
writes the variable-length layout this loader reads - ``input_ids``, ``segment_ids`` (vlen
int8 there, widened on read), ``masked_lm_positions``, ``masked_lm_ids`` (vlen int16),
``next_sentence_labels`` (int8) - as ``hdf5/training-4320/hdf5_4320_shards_varlength/
part_NNNNN_of_04320.hdf5`` and ``hdf5/eval_varlength/part_eval_10k.hdf5``::

    python -m loaders.adopt --train /data/bert/hdf5/training-4320/hdf5_4320_shards_varlength \\
        --eval /data/bert/hdf5/eval_varlength/part_eval_10k.hdf5 \\
        --vocab /data/bert/phase1/vocab.txt --out /data/bert_wiki_512

Every shard is read once (row count, every token id below the vocabulary, every sequence at
most ``--seq-len`` tokens and ``--max-pred`` predictions, the sha256 for checksums.sha256, and
NVIDIA's content hash - ``input_ids_md5``, comparable with their published
``4320_shards_varlength.chk`` and ``eval_varlength.chk``) in ``--workers`` processes; a bad one is a DataError naming the file (exit 2) and nothing is
written. ``--seq-len``/``--max-pred`` are what ``stats.json`` records as the set's
``seq_len``/``max_pred`` (the trainer holds ``data.max_predictions_per_seq`` to it): MLPerf's
512 and 76 by default.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from basis import cli, staging
from basis.staging import OutputError, Staging
from loaders import tokenization
from loaders.build_record import STATS_FILE, VOCAB_FILE
from loaders.shards import (CHECKSUM_FILE, EVAL_FILE, PUBLISHED_EVAL_MD5, TRAIN_DIR, DataError,
                            Limits, check_samples, input_ids_md5, read_shard, sha256_file)
from loaders.workers import WorkerDied, Workers, defer_stop

def _inspect(task: tuple[str, int, int, int]) -> dict:
    """Read one shard whole: its rows, longest sequence, most predictions, sha256."""
    path, vocab_size, seq_len, max_pred = task
    try:
        samples = read_shard(path)
    except (OSError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"{path}: cannot read ({e}); the shard is corrupt or truncated") from e
    check_samples(path, samples, Limits(vocab_size=vocab_size, max_seq_length=seq_len))
    preds = max((len(p) for p in samples.masked_lm_positions), default=0)
    if preds > max_pred:
        raise DataError(f"{path}: a sequence has {preds} masked positions, more than --max-pred "
                        f"{max_pred}; pass the --max-pred the shards were made with")
    return {"samples": len(samples), "sha256": sha256_file(path),
            "input_ids_md5": input_ids_md5(samples.input_ids),
            "max_length": int(samples.lengths().max()) if len(samples) else 0,
            "max_predictions": preds}


def adopt(train: Path, eval_file: Path, vocab_path: Path, out: Path, seq_len: int = 512,
          max_pred: int = 76, copy: bool = False, workers: int = 1, log=print) -> dict:
    """Write the data set ``out`` around the shards of ``train`` (``*.hdf5``, sorted by name)
    and ``eval_file``; returns its stats.json content."""
    train, eval_file, out = Path(train).resolve(), Path(eval_file).resolve(), Path(out).resolve()
    if not train.is_dir():
        raise DataError(f"--train {train}: not a directory of shards")
    shards = sorted(train.glob("*.hdf5"))
    if not shards:
        raise DataError(f"--train {train}: no *.hdf5 shards in it")
    if not eval_file.is_file():
        raise DataError(f"--eval {eval_file}: no such file")
    staging.refuse_live(out, log, "adoption")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"--out {out}: exists and is not an empty directory; pick another --out")
    vocab = tokenization.load_vocab(vocab_path)
    tasks = [(str(p), len(vocab), seq_len, max_pred) for p in [*shards, eval_file]]
    with Workers(workers) as pool:
        facts = pool.map(_inspect, tasks, describe=lambda t: f"checking {t[0]}")
    names = [f"{TRAIN_DIR}/{p.name}" for p in shards]
    stats = {
        "created_by": "python -m loaders.adopt",
        "adopted": {"train_dir": str(train), "eval_file": str(eval_file),
                    "how": "copy" if copy else "symlink"},
        "sequences": {"train": sum(f["samples"] for f in facts[:-1]),
                      "eval": facts[-1]["samples"]},
        "train_shards": [{"file": n, "samples": f["samples"],
                          "input_ids_md5": f["input_ids_md5"]} for n, f in zip(names, facts)],
        "eval_file": {"file": EVAL_FILE, "samples": facts[-1]["samples"],
                      "input_ids_md5": facts[-1]["input_ids_md5"],
                      "matches_published_eval": facts[-1]["input_ids_md5"] == PUBLISHED_EVAL_MD5},
        "vocab": {"file": VOCAB_FILE, "source": str(Path(vocab_path).resolve()),
                  "size": len(vocab), "sha256": sha256_file(vocab_path)},
        "parameters": {"seq_len": seq_len, "max_pred": max_pred},
        "observed": {"max_length": max(f["max_length"] for f in facts),
                     "max_predictions": max(f["max_predictions"] for f in facts)},
    }
    stage = Staging(out, "adoption").open()
    tmp = stage.dir
    try:
        (tmp / TRAIN_DIR).mkdir(parents=True)
        (tmp / EVAL_FILE).parent.mkdir(parents=True)
        place = shutil.copyfile if copy else (lambda src, dst: os.symlink(src, dst))
        for src, rel in zip([*shards, eval_file], [*names, EVAL_FILE]):
            place(src, tmp / rel)
        shutil.copyfile(vocab_path, tmp / VOCAB_FILE)
        (tmp / STATS_FILE).write_text(json.dumps(stats, indent=1) + "\n")
        sums = {rel: f["sha256"] for rel, f in zip([*names, EVAL_FILE], facts)}
        sums.update({VOCAB_FILE: sha256_file(tmp / VOCAB_FILE),
                     STATS_FILE: sha256_file(tmp / STATS_FILE)})
        (tmp / CHECKSUM_FILE).write_text("".join(f"{d}  {r}\n" for r, d in sorted(sums.items())))
        with cli.commit_window():
            stage.commit(stage.contents(last=STATS_FILE))
    except OSError as e:
        stage.discard()
        raise DataError(f"{out}: cannot write the data set ({e})") from e
    except BaseException:
        stage.discard()
        raise
    log(f"[adopt] wrote {out}: {len(shards)} train shards ({stats['sequences']['train']} "
        f"sequences) and {stats['sequences']['eval']} eval sequences, "
        f"{'copied' if copy else 'linked'}; the eval shard's input_ids md5 (NVIDIA's "
        f"hdf5_md5.py) is {facts[-1]['input_ids_md5']}"
        + (" = the published MLPerf eval set's" if stats["eval_file"]["matches_published_eval"]
           else f", not the published MLPerf eval set's {PUBLISHED_EVAL_MD5}"))
    return stats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m loaders.adopt",
                                description="Use MLPerf BERT shards made elsewhere (NVIDIA's "
                                            "preprocessed HDF5) as a data set here.")
    p.add_argument("--train", type=Path, required=True, help="directory of training *.hdf5")
    p.add_argument("--eval", type=Path, required=True, help="the eval shard (part_eval_10k.hdf5)")
    p.add_argument("--vocab", type=Path, required=True, help="the vocab.txt the ids refer to")
    p.add_argument("--out", type=Path, required=True, help="data set directory to write")
    p.add_argument("--seq-len", type=int, default=512, help="default %(default)s")
    p.add_argument("--max-pred", type=int, default=76, help="default %(default)s")
    p.add_argument("--copy", action="store_true", help="copy the shards (default: symlinks)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    a = p.parse_args(argv)
    return cli.run("adopt", lambda: adopt(a.train, a.eval, a.vocab, a.out, a.seq_len,
                                          a.max_pred, a.copy, a.workers),
                   {DataError: 2, WorkerDied: 3, OutputError: None}, defer=defer_stop)


if __name__ == "__main__":
    sys.exit(main())
