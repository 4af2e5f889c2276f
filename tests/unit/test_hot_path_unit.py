"""The step multiplier of the default step's hot path (runtime.optim.grad_scale.step_multiplier)
computes on the device what the host arithmetic gives. The hot path itself: in one process
tests/integration/test_hot_path_integration.py, on real ranks tests/ranks/test_hot_path.py."""
from __future__ import annotations

import torch

from runtime.optim.grad_scale import step_multiplier


def test_step_multiplier_matches_the_host_arithmetic():
    for norm, scale, clip in ((3.0, 1.0, True), (0.2, 1.0, True), (3.0, 1024.0, True),
                              (3.0, 1.0, False), (float("inf"), 8.0, True)):
        got, found_inf, coef, unscaled = step_multiplier(
            torch.tensor(norm * scale, dtype=torch.float32), torch.tensor(scale, dtype=torch.float64),
            max_norm=1.0, clip=clip)
        n = float(torch.tensor(norm * scale, dtype=torch.float32)) / scale
        assert bool(found_inf) == (n == float("inf"))
        if n != float("inf"):
            want = (min(1.0, 1.0 / (n + 1e-6)) if clip else 1.0) / scale
            assert float(got) == want  # bit for bit the Python arithmetic
