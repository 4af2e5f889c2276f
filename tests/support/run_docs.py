"""What the docs say a run writes, as data: docs/METRICS.md's fields per kind of metrics.jsonl
record, and the README's table of a run directory's entries - and what a run wrote that they
do not list.

``undocumented(records)`` is what the tests that write a metrics file call (the one-process
runs of tests/integration/test_balance_metrics.py and test_buckets_integration.py, the 2-rank
resumed run of tests/e2e/test_resume_e2e.py): a field a run writes must be on the page.
``unlisted(run_dir)`` the same for the entries of a run directory (the walkthrough's runs,
the resumed run with its checkpoints).
"""
from __future__ import annotations

import re
from pathlib import Path

from tests.support.launch import ROOT

PAGE = ROOT / "docs" / "METRICS.md"
README = ROOT / "README.md"


def documented(page: Path = PAGE) -> dict[str, set[str]]:
    """kind -> the fields its table rows name (a row's first cell: `a`, `b`)."""
    out: dict[str, set[str]] = {}
    kind = None
    for line in page.read_text().splitlines():
        head = re.match(r"^## `(\w+)` records", line)
        if head:
            kind = head.group(1)
            out.setdefault(kind, set())
        elif line.startswith("## "):
            kind = None
        elif kind and line.startswith("| `"):
            out[kind].update(re.findall(r"`(\w+)`", line.split("|")[1]))
    return out


def undocumented(records: list[dict], page: Path = PAGE) -> list[str]:
    """'kind.field' for every field of ``records`` the page does not list (empty: all are)."""
    docs = documented(page)
    return sorted({f"{r['kind']}.{k}" for r in records for k in r
                   if k not in docs.get(r["kind"], set())})


def listed(readme: Path = README) -> str:
    """The README's table of a run directory's entries (first cells, then the rest)."""
    text = readme.read_text().split("Outputs of a run", 1)[1]
    rows = [line for line in text.splitlines()[:40] if line.startswith("| `")]
    return "\n".join(rows)


def unlisted(run_dir: Path, readme: Path = README) -> list[str]:
    """The entries of ``run_dir`` - and of its ranks/, numbers as ``<r>`` - that the README's
    table does not name (empty: all are)."""
    table = listed(readme)
    firsts = {c for row in table.splitlines() for c in re.findall(r"`([^`]+)`",
                                                                  row.split("|")[1])}
    out = [p.name + ("/" if p.is_dir() else "") for p in run_dir.iterdir()
           if p.name + ("/" if p.is_dir() else "") not in firsts and f"`{p.name}" not in table]
    if (run_dir / "ranks").is_dir():
        out += [f"ranks/{p.name}" for p in (run_dir / "ranks").iterdir()
                if f"`{re.sub(r'[0-9]+', '<r>', p.name)}`" not in table
                and f"`{p.name}`" not in table]
    return sorted(out)
