"""The keys' reference (runtime.config.reference): docs/CONFIG.md is what ``python -m
runtime.config --reference`` writes from the typed config - every key, its choices, default,
resume rule and docstring - and ``--help-keys`` is wrapped for a terminal."""
from __future__ import annotations

import re
import typing
from dataclasses import fields

from runtime.config import SECTIONS, section_class
from runtime.config.__main__ import main
from runtime.config.reference import WIDTH, help_keys, markdown
from tests.support.launch import ROOT

PAGE = ROOT / "docs" / "CONFIG.md"


def test_the_config_page_is_current():
    """Regenerate with `python -m runtime.config --reference > docs/CONFIG.md` when it fails."""
    assert PAGE.read_text() == markdown(), \
        "docs/CONFIG.md is stale: python -m runtime.config --reference > docs/CONFIG.md"


def test_every_key_is_on_the_page_with_its_choices_and_resume_rule():
    text = markdown()
    heads = re.findall(r"^### `(\w+)\.(\w+)`$", text, re.M)
    want = [(s, f.name) for s in SECTIONS for f in fields(section_class(s))]
    assert heads == want
    for section, key in want:
        entry = " ".join(text.split(f"### `{section}.{key}`\n", 1)[1].split("\n### ", 1)[0]
                         .split())
        tp = typing.get_type_hints(section_class(section))[key]
        for choice in typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else ():
            assert f"`{choice!r}`" in entry, (section, key, choice)
        assert "on a resume: must match" in entry or "on a resume: may change" in entry, key
    assert all(len(line) <= WIDTH for line in text.splitlines()
               if not line.startswith(("`", "(`"))), "wrapped at 96 columns"


def test_help_keys_is_wrapped_and_the_command_prints_both(capsys):
    text = help_keys()
    assert max(len(line) for line in text.splitlines()) <= WIDTH + 1   # one '§' wide
    assert "  precision = 'fp32'" in text
    assert main(["--reference"]) == 0 and capsys.readouterr().out == markdown()
    assert main(["--help-keys"]) == 0 and capsys.readouterr().out == text + "\n"
