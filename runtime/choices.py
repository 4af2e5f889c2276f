"""The configuration's vocabulary, declared once: every choice list (a ``typing.Literal``) and
every hyperparameter range.

Owns: the Literal types the config (runtime.config) gives its keys - it checks a value against
them and names the key in the error - and that each consumer imports to dispatch on
(``get_args``); what each clip mode is (``CLIP_SPECS``: one row per mode, read by the engine,
the config checks and the tuner); the optimizer hyperparameter ranges (``HPARAM_RULES``), checked by the config
for ``optim.*`` and by ``runtime.optim.build_optimizer`` for direct callers, with one message.
Choices owned by a leaf package are declared there (``loaders.balance.BalanceMode``).
Never: imports torch or reads files - ``python -m runtime.config`` (run_and_time.sh) stays fast.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Literal

Precision = Literal["fp32", "bf16", "fp16"]
ClipMode = Literal["global_after", "local_before", "bucket_before", "none"]
GradSyncKind = Literal["buckets", "ddp"]
TiedEmbeddingSync = Literal["auto", "dense", "split"]
ReduceDtype = Literal["fp32", "bf16", "fp16"]
AttentionMode = Literal["padded", "unpadded"]
LoaderKind = Literal["torch", "dali"]
OptimizerName = Literal["lamb", "adamw", "lars"]
"""The optimizers a config can name: runtime.optim's registry (tests hold the two equal)."""
OptimBackend = Literal["auto", "reference", "foreach", "fused", "apex"]
OptimShard = Literal["none", "node", "world"]
"""optim.shard: which ranks share one optimizer update (runtime/grad_sync/shard.py)."""
LrScaling = Literal["none", "linear", "sqrt"]
ScheduleName = Literal["poly", "constant"]
DeviceKind = Literal["auto", "cpu", "cuda"]
# system.launcher: each has its row in submission/launchers.py (how run_and_time.sh starts it)
# and its name as rank discovery sees it in runtime.launch.env.DISCOVERED_AS.
Launcher = Literal["mpiexec", "mpirun", "srun", "torchrun"]
CacheClear = Literal["auto", "required", "off"]
SrunMpi = Literal["pmi2", "pmix", "none"]
Division = Literal["open", "closed"]
CudaGraphs = Literal["none", "encoder", "full"]


def allocator_conf(cuda_graphs: str) -> str | None:
    """The CUDA caching allocator's settings (PYTORCH_CUDA_ALLOC_CONF) a run in graph mode
    ``cuda_graphs`` takes when the user set none: growable ("expandable") segments for eager
    steps - every batch has its own shapes, which fragments fixed-size segments -, the default
    allocator under graphs: NCCL registers the buffers of captured collectives
    (NCCL_GRAPH_REGISTER=1 by default) assuming each is one contiguous allocation, and replays
    that hang with expandable segments are reported upstream (pytorch/pytorch#158029,
    pytorch/torchtitan#3306); static shapes do not fragment the pool anyway."""
    return "expandable_segments:True" if cuda_graphs == "none" else None


ClipWhere = Literal["before", "after", "none"]
ClipUnit = Literal["rank", "bucket", "global", "none"]


@dataclass(frozen=True)
class ClipSpec:
    """What a clip mode is, for everything that must know (the bucket engine, the config
    checks and help text, the step multiplier, the tuner's step-time model): one row per
    ``ClipMode``. ``where`` and ``unit`` say what it is; every other property follows from
    them, so a row cannot contradict itself (clipping a rank's whole gradient before the
    allreduce is what holds every launch until backward ends, and so on). The bucket engine
    takes the policy of (where, unit) (runtime.grad_sync.clip.POLICIES)."""

    name: str
    where: ClipWhere         # before the averaging (each rank its own), after it, or not at all
    unit: ClipUnit           # what one norm covers: a rank's gradient, a bucket, the average
    help: str                # the config's help text for the mode
    formula: str             # the averaged gradient it leaves (docs/GRADIENT_SYNC.md)

    def __post_init__(self):
        ok = {"before": ("rank", "bucket"), "after": ("global",), "none": ("none",)}
        if self.unit not in ok[self.where]:
            raise ValueError(f"clip mode {self.name}: unit {self.unit!r} with where "
                             f"{self.where!r}; takes {ok[self.where]}")

    @property
    def before_allreduce(self) -> bool:
        """Each rank clips its own gradient before the averaging."""
        return self.where == "before"

    @property
    def holds_launches(self) -> bool:
        """No bucket goes out before backward ends: the rank's whole gradient sets the norm."""
        return self.where == "before" and self.unit == "rank"

    @property
    def per_bucket(self) -> bool:
        """Each bucket clipped by its own norm, to τ/√K (launches stay overlapped)."""
        return self.unit == "bucket"

    @property
    def after_allreduce(self) -> bool:
        """The averaged gradient's norm sets one coefficient, folded into the optimizer step."""
        return self.where == "after"


CLIP_SPECS: dict[str, ClipSpec] = {s.name: s for s in (
    ClipSpec("global_after", "after", "global",
             "reference: norm of the averaged gradient after the allreduce, folded into the "
             "optimizer step", "min(1, τ/‖ḡ‖)·ḡ, ḡ = (1/P) Σ_r g_r"),
    ClipSpec("local_before", "before", "rank",
             "each rank clips its whole gradient before the allreduce; cannot overlap "
             "backward", "(1/P) Σ_r min(1, τ/‖g_r‖) g_r"),
    ClipSpec("bucket_before", "before", "bucket",
             "each rank clips each of K buckets to max_grad_norm/sqrt(K) before launching it; "
             "Samsung", "per bucket b of K: (1/P) Σ_r min(1, (τ/√K)/‖g_r,b‖) g_r,b"),
    ClipSpec("none", "none", "none", "no clipping", "(1/P) Σ_r g_r"),
)}
"""Every ``ClipMode`` (tests/unit/test_configs.py holds the two to the same names). A new mode is a
row here (its help text included: the config's is made from the rows), a policy in
runtime/grad_sync/clip.py when its (where, unit) has none yet, and its cost in
runtime/calibrate/tune/simulate.py (``Instance.build``)."""


def clip_help() -> str:
    """``train.clip_mode``'s help text, from the rows."""
    return ("where the max_grad_norm clip acts (docs/REFERENCES.md §5): " + " | ".join(
        f"'{s.name}' ({s.help})" for s in CLIP_SPECS.values()))


AFTER_MODES = " | ".join(s.name for s in CLIP_SPECS.values() if not s.before_allreduce)
"""The modes that leave each rank's gradient alone before the averaging, in words: what DDP
and the split tied-embedding sync need."""


def clip_spec(mode: str) -> ClipSpec:
    try:
        return CLIP_SPECS[mode]
    except KeyError:
        raise ValueError(f"clip_mode must be one of {' | '.join(CLIP_SPECS)}, got {mode!r}") \
            from None


def is_number(x: Any) -> bool:
    """A finite real number (not a bool, not NaN or ±inf)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


#: Optimizer hyperparameter -> (valid?, the range in words).
HPARAM_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "lr": (lambda x: is_number(x) and x > 0, "a finite number > 0"),
    "beta1": (lambda x: is_number(x) and 0 <= x < 1, "in [0, 1)"),
    "beta2": (lambda x: is_number(x) and 0 <= x < 1, "in [0, 1)"),
    "momentum": (lambda x: is_number(x) and 0 <= x < 1, "in [0, 1)"),
    "eps": (lambda x: is_number(x) and x > 0, "a finite number > 0"),
    "weight_decay": (lambda x: is_number(x) and x >= 0, "a finite number >= 0"),
    "trust_coefficient": (lambda x: is_number(x) and x > 0, "a finite number > 0"),
    "trust_clamp": (lambda x: x is None or (is_number(x) and x > 0), "None or a number > 0"),
    "bias_correction": (lambda x: isinstance(x, bool), "True or False"),
    "use_nvlamb": (lambda x: isinstance(x, bool), "True or False"),
    "adapt": (lambda x: isinstance(x, bool), "True or False"),
}


def hparam_error(key: str, value: Any) -> str | None:
    """Why ``value`` is not a valid ``key``, or None (also None for keys without a rule)."""
    rule = HPARAM_RULES.get(key)
    if rule is None or rule[0](value):
        return None
    return f"must be {rule[1]}, got {value!r}"
