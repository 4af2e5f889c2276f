"""The configuration's vocabulary, declared once: every choice list (a ``typing.Literal``) and
every hyperparameter range.

Owns: the Literal types the config (runtime.config) gives its keys - it checks a value against
them and names the key in the error - and that each consumer imports to dispatch on
(``get_args``); the rows of the choices that have rules of their own, one row per name, read
by the engine, the config's checks and help text and the tuner: what each CUDA-graph mode is
(``GRAPH_MODES``), each shard scope (``SHARD_SCOPES``), each clip mode (``CLIP_SPECS``), each
``model.compile`` value (``COMPILE_MODES``); the
optimizer hyperparameter ranges (``HPARAM_RULES``), checked by the config for ``optim.*`` and
by ``runtime.optim.build_optimizer`` for direct callers, with one message; the shape of a
config key's field (``key_field``: docstring and resume rule, ``MATCH`` / ``RECORD``).
Choices owned by a leaf package are declared there (``loaders.balance_spec.BalanceMode``).
Never: imports torch or reads files - ``python -m runtime.config`` (run_and_time.sh) stays fast.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Literal, get_args

class ConfigError(ValueError):
    """An invalid configuration; the message names the key and what to change. Declared in
    the vocabulary so every room may raise it without importing the config (runtime.config
    re-exports it)."""


ResumeRule = Literal["match", "record"]
MATCH, RECORD = get_args(ResumeRule)
"""What a resume may do with a config key (runtime.train.resume_rules): MATCH - the
checkpoint's value, else the resume is refused; RECORD - change it, and the change is said."""


def key_field(doc: str, default: Any = dataclasses.MISSING, *, resume: str | None = None,
              why: str = "", **kw) -> Any:
    """A config key's dataclass field: its default, its docstring (the ``--help-keys`` text)
    and its resume rule (``resume`` MATCH or RECORD, and ``why``: what a change would alter),
    each declared on the field. A section whose keys share one rule declares it once as its
    ``RESUME`` (runtime.config.system.SystemConfig)."""
    if resume is not None and (resume not in (MATCH, RECORD) or not why):
        raise ValueError(f"a key's resume rule is {MATCH!r} or {RECORD!r} with why, got "
                         f"{resume!r}, {why!r}")
    meta = {"doc": doc, **({"resume": (resume, why)} if resume else {})}
    if default is dataclasses.MISSING:
        return dataclasses.field(metadata=meta, **kw)
    return dataclasses.field(default=default, metadata=meta, **kw)


Precision = Literal["fp32", "bf16", "fp16", "bf16_master", "fp16_master"]
"""train.precision (its rows: ``PRECISIONS``)."""
ClipMode = Literal["global_after", "local_before", "bucket_before", "none"]
GradSyncKind = Literal["buckets", "ddp"]
TiedEmbeddingSync = Literal["auto", "dense", "split"]
ReduceDtype = Literal["auto", "fp32", "bf16", "fp16"]
AttentionMode = Literal["padded", "unpadded"]
LoaderKind = Literal["torch", "dali"]
OptimizerName = Literal["lamb", "adamw", "lars"]
"""The optimizers a config can name: runtime.optim's registry (tests hold the two equal)."""
OptimBackend = Literal["auto", "reference", "foreach", "fused", "apex"]
LambUpdate = Literal["recompute", "stored"]
"""optim.lamb_update: how LAMB's second fused pass gets the update (kernels.optim_flat)."""
OptimShard = Literal["none", "node", "world"]
"""optim.shard: which ranks share one optimizer update (its rows: ``SHARD_SCOPES``)."""
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
ModelCompile = Literal["none", "layers"]
"""model.compile: what of the model torch.compile compiles (its rows: ``COMPILE_MODES``)."""
Fp8Recipe = Literal["none", "tensorwise", "rowwise"]
"""model.fp8: the encoder's GEMMs in FP8 with torchao's recipe of this name (``FP8_RECIPES``)."""
Fp8Role = Literal["qkv", "attn_out", "ffn_in", "ffn_out"]
"""model.fp8_layers: an encoder layer's Linears by what they do (``FP8_ROLES``)."""
Fp8Emulate = Literal["auto", "on", "off"]
"""model.fp8_emulate: where torchao's emulate mode stands in for FP8 GEMMs."""


@dataclass(frozen=True)
class Need:
    """A key a launch mode needs set to one of ``allowed``, and why (the config's refusal)."""

    key: str                  # "section.key"
    allowed: tuple
    why: str


# What every captured mode needs: a graph replays fixed shapes on a stream of its own, and
# nothing inside it may read the host or change outside the step's control.
_CAPTURED_NEEDS = (
    Need("system.device", ("auto", "cuda"), "a CUDA device (system.device='cpu' has none)"),
    Need("data.shapes", ("static",), "data.shapes='static' (a graph replays fixed shapes; "
         "every batch of another shape policy may have its own)"),
    Need("train.grad_sync", ("buckets",), "train.grad_sync='buckets' (DDP's reducer is rebuilt "
         "and re-bucketed outside the step's control)"),
    Need("train.timeline", (False,), "train.timeline=false (the timeline stamps host times "
         "inside the step)"),
    Need("train.tied_embedding_sync", ("dense", "auto"), "train.tied_embedding_sync 'dense' "
         "or 'auto' (the split's decoder tap fires inside the graphed backward)"),
)


@dataclass(frozen=True)
class GraphMode:
    """What a ``train.cuda_graphs`` mode is, for everything that must know (the config's
    checks and help text, the rank's allocator settings, the cluster projection, bench.gpu):
    one row per ``CudaGraphs``. Its runner - how a step runs in this mode - is the class of
    that name in runtime/train/runners.py (a test holds the two lists equal)."""

    name: str
    help: str
    needs: tuple[Need, ...] = ()
    captures: bool = False    # CUDA graphs: a stream of its own, autocast without its cache
    overlaps_allreduce: bool = True
    """the bucket allreduces start during backward (encoder graphs hand back every gradient
    when the graphed backward ends: the projection charges the allreduce)"""

    @property
    def allocator(self) -> str | None:
        """PYTORCH_CUDA_ALLOC_CONF a run in this mode takes when the user set none: growable
        ("expandable") segments for eager steps - every batch has its own shapes, which
        fragments fixed-size segments -, the default allocator under graphs: NCCL registers
        the buffers of captured collectives (NCCL_GRAPH_REGISTER=1 by default) assuming each
        is one contiguous allocation, and replays that hang with expandable segments are
        reported upstream (pytorch/pytorch#158029, pytorch/torchtitan#3306); static shapes do
        not fragment the pool anyway."""
        return None if self.captures else "expandable_segments:True"


GRAPH_MODES: dict[str, GraphMode] = {m.name: m for m in (
    GraphMode("none", "eager"),
    GraphMode("encoder", "each micro-batch's forward and backward replayed from a graph, the "
              "gradient sync and optimizer eager: larger local batches, gradient accumulation; "
              "the allreduces start after the graphed backward (no overlap)",
              _CAPTURED_NEEDS, captures=True, overlaps_allreduce=False),
    GraphMode("full", "the whole iteration - forward, backward with the bucket allreduces and "
              "clipping, loss scale, optimizer, learning rate - one graph replayed each step: "
              "the small local batches where records are set",
              _CAPTURED_NEEDS + (Need("optim.backend", ("auto", "fused"), "optim.backend "
                                      "'auto' or 'fused' (the other steps read the skip flag "
                                      "back to the host)"),), captures=True),
)}


@dataclass(frozen=True)
class PrecisionMode:
    """What a ``train.precision`` value is: one row per ``Precision``, composed with model.fp8
    and train.allreduce_dtype into the run's one ``runtime.numerics.Numerics`` (what the
    builder, the step, the optimizer, the loss scale, the memory estimate and the MFU peak
    read), and read by the config's checks (``needs``) and help text. Dtypes are names
    (basis.dtypes): this module imports no torch. A new precision over the
    dtypes there is one row here and its name in ``Precision``."""

    name: str
    help: str
    params: str = "fp32"
    """the model's parameters - and so its gradients and the gradient buffers - in this dtype"""
    autocast: str | None = None
    """the step's forward under torch.autocast to this dtype (None: no autocast)"""
    master: bool = False
    """the optimizer keeps fp32 master weights (and fp32 state), steps them and writes the
    model's copy after each update; checkpoints hold the masters"""
    loss_scale: bool = False
    """fp16's dynamic loss scale (overflow skips the step, the scale halves)"""
    needs: tuple[Need, ...] = ()


_CUDA = Need("system.device", ("auto", "cuda"), "a CUDA device, system.device 'auto' or 'cuda' "
             "(fp16 and autocast steps are CUDA's; on a CPU train.precision 'fp32' or "
             "'bf16_master' run)")
_MASTER_NEEDS = (
    Need("optim.backend", ("auto", "fused"), "optim.backend 'auto' or 'fused' (the fused flat "
         "step keeps the fp32 master weights; the per-tensor backends keep none)"),
    Need("train.grad_sync", ("buckets",), "train.grad_sync='buckets' (its gradient buffer is "
         "the optimizer's, in the model's dtype; DDP's reducer keeps buckets of its own)"),
)

PRECISIONS: dict[str, PrecisionMode] = {m.name: m for m in (
    PrecisionMode("fp32", "fp32 parameters, gradients, activations and optimizer state"),
    PrecisionMode("bf16", "fp32 parameters under bf16 autocast: every weight cast each step, "
                  "fp32 gradients", autocast="bf16", needs=(_CUDA,)),
    PrecisionMode("fp16", "fp32 parameters under fp16 autocast with a dynamic loss scale",
                  autocast="fp16", loss_scale=True, needs=(_CUDA,)),
    PrecisionMode("bf16_master", "bf16 parameters, activations and gradients (reduced in "
                  "bf16 unless train.allreduce_dtype says otherwise), fp32 master weights and "
                  "state in the optimizer, which writes the bf16 copy after each update; "
                  "runs on CPU too", params="bf16", master=True, needs=_MASTER_NEEDS),
    PrecisionMode("fp16_master", "bf16_master's layout in fp16, with the dynamic loss scale",
                  params="fp16", master=True, loss_scale=True, needs=(_CUDA,) + _MASTER_NEEDS),
)}
"""Every ``Precision`` (tests/unit/test_configs.py holds the two to the same names)."""


def precision_help() -> str:
    """``train.precision``'s help text, from the rows."""
    return "; ".join(f"'{m.name}': {m.help}" for m in PRECISIONS.values())


@dataclass(frozen=True)
class CompileMode:
    """What a ``model.compile`` value is, for everything that must know (the builder, the
    config's check and help text, bench.gpu's cases): one row per ``ModelCompile``. How a
    layer is compiled - which dimensions are dynamic under which data.shapes - is
    runtime/model/compile.py's."""

    name: str
    help: str
    layers: bool = False
    """each encoder layer's forward and backward compiled: the fusions that are compiled
    functions of their own (kernels.fusions.COMPILED) are refused beside it - the layer's
    graph fuses the same operations, with the bias left in the GEMM"""


COMPILE_MODES: dict[str, CompileMode] = {m.name: m for m in (
    CompileMode("none", "every layer eager"),
    CompileMode("layers", "each encoder layer's forward and backward compiled with Inductor "
                "(torch.compile, one graph a layer, the same graph for every layer): static "
                "shapes under data.shapes='static', the batch's dimensions dynamic otherwise, "
                "the widths constant; compiled in the first step (a minute on 2 CPU cores, "
                "more on a GPU) and once more for the first evaluation; composes with "
                "train.cuda_graphs (compiled in the eager warm-up, then captured)",
                layers=True),
)}


def compile_help() -> str:
    """``model.compile``'s help text, from the rows."""
    return ("what of the model torch.compile compiles (runtime/model/compile.py, docs/GPU.md): "
            + " | ".join(f"'{m.name}' ({m.help})" for m in COMPILE_MODES.values())
            + ". 'layers' subsumes model.fusions bias_gelu and dropout_add_norm and is refused "
            "beside them")


@dataclass(frozen=True)
class Fp8Mode:
    """What a ``model.fp8`` value is, for everything that must know (the model's conversion,
    the config's checks and help text, the logs): one row per ``Fp8Recipe``. ``torchao`` is
    the name of torchao.float8's ``Float8LinearRecipeName`` it stands for (None: no FP8).
    How the Linears are converted is runtime/model/fp8.py's."""

    name: str
    help: str
    torchao: str | None = None
    needs: tuple[Need, ...] = ()


FP8_UNSCALED_WHY = ("fp16's loss scale multiplies the gradients that torchao casts to e5m2 "
                    "with a scale of its own, and an overflow skip is judged on gradients FP8 "
                    "already saturated; torchao's float8 training is bf16's")
"""Why model.fp8 refuses a precision whose loss is scaled (runtime.numerics.resolve refuses
the pair, the one place; runtime/model/fp8.py's docstring has the reasons at length)."""

FP8_RECIPES: dict[str, Fp8Mode] = {r.name: r for r in (
    Fp8Mode("none", "every GEMM in the precision's dtype"),
    Fp8Mode("tensorwise", "one dynamic scale per tensor: inputs and weights in e4m3, "
               "gradients in e5m2, cuBLAS's FP8 GEMM (torchao's default and fastest recipe)",
               "tensorwise"),
    Fp8Mode("rowwise", "a dynamic scale per row (per column of the weight), rounded down to "
               "a power of two, e4m3 throughout: more accurate, a CUTLASS GEMM, slower than "
               "tensorwise", "rowwise"),
)}
"""Every ``Fp8Recipe`` (tests/unit/test_configs.py holds the two to the same names)."""

FP8_ROLES: dict[str, str] = {
    "qkv": "the Q, K and V projections (three [H, H] Linears, or fusion qkv's one [3H, H])",
    "attn_out": "the attention output projection [H, H]",
    "ffn_in": "the feed-forward intermediate GEMM [I, H] (before GELU)",
    "ffn_out": "the feed-forward output GEMM [H, I]",
}
"""Every ``Fp8Role``, what it is (model.fp8_layers; runtime/model/fp8.py maps each to the
encoder layer's modules). Never the embeddings, the pooler or the heads."""


def fp8_help() -> str:
    """``model.fp8``'s help text, from the rows."""
    return ("the encoder's Linear layers (model.fp8_layers) trained in FP8 with torchao "
            "(torchao.float8, dynamic scaling; runtime/model/fp8.py, docs/GPU.md): "
            + " | ".join(f"'{r.name}' ({r.help})" for r in FP8_RECIPES.values())
            + ". Needs a train.precision without a loss scale ("
            + ", ".join(repr(n) for n, m in PRECISIONS.items() if not m.loss_scale) + "): "
            + FP8_UNSCALED_WHY + ". A GPU of compute "
            "capability 8.9 or more (Ada, Hopper, Blackwell) runs real FP8 GEMMs; elsewhere "
            "model.fp8_emulate decides. Weights, gradients, optimizer state, checkpoints and "
            "exported files stay in the precision's dtypes: FP8 lives only inside the GEMMs")


def fp8_layers_help() -> str:
    """``model.fp8_layers``' help text, from the rows."""
    return ("model.fp8: which Linears of every encoder layer run in FP8, by role: "
            + " | ".join(f"'{k}' ({v})" for k, v in FP8_ROLES.items())
            + ". Every selected dimension must be a multiple of 16 (FP8 GEMMs' rule); the "
            "embeddings, pooler and heads never are")


ShardGroup = Literal["rank", "node", "world"]


@dataclass(frozen=True)
class ShardScope:
    """What an ``optim.shard`` value is, for everything that must know (the gradient sync's
    shard groups, the memory estimate, the tuner's model, the config's checks and help text):
    one row per ``OptimShard``. ``group`` says which ranks share one optimizer update - each
    rank alone, the ranks of one node, every rank -; how many they are and whether they sit
    on one host follow from it, so no reader spells a scope's rule again. The collectives
    are runtime/grad_sync/shard.py's."""

    name: str
    group: ShardGroup
    help: str
    needs: tuple[Need, ...] = ()

    @property
    def sharded(self) -> bool:
        """Whether several ranks share one update (each keeps 1/N of the optimizer state)."""
        return self.group != "rank"

    def ranks_per_update(self, world_size: int, local_world_size: int) -> int:
        """N: the ranks that share one optimizer update, given the world and the ranks of
        one node (``local_world_size``)."""
        if self.group == "node":
            return max(1, min(local_world_size, world_size))
        return world_size if self.group == "world" else 1

    def one_host(self, world_size: int, local_world_size: int) -> bool:
        """Whether the ranks that share one update are always on one host (one host's CPU
        ranks share one parameter buffer instead of gathering it: runtime/grad_sync/shard.py)."""
        return self.group != "world" or local_world_size >= world_size


_SHARDED_NEEDS = (
    Need("train.grad_sync", ("buckets",), "train.grad_sync='buckets' (the shards are rows of "
         "its gradient buffer)"),
    Need("optim.backend", ("auto", "fused"), "optim.backend 'auto' or 'fused' (the sharded "
         "step is the fused step on a shard of its flat buffers)"),
)

SHARD_SCOPES: dict[str, ShardScope] = {s.name: s for s in (
    ShardScope("none", "rank", "every rank updates all the parameters and keeps the whole "
               "optimizer state"),
    ShardScope("node", "node", "N = the ranks of one node; across nodes the shard is "
               "all-reduced between its owners", _SHARDED_NEEDS),
    ShardScope("world", "world", "N = every rank", _SHARDED_NEEDS),
)}
"""Every ``OptimShard`` (tests/unit/test_configs.py holds the two to the same names). A new
scope is a row here, with a ``group`` kind of its own only when none fits (then its count
and host in ``ShardScope`` and its groups in runtime.grad_sync.shard_groups)."""


def shard_scope(name: str) -> ShardScope:
    try:
        return SHARD_SCOPES[name]
    except KeyError:
        raise ValueError(f"optim.shard must be one of {' | '.join(SHARD_SCOPES)}, got "
                         f"{name!r}") from None


def shard_help() -> str:
    """``optim.shard``'s help text, from the rows."""
    modes = " | ".join(f"'{s.name}' ({s.help})" for s in SHARD_SCOPES.values())
    needs = {n.key: n for s in SHARD_SCOPES.values() for n in s.needs}
    return ("shard the optimizer (ZeRO-1, NVIDIA's DistributedFusedLAMB): each rank updates "
            "1/N of the parameters and keeps 1/N of the optimizer state, gradients are "
            "reduced to the shards' owners bucket by bucket instead of all-reduced, the "
            "updated parameters all-gathered after the step; LAMB/LARS per-tensor norms of "
            f"split tensors exact. {modes}. The sharded scopes need "
            + " and ".join(f"{k} {' | '.join(repr(v) for v in n.allowed)}"
                           for k, n in needs.items())
            + ". docs/GRADIENT_SYNC.md")


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


def one_of(choices: Any, helps: dict[str, str] | None = None) -> str:
    """A ``Literal`` key's choices in words, in their declared order: "'a' (what a does) |
    'b'". The names come from the type, never typed again; ``helps`` may describe only
    declared ones (checked when the section is defined)."""
    names = [str(c) for c in get_args(choices)]
    helps = helps or {}
    stray = sorted(set(helps) - set(names))
    if stray:
        raise ValueError(f"help text for {stray}, which are not among the choices {names}")
    return " | ".join(f"'{n}'" + (f" ({helps[n]})" if n in helps else "") for n in names)


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


def graph_modes_help() -> str:
    """train.cuda_graphs's help text, from the rows."""
    modes = " | ".join(f"'{m.name}' ({m.help})" for m in GRAPH_MODES.values())
    common = [n.key for n in _CAPTURED_NEEDS]
    extra = {m.name: [n.key for n in m.needs if n.key not in common]
             for m in GRAPH_MODES.values() if m.captures}
    return (f"CUDA graphs of the step (runtime/train/runners.py, docs/GPU.md): {modes}. The "
            f"captured modes need {', '.join(common)} set as the config check says"
            + "".join(f"; '{k}' also {', '.join(v)}" for k, v in extra.items() if v)
            + ". Captured after a few eager steps, and anew after a resume")

