"""The search space of ``python -m submission hpo``: a TOML file of ``[params."section.key"]``
tables, checked against the config's own types and rules; values as the run's typed
``section.key=value`` overrides.

Owns: which keys a search may change, the file's fields (low/high with log or step, or
choices), every check of the file and of ``--enqueue`` settings (exit 2 naming the key), the
TOML form of a value.
Never: opens a study or runs anything; reads the config's types through runtime.config's
public accessors only.
"""
from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from runtime.config import ConfigError, key_type, load_config, read_toml_text
from submission.hpo.common import HpoError

# What a search may change: the optimizer and its schedule, the clip threshold, dropout.
# Not the batch (the search is for a batch), the target, the data or the system.
SEARCHABLE_SECTIONS = ("optim", "schedule")
SEARCHABLE_KEYS = ("train.max_grad_norm", "train.clip_mode", "model.hidden_dropout_prob",
                   "model.attention_probs_dropout_prob")
PARAM_FIELDS = {"low", "high", "log", "step", "choices"}


@dataclass(frozen=True)
class Param:
    """One searched config key: a float or int range (``log``: sampled on a log scale;
    ``step``: a grid) or a list of choices."""

    key: str
    kind: str                      # "float" | "int" | "categorical"
    low: Optional[float] = None
    high: Optional[float] = None
    log: bool = False
    step: Optional[float] = None
    choices: tuple = ()

    def suggest(self, trial) -> Any:
        if self.kind == "categorical":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), log=self.log,
                                     step=int(self.step or 1))
        return trial.suggest_float(self.key, self.low, self.high, log=self.log, step=self.step)

    def contains(self, value: Any) -> bool:
        if self.kind == "categorical":
            return value in self.choices
        return isinstance(value, (int, float)) and not isinstance(value, bool) \
            and self.low <= value <= self.high


def _field_kind(key: str) -> str:
    hint = str(key_type(key))
    if "Literal" in hint or hint in ("<class 'str'>", "<class 'bool'>"):
        return "categorical"
    if "float" in hint:
        return "float"
    if "int" in hint:
        return "int"
    return "categorical"


def load_space(path: str | Path, config: str | Path, overrides: list[str]) -> list[Param]:
    """The search space file, checked: every key a searchable config key, every range
    non-empty, log scales positive, every bound and choice a value the config accepts."""
    path = Path(path)
    try:
        data = tomllib.loads(read_toml_text(path))
    except FileNotFoundError:
        raise HpoError(f"search space {path} does not exist (see docs/HPO.md for its format)") \
            from None
    except (OSError, ConfigError, tomllib.TOMLDecodeError) as e:
        raise HpoError(f"search space {path}: not a readable TOML file ({e})") from None
    extra = set(data) - {"params"}
    if extra:
        raise HpoError(f"search space {path}: unknown table(s) {sorted(extra)}; the file holds "
                       f"[params.\"section.key\"] tables only")
    table = data.get("params")
    if not isinstance(table, dict) or not table:
        raise HpoError(f"search space {path}: no [params.\"section.key\"] table: name at least "
                       f"one config key to search, e.g. [params.\"optim.lr\"] low = 1e-4, "
                       f"high = 1e-2, log = true")
    params = []
    for key, spec in table.items():
        where = f"search space {path}: [params.\"{key}\"]"
        section, dot, _ = key.partition(".")
        if not dot or not isinstance(spec, dict):
            raise HpoError(f"{where}: each entry is a table named by a config key "
                           f"\"section.key\" (e.g. [params.\"optim.lr\"])")
        try:
            key_type(key)
        except ConfigError:
            raise HpoError(f"{where}: unknown config key {key} (python -m runtime.config "
                           f"--help-keys lists them)") from None
        if section not in SEARCHABLE_SECTIONS and key not in SEARCHABLE_KEYS:
            raise HpoError(f"{where}: {key} is not searched here - a search may change the "
                           f"[optim] and [schedule] keys and {', '.join(SEARCHABLE_KEYS)}; set "
                           f"other keys with --set (the batch, target and data are the study's)")
        unknown = set(spec) - PARAM_FIELDS
        if unknown:
            raise HpoError(f"{where}: unknown field(s) {sorted(unknown)}; use low/high "
                           f"(with log or step) or choices")
        kind = _field_kind(key)
        if "choices" in spec:
            if set(spec) - {"choices"}:
                raise HpoError(f"{where}: give either choices or low/high, not both")
            choices = spec["choices"]
            if not isinstance(choices, list) or not choices:
                raise HpoError(f"{where}: choices is empty: list at least one value")
            param = Param(key, "categorical", choices=tuple(choices))
            values = list(choices)
        else:
            if kind == "categorical":
                raise HpoError(f"{where}: {key} takes one of a set of values: give choices = "
                               f"[...], not a range")
            if "low" not in spec or "high" not in spec:
                raise HpoError(f"{where}: a range needs both low and high")
            low, high = spec["low"], spec["high"]
            for what, v in (("low", low), ("high", high), ("step", spec.get("step", 1))):
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                    raise HpoError(f"{where}: {what} = {v!r} is not a finite number")
            if kind == "int" and not all(isinstance(v, int) for v in (low, high)):
                raise HpoError(f"{where}: {key} is an integer: low and high must be integers")
            if not low < high:
                raise HpoError(f"{where}: the range [{low}, {high}] is empty (low must be below "
                               f"high; to fix a value, use --set {key}=VALUE)")
            log = spec.get("log", False)
            if not isinstance(log, bool):
                raise HpoError(f"{where}: log = {log!r} must be true or false")
            if log and low <= 0:
                raise HpoError(f"{where}: a log scale needs low > 0 (low = {low})")
            step = spec.get("step")
            if step is not None and (step <= 0 or log):
                raise HpoError(f"{where}: step = {step!r} must be > 0, and not with log = true")
            param = Param(key, kind, float(low) if kind == "float" else low,
                          float(high) if kind == "float" else high, log, step)
            values = [low, high]
        for v in values:  # every bound and choice must be a value this config accepts
            try:
                load_config(config, [*overrides, f"{key}={toml_literal(v)}"])
            except ConfigError as e:
                raise HpoError(f"{where}: {v!r} is not a value the config accepts ({e})") \
                    from None
        params.append(param)
    return params


def toml_literal(value: Any) -> str:
    """A Python value as a TOML literal, for a ``section.key=value`` argument or a file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise HpoError(f"{value!r} has no TOML form")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_literal(v) for v in value) + "]"
    raise HpoError(f"{value!r} ({type(value).__name__}) has no TOML form")


def trial_overrides(params: dict) -> list[str]:
    """A trial's parameters as the run's typed overrides, one argument each."""
    return [f"{k}={toml_literal(v)}" for k, v in sorted(params.items())]


def parse_enqueue(texts: list[str], params: list[Param]) -> list[dict]:
    """The ``--enqueue K=V[,K=V...]`` settings: each key a searched one, each value inside the
    space (exit 2 naming the setting otherwise)."""
    out = []
    by_key = {p.key: p for p in params}
    for text in texts:
        if "\n" in text or "\r" in text:
            raise HpoError(f"--enqueue {text!r} holds a line break: one setting per --enqueue, "
                           f"its keys separated by commas")
        values = {}
        for item in text.split(","):
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or key not in by_key:
                raise HpoError(f"--enqueue {text!r}: {key!r} is not a searched key "
                               f"({', '.join(by_key)})")
            try:
                value = tomllib.loads(f"v = {raw}")["v"]
            except tomllib.TOMLDecodeError:
                value = raw
            if by_key[key].kind == "float" and isinstance(value, int):
                value = float(value)
            if not by_key[key].contains(value):
                raise HpoError(f"--enqueue {text!r}: {key}={value!r} is outside the search "
                               f"space")
            values[key] = value
        out.append(values)
    return out
