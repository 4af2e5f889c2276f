"""Optimizers by name: LAMB, AdamW and LARS behind a registry, and BERT parameter grouping.

What this module owns:
  * the registry: ``register_optimizer(name)`` (refuses duplicates), ``build_optimizer(name,
    named_parameters, **hparams)``, ``available_optimizers()``, ``optimizer_hparam_names``;
  * hyperparameter validation, with errors that name the key and the valid range;
  * the MLPerf parameter grouping (``param_groups_for_bert``): names containing ``bias``,
    ``LayerNorm``, ``layer_norm``, ``gamma`` or ``beta`` get no weight decay and no layer
    adaptation; every other tensor gets both;
  * ``torch.optim.Optimizer`` subclasses whose ``step(grad_scale=1.0)`` hands per-tensor
    lists to a step function chosen by ``backend`` (today only ``"reference"``, the
    plain-torch functions in ``kernels.optim_reference``; fast backends plug in under new
    backend names in ``_BACKENDS`` without changing optimizer names or hyperparameters).

What it never does:
  * clip. The runtime computes the global clip coefficient (``kernels.optim_reference.
    clip_coefficient``) and passes it, times any loss-scale unscale factor, as
    ``step(grad_scale=...)``; the step multiplies every gradient by it. There is no
    ``max_grad_norm`` here, so the runtime never clips twice (apex FusedLAMB would).
  * schedule the learning rate: the runtime writes each group's ``"lr"`` before ``step``
    (``set_lr``; see ``runtime.schedules``). Group ``lr`` is validated (> 0) only when the
    optimizer is built — the schedule may legitimately set 0 (first warm-up step).

Step counting: each parameter's state holds ``"step"``, the number of updates applied to it;
it is incremented before the update, so bias correction uses β^step with step = 1, 2, …
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from kernels import optim_reference as _ref

__all__ = [
    "NO_DECAY_NAME_PARTS",
    "Lamb",
    "AdamW",
    "Lars",
    "available_backends",
    "available_optimizers",
    "build_optimizer",
    "excluded_from_decay",
    "optimizer_hparam_names",
    "param_groups_for_bert",
    "register_optimizer",
    "set_lr",
]

#: MLPerf reference (TF BERT) exclusion: no weight decay and no layer adaptation.
NO_DECAY_NAME_PARTS = ("bias", "LayerNorm", "layer_norm", "gamma", "beta")

# optimizer name -> backend name -> step function. A fast backend registers here under a
# new backend name with the reference function's signature and is tested against it.
_BACKENDS: dict[str, dict[str, Callable[..., None]]] = {
    "lamb": {"reference": _ref.lamb_step},
    "adamw": {"reference": _ref.adamw_step},
    "lars": {"reference": _ref.lars_step},
}


def available_backends(optimizer: str) -> tuple[str, ...]:
    return tuple(sorted(_BACKENDS.get(optimizer, {})))


# --------------------------------------------------------------------------- validation

def _fail(opt: str, key: str, rule: str, value: Any) -> None:
    raise ValueError(f"{opt}: hyperparameter '{key}' must be {rule}, got {value!r}")


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


# key -> (predicate, description of the valid range)
_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "lr": (lambda x: _is_number(x) and x > 0, "a number > 0"),
    "beta1": (lambda x: _is_number(x) and 0 <= x < 1, "in [0, 1)"),
    "beta2": (lambda x: _is_number(x) and 0 <= x < 1, "in [0, 1)"),
    "momentum": (lambda x: _is_number(x) and 0 <= x < 1, "in [0, 1)"),
    "eps": (lambda x: _is_number(x) and x > 0, "a number > 0"),
    "weight_decay": (lambda x: _is_number(x) and x >= 0, "a number >= 0"),
    "trust_coefficient": (lambda x: _is_number(x) and x > 0, "a number > 0"),
    "trust_clamp": (lambda x: x is None or (_is_number(x) and x > 0), "None or a number > 0"),
    "bias_correction": (lambda x: isinstance(x, bool), "True or False"),
    "use_nvlamb": (lambda x: isinstance(x, bool), "True or False"),
    "adapt": (lambda x: isinstance(x, bool), "True or False"),
}


def _validate(opt: str, hparams: Mapping[str, Any]) -> None:
    for key, value in hparams.items():
        if key == "backend":
            if value not in _BACKENDS.get(opt, {}):
                raise ValueError(
                    f"{opt}: backend {value!r} is not available; available backends: "
                    f"{', '.join(available_backends(opt))}")
            continue
        rule = _RULES.get(key)
        if rule is not None and not rule[0](value):
            _fail(opt, key, rule[1], value)


# --------------------------------------------------------------------------- grouping

def excluded_from_decay(name: str) -> bool:
    """True for bias and LayerNorm tensors (MLPerf: no weight decay, no adaptation)."""
    return any(part in name for part in NO_DECAY_NAME_PARTS)


def param_groups_for_bert(named_parameters: Iterable[tuple[str, torch.Tensor]],
                          weight_decay: float) -> list[dict[str, Any]]:
    """Split (name, tensor) pairs into the MLPerf BERT groups.

    Returns up to two groups (empty ones are dropped), each with ``params``,
    ``param_names``, ``weight_decay`` and ``adapt``:
      * decay group: ``weight_decay=weight_decay, adapt=True``;
      * no-decay group (names with any of ``NO_DECAY_NAME_PARTS``): ``weight_decay=0.0,
        adapt=False``.
    Tensors with ``requires_grad=False`` are left out. Order within a group follows the input.
    """
    _validate("param_groups_for_bert", {"weight_decay": weight_decay})
    decay: dict[str, list] = {"params": [], "param_names": []}
    no_decay: dict[str, list] = {"params": [], "param_names": []}
    for name, p in named_parameters:
        if not isinstance(name, str) or not isinstance(p, torch.Tensor):
            raise TypeError("param_groups_for_bert expects (name, tensor) pairs, as from "
                            f"model.named_parameters(); got ({type(name).__name__}, "
                            f"{type(p).__name__})")
        if not p.requires_grad:
            continue
        target = no_decay if excluded_from_decay(name) else decay
        target["params"].append(p)
        target["param_names"].append(name)
    groups = []
    if decay["params"]:
        groups.append({**decay, "weight_decay": float(weight_decay), "adapt": True})
    if no_decay["params"]:
        groups.append({**no_decay, "weight_decay": 0.0, "adapt": False})
    return groups


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Write the scheduled learning rate into every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr


# --------------------------------------------------------------------------- optimizers

class _PrestoOptimizer(torch.optim.Optimizer):
    """Common part: validation, backend choice, per-step grouping by state step."""

    name = ""  # registry / backend-table name

    def __init__(self, params, defaults: dict[str, Any], backend: str) -> None:
        _validate(self.name, {**defaults, "backend": backend})
        self.backend = backend
        self._step_fn = _BACKENDS[self.name][backend]
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _validate(self.name, {k: v for k, v in param_group.items()
                              if k in self.defaults or k == "adapt"})
        super().add_param_group(param_group)

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
    def step(self, closure=None, grad_scale: float | torch.Tensor = 1.0):
        """One update of every parameter that has a gradient.

        ``grad_scale`` multiplies every gradient inside the step: pass the runtime's clip
        coefficient times any loss-scale unscale factor (float or 0-dim tensor).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group, grad_scale)
        return loss

    def _step_group(self, group, grad_scale) -> None:
        raise NotImplementedError


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
            for lst, t in zip(lists, (p, p.grad, state["exp_avg"], state["exp_avg_sq"])):
                lst.append(t)
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
                 backend: str = "reference") -> None:
        _validate(self.name, {"use_nvlamb": use_nvlamb})
        self.use_nvlamb = use_nvlamb
        defaults = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, trust_clamp=trust_clamp, adapt=True)
        super().__init__(params, defaults, backend)

    def _call(self, group, params, grads, exp_avgs, exp_avg_sqs, step, grad_scale) -> None:
        self._step_fn(params, grads, exp_avgs, exp_avg_sqs, step=step, lr=group["lr"],
                      beta1=group["beta1"], beta2=group["beta2"], eps=group["eps"],
                      weight_decays=group["weight_decay"],
                      adapt_flags=True if self.use_nvlamb else group["adapt"],
                      bias_correction=group["bias_correction"], grad_scale=grad_scale,
                      trust_clamp=group["trust_clamp"])


class AdamW(_AdamFamily):
    """AdamW: u = m̂/(√v̂+ε) + λx, x ← x − lr·u (equal to torch.optim.AdamW)."""

    name = "adamw"

    def __init__(self, params, *, lr: float, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8, weight_decay: float = 0.01, bias_correction: bool = True,
                 backend: str = "reference") -> None:
        defaults = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction)
        super().__init__(params, defaults, backend)

    def _call(self, group, params, grads, exp_avgs, exp_avg_sqs, step, grad_scale) -> None:
        self._step_fn(params, grads, exp_avgs, exp_avg_sqs, step=step, lr=group["lr"],
                      beta1=group["beta1"], beta2=group["beta2"], eps=group["eps"],
                      weight_decays=group["weight_decay"],
                      bias_correction=group["bias_correction"], grad_scale=grad_scale)


class Lars(_PrestoOptimizer):
    """LARS: local_lr = η_trust·‖w‖/(‖g‖+λ‖w‖+ε), momentum on lr·local_lr·(g+λw).

    Per group: ``weight_decay`` and ``adapt`` (excluded tensors use local_lr = 1).
    """

    name = "lars"

    def __init__(self, params, *, lr: float, momentum: float = 0.9,
                 trust_coefficient: float = 0.001, eps: float = 1e-9,
                 weight_decay: float = 0.01, backend: str = "reference") -> None:
        defaults = dict(lr=lr, momentum=momentum, trust_coefficient=trust_coefficient,
                        eps=eps, weight_decay=weight_decay, adapt=True)
        super().__init__(params, defaults, backend)

    def _step_group(self, group, grad_scale) -> None:
        params, grads, bufs = [], [], []
        for p in self._params_with_grad(group):
            state = self.state[p]
            if not state:
                state["step"] = 0
                state["momentum_buffer"] = self._state_zeros(p)
            state["step"] += 1
            params.append(p)
            grads.append(p.grad)
            bufs.append(state["momentum_buffer"])
        if params:
            self._step_fn(params, grads, bufs, lr=group["lr"], momentum=group["momentum"],
                          trust_coefficient=group["trust_coefficient"], eps=group["eps"],
                          weight_decays=group["weight_decay"], adapt_flags=group["adapt"],
                          grad_scale=grad_scale)


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


def _groups(named_parameters, weight_decay: float) -> list[dict[str, Any]]:
    items = list(named_parameters)
    if items and all(isinstance(g, dict) for g in items):
        return items
    groups = param_groups_for_bert(items, weight_decay)
    if not groups:
        raise ValueError("no trainable parameters: every tensor has requires_grad=False "
                         "(or the list is empty)")
    return groups


@register_optimizer("lamb")
def _build_lamb(named_parameters, *, lr: float, beta1: float = 0.9, beta2: float = 0.999,
                eps: float = 1e-6, weight_decay: float = 0.01, bias_correction: bool = True,
                trust_clamp: float | None = None, use_nvlamb: bool = False,
                backend: str = "reference") -> Lamb:
    return Lamb(_groups(named_parameters, weight_decay), lr=lr, beta1=beta1, beta2=beta2,
                eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                trust_clamp=trust_clamp, use_nvlamb=use_nvlamb, backend=backend)


@register_optimizer("adamw")
def _build_adamw(named_parameters, *, lr: float, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8, weight_decay: float = 0.01, bias_correction: bool = True,
                 backend: str = "reference") -> AdamW:
    return AdamW(_groups(named_parameters, weight_decay), lr=lr, beta1=beta1, beta2=beta2,
                 eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                 backend=backend)


@register_optimizer("lars")
def _build_lars(named_parameters, *, lr: float, momentum: float = 0.9,
                trust_coefficient: float = 0.001, eps: float = 1e-9,
                weight_decay: float = 0.01, backend: str = "reference") -> Lars:
    return Lars(_groups(named_parameters, weight_decay), lr=lr, momentum=momentum,
                trust_coefficient=trust_coefficient, eps=eps, weight_decay=weight_decay,
                backend=backend)
