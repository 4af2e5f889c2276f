"""Changes made to a built model from outside it, as a list applied in one declared order -
torchtitan's model-converter protocol (``torchtitan/protocols/model_converter.py``: each
converter ``convert``s the model in place and says how its state-dict keys map; a container
applies them in order and composes the mappings in reverse).

    CONVERTERS   the rows, in the order ``convert`` applies them to a model built with its
                 initial weights (runtime.train.build.build_model):

      name     asked by            what it does                            state dict
      qkv      model.fusions qkv   each layer's Q, K and V Linears become  Wqkv [3H, H] <->
                                   one Wqkv (one GEMM, one bias add)       HF's query/key/value
      fp8      model.fp8           the encoder's Linears of fp8_layers     unchanged: the same
                                   become torchao's Float8Linear           Parameters
      compile  model.compile       each encoder layer's forward compiled   unchanged
                                   with Inductor

Why this order: the one QKV Linear must exist before FP8 picks the Linears to convert (its
role ``qkv`` names ``Wqkv`` too), and a layer is compiled last, tracing the FP8 Linears. Every
converter runs after the weights are set (``model.init``: HF files hold the split layout, which
``qkv`` then fuses), so a checkpoint, an export and a resume see the model the list made.

A row says what its converter needs (``needs``: the config keys its ``from_config`` reads -
tests/unit/test_converters.py holds each converter to its row's keys) and its state-dict
mapping where it has one (``to_hf``: the model's keys -> Hugging Face's; runtime.model.hf's
``hf_layout`` composes them in reverse order, and loading HF weights into a converted model
reads through the same views). A new model change is a row here and a class with
``from_config`` and ``convert``.

Owns: ``ModelConverter`` (the protocol), the converters (``FuseQKV``, ``Fp8Linears``,
``CompiledLayers``), ``CONVERTERS`` and ``convert``, ``to_hf``.
Never: imports the config (``from_config`` reads the keys its row names from the config it is
handed, as torchtitan's converters take the job config), sets weights, or converts a model
twice (each converter refuses a model it already converted).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Protocol

import torch
from torch import nn

from runtime.choices import COMPILE_MODES, FP8_RECIPES
from runtime.model import fp8
from runtime.model.bert import BertSelfAttention
from runtime.model.compile import compile_layers


class ModelConverter(Protocol):
    """A change to a built model, made in place (see the module docstring)."""

    def convert(self, model: nn.Module) -> None:
        ...


# ------------------------------------------------------------------------------ qkv

_FUSED_QKV = re.compile(r"^(?P<prefix>.*\.attention\.self\.)Wqkv\.(?P<kind>weight|bias)$")
_QKV = ("query", "key", "value")
"""The fused projection's row blocks, in order (runtime.model.bert.BertSelfAttention.Wqkv)."""


class FuseQKV:
    """Fusion ``qkv`` (model.fusions): each ``BertSelfAttention``'s ``query``, ``key`` and
    ``value`` Linears become one ``Wqkv`` whose [3H, H] weight holds their rows in that order
    (and its [3H] bias likewise) - the same numbers, one GEMM and one bias add instead of
    three (NVIDIA's MLPerf BERT and MosaicBERT keep one Wqkv). No random number is drawn: the
    split layout's initial weights (or the HF file's) are the fused ones."""

    @classmethod
    def from_config(cls, cfg: Any, device: Optional[torch.device] = None) -> Optional["FuseQKV"]:
        return cls() if "qkv" in cfg.model.fusions else None

    @torch.no_grad()
    def convert(self, model: nn.Module) -> None:
        layers = [m for m in model.modules() if isinstance(m, BertSelfAttention)]
        if not layers or any(m.fused_qkv for m in layers):
            raise ValueError("fusion 'qkv': the model has no split Q, K and V projections "
                             "(fused already, or no attention layer)")
        for m in layers:
            q, k, v = m.query, m.key, m.value
            fused = nn.Linear(q.in_features, 3 * q.out_features, device="meta")
            fused.weight = nn.Parameter(torch.cat([q.weight, k.weight, v.weight]),
                                        requires_grad=q.weight.requires_grad)
            fused.bias = nn.Parameter(torch.cat([q.bias, k.bias, v.bias]),
                                      requires_grad=q.bias.requires_grad)
            del m.query, m.key, m.value
            m.Wqkv, m.fused_qkv = fused, True

    @staticmethod
    def to_hf(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` with each ``...attention.self.Wqkv.weight`` / ``.bias`` as HF's
        ``query``, ``key`` and ``value`` keys, row blocks of it (views, no copy) in the order
        the split layout's ``state_dict()`` has them (weight, bias; query, key, value); every
        other key as it is. A state dict in HF's layout comes back as it was."""
        out: dict[str, torch.Tensor] = {}
        for key, tensor in state.items():
            m = _FUSED_QKV.match(key)
            if m is None:
                out[key] = tensor
                continue
            prefix = m["prefix"]
            if m["kind"] == "bias" and prefix + "Wqkv.weight" in state:
                continue  # written beside its weight, as the split layout orders them
            kinds = [k for k in ("weight", "bias") if prefix + f"Wqkv.{k}" in state] \
                if m["kind"] == "weight" else ["bias"]
            blocks = {k: _thirds(prefix + f"Wqkv.{k}", state[prefix + f"Wqkv.{k}"])
                      for k in kinds}
            for i, name in enumerate(_QKV):
                for k in kinds:
                    out[f"{prefix}{name}.{k}"] = blocks[k][i]
        return out


def _thirds(key: str, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if tensor.dim() < 1 or tensor.shape[0] % 3:
        raise ValueError(f"{key}: shape {tuple(tensor.shape)} is not Q, K and V rows (its first "
                         f"dimension must be 3 x hidden_size)")
    return tensor.chunk(3)


# ------------------------------------------------------------------------------ fp8

class Fp8Linears:
    """model.fp8: the encoder Linears of ``roles`` (model.fp8_layers) as torchao's
    ``Float8Linear`` with ``recipe``, emulated or not (runtime.model.fp8: which Linears, the
    token rows a multiple of 16, why emulated). The same Parameters: no state-dict mapping."""

    def __init__(self, recipe: str, roles, emulate: bool):
        self.recipe, self.roles, self.emulate = recipe, tuple(roles), emulate

    @classmethod
    def from_config(cls, cfg: Any, device: Optional[torch.device] = None) -> Optional["Fp8Linears"]:
        """``device``: the one the model will run on (default: system.device, 'auto' being
        CUDA where present) - real FP8 or torchao's emulate mode (``fp8.emulation``)."""
        m = cfg.model
        if FP8_RECIPES[m.fp8].torchao is None:
            return None
        if device is None:
            device = torch.device("cuda" if cfg.system.device != "cpu" and
                                  torch.cuda.is_available() else "cpu")
        return cls(m.fp8, m.fp8_layers, fp8.emulation(m.fp8_emulate, device).emulate)

    def convert(self, model: nn.Module) -> None:
        if fp8.converted(model):
            raise ValueError(f"model.fp8={self.recipe!r}: the model has FP8 Linears already")
        fp8.convert(model, self.recipe, self.roles, self.emulate)


# ------------------------------------------------------------------------------ compile

class CompiledLayers:
    """model.compile = 'layers': each encoder layer's forward compiled (runtime.model.compile;
    ``static_shapes`` under data.shapes = 'static'). Parameters and state dict unchanged."""

    def __init__(self, static_shapes: bool):
        self.static_shapes = static_shapes

    @classmethod
    def from_config(cls, cfg: Any, device: Optional[torch.device] = None) -> Optional["CompiledLayers"]:
        if not COMPILE_MODES[cfg.model.compile].layers:
            return None
        return cls(static_shapes=cfg.data.shapes == "static")

    def convert(self, model: nn.Module) -> None:
        compile_layers(model, static_shapes=self.static_shapes)


# ------------------------------------------------------------------------------ the rows

@dataclass(frozen=True)
class Converter:
    """One change of the list (see the module docstring): its ``name``, its class (with
    ``from_config(cfg, device)`` - the converter, or None where the run does not ask for it -
    and ``convert(model)``), what it ``needs`` (the config keys ``from_config`` reads) and
    its state-dict mapping to HF's keys (``to_hf``; None: the model's keys are HF's)."""

    name: str
    cls: type
    needs: tuple[str, ...]
    to_hf: Optional[Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]] = None


CONVERTERS: tuple[Converter, ...] = (
    Converter("qkv", FuseQKV, ("model.fusions",), FuseQKV.to_hf),
    Converter("fp8", Fp8Linears, ("model.fp8", "model.fp8_layers", "model.fp8_emulate",
                                  "system.device")),
    Converter("compile", CompiledLayers, ("model.compile", "data.shapes")),
)
"""Every model change, in the order ``convert`` applies them (the fusions among them -
kernels.fusions.CONVERTED - under their fusion's name)."""


def convert(model: nn.Module, cfg: Any, device: Optional[torch.device] = None) -> list[str]:
    """Apply to ``model`` every row of ``CONVERTERS`` the run of ``cfg`` asks for, in their
    order (``device``: the one the model will run on, for FP8's emulation). Returns the
    names applied."""
    done = []
    for row in CONVERTERS:
        converter = row.cls.from_config(cfg, device)
        if converter is not None:
            converter.convert(model)
            done.append(row.name)
    return done


def to_hf(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a converted model's keys, or HF's) with HF's keys: the rows' mappings
    composed in reverse order (the last change undone first)."""
    out = dict(state)
    for row in reversed(CONVERTERS):
        if row.to_hf is not None:
            out = row.to_hf(out)
    return out
