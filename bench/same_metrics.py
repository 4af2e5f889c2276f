"""``python -m bench.same_metrics A B``: whether two runs' metrics.jsonl hold the same records,
every field but the ones measured on a clock - the check a refactor that must not change
behaviour passes ("every metrics record bitwise equal before and after").

Owns: the list of clock fields (``CLOCK``: wall and device times, and what is divided by them)
and the comparison, record by record, value by value (floats by their exact bits: JSON keeps
Python's shortest round-trip repr, so equal text is equal bits). Never: runs anything (run the
two commits with the same command and SEED first; docs/DEVELOPING.md has the recipe).

Exit 0 when every record matches, 1 when one differs (the first differences printed), 2 when a
file is missing or unreadable.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from runtime.observe.metrics import read_records

CLOCK = frozenset({
    "time_s", "step_time_s", "device_step_s", "compute_s_max", "compute_s_mean", "load_s_max",
    "elapsed_s", "tflops", "mfu", "imbalance_compute", "samples_per_s", "tokens_per_s",
    "eval_time_s", "throughput", "mfu_fp8"})
"""Fields measured on a clock (or divided by one): they differ from run to run by design."""


def records(path: Path) -> list[dict]:
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    try:   # older files' fields under today's names: a run before a rename compares equal
        return read_records(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"same_metrics: {path}: cannot read it ({e})") from None


def differences(a: list[dict], b: list[dict]) -> list[str]:
    """What differs between two runs' records, clock fields aside (empty: the same)."""
    out = []
    if len(a) != len(b):
        out.append(f"{len(a)} records against {len(b)}")
    for i, (x, y) in enumerate(zip(a, b)):
        for key in sorted((set(x) | set(y)) - CLOCK):
            if json.dumps(x.get(key)) != json.dumps(y.get(key)):
                out.append(f"record {i} ({x.get('kind')} step {x.get('step')}): {key} "
                           f"{x.get(key)!r} against {y.get(key)!r}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.same_metrics", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("a", type=Path, help="a run directory or its metrics.jsonl")
    p.add_argument("b", type=Path)
    args = p.parse_args(argv)
    try:
        a, b = records(args.a), records(args.b)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    diff = differences(a, b)
    fields = sorted({k for r in a for k in r} - CLOCK)
    if diff:
        print(f"DIFFERENT: {len(diff)} difference(s); the first:\n  " + "\n  ".join(diff[:20]))
        return 1
    print(f"SAME: {len(a)} records, {len(fields)} fields each compared exactly "
          f"(clock fields aside: {', '.join(sorted(CLOCK & {k for r in a for k in r}))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
