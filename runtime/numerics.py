"""How a run keeps its numbers, resolved once: ``train.precision``, ``model.fp8`` and
``train.allreduce_dtype`` made into one frozen ``Numerics`` value - the parameters' dtype (and
so the gradients' and the gradient buffers'), the forward's autocast, the dtype the GEMMs run
in (and FP8's beside it), the allreduce's dtype, fp32 master weights or not, a loss scale or
not, and the bytes each of those takes. FSDP2's ``MixedPrecisionPolicy(param_dtype,
reduce_dtype, ...)`` is the model: one policy object handed to whatever needs it, not a name
that each reader compares with strings.

    n = cfg.numerics()                  # runtime.config.Config: resolve(precision, fp8, reduce)
    n.params, n.autocast, n.gemm, n.reduce     # dtype names ("fp32", "bf16", "fp16"; None)
    n.master, n.loss_scale                      # the optimizer's masters, the dynamic loss scale
    n.param_bytes, n.activation_bytes           # bytes per element (basis.dtypes)
    n.peak_dtypes                               # ("bf16",) or ("bf16", "fp8"): MFU's peaks

Who reads it: runtime.train.build (hands it to the model's dtype, the gradient sync's reduce
dtype, the optimizer's masters, the loss scale and the MFU peak), the step body's autocast
(runtime.model.precision), the memory estimate (runtime.train.memory), the bucket tuner, the
run's derived facts (the MLPerf log's ``presto_step_choices``). Each precision is a row of
runtime.choices.PRECISIONS (what it is), each FP8 recipe one of FP8_RECIPES; this module
composes them with the allreduce's dtype and refuses what does not compose (``resolve``: the
one place, a ConfigError naming both keys - exit 2).

Owns: ``Numerics``, ``resolve`` (the dtype names, their torch dtypes and their widths are
basis.dtypes').
Never: imports torch (the memory check and ``python -m runtime.config`` run before any rank
starts), reads the config (values are handed in: runtime.config.Config.numerics), or decides
anything at run time - a ``Numerics`` is a value.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from basis.dtypes import BYTES, TORCH_NAMES
from runtime.choices import FP8_RECIPES, FP8_UNSCALED_WHY, PRECISIONS, ConfigError

FP8 = "fp8"
"""The GEMM dtype model.fp8's Linears run in (the peak table's key: runtime.observe.mfu)."""


@dataclass(frozen=True)
class Numerics:
    """A run's numbers (see the module docstring): made by ``resolve``, never changed."""

    precision: str
    """train.precision: the row's name (for the logs and the checkpoint's resume rule)"""
    fp8: str
    """model.fp8: the recipe's name ('none': every GEMM in ``gemm``)"""
    params: str
    """the parameters' dtype - and so the gradients' and the gradient buffers'"""
    autocast: Optional[str]
    """the forward's torch.autocast dtype (None: no autocast)"""
    reduce: str
    """the gradient allreduce's dtype (train.allreduce_dtype, 'auto' resolved to ``params``)"""
    master: bool
    """the optimizer keeps fp32 master weights (and fp32 state) and writes the parameters"""
    loss_scale: bool
    """the loss is scaled (fp16's dynamic loss scale: an overflow skips the step)"""

    @property
    def gemm(self) -> str:
        """The dtype the GEMMs run in (FP8's Linears aside: ``peak_dtypes``)."""
        return self.autocast or self.params

    @property
    def peak_dtypes(self) -> tuple[str, ...]:
        """The GEMM dtypes of a step, the one MFU is read against first: ``gemm``, and
        ``fp8`` beside it under model.fp8 (only the converted encoder Linears run in FP8:
        attention, embeddings and heads stay in ``gemm``)."""
        return (self.gemm, FP8) if self.fp8_gemms else (self.gemm,)

    @property
    def fp8_gemms(self) -> bool:
        """Some GEMMs run in FP8 (model.fp8 names a torchao recipe)."""
        return FP8_RECIPES[self.fp8].torchao is not None

    @property
    def param_bytes(self) -> int:
        """Bytes of a parameter - and of its gradient, and of its gradient buffer's slot."""
        return BYTES[self.params]

    @property
    def master_bytes(self) -> int:
        """Bytes of a parameter's fp32 master weight in the optimizer (0: none kept)."""
        return BYTES["fp32"] if self.master else 0

    @property
    def reduce_bytes(self) -> int:
        """Bytes of a gradient element on the wire."""
        return BYTES[self.reduce]

    @property
    def activation_bytes(self) -> int:
        """Bytes of an activation element: the GEMMs' dtype (autocast's outputs, or the
        parameters' without autocast)."""
        return BYTES[self.gemm]

    @property
    def narrow_params(self) -> bool:
        """The parameters are narrower than fp32 (the model is cast at build, and a CPU's
        GEMMs of them run through kernels.cpu_gemm)."""
        return self.param_bytes < BYTES["fp32"]

    def describe(self) -> dict:
        """What the run's derived facts say (RunState.derived['numerics']: the MLPerf log's
        ``presto_step_choices``, summary.json)."""
        return {"precision": self.precision, "fp8": self.fp8, "params_dtype": self.params,
                "autocast_dtype": self.autocast, "gemm_dtype": self.gemm,
                "allreduce_dtype": self.reduce, "master_weights": self.master,
                "loss_scale": self.loss_scale}


def resolve(precision: str, fp8: str = "none", allreduce_dtype: str = "auto") -> Numerics:
    """The ``Numerics`` of train.precision = ``precision``, model.fp8 = ``fp8`` and
    train.allreduce_dtype = ``allreduce_dtype``. What does not compose is refused here, the
    one place, naming both keys (ConfigError: exit 2 before anything starts): an FP8 recipe
    beside a precision whose loss is scaled (fp16's loss scale multiplies the gradients that
    torchao casts to e5m2 with a scale of its own, and an overflow skip is judged on gradients
    FP8 already saturated; torchao's float8 training is bf16's)."""
    for key, value, rows in (("train.precision", precision, PRECISIONS),
                             ("model.fp8", fp8, FP8_RECIPES)):
        if value not in rows:
            raise ConfigError(f"{key}={value!r}: choose one of {' | '.join(rows)}")
    row = PRECISIONS[precision]
    reduce = row.params if allreduce_dtype == "auto" else allreduce_dtype
    if reduce not in TORCH_NAMES:
        raise ConfigError(f"train.allreduce_dtype={allreduce_dtype!r}: choose one of auto | "
                          + " | ".join(TORCH_NAMES))
    if FP8_RECIPES[fp8].torchao is not None and row.loss_scale:
        unscaled = [n for n, r in PRECISIONS.items() if not r.loss_scale]
        raise ConfigError(
            f"model.fp8='{fp8}' with train.precision='{precision}': {FP8_UNSCALED_WHY}; set "
            f"train.precision to one without a loss scale ({', '.join(map(repr, unscaled))}), "
            f"or model.fp8='none'")
    return Numerics(precision=precision, fp8=fp8, params=row.params, autocast=row.autocast,
                    reduce=reduce, master=row.master, loss_scale=row.loss_scale)

