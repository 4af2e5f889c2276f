"""The split and fused-QKV model pair the qkv tests share (tests/unit/test_qkv.py, and
tests/integration/test_qkv_fused_optim.py for the cases that compile the fused optimizer):
one seed builds both layouts, a small batch with ragged rows, one forward and backward, and a
few optimizer steps on both with the same gradients."""
from __future__ import annotations

import torch

from runtime.model.bert import BertForPreTraining
from runtime.model.config import BertConfig
from runtime.model.converters import FuseQKV
from runtime.model.hf import hf_layout
from runtime.optim.optimizers import build_optimizer

QKV = ("query", "key", "value")

OPTIMIZERS = [("lamb", dict(lr=0.05, weight_decay=0.01)),
              ("lars", dict(lr=0.05, weight_decay=0.01))]


def config(hidden=64, heads=4, layers=2):
    return BertConfig(vocab_size=120, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, intermediate_size=2 * hidden,
                      max_position_embeddings=64, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)


def pair(attention="padded", kernel="auto", cfg=None, seed=0):
    """(split, fused) models built from one seed: the fused one as build_model makes it, a
    split model converted (runtime.model.converters.FuseQKV)."""
    cfg = cfg or config()
    torch.manual_seed(seed)
    split = BertForPreTraining(cfg, attention=attention, kernel=kernel)
    torch.manual_seed(seed)
    fused = BertForPreTraining(cfg, attention=attention, kernel=kernel)
    FuseQKV().convert(fused)
    return split, fused


def batch(seed=1, rows=4, width=24, vocab=120):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    for r, n in enumerate((width, 17, 9, 3)[:rows]):
        mask[r, n:] = 0
    labels = torch.full_like(ids, -100)
    labels[:, 1::5] = ids[:, 1::5]
    labels[mask == 0] = -100
    return ids, torch.zeros_like(ids), mask, labels, torch.tensor([0, 1] * (rows // 2))


def grads_hf(model):
    """Each parameter's gradient under its HF key (a fused Wqkv's as its three blocks)."""
    return hf_layout({n: p.grad for n, p in model.named_parameters()})


def run(model, b, autocast=False):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(*b[:3], masked_lm_labels=b[3], next_sentence_labels=b[4])
    out.loss.backward()
    return out


def same_grads(split, fused, seed):
    """Random gradients on the split model, the same numbers on the fused one."""
    g = torch.Generator().manual_seed(seed)
    grads = {}
    for n, p in split.named_parameters():
        p.grad = grads[n] = torch.randn(p.shape, generator=g)
    for n, p in fused.named_parameters():
        if ".Wqkv." in n:
            prefix, kind = n.split(".Wqkv.")
            p.grad = torch.cat([grads[f"{prefix}.{name}.{kind}"] for name in QKV])
        else:
            p.grad = grads[n].clone()


def steps(name, backend, split, fused, steps=3, combined=False, **hp):
    """``steps`` steps of optimizer ``name`` on both models with the same gradients;
    ``combined``: the fused model's groups without names - one trust ratio for each tensor,
    its [3H, H] weight included (what a fused tensor handed over as it is would get)."""
    fused_params = list(fused.named_parameters())
    if combined:
        from runtime.optim.groups import param_groups_for_bert
        fused_params = [{k: v for k, v in g.items() if k != "param_names"}
                        for g in param_groups_for_bert(fused_params, hp["weight_decay"])]
    opts = [build_optimizer(name, params, backend=backend, **hp)
            for params in (list(split.named_parameters()), fused_params)]
    for step in range(steps):
        same_grads(split, fused, seed=step)
        for opt in opts:
            opt.step()
