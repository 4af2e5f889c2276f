"""Reading a run's config: a TOML file, ``section.key=value`` overrides, key types.

Owns: ``load_config`` (defaults, then the file, then the overrides, then ``model.size``'s
shape, then validation - and the keys every file must name), the file's text
(``read_toml_text``: UTF-8, a byte-order mark dropped), each value checked against its key's
type as it is read (``_coerce``; an unknown section or key gets "did you mean"), the override
form (``parse_override``) and ``key_type`` for tools that check values without building a
config (submission.hpo's search space).
Never: holds a rule about a key's value (runtime.config.sections and checks do), or reads the
launcher's environment.
"""
from __future__ import annotations

import difflib
import tomllib
from pathlib import Path
from typing import Any, Literal, get_origin

from runtime.choices import ConfigError
from runtime.config.checks import check_choice
from runtime.config.run import SECTIONS, Config, section_types


def key_type(key: str) -> Any:
    """The declared type of the config key ``section.key`` (its field's type hint: ``float``,
    ``Optional[int]``, a ``Literal`` of choices ...), for tools that check values against
    the config without building one (submission.hpo's search space); ConfigError for a name
    that is not a key."""
    section, dot, name = key.partition(".")
    types = section_types(section) if dot and section in SECTIONS else {}
    if name not in types:
        raise ConfigError(f"unknown key {key} (python -m runtime.config --help-keys lists them)")
    return types[name]


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check a TOML value against the field's type; ints are accepted for floats."""
    if get_origin(hint) is Literal:
        check_choice(key, value, hint)
        return value
    text = str(hint)
    optional = "None" in text
    if value is None or (optional and value == "none"):
        if optional:
            return None
        raise ConfigError(f"{key} may not be empty")
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int or (optional and "int" in text and "float" not in text):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float or (optional and "float" in text):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif text == "list[int]":
        if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                           for v in value):
            return value
    elif text == "list[str]":
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return value
    raise ConfigError(f"{key} = {value!r} has the wrong type; expected {text}")


def _apply(cfg: Config, section: str, key: str, value: Any, where: str) -> None:
    if section not in SECTIONS:
        near = difflib.get_close_matches(section, SECTIONS, 1)
        hint = f"; did you mean [{near[0]}]?" if near else f"; sections are {SECTIONS}"
        raise ConfigError(f"{where}: unknown section [{section}]{hint}")
    types = section_types(section)
    if key not in types:
        near = difflib.get_close_matches(key, list(types), 1)
        hint = f"; did you mean {section}.{near[0]}?" if near else ""
        raise ConfigError(f"{where}: unknown key {section}.{key}{hint} "
                          f"(python -m runtime.config --help-keys lists them)")
    setattr(getattr(cfg, section), key, _coerce(f"{section}.{key}", value, types[key]))


def parse_override(text: str) -> tuple[str, str, Any]:
    """A ``section.key=value`` argument as (section, key, value): the value read as TOML, a
    bare word as a string. Checks the form only; load_config checks the key and the value."""
    if "\n" in text or "\r" in text:   # TOML would read the rest as more lines, and drop it
        raise ConfigError(f"override {text!r} holds a line break: give each section.key=value "
                          f"as its own argument (a string value with a line break: \"...\\n...\")")
    name, sep, raw = text.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare strings need no quotes on the command line
    return section, key, value


def read_toml_text(path: str | Path) -> str:
    """A TOML file's text: UTF-8 (else ConfigError naming the byte and line), a leading
    byte-order mark dropped (Windows editors write one; TOML's grammar has none)."""
    path = Path(path)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} on line "
                          f"{line}): TOML files are UTF-8 - save it as UTF-8 (iconv -t "
                          f"UTF-8), or check that this is the config you meant") from None
    return text.removeprefix("\ufeff")


# Keys every config file must name (here or in an override): the defaults are BERT-base at
# a global batch of 448, which no file means and which a small node cannot hold.
REQUIRED_IN_A_FILE = ("model.hidden_size", "model.num_hidden_layers",
                      "model.num_attention_heads", "model.intermediate_size",
                      "train.global_batch_size")


def _apply_size(cfg: Config, named: set) -> None:
    """model.size: the named shape's keys (basis.model_shape.SIZES); one of them set
    beside it to another value is refused, naming both."""
    m = cfg.model
    if not m.size:
        return
    from basis.model_shape import SHAPE_KEYS, sized
    try:
        shape = sized(m.size, {k: getattr(m, k) for k in SHAPE_KEYS if f"model.{k}" in named})
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for key, value in shape.items():
        setattr(m, key, value)
    named |= {f"model.{k}" for k in shape}


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Read a TOML config (or defaults), apply ``section.key=value`` overrides, validate."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        text = read_toml_text(path)
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({e})") from e
        if not data:
            raise ConfigError(f"{path}: the file sets nothing (empty, or only comments). An "
                              f"empty config would train with every default - BERT-base, a "
                              f"global batch of 448 - which is never what a file was meant "
                              f"for: start from submission/configs/config_CPU_1x2x32x1.toml")
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: top-level key {section!r} must be a [section]")
            for key, value in table.items():
                _apply(cfg, section, key, value, str(path))
        cfg.source = str(path)
    named = set()
    for text in overrides:
        section, key, value = parse_override(text)
        _apply(cfg, section, key, value, "override")
        named.add(f"{section}.{key}")
    if path is not None:
        named |= {f"{s}.{k}" for s, t in data.items() for k in t}
    _apply_size(cfg, named)
    cfg.validate()
    if path is not None:
        missing = [k for k in REQUIRED_IN_A_FILE if k not in named]
        if missing:
            raise ConfigError(
                f"{path}: a config file names its model size and global batch; missing: "
                f"{', '.join(missing)}. The built-in defaults (BERT-base, a global batch of "
                f"448) are never what a file means - copy the keys from "
                f"submission/configs/config_CPU_1x2x32x1.toml (a 2-layer hidden-128 BERT, "
                f"batch 64, fits this machine) or your system's config")
    return cfg
