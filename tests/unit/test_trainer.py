"""Trainer pieces in one process: eval accuracy as sum correct over sum masked in a world of one,
fp16 loss scaling and skipped steps, gradient accumulation, the clip coefficient folded into
the step, and the MLPerf eval cadence formula - each over a step or two of the tiny model of
tests/support/tiny.py. The eval cadence in a whole fit:
tests/integration/test_trainer_integration.py; the eval counts on 2 and 4 real ranks:
tests/ranks/test_trainer_ranks.py."""
from __future__ import annotations

import math

import pytest
import torch

from runtime.config import load_config
from runtime.optim.grad_scale import DynamicLossScale
from runtime.train.trainer import Trainer
from tests.support.data import THE, assert_eval_counts
from tests.support.tiny import tiny_config


def test_eval_accuracy_is_sum_correct_over_sum_masked_in_a_world_of_one(small_dataset, single_ctx,
                                                                       eval_truth):
    """tests/dist_scripts/eval_counts.py's work in this process: the truth on one rank."""
    trainer = Trainer(tiny_config(small_dataset, "data.eval_batch_size=7"), single_ctx)
    trainer.setup()
    with torch.no_grad():  # an untrained model predicts nothing right; make it say "the"
        trainer.model.cls.predictions.bias[THE] += 20.0
    result = trainer.evaluate()
    got = {"correct": result.correct, "count": result.count, "accuracy": result.accuracy,
           "eval_samples": trainer.state.eval_samples}
    trainer.close()
    assert_eval_counts(got, eval_truth, 1)


def test_dynamic_loss_scale_halves_on_overflow_and_grows_after_good_steps():
    s = DynamicLossScale(2.0 ** 16, growth_interval=3)
    s.update(finite=False)
    assert s.scale == 2.0 ** 15 and s.skipped == 1
    for _ in range(3):
        s.update(finite=True)
    assert s.scale == 2.0 ** 16
    off = DynamicLossScale(2.0 ** 16, enabled=False)
    off.update(finite=False)
    assert off.scale == 1.0 and off.skipped == 0


def _fixed_batches(trainer, n):
    it = iter(trainer.train_loader)
    return [next(it) for _ in range(n)]


def test_non_finite_gradient_skips_the_step_and_counts_it(small_dataset, single_ctx):
    trainer = Trainer(tiny_config(small_dataset), single_ctx)
    trainer.setup()
    trainer.loss_scale = DynamicLossScale(1024.0)  # as with precision=fp16
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    poison = trainer.model.bert.encoder.layer[0].output.dense.weight
    handle = poison.register_hook(lambda g: torch.full_like(g, float("inf")))
    m = trainer.train_step(iter(_fixed_batches(trainer, 1)))
    handle.remove()
    assert m.skipped and not math.isfinite(m.grad_norm)
    assert trainer.loss_scale.skipped == 1 and trainer.loss_scale.scale == 512.0
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p, before[n]), n
    m2 = trainer.train_step(iter(_fixed_batches(trainer, 1)))
    assert not m2.skipped and math.isfinite(m2.grad_norm)
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])]
    assert changed
    trainer.close()


def test_loss_scale_is_unscaled_inside_the_step(small_dataset, single_ctx):
    """Same batch, scale 1 vs 1024: same gradient norm, same update."""
    results = []
    for scale in (1.0, 1024.0):
        torch.manual_seed(0)
        trainer = Trainer(tiny_config(small_dataset), single_ctx)
        trainer.setup()
        trainer.loss_scale = DynamicLossScale(scale, enabled=scale != 1.0)
        batch = _fixed_batches(trainer, 1)
        m = trainer.train_step(iter(batch))
        results.append((m.grad_norm, trainer.model.cls.seq_relationship.weight.detach().clone()))
        trainer.close()
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-7)


def test_gradient_accumulation_averages_micro_batch_gradients(small_dataset, single_ctx):
    trainer = Trainer(tiny_config(small_dataset, "train.gradient_accumulation_steps=2",
                                  "train.clip_mode=none"), single_ctx)
    trainer.setup()
    assert trainer.local_batch == 8
    batches = _fixed_batches(trainer, 2)
    # Direct computation: mean of the two micro-batches' gradients.
    expected = None
    for b in batches:
        trainer.model.zero_grad(set_to_none=True)
        out = trainer.model(b.input_ids, b.token_type_ids, b.attention_mask,
                            masked_lm_labels=b.masked_lm_labels,
                            next_sentence_labels=b.next_sentence_labels)
        out.loss.backward()
        g = [p.grad.clone() / 2 for p in trainer.model.parameters()]
        expected = g if expected is None else [a + c for a, c in zip(expected, g)]
    trainer.model.zero_grad(set_to_none=True)
    captured = {}
    real_step = trainer.optimizer.step

    def capture(grad_scale=1.0, **kw):
        captured["grads"] = [p.grad.clone() for p in trainer.model.parameters()]
        captured["grad_scale"] = grad_scale
        return real_step(grad_scale=grad_scale, **kw)

    trainer.optimizer.step = capture
    m = trainer.train_step(iter(batches))
    for got, want in zip(captured["grads"], expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert captured["grad_scale"] == 1.0 and m.clip_coef == 1.0
    assert m.real_tokens == sum(b.num_real_tokens for b in batches)
    trainer.close()


def test_clip_coefficient_is_folded_into_the_step(small_dataset, single_ctx):
    trainer = Trainer(tiny_config(small_dataset, "train.max_grad_norm=0.01"), single_ctx)
    trainer.setup()
    seen = {}
    real_step = trainer.optimizer.step
    trainer.optimizer.step = lambda grad_scale=1.0, **kw: (seen.setdefault("s", grad_scale),
                                                           real_step(grad_scale=grad_scale, **kw))
    m = trainer.train_step(iter(_fixed_batches(trainer, 1)))
    assert m.grad_norm > 0.01
    assert seen["s"] == pytest.approx(0.01 / (m.grad_norm + 1e-6))
    assert m.clip_coef == pytest.approx(seen["s"])
    trainer.close()


def test_mlperf_eval_cadence_formula():
    cfg = load_config(None, ["train.global_batch_size=448"])
    assert cfg.train.eval_cadence() == (150_000, 150_000)
    cfg = load_config(None, ["train.global_batch_size=3072", "train.eval_iter_start_samples=0"])
    assert cfg.train.eval_cadence() == (0, 175_000)
