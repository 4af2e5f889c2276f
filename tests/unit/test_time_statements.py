"""One true statement of every time: how long the edit loop (`make check`) and the whole suite
(`make test`) take is said in four places - README.md, pytest.ini, tests/conftest.py and
docs/DEVELOPING.md - and each says it with the same words, which are the medians of the runs
docs/benchmarks/test_suite_time.md records (its "quoted elsewhere" line names the runs)."""
from __future__ import annotations

import re
import statistics

from tests.support.launch import ROOT

RECORD = ROOT / "docs/benchmarks/test_suite_time.md"
QUOTED_IN = ("README.md", "pytest.ini", "tests/conftest.py", "docs/DEVELOPING.md")
LINE = re.compile(r"\*\*The figures quoted elsewhere\*\*: (?P<phrase>`make check` (?P<check>[\d.]+) s, "
                  r"`make test` (?P<test>\d+ m \d\d s) \(medians of 3 on the 2-core "
                  r"development machine, (?P<date>\d{4}-\d\d-\d\d)\))")


DURATION = re.compile(r"\b(?:about|under|~|in)\s*(?:a|an|one|\d+(?:\.\d+)?)\s*"
                      r"(?:minutes?|seconds?|min|s|m)\b")


def _flat(text: str) -> str:
    """Whitespace and comment leaders folded: a phrase may wrap in any of the four files."""
    text = re.sub(r"^\s*(#|\*(?=\s)|//)\s?", " ", text, flags=re.M)
    return " ".join(text.split())


def _seconds(cell: str) -> float:
    m = re.fullmatch(r"(\d+) m (\d+) s", cell.strip())
    return int(m[1]) * 60 + int(m[2]) if m else float(cell.strip().rstrip(" s"))


def _quoted():
    m = LINE.search(_flat(RECORD.read_text()))
    assert m, f"{RECORD.name}: no '**The figures quoted elsewhere**: ...' line in the form " \
              f"the other files quote"
    return m


def _rows(title: str, date: str) -> list[list[str]]:
    """The cells of the table under ``## title`` whose first cell starts with ``date`` and
    whose last names issue 68's medians."""
    text = RECORD.read_text()
    section = text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith(f"| {date}") and "median of 3" in line]


def test_the_quoted_figures_are_the_medians_of_the_recorded_runs():
    m = _quoted()
    checks = _rows("`make check`", m["date"])
    tests = _rows("Every recorded run, oldest first", m["date"])
    assert len(checks) == 3 and len(tests) == 3, (checks, tests)
    assert all(r[4] == "green" for r in tests), tests
    check = statistics.median(_seconds(r[3]) for r in checks)
    assert m["check"] == f"{check:.0f}", (m["check"], [r[3] for r in checks])
    test = statistics.median(_seconds(r[7]) for r in tests)
    assert _seconds(m["test"]) == test, (m["test"], [r[7] for r in tests])


def test_every_place_that_states_the_times_states_the_same_figures():
    phrase = _flat(_quoted()["phrase"])
    for name in QUOTED_IN:
        text = _flat((ROOT / name).read_text())
        assert phrase in text, f"{name}: does not quote {phrase!r} (the medians recorded " \
                               f"in {RECORD.relative_to(ROOT)})"
        # no second, different figure for the suite or a tier beside it
        rest = text.replace(phrase, "")
        for m in re.finditer(r"make test|make check|tests/unit|unit tier", rest):
            near = rest[m.end():m.end() + 120]
            other = DURATION.search(near)
            assert other is None, f"{name}: {m[0]!r} ... {other[0]!r}: a figure of its own " \
                                  f"beside the quoted ones ({near!r})"


def test_the_phrase_is_read_as_written():
    m = LINE.search("**The figures quoted elsewhere**: `make check` 21 s, `make test` 12 m 50 s "
                    "(medians of 3 on the 2-core development machine, 2026-12-06)")
    assert m and m["check"] == "21" and m["test"] == "12 m 50 s" and m["date"] == "2026-12-06"
    assert _seconds("12 m 05 s") == 725 and _seconds("20.85 s") == 20.85
    assert _flat("a\n# b\n   * c") == "a b c" and _flat("**x** y") == "**x** y"
    assert DURATION.search("takes about 2 minutes") and DURATION.search("under a minute")
    assert DURATION.search("(about 22 minutes on") and not DURATION.search("in two workers")
