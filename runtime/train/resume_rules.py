"""What may change across a resume: one declared rule per config key.

A resumed run continues a checkpoint's weights, optimizer state, data position and MLPerf
log. A key whose change would make that continuation something else - another model shape,
an optimizer whose state means something else, another precision or data set or local batch,
another data order - must MATCH the checkpoint's value: a resume that changes it is refused
before any rank trains (exit 2), naming each key, both values and what to do. Every other key
may change and is RECORDed: the change is said on the console and written into the MLPerf
log's ``presto_resumed`` event and the ``resume`` record of metrics.jsonl.

Each key declares its rule on its field (runtime.config.sections: ``_doc(..., resume=MATCH,
why=...)``; the model's shape keys in runtime.model.config.BertConfig), or its section gives
all its keys one (``SystemConfig.RESUME``). Owns: ``RULES`` and ``SECTION_RULES``, derived from
those declarations (tests/unit/test_resume_rules.py checks that no key is left out, so a new
key must be given one), ``compare`` (a saved resolved config against this run's: the refused
keys and the recorded changes) and the refusal's text.
Never: reads checkpoints (runtime.train.checkpoint), logs, or decides what to resume.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from runtime.choices import MATCH, RECORD  # noqa: F401 - the rules' names, for readers
from runtime.config import SECTIONS, section_class


def _declared() -> tuple[dict[str, tuple[str, str]], dict[str, tuple[str, str]]]:
    """The rules the config declares: each key's own (its field's ``resume`` metadata,
    runtime.choices.key_field) and each section's that gives all its keys one (its
    ``RESUME``); a key in such a section with a rule of its own would have two."""
    keys, sections = {}, {}
    for section in SECTIONS:
        cls = section_class(section)
        shared = getattr(cls, "RESUME", None)
        if shared is not None:
            sections[section] = shared
        for f in fields(cls):
            if "resume" not in f.metadata:
                continue
            if shared is not None:
                raise TypeError(f"{section}.{f.name} declares a resume rule of its own in a "
                                f"section whose keys share one ({cls.__name__}.RESUME)")
            keys[f"{section}.{f.name}"] = f.metadata["resume"]
    return keys, sections


RULES, SECTION_RULES = _declared()
"""Each key's rule and why (``RULES``), and the sections whose keys share one (``[system]``:
where and how the ranks run, ``[submission]``: the MLPerf log's labels)."""


def rule(key: str) -> tuple[str, str]:
    """The rule of ``section.key`` and why; KeyError for a key no rule names."""
    if key in RULES:
        return RULES[key]
    return SECTION_RULES[key.split(".", 1)[0]]


@dataclass(frozen=True)
class Difference:
    key: str
    saved: Any
    now: Any
    why: str

    def text(self) -> str:
        return f"{self.key}: {self.saved!r} -> {self.now!r}"


def compare(saved: dict, now: dict) -> tuple[list[Difference], list[Difference]]:
    """(refused, recorded): the keys whose values differ between a checkpoint's resolved
    config ``saved`` and this run's ``now`` (both ``Config.to_dict()`` shapes), by rule. A
    key the checkpoint does not have (written before the key existed) is not compared."""
    refused, recorded = [], []
    for section, table in now.items():
        if not isinstance(table, dict):
            continue
        old_table = saved.get(section) or {}
        for key, value in table.items():
            if key not in old_table:
                continue
            old = old_table[key]
            if json.loads(json.dumps(value)) == old:
                continue
            name = f"{section}.{key}"
            kind, why = rule(name)
            (refused if kind == MATCH else recorded).append(Difference(name, old, value, why))
    return refused, recorded


def refusal(checkpoint: str, refused: list[Difference], run_dir: str) -> str:
    """The message of a refused resume: each key, both values and why, then what to do."""
    lines = [f"cannot resume from {checkpoint}: this run's config changes "
             f"{len(refused)} key(s) a resume must keep:"]
    lines += [f"  {d.key}: the checkpoint has {d.saved!r}, this run {d.now!r} ({d.why})"
              for d in refused]
    keep = " ".join(f"{d.key}={json.dumps(d.saved)}" for d in refused)
    lines.append(f"To continue this run, resume with the checkpoint's values ({keep}). To "
                 f"start afresh from its weights only, run in a new directory with "
                 f"model.init={checkpoint} (new optimizer state, schedule "
                 f"and data order; a new MLPerf log). Nothing was trained; {run_dir} is "
                 f"unchanged.")
    return "\n".join(lines)


def check(ck: Any, cfg: Any) -> list[str]:
    """A resume from checkpoint ``ck`` (runtime.train.checkpoint) by a run of ``cfg``:
    refused (ResumeRefused) when it changes a key that must match; else the changes that may
    happen, as text for the record (console, MLPerf log, metrics)."""
    from runtime.train.checkpoint import ResumeRefused
    saved = ck.train_state().get("progress", {}).get("config")
    if saved is None:
        return []
    refused, recorded = compare(json.loads(saved), cfg.to_dict())
    if refused:
        raise ResumeRefused(refusal(str(ck.path), refused, cfg.train.output_dir))
    return [d.text() for d in recorded]
