"""``python -m runtime.config FILE [--get section.key] [--set section.key=value] [--json]``,
``--help-keys`` and ``--reference``: the config for shell layers (run_and_time.sh,
submission/run.sub), every key with its docstring, and docs/CONFIG.md.

Owns: the command line. Never: a rule about a key (the package's other modules hold them),
or the keys' text (runtime.config.reference writes it).
"""
from __future__ import annotations

import argparse
import json
import sys

import runtime.config
from runtime.choices import ConfigError
from runtime.config.load import load_config
from runtime.config.reference import help_keys, markdown
from runtime.config.run import SECTIONS

__all__ = ["help_keys", "main"]


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
    ap.add_argument("--reference", action="store_true",
                    help="print docs/CONFIG.md, the keys' reference in markdown")
    args = ap.parse_args(argv)
    if args.help_keys or args.reference:
        print(help_keys() if args.help_keys else markdown(), end="\n" if args.help_keys else "")
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
