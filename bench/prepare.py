"""``python -m bench.prepare``: time a full default data-set build.

Builds the default set (``python -m loaders.prepare`` defaults, ``--workers 2`` unless told
otherwise) into a temporary directory, prints seconds per phase and sequences/s, then one
JSON line; the same record goes to ``bench/results/prepare.json``. The build is removed
afterwards. Not a test: it measures, on whatever machine runs it.

    python -m bench.prepare                 # default set, 2 workers
    python -m bench.prepare --workers 1 --repeat 2
"""
from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import Benchmark, option, out, run
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


def summary(r) -> dict:
    """The fastest build, its rate, how it was run."""
    a = r.args
    best = min(r.results, key=lambda x: x["total_s"])
    return {"build": f"python -m loaders.prepare --out TMP --workers {a.workers}"
                     + (" --debian-docs" if a.debian_docs else ""),
            "workers": a.workers, "repeat": a.repeat,
            "all_totals_s": [x["total_s"] for x in r.results],
            "sequences_per_s": round((best["train_sequences"] + best["eval_sequences"])
                                     / best["total_s"], 1), **best}


def table(rec: dict) -> str:
    lines = [f"{'phase':<18}{'seconds':>10}"]
    lines += [f"{k:<18}{rec['seconds'][k]:>10.2f}" for k in PHASES]
    lines.append(f"{'total':<18}{rec['total_s']:>10.2f}")
    lines.append(f"train sequences {rec['train_sequences']}, eval {rec['eval_sequences']}, "
                 f"{rec['sequences_per_s']:,.0f} sequences/s")
    return "\n".join(lines)


BENCHMARK = Benchmark(
    "prepare", __doc__,
    lambda r, k: run_once(r.args.workers, r.args.sources, r.args.debian_docs),
    cases=lambda r: range(r.args.repeat),
    options=(option("--workers", type=int, default=2),
             option("--repeat", type=int, default=1,
                    help="builds to time; the fastest is kept"),
             option("--sources", type=Path, default=DEFAULT_SOURCES),
             option("--debian-docs", action="store_true"),
             out(RESULTS, "--results")),
    out_dest="results", summary=summary, table=table)


def main(argv=None) -> int:
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
