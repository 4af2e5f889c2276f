"""Fusion ``qkv`` (runtime/model/bert.py BertSelfAttention.Wqkv): one [3H, H] GEMM for Q, K
and V instead of three, held against the split layout it replaces.

The truths: the same seed draws the same weights in both layouts; on the same weights both
give the same outputs and gradients (fp32: to the last bits the GEMMs' summation order
allows; bf16 autocast: within its rounding), padded and unpadded with every CPU attention
kernel; the fused attention runs one GEMM forward where the split runs three (counted at the
aten level); HF files are byte for byte the split layout's, and either layout loads the
other's weights (HF's keys, a TensorFlow conversion); LAMB and LARS keep one trust ratio per
Q, K and V in the reference and foreach backends - with the same gradients a fused step
equals the split step bit for bit, and with one ratio for the whole [3H, H] tensor (a fused
tensor handed to the optimizer as it is) it would not (the fused backend compiles:
tests/integration/test_qkv_fused_optim.py holds it there, and a few LAMB training steps); a state dict or optimizer state of the other layout is
refused naming the keys, and a resume that changes the layout is refused naming
model.fusions (tests/integration/test_qkv_checkpoints.py: the same on a real run's
checkpoints).
"""
from __future__ import annotations

import io

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.optim_flat import FlatBuffers, FlatLayout
from runtime.config import ConfigError, load_config
from runtime.model.bert import BertForPreTraining
from runtime.model.config import BertConfig
from runtime.model.converters import FuseQKV
from runtime.model.hf import load_hf_state_dict, load_pretrained, save_hf_state_dict
from runtime.optim.groups import norm_blocks
from runtime.optim.optimizers import build_optimizer
from runtime.train import resume_rules as rr
from tests.support.qkv import OPTIMIZERS, batch, config, grads_hf, pair, run, steps
from tests.support.runs import CPU_CONFIG

# ------------------------------------------------------------------------------ the model

def test_one_seed_draws_the_same_weights_in_both_layouts():
    split, fused = pair()
    a, b = save_hf_state_dict(split), save_hf_state_dict(fused)
    assert list(a) == list(b)                      # the split layout's keys, in its order
    for k in a:
        assert torch.equal(a[k], b[k]), k
    w = fused.bert.encoder.layer[1].attention.self.Wqkv.weight
    assert w.shape == (3 * 64, 64)
    assert not hasattr(fused.bert.encoder.layer[1].attention.self, "query")
    layer = split.bert.encoder.layer[1].attention.self
    assert torch.equal(w[64:128], layer.key.weight)  # rows Q, K, V in that order


@pytest.mark.parametrize("attention,kernel", [("padded", "auto"), ("unpadded", "repad"),
                                              ("unpadded", "per_sequence"),
                                              ("unpadded", "jagged"),
                                              ("unpadded", "block_diagonal")])
def test_fused_equals_split_in_fp32(attention, kernel):
    split, fused = pair(attention, kernel)
    b = batch()
    a, f = run(split, b), run(fused, b)
    # forward: the same dot products over H, one GEMM or three - equal to the last bits
    # where the GEMM sums in the same order (it does here; allow the order a GEMM may pick)
    torch.testing.assert_close(f.mlm_logits, a.mlm_logits, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(f.loss, a.loss, rtol=2e-6, atol=0)
    ga, gf = grads_hf(split), grads_hf(fused)
    assert list(ga) == list(gf)
    for k in ga:
        torch.testing.assert_close(gf[k], ga[k], rtol=1e-5, atol=1e-7, msg=k)


@pytest.mark.parametrize("attention", ["padded", "unpadded"])
def test_fused_equals_split_under_bf16_autocast(attention):
    split, fused = pair(attention)
    b = batch()
    a, f = run(split, b, autocast=True), run(fused, b, autocast=True)
    torch.testing.assert_close(f.loss, a.loss, rtol=1e-2, atol=1e-2)
    ga, gf = grads_hf(split), grads_hf(fused)
    for k in ga:
        torch.testing.assert_close(gf[k], ga[k], rtol=5e-2, atol=2e-3, msg=k)


class GemmCount(TorchDispatchMode):
    """aten GEMM calls (mm, addmm, linear) by op, under autograd (forward and backward)."""

    OPS = ("aten.mm", "aten.addmm", "aten.linear")

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) in self.OPS:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("attention", ["padded", "unpadded"])
def test_the_fused_attention_runs_one_gemm_where_the_split_runs_three(attention):
    from kernels.attention import Varlen
    from runtime.model.bert import Unpadded, additive_mask
    counts = {}
    for name, model in zip(("split", "fused"), pair(attention, kernel="repad")):
        layer = model.bert.encoder.layer[0].attention.self
        if attention == "padded":
            x = torch.randn(2, 8, 64, requires_grad=True)
            mask = additive_mask(torch.ones(2, 1, 1, 8, dtype=torch.bool), x)
        else:
            x = torch.randn(11, 64, requires_grad=True)
            mask = Unpadded(Varlen.from_lengths(torch.tensor([8, 3])), "repad")
        forward, backward = GemmCount(), GemmCount()
        with forward:
            out = layer(x, mask)
        with backward:
            out.sum().backward()
        counts[name] = (forward.count, backward.count)
    # backward: a GEMM for the input's gradient and one for the weight's, per projection
    assert counts == {"split": (3, 6), "fused": (1, 2)}


def test_the_unpadded_path_hands_the_attention_views_not_copies(monkeypatch):
    import runtime.model.bert as bert
    seen = []

    def spy(q, k, v, *rest):
        seen.append((q, k, v))
        return q.reshape(q.shape[0], -1).new_zeros(q.shape)
    monkeypatch.setattr(bert, "varlen_attention", spy)
    from kernels.attention import Varlen
    _, fused = pair("unpadded")
    layer = fused.bert.encoder.layer[0].attention.self
    layer(torch.randn(11, 64), bert.Unpadded(Varlen.from_lengths(torch.tensor([8, 3]))))
    (q, k, v), = seen
    assert q.shape == (11, 4, 16) and q.stride() == (192, 16, 1)  # rows of [T, 3H]
    assert k.data_ptr() == q.data_ptr() + 64 * q.element_size()
    assert v.data_ptr() == q.data_ptr() + 128 * q.element_size()


# ------------------------------------------------------------------------------ HF files

def test_hf_files_are_byte_for_byte_the_split_layouts(tmp_path):
    from safetensors.torch import save as st_bytes
    split, fused = pair()
    with torch.no_grad():  # trained-looking weights, the same in both
        for p in split.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    load_hf_state_dict(fused, save_hf_state_dict(split))

    def torch_bytes(sd):
        buf = io.BytesIO()
        torch.save(sd, buf)
        return buf.getvalue()
    a, b = save_hf_state_dict(split), save_hf_state_dict(fused)
    assert torch_bytes(a) == torch_bytes(b)
    assert st_bytes(a) == st_bytes(b)
    assert all(k.split(".")[-2] != "Wqkv" for k in b)


def test_either_layout_loads_the_others_weights():
    split, fused = pair()
    other_split, other_fused = pair(seed=5)
    # HF keys into the fused layout, the fused layout's own state dict into the split one
    report = load_hf_state_dict(other_fused, save_hf_state_dict(split))
    assert not report.initialised and "bert.encoder.layer.0.attention.self.query.weight" \
        in report.loaded
    load_hf_state_dict(other_split, fused.state_dict())
    for model in (other_split, other_fused):
        sd = save_hf_state_dict(model)
        for k, v in save_hf_state_dict(split).items():
            assert torch.equal(sd[k], v), k


def test_a_fused_tensor_that_is_not_three_blocks_is_refused_naming_it():
    _, fused = pair()
    sd = fused.state_dict()
    key = "bert.encoder.layer.0.attention.self.Wqkv.weight"
    sd[key] = sd[key][:100]
    with pytest.raises(ValueError, match=f"{key}: shape \\(100, 64\\)"):
        load_hf_state_dict(fused, sd)


def test_a_state_dict_of_the_other_layout_loaded_directly_is_refused_naming_the_keys():
    split, fused = pair()
    with pytest.raises(RuntimeError, match=r"(?s)Missing key.*attention\.self\.Wqkv\.weight.*"
                                           r"Unexpected key.*attention\.self\.query\.weight"):
        fused.load_state_dict(split.state_dict())
    with pytest.raises(RuntimeError, match=r"(?s)Missing key.*self\.query\.weight.*"
                                           r"Unexpected key.*self\.Wqkv\.weight"):
        split.load_state_dict(fused.state_dict())


def test_a_tensorflow_conversion_loads_into_the_fused_layout(tmp_path):
    from runtime.model import convert as cv
    from tests.support.tf_checkpoint import CONFIG, PREFIX
    out = tmp_path / "bert"
    cv.convert(PREFIX, out, log=lambda m: None)
    cfg = BertConfig(**{k: v for k, v in CONFIG.items() if k != "hidden_act"})
    split = BertForPreTraining(cfg)
    fused = BertForPreTraining(cfg)
    FuseQKV().convert(fused)
    for model in (split, fused):
        assert not load_pretrained(model, out).initialised
    from safetensors.torch import load_file
    written = load_file(str(out / "model.safetensors"))
    sd = save_hf_state_dict(fused)
    assert set(sd) == set(written)
    assert all(torch.equal(sd[k], written[k]) for k in sd)
    ids = torch.randint(104, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = split.eval()(ids, masked_lm_labels=ids)
        b = fused.eval()(ids, masked_lm_labels=ids)
    torch.testing.assert_close(b.mlm_logits, a.mlm_logits, rtol=2e-6, atol=1e-6)


# ------------------------------------------------------------------------------ optimizers

def test_only_the_fused_weight_is_three_norm_blocks():
    _, fused = pair()
    blocks = {n: norm_blocks(n) for n, _ in fused.named_parameters()}
    assert {n for n, k in blocks.items() if k == 3} == {
        f"bert.encoder.layer.{i}.attention.self.Wqkv.weight" for i in range(2)}
    assert set(blocks.values()) == {1, 3}
    assert norm_blocks("module.bert.encoder.layer.0.attention.self.Wqkv.weight") == 3  # DDP


@pytest.mark.parametrize("backend", ["reference", "foreach"])   # fused: tests/integration/test_qkv_fused_optim.py
@pytest.mark.parametrize("name,hp", OPTIMIZERS)
def test_with_the_same_gradients_a_fused_step_equals_the_split_one_bit_for_bit(name, hp,
                                                                                backend):
    split, fused = pair(cfg=config(hidden=32, heads=2, layers=1))
    steps(name, backend, split, fused, **hp)
    a, b = save_hf_state_dict(split), save_hf_state_dict(fused)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("name,hp", OPTIMIZERS)
def test_one_ratio_for_the_whole_fused_tensor_would_differ(name, hp):
    """The test above can fail: one trust ratio for the whole [3H, H] tensor moves the
    Q, K and V weights by other amounts."""
    split, fused = pair(cfg=config(hidden=32, heads=2, layers=1))
    with torch.no_grad():  # Q, K and V of different norms: their ratios differ
        fused.bert.encoder.layer[0].attention.self.Wqkv.weight[:32].mul_(4.0)
        split.bert.encoder.layer[0].attention.self.query.weight.mul_(4.0)
    key = "bert.encoder.layer.0.attention.self.query.weight"
    before = save_hf_state_dict(split)[key]
    steps(name, "reference", split, fused, combined=True, **hp)
    a, b = save_hf_state_dict(split), save_hf_state_dict(fused)
    # Q's update: its own ratio against the one of [Q; K; V] - apart by a good part of it
    assert (a[key] - b[key]).abs().max() > 0.1 * (a[key] - before).abs().max()
    other = "bert.encoder.layer.0.intermediate.dense.weight"
    assert torch.equal(a[other], b[other])


def test_optimizer_state_of_the_other_layout_is_refused_naming_the_parameters():
    split, fused = pair()
    a = build_optimizer("lamb", list(split.named_parameters()), lr=0.01)
    b = build_optimizer("lamb", list(fused.named_parameters()), lr=0.01)
    for model in (split, fused):
        run(model, batch())
    a.step()
    with pytest.raises(ValueError, match=r"group 0 has \d+ tensors, "
                                         r"'bert\.encoder\.layer\.0\.attention\.self\.query"
                                         r"\.weight' at place 3, where this model has \d+, "
                                         r"'bert\.encoder\.layer\.0\.attention\.self\.Wqkv"
                                         r"\.weight'.*model\.fusions 'qkv'"):
        b.load_state_dict(a.state_dict())


def test_a_flat_layout_refuses_blocks_that_are_not_whole_rows():
    assert [s.blocks for s in FlatLayout.build([(96, 32), (96,)], blocks=[3, 1]).segments] \
        == [3, 1]
    with pytest.raises(ValueError, match=r"tensor 0 of shape \(48, 16\): 3 norm blocks"):
        FlatLayout.build([(48, 16)], blocks=[3])


def test_a_sharded_window_takes_its_rows_norm_blocks():
    layout = FlatLayout.build([(96, 32), (5,), (64, 16)], blocks=[3, 1, 1])
    assert layout.row_block("cpu").tolist() == [0, 1, 2, 3, 4]
    assert layout.block_segment("cpu").tolist() == [0, 0, 0, 1, 2]
    window = FlatBuffers(layout, dtype=torch.float32, device="cpu", state_names=(),
                         total=6 * 1024, window=(2 * 1024, 6 * 1024))
    assert window.row_block.tolist() == [2, 3, 4, 4]  # the zero tail counts as the last


# ------------------------------------------------------------------------------ the config

def test_the_config_takes_qkv_and_refuses_a_size_its_blocks_cannot_cut():
    cfg = load_config(CPU_CONFIG, ['model.fusions=["qkv"]'])
    assert cfg.model.fusions == ["qkv"]
    with pytest.raises(ConfigError, match="model.fusions 'qkv' needs model.hidden_size a "
                                          "multiple of 32, got 48"):
        load_config(CPU_CONFIG, ['model.fusions=["qkv"]', "model.hidden_size=48",
                                 "model.num_attention_heads=2"])


def test_a_resume_that_changes_the_layout_is_refused_naming_the_key():
    saved = load_config(CPU_CONFIG).to_dict()
    now = load_config(CPU_CONFIG, ['model.fusions=["qkv"]']).to_dict()
    refused, recorded = rr.compare(saved, now)
    assert [d.key for d in refused] == ["model.fusions"] and not recorded
    text = rr.refusal("ck/step_8", refused, "results/x")
    assert "model.fusions: the checkpoint has [], this run ['qkv']" in text
    assert "qkv: one [3H, H] tensor or three" in text
