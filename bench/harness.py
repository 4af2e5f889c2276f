"""The one shape of a ``python -m bench.X``: a benchmark is a ``Benchmark`` row - its options,
its cases and the function that measures one, the fields its record adds, its printed table
and its goals - and ``run(row, argv)`` does the rest, alike for every benchmark (as
bench/gpu/table.py's stage rows and bench/gpu/orchestrator.py do for the GPU stages):

1. the command line: argparse from the row's ``Option`` rows, ``--help``'s description the
   module docstring's first paragraph, the goals listed after the options; ``check`` refuses
   what argparse cannot (exit 2). An ``instead`` flag (a rank's ``--worker`` side, a
   ``--rescore``) runs its function in place of the benchmark; ``mode`` may pick another row
   of the same command line (bench.batch_scaling ``--calibrate``);
2. the record: bench.common.record's header, then ``fields(args)``;
3. the cases: ``cases(run)`` in order (a generator may look at the results so far), each
   measured by ``measure(run, case)`` - a result dict, or a list of them - kept in
   ``run.results`` (and in the record under ``results``, when the row names the key), its
   ``progress`` line printed; with ``partial`` the record is written after every case (an
   interrupted run keeps what it finished). ``setup(run)``, a context manager, holds what the
   cases share (a work folder, a reference run) in ``run.state``;
4. ``summary(run)``: the fields derived from the results (medians, ratios, verdicts);
5. the table (``table(record)``, text) printed, then each goal's verdict, recorded in the
   record's ``goals_met`` ({name: true, false or null - not measured});
6. bench.common.finish: the record at the output option, the final JSON line (``line``);
7. the exit status: 0 measured (a missed goal is a finding: the table and record say it);
   1 a gate goal missed (a run that had to succeed did not) or ``Stop(why, 1)``;
   2 refused before measuring: bad arguments, a missing test bed (``Stop(why, 2)``).

A new benchmark: its cases and measure function in bench/<name>.py, one ``Benchmark`` row
named ``BENCHMARK`` there, and ``def main(argv=None): return run(BENCHMARK, argv)``.

Owns: the command line's plumbing, the record's life (header, results, partial writes, the
final line), the printed verdicts and the exit status.
Never: measures anything, or imports torch (a benchmark's ``--help`` costs no torch import
here).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterable, Optional, Union

from bench.common import finish, fmt, record, write


class Stop(Exception):
    """The benchmark cannot go on: ``why`` is printed as ``bench.NAME: why`` and ``code`` is
    the exit status (2: refused before measuring - arguments, a missing test bed; 1: a run
    that had to succeed failed)."""

    def __init__(self, why: str, code: int = 1):
        super().__init__(why)
        self.code = code


@dataclass(frozen=True)
class Option:
    """One command-line option: argparse's flags and keywords."""

    flags: tuple[str, ...]
    kwargs: dict = field(default_factory=dict)


def option(*flags: str, **kwargs) -> Option:
    return Option(flags, kwargs)


def hidden(*flags: str, **kwargs) -> Option:
    """An option left out of ``--help``: a worker's, a test's."""
    return Option(flags, {**kwargs, "help": argparse.SUPPRESS})


def listed(choices: Optional[Iterable] = None, kind: Callable = str, what: str = "value"):
    """argparse ``type`` of a comma-separated list (``--modes a,b``): its items as ``kind``,
    each one of ``choices`` when given (else argparse refuses it, exit 2, naming the choices)."""
    allowed = None if choices is None else list(choices)

    def parse(text: str) -> list:
        try:
            items = [kind(x.strip()) for x in str(text).split(",") if x.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
        bad = [x for x in items if allowed is not None and x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {what}(s) {', '.join(map(str, bad))}; choose from "
                f"{', '.join(map(str, allowed))}")
        return items

    parse.__name__ = f"{what} list"
    return parse


# The options many benchmarks share, by one spelling.
SET = option("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
             help="a config override (repeatable)")
WORKDIR = option("--workdir", type=Path, default=None,
                 help="run directories and console logs (default: a dated folder under "
                      "results/)")
TIMEOUT = option("--timeout", type=float, default=None, help="seconds per run (default none)")


def seeds(default: str) -> Option:
    return option("--seeds", type=listed(kind=int, what="seed"), default=default,
                  help=f"comma-separated seeds (default {default})")


def out(default: Optional[Path], flag: str = "--out") -> Option:
    return option(flag, type=Path, default=default,
                  help="the JSON record" + (f" (default {_rel(default)})" if default else ""))


def _rel(path: Path) -> str:
    from bench.common import REPO
    try:
        return str(Path(path).relative_to(REPO))
    except ValueError:
        return str(path)


# ------------------------------------------------------------------------------------ rows

@dataclass(frozen=True)
class Goal:
    """A goal a benchmark's figures are held to: ``met(record)`` says met (True), missed
    (False) or not measured (None). A ``gate`` goal is no finding but a condition of the
    measurement itself (every run reached the target, the set resolves): missed, the exit
    status is 1."""

    name: str
    about: str
    met: Callable[[dict], Optional[bool]]
    gate: bool = False


@dataclass(frozen=True)
class Column:
    """A column of a printed table: its title, the row's value (a key or a function of the
    row) and its format spec ("-" for a missing value)."""

    title: str
    value: Union[str, Callable[[dict], Any]]
    spec: str = ""

    def cell(self, row: dict) -> str:
        v = row.get(self.value) if isinstance(self.value, str) else self.value(row)
        return fmt(v, self.spec)


def markdown(columns: Iterable[Column], rows: Iterable[dict]) -> str:
    """A markdown table, one line per row."""
    columns = list(columns)
    lines = ["| " + " | ".join(c.title for c in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(c.cell(r) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


@dataclass
class Run:
    """One call of a benchmark: its arguments, its record (grown as it runs), what the cases
    share (``state``, from ``setup``) and the results so far."""

    bench: "Benchmark"
    args: argparse.Namespace
    record: dict
    state: Any = None
    results: list = field(default_factory=list)

    @property
    def out(self) -> Optional[Path]:
        return getattr(self.args, self.bench.out_dest)

    def save(self) -> None:
        """The record as it stands, at the output path (when there is one)."""
        if self.out is not None:
            write(self.record, self.out)


Cases = Callable[[Run], Iterable]
Measure = Callable[[Run, Any], Union[dict, list]]


def _one_case(run: Run) -> Iterable:
    return (None,)


@dataclass(frozen=True)
class Benchmark:
    """A ``python -m bench.X``: what its command line takes, what it measures, what it
    records and prints, what it is held to."""

    name: str                               # the record's "benchmark"
    doc: str                                # the module docstring (--help: its first paragraph)
    measure: Measure                        # one case -> its result (a dict, or a list)
    cases: Cases = _one_case                # the cases, in order
    options: tuple[Option, ...] = ()
    fields: Callable[[argparse.Namespace], dict] = lambda args: {}   # the record's own fields
    setup: Optional[Callable[[Run], ContextManager]] = None  # what the cases share, held open
    results: Optional[str] = None           # the record's key for the results list
    progress: Optional[Callable[[Run, Any, dict], Optional[str]]] = None  # a line per result
    summary: Optional[Callable[[Run], Optional[dict]]] = None  # derived fields
    table: Optional[Callable[[dict], str]] = None              # the printed table
    goals: tuple[Goal, ...] = ()
    line: Union[None, tuple[str, ...], Callable[[dict], dict]] = None  # the final JSON line
    check: Optional[Callable[[argparse.Namespace], Optional[str]]] = None  # -> why refused
    #                                         (it may complete the arguments: a default that
    #                                         depends on others)
    instead: tuple[tuple[str, Callable[[argparse.Namespace], Optional[int]]], ...] = ()
    mode: Optional[Callable[[argparse.Namespace], Optional["Benchmark"]]] = None
    module: Optional[str] = None            # the command's module, when not bench.<name>
    out_dest: str = "out"                   # the option holding the record's path
    partial: bool = False                   # write the record after every case

    @property
    def command(self) -> str:
        return self.module or f"bench.{self.name}"


def parser(bench: Benchmark) -> argparse.ArgumentParser:
    """The command line of ``bench``: its options, its goals after them."""
    epilog = "\n".join(["goals:"] + [f"  {g.name}: {g.about}" + (" (exit 1 when missed)"
                                                               if g.gate else "")
                                     for g in bench.goals]) if bench.goals else None
    ap = argparse.ArgumentParser(prog=f"python -m {bench.command}",
                                 description=description(bench.doc), epilog=epilog,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for o in bench.options:
        ap.add_argument(*o.flags, **o.kwargs)
    for flag, _ in bench.instead:
        if not any(flag in o.flags for o in bench.options):
            ap.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    return ap


def description(doc: str) -> str:
    """The module docstring's first paragraph, as ``--help`` shows it."""
    return textwrap.fill(" ".join((doc or "").strip().split("\n\n")[0].split()), 92)


def run(bench: Benchmark, argv: Optional[list[str]] = None) -> int:
    """Parse, record, measure every case, summarise, print, hold to the goals: the exit
    status (module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = parser(bench)
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:       # --help (0), a bad option (2)
        return int(e.code or 0)
    for dest, fn in bench.instead:
        if getattr(args, dest.lstrip("-").replace("-", "_"), None):
            return fn(args) or 0
    bench = (bench.mode(args) if bench.mode else None) or bench
    why = bench.check(args) if bench.check else None
    if why:
        print(f"{ap.prog}: error: {why}", file=sys.stderr)
        return 2
    try:
        return _measure(bench, args, argv)
    except Stop as e:
        print(f"{bench.command}: {e}", file=sys.stderr, flush=True)
        return e.code


def _measure(bench: Benchmark, args, argv: list[str]) -> int:
    rec = record(bench.name, argv, module=bench.module, **bench.fields(args))
    r = Run(bench, args, rec)
    if bench.results:
        rec[bench.results] = r.results
    start = time.perf_counter()
    with (bench.setup(r) if bench.setup else contextlib.nullcontext()) as r.state:
        for case in bench.cases(r):
            got = bench.measure(r, case)
            for res in (got if isinstance(got, list) else [got]):
                r.results.append(res)
                line = bench.progress(r, case, res) if bench.progress else None
                if line:
                    print(line, flush=True)
            if bench.partial:
                r.save()
    if bench.summary:
        rec.update(bench.summary(r) or {})
    rec["wall_s"] = round(time.perf_counter() - start, 1)
    if bench.table:
        print(bench.table(rec), flush=True)
    verdicts = {g.name: _verdict(g.met(rec)) for g in bench.goals}
    if verdicts:
        rec["goals_met"] = verdicts
    for g in bench.goals:
        word = {True: "met", False: "MISSED", None: "not measured"}[verdicts[g.name]]
        print(f"goal {g.name} ({g.about}): {word}", flush=True)
    finish(rec, r.out, line=_line(bench, rec))
    return 1 if any(g.gate and verdicts[g.name] is False for g in bench.goals) else 0


def _verdict(met) -> Optional[bool]:
    return None if met is None else bool(met)


def _line(bench: Benchmark, rec: dict) -> Optional[dict]:
    if bench.line is None:
        return None
    if callable(bench.line):
        return bench.line(rec)
    return {k: rec[k] for k in ("benchmark", *bench.line) if k in rec}
