"""The ``fused`` backend's runtime side: an optimizer's parameters bound to flat buffers.

What this module owns (``FlatBinding``):
  * the layout: every parameter of the optimizer's groups in gradient-production order —
    the reverse of the model's parameter order, which is DDP's bucket order (the builders in
    ``runtime.optim`` pass it) — one ``kernels.optim_flat.FlatBuffers`` and one fused step per
    (device, dtype);
  * binding: parameters, their ``.grad`` and their optimizer state (``exp_avg``,
    ``exp_avg_sq`` / ``momentum_buffer``) become views of the flat buffers, so
    ``state_dict()`` and any per-tensor code see the same memory; after
    ``load_state_dict`` the loaded state is copied back in (``adopt_state``);
  * each step: per-tensor hyperparameters from the parameter groups (looked up each step, so
    a schedule writing ``group["lr"]`` just works) and per-tensor step counts from
    ``state[p]["step"]``; a tensor whose ``.grad`` is None is inactive (left untouched, its
    step not counted), a ``.grad`` or ``.data`` the caller replaced is copied in and
    re-pointed;
  * ``zero_grad``: one memset of the gradient buffer. Gradients stay views and are never set
    to None (``set_to_none`` is ignored), so autograd and DDP keep accumulating straight
    into the buffer. Consequence: a parameter that got no gradient since ``zero_grad`` is
    stepped with a zero gradient, where torch's ``set_to_none`` would skip it (every BERT
    parameter gets a gradient every step; set ``p.grad = None`` to skip one);
  * ``grad_norm``: the global gradient norm as one reduction over each gradient buffer;
  * gradients owned elsewhere: when the parameters' ``.grad`` are already views of another
    buffer at binding time (``runtime.buckets`` attaches its bucket views before the
    optimizer is built), the binding leaves them there (``external_grads``): each step copies
    them into the gradient buffer (one extra read and write of the gradients) and never
    re-points them, so the bucket allreduce keeps working on its own memory. Sharing one
    buffer instead needs the bucket buffer in this layout (rows of 1024, whole tensors on
    row boundaries): see ``kernels.optim_flat.FlatLayout``.

What it never does: the step math (``kernels.optim_flat``), choose the backend
(``runtime.optim``), move parameters (build the optimizer after ``model.to(device)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kernels.optim_flat import FlatBuffers, FlatLayout

__all__ = ["FlatBinding"]


@dataclass
class _Part:
    """One (device, dtype): its buffers, fused step, parameters and their cached views."""

    buffers: FlatBuffers
    engine: object
    params: list[torch.Tensor]
    data_views: list[torch.Tensor] = field(default_factory=list)
    grad_views: list[torch.Tensor] = field(default_factory=list)


def _layout_order(params: list[torch.Tensor],
                  model_order: Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
    """Reverse model order (gradient-production order), restricted to ``params``; params
    the model order does not name follow in group order."""
    ids = {id(p) for p in params}
    ordered, seen = [], set()
    for p in reversed(list(model_order or ())):
        if id(p) in ids and id(p) not in seen:
            ordered.append(p)
            seen.add(id(p))
    ordered += [p for p in params if id(p) not in seen]
    return ordered


class FlatBinding:
    """Flat buffers and fused steps behind one ``runtime.optim`` optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, step_class,
                 model_order: Sequence[torch.Tensor] | None = None,
                 compile: bool = True) -> None:
        self.optimizer = optimizer
        self.step_class = step_class
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("fused backend: a parameter appears twice in the groups")
        # .grad already a view of some other buffer (gradient buckets): leave it there.
        self.external_grads = any(p.grad is not None and p.grad._is_view() for p in params)
        keys: dict[tuple, list[torch.Tensor]] = {}
        for p in _layout_order(params, model_order):
            if p.is_sparse:
                raise ValueError("fused backend: sparse parameters are not supported")
            keys.setdefault((p.device, p.dtype), []).append(p)
        self.parts = [self._bind(ps, compile) for ps in keys.values()]

    def _bind(self, params: list[torch.Tensor], compile: bool) -> _Part:
        layout = FlatLayout.build([tuple(p.shape) for p in params])
        buffers = FlatBuffers(layout, dtype=params[0].dtype, device=params[0].device,
                              state_names=self.step_class.state_names)
        buffers.bind(params, grads=not self.external_grads)
        part = _Part(buffers, self.step_class(buffers, compile=compile), params)
        for i, p in enumerate(params):
            part.data_views.append(buffers.view(buffers.params, i))
            part.grad_views.append(buffers.view(buffers.grads, i))
            state = self.optimizer.state[p]
            state.setdefault("step", 0)
            for name in self.step_class.state_names:
                view = buffers.view(buffers.state[name], i)
                if name in state:
                    view.copy_(state[name])
                state[name] = view
        return part

    # ------------------------------------------------------------------ lifecycle
    def warmup(self) -> float:
        """Compile every fused pass now; returns seconds (kept out of any step timing)."""
        return sum(part.engine.warmup() for part in self.parts)

    @property
    def compiled(self) -> bool:
        return all(part.engine.compiled for part in self.parts)

    def adopt_state(self) -> None:
        """After ``load_state_dict``: copy the loaded state into the buffers, re-point it."""
        for part in self.parts:
            b = part.buffers
            for i, p in enumerate(part.params):
                state = self.optimizer.state[p]
                state.setdefault("step", 0)
                for name in self.step_class.state_names:
                    view = b.view(b.state[name], i)
                    if name in state and state[name] is not view:
                        view.copy_(state[name])
                    state[name] = view

    @torch.no_grad()
    def zero_grad(self) -> None:
        if self.external_grads:  # zero the owner's views in place, never replace them
            for part in self.parts:
                for p in part.params:
                    if p.grad is not None:
                        p.grad.zero_()
            return
        for part in self.parts:
            part.buffers.grads.zero_()
            for p, view in zip(part.params, part.grad_views):
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """Global gradient norm; gradients the caller replaced are copied in first."""
        for part in self.parts:
            for i in range(len(part.params)):
                self._active(part, i)
        norms = [part.engine.grad_norm() for part in self.parts]
        if len(norms) == 1:
            return norms[0]
        device = self.parts[0].buffers.device
        return torch.stack([n.to(device) for n in norms]).square().sum().sqrt()

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def _active(self, part: _Part, i: int) -> bool:
        """Whether tensor i has a gradient; copies a replaced .data / .grad into the buffer."""
        p, data, grad = part.params[i], part.data_views[i], part.grad_views[i]
        if p.data_ptr() != data.data_ptr():
            data.copy_(p.detach())
            p.data = data
        g = p.grad
        if g is None:
            return False
        if g.data_ptr() != grad.data_ptr():
            grad.copy_(g)
            if not self.external_grads:
                p.grad = grad
        return True

    @torch.no_grad()
    def step(self, grad_scale, hparams_of: Callable[[dict], dict]) -> None:
        """One fused step per part. ``hparams_of(group)`` gives the step's keyword arguments
        for a parameter of that group (per-tensor names: weight_decays, adapt_flags, ...)."""
        group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        for part in self.parts:
            active, steps, per_group = [], [], {}
            columns: dict[str, list] = {}
            for i, p in enumerate(part.params):
                group = group_of[id(p)]
                key = id(group)
                if key not in per_group:
                    per_group[key] = hparams_of(group)
                for name, value in per_group[key].items():
                    columns.setdefault(name, []).append(value)
                state = self.optimizer.state[p]
                on = self._active(part, i)
                state["step"] += int(on)
                active.append(on)
                steps.append(max(state["step"], 1))
            if not any(active):
                continue
            kwargs = dict(columns, active=active, grad_scale=grad_scale)
            if self.step_class.takes_steps:
                kwargs["steps"] = steps
            part.engine.step(**kwargs)
