"""Fusion ``qkv`` with the fused optimizer backend (kernels/optim_flat.py, compiled by
Inductor on first use): LAMB and LARS keep one trust ratio per Q, K and V there too - with the
same gradients a fused-QKV step equals the split step bit for bit - and a few LAMB training
steps of the two layouts part only by the GEMMs' rounding. The other backends, and the
model's own truths: tests/unit/test_qkv.py (these cases compile, so they live here)."""
from __future__ import annotations

import pytest
import torch

from runtime.model.hf import save_hf_state_dict
from runtime.optim.optimizers import build_optimizer
from tests.support.qkv import OPTIMIZERS, batch, config, pair, run, steps


@pytest.mark.parametrize("name,hp", OPTIMIZERS)
def test_with_the_same_gradients_a_fused_step_equals_the_split_one_bit_for_bit(name, hp):
    split, fused = pair(cfg=config(hidden=32, heads=2, layers=1))
    steps(name, "fused", split, fused, **hp)
    a, b = save_hf_state_dict(split), save_hf_state_dict(fused)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_few_lamb_training_steps_fused_and_split_differ_by_rounding_only():
    """End to end (forward, backward, clip-free LAMB on the fused flat buffers): the two
    layouts part only by the GEMMs' float rounding."""
    split, fused = pair(cfg=config(hidden=32, heads=2, layers=2))
    opts = [build_optimizer("lamb", list(m.named_parameters()), lr=0.01, backend="fused")
            for m in (split, fused)]
    peak: dict = {}   # each tensor's largest magnitude over the run: the scale of its rounding
    for step in range(4):
        b = batch(seed=step)
        for model, opt in zip((split, fused), opts):
            opt.zero_grad()
            run(model, b)
            opt.step()
        for k, v in save_hf_state_dict(split).items():
            peak[k] = max(peak.get(k, 0.0), float(v.abs().max()))
    a, f = save_hf_state_dict(split), save_hf_state_dict(fused)
    # The key bias adds one number per query row to all its scores: softmax takes no
    # notice, its exact gradient is 0. What backward leaves there is rounding noise, which
    # Adam's m/sqrt(v) scales to steps of size lr whatever the layout: no truth to compare.
    noise = [k for k in a if k.endswith(".key.bias")]
    assert len(noise) == 2 and all(float(split.get_parameter(k).grad.abs().max()) < 1e-6
                                   for k in noise)
    # Each difference is measured against the largest value its tensor held, not its last
    # one: cls.seq_relationship.bias goes to -0.01 and back to 9e-4, a last value far below
    # its rounding's scale. The bound: the fourth batch's NSP gradient nearly cancels (2.3e-4
    # per entry after 3.4e-3), so its rounding - 6.5e-5 of it between the layouts - reaches
    # the pooler through Adam's normalised step: 9.2e-6 of the pooler bias's peak at one
    # thread on a Xeon (2026-12-02), 8e-7 at two. A layout bug moves a tensor by a good part
    # of its step (> 0.1 of it: test_one_ratio_for_the_whole_fused_tensor_would_differ).
    worst = max(float((a[k] - f[k]).abs().max()) / max(peak[k], 1e-12)
                for k in a if k not in noise)
    assert worst < 1e-4
    moved = save_hf_state_dict(pair(cfg=config(hidden=32, heads=2, layers=2))[0])
    assert max(float((a[k] - moved[k]).abs().max()) for k in a) > 1e-3  # it trained
