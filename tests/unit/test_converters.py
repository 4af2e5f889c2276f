"""The model's changes as a list (runtime.model.converters): each a row - its name, the config
keys it reads, its state-dict mapping - and a class, applied by build_model in the declared
order after the weights are set; fusion qkv's conversion draws no random number and holds the
split layout's numbers; a constructor asked for a converted fusion refuses, naming where it
is made."""
import dataclasses

import pytest
import torch
from torch import nn

from kernels.fusions import CONVERTED, FUSIONS
from runtime.config import load_config
from runtime.model import fp8
from runtime.model.bert import BertForPreTraining
from runtime.model.compile import compiled_layers
from runtime.model.converters import CONVERTERS, FuseQKV, convert, to_hf
from runtime.train.build import build_model
from tests.support.runs import CPU_CONFIG
from tests.support.tiny import TINY

SHAPE = [f"{k}={v}" for k, v in TINY.items() if k.startswith("model.")]
ALL = ['model.fusions=["qkv"]', "model.fp8=tensorwise", "model.compile=layers",
       "data.shapes=static", "data.balance=offline_pack", "data.static_rows=2"]


class Reads:
    """A config that records the ``section.key``s read through it."""

    def __init__(self, obj, seen: set, section: str = ""):
        self._obj, self._seen, self._section = obj, seen, section

    def __getattr__(self, name):
        value = getattr(self._obj, name)
        if not self._section:
            return Reads(value, self._seen, name)
        self._seen.add(f"{self._section}.{name}")
        return value


def test_the_rows_are_in_their_order_and_each_converted_fusion_has_one():
    assert [r.name for r in CONVERTERS] == ["qkv", "fp8", "compile"]
    assert set(CONVERTED) <= {r.name for r in CONVERTERS} and set(CONVERTED) <= set(FUSIONS)


def test_each_converter_reads_what_its_row_says_it_needs():
    cfg = load_config(CPU_CONFIG, [*SHAPE, *ALL])
    keys = {f"{s.name}.{f.name}" for s in dataclasses.fields(cfg) if s.name != "source"
            for f in dataclasses.fields(getattr(cfg, s.name))}
    for row in CONVERTERS:
        assert set(row.needs) <= keys, row.name
        seen: set = set()
        assert row.cls.from_config(Reads(cfg, seen)) is not None, row.name   # asked
        assert seen == set(row.needs), row.name
    plain = load_config(CPU_CONFIG, SHAPE)
    for row in CONVERTERS:
        assert row.cls.from_config(plain) is None, row.name   # not asked: not made


def test_build_model_applies_them_in_order_after_the_weights():
    """FP8 converts the one Wqkv qkv made (its role names it), and the compiled layer traces
    the FP8 Linears: the order is the rows'."""
    cfg = load_config(CPU_CONFIG, [*SHAPE, *ALL])
    torch.manual_seed(0)
    model = build_model(cfg, torch.device("cpu"))
    attention = model.bert.encoder.layer[0].attention.self
    assert attention.fused_qkv and type(attention.Wqkv).__name__ == "Float8Linear"
    assert "bert.encoder.layer.0.attention.self.Wqkv" in {n for n, _ in fp8.converted(model)}
    assert len(compiled_layers(model)) == cfg.model.num_hidden_layers
    # the same initial weights as the plain model's, in HF's keys
    torch.manual_seed(0)
    plain = build_model(load_config(CPU_CONFIG, SHAPE), torch.device("cpu"))
    mine, theirs = to_hf(model.state_dict()), plain.state_dict()
    assert list(mine) == list(theirs)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_fusing_qkv_draws_no_random_number_and_keeps_the_numbers():
    cfg = load_config(CPU_CONFIG, SHAPE).model.bert_config()
    torch.manual_seed(0)
    model = BertForPreTraining(cfg)
    layer = model.bert.encoder.layer[0].attention.self
    q, k, v = (layer.query.weight.detach().clone(), layer.key.weight.detach().clone(),
               layer.value.weight.detach().clone())
    order = [n for n, _ in model.named_parameters()]
    state = torch.get_rng_state()
    FuseQKV().convert(model)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(layer.Wqkv.weight, torch.cat([q, k, v]))
    assert not hasattr(layer, "query") and isinstance(layer.Wqkv, nn.Linear)
    # the fused parameters take the three's place in the registration order
    i = order.index("bert.encoder.layer.0.attention.self.query.weight")
    assert [n for n, _ in model.named_parameters()][i:i + 2] == [
        "bert.encoder.layer.0.attention.self.Wqkv.weight",
        "bert.encoder.layer.0.attention.self.Wqkv.bias"]
    with pytest.raises(ValueError, match="fused already"):
        FuseQKV().convert(model)


def test_a_constructor_asked_for_a_converted_fusion_refuses_naming_the_converters():
    cfg = load_config(CPU_CONFIG, SHAPE).model.bert_config()
    with pytest.raises(ValueError, match=r"'qkv'.*runtime\.model\.converters"):
        BertForPreTraining(cfg, fusions=("qkv",))


def test_convert_names_what_it_applied():
    cfg = load_config(CPU_CONFIG, [*SHAPE, 'model.fusions=["qkv", "pad_vocab"]'])
    model = BertForPreTraining(cfg.model.bert_config(), fusions=("pad_vocab",))
    assert convert(model, cfg, torch.device("cpu")) == ["qkv"]
