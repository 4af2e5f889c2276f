"""One fused-optimizer pass function compiled per buffer layout (kernels.optim_flat's steps).

Owns: ``CompiledPass`` (compiled at its first call, run eagerly once compiling has failed, with
one ``RuntimeWarning``) and the process's table of compiled wrappers: one per (pass function,
layout), each on a code object of its own (kernels.own_code), and on CPU the counts symbolic
from a process's second layout of a pass on. Never: the passes' arithmetic
(kernels.optim_passes) or the buffers and steps (kernels.optim_flat).
"""
from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from kernels.own_code import with_own_code

_COMPILED: dict[tuple, tuple[Callable, bool]] = {}
"""One torch.compile wrapper per (pass function, buffer layout), shared by the steps of that
layout, and whether its counts are symbols. Dynamo keeps a function's graphs on its code object
and, past ``recompile_limit`` (8) graphs, runs the function eagerly without a word: with one
wrapper per function, the ninth layout a process built (a test worker, bench.gpu's stages in one
process) stepped eagerly - other numbers, model-sized temporaries. Each layout compiles its own
copy of the function's code (kernels.own_code), so no number of layouts reaches that limit."""

_FIRST_SIZES: dict[tuple, tuple] = {}
"""(pass function, variant) -> the sizes of the first layout this process compiled it for."""


class CompiledPass:
    """A pass function compiled on its first call; run eagerly once compiling has failed.
    ``variant`` and ``sizes``: what the graph's guards depend on (dtype, device and the like;
    the buffers' sizes).

    ``symbolic_after_first`` (the CPU's steps): the first layout of a (pass, variant) a
    process builds compiles with every size a constant, as CUDA's always do (as measured);
    a second one with the first dimension of every tensor argument - the rows, the tensors -
    a symbol, the row width (1024) still a constant. That graph is the same for every later
    layout, so Inductor's cache gives each the compiled code of the first: a test worker or
    a tool building models, shards and tests of many sizes pays a trace (~0.2 s) a layout
    instead of a compile (~1.7 s of CPU, most of it g++), while a run of one model pays no
    symbolic trace (~0.4 s more a process). The rows are independent (a row's sums and
    updates do not depend on how many rows there are): the numbers are the same bit for
    bit. Dynamo's automatic dynamic shapes, by layout copy."""

    def __init__(self, fn: Callable, compile: bool, variant: tuple = (), sizes: tuple = (),
                 symbolic_after_first: bool = False) -> None:
        self.fn = fn
        self.compiled = None
        self.counts_symbolic = False
        self._mark = False   # the counts still to be marked symbolic: at the first call alone
        if compile:
            key = (fn, variant, sizes)
            if key not in _COMPILED:
                first = _FIRST_SIZES.setdefault((fn, variant), sizes)
                _COMPILED[key] = (torch.compile(with_own_code(fn), dynamic=False,
                                                fullgraph=True),
                                  symbolic_after_first and first != sizes)
            self.compiled, self.counts_symbolic = _COMPILED[key]
            self._mark = self.counts_symbolic

    def __call__(self, *args):
        if self.compiled is not None:
            if self._mark:   # the trace reads the marks; the graph then takes any count
                for a in args:
                    if isinstance(a, torch.Tensor) and a.dim():
                        torch._dynamo.maybe_mark_dynamic(a, 0)
            try:
                out = self.compiled(*args)
                self._mark = False   # ~0.1 ms a call: not every step
                return out
            except Exception as e:  # compile errors come before any buffer is written
                first = (str(e).strip().splitlines() or [""])[0][:300]
                warnings.warn(
                    f"fused optimizer: torch.compile of {self.fn.__name__} failed "
                    f"({type(e).__name__}: {first}); running it eagerly instead: same "
                    "numbers, slower, with model-sized temporaries. Set optim.backend="
                    "'foreach' to silence this.", RuntimeWarning, stacklevel=3)
                self.compiled = None
        return self.fn(*args)
