"""basis.model_shape: the model's shape keys, sizes and the one rule for ``model.size``
beside shape keys - the run config's and the converter's ``--config`` TOML read it alike."""
import pytest

from basis import model_shape
from runtime.choices import ConfigError
from runtime.config import load_config
from runtime.model import convert

TOML = """[model]
size = "large"
{extra}
[train]
global_batch_size = 64
"""


def test_size_beside_a_disagreeing_shape_key_is_one_error_for_the_run_and_the_converter(
        tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(TOML.format(extra="hidden_size = 768"))
    want = ("model.size='large' has hidden_size=1024, but model.hidden_size=768 is set too: "
            "drop one of them")
    with pytest.raises(ConfigError) as run:
        load_config(bad)
    assert want in str(run.value)
    with pytest.raises(convert.ConvertError) as conv:   # it took the shape key, silently
        convert.load_config(bad, tmp_path / "model.ckpt")
    assert want in str(conv.value)


def test_size_beside_agreeing_keys_and_the_other_model_keys(tmp_path):
    ok = tmp_path / "ok.toml"
    ok.write_text(TOML.format(extra="hidden_size = 1024\nvocab_size = 30528\n"
                                    "attention = \"unpadded\""))
    cfg, _ = convert.load_config(ok, tmp_path / "model.ckpt")
    assert model_shape.shape_of(cfg) == {**model_shape.size("large"), "vocab_size": 30528}
    assert model_shape.shape_of(load_config(ok).model) == model_shape.shape_of(cfg)
    with pytest.raises(ValueError, match="model.size='huge': choose one of tiny | base | large"):
        model_shape.sized("huge", {})


def test_the_parameter_count_of_the_named_sizes():
    cfg = dict(model_shape.size("large"), vocab_size=30522, max_position_embeddings=512,
               type_vocab_size=2)
    assert 330e6 < model_shape.parameter_count(cfg) < 340e6
