"""Reading TensorFlow checkpoints without TensorFlow (runtime/model/tf_bundle.py) and converting
the BERT ones (runtime/model/convert.py), held against what real TensorFlow wrote and read.

The fixture (tests/fixtures/tf_bert_tiny/, written by its make_fixture.py with TensorFlow
2.21, which the suite never installs): a 3-layer BERT with Google's variable names, the
adam_m/adam_v slots and global_step, saved by TF1's sharded Saver into two data shards, and
``tf_values.npz`` - every variable as ``tf.train.load_checkpoint`` read it back. The truths:
the reader's bytes equal TensorFlow's for every variable; the converted file holds exactly
those values (kernels transposed); a model loaded from the converted directory (model.init)
gives bit-identical logits to one loaded from TensorFlow's values through the HF-key loader;
every damaged or foreign input exits 2 naming the file, with nothing written.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.tf_bundle_writer import write_bundle, write_index
from runtime.model import convert as cv
from runtime.model import crc32c as crc_module
from runtime.model.crc32c import crc32c_numpy
from runtime.model.tf_bundle import (Bundle, BundleError, crc32c, mask_crc, read_table,
                                     unmask_crc)
from tests.support.tf_checkpoint import CONFIG, FIXTURE, PREFIX, copy_checkpoint



@pytest.fixture(scope="module")
def tf_values() -> dict[str, np.ndarray]:
    with np.load(FIXTURE / "tf_values.npz") as z:
        return {k.replace("|", "/"): z[k] for k in z.files if k != "tf_version"}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("conv") / "bert"
    cv.convert(PREFIX, out, log=lambda m: None)
    return out


# ------------------------------------------------------------------------------ the reader

def test_crc32c_known_values_and_every_length_path():
    crc32c = crc32c_numpy                                # the reference; the library below
    assert crc32c(b"123456789") == 0xE3069283           # the CRC-32C check value
    assert crc32c(b"") == 0 and crc32c(bytes(32)) == 0x8A9136AA   # RFC 3720 B.4
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 300_017, dtype=np.uint8).tobytes()
    plain = 0xFFFFFFFF                                   # the byte loop, the definition
    table = [0] * 256
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table[i] = c
    for b in data:
        plain = table[(plain ^ b) & 0xFF] ^ (plain >> 8)
    assert crc32c(data) == plain ^ 0xFFFFFFFF            # lanes folded = one pass
    assert crc32c(data[70_000:], crc32c(data[:70_000])) == plain ^ 0xFFFFFFFF
    assert all(unmask_crc(mask_crc(x)) == x for x in (0, 1, 0xE3069283, 0xFFFFFFFF))


def test_the_library_runs_and_equals_the_numpy_reference():
    # requirements.txt pins google-crc32c: a venv without its C extension fails here rather
    # than checking a checkpoint ~100x slower without a word.
    assert crc_module.IMPLEMENTATION.startswith("google-crc32c "), crc_module.IMPLEMENTATION
    assert crc32c(b"123456789") == 0xE3069283 and crc32c(b"") == 0
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, (1 << 20) + 13, dtype=np.uint8).tobytes()
    edges = [0, 1, 2, 3, 4, 7, 8, 9, 15, 16, 17, 255, 256, 257, 4095, 4096, 4097,
             crc_module._BYTEWISE_BELOW - 1, crc_module._BYTEWISE_BELOW,
             crc_module._BYTEWISE_BELOW + 1, 65_537, 300_017, len(data)]
    for n in edges:
        assert crc32c(data[:n]) == crc32c_numpy(data[:n]), n
    for start in (0, 1, 5, 4097):                      # continuing from an earlier CRC
        assert crc32c(data[start:], crc32c(data[:start])) == crc32c_numpy(data), start
    assert crc32c(bytearray(data[:99])) == crc32c_numpy(data[:99])    # any bytes-like
    assert crc32c(memoryview(data)[3:70_000]) == crc32c_numpy(data[3:70_000])
    assert crc32c(bytes(1 << 16)) == crc32c_numpy(bytes(1 << 16))     # all zeros


@pytest.mark.parametrize("library,says", [
    (None, "numpy (google-crc32c is not installed)"),
    ("python", "numpy (google-crc32c has only its pure-Python build)"),
])
def test_without_the_c_library_the_numpy_implementation_runs_and_says_so(monkeypatch, library,
                                                                         says):
    import importlib
    import sys
    import types
    if library is None:
        monkeypatch.setitem(sys.modules, "google_crc32c", None)      # import fails
    else:
        fake = types.ModuleType("google_crc32c")
        fake.implementation = library
        fake.extend = lambda crc, data: pytest.fail("the pure-Python build was used")
        monkeypatch.setitem(sys.modules, "google_crc32c", fake)
    try:
        module = importlib.reload(crc_module)
        assert module.IMPLEMENTATION == says
        assert module.crc32c(b"123456789") == 0xE3069283
    finally:
        monkeypatch.undo()
        importlib.reload(crc_module)
    assert crc_module.IMPLEMENTATION.startswith("google-crc32c ")


def test_the_bench_writer_writes_the_entries_tensorflow_wrote(tmp_path, tf_values):
    """bench/tf_bundle_writer.py, which makes the bench's checkpoint and the crafted indexes
    below: from the fixture's entries, the same header and BundleEntryProto bytes as
    TensorFlow's; from its values, a bundle the reader reads back equal, with TF's CRCs."""
    bundle = Bundle(PREFIX)
    write_index(tmp_path / "same.index", bundle.num_shards, bundle.entries)
    assert read_table(tmp_path / "same.index") == read_table(Path(f"{PREFIX}.index"))
    entries = write_bundle(tmp_path / "again", sorted(tf_values.items()), num_shards=2,
                           shard_of=lambda n: bundle.entries[n].shard_id)
    again = Bundle(tmp_path / "again")
    for name, want in tf_values.items():
        assert np.array_equal(again.read(name), want), name
        assert entries[name].crc32c == bundle.entries[name].crc32c, name


def test_reader_equals_tensorflow_for_every_variable(tf_values):
    bundle = Bundle(PREFIX)
    assert bundle.num_shards == 2
    assert {e.shard_id for e in bundle.entries.values()} == {0, 1}      # both shards used
    assert set(bundle.entries) == set(tf_values)
    for name, want in tf_values.items():
        got = bundle.read(name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert np.array_equal(got, want), name
    assert int(bundle.read("global_step")) == 3


def test_index_is_a_sorted_table_with_the_header_first():
    keys = [k for k, _ in read_table(Path(f"{PREFIX}.index"))]
    assert keys[0] == b"" and keys == sorted(keys) and len(keys) == 188


@pytest.mark.parametrize("damage,expect", [
    (lambda p: p.write_bytes(p.read_bytes()[:-7]), r"\.index: no table magic number"),
    (lambda p: p.write_bytes(p.read_bytes()[:20]), r"\.index: 20 bytes, shorter than"),
    (lambda p: p.write_bytes(_flip(p.read_bytes(), 100)), r"\.index: the data block .* fails "
                                                          r"its CRC-32C"),
    (lambda p: p.write_bytes(b"\0" * 200), r"\.index: no table magic"),
])
def test_a_damaged_index_is_refused_naming_it(tmp_path, damage, expect):
    prefix = copy_checkpoint(tmp_path)
    damage(Path(f"{prefix}.index"))
    with pytest.raises(BundleError, match=expect):
        Bundle(prefix)


def _flip(raw: bytes, at: int) -> bytes:
    return raw[:at] + bytes([raw[at] ^ 0x40]) + raw[at + 1:]


def test_data_shard_faults_name_the_shard(tmp_path):
    prefix = copy_checkpoint(tmp_path)
    bundle = Bundle(prefix)
    name = next(n for n, e in bundle.entries.items() if e.shard_id == 1 and e.size > 64)
    e = bundle.entries[name]
    shard = Path(f"{prefix}.data-00001-of-00002")
    raw = shard.read_bytes()
    shard.write_bytes(_flip(raw, e.offset + 5))
    with pytest.raises(BundleError, match=rf"data-00001-of-00002: the bytes of {name} .* fail "
                                          "their CRC-32C"):
        bundle.read(name)
    shard.write_bytes(raw[:e.offset + 3])
    with pytest.raises(BundleError, match=r"data-00001-of-00002: \d+ bytes, but .* truncated"):
        bundle.check_layout([name])
    shard.unlink()
    with pytest.raises(BundleError, match=r"data-00001-of-00002: missing - data shard 2 of 2"):
        bundle.check_layout([name])


def test_a_file_instead_of_the_prefix_says_to_name_the_prefix():
    with pytest.raises(BundleError, match=r"name the checkpoint by its prefix"):
        Bundle(Path(f"{PREFIX}.index"))


# ------------------------------------------------------------------------------ the mapping

def test_every_fixture_name_is_mapped_or_optimizer_state(tf_values):
    weights, state, unknown = cv.classify(tf_values)
    assert not unknown
    assert len(weights) == 5 + 16 * CONFIG["num_hidden_layers"] + 9
    assert {n for n, _ in state} == {n for n in tf_values if n.endswith(("/adam_m", "/adam_v"))} \
        | {"global_step"}
    by_tf = {w.tf: w for w in weights}
    assert by_tf["bert/encoder/layer_2/attention/output/LayerNorm/gamma"].hf == \
        "bert.encoder.layer.2.attention.output.LayerNorm.weight"
    assert by_tf["bert/encoder/layer_1/intermediate/dense/kernel"].transpose
    assert by_tf["cls/seq_relationship/output_weights"].hf == "cls.seq_relationship.weight"
    assert not by_tf["cls/seq_relationship/output_weights"].transpose   # [2, hidden] already
    assert cv.map_name("bert/encoder/layer_11/output/dense/bias").hf == \
        "bert.encoder.layer.11.output.dense.bias"
    _, state, unknown = cv.classify(["bert/pooler/dense/kernel/LAMB_1", "beta1_power",
                                     "bert/nothing/kernel/adam_m", "model/.ATTRIBUTES/x"])
    assert [n for n, _ in state] == ["bert/pooler/dense/kernel/LAMB_1", "beta1_power"]
    assert unknown == ["bert/nothing/kernel/adam_m", "model/.ATTRIBUTES/x"]


def test_converted_file_holds_tensorflows_values_exactly(converted, tf_values):
    from safetensors.torch import load_file
    sd = load_file(converted / cv.MODEL_FILE)
    weights, _, _ = cv.classify(tf_values)
    for w in weights:
        want = tf_values[w.tf].T if w.transpose else tf_values[w.tf]
        assert np.array_equal(sd[w.hf].numpy(), want), w.tf
    assert torch.equal(sd["cls.predictions.decoder.weight"],
                       sd["bert.embeddings.word_embeddings.weight"])        # tied
    assert torch.equal(sd["cls.predictions.decoder.bias"], sd["cls.predictions.bias"])
    assert set(sd) == {w.hf for w in weights} | set(cv.TIED)
    manifest = json.loads((converted / cv.MANIFEST_FILE).read_text())
    for src in manifest["sources"]:
        path = FIXTURE / src["file"]
        assert src["bytes"] == path.stat().st_size and src["sha256"] == cv._sha256(path)
    assert [s["file"] for s in manifest["sources"]] == [
        "model.ckpt-3.index", "model.ckpt-3.data-00000-of-00002",
        "model.ckpt-3.data-00001-of-00002"]
    assert len(manifest["mapping"]) == len(weights)
    assert {s["tf"] for s in manifest["skipped"]} == set(tf_values) - {w.tf for w in weights}
    assert manifest["outputs"][cv.MODEL_FILE]["sha256"] == cv._sha256(converted / cv.MODEL_FILE)
    assert json.loads((converted / cv.CONFIG_FILE).read_text())["hidden_size"] == 16


def test_optimizer_state_is_kept_when_asked(tmp_path, tf_values):
    from safetensors.torch import load_file
    cv.convert(PREFIX, tmp_path / "out", keep_optimizer_state=True, log=lambda m: None)
    slots = load_file(tmp_path / "out" / cv.OPTIMIZER_FILE)
    key = "bert.encoder.layer.0.attention.self.query.weight.adam_v"
    want = tf_values["bert/encoder/layer_0/attention/self/query/kernel/adam_v"].T
    assert np.array_equal(slots[key].numpy(), want)
    assert int(slots["global_step"]) == 3 and len(slots) == 125


def _logits(model):
    torch.manual_seed(0)
    ids = torch.randint(104, CONFIG["vocab_size"], (2, 12))
    ids[:, 0], ids[:, -1] = 101, 102
    labels = ids.clone()                       # every position labelled: the MLM logits of all
    with torch.no_grad():
        out = model.eval()(ids, torch.zeros_like(ids), torch.ones_like(ids), labels)
    return out


def test_model_init_loads_the_directory_with_the_logits_of_the_hf_path(converted, tf_values,
                                                                       tmp_path):
    from runtime.model.bert import BertForPreTraining
    from runtime.model.config import BertConfig
    from runtime.model.hf import load_hf_state_dict
    from runtime.train.build import build_model
    from tests.support.tiny import tiny_config

    shape = {f"model.{k}": v for k, v in CONFIG.items() if k != "hidden_act"}
    cfg = tiny_config(tmp_path, *[f"{k}={v}" for k, v in shape.items()],
                      f'model.init="{converted}"', 'model.size=""',
                      "data.max_seq_length=64")
    ours = build_model(cfg)                                   # model.init = the directory

    # The same weights through the HF-key loader: TensorFlow's values under the HF keys an
    # independent table gives (the BertModel layout HF's own TF converter writes).
    sd = {}
    for name, value in tf_values.items():
        if name.endswith(("/adam_m", "/adam_v")) or name == "global_step":
            continue
        key = (name.replace("bert/encoder/layer_", "bert/encoder/layer/")
               .replace("/gamma", "/weight").replace("/beta", "/bias")
               .replace("cls/predictions/output_bias", "cls/predictions/bias")
               .replace("cls/seq_relationship/output_weights", "cls/seq_relationship/weight")
               .replace("cls/seq_relationship/output_bias", "cls/seq_relationship/bias"))
        key = key.replace("/", ".")
        if key.endswith(".kernel"):
            key, value = key[:-len("kernel")] + "weight", value.T
        elif key.endswith("_embeddings"):
            key += ".weight"
        sd[key] = torch.from_numpy(np.ascontiguousarray(value))
    theirs = BertForPreTraining(BertConfig(**{k: v for k, v in CONFIG.items()
                                              if k != "hidden_act"}))
    report = load_hf_state_dict(theirs, sd)
    assert not report.initialised                              # every weight came from TF
    a, b = _logits(ours), _logits(theirs)
    assert a.mlm_logits.shape == (24, CONFIG["vocab_size"])
    assert torch.equal(a.mlm_logits, b.mlm_logits) and torch.equal(a.nsp_logits, b.nsp_logits)


# ------------------------------------------------------------------------------ bad input

def _cli(capsys, *args) -> tuple[int, str]:
    rc = cv.main([str(a) for a in args])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("case", ["truncated index", "corrupt data", "missing shard",
                                  "truncated data"])
def test_a_damaged_checkpoint_exits_2_naming_the_file_and_writes_nothing(tmp_path, capsys, case):
    prefix = copy_checkpoint(tmp_path)
    index, shard = Path(f"{prefix}.index"), Path(f"{prefix}.data-00000-of-00002")
    if case == "truncated index":
        index.write_bytes(index.read_bytes()[:-30])
        named = index
    elif case == "corrupt data":
        e = Bundle(prefix).entries["bert/embeddings/word_embeddings"]
        shard = Path(f"{prefix}.data-{e.shard_id:05d}-of-00002")
        shard.write_bytes(_flip(shard.read_bytes(), e.offset + 17))
        named = shard
    elif case == "missing shard":
        shard.unlink()
        named = shard
    else:
        shard.write_bytes(shard.read_bytes()[:1000])
        named = shard
    rc, err = _cli(capsys, prefix, "--out", tmp_path / "out")
    assert rc == 2 and err.startswith("convert: error: ") and str(named) in err, err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.parametrize("shape,size", [
    ((2**32, 2**32), 0),           # 2**64 elements: an int64 product wraps to 0 = "0 bytes"
    ((2**32 + 1, 2**32 + 1), 8),   # wraps to 2**33 + 1 elements
])
def test_an_entry_whose_element_count_overflows_int64_is_a_corrupt_index(tmp_path, capsys,
                                                                         shape, size):
    """An index (CRCs valid) giving an optimizer slot a shape no file can hold: exit 2 naming
    the variable, the file and the true byte count - never a traceback from reshape."""
    from dataclasses import replace
    prefix = copy_checkpoint(tmp_path)
    bundle = Bundle(prefix)
    name = "bert/embeddings/word_embeddings/adam_m"
    entries = dict(bundle.entries)
    entries[name] = replace(entries[name], shape=shape, size=size,
                            crc32c=mask_crc(crc32c(b"\0" * size)))
    write_index(Path(f"{prefix}.index"), bundle.num_shards, entries)
    rc, err = _cli(capsys, prefix, "--out", tmp_path / "out", "--keep-optimizer-state")
    assert rc == 2 and err.startswith("convert: error: "), err
    assert f"{prefix}.index: {name} holds {size} bytes" in err and "the index is corrupt" in err
    assert f"({shape[0] * shape[1] * 4} bytes)" in err          # the true count, unwrapped
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


def test_an_unknown_variable_exits_2_naming_it(tmp_path, capsys):
    prefix = copy_checkpoint(tmp_path, FIXTURE / "unknown.ckpt")
    rc, err = _cli(capsys, prefix, "--out", tmp_path / "out")
    assert rc == 2 and f"{prefix}.index" in err
    assert "bert/encoder/layer_0/attention/self/rotary/inv_freq" in err
    assert not (tmp_path / "out").exists()


def test_a_shape_the_config_disagrees_with_exits_2_naming_key_and_field(tmp_path, capsys):
    cfg = dict(CONFIG, hidden_size=32, intermediate_size=64)
    (tmp_path / "other.json").write_text(json.dumps(cfg))
    rc, err = _cli(capsys, PREFIX, "--out", tmp_path / "out", "--config", tmp_path / "other.json")
    assert rc == 2 and f"{PREFIX}.index" in err and "disagree with the config" in err
    assert "bert/embeddings/word_embeddings has shape [187, 16]" in err
    assert "hidden_size = 16 in the checkpoint" in err
    cfg = dict(CONFIG, num_hidden_layers=2)
    (tmp_path / "fewer.json").write_text(json.dumps(cfg))
    rc, err = _cli(capsys, PREFIX, "--out", tmp_path / "out", "--config", tmp_path / "fewer.json")
    assert rc == 2 and "the checkpoint has 3 encoder layers (layer_0 .. layer_2)" in err
    assert "num_hidden_layers = 2" in err
    rc, err = _cli(capsys, PREFIX, "--out", tmp_path / "out", "--config", tmp_path / "none.json")
    assert rc == 2 and "none.json: no such file" in err
    assert not (tmp_path / "out").exists()


def test_the_output_directory_is_never_overwritten(tmp_path, capsys, converted):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("x")
    rc, err = _cli(capsys, PREFIX, "--out", out)
    assert rc == 2 and "not empty" in err and (out / "mine.txt").read_text() == "x"
    rc, err = _cli(capsys, PREFIX, "--out", converted)          # the same conversion
    assert rc == 0 and not err
    rc, err = _cli(capsys, PREFIX, "--out", converted, "--keep-optimizer-state")
    assert rc == 2 and "other files or options" in err


def test_model_init_naming_the_tensorflow_checkpoint_says_to_convert_it(tmp_path):
    from runtime.train.build import InitCheckpointError, build_model
    from tests.support.tiny import tiny_config
    for init in (PREFIX, FIXTURE):                     # the prefix, or its directory
        cfg = tiny_config(tmp_path, f'model.init="{init}"')
        with pytest.raises(InitCheckpointError, match=r"is a TensorFlow checkpoint: convert it "
                                                      r"first with `python -m runtime.model"):
            build_model(cfg)
