"""Gradient buckets (runtime.grad_sync) and the step timeline (runtime.observe.timeline) in one
process (a world of one): plans and their errors, gradients as views of the bucket buffer, the
first-step re-cut, the clip modes' arithmetic, the tied embedding's sync decision. Through real
ranks: tests/ranks/test_buckets_ranks.py; the timeline drawn from a run:
tests/integration/test_buckets_integration.py."""
from __future__ import annotations

import contextlib
import math
from collections import Counter

import pytest
import torch
from torch import nn

from bench.kernel_counter import counting
from kernels.optim_reference import global_grad_norm
from runtime.grad_sync import (BucketPlan, GradientBuckets, GradLayout, Piece, PlanError,
                               alone_bucket, resolve_tied_sync)
from runtime.grad_sync.plan import production_order
from runtime.config import ConfigError, load_config
from runtime.observe.timeline import StepTimeline, union_length

SIZES = {"a": 10, "big": 25, "b": 3}


# ---------------------------------------------------------------------------------------------
# plans


def test_cap_plan_cuts_large_parameters_into_consecutive_pieces():
    plan = BucketPlan.from_cap(SIZES.items(), cap_elements=8)
    assert plan.buckets == (
        (Piece("a", 0, 8),), (Piece("a", 8, 10),),
        (Piece("big", 0, 8),), (Piece("big", 8, 16),), (Piece("big", 16, 24),),
        (Piece("big", 24, 25), Piece("b", 0, 3)))
    plan.validate(SIZES)
    assert plan.split_parameters() == ["a", "big"] and plan.order() == ["a", "big", "b"]
    whole = BucketPlan.from_cap(SIZES.items(), cap_elements=100)
    assert whole.buckets == ((Piece("a", 0, 10), Piece("big", 0, 25), Piece("b", 0, 3)),)


def test_plan_file_round_trip_and_digest():
    data = {"format": "presto-bucket-plan/1", "buckets": [["b", "big[0:7]"], ["big[7:]", "a"]]}
    plan = BucketPlan.from_json(data, SIZES)
    assert plan.buckets == ((Piece("b", 0, 3), Piece("big", 0, 7)),
                            (Piece("big", 7, 25), Piece("a", 0, 10)))
    assert plan.to_json(SIZES) == {"format": "presto-bucket-plan/1",
                                   "buckets": [["b", "big[0:7]"], ["big[7:25]", "a"]]}
    moved = BucketPlan.from_json({"buckets": [["b", "big[0:8]"], ["big[8:]", "a"]]}, SIZES)
    assert plan.digest() == BucketPlan.from_json(plan.to_json(SIZES), SIZES).digest()
    assert plan.digest() != moved.digest()


@pytest.mark.parametrize("buckets,message", [
    ([["a", "big"]], r"in no bucket: b\b"),
    ([["a", "big", "b"], ["a"]], r"parameter a: elements \[0:10\] are in two buckets \(0 and 1\)"),
    ([["a", "big[0:10]", "b"], ["big[5:]"]], r"parameter big: elements \[5:10\] are in two"),
    ([["a", "big[0:10]", "b"], ["big[12:]"]], r"parameter big: elements \[10:12\] are in no bucket"),
    ([["a", "big[0:20]", "b"]], r"parameter big: elements \[20:25\] are in no bucket"),
    ([["big[0:10]", "a"], ["big[10:]", "b"]], r"pieces of split parameter big \(buckets \[0, 1\]\)"
                                              r" must follow each other"),
    ([["big[10:]"], ["big[:10]", "a", "b"]], r"pieces of split parameter big"),
    ([["a", "bigg", "b"]], r"unknown parameter 'bigg'; did you mean big\?"),
    ([["a", "big[0:30]", "b"]], r"big\[0:30\] is not a non-empty range of its 25 elements"),
    ([["a", "big", "b"], []], r"bucket 1 is empty"),
    ([["a", "big", "b[x]"]], r"is not \"name\" or \"name\[start:stop\]\""),
])
def test_bad_plans_name_the_parameter(buckets, message):
    with pytest.raises(PlanError, match=message):
        BucketPlan.from_json({"buckets": buckets}, SIZES, source="plan.json")


def test_plan_file_errors(tmp_path):
    with pytest.raises(PlanError, match="train.bucket_plan: .* does not exist"):
        BucketPlan.read(tmp_path / "missing.json", SIZES)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(PlanError, match="not valid JSON"):
        BucketPlan.read(tmp_path / "bad.json", SIZES)
    with pytest.raises(PlanError, match="format"):
        BucketPlan.from_json({"format": "other/2", "buckets": [["a", "big", "b"]]}, SIZES)


def test_config_keys_are_validated():
    with pytest.raises(ConfigError, match="train.clip_mode=bucket_before .* train.grad_sync='buckets'"):
        load_config(None, ["train.clip_mode=bucket_before", "train.grad_sync=ddp"])
    with pytest.raises(ConfigError, match="global_after | local_before | bucket_before | none"):
        load_config(None, ["train.clip_mode=before"])
    with pytest.raises(ConfigError, match="train.bucket_cap_mb must be > 0"):
        load_config(None, ["train.bucket_cap_mb=0"])
    with pytest.raises(ConfigError, match="train.allreduce_dtype"):
        load_config(None, ["train.allreduce_dtype=int8"])
    cfg = load_config(None, ["train.clip_mode=bucket_before", "train.bucket_cap_mb=4"])
    assert cfg.train.grad_sync == "buckets"


# ---------------------------------------------------------------------------------------------
# buckets in one process


class LateFirst(nn.Module):
    """Registered late-then-early but used early-then-late: the gradient of ``late`` arrives
    first, so reverse registration order (``early`` first) is wrong and must be re-measured."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.late = nn.Linear(6, 3)
        self.early = nn.Linear(4, 6)

    def forward(self, x):
        return self.late(torch.tanh(self.early(x)))


def toy_buckets(model, clip_mode="none", cap=9, tau=1.0, **kw):
    named = list(model.named_parameters())
    plan = BucketPlan.from_cap([(n, p.numel()) for n, p in reversed(named)], cap)
    return GradientBuckets(model, plan, world_size=1, clip_mode=clip_mode, max_grad_norm=tau,
                           cap_elements=cap, **kw)


def in_layout(grads: dict, layout: GradLayout) -> torch.Tensor:
    """The flat buffer ``layout`` implies for ``grads``: each at its offset, zeros between."""
    flat = torch.zeros(layout.total)
    for name, offset, numel in layout.segments():
        flat[offset:offset + numel] = grads[name].reshape(-1)
    return flat


def autograd_grads(model, x):
    clone = LateFirst()
    clone.load_state_dict(model.state_dict())
    clone(x).pow(2).sum().backward()
    return {n: p.grad for n, p in clone.named_parameters()}


def test_gradients_are_added_into_the_bucket_buffer_and_are_its_views_after_the_step():
    model = LateFirst()
    buckets = toy_buckets(model)
    x = torch.randn(5, 4)
    want = autograd_grads(model, x)
    buckets.begin_step()
    model(x).pow(2).sum().backward()
    buckets.finish()
    for name, p in model.named_parameters():
        assert p.grad.untyped_storage().data_ptr() == buckets.flat.untyped_storage().data_ptr()
        torch.testing.assert_close(p.grad, want[name])
    flat = in_layout(want, buckets.layout)  # the gradients in plan order, rows of 1024
    torch.testing.assert_close(buckets.flat, flat)
    for name, offset, numel in buckets.layout.segments():
        assert offset % 1024 == 0
        assert buckets.params[name].grad.data_ptr() == buckets.flat[offset:offset + numel].data_ptr()


@pytest.mark.parametrize("micro_steps", [1, 3])
def test_each_bucket_takes_its_gradients_in_one_add_with_the_bits_of_accumulating(micro_steps):
    """AccumulateGrad keeps each gradient where the backward made it (the .grad are unset in a
    step) and each bucket takes its own in one multi-tensor op per micro-step: no add_ per
    parameter (on a GPU ~12 kernels a BERT layer) - a copy the first time in a step, an add
    after. No memset of the buffer between steps either (the copy overwrites each bucket,
    its padding zeroed in the same launch). The buffer holds the very bits of adding each
    micro-step's gradient into zeros in order (torch.equal: up to the sign of a zero), as
    autograd accumulating into the views did; split parameters (cap 9 cuts ``late.weight``
    and ``early.weight``) included - in the step after another, whose values it overwrites."""
    model = LateFirst()
    buckets = toy_buckets(model, cap=9)
    assert buckets.plan.split_parameters() and buckets.num_buckets >= 4
    for step in range(2):
        xs = [torch.randn(5, 4) for _ in range(micro_steps)]
        want = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        for x in xs:
            for n, g in autograd_grads(model, x).items():
                want[n] += g
        with counting() as count:  # the ops below autograd (bench.kernel_counter)
            buckets.begin_step()
            for i, x in enumerate(xs):
                with buckets.no_sync() if i < micro_steps - 1 else contextlib.nullcontext():
                    model(x).pow(2).sum().backward()
            buckets.finish()
            k, flat, layout = buckets.num_buckets, buckets.flat.clone(), buckets.layout
            buckets.zero_grad()  # (after the first step: the re-cut, a new buffer)
        ops = Counter(r[2] for r in count.records)
        assert ops["add_"] == 0, ops
        assert ops["_foreach_copy_"] == k, ops
        assert ops["_foreach_add_"] == k * (micro_steps - 1), ops
        assert ops["zero_"] == ops["fill_"] == 0, ops
        assert torch.equal(flat, in_layout(want, layout)), step
        assert buckets._views_attached()


def test_a_step_overwrites_the_last_ones_values_padding_included():
    """What a step leaves in the buffer - even non-finite values in the rows' padding, as a
    bucket scaled by a NaN clip coefficient leaves them - is gone after the next step's
    copies (the padding is in the per-row norms the clip and the optimizer read)."""
    model = LateFirst()
    buckets = toy_buckets(model, cap=9)
    x = torch.randn(5, 4)
    buckets.begin_step()
    model(x).pow(2).sum().backward()
    buckets.finish()
    buckets.zero_grad()  # the first step's re-cut: a new buffer
    buckets.flat.fill_(float("nan"))
    buckets.begin_step()
    model(x).pow(2).sum().backward()
    buckets.finish()
    assert torch.equal(buckets.flat, in_layout(autograd_grads(model, x), buckets.layout))


def test_a_bucket_short_of_a_gradient_is_zeroed_not_left_with_the_last_step():
    """A parameter without a gradient in a step reads 0, not the last step's gradient: its
    bucket is zeroed before the others' gradients are added (one with no gradient at all:
    zeroed at finish)."""
    torch.manual_seed(0)
    model = nn.Module()
    model.a, model.b, model.c = (nn.Parameter(torch.randn(4)) for _ in range(3))
    plan = BucketPlan.from_json({"buckets": [["a", "b"], ["c"]]}, {"a": 4, "b": 4, "c": 4})
    buckets = GradientBuckets(model, plan, world_size=1)
    for step, used in enumerate([("a", "b", "c"), ("a",), ("b", "c")]):
        buckets.begin_step()
        sum(getattr(model, n).pow(2).sum() for n in used).backward()
        buckets.finish()
        for n in "abc":
            want = 2 * getattr(model, n).detach() if n in used else torch.zeros(4)
            assert torch.equal(getattr(model, n).grad, want), (step, n)
        buckets.zero_grad()


class Replayed(torch.autograd.Function):
    """x @ w.T whose backward hands out w's gradient in one static tensor it rewrites at
    every call - as a replayed CUDA graph's backward does (make_graphed_callables returns
    its static gradient outputs, detached)."""

    static = None

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        if Replayed.static is None:
            Replayed.static = torch.empty_like(w)
        torch.mm(grad.t(), x, out=Replayed.static)
        return grad @ w, Replayed.static.detach()


def test_gradients_in_memory_the_backward_rewrites_are_in_the_buffer_before_it_does():
    """A stolen gradient that aliases a graph's static output must be added into the bucket
    before the next micro-step's replay rewrites it (the encoder graphs' hazard: with the
    .grad unset, AccumulateGrad keeps that alias; accumulating into it on the next micro-step
    would double the new gradient and lose the old)."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(3, 4))
    model = nn.Module()
    model.w = w
    buckets = GradientBuckets(model, BucketPlan.from_cap([("w", 12)], 100), world_size=1)
    xs = [torch.randn(5, 4) for _ in range(3)]
    want = sum(2 * (x @ w.detach().t()).t() @ x for x in xs)
    buckets.begin_step()
    for i, x in enumerate(xs):
        with buckets.no_sync() if i < 2 else contextlib.nullcontext():
            Replayed.apply(x, w).pow(2).sum().backward()
    buckets.finish()
    torch.testing.assert_close(w.grad, want)
    assert w.grad.data_ptr() == buckets.flat.data_ptr()


def test_a_parameter_without_a_gradient_in_a_micro_step_leaves_its_bucket_short_not_stuck():
    """The bucket of a parameter that one micro-step does not use still takes the gradients
    that did arrive, at the end of that micro-step; the next micro-step counts afresh."""
    model = LateFirst()
    buckets = toy_buckets(model, cap=100)  # one bucket: every parameter in it
    x = torch.randn(5, 4)
    buckets.begin_step()
    with buckets.no_sync():
        model.late(x[:, :3].repeat(1, 2)).pow(2).sum().backward()  # early's unused
    model(x).pow(2).sum().backward()
    buckets.finish()
    late_only = LateFirst()
    late_only.load_state_dict(model.state_dict())
    late_only.late(x[:, :3].repeat(1, 2)).pow(2).sum().backward()
    full = autograd_grads(model, x)
    torch.testing.assert_close(model.late.weight.grad, late_only.late.weight.grad
                               + full["late.weight"])
    torch.testing.assert_close(model.early.weight.grad, full["early.weight"])


def test_a_split_parameter_unused_in_one_micro_step_gets_all_of_its_next_gradient():
    """``x`` is cut over two buckets and unused in the first micro-step, while ``a`` shares its
    first bucket: that bucket is added short at the micro-step's end, the second not at all -
    the next micro-step's gradient of ``x`` must still reach both."""
    torch.manual_seed(0)
    model = nn.Module()
    model.a, model.x = nn.Parameter(torch.randn(4)), nn.Parameter(torch.randn(10))
    plan = BucketPlan.from_json({"buckets": [["a", "x[0:5]"], ["x[5:]"]]},
                                {"a": 4, "x": 10})
    buckets = GradientBuckets(model, plan, world_size=1)
    buckets.begin_step()
    with buckets.no_sync():
        model.a.pow(2).sum().backward()
    (model.a.pow(2).sum() + (3 * model.x).sum()).backward()
    buckets.finish()
    torch.testing.assert_close(model.a.grad, 4 * model.a.detach())
    torch.testing.assert_close(model.x.grad, torch.full((10,), 3.0))


def test_first_step_recuts_the_plan_in_measured_order():
    model = LateFirst()
    buckets = toy_buckets(model)
    assert buckets.plan.order()[0].startswith("early")  # reverse registration: a wrong guess
    version = buckets.layout_version
    x = torch.randn(5, 4)
    buckets.begin_step()
    model(x).pow(2).sum().backward()
    buckets.finish()
    buckets.zero_grad()
    assert buckets.measured_order[:2] == ["late.bias", "late.weight"]
    # re-cut by ready time (on one rank: the arrival order), not by registration
    times = [buckets.measured_ready_s[n] for n in buckets.measured_order]
    assert times == sorted(times) and set(times) != {0.0}
    assert buckets.plan.order() == production_order(buckets.measured_ready_s,
                                                    buckets.measured_order)
    assert buckets.plan.order() == buckets.measured_order
    assert buckets.layout_version == version + 1
    buckets.begin_step()  # the next step accumulates into the new buffer
    model(x).pow(2).sum().backward()
    buckets.finish()
    want = autograd_grads(model, x)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name])
        assert p.grad.untyped_storage().data_ptr() == buckets.flat.untyped_storage().data_ptr()


def test_bucket_before_clips_each_bucket_to_tau_over_sqrt_k():
    model = LateFirst()
    buckets = toy_buckets(model, clip_mode="bucket_before", cap=9, tau=0.3)
    x = torch.randn(5, 4) * 3
    want = autograd_grads(model, x)
    buckets.begin_step()
    model(x).pow(2).sum().backward()
    report = buckets.finish()
    k = buckets.num_buckets
    assert k >= 3 and len(report.clip_coefs) == k
    assert min(report.clip_coefs) < 1.0
    padded = in_layout(want, buckets.layout)
    for b, (lo, hi) in enumerate(buckets.bounds):
        local = padded[lo:hi]  # bucket b's pieces in plan order (and the rows' zero padding)
        coef = min(1.0, (0.3 / math.sqrt(k)) / (float(local.norm()) + 1e-6))
        assert report.clip_coefs[b] == pytest.approx(coef, rel=1e-5)
        torch.testing.assert_close(buckets.flat[lo:hi], coef * local)
        assert float(buckets.flat[lo:hi].norm()) <= 0.3 / math.sqrt(k) * (1 + 1e-5)
    assert report.local_norm == pytest.approx(
        math.sqrt(sum(float(g.pow(2).sum()) for g in want.values())), rel=1e-5)


def test_no_sync_accumulates_without_launching_and_a_second_synced_backward_is_an_error():
    model = LateFirst()
    timeline = StepTimeline()
    buckets = toy_buckets(model, timeline=timeline)
    x = torch.randn(5, 4)
    buckets.begin_step()
    with buckets.no_sync():
        model(x).pow(2).sum().backward()
    assert all(t is None for t in timeline.launch)
    model(x).pow(2).sum().backward()
    assert all(t is not None for t in timeline.launch)
    buckets.finish()
    torch.testing.assert_close(model.late.bias.grad, 2 * autograd_grads(model, x)["late.bias"])
    buckets.zero_grad()
    buckets.begin_step()
    model(x).pow(2).sum().backward()
    with pytest.raises(RuntimeError, match="produced twice .* no_sync"):
        model(x).pow(2).sum().backward()


def test_grads_set_to_none_are_re_pointed_into_the_buffer():
    model = LateFirst()
    buckets = toy_buckets(model)
    model.zero_grad(set_to_none=True)
    buckets.begin_step()
    model(torch.randn(5, 4)).sum().backward()
    buckets.finish()
    assert all(p.grad.untyped_storage().data_ptr() == buckets.flat.untyped_storage().data_ptr()
               for p in model.parameters())


def test_the_gradient_norm_is_accurate_on_millions_of_elements():
    torch.manual_seed(0)
    x = torch.randn(4_000_000) * 1e-3
    assert float(global_grad_norm([x])) == pytest.approx(float(x.double().norm()), rel=1e-6)


# ---------------------------------------------------------------------------------------------
# timeline


def test_union_length_counts_overlaps_once():
    assert union_length([]) == 0.0
    assert union_length([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert union_length([(0, 4), (1, 2)]) == pytest.approx(4.0)


def test_timeline_summary_derives_exposed_communication():
    clock = iter([0.0, 0.0, 1.0, 1.0, 3.0]).__next__
    tl = StepTimeline(clock=clock)
    tl.start_step(0.0)
    with tl.span("forward"):      # 0 → 1
        pass
    with tl.span("backward"):     # 1 → 3
        pass
    tl.start_buckets([100, 200])
    tl.bucket_ready(0, 1.5), tl.bucket_launched(0, 1.5), tl.bucket_done(0, 2.5)
    tl.bucket_ready(1, 3.0), tl.bucket_launched(1, 3.0), tl.bucket_done(1, 3.5)
    s = tl.summary(end=4.0)
    assert s["comm_s"] == pytest.approx(1.5)
    assert s["exposed_comm_s"] == pytest.approx(0.5)
    assert s["overlap_frac"] == pytest.approx(1 - 0.5 / 1.5)
    assert s["timeline"]["buckets"]["launch"] == [1.5, 3.0] and s["timeline"]["step_s"] == 4.0


# ---------------------------------------------------------------------------------------------
# the tied embedding's sync


def test_split_config_is_refused_with_the_before_modes():
    for mode in ("local_before", "bucket_before"):
        with pytest.raises(ConfigError, match="tied_embedding_sync='split' needs"):
            load_config(None, [f"train.clip_mode={mode}", "train.tied_embedding_sync=split"])
    with pytest.raises(ConfigError, match="auto | dense | split"):
        load_config(None, ["train.tied_embedding_sync=sparse"])


def tied_sync_mode(asked: str, clip_mode: str, world_size: int) -> str:
    """The tied sync resolve_tied_sync picks for a model with a tied embedding of 30,522
    rows, on CPU (where the split always pays)."""
    return resolve_tied_sync(asked, clip_mode, world_size, rows=30522)[0]


def test_auto_tied_sync_is_split_only_where_it_applies():
    assert tied_sync_mode("auto", "global_after", 2) == "split"
    assert tied_sync_mode("auto", "none", 8) == "split"
    assert tied_sync_mode("auto", "bucket_before", 2) == "dense"  # needs whole local buckets
    assert tied_sync_mode("auto", "local_before", 2) == "dense"
    assert tied_sync_mode("auto", "global_after", 1) == "dense"   # nothing to reduce
    assert tied_sync_mode("dense", "global_after", 2) == "dense"
    assert load_config(None, []).train.tied_embedding_sync == "auto"


def test_a_plan_that_cuts_the_tied_embedding_makes_auto_dense_in_the_one_decision():
    """The plan cut is resolve_tied_sync's too (the sync and the tuner ask it with the plan):
    'auto' turns dense on a plan that cuts the embedding, 'split' stays asked (the engine then
    refuses the plan, naming the embedding)."""
    order = [("a", 10), ("emb", 100), ("b", 5)]
    whole, cut = BucketPlan.from_cap(order, 8, alone="emb"), BucketPlan.from_cap(order, 8)
    kw = dict(rows=30522, tied=("emb", 100))
    assert resolve_tied_sync("auto", "global_after", 2, plan=whole, **kw)[0] == "split"
    assert resolve_tied_sync("auto", "global_after", 2, plan=cut, **kw) == \
        ("dense", "auto: dense - the bucket plan cuts the tied embedding")
    assert resolve_tied_sync("split", "global_after", 2, plan=cut, **kw)[0] == "split"
    assert resolve_tied_sync("auto", "global_after", 2, pays=False, **kw)[0] == "dense"


def test_split_plan_keeps_the_tied_parameter_whole_and_alone():
    order = [("a", 10), ("emb", 100), ("b", 5), ("c", 5)]
    plan = BucketPlan.from_cap(order, 8, alone="emb")
    assert [[(p.name, p.start, p.stop) for p in b] for b in plan.buckets] == [
        [("a", 0, 8)], [("a", 8, 10)], [("emb", 0, 100)], [("b", 0, 5)], [("c", 0, 5)]]
    assert alone_bucket(plan, "emb", 100) == 2
    with pytest.raises(PlanError, match="whole and alone"):
        alone_bucket(BucketPlan.from_cap(order, 8), "emb", 100)
