"""Peak resident memory of an optimizer step, for tests/test_optim_backends.py, which runs
``memory_growth`` in a fresh process (``python -c "import tests.support.memory ..."``): the
heap a long test process has built up can hide the control's temporaries."""
from __future__ import annotations

import torch

from runtime.optim.optimizers import build_optimizer


def _peak_growth_bytes(fn) -> int:
    """Resident-set peak during fn above the resident set before it (Linux /proc)."""
    def field(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024
        raise KeyError(key)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident set
    before = field("VmRSS")
    fn()
    return field("VmHWM") - before


MEMORY_SHAPES = [(3000, 3000), (1024,)]  # 9M elements: 34 MiB per buffer


def memory_growth(name: str) -> dict:
    """Peak resident growth of one step per backend. Run in a fresh process (the test does):
    the heap a long test process has built up can hide the control's temporaries."""
    gen = torch.Generator().manual_seed(7)
    growth = {}
    for backend in ("foreach", "fused"):
        named = [(f"l{i}.weight", torch.randn(s, generator=gen).requires_grad_())
                 for i, s in enumerate(MEMORY_SHAPES)]
        opt = build_optimizer(name, named, lr=1e-3, backend=backend)
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step(grad_scale=0.5)  # state allocated, compiled
        growth[backend] = _peak_growth_bytes(lambda: opt.step(grad_scale=0.5))
        del opt, named
    return growth
