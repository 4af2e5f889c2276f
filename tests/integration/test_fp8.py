"""model.fp8 in a model and a trainer, on the CPU in torchao's emulate mode (the FP8 casts and
scales a GPU makes, the GEMMs of the dequantised values in fp32): one encoder layer's forward
and backward against its bf16 result within FP8's error - and measurably off it, so FP8 is
what ran -; a short run that says once that it emulates and logs what it converted; an
interrupted-and-resumed run equal to the uninterrupted one bit for bit; and the state dict and
Hugging Face export of an FP8 model identical to the same model's without FP8. The config's
refusals and the conversion's choices: tests/unit/test_fp8_config.py; the captured step's safety on
the simulated device: tests/integration/test_graphs_integration.py."""
from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import save_file

from runtime.choices import FP8_ROLES
from runtime.model import fp8
from runtime.model.bert import BertLayer
from runtime.model.config import BertConfig
from runtime.model.hf import save_hf_state_dict, read_state_dict
from runtime.train.trainer import build_model
from tests.support.fit import fit
from tests.support.tiny import tiny_config

LAYER = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                   intermediate_size=128, hidden_dropout_prob=0.0,
                   attention_probs_dropout_prob=0.0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_one_layers_fp8_forward_and_backward_are_its_bf16_ones_within_fp8s_error(recipe):
    """e4m3 keeps 3 mantissa bits (a rounding error up to 2^-4 of a value), e5m2 - the
    tensorwise recipe's gradients - 2 (2^-3): a GEMM's output off by a few percent of its norm.
    bf16's own error (2^-8) is ten times smaller, so the FP8 layer is measurably off the bf16
    one: at least 0.5 % - and it is FP8, not a silent bf16 GEMM, that ran."""
    torch.manual_seed(0)
    ref = BertLayer(LAYER).to(torch.bfloat16)
    layer = copy.deepcopy(ref)
    assert fp8.convert(layer, recipe, FP8_ROLES, emulate=True)  # (a layer's own names)
    assert len(fp8.converted(layer)) == 6
    x = torch.randn(4, 32, 64, dtype=torch.bfloat16)
    mask = torch.ones(4, 1, 1, 32, dtype=torch.bool)
    grad = torch.randn(4, 32, 64, dtype=torch.bfloat16)
    outs = []
    for net in (ref, layer):
        xi = x.clone().requires_grad_(True)
        y = net(xi, mask)
        y.backward(grad)
        outs.append((y, xi.grad, {n: p.grad for n, p in net.named_parameters()}))
    (y0, gx0, gw0), (y1, gx1, gw1) = outs
    errors = {"output": _rel(y1, y0), "grad_input": _rel(gx1, gx0)}
    errors.update({n: _rel(gw1[n], g) for n, g in gw0.items() if g.dim() == 2})  # the weights
    assert all(0.005 < e < 0.12 for e in errors.values()), errors
    # the LayerNorm after the GEMMs: its output within FP8's error of the bf16 one
    assert errors["output"] < 0.05, errors


def _tiny(data, out, *extra):
    """The tiny model in FP8 around bf16 parameters with fp32 masters (the GPU configs'
    precision; its resume is exact since the optimizer keeps the saved state's dtype),
    dropout on, 6 steps."""
    return tiny_config(
        data, f'train.output_dir="{out}"', "model.fp8=tensorwise",
        "train.precision=bf16_master", "optim.backend=auto",
        "model.hidden_dropout_prob=0.1", "train.max_steps=6",
        "train.eval_iter_start_samples=48", "train.eval_iter_samples=48",
        "train.target_mlm_accuracy=0.99", "train.log_every_steps=2", "data.eval_batch_size=32",
        "train.bucket_cap_mb=0.05", "schedule.warmup_steps=2", "schedule.total_steps=20",
        "optim.lr=0.01", *extra)


@pytest.fixture(scope="module")
def uninterrupted(small_dataset, single_ctx, tmp_path_factory):
    return fit(_tiny(small_dataset, tmp_path_factory.mktemp("fp8_full")), single_ctx)


def test_a_short_emulated_run_trains_and_says_so_once(uninterrupted):
    state, rec, trainer = uninterrupted
    assert state.step == 6 and len(rec.steps) == 6
    losses = [loss for _, loss, _, _ in rec.steps]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    said = [m for m in rec.said if "model.fp8" in m]
    assert len(said) == 1 and "emulated" in said[0] and "6 encoder Linears" in said[0], rec.said
    f8 = state.derived["fp8"]
    assert f8["recipe"] == "tensorwise" and f8["emulated"] and f8["linears"] == 6
    from submission.mllog_callback import step_choices
    assert step_choices(state) == {"precision": "bf16_master", "fp8": "tensorwise",
                                   "params_dtype": "bf16", "autocast_dtype": None,
                                   "gemm_dtype": "bf16", "allreduce_dtype": "bf16",
                                   "master_weights": True, "loss_scale": False,
                                   "fp8_layers": list(FP8_ROLES), "fp8_emulated": True}
    # the parameters stayed the precision's, FP8 lived only in the GEMMs
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}


def test_an_interrupted_and_resumed_fp8_run_equals_the_uninterrupted_one(
        small_dataset, single_ctx, tmp_path, uninterrupted):
    """Dynamic scaling keeps no state: the checkpoint is the one a run without FP8 writes, and
    the resumed steps are the uninterrupted steps bit for bit (dropout on)."""
    _, full, _ = uninterrupted
    cfg = _tiny(small_dataset, tmp_path / "b", "train.checkpoint_every_samples=32",
                "train.checkpoint_keep=1")
    first_state, first, _ = fit(cfg, single_ctx, stop_at=2)
    assert first_state.status == "interrupted" and 0 < first_state.step < 6
    second_state, second, t2 = fit(cfg, single_ctx)
    assert t2.resume_from is not None and t2.resume_from.step == first_state.step
    assert first.steps + second.steps == full.steps
    assert first.evals + second.evals == full.evals


@pytest.mark.parametrize("fusions", ["[]", '["qkv"]'])
def test_the_state_dict_and_the_hf_export_are_the_models_without_fp8(small_dataset, tmp_path,
                                                                     fusions):
    """The same seed, with and without model.fp8: the same keys, dtypes and values in the
    state dict and in the exported Hugging Face file (weights in their normal precision)."""
    files, states = [], []
    for recipe in ("none", "rowwise"):
        torch.manual_seed(0)
        model = build_model(tiny_config(small_dataset, f"model.fp8={recipe}",
                                        f"model.fusions={fusions}"))
        assert bool(fp8.converted(model)) == (recipe != "none")
        states.append(model.state_dict())
        path = tmp_path / recipe / "model.safetensors"
        path.parent.mkdir()
        save_file(save_hf_state_dict(model), str(path), metadata={"format": "pt"})
        files.append(read_state_dict(path))
    for a, b in (states, files):
        assert list(a) == list(b)
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


MODEL = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                   intermediate_size=128, max_position_embeddings=256,
                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _fp8_step(model, multiple: int) -> tuple:
    """One forward and backward of ``model`` (FP8, emulation off) with its token rows a
    multiple of ``multiple``, on 4 rows of 250 real tokens: T = 1,000 tokens (unpadded),
    b·L = 1,000 (padded) - not multiples of 16. Returns the loss and the gradients."""
    model.bert.token_multiple = multiple
    model.zero_grad(set_to_none=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 128, (4, 250), generator=g)
    labels = torch.full((4, 250), -100)
    labels[:, 3:250:7] = ids[:, 3:250:7]
    out = model(ids, torch.zeros_like(ids), torch.ones_like(ids), masked_lm_labels=labels,
                next_sentence_labels=torch.tensor([0, 1, 0, 1]))
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("attention", ["unpadded", "padded"])
def test_fp8_gemms_keep_cudas_shape_rules_at_any_token_count(attention):
    """On CUDA ``torch._scaled_mm`` refuses an inner dimension that is not a multiple of 16,
    and the weight gradient's GEMM has the token count there: on the unpadded path a multiple
    of 16 in one step of 16, so real FP8 failed at its first backward. Here the CPU's
    ``_scaled_mm`` runs with CUDA's checks first (bench.cuda_dispatch), emulation off: the
    model's token rows padded to 16 pass them, with the loss and gradients of the count
    unpadded; without the padding CUDA's check refuses the step."""
    from bench.cuda_dispatch import scaled_mm_as_on_cuda
    from runtime.model.bert import BertForPreTraining
    torch.manual_seed(0)
    model = BertForPreTraining(MODEL, attention=attention).to(torch.bfloat16)
    fp8.convert(model, "tensorwise", FP8_ROLES, emulate=False)
    assert model.bert.token_multiple == fp8.MULTIPLE
    want_loss, want = _fp8_step(model, 1)  # the CPU's own kernel takes T = 1,000
    with scaled_mm_as_on_cuda():
        loss, grads = _fp8_step(model, fp8.MULTIPLE)
        with pytest.raises(RuntimeError, match="divisible by 16"):
            _fp8_step(model, 1)
    torch.testing.assert_close(loss, want_loss, rtol=1e-3, atol=1e-3)
    for name, g in want.items():
        torch.testing.assert_close(grads[name], g, rtol=2e-2, atol=2e-3, msg=name)
