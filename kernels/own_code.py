"""A function with a code object of its own, for ``torch.compile``.

Dynamo keeps the graphs it compiles of a function on that function's code object and, past
``recompile_limit`` (8) graphs of one code object, runs it eagerly without a word. A compile
that must not share that count with every other use of the same function - one fused-optimizer
layout (kernels.optim_flat), one model's layers (runtime.model.compile) - compiles a copy made
here.

Owns: ``with_own_code``. Never: compiles, or imports torch.
"""
from __future__ import annotations

import types
from collections.abc import Callable


def with_own_code(fn: Callable, code: types.CodeType | None = None) -> Callable:
    """``fn`` (a plain function) on ``code`` - a fresh copy of its code object by default, or one
    a caller shares among the functions whose graphs belong together."""
    own = types.FunctionType(fn.__code__.replace() if code is None else code, fn.__globals__,
                             fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__, own.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    return own
