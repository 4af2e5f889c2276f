"""The model's arithmetic (runtime/model/arithmetic.py) against independent counts: the
parameter count against the built model, the FLOP formula against torch's FlopCounterMode on a
real batch, the attention rule against the kernel that runs, and the MFU arithmetic and peak
table (runtime/observe/mfu.py)."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from kernels import attention as attn
from kernels.attention_rule import COST_LAYOUT, KERNELS, cost_layout, resolve
from loaders.dataset import TrainLoader
from runtime.calibrate.length_cost import KERNEL
from basis import model_shape
from runtime.model import arithmetic as ar
from runtime.model.bert import BertForPreTraining
from runtime.model.config import BertConfig
from runtime.observe.mfu import Peak, figures, peak_of


def config(name="tiny", **over):
    return BertConfig(**{**model_shape.size(name), "vocab_size": 30522, "max_position_embeddings": 128,
                         "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                         **over})


@pytest.mark.parametrize("name,over", [("tiny", {}), ("tiny", {"num_hidden_layers": 3,
                                                                "intermediate_size": 96})])
def test_the_parameter_count_is_the_built_models(name, over):
    cfg = config(name, **over)
    model = BertForPreTraining(cfg)
    counted = sum(p.numel() for p in model.parameters())  # tied decoder weight once
    assert model_shape.parameter_count(cfg) == counted


def test_named_sizes():
    assert 330e6 < model_shape.parameter_count(BertConfig(**model_shape.size("large"))) < 340e6  # BERT-large
    assert 105e6 < model_shape.parameter_count(BertConfig(**model_shape.size("base"))) < 112e6
    with pytest.raises(ValueError, match="tiny, base, large"):
        model_shape.size("huge")


@pytest.mark.parametrize("attention", ["unpadded", "padded"])
def test_the_flop_formula_counts_what_torch_counts(small_dataset, attention):
    """Forward exactly (the unpadded path computes only the real tokens: every matmul is the
    model's work), forward + backward within 3 % of 3x; on the padded path torch counts the
    padding too: the model's FLOPs (real tokens) are below what it computes."""
    cfg = config("tiny", num_hidden_layers=2)
    model = BertForPreTraining(cfg, attention=attention, kernel="per_sequence")
    with TrainLoader(small_dataset, 0, 1, 8, 3, verify=False) as loader:
        batch = next(loader)
    work = ar.batch_work(batch.sequence_lengths)
    masked = int((batch.masked_lm_labels != -100).sum())
    want = ar.forward_flops(cfg, masked=masked, **work)
    with FlopCounterMode(display=False) as fwd:
        out = model(batch.input_ids, batch.token_type_ids, batch.attention_mask,
                    masked_lm_labels=batch.masked_lm_labels,
                    next_sentence_labels=batch.next_sentence_labels, layout=batch.layout)
    with FlopCounterMode(display=False) as both:
        out = model(batch.input_ids, batch.token_type_ids, batch.attention_mask,
                    masked_lm_labels=batch.masked_lm_labels,
                    next_sentence_labels=batch.next_sentence_labels, layout=batch.layout)
        out.loss.backward()
    step = ar.step_flops(cfg, masked=masked, **work)
    if attention == "unpadded":
        assert fwd.get_total_flops() == pytest.approx(want, rel=1e-9)
        assert both.get_total_flops() == pytest.approx(step, rel=0.03)
    else:  # the padded path computes on every padded token: between its dense layers
        rows, width = batch.input_ids.shape  # alone and with attention over L² a row
        padded = dict(real_tokens=rows * width, masked=masked, sequences=work["sequences"])
        low = ar.forward_flops(cfg, squared_lengths=0, **padded)
        high = ar.forward_flops(cfg, squared_lengths=rows * width ** 2, **padded)
        assert low <= fwd.get_total_flops() <= high


def test_one_attention_rule_for_the_kernels_and_the_cost_layouts(monkeypatch):
    for device in ("cpu", "cuda"):
        for ok in (True, False):
            for kernel in KERNELS:
                name = resolve(kernel, device, ok)
                assert name in KERNELS and name != "auto"
                if COST_LAYOUT[name] is None:
                    with pytest.raises(ValueError, match="counter-example"):
                        cost_layout("unpadded", device, kernel, ok)
                else:
                    assert cost_layout("unpadded", device, kernel, ok) == COST_LAYOUT[name]
                assert cost_layout("padded", device, kernel, ok) == "padded"
    assert resolve("auto", "cuda", False) == "repad"  # the half the old copy left out
    # the kernel that runs for 'auto' on a CPU is the rule's, and its cost layout the one
    # the balancer prices
    ran = []
    monkeypatch.setitem(attn._BY_NAME, "repad", lambda *a, **k: ran.append("repad") or a[0])
    q = torch.zeros(3, 2, 4)
    attn.varlen_attention(q, q, q, attn.Varlen.from_lengths(torch.tensor([3])))
    assert ran == ["repad"] and ar.attention_layout("unpadded", "cpu") == "repad"
    # the calibration times each layout with a kernel of that layout
    for layout, kernel in KERNEL.items():
        assert kernel is None and layout == "padded" or COST_LAYOUT[kernel] == layout
    with pytest.raises(ValueError, match="model.attention='sparse'"):
        ar.attention_layout("sparse", "cpu")


def test_mfu_figures_and_the_peak_table():
    assert peak_of("NVIDIA H100 80GB HBM3", "bf16") == Peak(989.4, "H100 bf16 dense, datasheet")
    assert peak_of("NVIDIA H100 PCIe", "bf16").tflops == 756.0
    assert peak_of("NVIDIA A100-SXM4-80GB", "fp32").tflops == 19.5
    assert peak_of(None, "fp32").tflops is None  # a CPU: said so, no number
    assert "system.peak_tflops" in peak_of(None, "fp32").source
    assert peak_of("Some Future GPU", "bf16").tflops is None
    assert peak_of(None, "fp32", override=2.5) == Peak(2.5, "system.peak_tflops")
    f = figures(8e12, world_size=2, seconds=2.0, peak=Peak(4.0, ""))
    assert f == {"tflops": 2.0, "mfu": 0.5}
    assert figures(8e12, 2, 2.0, Peak(None, ""))["mfu"] is None
