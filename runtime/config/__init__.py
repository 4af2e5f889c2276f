"""The one typed configuration of a run: sections of dataclasses, read from a TOML file.

Owns, in its modules: every hyperparameter and system knob, its default, its docstring (the
``--help`` text of ``python -m runtime.config --help-keys``) and its validation. A key has
one meaning everywhere: in the config file, in ``section.key=value`` overrides and in the
logs.

  sections.py  one dataclass per training ``[section]`` (model, data, optim, schedule,
               train): the keys, their types, defaults, docstrings and resume rules, and
               the checks that read one section alone
  system.py    the same for ``[system]`` (where and how the ranks run) and ``[submission]``
  checks.py    the checks that tie sections together, and a key against its choices
  run.py       ``Config``: a whole run, validated; the values derived from several sections
  load.py      ``load_config``: the TOML file, overrides, ``key_type``
  __main__.py  ``python -m runtime.config``: values for shell layers, ``--help-keys``

Each choice list is a ``typing.Literal`` declared once (runtime.choices, or the leaf package
that consumes it) and checked here from the field's type; a choice with rules of its own is a
row in runtime.choices (clip modes, CUDA-graph modes, shard scopes) that the checks and the
help text read.
Never: reads the launcher's environment (runtime.launch.env does), touches torch or the disk
beyond reading the file.

Config files live in ``submission/configs/config_<SYSTEM>_<nodes>x<ranks>x<batch>x<accum>.toml``.
"""
from runtime.choices import ConfigError
from runtime.config.checks import check_choice
from runtime.config.load import (REQUIRED_IN_A_FILE, key_type, load_config, parse_override,
                                 read_toml_text)
from runtime.config.run import SECTIONS, Config, section_class, section_types
from runtime.config.sections import (MAX_PROFILED_STEPS, SEED_MAX, DataConfig, ModelConfig,
                                     OptimConfig, ScheduleConfig, TrainConfig)
from runtime.config.system import SubmissionConfig, SystemConfig

__all__ = ["Config", "ConfigError", "DataConfig", "MAX_PROFILED_STEPS", "ModelConfig",
           "OptimConfig", "REQUIRED_IN_A_FILE", "SECTIONS", "SEED_MAX", "ScheduleConfig",
           "SubmissionConfig", "SystemConfig", "TrainConfig", "check_choice", "key_type",
           "load_config", "parse_override", "read_toml_text", "section_class", "section_types"]
