"""What Inductor generated, read back: the tests of the compiled fusions and layers check that
only the batch's dimensions are symbolic in the code (the widths constants) and count
compiles.

``generated_code(fn)`` runs ``fn`` (a forward and backward through compiled code) after
``torch._dynamo.reset()`` with the on-disk FX graph cache off, so the code is generated now
and returned; ``input_sizes(code)`` lists the size tuple of each input the generated wrappers
check (``assert_size_stride``); ``frames_compiled()`` counts Dynamo's compiled graphs so far.
"""
from __future__ import annotations

import re
from typing import Callable

_SIZES = re.compile(r"assert_size_stride\(\w+, \(([^()]*)\)")


def generated_code(fn: Callable[[], object]) -> list[str]:
    """The wrapper code Inductor generated while ``fn`` ran (every compile reset first)."""
    import torch
    from torch._inductor.utils import run_and_get_code
    with torch._inductor.config.patch(fx_graph_cache=False):
        _, code = run_and_get_code(fn)
    return code


def input_sizes(code: list[str]) -> list[tuple[str, ...]]:
    """Each checked input's sizes as written in the code: '64' for a constant, 's17' or
    '(-1) + s46' for a symbolic one."""
    return [tuple(d.strip() for d in m.split(",") if d.strip())
            for src in code for m in _SIZES.findall(src)]


def is_constant(size: str) -> bool:
    return size.isdigit()


def frames_compiled() -> int:
    """Graphs Dynamo has compiled in this process (a recompile adds one)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]
