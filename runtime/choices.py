"""The configuration's vocabulary, declared once: every choice list (a ``typing.Literal``) and
every hyperparameter range.

Owns: the Literal types the config (runtime.config) gives its keys - it checks a value against
them and names the key in the error - and that each consumer imports to dispatch on
(``get_args``); the optimizer hyperparameter ranges (``HPARAM_RULES``), checked by the config
for ``optim.*`` and by ``runtime.optim.build_optimizer`` for direct callers, with one message.
Choices owned by a leaf package are declared there (``loaders.balance.BalanceMode``).
Never: imports torch or reads files - ``python -m runtime.config`` (run_and_time.sh) stays fast.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Literal

Precision = Literal["fp32", "bf16", "fp16"]
ClipMode = Literal["global_after", "local_before", "bucket_before", "none"]
GradSyncKind = Literal["buckets", "ddp"]
TiedEmbeddingSync = Literal["auto", "dense", "split"]
ReduceDtype = Literal["fp32", "bf16", "fp16"]
AttentionMode = Literal["padded", "unpadded"]
LoaderKind = Literal["torch", "dali"]
OptimBackend = Literal["auto", "reference", "foreach", "fused", "apex"]
LrScaling = Literal["none", "linear", "sqrt"]
ScheduleName = Literal["poly", "constant"]
DeviceKind = Literal["auto", "cpu", "cuda"]
# system.launcher: each has its row in submission/launchers.py (how run_and_time.sh starts it)
# and its name as rank discovery sees it in runtime.launch.env.DISCOVERED_AS.
Launcher = Literal["mpiexec", "mpirun", "srun", "torchrun"]
CacheClear = Literal["auto", "required", "off"]
SrunMpi = Literal["pmi2", "pmix", "none"]
Division = Literal["open", "closed"]


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
