"""Optimizers by name: LAMB, AdamW and LARS behind a registry, stepping BERT's parameter groups.

What this module owns:
  * the registry: ``register_optimizer(name)`` (refuses duplicates), ``build_optimizer(name,
    named_parameters, **hparams)``, ``available_optimizers()``, ``optimizer_hparam_names``;
  * hyperparameter validation, with errors that name the key and the valid range;
  * the parameter groups and norm blocks of ``runtime.optim.groups``, applied: a built
    optimizer takes BERT's groups from there and steps a norm block's rows as that many tensors;
  * ``torch.optim.Optimizer`` subclasses whose ``step(grad_scale=1.0)`` runs the step of
    the chosen ``backend`` (same optimizer names and hyperparameters for every backend):
      - ``reference``: per-tensor plain torch (``kernels.optim_reference``), the meaning;
      - ``foreach``: multi-tensor ``torch._foreach_*`` (``kernels.optim_foreach``);
      - ``fused``: flat contiguous buffers, one or two compiled passes per step
        (``kernels.optim_flat``, bound to the optimizer by ``runtime.optim.flat_binding``; the
        model's parameters and gradients become views of the buffers);
      - ``apex``: apex's FusedLAMB/FusedAdam kernels (``kernels.optim_apex``), offered only
        where NVIDIA apex imports, CUDA only, LAMB and AdamW;
      - ``auto`` (the config default): ``fused`` on CPU and CUDA — fastest there in
        ``bench.optim`` — and ``foreach`` on any other device (``resolve_backend``).
  * ``grad_norm()``: the global gradient norm (one reduction over the flat gradient buffer
    with ``fused``, ``kernels.optim_reference.global_grad_norm`` otherwise), for callers that
    step an optimizer without a gradient sync (the trainer takes the sync's ``grad_norm``);
  * the backend table (``_BACKENDS``): one ``Backend`` row per (optimizer, backend), a
    per-tensor step function or a flat-buffer step class - ``fused`` is such a row, not a
    special case.

What it never does:
  * clip. The runtime computes the global clip coefficient (``kernels.optim_reference.
    clip_coefficient_of_norm``, in runtime.optim.grad_scale) and passes it, times any loss-scale unscale factor, as
    ``step(grad_scale=...)``; the step multiplies every gradient by it. There is no
    ``max_grad_norm`` here, so the runtime never clips twice (apex FusedLAMB would).
  * schedule the learning rate: the runtime writes each group's ``"lr"`` before ``step``
    (``set_lr``; see ``runtime.optim.schedules``). Group ``lr`` is validated (> 0) only when the
    optimizer is built — the schedule may legitimately set 0 (first warm-up step).

Step counting: each parameter's state holds ``"step"``, the number of updates applied to it;
it is incremented before the update, so bias correction uses β^step with step = 1, 2, …
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

from kernels import optim_apex as _apex
from kernels import optim_flat as _flat
from kernels import optim_foreach as _foreach
from kernels import optim_reference as _ref
from runtime.choices import hparam_error
from runtime.optim.flat_binding import FlatBinding
from runtime.optim.groups import norm_blocks, param_groups_for_bert

SHARD_KEY = "presto_shards"
"""Where a sharded optimizer's state_dict says how its shards fit together."""

__all__ = [
    "StateOfOtherParameters",
    "Lamb",
    "AdamW",
    "Lars",
    "available_backends",
    "resolve_backend",
    "available_optimizers",
    "build_optimizer",
    "optimizer_hparam_names",
    "register_optimizer",
    "set_lr",
]

@dataclass(frozen=True)
class Backend:
    """One way to run an optimizer's step: per tensor (``step``, with the reference
    function's signature) or over flat buffers (``flat``, a kernels.optim_flat step class that
    runtime.optim.flat_binding binds the parameters to)."""

    step: Optional[Callable[..., None]] = None
    flat: Optional[type] = None


# optimizer name -> backend name -> Backend. A fast backend is a row here under a new name,
# tested against the reference; nothing else branches on it.
_BACKENDS: dict[str, dict[str, Backend]] = {
    "lamb": {"reference": Backend(_ref.lamb_step), "foreach": Backend(_foreach.lamb_step),
             "fused": Backend(flat=_flat.FusedLamb)},
    "adamw": {"reference": Backend(_ref.adamw_step), "foreach": Backend(_foreach.adamw_step),
              "fused": Backend(flat=_flat.FusedAdamW)},
    "lars": {"reference": Backend(_ref.lars_step), "foreach": Backend(_foreach.lars_step),
             "fused": Backend(flat=_flat.FusedLars)},
}
# optim.lamb_update -> LAMB's fused step class in place of the backend's (None: the
# backend's own; the per-tensor backends always recompute u)
LAMB_UPDATES: dict[str, type | None] = {"recompute": None,
                                        "stored": _flat.FusedLambStoredUpdate}

if _apex.available():  # never offered where NVIDIA apex does not import
    _BACKENDS["lamb"]["apex"] = Backend(_apex.lamb_step)
    _BACKENDS["adamw"]["apex"] = Backend(_apex.adamw_step)

AUTO = "auto"


def available_backends(optimizer: str) -> tuple[str, ...]:
    names = set(_BACKENDS.get(optimizer, {}))
    if names:
        names.add(AUTO)
    return tuple(sorted(names))


def resolve_backend(optimizer: str, backend: str, device: torch.device) -> str:
    """The backend that runs: ``auto`` becomes ``fused`` on CPU and CUDA (the fastest there,
    see docs/BENCHMARKS.md) and ``foreach`` elsewhere; ``apex`` needs CUDA."""
    device = torch.device(device)
    if backend == AUTO:
        return "fused" if device.type in ("cpu", "cuda") else "foreach"
    if backend == "apex" and device.type != "cuda":
        raise ValueError(f"{optimizer}: backend 'apex' runs on CUDA only, the parameters are "
                         f"on {device}; use 'fused' or 'auto'")
    return backend


# --------------------------------------------------------------------------- validation

def _validate(opt: str, hparams: Mapping[str, Any]) -> None:
    for key, value in hparams.items():
        if key == "backend":
            if value not in available_backends(opt):
                hint = (" (apex needs NVIDIA apex with its CUDA extensions: importing "
                        "apex.optimizers and amp_C failed here)") if value == "apex" else ""
                raise ValueError(
                    f"{opt}: backend {value!r} is not available{hint}; available backends: "
                    f"{', '.join(available_backends(opt))}")
            continue
        why = hparam_error(key, value)
        if why:
            raise ValueError(f"{opt}: hyperparameter '{key}' {why}")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Write the scheduled learning rate into every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr


# --------------------------------------------------------------------------- optimizers

def _eager(method: Callable) -> Callable:
    """torch.optim.Optimizer's ``method`` without torch's lazy dynamo guard. torch wraps
    add_param_group, zero_grad, state_dict and load_state_dict in ``torch._disable_dynamo``,
    which imports torch._dynamo on the first call (1.3 s of every rank's start-up here) only to
    keep a compiled caller from tracing into them. Nothing compiled calls them: the fused
    backend compiles its own passes (runtime.optim.flat_binding), the others compile nothing -
    so a run of the foreach, apex or reference backend never imports dynamo."""
    return getattr(method, "__wrapped__", method)


class _PrestoOptimizer(torch.optim.Optimizer):
    """Common part: validation, backend choice, per-step grouping by state step.

    ``param_order``: the model's parameters in registration order (the builders pass it);
    the ``fused`` backend lays its buffers out in the reverse order, DDP's bucket order.
    ``fused`` binds the parameters at construction and compiles its passes then
    (``compile_seconds``), so compiling happens in init, never in a timed step.
    """

    name = ""  # registry / backend-table name

    def __init__(self, params, defaults: dict[str, Any], backend: str,
                 param_order=None, master_weights: bool = False,
                 flat_step: type | None = None) -> None:
        _validate(self.name, {**defaults, "backend": backend})
        self._flat: FlatBinding | None = None
        super().__init__(params, defaults)
        # id(param) -> its norm blocks, from the groups' names (ready-made groups without
        # names: none); kept beside the groups, so loading a state dict cannot drop them
        self._blocks = {id(p): k for g in self.param_groups
                        for p, name in zip(g["params"], g.get("param_names", ()))
                        if (k := norm_blocks(name)) > 1}
        self.requested_backend = backend
        self.backend = resolve_backend(self.name, backend, self._device())
        self.compile_seconds = 0.0
        row = _BACKENDS[self.name][self.backend]
        if master_weights and row.flat is None:
            raise ValueError(f"{self.name}: fp32 master weights (train.precision '*_master') "
                             f"need the fused backend (optim.backend 'auto' or 'fused'), not "
                             f"{self.backend!r}")
        if flat_step is not None and row.flat is None:
            raise ValueError(f"{self.name}: {flat_step.__name__} is a step of the fused backend "
                             f"(optim.backend 'auto' or 'fused'), not {self.backend!r}")
        if row.flat is not None:
            self._flat = FlatBinding(self, flat_step or row.flat, param_order,
                                     master=master_weights,
                                     blocks=self._blocks)
            self.compile_seconds = self._flat.warmup()
        else:
            self._step_fn = row.step

    def _device(self) -> torch.device:
        for group in self.param_groups:
            for p in group["params"]:
                return p.device
        return torch.device("cpu")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_flat", None) is not None:
            raise RuntimeError(f"{self.name}: the fused backend binds its parameters when it "
                               "is built; build a new optimizer instead of add_param_group")
        _validate(self.name, {k: v for k, v in param_group.items()
                              if k in self.defaults or k == "adapt"})
        _eager(torch.optim.Optimizer.add_param_group)(self, param_group)

    @property
    def flat_binding(self) -> FlatBinding | None:
        """The fused backend's buffers and layout (None for other backends)."""
        return self._flat

    def zero_grad(self, set_to_none: bool = True) -> None:
        """With ``fused``: zero the flat gradient buffer, gradients stay views (never None,
        whatever ``set_to_none`` says; see runtime.optim.flat_binding). Otherwise torch's."""
        if self._flat is not None:
            self._flat.zero_grad()
        else:
            _eager(torch.optim.Optimizer.zero_grad)(self, set_to_none=set_to_none)

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients (0-dim fp32); non-finite if any gradient is."""
        if self._flat is not None:
            return self._flat.grad_norm()
        return _ref.global_grad_norm([p.grad for g in self.param_groups for p in g["params"]])

    def _params_by_index(self) -> list[torch.Tensor]:
        """The parameters in state_dict's numbering (group after group)."""
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict; sharded (``optim.shard``), per tensor only its step count,
        and under ``SHARD_KEY`` how the shards (``shard_state_dict``) fit together."""
        out = _eager(torch.optim.Optimizer.state_dict)(self)
        meta = None if self._flat is None else self._flat.shard_meta(
            {id(p): i for i, p in enumerate(self._params_by_index())})
        if meta is not None:
            out[SHARD_KEY] = meta
        return out

    def load_state_dict(self, state_dict) -> None:
        """torch's; a sharded state dict's ``SHARD_KEY`` is left for ``load_shard_states``
        (the shards are in other files). The state of other parameters - where both name
        them (``param_names``), another name at any place - is refused naming the first
        that differ: torch compares the groups' sizes alone, so the state of another model
        with as many tensors would land on the wrong ones."""
        state_dict = {k: v for k, v in state_dict.items() if k != SHARD_KEY}
        _check_names(self.param_groups, state_dict.get("param_groups", []))
        _eager(torch.optim.Optimizer.load_state_dict)(self, state_dict)
        self._keep_state_dtypes(state_dict.get("state", {}))
        if self._flat is not None:
            self._flat.adopt_state()

    @torch.no_grad()
    def _keep_state_dtypes(self, saved: dict) -> None:
        """torch's ``load_state_dict`` casts every floating state tensor to its parameter's
        dtype: a bf16 parameter's fp32 master weight and moments came back in bf16, and a
        resumed bf16_master run drifted from the one it continues. The state keeps the
        dtype it was saved in."""
        params = self._params_by_index()
        for index, entries in saved.items():
            p = params[int(index)]
            for key, value in entries.items():
                have = self.state[p].get(key)
                if (torch.is_tensor(value) and torch.is_tensor(have)
                        and value.is_floating_point() and have.dtype != value.dtype):
                    self.state[p][key] = value.to(device=have.device, copy=True)

    @property
    def shard(self):
        """The shard this optimizer steps (runtime.grad_sync.shard.Shard), or None."""
        return None if self._flat is None else self._flat.shard

    @property
    def keeps_masters(self) -> bool:
        """Whether it keeps fp32 master weights of lower-precision parameters."""
        return self._flat is not None and self._flat.keeps_masters

    @torch.no_grad()
    def seed_masters(self, values: dict[int, torch.Tensor]) -> None:
        """The master weights' exact fp32 values ({id(param): tensor}: the model's before it
        was cast to its training dtype, runtime.model.precision.to_params_dtype)."""
        for p in self._params_by_index():
            self.state[p]["master"] = values[id(p)]
        self._flat.adopt_state()

    def masters(self) -> dict[int, torch.Tensor]:
        """{id(param): fp32 master weight}; sharded, gathered from every shard (a collective:
        every rank of the shard group calls it)."""
        return self._flat.masters()

    def shard_state_dict(self) -> dict[str, Any] | None:
        """This rank's shard of the state ({index, window, state}), None when not sharded."""
        return None if self._flat is None else self._flat.shard_state()

    def load_shard_states(self, meta: dict, read: Callable[[int], dict]) -> str:
        """After ``load_state_dict`` of a sharded state dict: the shards' state, from
        ``read(j)`` (shard j's ``shard_state_dict``), onto this optimizer however it is
        sharded now (see FlatBinding.load_shards). Returns what it did."""
        if self._flat is None:
            raise ValueError(f"{self.name}: sharded optimizer state needs the fused backend "
                             f"(optim.backend 'auto' or 'fused')")
        return self._flat.load_shards(meta, read, self._params_by_index())

    def _hparams(self, group) -> dict[str, Any]:
        """The step function's keyword arguments for ``group`` (but step and grad_scale)."""
        raise NotImplementedError

    def _params_with_grad(self, group):
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{self.name}: sparse gradients are not supported")
            yield p

    def _state_zeros(self, p: torch.Tensor) -> torch.Tensor:
        # State is fp32 for fp32/bf16/fp16 parameters (fp64 for fp64), as the step math.
        return torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32),
                                memory_format=torch.preserve_format)

    @torch.no_grad()
    def step(self, closure=None, grad_scale: float | torch.Tensor = 1.0,
             found_inf: torch.Tensor | None = None):
        """One update of every parameter that has a gradient.

        ``grad_scale`` multiplies every gradient inside the step: pass the runtime's clip
        coefficient times any loss-scale unscale factor (float or 0-dim tensor).
        ``found_inf`` (0-dim bool tensor): when True, nothing changes - parameters, state and
        step counts stay as they were (a non-finite gradient). The ``fused`` backend decides
        on the device; the per-tensor backends read the flag on the host (one sync).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._flat is not None:
            self._flat.step(grad_scale, self._hparams, found_inf)
            return loss
        if found_inf is not None and bool(found_inf):
            return loss
        for group in self.param_groups:
            self._step_group(group, grad_scale)
        return loss

    def share_gradients(self, grads: torch.Tensor, ordered, shard=None) -> None:
        """The gradient sync's flat buffer and its parameter order (``GradSync.on_layout``):
        the ``fused`` backend steps on it instead of copying it each step; the per-tensor
        backends already step on each ``.grad`` view where it lies. ``shard``: the sync
        reduces the gradient to shards (optim.shard) - step this rank's only."""
        if self._flat is not None:
            self._flat.share_gradients(grads, ordered, shard)
        elif shard is not None:
            raise ValueError(f"{self.name}: optim.shard needs the fused backend (optim.backend "
                             f"'auto' or 'fused'), not {self.backend!r}")

    def _step_group(self, group, grad_scale) -> None:
        raise NotImplementedError

    def _blocks_of(self, p: torch.Tensor, *state: torch.Tensor) -> list[tuple]:
        """For ``p`` and each of ``state`` (its gradient and optimizer state), the tensors
        the step function takes: the tensor itself, or its ``norm_blocks`` row blocks (views:
        the step writes through them)."""
        k = self._blocks.get(id(p), 1)
        return [(t,) if k == 1 else t.chunk(k) for t in (p, *state)]


class StateOfOtherParameters(ValueError):
    """``load_state_dict`` of a state dict whose groups name other parameters."""


def _check_names(groups: list[dict], saved: list[dict]) -> None:
    """StateOfOtherParameters when a saved group names other parameters than this
    optimizer's group at the same place (a group or state dict without names is not
    compared)."""
    for i, (mine, theirs) in enumerate(zip(groups, saved)):
        ours, its = mine.get("param_names"), theirs.get("param_names")
        if ours is None or its is None or list(ours) == list(its):
            continue
        at = next((j for j, (x, y) in enumerate(zip(ours, its)) if x != y),
                  min(len(ours), len(its)))
        raise StateOfOtherParameters(
            f"the optimizer state is for other parameters: its group {i} has {len(its)} "
            f"tensors, {_name_at(its, at)} at place {at}, where this model has {len(ours)}, "
            f"{_name_at(ours, at)} (another model layout - model.fusions 'qkv' makes the "
            f"attention's query/key/value one Wqkv - or another model)")


def _name_at(names: list, at: int) -> str:
    return repr(names[at]) if at < len(names) else "nothing"


class _AdamFamily(_PrestoOptimizer):
    """LAMB and AdamW share m, v state and the bias-corrected Adam direction."""

    def _step_group(self, group, grad_scale) -> None:
        by_step: dict[int, tuple[list, list, list, list]] = {}
        for p in self._params_with_grad(group):
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["exp_avg"] = self._state_zeros(p)
                state["exp_avg_sq"] = self._state_zeros(p)
            state["step"] += 1
            lists = by_step.setdefault(state["step"], ([], [], [], []))
            for lst, ts in zip(lists, self._blocks_of(p, p.grad, state["exp_avg"],
                                                      state["exp_avg_sq"]), strict=True):
                lst.extend(ts)
        # Normally one bucket: all parameters have taken the same number of steps.
        for step, (params, grads, exp_avgs, exp_avg_sqs) in by_step.items():
            self._call(group, params, grads, exp_avgs, exp_avg_sqs, step, grad_scale)

    def _call(self, group, params, grads, exp_avgs, exp_avg_sqs, step, grad_scale) -> None:
        raise NotImplementedError


class Lamb(_AdamFamily):
    """LAMB (You et al., paper v5) with decoupled weight decay inside the trust ratio.

    Per group: ``weight_decay`` and ``adapt`` (layer adaptation on/off; groups without the
    key adapt). ``use_nvlamb=True`` adapts every tensor (apex semantics) while keeping each
    group's weight decay. ``trust_clamp`` clamps ‖x‖ in the ratio (None = identity, the
    reference). No clipping inside: see module docstring.
    """

    name = "lamb"

    def __init__(self, params, *, lr: float, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-6, weight_decay: float = 0.01, bias_correction: bool = True,
                 trust_clamp: float | None = None, use_nvlamb: bool = False,
                 backend: str = "reference", param_order=None,
                 master_weights: bool = False, lamb_update: str = "recompute") -> None:
        _validate(self.name, {"use_nvlamb": use_nvlamb})
        if lamb_update not in LAMB_UPDATES:
            raise ValueError(f"lamb: lamb_update {lamb_update!r} is not one of "
                             f"{', '.join(LAMB_UPDATES)}")
        self.use_nvlamb = use_nvlamb
        defaults = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, trust_clamp=trust_clamp, adapt=True)
        super().__init__(params, defaults, backend, param_order, master_weights,
                         flat_step=LAMB_UPDATES[lamb_update])

    def _hparams(self, group) -> dict[str, Any]:
        return dict(lr=group["lr"], beta1=group["beta1"], beta2=group["beta2"],
                    eps=group["eps"], weight_decays=group["weight_decay"],
                    adapt_flags=True if self.use_nvlamb else group["adapt"],
                    bias_correction=group["bias_correction"],
                    trust_clamp=group["trust_clamp"])

    def _call(self, group, params, grads, exp_avgs, exp_avg_sqs, step, grad_scale) -> None:
        self._step_fn(params, grads, exp_avgs, exp_avg_sqs, step=step, grad_scale=grad_scale,
                      **self._hparams(group))


class AdamW(_AdamFamily):
    """AdamW: u = m̂/(√v̂+ε) + λx, x ← x − lr·u (equal to torch.optim.AdamW)."""

    name = "adamw"

    def __init__(self, params, *, lr: float, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8, weight_decay: float = 0.01, bias_correction: bool = True,
                 backend: str = "reference", param_order=None,
                 master_weights: bool = False) -> None:
        defaults = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction)
        super().__init__(params, defaults, backend, param_order, master_weights)

    def _hparams(self, group) -> dict[str, Any]:
        return dict(lr=group["lr"], beta1=group["beta1"], beta2=group["beta2"],
                    eps=group["eps"], weight_decays=group["weight_decay"],
                    bias_correction=group["bias_correction"])

    def _call(self, group, params, grads, exp_avgs, exp_avg_sqs, step, grad_scale) -> None:
        self._step_fn(params, grads, exp_avgs, exp_avg_sqs, step=step, grad_scale=grad_scale,
                      **self._hparams(group))


class Lars(_PrestoOptimizer):
    """LARS: local_lr = η_trust·‖w‖/(‖g‖+λ‖w‖+ε), momentum on lr·local_lr·(g+λw).

    Per group: ``weight_decay`` and ``adapt`` (excluded tensors use local_lr = 1).
    """

    name = "lars"

    def __init__(self, params, *, lr: float, momentum: float = 0.9,
                 trust_coefficient: float = 0.001, eps: float = 1e-9,
                 weight_decay: float = 0.01, backend: str = "reference",
                 param_order=None, master_weights: bool = False) -> None:
        defaults = dict(lr=lr, momentum=momentum, trust_coefficient=trust_coefficient,
                        eps=eps, weight_decay=weight_decay, adapt=True)
        super().__init__(params, defaults, backend, param_order, master_weights)

    def _hparams(self, group) -> dict[str, Any]:
        return dict(lr=group["lr"], momentum=group["momentum"],
                    trust_coefficient=group["trust_coefficient"], eps=group["eps"],
                    weight_decays=group["weight_decay"], adapt_flags=group["adapt"])

    def _step_group(self, group, grad_scale) -> None:
        params, grads, bufs = [], [], []
        for p in self._params_with_grad(group):
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["momentum_buffer"] = self._state_zeros(p)
            state["step"] += 1
            for lst, ts in zip((params, grads, bufs),
                               self._blocks_of(p, p.grad, state["momentum_buffer"]),
                               strict=True):
                lst.extend(ts)
        if params:
            self._step_fn(params, grads, bufs, grad_scale=grad_scale, **self._hparams(group))


# --------------------------------------------------------------------------- registry

_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {}


def register_optimizer(name: str):
    """Decorator: register ``builder(named_parameters, **hparams) -> Optimizer`` as ``name``.

    Refuses a name that is already registered (ValueError), so two modules can never
    silently replace each other's optimizer.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"optimizer name must be a non-empty string, got {name!r}")

    def decorator(builder):
        if name in _OPTIMIZERS:
            raise ValueError(f"optimizer {name!r} is already registered "
                             f"(by {_OPTIMIZERS[name].__module__}."
                             f"{_OPTIMIZERS[name].__qualname__}); choose another name")
        _OPTIMIZERS[name] = builder
        return builder

    return decorator


def available_optimizers() -> tuple[str, ...]:
    return tuple(sorted(_OPTIMIZERS))


def _builder(name: str):
    try:
        return _OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r}; available optimizers: "
                         f"{', '.join(available_optimizers())}") from None


def _hparam_params(builder) -> dict[str, inspect.Parameter]:
    params = list(inspect.signature(builder).parameters.values())[1:]  # skip named_parameters
    return {p.name: p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def optimizer_hparam_names(name: str) -> tuple[str, ...]:
    """The hyperparameters ``build_optimizer(name, ...)`` accepts (to filter a config)."""
    return tuple(_hparam_params(_builder(name)))


def build_optimizer(name: str, named_parameters, **hparams) -> torch.optim.Optimizer:
    """Build the optimizer registered as ``name``.

    ``named_parameters``: (name, tensor) pairs, e.g. ``model.named_parameters()``, grouped
    with ``param_groups_for_bert``; or a list of ready parameter-group dicts, used as is.
    Unknown names, unknown or missing hyperparameters and out-of-range values raise
    ValueError naming the key.
    """
    builder = _builder(name)
    accepted = _hparam_params(builder)
    unknown = sorted(set(hparams) - set(accepted))
    if unknown:
        raise ValueError(f"{name}: unknown hyperparameter(s) {', '.join(map(repr, unknown))}; "
                         f"accepted: {', '.join(accepted)}")
    missing = [k for k, p in accepted.items()
               if p.default is inspect.Parameter.empty and k not in hparams]
    if missing:
        raise ValueError(f"{name}: hyperparameter(s) {', '.join(map(repr, missing))} required")
    _validate(name, hparams)
    return builder(named_parameters, **hparams)


def _groups(named_parameters, weight_decay: float):
    """(parameter groups, the model's parameter order or None for ready-made groups)."""
    items = list(named_parameters)
    if items and all(isinstance(g, dict) for g in items):
        return items, None
    groups = param_groups_for_bert(items, weight_decay)
    if not groups:
        raise ValueError("no trainable parameters: every tensor has requires_grad=False "
                         "(or the list is empty)")
    return groups, [p for _, p in items]


@register_optimizer("lamb")
def _build_lamb(named_parameters, *, lr: float, beta1: float = 0.9, beta2: float = 0.999,
                eps: float = 1e-6, weight_decay: float = 0.01, bias_correction: bool = True,
                trust_clamp: float | None = None, use_nvlamb: bool = False,
                backend: str = "reference", master_weights: bool = False,
                lamb_update: str = "recompute") -> Lamb:
    groups, order = _groups(named_parameters, weight_decay)
    return Lamb(groups, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                bias_correction=bias_correction, trust_clamp=trust_clamp,
                use_nvlamb=use_nvlamb, backend=backend, param_order=order,
                master_weights=master_weights, lamb_update=lamb_update)


@register_optimizer("adamw")
def _build_adamw(named_parameters, *, lr: float, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8, weight_decay: float = 0.01, bias_correction: bool = True,
                 backend: str = "reference", master_weights: bool = False) -> AdamW:
    groups, order = _groups(named_parameters, weight_decay)
    return AdamW(groups, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                 bias_correction=bias_correction, backend=backend, param_order=order,
                 master_weights=master_weights)


@register_optimizer("lars")
def _build_lars(named_parameters, *, lr: float, momentum: float = 0.9,
                trust_coefficient: float = 0.001, eps: float = 1e-9,
                weight_decay: float = 0.01, backend: str = "reference",
                master_weights: bool = False) -> Lars:
    groups, order = _groups(named_parameters, weight_decay)
    return Lars(groups, lr=lr, momentum=momentum, trust_coefficient=trust_coefficient,
                eps=eps, weight_decay=weight_decay, backend=backend, param_order=order,
                master_weights=master_weights)
