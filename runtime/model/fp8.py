"""FP8 training of the encoder's GEMMs with torchao (``model.fp8``), applied from outside the
model as ``model.compile`` is: its converter (runtime.model.converters ``Fp8Linears``, a row of
the list the builder applies) hands the model here after its weights are set and fusion qkv
made, before its layers are compiled.

Owns: which Linears are converted - the encoder layers' by role (``ROLE_MODULES``: model.fp8_layers
names roles, runtime.choices.FP8_ROLES says what each is), in either QKV layout (three [H, H]
Linears, or fusion qkv's one [3H, H] ``Wqkv``), and only those whose dimensions are multiples
of 16 (an FP8 GEMM's rule; the config refuses a shape that breaks it) -; the conversion
(``convert``: torchao.float8.convert_to_float8_training with the recipe's
``Float8LinearConfig``, tensorwise or rowwise dynamic scaling, and the encoder's token count
made a multiple of 16 too - the weight gradient's GEMM has it as its inner dimension. Not
torchao's ``pad_inner_dim``: that pads both operands of all three GEMMs with ``F.pad`` on
every call, a copy even of an aligned operand - 576 copies a step in BERT-large's 96 Linears
-, where the model pads at most 15 token rows once a step and only when the count needs it:
``BertModel.token_multiple``); where emulation stands in
(``emulation``: torchao's emulate mode - the same casts to e4m3/e5m2 and the same scales,
the GEMM of the dequantised values in fp32 - on a CPU, or on a GPU below compute capability
8.9 when model.fp8_emulate = 'on'; a GPU below 8.9 is refused otherwise, ``Fp8Unavailable``,
exit 2 on every rank before the first step); and what a converted model says about itself
(``facts``: the run's log, summary and MLPerf log).

Why the combinations are what they are (runtime.numerics.resolve refuses a scaled loss beside
FP8; the config's checks the rest): a ``Float8Linear`` keeps the ``nn.Linear``'s own weight and bias Parameters (the same
objects, names and dtypes), and dynamic scaling keeps no state (no amax history) - so the state
dict, the Hugging Face export, checkpoints and a bitwise resume, the gradient buffers, the fused
and sharded optimizers and the fp32 master weights see the model they would see without FP8.
FP8 lives only inside the three GEMMs of each converted Linear (output, grad input, grad
weight). fp16 and fp16_master are refused: their loss scale multiplies the gradients that
torchao casts to e5m2 with a scale of its own, and torchao's float8 training is made and tested
for bf16. The fusions bias_gelu and dropout_add_norm call their GEMM with ``F.linear`` on the
Linear's weight, outside the module, so FP8 would not run there: the config refuses them beside
the roles they cover (model.compile = 'layers' fuses the same elementwise work and traces the
FP8 Linears).

Note: ``convert_to_float8_training`` also reverts Inductor's Triton min/max code generation to
its ``tl.where`` form for the whole process (a workaround of torchao's for a Triton FP8-store
miscompile, triton-lang/triton#11111; numerically the same).

Never: reads the config (the builder passes the keys' values), changes a parameter's value,
name or dtype, converts the embeddings, the pooler or the heads, or imports torchao unless FP8
is asked for (``import runtime.model.fp8`` is free without it).
"""
from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from runtime.choices import FP8_RECIPES, FP8_ROLES

FP8_CAPABILITY = (8, 9)
"""The CUDA compute capability of the first GPUs with FP8 tensor cores (Ada: 8.9; Hopper: 9.0)."""
MULTIPLE = 16
"""An FP8 GEMM's dimensions are multiples of this (torch._scaled_mm's rule)."""

ROLE_MODULES: dict[str, tuple[str, ...]] = {
    "qkv": ("attention.self.query", "attention.self.key", "attention.self.value",
            "attention.self.Wqkv"),
    "attn_out": ("attention.output.dense",),
    "ffn_in": ("intermediate.dense",),
    "ffn_out": ("output.dense",),
}
"""Each role's Linears inside a ``BertLayer`` (runtime.model.bert), by their names there
(tests hold the keys to runtime.choices.FP8_ROLES and every name to a module of the model)."""
_IN_A_LAYER = re.compile(r"^(?:(?:bert\.)?encoder\.layer\.\d+\.)?(.+)$")


class Fp8Unavailable(ValueError):
    """model.fp8 asked for where it cannot run as configured (a GPU below compute capability
    8.9 without model.fp8_emulate = 'on'; real FP8 asked for on a CPU). Every rank sees the
    same kind of device, so every rank raises it alike: exit 2, before the first step."""

    exit_code = 2
    raised_on_all_ranks = True


def role_of(fqn: str) -> Optional[str]:
    """The model.fp8_layers role of the module named ``fqn`` in a ``BertForPreTraining``, its
    ``BertModel`` or one ``BertLayer``, or None: not an encoder layer's Linear of any role."""
    inner = _IN_A_LAYER.match(fqn).group(1)
    return next((role for role, names in ROLE_MODULES.items() if inner in names), None)


def dims_fit(linear: nn.Linear) -> bool:
    """Both of the weight's dimensions are multiples of 16 (an FP8 GEMM's shape rule)."""
    out_features, in_features = linear.weight.shape
    return out_features % MULTIPLE == 0 and in_features % MULTIPLE == 0


def module_filter(roles: Iterable[str]) -> Callable[[nn.Module, str], bool]:
    """torchao's ``module_filter_fn``: a Linear of one of ``roles`` whose dimensions fit."""
    wanted = set(roles)
    unknown = wanted - set(FP8_ROLES)
    if unknown:
        raise ValueError(f"model.fp8_layers: unknown role(s) {sorted(unknown)}; the roles are "
                         f"{' | '.join(FP8_ROLES)}")

    def keep(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and role_of(fqn) in wanted and dims_fit(module)
    return keep


@dataclass(frozen=True)
class Emulation:
    """Whether the FP8 GEMMs are emulated on ``device``, and why (the run says it once)."""

    emulate: bool
    why: str


def emulation(emulate: str, device: torch.device | str) -> Emulation:
    """How model.fp8 runs on ``device`` given model.fp8_emulate (``emulate``: 'auto', 'on' or
    'off'); raises ``Fp8Unavailable`` where it cannot run as asked."""
    device = torch.device(device)
    if device.type != "cuda":
        if emulate == "off":
            raise Fp8Unavailable(
                f"model.fp8_emulate='off' asks for real FP8 GEMMs, but this rank runs on "
                f"{device.type} (no FP8 tensor cores): set model.fp8_emulate='auto' to emulate "
                f"them here, or model.fp8='none'")
        return Emulation(True, f"no FP8 GEMMs on {device.type}: torchao's emulate mode (the "
                               f"FP8 casts and scales as on a GPU, the GEMMs in fp32)")
    capability = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    able = tuple(capability) >= FP8_CAPABILITY
    if emulate == "on":
        return Emulation(True, f"model.fp8_emulate='on' on {name} (compute capability "
                               f"{capability[0]}.{capability[1]}): torchao's emulate mode, "
                               f"GEMMs in fp32 - for checking numbers, not for speed")
    if not able:
        raise Fp8Unavailable(
            f"model.fp8 needs FP8 tensor cores (compute capability >= "
            f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]}: Ada, Hopper, Blackwell); {name} has "
            f"{capability[0]}.{capability[1]}: set model.fp8='none', or "
            f"model.fp8_emulate='on' to emulate FP8 here (fp32 GEMMs: slower than bf16)")
    return Emulation(False, f"FP8 GEMMs on {name} (compute capability "
                            f"{capability[0]}.{capability[1]})")


def _float8():
    """torchao.float8, imported quietly: torchao's package import tries its CUDA extension
    libraries (MX, CUTLASS kernels float8 training does not use) and logs each that a CPU
    build of torch cannot load, and registers an enum torch warns about - noise in every
    rank's log that says nothing about this run."""
    quiet = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)
    return float8


def torchao_config(recipe: str, emulate: bool):
    """The ``Float8LinearConfig`` of ``recipe`` (runtime.choices.FP8_RECIPES' torchao name),
    with emulate mode on or off."""
    row = FP8_RECIPES[recipe]
    if row.torchao is None:
        raise ValueError(f"model.fp8={recipe!r} converts nothing")
    float8 = _float8()
    config = float8.Float8LinearConfig.from_recipe_name(row.torchao)
    return dataclasses.replace(config, emulate=emulate)


def convert(model: nn.Module, recipe: str, roles: Iterable[str], emulate: bool) -> list[str]:
    """The encoder Linears of ``roles`` in ``model`` converted to torchao's ``Float8Linear``
    with ``recipe``, in place (the same Parameters: see the module docstring), and the
    encoder's token rows made a multiple of 16 (``BertModel.token_multiple``: the weight
    gradient's GEMM has the token count as its inner dimension, and CUDA's ``_scaled_mm``
    refuses one that is not a multiple of 16 - the unpadded path's T is one in 16 steps).
    Returns the converted modules' names; a model with no such Linear is refused (model.fp8
    would do nothing)."""
    keep = module_filter(roles)
    chosen = [name for name, m in model.named_modules() if keep(m, name)]
    if not chosen:
        raise ValueError(f"model.fp8={recipe!r}: no encoder Linear of roles {sorted(roles)} "
                         f"with dimensions that are multiples of {MULTIPLE} in this model")
    _float8().convert_to_float8_training(model, module_filter_fn=keep,
                                         config=torchao_config(recipe, emulate))
    for m in model.modules():  # the token count a multiple of 16 too (runtime.model.bert)
        if hasattr(m, "token_multiple"):
            m.token_multiple = MULTIPLE
    return chosen


def converted(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The FP8 Linears of ``model`` (none when model.fp8 = 'none')."""
    return [(n, m) for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


def facts(model: nn.Module, recipe: str, emulate: str, device: torch.device | str) -> dict:
    """What the run's log, summary.json and MLPerf log say about FP8 in ``model`` (converted
    with model.fp8 = ``recipe``, model.fp8_emulate = ``emulate``, for ``device``): the
    recipe, whether it is emulated and why, how many Linears run in FP8 and of which roles."""
    layers = converted(model)
    if not layers:
        return {"recipe": "none"}
    return {"recipe": recipe, "emulated": bool(layers[0][1].config.emulate),
            "why": emulation(emulate, device).why,
            "linears": len(layers),
            "roles": sorted({role_of(n) for n, _ in layers}, key=list(FP8_ROLES).index)}
