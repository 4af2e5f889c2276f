"""model.fp8 (runtime/model/fp8.py, runtime.choices.FP8_RECIPES / FP8_ROLES) without training:
the rows against their Literal types and the model's modules, the refusals of the config
(exit 2 naming the keys; through ``python -m runtime.config`` as a child process in
tests/integration/test_bad_input_integration.py) and the combinations it accepts, where
emulation stands in (a CPU; a GPU below compute capability 8.9 only when asked), and which
Linears a conversion picks - by role in both QKV layouts, never the embeddings, pooler or
heads, never a dimension that is not a multiple of 16. The model trained in FP8:
tests/integration/test_fp8.py."""
from __future__ import annotations

from typing import get_args

import pytest
import torch
from torch import nn

from runtime.choices import FP8_RECIPES, FP8_ROLES, Fp8Recipe, Fp8Role
from runtime.config import load_config
from runtime.config.__main__ import main as config_main
from runtime.model import fp8
from runtime.model.bert import BertForPreTraining
from runtime.model.converters import FuseQKV
from runtime.model.config import BertConfig
from tests.support.runs import CPU_CONFIG

TINY = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=128, max_position_embeddings=128)


def test_the_rows_are_the_literals_and_every_role_names_modules_of_the_model():
    assert tuple(FP8_RECIPES) == get_args(Fp8Recipe)
    assert tuple(FP8_ROLES) == get_args(Fp8Role) == tuple(fp8.ROLE_MODULES)
    assert [n for n, r in FP8_RECIPES.items() if r.torchao is None] == ["none"]
    names = set()
    for qkv in (False, True):
        model = BertForPreTraining(TINY)
        if qkv:
            FuseQKV().convert(model)
        layer = model.bert.encoder.layer[0]
        names |= {n for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    assert names == {n for ns in fp8.ROLE_MODULES.values() for n in ns}


def _refused(capsys, *sets: str) -> str:
    argv = [str(CPU_CONFIG)] + [a for s in sets for a in ("--set", s)]
    assert config_main(argv) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("sets,words", [
    (["model.fp8=tensorwize"], ["model.fp8", "did you mean 'tensorwise'"]),
    (["model.fp8=tensorwise", 'model.fp8_layers=["qkvv"]'],
     ["model.fp8_layers", "did you mean 'qkv'"]),
    (["model.fp8=rowwise", "model.fp8_layers=[]"], ["model.fp8_layers=[]", "model.fp8='none'"]),
    (["model.fp8=tensorwise", "model.hidden_size=72", "model.num_attention_heads=2"],
     ["model.fp8_layers 'qkv'", "model.hidden_size a multiple of 16", "got 72"]),
    (["model.fp8=tensorwise", 'model.fusions=["bias_gelu"]'],
     ["model.fusions 'bias_gelu'", "'ffn_in'", "model.compile='layers'"]),
    (["model.fp8=tensorwise", 'model.fusions=["dropout_add_norm"]',
      'model.fp8_layers=["qkv","attn_out"]'], ["'dropout_add_norm'", "'attn_out'"]),
    (["model.fp8=tensorwise", "model.fp8_emulate=off"],
     ["model.fp8_emulate='off'", "system.device='cpu'"]),
    (["model.fp8=tensorwise", "system.device=cuda", "train.precision=fp16"],
     ["model.fp8='tensorwise' with train.precision='fp16'", "fp16's loss scale",
      "'bf16_master'", "model.fp8='none'"]),
    (["model.fp8=rowwise", "system.device=cuda", "train.precision=fp16_master"],
     ["model.fp8='rowwise' with train.precision='fp16_master'"]),
])
def test_the_config_refuses_what_cannot_work_naming_the_keys(capsys, sets, words):
    err = _refused(capsys, *sets)
    for word in words:
        assert word in err, err


@pytest.mark.parametrize("sets", [
    ["train.precision=bf16_master"],
    ["train.precision=fp32", "model.compile=layers"],
    ['model.fusions=["qkv","pad_vocab"]', "model.fp8_emulate=on"],
    ['model.fusions=["bias_gelu"]', 'model.fp8_layers=["qkv","attn_out","ffn_out"]'],
    ["system.device=cuda", "train.precision=bf16", "data.shapes=static",
     "train.cuda_graphs=full"],
    ["system.device=cuda", "train.precision=bf16_master", "data.shapes=static",
     "train.cuda_graphs=encoder"],
    ["optim.shard=world"],
])
def test_the_combinations_that_work_are_accepted(sets):
    cfg = load_config(CPU_CONFIG, ["model.fp8=tensorwise", *sets])
    assert cfg.model.fp8 == "tensorwise"


def test_the_help_lists_every_recipe_and_role():
    from runtime.config.__main__ import help_keys
    text = help_keys()
    for name in (*FP8_RECIPES, *FP8_ROLES):
        assert f"'{name}'" in text
    assert "fp8_emulate = 'auto'" in text


# ------------------------------------------------------------------------------ emulation

def _gpu(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a test GPU")


def test_a_cpu_emulates_unless_real_fp8_is_demanded():
    assert fp8.emulation("auto", "cpu").emulate and fp8.emulation("on", "cpu").emulate
    with pytest.raises(fp8.Fp8Unavailable, match="model.fp8_emulate='off'"):
        fp8.emulation("off", "cpu")


def test_a_gpu_below_8_9_is_refused_unless_emulation_is_asked_for(monkeypatch):
    from submission.train import exit_code_of
    _gpu(monkeypatch, (8, 0))
    with pytest.raises(fp8.Fp8Unavailable) as e:
        fp8.emulation("auto", "cuda:0")
    assert "compute capability >= 8.9" in str(e.value) and "8.0" in str(e.value)
    assert "model.fp8_emulate='on'" in str(e.value) and exit_code_of(e.value) == 2
    assert e.value.raised_on_all_ranks
    assert fp8.emulation("on", "cuda:0").emulate
    _gpu(monkeypatch, (9, 0))
    assert not fp8.emulation("auto", "cuda:0").emulate
    assert not fp8.emulation("off", "cuda:0").emulate
    assert fp8.emulation("on", "cuda:0").emulate


# ------------------------------------------------------------------------------ which Linears

def test_the_filter_picks_roles_and_fitting_shapes_only():
    keep = fp8.module_filter(FP8_ROLES)
    assert keep(nn.Linear(32, 64), "bert.encoder.layer.3.intermediate.dense")
    assert not keep(nn.Linear(24, 64), "bert.encoder.layer.3.intermediate.dense")  # 24 % 16
    assert not keep(nn.Linear(64, 40), "bert.encoder.layer.0.attention.self.Wqkv")
    for outside in ("bert.pooler.dense", "cls.predictions.transform.dense",
                    "cls.predictions.decoder", "cls.seq_relationship"):
        assert not keep(nn.Linear(64, 64), outside)
    assert not fp8.module_filter(["ffn_out"])(nn.Linear(64, 64),
                                              "bert.encoder.layer.0.intermediate.dense")
    with pytest.raises(ValueError, match="unknown role"):
        fp8.module_filter(["mlp"])


@pytest.mark.parametrize("fused,qkv", [(False, ["query", "key", "value"]), (True, ["Wqkv"])])
def test_both_qkv_layouts_are_converted_by_role_and_nothing_else(fused, qkv):
    torch.manual_seed(0)
    model = BertForPreTraining(TINY)
    if fused:
        FuseQKV().convert(model)
    params = dict(model.named_parameters())
    names = fp8.convert(model, "tensorwise", FP8_ROLES, emulate=True)
    got = {n for n, _ in fp8.converted(model)}
    assert got == set(names)
    want = {f"bert.encoder.layer.{i}.{m}" for i in range(2) for m in
            [*(f"attention.self.{q}" for q in qkv), "attention.output.dense",
             "intermediate.dense", "output.dense"]}
    assert got == want
    # the same Parameter objects under the same names: the optimizer, the gradient buffers,
    # checkpoints and the export see the model they would see without FP8
    assert dict(model.named_parameters()) == params
    facts = fp8.facts(model, "tensorwise", "auto", "cpu")
    assert facts["emulated"] and facts["linears"] == len(want) and facts["roles"] == list(FP8_ROLES)


def test_a_model_with_no_linear_to_convert_is_refused():
    model = BertForPreTraining(BertConfig(vocab_size=100, hidden_size=40, num_hidden_layers=1,
                                          num_attention_heads=2, intermediate_size=72))
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8.convert(model, "tensorwise", FP8_ROLES, emulate=True)
