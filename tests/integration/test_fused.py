"""The fusions of model.fusions (kernels/fused.py, runtime/model/bert.py) against their plain-torch
references on CPU: each fused function equal in value and every gradient (fp32), dropout at
its rate, the widths constants and only the token dimension symbolic in the generated code, a
model with each fusion alone and with all of them equal to one without (loss and gradients
on a real batch), the padded vocabulary invisible to HF files, and no recompile over real
batches of changing shapes."""
from __future__ import annotations

import pytest
import torch

from kernels import fused
from kernels.fusions import FUSIONS
from loaders.balance import BalanceSpec
from loaders.dataset import TrainLoader
from runtime.model.bert import BertForPreTraining, PAD_LOGIT
from runtime.model.config import BertConfig
from runtime.model.hf import load_hf_state_dict, save_hf_state_dict
from tests.support.inductor import frames_compiled, generated_code, input_sizes, is_constant

TOL = dict(rtol=1e-5, atol=1e-6)  # fp32: a compiled kernel sums in another order


def leaves(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, requires_grad=True) for s in shapes]


def grads_of(fn, inputs):
    out = fn(*inputs)
    out.backward(torch.ones_like(out).mul_(0.37))  # any fixed upstream gradient
    return out.detach(), [x.grad.clone() for x in inputs if isinstance(x, torch.Tensor)
                          and x.requires_grad]


def test_bias_gelu_equals_its_reference():
    for shape in ((5, 16), (3, 7, 16)):  # two shapes: one compile (dynamic)
        ref = grads_of(fused.bias_gelu_reference, leaves(shape, (16,)))
        got = grads_of(fused.bias_gelu, leaves(shape, (16,)))
        torch.testing.assert_close(got[0], ref[0], **TOL)
        for a, b in zip(got[1], ref[1]):
            torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("training", [True, False])
def test_bias_dropout_add_layer_norm_equals_its_reference(training):
    def call(fn):
        y, b, r, w, lb = leaves((6, 16), (16,), (6, 16), (16,), (16,), seed=1)
        return grads_of(lambda *a: fn(*a, 0.0, training, 1e-12), [y, b, r, w, lb])
    ref, got = call(fused.bias_dropout_add_layer_norm_reference), \
        call(fused.bias_dropout_add_layer_norm)
    torch.testing.assert_close(got[0], ref[0], **TOL)
    for a, b in zip(got[1], ref[1]):
        torch.testing.assert_close(a, b, **TOL)


def test_only_the_token_dimension_is_symbolic_in_the_generated_code():
    """[b, L, H] inputs are seen as [b·L, H] with the token dimension dynamic: in the forward
    and backward code of both fusions every [tokens, width] input has a constant width (H =
    48, I = 80 here) and a symbolic token count. Compiled with every dimension symbolic
    (dynamic=True, before) the widths were symbols too - LayerNorm a looped reduction."""
    def run():
        y, b, r, w, lb = leaves((3, 7, 48), (48,), (3, 7, 48), (48,), (48,), seed=2)
        fused.bias_dropout_add_layer_norm(y, b, r, w, lb, 0.1, True, 1e-12).sum().backward()
        yi, bi = leaves((3, 7, 80), (80,), seed=3)
        fused.bias_gelu(yi, bi).sum().backward()
    sizes = input_sizes(generated_code(run))
    rows = [s for s in sizes if len(s) == 2]
    assert len(rows) >= 6 and {s[1] for s in rows} <= {"1", "48", "80"}, sizes
    assert {"48", "80"} <= {s[1] for s in rows}
    assert all(not is_constant(s[0]) for s in rows), sizes  # the token count: a symbol
    assert all(is_constant(d) for s in sizes if len(s) == 1 for d in s), sizes  # biases


def test_inside_a_compiled_region_the_reference_is_traced_instead(monkeypatch):
    """A model built with the fusions whose layers are compiled whole (runtime.model.compile
    for a direct caller; the config refuses the pair): the fusion calls its reference - traced
    into the layer's graph - rather than torch.compile inside a trace."""
    own = fused._Compiled(fused.bias_gelu_reference)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    y, b = leaves((4, 16), (16,), seed=4)
    torch.testing.assert_close(own(y, b), fused.bias_gelu_reference(y, b), rtol=0, atol=0)
    assert own.compiled is None and not own.failed


def _compiled_by(monkeypatch, *calls):
    """A _Compiled whose "compiled" function does ``calls`` in turn (a value: return it; an
    exception: raise it) - no compile, what the fallback does is what is checked."""
    todo = list(calls)

    def fake(*args):
        got = todo.pop(0)
        if isinstance(got, BaseException):
            raise got
        return got
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fake)
    return fused._Compiled(fused.bias_gelu_reference)


def test_a_fusions_fallback_is_on_record_and_never_hides_a_later_failure(monkeypatch):
    """Only a failure at the first call falls back to the reference, and ``failed`` (what
    bench.gpu puts in a case's record via ``fused.fallbacks``) says why; a device out of
    memory - at any call - and any error after a compiled call succeeded are raised: a fused
    case must never record the reference's figures under its name."""
    y, b = leaves((4, 16), (16,), seed=5)
    want = fused.bias_gelu_reference(y, b)
    oom = _compiled_by(monkeypatch, torch.OutOfMemoryError("CUDA out of memory."))
    with pytest.raises(torch.OutOfMemoryError):
        oom(y, b)
    assert oom.failed is None
    later = _compiled_by(monkeypatch, want.detach(), RuntimeError("illegal memory access"))
    later(y, b)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        later(y, b)
    assert later.failed is None
    broken = _compiled_by(monkeypatch, RuntimeError("InductorError: no Triton\nmore"))
    with pytest.warns(RuntimeWarning, match="running the reference instead"):
        torch.testing.assert_close(broken(y, b), want, rtol=0, atol=0)
    assert broken.failed == "RuntimeError: InductorError: no Triton"
    torch.testing.assert_close(broken(y, b), want, rtol=0, atol=0)  # the reference from now on
    monkeypatch.setitem(fused.BY_FUSION, "bias_gelu", broken)
    assert fused.fallbacks() == {"bias_gelu": "RuntimeError: InductorError: no Triton"}


def test_the_fused_dropout_drops_at_its_rate():
    """Ones in, no residual: before the LayerNorm a kept entry is 1/0.9 and a dropped one 0,
    so in each normalised row the dropped entries are the ones below the row's mean."""
    y, zero = torch.ones(400, 256), torch.zeros(256)
    out = fused.bias_dropout_add_layer_norm(y, zero, torch.zeros_like(y), torch.ones(256),
                                            zero, 0.1, True, 1e-12)
    dropped = (out < out.mean(dim=1, keepdim=True)).float().mean()
    assert abs(float(dropped) - 0.1) < 0.01
    rows = out[(out < 0).any(dim=1)]
    assert len(rows) > 390 and torch.isfinite(out).all()  # nearly every row lost some


def config():
    return BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=128, max_position_embeddings=128,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


SAME_NAMES = ("bias_gelu", "dropout_add_norm", "pad_vocab")
"""The fusions that keep every parameter's name (the test below compares gradients by name)."""


@pytest.mark.parametrize("attention,fusions", [
    *(("unpadded", (name,)) for name in SAME_NAMES), ("unpadded", SAME_NAMES),
    ("padded", SAME_NAMES)], ids=[*SAME_NAMES, "all-unpadded", "all-padded"])
def test_a_model_with_each_fusion_or_all_equals_one_without(small_dataset, attention, fusions):
    """Each fusion selectable alone (what bench.gpu times one at a time) and all together."""
    assert set(SAME_NAMES) <= set(FUSIONS)
    torch.manual_seed(0)
    plain = BertForPreTraining(config(), attention=attention)
    fast = BertForPreTraining(config(), attention=attention, fusions=fusions)
    print(load_hf_state_dict(fast, save_hf_state_dict(plain)))
    with TrainLoader(small_dataset, 0, 1, 8, 3, verify=False) as loader:
        batch = next(loader)
    results = []
    for model in (plain, fast):
        out = model(batch.input_ids, batch.token_type_ids, batch.attention_mask,
                    masked_lm_labels=batch.masked_lm_labels,
                    next_sentence_labels=batch.next_sentence_labels, layout=batch.layout)
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        results.append((out, grads))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(b.loss, a.loss, **TOL)
    assert int(a.mlm_correct) == int(b.mlm_correct)
    v = plain.config.vocab_size
    for name, g in ga.items():
        h = gb[name]
        if h.shape != g.shape:  # the padded vocabulary's rows: exactly no gradient
            assert "pad_vocab" in fusions
            assert h.shape[0] == fast.vocab_rows and not h[v:].any()
            h = h[:v]
        torch.testing.assert_close(h, g, rtol=1e-4, atol=1e-6, msg=name)


def test_the_padded_vocabulary_is_invisible_to_state_dicts():
    torch.manual_seed(0)
    fast = BertForPreTraining(config(), fusions=("pad_vocab",))
    assert fast.vocab_rows == 30528 and fast.vocab_rows % 64 == 0
    sd = save_hf_state_dict(fast)
    assert sd["bert.embeddings.word_embeddings.weight"].shape[0] == 30522
    assert sd["cls.predictions.bias"].shape == (30522,)
    assert float(fast.cls.predictions.bias[-1]) == PAD_LOGIT
    again = BertForPreTraining(config(), fusions=("pad_vocab",))
    again.load_state_dict(fast.state_dict())  # a checkpoint's round trip
    for (n, p), q in zip(fast.named_parameters(), again.parameters()):
        assert torch.equal(p, q), n
    with pytest.raises(ValueError, match="unknown fusion"):
        BertForPreTraining(config(), fusions=("flash_mlp",))


def test_no_recompile_over_batches_of_changing_shapes(small_dataset):
    torch.manual_seed(0)
    model = BertForPreTraining(config(), attention="unpadded",
                               fusions=("bias_gelu", "dropout_add_norm"))
    spec = BalanceSpec(mode="pack", pack_length=128)
    with TrainLoader(small_dataset, 0, 1, 8, 3, verify=False, balance=spec) as loader:
        batches = [next(loader) for _ in range(12)]
    assert len({b.num_real_tokens for b in batches}) > 5  # the token dimension changes
    model.train()

    def step(b):
        out = model(b.input_ids, b.token_type_ids, b.attention_mask,
                    masked_lm_labels=b.masked_lm_labels,
                    next_sentence_labels=b.next_sentence_labels, layout=b.layout)
        out.loss.backward()
    step(batches[0])  # compiles each fusion once (the token dimension dynamic from the start)
    graphs = frames_compiled()
    for b in batches[1:]:
        step(b)
    assert frames_compiled() == graphs
    assert not fused.bias_gelu.failed and not fused.bias_dropout_add_layer_norm.failed
