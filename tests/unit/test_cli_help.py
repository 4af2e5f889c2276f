"""Every ``python -m`` entry point of the repository says in whole sentences what it does: its
``--help`` description (and each subcommand's) starts like a sentence and ends with one,
instead of the first line of a docstring cut mid-sentence ("... follow them, score them,").

The entry points are found, not listed: every module under bench/, loaders/, runtime/ and
submission/ with an ``if __name__ == "__main__":`` block, and every package with a
``__main__.py``. Each runs in this process as ``python -m MODULE --help`` would, up to the
moment it parses its arguments: the parser it built is taken there, nothing else runs.
"""
from __future__ import annotations

import argparse
import os
import re
import runpy
import signal
import sys
import warnings
from pathlib import Path

import pytest

from tests.support.launch import ROOT

PACKAGES = ("bench", "loaders", "runtime", "submission")
MAIN = re.compile(r"^if __name__ == .__main__.:", re.M)
# A sentence: starts with a capital, a quote or code; ends with . ? or ! (a closing bracket,
# quote or code mark may follow).
STARTS = re.compile(r"^[A-Z`\"'(]")
ENDS = re.compile(r"[.?!][)\"'`]*$")

# Entry points in files that another change owns right now; each must be fixed there.
PENDING: dict[str, str] = {}


def entry_points() -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            if path.name == "__main__.py":
                found.append(".".join(rel.parts[:-1]))
            elif MAIN.search(path.read_text()):
                found.append(".".join(rel.parts))
    return sorted(set(found))


class _Parsed(Exception):
    def __init__(self, parser):
        self.parser = parser


def parser_of(module: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser ``python -m module --help`` builds, caught where it would parse."""
    def caught(self, *args, **kwargs):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", caught)
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP,
                                                 signal.SIGUSR1)}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])   # runtime.launch.signals blocks them
    environ = dict(os.environ)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # "found in sys.modules"
            runpy.run_module(module, run_name="__main__", alter_sys=False)
    except _Parsed as got:
        return got.parser
    finally:   # what a module's main block changes in this process before it parses
        for s, h in handlers.items():
            signal.signal(s, h)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        os.environ.clear()
        os.environ.update(environ)
    pytest.fail(f"python -m {module} --help built no argparse parser")


def sentence_problem(text: str | None) -> str | None:
    words = " ".join((text or "").split())
    if not words:
        return "no description"
    if not STARTS.match(words):
        return f"does not start like a sentence: {words[:60]!r}"
    if not ENDS.search(words):
        return f"does not end like a sentence: ...{words[-60:]!r}"
    return None


def test_the_entry_points_are_found():
    found = entry_points()
    for module in ("submission", "submission.train", "runtime.train.memory", "bench.shard",
                   "runtime.calibrate.tune", "loaders.prepare", "bench.gpu"):
        assert module in found
    assert len(found) >= 25, found


@pytest.mark.parametrize("module", [
    pytest.param(m, marks=pytest.mark.xfail(reason=PENDING[m], strict=True)) if m in PENDING
    else m for m in entry_points()])
def test_every_help_description_is_whole_sentences(module, monkeypatch):
    parser = parser_of(module, monkeypatch)
    problems = []
    if why := sentence_problem(parser.description):
        problems.append(f"python -m {module} --help: {why}")
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if why := sentence_problem(sub.description):
                    problems.append(f"python -m {module} {name} --help: {why}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text,ok", [
    ("Will a run fit? An estimate of one rank's memory, checked against what the node has.",
     True),
    ("``python -m submission``: submit experiments to Slurm, follow them, score them,", False),
    ("the job's exit status from its ranks' status files", False),
    ("An estimate of one rank's memory from the config, checked against what the", False),
    ("The launchers in words (submission/launchers.py).", True),
])
def test_the_sentence_rule(text, ok):
    assert (sentence_problem(text) is None) is ok
