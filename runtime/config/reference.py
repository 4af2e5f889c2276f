"""The keys' reference, written from the typed config itself: ``--help-keys`` (the terminal's
listing, wrapped) and docs/CONFIG.md (``python -m runtime.config --reference``, markdown).

Owns: turning each section's dataclass fields - type, default, docstring and resume rule
(runtime.choices.key_field) - into text. Never: a rule about a key (the sections hold them),
or text typed twice: both forms read the same fields, and tests/unit/test_config_reference.py
holds docs/CONFIG.md equal to what this writes.
"""
from __future__ import annotations

import textwrap
import typing
from dataclasses import MISSING, fields

from runtime.choices import MATCH
from runtime.config.run import SECTIONS, Config, section_class

WIDTH = 96
PAGE_HEAD = """\
# Config keys: the reference

Generated from the typed config (runtime/config/sections.py, runtime/config/system.py) by
`python -m runtime.config --reference > docs/CONFIG.md`; a test holds this page equal to what
that writes, so edit the fields' docstrings, not this page. The terminal's form:
`python -m runtime.config --help-keys`. A config is one TOML file of these sections
(`submission/configs/config_<SYSTEM>_<nodes>x<ranks>x<batch>x<accum>.toml`); any key is
overridden with `section.key=value` after `run_and_time.sh --` (or `--set` of `python -m
submission` and `python -m runtime.config`). What checks a key against another (a global
batch that ranks x accumulation divide, bf16 on a CPU...) runs when a config is loaded, on
every rank before anything trains: the error names the key and the fix.

**On a resume** (docs/RESILIENCE.md) each key has a rule: *must match* - a change is refused
(exit 2), because the checkpoint's weights, optimizer state or data position would mean
something else - or *may change* - the change is accepted and recorded in the MLPerf log's
`presto_resumed` and the metrics' `resume` record (docs/METRICS.md).
"""


def _type_text(tp) -> str:
    """A field's type in words: a Literal's choices, else the type's name."""
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + ", ".join(f"`{a!r}`" for a in typing.get_args(tp))
    name = getattr(tp, "__name__", None) if typing.get_origin(tp) is None else None
    return f"type `{name or str(tp).replace('typing.', '')}`"


def _default(f, obj) -> str:
    return repr(getattr(obj, f.name)) if f.default is not MISSING or \
        f.default_factory is not MISSING else "(required)"


def _resume(cls, f) -> str:
    rule, why = f.metadata.get("resume") or getattr(cls, "RESUME", (None, ""))
    if rule is None:
        return ""
    return ("must match the checkpoint" if rule == MATCH else "may change") + \
        (f" ({why})" if why else "")


def _section_doc(obj) -> str:
    return " ".join(type(obj).__doc__.split())


def help_keys() -> str:
    """Every key with its default and docstring, wrapped for a terminal."""
    lines = []
    defaults = Config()
    for section in SECTIONS:
        obj = getattr(defaults, section)
        lines += textwrap.wrap(f"[{section}]  {_section_doc(obj)}", WIDTH,
                               subsequent_indent="    ")
        for f in fields(obj):
            lines.append(f"  {f.name} = {getattr(obj, f.name)!r}")
            lines += textwrap.wrap(" ".join(f.metadata.get("doc", "").split()), WIDTH,
                                   initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def markdown() -> str:
    """docs/CONFIG.md: every section and key - type or choices, default, resume rule, doc."""
    out = [PAGE_HEAD]
    defaults = Config()
    for section in SECTIONS:
        obj, cls = getattr(defaults, section), section_class(section)
        hints = typing.get_type_hints(cls)
        out.append(f"## [{section}]\n")
        out.append(textwrap.fill(_section_doc(obj), WIDTH) + "\n")
        for f in fields(obj):
            out.append(f"### `{section}.{f.name}`\n")
            facts = [f"{_type_text(hints[f.name])}", f"default `{_default(f, obj)}`"]
            resume = _resume(cls, f)
            if resume:
                facts.append(f"on a resume: {resume}")
            out.append(textwrap.fill("; ".join(facts) + ".", WIDTH) + "\n")
            doc = " ".join(f.metadata.get("doc", "").split())
            if doc:
                out.append(textwrap.fill(doc, WIDTH, break_on_hyphens=False) + "\n")
    return "\n".join(out).rstrip("\n") + "\n"
