"""``python -m bench.prepare``: time a full default data-set build.

Builds the default set (``python -m loaders.prepare`` defaults, ``--workers 2`` unless told
otherwise) into a temporary directory, prints seconds per phase and sequences/s, then one
JSON line; the same record goes to ``bench/results/prepare.json``. The build is removed
afterwards. Not a test: it measures, on whatever machine runs it.

    python -m bench.prepare                 # default set, 2 workers
    python -m bench.prepare --workers 1 --repeat 2
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.common import finish, record
from loaders.prepare import DEFAULT_SOURCES, PrepareConfig, build

PHASES = ("hash_inputs", "extract", "tokenize", "create_instances", "write", "checksums")
RESULTS = Path(__file__).resolve().parent / "results" / "prepare.json"


def run_once(workers: int, sources: Path, debian_docs: bool) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    try:
        cfg = PrepareConfig(out=tmp / "data", workers=workers, sources=sources,
                            debian_docs=debian_docs)
        t0 = time.perf_counter()
        report = build(cfg, log=lambda msg: None)
        wall = time.perf_counter() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    s = report.stats
    return {"seconds": {k: round(report.seconds.get(k, 0.0), 3) for k in PHASES},
            "total_s": round(wall, 3),
            "train_sequences": s["sequences"]["train"], "eval_sequences": s["sequences"]["eval"],
            "train_tokens": s["tokens"]["train"],
            "documents": s["documents"], "parameters": s["parameters"]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prepare",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1, help="builds to time; the fastest is kept")
    p.add_argument("--sources", type=Path, default=DEFAULT_SOURCES)
    p.add_argument("--debian-docs", action="store_true")
    p.add_argument("--results", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    header = record("prepare", sys.argv[1:] if argv is None else argv)
    runs = [run_once(a.workers, a.sources, a.debian_docs) for _ in range(a.repeat)]
    best = min(runs, key=lambda r: r["total_s"])
    seq_per_s = (best["train_sequences"] + best["eval_sequences"]) / best["total_s"]
    print(f"{'phase':<18}{'seconds':>10}")
    for k in PHASES:
        print(f"{k:<18}{best['seconds'][k]:>10.2f}")
    print(f"{'total':<18}{best['total_s']:>10.2f}")
    print(f"train sequences {best['train_sequences']}, eval {best['eval_sequences']}, "
          f"{seq_per_s:,.0f} sequences/s")
    finish({**header,
            "build": f"python -m loaders.prepare --out TMP --workers {a.workers}"
                     + (" --debian-docs" if a.debian_docs else ""),
            "workers": a.workers, "repeat": a.repeat,
            "all_totals_s": [r["total_s"] for r in runs],
            "sequences_per_s": round(seq_per_s, 1), **best}, a.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
