"""The ``fused`` backend's runtime side: an optimizer's parameters bound to flat buffers.

What this module owns (``FlatBinding``):
  * the layout: every parameter of the optimizer's groups in gradient-production order —
    the reverse of the model's parameter order, which is DDP's bucket order (the builders in
    ``runtime.optim`` pass it) — one ``kernels.optim_flat.FlatBuffers`` and one fused step per
    (device, dtype);
  * norm blocks: a parameter the optimizer names in ``blocks`` (a fused QKV weight: 3) is
    laid out as that many tensors for LAMB's and LARS's norms (``FlatLayout`` blocks);
  * binding: parameters, their ``.grad`` and their optimizer state (``exp_avg``,
    ``exp_avg_sq`` / ``momentum_buffer``, and ``step``) become views of the flat buffers, so
    ``state_dict()`` and any per-tensor code see the same memory; after ``load_state_dict``
    the loaded state is copied back in (``adopt_state``);
  * sharing the gradient buffer (``share_gradients``): when the gradient sync owns a flat
    buffer already in this layout (runtime.grad_sync's bucket buffer: rows of 1024, whole
    tensors on row boundaries, in its plan's order), the binding re-lays its parameters and
    state out in that order and steps on that buffer - one owner of gradient memory, no copy
    per step. Called again after the sync's first-step re-cut;
  * each step: per-tensor hyperparameters from the parameter groups (looked up each step, so
    a schedule writing ``group["lr"]`` just works) and per-tensor step counts, kept on the
    device (``state[p]["step"]`` is a 0-dim view): the optimizer's ``found_inf`` (a
    non-finite gradient) is folded into the update mask and the counts on the device, so a
    skipped step needs no host decision. A tensor whose ``.grad`` is None is inactive (left
    untouched, its step not counted); a ``.grad`` or ``.data`` the caller replaced is copied
    in and re-pointed;
  * ``zero_grad``: one memset of the gradient buffer. Gradients stay views and are never set
    to None (``set_to_none`` is ignored), so autograd and DDP keep accumulating straight
    into the buffer. Consequence: a parameter that got no gradient since ``zero_grad`` is
    stepped with a zero gradient, where torch's ``set_to_none`` would skip it (every BERT
    parameter gets a gradient every step; set ``p.grad = None`` to skip one);
  * ``grad_norm``: the global gradient norm from per-row norms of each gradient buffer;
  * a sharded step (``optim.shard``; the sync passes its ``shard`` with the buffer,
    runtime.grad_sync.shard): the parameters stay whole on every rank, the optimizer state
    is kept for this rank's rows only (``FlatBuffers.window``; ``state[p]`` then holds the
    step count alone), the fused step runs on those rows with its per-tensor partial norms
    summed over the shard group, and the parameters are all-gathered after it. A re-layout
    (the first-step re-cut) gathers the state once to move it to the new shards - a
    transient of the whole state; the checkpoint side is ``shard_meta`` /
    ``shard_state`` / ``load_shards``;
  * gradients owned elsewhere in another layout: when the parameters' ``.grad`` are already
    views of some other buffer at binding time and nobody shares it (``external_grads``),
    each step copies them into the gradient buffer (one extra read and write) and never
    re-points them.

What it never does: the step math (``kernels.optim_flat``), choose the backend
(``runtime.optim``), move parameters (build the optimizer after ``model.to(device)``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kernels.optim_flat import MASTER, FlatBuffers, FlatLayout

__all__ = ["FlatBinding", "SHARD_FORMAT"]

SHARD_FORMAT = "presto-optimizer-shards/1"


@dataclass
class _Part:
    """One (device, dtype): its buffers, fused step, parameters and their cached views."""

    buffers: FlatBuffers
    engine: object
    params: list[torch.Tensor]
    steps: torch.Tensor  # per-tensor update counts (float64, on the device)
    data_views: list[torch.Tensor] = field(default_factory=list)
    grad_views: list[torch.Tensor] = field(default_factory=list)
    shard: object = None  # runtime.grad_sync.shard.Shard: this part steps its window only


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
                 compile: bool = True, master: bool = False,
                 blocks: dict[int, int] | None = None) -> None:
        self.optimizer = optimizer
        self.step_class = step_class
        self.compile = compile
        # fp32 master weights (train.precision '*_master'): one more state, kept, sharded,
        # saved and re-sharded like the others, that the passes read x from and write
        self.state_names = step_class.state_names + ((MASTER,) if master else ())
        self.blocks = dict(blocks or {})  # id(param) -> norm blocks (absent: 1)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("fused backend: a parameter appears twice in the groups")
        # .grad already a view of some other buffer: leave it there (until shared).
        self.external_grads = any(p.grad is not None and p.grad._is_view() for p in params)
        keys: dict[tuple, list[torch.Tensor]] = {}
        for p in _layout_order(params, model_order):
            if p.is_sparse:
                raise ValueError("fused backend: sparse parameters are not supported")
            keys.setdefault((p.device, p.dtype), []).append(p)
        self.parts = [self._bind(ps, grads=None) for ps in keys.values()]

    def _bind(self, params: list[torch.Tensor], grads: torch.Tensor | None,
              shard=None) -> _Part:
        """Buffers for ``params`` in this order, state and step counts copied in from the
        optimizer's state (which may still point into the buffers being replaced); with a
        ``shard``, the state of its window only."""
        layout = FlatLayout.build([tuple(p.shape) for p in params],
                                  blocks=[self.blocks.get(id(p), 1) for p in params])
        extra = {} if shard is None else {
            "total": shard.padded_total, "window": shard.window,
            "params": shard.alloc_params(shard.padded_total, params[0].dtype)}
        buffers = FlatBuffers(layout, dtype=params[0].dtype, device=params[0].device,
                              state_names=self.state_names, grads=grads, **extra)
        buffers.bind(params, grads=grads is None and not self.external_grads)
        steps = torch.zeros(len(params), dtype=torch.float64, device=buffers.device)
        part = _Part(buffers, self.step_class(buffers, compile=self.compile), params, steps,
                     shard=shard)
        if shard is not None:
            part.engine.combine = shard.sum_
        for i, p in enumerate(params):
            part.data_views.append(buffers.view(buffers.params, i))
            part.grad_views.append(buffers.view(buffers.grads, i))
            self._adopt(part, i)
        return part

    def _adopt(self, part: _Part, i: int) -> None:
        """Copy tensor i's state (and step count) into the part's buffers; re-point it there."""
        b, p = part.buffers, part.params[i]
        state = self.optimizer.state[p]
        step = state.get("step", 0)
        part.steps[i] = step.to(part.steps) if isinstance(step, torch.Tensor) else float(step)
        state["step"] = part.steps[i]  # a 0-dim view: counted on the device
        if MASTER in self.state_names and MASTER not in state:  # a new master: the weights
            state[MASTER] = part.params[i].detach()   # as they are (seed_masters: exact fp32)
        if part.shard is not None:  # the window's piece of each state; nothing per tensor
            seg, (lo, hi) = b.layout.segments[i], b.window
            a, z = max(seg.offset, lo), min(seg.offset + seg.numel, hi)
            for name in self.state_names:
                whole = state.pop(name, None)
                if whole is not None and z > a:
                    b.state[name][a - lo:z - lo].copy_(
                        whole.reshape(-1)[a - seg.offset:z - seg.offset])
            return
        for name in self.state_names:
            view = b.view(b.state[name], i)
            if name in state and state[name] is not view:
                view.copy_(state[name])
            state[name] = view

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
            for i in range(len(part.params)):
                self._adopt(part, i)

    @property
    def keeps_masters(self) -> bool:
        return MASTER in self.state_names

    @torch.no_grad()
    def masters(self) -> dict[int, torch.Tensor]:
        """{id(param): its fp32 master weight} - views of the buffer, or, sharded, of a whole
        buffer gathered from every shard (a collective over the shard group: every rank calls
        it, as a checkpoint does)."""
        out = {}
        for part in self.parts:
            b = part.buffers
            whole = b.state[MASTER]
            if part.shard is not None:
                lo, hi = b.window
                whole = torch.zeros(b.total, dtype=b.state[MASTER].dtype, device=b.device)
                whole[lo:hi] = b.state[MASTER]
                part.shard.gather(whole)
            for i, p in enumerate(part.params):
                out[id(p)] = b.view(whole, i)
        return out

    @torch.no_grad()
    def share_gradients(self, grads: torch.Tensor, ordered: Sequence[torch.Tensor],
                        shard=None) -> None:
        """Step on ``grads``, a flat gradient buffer owned by the caller, whose layout is the
        fused one for ``ordered`` (each tensor's ``.grad`` already a view of it, starting on a
        row boundary). Parameters and state move to new buffers in that order (a transient
        second copy of them); the old buffers are freed. Raises if the layouts differ.
        ``shard`` (runtime.grad_sync.shard.Shard): step its window of the buffer only (the
        buffer zero-padded to ``shard.padded_total``); its passes are compiled here. A
        collective when the binding was sharded before (its state is gathered to move)."""
        if len(self.parts) != 1:
            raise ValueError("fused backend: sharing one gradient buffer needs every parameter "
                             "on one device with one dtype")
        (old,) = self.parts
        ordered = list(ordered)
        if {id(p) for p in ordered} != {id(p) for p in old.params}:
            raise ValueError("fused backend: the shared gradient buffer holds other parameters "
                             "than the optimizer's")
        layout = FlatLayout.build([tuple(p.shape) for p in ordered])
        base, size = grads.data_ptr(), grads.element_size()
        for p, seg in zip(ordered, layout.segments):
            if p.grad is None or p.grad.data_ptr() != base + seg.offset * size:
                raise ValueError("fused backend: the shared gradient buffer is not in the fused "
                                 "layout (each tensor's .grad a view starting on a row boundary "
                                 "of 1024 elements, in the given order)")
        if grads is old.buffers.grads and old.shard is shard and \
                all(a is b for a, b in zip(ordered, old.params)):
            return
        if old.shard is not None:
            self._gather_state(old)
        for i in range(len(old.params)):  # step counts travel with the state
            self.optimizer.state[old.params[i]]["step"] = old.steps[i].clone()
        self.external_grads = False
        self.parts = [self._bind(ordered, grads=grads, shard=shard)]
        if shard is not None:  # the window's row count is a new shape for the passes
            seconds = self.parts[0].engine.warmup()
            if hasattr(self.optimizer, "compile_seconds"):
                self.optimizer.compile_seconds += seconds

    @torch.no_grad()
    def _gather_state(self, part: _Part) -> None:
        """Every rank's window of ``part``'s state, gathered into whole buffers (a collective
        over the shard group) and handed to ``optimizer.state`` per tensor again."""
        b = part.buffers
        lo, hi = b.window
        for name, mine in b.state.items():
            whole = torch.zeros(b.total, dtype=mine.dtype, device=mine.device)
            whole[lo:hi] = mine
            part.shard.gather(whole)
            for i, p in enumerate(part.params):
                self.optimizer.state[p][name] = b.view(whole, i)

    # ------------------------------------------------------------------ shards in checkpoints
    @property
    def shard(self):
        """The shard this binding steps (None: every row)."""
        return self.parts[0].shard if len(self.parts) == 1 else None

    def shard_meta(self, index_of: dict[int, int]) -> dict | None:
        """What a checkpoint needs to put the shards back together: the shard count and
        size and, per tensor (``index_of``: id(param) -> its index in the optimizer's
        state_dict), its place in the flat buffer. None when not sharded."""
        part = self.parts[0] if self.shard is not None else None
        if part is None:
            return None
        b = part.buffers
        return {"format": SHARD_FORMAT, "shards": part.shard.size,
                "shard_elements": b.window[1] - b.window[0], "total": b.total,
                "state_names": list(self.state_names),
                "segments": [[index_of[id(p)], seg.offset, seg.numel]
                             for p, seg in zip(part.params, b.layout.segments)]}

    def shard_state(self) -> dict | None:
        """This rank's window of the state, {index, window, state: {name: tensor}}; None
        when not sharded."""
        if self.shard is None:
            return None
        b = self.parts[0].buffers
        return {"index": self.shard.index, "window": list(b.window), "state": dict(b.state)}

    @torch.no_grad()
    def load_shards(self, meta: dict, read: Callable[[int], dict],
                    params_by_index: Sequence[torch.Tensor]) -> str:
        """Load state saved as ``meta["shards"]`` shards (``read(j)``: shard j's
        ``shard_state``). The same shards and layout: this rank's own file, copied as it is
        (exact). Otherwise - another world size, another optim.shard, no shards now - every
        shard is read, put back together per tensor in the saved layout and re-sharded into
        this binding. Returns which of the two it did."""
        if meta.get("format") != SHARD_FORMAT:
            raise ValueError(f"sharded optimizer state of format {meta.get('format')!r}, "
                             f"this runtime reads {SHARD_FORMAT!r}")
        part = self.parts[0] if self.shard is not None else None
        if part is not None and meta == self.shard_meta(
                {id(p): i for i, p in enumerate(params_by_index)}):
            saved = read(part.shard.index)
            for name, buf in part.buffers.state.items():
                buf.copy_(saved["state"][name])
            return f"own shard {part.shard.index} of {part.shard.size}"
        shards = [read(j) for j in range(meta["shards"])]
        for name in meta["state_names"]:
            whole = torch.cat([s["state"][name].reshape(-1) for s in shards])
            for index, offset, numel in meta["segments"]:
                p = params_by_index[index]
                self.optimizer.state[p][name] = whole[offset:offset + numel].view(p.shape)
        self.adopt_state()
        return (f"re-sharded from {meta['shards']} shard(s) to "
                f"{self.shard.size if self.shard is not None else 'none (unsharded)'}")

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
    def _active(self, part: _Part, i: int) -> bool:  # (callers hold no_grad)
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
    def step(self, grad_scale, hparams_of: Callable[[dict], dict],
             found_inf: torch.Tensor | None = None) -> None:
        """One fused step per part. ``hparams_of(group)`` gives the step's keyword arguments
        for a parameter of that group (per-tensor names: weight_decays, adapt_flags, ...);
        ``found_inf`` (0-dim bool, on the device) skips the update without a host read."""
        group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        for part in self.parts:
            per_group: dict[int, dict] = {}
            keys = []
            for p in part.params:
                group = group_of[id(p)]
                key = id(group)
                if key not in per_group:
                    per_group[key] = hparams_of(group)
                keys.append(key)
            columns = _columns(per_group, keys)
            active = [self._active(part, i) for i in range(len(part.params))]
            if not any(active):
                continue
            keep = part.engine._keep(active)
            if found_inf is not None:
                keep = keep & ~found_inf.to(keep.device)
            part.steps.add_(keep.to(part.steps.dtype))
            kwargs = dict(columns, active=keep, grad_scale=grad_scale)
            if self.step_class.takes_steps:
                kwargs["steps"] = part.steps.clamp(min=1.0)
            part.engine.step(**kwargs)
            if part.shard is not None:  # every rank's window to every rank
                part.shard.gather(part.buffers.params)


def _columns(per_group: dict[int, dict], keys: list[int]) -> dict[str, object]:
    """The step's per-tensor keyword arguments: a value every group shares stays one value
    (the fused step broadcasts it with no per-tensor Python: the host's time per step is
    what bounds a step of 336M parameters on an H100), a value that differs between groups
    becomes one per tensor, in the binding's order (``keys``: each tensor's group)."""
    first = next(iter(per_group.values()))
    out: dict[str, object] = {}
    for name in first:
        values = [hp[name] for hp in per_group.values()]
        if all(_same(v, values[0]) for v in values[1:]):
            out[name] = values[0]
        else:
            out[name] = tuple(per_group[k][name] for k in keys)
    return out


def _same(a, b) -> bool:
    """Equal plain values (tensors are never taken as equal: no device read)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return type(a) is type(b) and a == b
