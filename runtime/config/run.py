"""A whole run's config: ``Config``, its sections, and what every rank derives from it alike.

Owns: the sections a run has (``SECTIONS``, in file order) and each key's declared type
(``section_types``), validating a whole config (each key against its choices, each section
alone, then the cross-section checks), the quantities derived from several sections (the
local batch, tokens per step, the numerics, what the run compiles) and the fingerprint ranks compare at
start.
Never: reads files or overrides (runtime.config.load); a rule of its own (sections.py and
checks.py hold them).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field, fields
from typing import Any, get_type_hints

from kernels.fusions import COMPILED
from runtime import numerics
from runtime.choices import COMPILE_MODES, ConfigError
from runtime.config.checks import check_choice, check_run
from runtime.config.sections import (DataConfig, ModelConfig, OptimConfig, ScheduleConfig,
                                     TrainConfig)
from runtime.config.system import SubmissionConfig, SystemConfig


@dataclass
class Config:
    """A whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    submission: SubmissionConfig = field(default_factory=SubmissionConfig)
    source: str = field(default="<defaults>", compare=False)

    def validate(self) -> "Config":
        for section in SECTIONS:
            obj = getattr(self, section)
            for key, hint in section_types(section).items():
                check_choice(f"{section}.{key}", getattr(obj, key), hint)
            check = getattr(getattr(self, section), "validate", None)
            if check:
                check()
        check_run(self)
        return self

    def local_batch_size(self, world_size: int) -> int:
        """Per-rank micro-batch; a clear error when the global batch does not divide."""
        per = world_size * self.train.gradient_accumulation_steps
        if self.train.global_batch_size % per:
            raise ConfigError(
                f"train.global_batch_size ({self.train.global_batch_size}) is not divisible by "
                f"world size ({world_size}) x train.gradient_accumulation_steps "
                f"({self.train.gradient_accumulation_steps}) = {per}; pick a multiple of {per}")
        return self.train.global_batch_size // per

    def numerics(self) -> numerics.Numerics:
        """How this run keeps its numbers: train.precision, model.fp8 and
        train.allreduce_dtype resolved into one value (runtime.numerics.resolve, which refuses
        the pairs that do not compose)."""
        return numerics.resolve(self.train.precision, self.model.fp8,
                                self.train.allreduce_dtype)

    def tokens_per_step(self, world_size: int) -> int:
        """At most how many tokens one rank feeds one optimizer step: local batch x
        accumulation x sequence length (what the tied sync's row buffer is sized by)."""
        return self.local_batch_size(world_size) * self.train.gradient_accumulation_steps \
            * self.data.max_seq_length

    def compiles(self, on_first_use: bool = False) -> list[str]:
        """What of this run torch.compile builds with Inductor, in the config's words (empty:
        nothing) - a run that compiles writes Inductor's cache (runtime.model.inductor_cache).
        ``on_first_use``: only what compiles lazily, in a process's first step (the layers,
        the compiled fusions), which the trainer says before that step - a compiled layer
        takes tens of seconds on a CPU with nothing else printed; the fused optimizer's step
        compiles when it is built."""
        out = []
        if COMPILE_MODES[self.model.compile].layers:
            out.append(f"model.compile='{self.model.compile}' (each encoder layer's forward "
                       f"and backward)")
        fused = [f for f in self.model.fusions if f in COMPILED]
        if fused:
            out.append(f"model.fusions {', '.join(fused)}")
        if self.optim.backend in ("auto", "fused") and not on_first_use:  # auto: fused on
            out.append(f"optim.backend='{self.optim.backend}', whose fused step is compiled")
        return out

    def to_dict(self) -> dict:
        return {s: dataclasses.asdict(getattr(self, s)) for s in SECTIONS}

    def fingerprint(self) -> str:
        """Hash of every value: ranks compare it at start so they never train different runs."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


SECTIONS = [f.name for f in fields(Config) if f.name != "source"]


def section_class(section: str) -> type:
    """The dataclass of ``[section]``."""
    return type(getattr(Config(), section))


def section_types(section: str) -> dict[str, Any]:
    """Each key of ``[section]`` and its declared type (the fields only: a section's class
    constants are not keys)."""
    cls = section_class(section)
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}
