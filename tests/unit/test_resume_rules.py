"""The resume rules (runtime.train.resume_rules, derived from the config's fields): every config
key has one declared rule, and each rule does what it says - a MATCH key that differs from the
checkpoint's is refused with both values and what to do, a RECORD key is accepted and listed.
The end-to-end refusals (the optimizer swapped for AdamW or LARS on a LAMB checkpoint) are in
tests/e2e/test_resume_e2e.py."""
from __future__ import annotations

import copy
from dataclasses import fields

import pytest

from runtime.config import Config, load_config
from runtime.train import resume_rules as rr
from tests.support.runs import CPU_CONFIG

ALL_KEYS = [f"{s}.{f.name}" for s in ("model", "data", "optim", "schedule", "train", "system",
                                      "submission") for f in fields(getattr(Config(), s))]


def test_every_config_key_has_exactly_one_rule():
    missing = [k for k in ALL_KEYS if k.split(".")[0] not in rr.SECTION_RULES
               and k not in rr.RULES]
    assert not missing, (f"keys without a resume rule (declare one on the field: "
                         f"_doc(..., resume=MATCH or RECORD, why=...)): {missing}")
    stale = [k for k in rr.RULES if k not in ALL_KEYS]
    assert not stale, f"rules for keys the config no longer has: {stale}"
    both = [k for k in rr.RULES if k.split(".")[0] in rr.SECTION_RULES]
    assert not both, f"keys with their own rule and their section's: {both}"
    assert {r for r, _ in rr.RULES.values()} | {r for r, _ in rr.SECTION_RULES.values()} \
        == {rr.MATCH, rr.RECORD}


def _changed(cfg_dict: dict, key: str) -> dict:
    """``cfg_dict`` with ``key`` given some other value of its type."""
    out = copy.deepcopy(cfg_dict)
    section, name = key.split(".")
    v = out[section][name]
    if isinstance(v, bool):
        nv = not v
    elif isinstance(v, (int, float)):
        nv = v + 1 if isinstance(v, int) else v * 0.5 + 0.001
    elif isinstance(v, str):
        nv = v + "_other"
    elif isinstance(v, list):
        nv = v + [999]
    else:
        nv = 0.5
    out[section][name] = nv
    return out


@pytest.mark.parametrize("key", ALL_KEYS)
def test_each_rule_refuses_or_records_its_key(key):
    saved = load_config(CPU_CONFIG).to_dict()
    now = _changed(saved, key)
    refused, recorded = rr.compare(saved, now)
    kind, why = rr.rule(key)
    assert [d.key for d in (refused if kind == rr.MATCH else recorded)] == [key]
    assert not (recorded if kind == rr.MATCH else refused)
    d = (refused or recorded)[0]
    assert d.saved == saved[key.split(".")[0]][key.split(".")[1]] and d.why == why


def test_the_optimizer_swap_is_refused_with_both_values_and_what_to_do():
    saved = load_config(CPU_CONFIG).to_dict()
    for other in ("adamw", "lars"):
        now = load_config(CPU_CONFIG, [f"optim.name={other}", "optim.lr=0.002",
                                       "train.eval_iter_samples=640"]).to_dict()
        refused, recorded = rr.compare(saved, now)
        assert [d.key for d in refused] == ["optim.name"]
        assert sorted(d.key for d in recorded) == ["optim.lr", "train.eval_iter_samples"]
        text = rr.refusal("/r/checkpoints/step_000035", refused, "/r")
        assert f"optim.name: the checkpoint has 'lamb', this run '{other}'" in text
        assert 'resume with the checkpoint\'s values (optim.name="lamb")' in text
        assert "model.init=/r/checkpoints/step_000035" in text and "/r is unchanged" in text


def test_a_key_the_checkpoint_predates_is_not_compared():
    saved = load_config(CPU_CONFIG).to_dict()
    del saved["train"]["max_nonfinite_steps"]
    now = _changed(load_config(CPU_CONFIG).to_dict(), "train.max_nonfinite_steps")
    assert rr.compare(saved, now) == ([], [])


def test_resiliences_resume_table_says_each_keys_declared_rule():
    """docs/RESILIENCE.md, "What a resume keeps": the keys a precision or speed change
    touches - train.precision, model.fp8, model.compile - each with what a resume that changes
    it does, as their fields declare it (the probe's B7: no doc named train.precision as a key a
    resume must keep)."""
    import re
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "docs" / "RESILIENCE.md").read_text()
    table = text.split("### What a resume keeps", 1)[1].split("\n\n")[2]
    rows = re.findall(r"^\| `([\w.]+)` \| (must match|may change)\b", table, re.M)
    said = {key: "match" if how == "must match" else "record" for key, how in rows}
    assert {"train.precision", "model.fp8", "model.compile"} <= set(said), table
    assert said == {key: rr.rule(key)[0] for key in said}
