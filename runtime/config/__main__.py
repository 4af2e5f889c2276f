"""``python -m runtime.config FILE [--get section.key] [--set section.key=value] [--json]``
and ``--help-keys``: the config for shell layers (run_and_time.sh, submission/run.sub) and
every key with its docstring.

Owns: the command line and the keys' help listing. Never: a rule about a key (the package's
other modules hold them).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields

import runtime.config
from runtime.choices import ConfigError
from runtime.config.load import load_config
from runtime.config.run import SECTIONS, Config


def help_keys() -> str:
    lines = []
    defaults = Config()
    for section in SECTIONS:
        obj = getattr(defaults, section)
        lines.append(f"[{section}]  {type(obj).__doc__.strip()}")
        for f in fields(obj):
            lines.append(f"  {f.name} = {getattr(obj, f.name)!r}\n      {f.metadata.get('doc', '')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m runtime.config FILE [--get section.key] [--check]` for shell layers."""
    ap = argparse.ArgumentParser(prog="python -m runtime.config",
                                 description=runtime.config.__doc__.split("\n\n")[0])
    ap.add_argument("file", nargs="?", help="config TOML")
    ap.add_argument("--get", action="append", default=[], metavar="SECTION.KEY",
                    help="print the value (one line per --get)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--json", action="store_true", help="print the whole config as JSON")
    ap.add_argument("--help-keys", action="store_true", help="list every key with its docstring")
    args = ap.parse_args(argv)
    if args.help_keys:
        print(help_keys())
        return 0
    try:
        cfg = load_config(args.file, args.set)
        for name in args.get:
            section, _, key = name.partition(".")
            if section not in SECTIONS or not hasattr(getattr(cfg, section), key):
                raise ConfigError(f"unknown key {name}")
            print(getattr(getattr(cfg, section), key))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(cfg.to_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
