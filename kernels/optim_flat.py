"""Fused optimizer steps (LAMB, AdamW, LARS) over flat contiguous buffers, compiled once.

What this module owns:
  * ``FlatLayout``: where each tensor lives in one flat buffer. Tensors sit in the order
    given (the runtime passes gradient-production order, or the order of its gradient
    buckets' plan), each starting on a row boundary (``row`` = 1024 elements, 4 KiB in fp32)
    and zero-padded to whole rows, so a per-tensor norm is a sum over that tensor's rows
    (of each of its ``blocks``: equal runs of whole rows, e.g. a fused QKV weight's Q, K, V,
    each normed as a tensor of its own: ``row_block``). The
    gradient buckets are not cut here: ``runtime/grad_sync/plan.py``'s ``GradLayout`` lays
    the bucket buffer out with the same rows (``align = ROW``), which is what lets the fused
    step run on that buffer without a copy (``FlatLayout.bucket_bounds`` only computes a
    slice of consecutive tensors, for tests).
  * ``FlatBuffers``: for one (device, dtype), one buffer each for parameters, gradients and
    every optimizer state (fp32 state for fp32/bf16/fp16 parameters, fp64 for fp64).
    ``bind`` makes the model's parameters views into the parameter buffer and their
    ``.grad`` views into the gradient buffer, so backward accumulates straight into it.
  * the ``fused`` backend: ``FusedLamb``, ``FusedAdamW``, ``FusedLars``. Each pass is a
    plain-torch function over the (rows, 1024) views (kernels.optim_passes), compiled by
    ``torch.compile``
    (``dynamic=False``, ``fullgraph=True``; C++/OpenMP on CPU, Triton on CUDA; on CPU a
    process's second layout and later ones compile with the numbers of rows and tensors as
    symbols and share one kernel: kernels.compiled_pass) the first time it runs (``warmup``:
    a step with every row masked out, which changes nothing):

        LAMB   pass 1, one loop: read p, g, m, v; write m, v; per-row Σx², Σu²
               per tensor: norms = index_add of row sums; trust ratio; lr·ratio per row
               pass 2: read p, m, v (u recomputed, never stored); write p
               (``FusedLambStoredUpdate``: pass 1 also writes u over g, in g's dtype;
               pass 2 reads p, u; write p - optim.lamb_update "stored")
        AdamW  one pass: read p, g, m, v; write p, m, v
        LARS   pass 1: read p, g; per-row Σw², Σ(sg)²    pass 2: read p, g, buf; write buf, p

    Bytes per fp32 element: LAMB 40 (pass 1 16 read + 8 written, pass 2 12 + 4), AdamW 28,
    LARS 28 (``BYTES_PER_ELEMENT``; ``bench.optim`` divides them by measured bandwidth).
    No model-sized temporary is allocated: the update u is recomputed in pass 2 instead of
    stored. What is allocated per step is per-tensor vectors and pass 1's two row sums
    (2 numbers per 1024 elements, 0.2% of one buffer).
  * the fallback: when compiling fails (no C++ compiler, an inductor bug), the same functions
    run eagerly after one ``RuntimeWarning`` — the same numbers, several passes, and
    model-sized temporaries.

The math is ``kernels.optim_reference``'s, operation for operation (read it there), and
``tests/integration/test_optim_backends.py`` holds every step equal to it. Hyperparameters are per
tensor (a scalar is broadcast): lr, weight decay, adapt flag, betas, eps, bias correction,
trust clamp, the step count (bias correction uses β^step of each tensor) and ``active``
(False for a tensor without gradient this step: its parameter and state stay untouched).
They travel as per-tensor tables that the kernels index by each row's tensor
(``row_segment``), one load per row. The per-row ``active`` mask has a second use: it keeps
inductor's in-place moment update inside the loop of pass 1's row reductions (without a
per-row input the update is flattened to 1-D, fused separately, and m and v are materialised
as copies and read twice).

With fp32 master weights (``MASTER``, one more state buffer: train.precision '*_master'),
x is read from the masters and the ``*_master`` passes write the masters and then the
parameters' bf16/fp16 copy (4 bytes more read and 6 more written per element than the fp32
step, for parameters and gradients of half the size).

What it never does: group parameters, clip, choose a backend (``runtime.optim`` does), or
call ``.item()`` (no host sync in a step).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels.optim_passes import (adamw_pass, adamw_pass_master, lamb_pass1,  # noqa: F401
                                  lamb_pass1_store, lamb_pass2, lamb_pass2_master,
                                  lamb_pass2_master_stored, lamb_pass2_stored, lars_pass1,
                                  lars_pass2, lars_pass2_master)
from kernels.optim_reference import ROW, Scalar, _trust_ratio, norm_of_rows, row_norms
from kernels.compiled_pass import CompiledPass

__all__ = [
    "BYTES_PER_ELEMENT",
    "ROW",
    "FlatBuffers",
    "FlatLayout",
    "FlatSegment",
    "FusedAdamW",
    "FusedLamb",
    "FusedLambStoredUpdate",
    "FusedLars",
]

# ROW (kernels.optim_reference.ROW, 1024) elements per row: every tensor starts on a row
# boundary; norms are sums over rows.

#: Bytes one fp32 element costs a fused step (read + written), as counted in the docstring.
BYTES_PER_ELEMENT = {"lamb": 40, "adamw": 28, "lars": 28}

MASTER = "master"
"""The state buffer of fp32 master weights (``FlatBuffers(..., state_names=(..., MASTER))``)
for parameters kept in bf16/fp16: the passes read x from it and write both it and the
parameters' copy in their dtype (``*_master`` passes)."""


# --------------------------------------------------------------------------- layout

@dataclass(frozen=True)
class FlatSegment:
    """One tensor in a flat buffer: elements [offset, offset + numel), padded to ``rows``,
    normed as ``blocks`` equal runs of its rows."""

    offset: int
    numel: int
    shape: tuple[int, ...]
    rows: int
    blocks: int = 1


@dataclass(frozen=True)
class FlatLayout:
    """Tensors one after another, each on a row boundary, zero padding to whole rows."""

    segments: tuple[FlatSegment, ...]
    row: int = ROW

    @classmethod
    def build(cls, shapes: Sequence[Sequence[int]], row: int = ROW,
              blocks: Sequence[int] | None = None) -> "FlatLayout":
        """``blocks``: per tensor, its norm blocks of whole rows (None: 1 each)."""
        if row < 1:
            raise ValueError(f"row must be >= 1, got {row}")
        blocks = [1] * len(shapes) if blocks is None else list(blocks)
        segments, offset = [], 0
        for i, (shape, k) in enumerate(zip(shapes, blocks, strict=True)):
            numel = math.prod(shape)
            if k < 1 or (k > 1 and (numel % k or (numel // k) % row)):
                raise ValueError(f"tensor {i} of shape {tuple(shape)}: {k} norm blocks must "
                                 f"each be whole rows of {row} elements")
            rows = -(-numel // row)
            segments.append(FlatSegment(offset, numel, tuple(shape), rows, k))
            offset += rows * row
        return cls(tuple(segments), row)

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)

    @property
    def total(self) -> int:
        """Elements in a buffer, padding included (a multiple of ``row``)."""
        return self.rows * self.row

    def bucket_bounds(self, first: int, last: int) -> tuple[int, int]:
        """Element range of segments first..last (inclusive) with their padding: the
        contiguous slice a gradient bucket holding those tensors would be."""
        start = self.segments[first].offset
        end = self.segments[last].offset + self.segments[last].rows * self.row
        return start, end

    def row_segment(self, device, rows: int | None = None) -> torch.Tensor:
        """For each row, the index of the tensor it belongs to (int64, ``rows`` long). Rows
        past the last tensor (``rows`` > ``self.rows``: a sharded buffer's zero tail) count as
        the last tensor's: they hold zeros in every buffer, which add exactly 0 to its norms
        and which every step leaves zero."""
        counts = [s.rows for s in self.segments]
        if rows is not None and rows > self.rows:
            counts[-1] += rows - self.rows
        ids = torch.repeat_interleave(torch.arange(len(self.segments)),
                                      torch.tensor(counts, dtype=torch.int64))
        return _to_device(ids, torch.device(device), torch.int64)

    def row_block(self, device, rows: int | None = None) -> torch.Tensor:
        """``row_segment`` with each norm block counted as a tensor."""
        counts = [s.rows // s.blocks for s in self.segments for _ in range(s.blocks)]
        if rows is not None and rows > self.rows:
            counts[-1] += rows - self.rows
        ids = torch.repeat_interleave(torch.arange(len(counts)),
                                      torch.tensor(counts, dtype=torch.int64))
        return _to_device(ids, torch.device(device), torch.int64)

    def block_segment(self, device) -> torch.Tensor:
        """For each norm block, the index of its tensor (int64)."""
        ids = torch.tensor([i for i, s in enumerate(self.segments) for _ in range(s.blocks)])
        return _to_device(ids, torch.device(device), torch.int64)


class FlatBuffers:
    """Parameters, gradients and named state of one (device, dtype), one buffer each.

    ``window`` (a sharded optimizer, runtime.grad_sync.shard): the element range [lo, hi),
    whole rows, that this rank steps. Parameters and gradients stay whole (``total``
    elements: the layout zero-padded so that the shards are equal); the state buffers hold
    the window only, and the steps run on the window's rows (``step_rows``). ``params``: a
    parameter buffer allocated by the caller (the shard's shared memory)."""

    def __init__(self, layout: FlatLayout, *, dtype: torch.dtype, device,
                 state_names: Sequence[str], grads: torch.Tensor | None = None,
                 total: int | None = None, window: tuple[int, int] | None = None,
                 params: torch.Tensor | None = None) -> None:
        self.layout = layout
        self.dtype = dtype
        self.math_dtype = torch.promote_types(dtype, torch.float32)
        self.device = torch.device(device)
        self.total = layout.total if total is None else total
        lo, hi = window if window is not None else (0, self.total)
        if self.total < layout.total or self.total % layout.row or not \
                0 <= lo <= hi <= self.total or lo % layout.row or hi % layout.row:
            raise ValueError(f"FlatBuffers: window [{lo}, {hi}) of {self.total} elements must "
                             f"be whole rows of {layout.row} inside a buffer of at least "
                             f"{layout.total}")
        self.window = (lo, hi)
        self.sharded = window is not None
        if params is not None:  # a parameter buffer allocated elsewhere (shared memory)
            if params.shape != (self.total,) or params.dtype != dtype or \
                    not params.is_contiguous():
                raise ValueError(f"FlatBuffers: the parameter buffer must be a contiguous "
                                 f"{dtype} vector of {self.total} elements")
            self.params = params
        else:
            self.params = torch.zeros(self.total, dtype=dtype, device=self.device)
        if grads is not None:  # a gradient buffer owned elsewhere, already in this layout
            if grads.shape != (self.total,) or grads.dtype != dtype or \
                    grads.device != self.device or not grads.is_contiguous():
                raise ValueError(f"FlatBuffers: the gradient buffer must be a contiguous "
                                 f"{dtype} vector of {self.total} elements on {self.device}, "
                                 f"got {tuple(grads.shape)} {grads.dtype} on {grads.device}")
            self.grads = grads
        else:
            self.grads = torch.zeros(self.total, dtype=dtype, device=self.device)
        self.state = {name: torch.zeros(hi - lo, dtype=self.math_dtype, device=self.device)
                      for name in state_names}
        self.row_segment = layout.row_segment(self.device, self.total // layout.row)[
            lo // layout.row:hi // layout.row]
        # the norms' index: each row's block, each block's tensor (None: the tensors)
        self.row_block, self.block_segment = self.row_segment, None
        if any(s.blocks > 1 for s in layout.segments):
            self.row_block = layout.row_block(self.device, self.total // layout.row)[
                lo // layout.row:hi // layout.row]
            self.block_segment = layout.block_segment(self.device)

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Tensor i of ``flat`` (one of this object's buffers) in its own shape."""
        s = self.layout.segments[i]
        return flat[s.offset:s.offset + s.numel].view(s.shape)

    def rows(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(-1, self.layout.row)

    def step_rows(self, flat: torch.Tensor) -> torch.Tensor:
        """The rows a step runs on: the window's of a whole buffer (parameters, gradients),
        a state buffer as it is (it holds the window only)."""
        if flat.numel() == self.total and self.window != (0, self.total):
            flat = flat[self.window[0]:self.window[1]]
        return self.rows(flat)

    def bind(self, params: Sequence[torch.Tensor], grads: bool = True) -> None:
        """Copy each parameter (and its gradient, if any) in; make ``p.data`` (and, with
        ``grads``, ``p.grad``) views of the buffers. The parameter objects stay the same
        (modules keep them)."""
        if len(params) != len(self.layout.segments):
            raise ValueError(f"bind: {len(params)} tensors for a layout of "
                             f"{len(self.layout.segments)}")
        for i, p in enumerate(params):
            if tuple(p.shape) != self.layout.segments[i].shape:
                raise ValueError(f"bind: tensor {i} has shape {tuple(p.shape)}, layout says "
                                 f"{self.layout.segments[i].shape}")
            data, grad = self.view(self.params, i), self.view(self.grads, i)
            data.copy_(p.detach())
            if p.grad is not None:
                grad.copy_(p.grad)
            p.data = data
            if grads:
                p.grad = grad


def _to_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A small host tensor on ``device`` in ``dtype``; to CUDA through pinned memory and
    ``non_blocking``, so the host never waits for the GPU (the caching host allocator keeps
    the pinned block until the copy is done)."""
    t = t.to(dtype)
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)  # (on CPU non_blocking changes nothing)


def _per_tensor(value, n: int, name: str) -> list:
    """One value per tensor: a list/tuple of n values, or one value (None included) for all."""
    if not isinstance(value, (list, tuple)):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"{name}: expected one value per tensor ({n}), got {len(value)}")
    return list(value)


def _one_minus(beta, n: int):
    """1 − β per tensor, a scalar kept a scalar (the common case costs no per-tensor list)."""
    if isinstance(beta, (int, float)):
        return 1.0 - beta
    return [1.0 - a for a in _per_tensor(beta, n, "beta")]


# --------------------------------------------------------------------------- steps

class _FusedStep:
    """Common part of the fused steps: buffers, kernels, per-tensor → per-row tables."""

    name = ""
    state_names: tuple[str, ...] = ()
    pass_functions: tuple[Callable, ...] = ()
    # The pass that writes the parameters, by whether fp32 masters are kept: (without, with).
    # The master one takes the master rows right after the parameters' (module docstring).
    update_passes: tuple[str, str] = ("", "")
    takes_steps = True  # step() wants per-tensor step counts (bias correction)

    def __init__(self, buffers: FlatBuffers, *, compile: bool = True) -> None:
        missing = set(self.state_names) - set(buffers.state)
        if missing:
            raise ValueError(f"{self.name}: buffers lack state {sorted(missing)}")
        self.buffers = buffers
        self.master = MASTER in buffers.state   # fp32 master weights: read and written here
        # chosen once: the rows the update writes (the parameters, then the masters where kept)
        # and the pass that writes them - the steps below read these, never ``master``
        self.written: tuple[str, ...] = ("params", MASTER) if self.master else ("params",)
        self.update_pass_name = self.update_passes[self.master]
        variant = (buffers.dtype, buffers.device, buffers.layout.row,
                   buffers.block_segment is not None, self.master)
        sizes = (buffers.total, buffers.window, len(buffers.layout.segments))
        on_cpu = buffers.device.type == "cpu"
        self.kernels = {fn.__name__: CompiledPass(fn, compile, variant, sizes,
                                                  symbolic_after_first=on_cpu)
                        for fn in self.pass_functions}
        self.compile_seconds: float | None = None
        self._constants: dict[tuple, torch.Tensor] = {}  # host values already on the device
        # A sharded step: sums this rank's per-tensor partial sums over the shard group, in
        # place (runtime.grad_sync.shard.Shard.sum_); None: the rows are every row.
        self.combine: Callable[[torch.Tensor], object] | None = None

    @property
    def compiled(self) -> bool:
        """True while every pass runs compiled (False after a fallback or compile=False)."""
        return all(k.compiled is not None for k in self.kernels.values())

    @property
    def n(self) -> int:
        return len(self.buffers.layout.segments)

    def _x_rows(self) -> torch.Tensor:
        """The rows the update reads x from: the fp32 masters where kept, else the params."""
        return self._rows(self.written[-1])

    def _update(self, *rest) -> None:
        """The parameter-writing pass on the written rows, then ``rest``."""
        self.kernels[self.update_pass_name](*(self._rows(n) for n in self.written), *rest)

    def _rows(self, name: str) -> torch.Tensor:
        b = self.buffers
        flat = b.params if name == "params" else b.grads if name == "grads" else b.state[name]
        return b.step_rows(flat)

    def _vector(self, values, name: str, per_step: bool = False,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        """Per-tensor values (scalar, sequence or tensor) as a math-dtype device vector.

        Host values are copied to the device without a host sync: constants (betas, weight
        decays, ...) once, then cached by value; ``per_step`` values (the learning rate) through
        pinned memory with ``non_blocking`` - a plain copy from pageable memory would make the
        host wait for the GPU every step."""
        b = self.buffers
        dtype = dtype or b.math_dtype
        if isinstance(values, torch.Tensor):
            return values.to(b.device, dtype).expand(self.n)
        if isinstance(values, (int, float)):  # one value for all: no per-tensor Python
            if per_step:
                one = _to_device(torch.tensor([float(values)], dtype=torch.float64), b.device,
                                 dtype)
                return one.expand(self.n)
            return self._constant((name, dtype, float(values)), lambda: torch.full(
                (self.n,), float(values), dtype=dtype, device=b.device))
        vals = _per_tensor(values, self.n, name)
        if any(isinstance(x, torch.Tensor) for x in vals):
            return torch.stack([torch.as_tensor(x, dtype=dtype).to(b.device) for x in vals])
        if per_step:
            return _to_device(torch.tensor(vals, dtype=torch.float64), b.device, dtype)
        return self._constant((name, dtype, tuple(vals)), lambda: _to_device(
            torch.tensor(vals, dtype=torch.float64), b.device, dtype))

    def _constant(self, key, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """A device vector cached by ``key`` (made once by ``make``, no host sync after)."""
        cached = self._constants.get(key)
        if cached is None:
            if len(self._constants) > 256:  # values that keep changing: do not grow forever
                self._constants.clear()
            cached = self._constants[key] = make()
        return cached

    @staticmethod
    def _table(*columns: torch.Tensor) -> torch.Tensor:
        """(tensors, k) table of per-tensor columns; kernels index it by row_segment."""
        return torch.stack(columns, dim=1)

    def _flags(self, values, name: str) -> torch.Tensor:
        if isinstance(values, torch.Tensor):
            return values.to(self.buffers.device, torch.bool).expand(self.n)
        device = self.buffers.device
        if isinstance(values, (bool, int)):  # one flag for all
            return self._constant((name, bool(values)), lambda: torch.full(
                (self.n,), bool(values), dtype=torch.bool, device=device))
        flags = tuple(bool(x) for x in _per_tensor(values, self.n, name))
        return self._constant((name, flags), lambda: _to_device(
            torch.tensor(flags, dtype=torch.bool), device, torch.bool))

    def _keep(self, active) -> torch.Tensor:
        """Per-tensor update mask: bools, or a device bool tensor (the binding folds the
        optimizer's ``found_inf`` into it, so a skipped step needs no host decision)."""
        return self._flags(active, "active")

    def _by_block(self, *per_tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-tensor vectors or tables as per-block ones (a tensor of k norm blocks repeated
        k times), to index by ``buffers.row_block``; as they are without blocks."""
        index = self.buffers.block_segment
        if index is None:
            return per_tensor
        return tuple(x.index_select(0, index) for x in per_tensor)

    def _segment_norms(self, *row_sums: torch.Tensor) -> list[torch.Tensor]:
        """Per-block norms (per tensor; a tensor of k norm blocks gives k) from per-row sums
        of squares, one vector per argument: the rows' sums added per block in fp64 (in row
        order), then the square root in the rows' dtype. With ``combine`` (a sharded step:
        runtime.grad_sync.shard) this rank's partial sums - its rows only - are summed over
        the shard group in place first, in one collective; fp64 makes a tensor split across
        shards come out as the unsharded sum to the last fp32 bit (bar a sum within ~1e-12 of
        a rounding boundary), and a tensor on one shard gets its own sum plus zeros."""
        b = self.buffers
        n = self.n if b.block_segment is None else b.block_segment.shape[0]
        sums = torch.zeros(len(row_sums), n, dtype=torch.float64, device=b.device)
        for i, r in enumerate(row_sums):
            sums[i].index_add_(0, b.row_block, r.to(torch.float64))
        if self.combine is not None:
            self.combine(sums)
        return list(sums.sqrt().to(row_sums[0].dtype).unbind(0))

    def _grad_scale(self, grad_scale: Scalar) -> torch.Tensor:
        if isinstance(grad_scale, torch.Tensor):
            return grad_scale.to(self.buffers.device, self.buffers.math_dtype)
        return _to_device(torch.tensor(float(grad_scale), dtype=torch.float64),
                          self.buffers.device, self.buffers.math_dtype)

    def _bias_corrections(self, steps, beta1, beta2, bias_correction):
        """(1 − β1^step, 1 − β2^step) per tensor as device vectors (1 where bias correction is
        off). ``steps``: 1-based update counts - host numbers, or a device tensor (the
        binding's counts, which a skipped step does not advance: no host read)."""
        b = self.buffers
        if isinstance(steps, torch.Tensor):
            s = steps.to(b.device, torch.float64).expand(self.n)
        else:
            vals = _per_tensor(steps, self.n, "steps")
            if any(x < 1 for x in vals):
                raise ValueError(f"{self.name}: steps must be 1-based update counts (>= 1)")
            s = _to_device(torch.tensor(vals, dtype=torch.float64), b.device, torch.float64)
        on = self._flags(bias_correction, "bias_correction")
        out = []
        for beta, name in ((beta1, "beta1"), (beta2, "beta2")):
            base = self._vector(beta, name, dtype=torch.float64)
            bc = torch.where(on, 1.0 - base ** s, torch.ones_like(s))
            out.append(bc.to(b.math_dtype))
        return out

    def _adam_table(self, *, steps, beta1, beta2, eps, weight_decays, bias_correction,
                    extra=()) -> torch.Tensor:
        bc1, bc2 = self._bias_corrections(steps, beta1, beta2, bias_correction)
        v = self._vector
        return self._table(v(weight_decays, "weight_decays"), v(beta1, "beta1"),
                           v(_one_minus(beta1, self.n), "1-beta1"), v(beta2, "beta2"),
                           v(_one_minus(beta2, self.n), "1-beta2"), bc1, bc2,
                           v(eps, "eps"), *extra)

    def grad_norm(self) -> torch.Tensor:
        """L2 norm of every gradient in the buffer (padding is zero), 0-dim fp32: per-row
        norms, as ``kernels.optim_reference.global_grad_norm`` (the same bits). Sharded: the
        window's rows, their fp64 sum of squares summed over the shard group."""
        if self.combine is None:
            return norm_of_rows(row_norms(self.buffers.grads))
        sq = row_norms(self._rows("grads")).double().pow(2).sum().reshape(1)
        self.combine(sq)
        return sq.sqrt().float().reshape(())

    def warmup(self) -> float:
        """Compile every pass now (a step with all tensors inactive: nothing changes).

        Returns and records (``compile_seconds``) the wall time, compile included."""
        t0 = time.perf_counter()
        combine, self.combine = self.combine, None  # a warm-up talks to no other rank
        try:
            self._warmup_step()
        finally:
            self.combine = combine
        if self.buffers.device.type == "cuda":
            torch.cuda.synchronize(self.buffers.device)
        self.compile_seconds = time.perf_counter() - t0
        return self.compile_seconds

    def _warmup_step(self) -> None:
        raise NotImplementedError


class FusedLamb(_FusedStep):
    """LAMB over flat buffers (state ``exp_avg``, ``exp_avg_sq``); two passes."""

    name = "lamb"
    state_names = ("exp_avg", "exp_avg_sq")
    pass_functions = (lamb_pass1, lamb_pass2, lamb_pass2_master)
    update_passes = ("lamb_pass2", "lamb_pass2_master")

    @torch.no_grad()
    def step(self, *, steps, lr, beta1, beta2, eps, weight_decays, adapt_flags,
             bias_correction=True, grad_scale: Scalar = 1.0, trust_clamp=None,
             active=True) -> None:
        t = self._adam_table(steps=steps, beta1=beta1, beta2=beta2, eps=eps,
                             weight_decays=weight_decays, bias_correction=bias_correction)
        if isinstance(trust_clamp, (list, tuple)):
            clamps = [math.inf if c is None else c
                      for c in _per_tensor(trust_clamp, self.n, "trust_clamp")]
        else:
            clamps = math.inf if trust_clamp is None else trust_clamp
        # per norm block from here on (each tensor one, unless the layout declared blocks)
        t, keep, clamp, adapt, lr = self._by_block(
            t, self._keep(active), self._vector(clamps, "trust_clamp"),
            self._flags(adapt_flags, "adapt_flags"), self._vector(lr, "lr", per_step=True))
        seg = self.buffers.row_block
        G, X = self._rows("grads"), self._x_rows()
        M, V = self._rows("exp_avg"), self._rows("exp_avg_sq")
        x2, u2 = self.kernels[self.pass_functions[0].__name__](X, G, M, V, keep, t, seg,
                                                                self._grad_scale(grad_scale))
        w, u = self._segment_norms(x2, u2)
        phi = torch.minimum(w, clamp)
        ratio = torch.where(adapt, _trust_ratio(w, u, phi, u), torch.ones_like(w))
        self._update(*self._pass2_inputs(M, V, G, keep, t, seg, lr * ratio))

    @staticmethod
    def _pass2_inputs(M, V, G, keep, t, seg, lr) -> tuple:
        """Pass 2's arguments after the rows it writes: u is recomputed from m, v and t."""
        return M, V, keep, t, seg, lr

    def _warmup_step(self) -> None:
        self.step(steps=1, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-6, weight_decays=0.0,
                  adapt_flags=True, active=False)


class FusedLambStoredUpdate(FusedLamb):
    """LAMB whose pass 1 stores the update u over the gradient rows, in the gradients' dtype,
    and whose pass 2 reads it instead of m and v (``optim.lamb_update = "stored"``).

    Bytes per parameter: pass 1 writes u (+ the gradient's width), pass 2 reads u instead of
    m and v (− 8 + the gradient's width). With fp32 gradients u is stored exactly and the
    step moves as many bytes as ``FusedLamb`` (it exists there only to be tested against it);
    with the bf16/fp16 gradients of the ``*_master`` precisions it moves 4 bytes a parameter
    less (36 of 40) and applies u rounded to the gradient's dtype: the trust ratio is of the
    unrounded u, as ``kernels.optim_reference.lamb_step(update_dtype=...)`` computes it. After
    a step the gradient buffer holds the update of every active tensor, not its gradient: the
    gradient syncs overwrite it before the next step reads it (the buckets' first copy, DDP's
    zeroing), and ``grad_norm`` is read before the step. An inactive tensor's gradient stays
    (so the warm-up, every tensor inactive, changes nothing)."""

    pass_functions = (lamb_pass1_store, lamb_pass2_stored, lamb_pass2_master_stored)
    update_passes = ("lamb_pass2_stored", "lamb_pass2_master_stored")

    @staticmethod
    def _pass2_inputs(M, V, G, keep, t, seg, lr) -> tuple:
        """Pass 2 reads the stored u (the gradient rows) instead of m, v and t."""
        return G, keep, seg, lr


class FusedAdamW(_FusedStep):
    """AdamW over flat buffers (state ``exp_avg``, ``exp_avg_sq``); one pass."""

    name = "adamw"
    state_names = ("exp_avg", "exp_avg_sq")
    pass_functions = (adamw_pass, adamw_pass_master)
    update_passes = ("adamw_pass", "adamw_pass_master")

    @torch.no_grad()
    def step(self, *, steps, lr, beta1, beta2, eps, weight_decays, bias_correction=True,
             grad_scale: Scalar = 1.0, active=True) -> None:
        t = self._adam_table(steps=steps, beta1=beta1, beta2=beta2, eps=eps,
                             weight_decays=weight_decays, bias_correction=bias_correction,
                             extra=(self._vector(lr, "lr", per_step=True),))
        self._update(self._rows("grads"), self._rows("exp_avg"), self._rows("exp_avg_sq"),
                     self._keep(active), t, self.buffers.row_segment,
                     self._grad_scale(grad_scale))

    def _warmup_step(self) -> None:
        self.step(steps=1, lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decays=0.0,
                  active=False)


class FusedLars(_FusedStep):
    """LARS over flat buffers (state ``momentum_buffer``); two passes."""

    name = "lars"
    state_names = ("momentum_buffer",)
    pass_functions = (lars_pass1, lars_pass2, lars_pass2_master)
    update_passes = ("lars_pass2", "lars_pass2_master")
    takes_steps = False

    @torch.no_grad()
    def step(self, *, lr, momentum, trust_coefficient, eps, weight_decays, adapt_flags,
             grad_scale: Scalar = 1.0, active=True) -> None:
        v = self._vector
        # per norm block (each tensor one, unless the layout declared blocks)
        keep, wd, momentum, coefficient, eps, adapt, lr = self._by_block(
            self._keep(active), v(weight_decays, "weight_decays"), v(momentum, "momentum"),
            v(trust_coefficient, "trust_coefficient"), v(eps, "eps"),
            self._flags(adapt_flags, "adapt_flags"), v(lr, "lr", per_step=True))
        gs = self._grad_scale(grad_scale)
        G, B, X = self._rows("grads"), self._rows("momentum_buffer"), self._x_rows()
        w2, g2 = self.kernels["lars_pass1"](X, G, gs)
        w, g = self._segment_norms(w2, g2)
        local = _trust_ratio(w, g, coefficient * w, g + wd * w + eps)
        local = torch.where(adapt, local, torch.ones_like(local))
        t, seg = self._table(wd, momentum), self.buffers.row_block
        self._update(G, B, keep, t, seg, gs, lr * local)

    def _warmup_step(self) -> None:
        self.step(lr=0.0, momentum=0.9, trust_coefficient=0.001, eps=1e-9, weight_decays=0.0,
                  adapt_flags=True, active=False)
