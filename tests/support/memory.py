"""Peak resident memory of an optimizer step, for tests/integration/test_optim_backends.py, which
runs ``memory_growth`` in a fresh process (``python -c "import tests.support.memory ..."``):
the heap a long test process has built up can hide the control's temporaries."""
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


def activation_growth(config: str, overrides: list[str], micro_batches: list[int]) -> dict:
    """Peak resident growth of one training micro-step (forward and backward, dropout on) of
    ``config``'s model at each micro-batch of full-length rows with
    ``data.max_predictions_per_seq`` masked positions each: what the activations of that
    micro-batch take. Gradients exist before (a first step at one row), so only the
    activations (and the autograd temporaries) grow. Run in a fresh process with
    MALLOC_MMAP_THRESHOLD_ low, so that a freed tensor leaves the resident set."""
    from runtime.config import load_config
    from runtime.train.build import build_model
    cfg = load_config(config, overrides)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = build_model(cfg).train()
    seq, preds, vocab = (cfg.data.max_seq_length, cfg.data.max_predictions_per_seq,
                         cfg.model.vocab_size)

    def step(b: int) -> None:
        ids = torch.randint(1000, vocab, (b, seq))
        labels = torch.full((b, seq), -100)
        labels[:, 1:1 + preds] = ids[:, 1:1 + preds]
        out = model(ids, torch.zeros_like(ids), torch.ones_like(ids), masked_lm_labels=labels,
                    next_sentence_labels=torch.zeros(b, dtype=torch.long))
        out.loss.backward()

    step(1)
    return {b: _peak_growth_bytes(lambda b=b: step(b)) for b in micro_batches}
