"""Optimizer backends (foreach, fused, apex) against the plain-torch reference: 100 steps on
random problems, the flat-buffer binding (views, zero_grad, state_dict, skipped tensors),
the compile fallback, backend dispatch, and the fused step's memory. CUDA and apex tests
skip without a GPU / without NVIDIA apex."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from kernels import compiled_pass, optim_apex, optim_flat
from kernels.optim_flat import FlatLayout
from kernels.optim_reference import lamb_step
from runtime.optim import optimizers as optim
from runtime.optim.optimizers import build_optimizer
from tests.support.memory import MEMORY_SHAPES

CUDA = pytest.mark.cuda  # skipped without a GPU (conftest)

# name -> shape; init "zero" gives a zero-norm weight (trust ratio 1). "head.still.weight"
# never gets a gradient (with λ = 0 its update is 0: ratio 1 from a zero update norm).
SHAPES = {
    "emb.word_embeddings.weight": (700, 3),      # spans several 1024-element rows
    "enc.dense.weight": (37, 5),
    "enc.dense.bias": (37,),                     # excluded: no decay, no adaptation
    "enc.LayerNorm.weight": (5,),                # excluded
    "enc.zero.weight": (6, 4),                   # zero init
    "head.still.weight": (1024,),                # exactly one row, zero gradient
    "head.scalar": (),                           # 0-dim parameter
}
STEPS = 100


def _problem(seed: int, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    init = {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in SHAPES.items()}
    init["enc.zero.weight"].zero_()
    grads = []
    for _ in range(STEPS):
        g = {n: torch.randn(s, generator=gen, dtype=torch.float64) for n, s in SHAPES.items()}
        g["head.still.weight"].zero_()
        grads.append(g)
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return ({n: cast(t) for n, t in init.items()},
            [{n: cast(t) for n, t in g.items()} for g in grads])


def _named(init):
    return [(n, t.clone().requires_grad_()) for n, t in init.items()]


def _grad_scale(step: int, device):
    # float and 0-dim tensor scales both fold into the step (clip coef × unscale)
    return 0.37 if step % 2 else torch.tensor(0.81, device=device)


def _run(name, backend, init, grads, hparams, *, in_place_grads=False):
    named = _named(init)
    opt = build_optimizer(name, named, backend=backend, **hparams)
    device = next(iter(init.values())).device
    for step, g in enumerate(grads, start=1):
        optim.set_lr(opt, hparams["lr"] * (1.0 - step / (2 * STEPS)))  # a schedule
        for n, p in named:
            if in_place_grads and step % 3 and p.grad is not None:
                p.grad.copy_(g[n])  # the fused backend's own gradient view
            else:
                p.grad = g[n].clone()
        opt.step(grad_scale=_grad_scale(step, device))
    return named, opt


def _assert_rel(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str,
                scale: float | None = None):
    """max |actual − expected| ≤ tol · scale, scale = max|expected| unless given."""
    err = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item() if scale is None else scale
    assert err <= tol * scale or err == 0.0, f"{what}: max error {err:.3g}, scale {scale:.3g}"


def _max_abs(tensors) -> float:
    return max(t.double().abs().max().item() for t in tensors)


def _compare(name, backend, hparams, tol=1e-6, device="cpu", dtype=torch.float32,
             in_place_grads=False, got_extra=None):
    """Both runs agree within ``tol`` relative to the largest magnitude of each quantity
    (parameters, each state) across the model. Relative to each element would not do: a
    moment passing near zero (cancellation) keeps the absolute error of its history.
    ``got_extra``: hyperparameters of the compared run only (the reference takes none)."""
    init, grads = _problem(0, device, dtype)
    ref, ref_opt = _run(name, "reference", init, grads, hparams)
    got, got_opt = _run(name, backend, init, grads, {**hparams, **(got_extra or {})},
                        in_place_grads=in_place_grads)
    scale = _max_abs(q.detach() for _, q in ref)
    for (n, p), (_, q) in zip(got, ref):
        assert p.dtype == q.dtype
        _assert_rel(p.detach(), q.detach(), tol, f"{backend} {name} param {n}", scale)
    for key, value in ref_opt.state[ref[0][1]].items():
        if not isinstance(value, torch.Tensor):
            assert [got_opt.state[p][key] for _, p in got] == \
                [ref_opt.state[q][key] for _, q in ref], key
            continue
        scale = _max_abs(ref_opt.state[q][key] for _, q in ref)
        for (n, p), (_, q) in zip(got, ref):
            _assert_rel(got_opt.state[p][key], ref_opt.state[q][key], tol,
                        f"{backend} {name} {key} {n}", scale)
    # the problem moved the parameters: equality is not trivially "both did nothing"
    assert any(not torch.equal(p.detach(), init[n]) for n, p in ref)


LAMB = dict(lr=0.02, beta1=0.9, beta2=0.999, eps=1e-6)
ADAMW = dict(lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8)
LARS = dict(lr=0.1, momentum=0.9, trust_coefficient=0.01, eps=1e-9)


@pytest.mark.parametrize("backend", ["foreach", "fused"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_lamb_backend_equals_reference(backend, weight_decay, bias_correction):
    _compare("lamb", backend, dict(LAMB, weight_decay=weight_decay,
                                   bias_correction=bias_correction),
             in_place_grads=backend == "fused")


@pytest.mark.parametrize("backend", ["foreach", "fused"])
@pytest.mark.parametrize("extra", [dict(trust_clamp=1.5), dict(use_nvlamb=True)])
def test_lamb_variants_equal_reference(backend, extra):
    _compare("lamb", backend, dict(LAMB, weight_decay=0.01, **extra))


@pytest.mark.parametrize("extra", [dict(weight_decay=0.05), dict(use_nvlamb=True),
                                   dict(trust_clamp=1.5, bias_correction=False)])
def test_lamb_stored_update_with_fp32_gradients_equals_reference(extra):
    """optim.lamb_update 'stored' with fp32 gradients: u stored over the gradient exactly,
    pass 2 reading it - the reference's step to the LAMB test's tolerance, 100 steps."""
    _compare("lamb", "fused", dict(LAMB, **extra), got_extra=dict(lamb_update="stored"),
             in_place_grads=True)


def test_lamb_stored_update_in_bf16_applies_u_rounded_to_bf16():
    """bf16 parameters and gradients, fp32 masters, optim.lamb_update 'stored': each step
    equals the reference LAMB on the masters with ``update_dtype=bf16`` (the ratio of the
    unrounded u, the update applied rounded) - to a bf16 rounding of the step where the fused
    and the reference u fall on two sides of a bf16 boundary -, the model's copy is the
    masters rounded, and the gradient buffer holds the update after the step. The same steps
    without the rounding differ by more than the LAMB test's tolerance (1e-6 of the largest
    parameter): this update is not the exact one (docs/benchmarks/device_time.md)."""
    hparams = dict(LAMB, weight_decay=0.01)
    init, grads = _problem(3)
    bf16 = [(n, t.to(torch.bfloat16).requires_grad_()) for n, t in init.items()]
    opt = build_optimizer("lamb", bf16, backend="fused", master_weights=True,
                          lamb_update="stored", **hparams)
    assert type(opt.flat_binding.parts[0].engine) is optim_flat.FusedLambStoredUpdate
    opt.seed_masters({id(p): init[n] for n, p in bf16})
    groups = {n: g for g in opt.param_groups for n in g["param_names"]}
    ref = {n: [t.clone(), t.clone()] for n, t in init.items()}   # rounded, exact
    state = {n: [[torch.zeros_like(t), torch.zeros_like(t)] for _ in range(2)]
             for n, t in init.items()}
    bound, exact_apart = 0.0, 0.0
    for step, g in enumerate(grads[:12], start=1):
        before = {n: ref[n][0].clone() for n in ref}
        for n, p in bf16:
            p.grad = g[n].to(torch.bfloat16)
        opt.step(grad_scale=0.5)
        for n, p in bf16:
            grp = groups[n]
            for k, dtype in ((0, torch.bfloat16), (1, None)):
                lamb_step([ref[n][k]], [g[n].to(torch.bfloat16).float()], [state[n][k][0]],
                          [state[n][k][1]], step=step, lr=grp["lr"], beta1=grp["beta1"],
                          beta2=grp["beta2"], eps=grp["eps"],
                          weight_decays=grp["weight_decay"], adapt_flags=grp["adapt"],
                          grad_scale=0.5, update_dtype=dtype)
        # a bf16 rounding flip moves an element by at most 2^-8 of its step
        bound += 2.0 ** -8 * max((ref[n][0] - before[n]).abs().max().item() for n in ref)
        masters = opt.masters()
        scale = max(t[0].abs().max().item() for t in ref.values())
        for n, p in bf16:
            err = (masters[id(p)] - ref[n][0]).abs().max().item()
            assert err <= bound + 1e-6 * scale, (step, n, err, bound)
            assert torch.equal(p.detach(), masters[id(p)].to(torch.bfloat16)), (step, n)
        exact_apart = max(exact_apart, max((ref[n][0] - ref[n][1]).abs().max().item()
                                           for n in ref) / scale)
    assert exact_apart > 1e-6, exact_apart
    assert opt.flat_binding.compiled   # both passes compiled (no eager fallback on bf16 g)
    # after the step the gradient buffer holds u (bf16), not the gradient it was given
    p = dict(bf16)["emb.word_embeddings.weight"]
    assert not torch.equal(p.grad, grads[11]["emb.word_embeddings.weight"].to(torch.bfloat16))


def test_lamb_stored_update_is_refused_without_the_fused_step():
    init, _ = _problem(0)
    with pytest.raises(ValueError, match="FusedLambStoredUpdate is a step of the fused "
                                         "backend .* not 'foreach'"):
        build_optimizer("lamb", _named(init), lr=1e-2, backend="foreach",
                        lamb_update="stored")
    with pytest.raises(ValueError, match="lamb_update 'kept' is not one of recompute, stored"):
        build_optimizer("lamb", _named(init), lr=1e-2, backend="fused", lamb_update="kept")


@pytest.mark.parametrize("backend", ["foreach", "fused"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_adamw_backend_equals_reference(backend, weight_decay, bias_correction):
    _compare("adamw", backend, dict(ADAMW, weight_decay=weight_decay,
                                    bias_correction=bias_correction))


@pytest.mark.parametrize("backend", ["foreach", "fused"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_lars_backend_equals_reference(backend, weight_decay):
    _compare("lars", backend, dict(LARS, weight_decay=weight_decay))


@pytest.mark.parametrize("name,hparams", [("lamb", LAMB), ("adamw", ADAMW), ("lars", LARS)])
def test_fused_skips_tensors_without_grad_like_the_reference(name, hparams):
    # Some tensors miss gradients on some steps: their parameters and state stay untouched
    # and their step counts (bias correction) fall behind the others' — per-tensor steps.
    init, grads = _problem(1)
    runs = {}
    for backend in ("reference", "fused"):
        named = _named(init)
        opt = build_optimizer(name, named, backend=backend, weight_decay=0.01, **hparams)
        for step, g in enumerate(grads[:30], start=1):
            for i, (n, p) in enumerate(named):
                p.grad = None if (step + i) % 4 == 0 else g[n].clone()
            opt.step()
        runs[backend] = (named, opt)
    (ref, ref_opt), (got, got_opt) = runs["reference"], runs["fused"]
    for (n, p), (_, q) in zip(got, ref):
        _assert_rel(p.detach(), q.detach(), 1e-6, n)
        assert got_opt.state[p]["step"] == ref_opt.state[q]["step"] < 30


# ----------------------------------------------------------------------------- binding

def test_fused_params_grads_and_state_are_views_of_flat_buffers():
    init, grads = _problem(2)
    named = _named(init)
    opt = build_optimizer("lamb", named, lr=1e-3, backend="fused")
    (part,) = opt.flat_binding.parts
    b = part.buffers
    order = [n for n, _ in reversed(named)]  # gradient-production order: reverse model order
    assert [tuple(s.shape) for s in b.layout.segments] == [SHAPES[n] for n in order]
    base = {b.params.data_ptr(), b.grads.data_ptr(), *(t.data_ptr() for t in b.state.values())}
    assert len(base) == 2 + len(b.state)
    for i, (n, p) in enumerate(reversed(named)):
        seg = b.layout.segments[i]
        assert seg.offset % optim_flat.ROW == 0
        assert p.data_ptr() == b.params.data_ptr() + 4 * seg.offset, n
        assert p.grad.data_ptr() == b.grads.data_ptr() + 4 * seg.offset, n
        assert opt.state[p]["exp_avg"].data_ptr() == b.state["exp_avg"].data_ptr() + 4 * seg.offset
        assert torch.equal(p.detach(), init[n])
    # backward accumulates into the buffer; zero_grad zeroes it and keeps the views
    p = named[1][1]
    (p * 2.0).sum().backward()
    assert b.grads.abs().sum().item() == 2.0 * p.numel()
    opt.zero_grad(set_to_none=True)
    assert p.grad is not None and b.grads.abs().sum().item() == 0.0
    assert p.grad.data_ptr() == b.grads.data_ptr() + 4 * b.layout.segments[len(named) - 2].offset


def test_flat_layout_rows_and_bucket_bounds():
    layout = FlatLayout.build([(3, 5), (1024,), (), (2049,)], row=1024)
    assert [s.offset for s in layout.segments] == [0, 1024, 2048, 3072]
    assert [s.rows for s in layout.segments] == [1, 1, 1, 3]
    assert layout.total == 6 * 1024 and layout.rows == 6
    assert layout.bucket_bounds(1, 2) == (1024, 3072)
    assert layout.row_segment("cpu").tolist() == [0, 1, 2, 3, 3, 3]


def test_fused_state_dict_round_trip_continues_identically():
    init, grads = _problem(3)
    a, b = _named(init), _named(init)
    opt_a = build_optimizer("lamb", a, lr=1e-2, backend="fused")
    for (n, p) in a:
        p.grad = grads[0][n].clone()
    opt_a.step()
    for (_, p), (_, q) in zip(a, b):
        q.data.copy_(p.data)
    opt_b = build_optimizer("lamb", b, lr=1e-2, backend="fused")
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    (part,) = opt_b.flat_binding.parts
    for i, p in enumerate(part.params):  # loaded state lives in the flat buffers again
        assert opt_b.state[p]["exp_avg"].data_ptr() == part.buffers.view(
            part.buffers.state["exp_avg"], i).data_ptr()
    for (n, p), (_, q) in zip(a, b):
        p.grad = grads[1][n].clone()
        q.grad = grads[1][n].clone()
    opt_a.step()
    opt_b.step()
    for (_, p), (_, q) in zip(a, b):
        assert torch.equal(p, q)


def test_grad_norm_equals_reference_global_norm():
    init, grads = _problem(4)
    for backend in ("reference", "fused"):
        named = _named(init)
        opt = build_optimizer("adamw", named, lr=1e-3, backend=backend)
        for n, p in named:
            p.grad = grads[0][n].clone()
        want = torch.sqrt(sum((g.double() ** 2).sum() for g in grads[0].values()))
        assert opt.grad_norm().dtype == torch.float32
        assert opt.grad_norm().item() == pytest.approx(want.item(), rel=1e-6)
        named[0][1].grad[0, 0] = float("nan")
        assert not torch.isfinite(opt.grad_norm())


def test_compile_failure_warns_and_falls_back_to_the_same_numbers(monkeypatch):
    def broken(*args):
        raise RuntimeError("simulated inductor failure\nsecond line")

    monkeypatch.setattr(compiled_pass, "_COMPILED", {})   # nothing compiled yet in this process
    monkeypatch.setattr(compiled_pass.torch, "compile", lambda fn, **options: broken)
    init, grads = _problem(5)
    with pytest.warns(RuntimeWarning) as caught:
        named = _named(init)
        opt = build_optimizer("lamb", named, lr=1e-2, backend="fused")
    messages = " | ".join(str(w.message) for w in caught)
    for fn in ("lamb_pass1", "lamb_pass2"):
        assert f"torch.compile of {fn} failed (RuntimeError: simulated" in messages
    assert not opt.flat_binding.compiled
    ref = _named(init)
    ref_opt = build_optimizer("lamb", ref, lr=1e-2)
    for g in grads[:5]:
        for (n, p), (_, q) in zip(named, ref):
            p.grad, q.grad = g[n].clone(), g[n].clone()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once, at build time
            opt.step()
        ref_opt.step()
    for (n, p), (_, q) in zip(named, ref):
        _assert_rel(p.detach(), q.detach(), 1e-6, n)


def test_every_layout_a_process_builds_steps_compiled():
    """Dynamo runs a function eagerly, without a word, once it holds ``recompile_limit``
    graphs of it: with one compiled wrapper per pass function, a test worker's ninth layout
    stepped eagerly (other numbers: a tolerance test failed by order). Here the limit is 1 and
    three layouts each compile their own graph, the third too."""
    from tests.support.inductor import frames_compiled
    name = ("recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit")
            else "cache_size_limit")
    with torch._dynamo.config.patch(**{name: 1}):
        for rows in (3, 4, 5):   # 3-5 rows of 1024: three shapes of every flat buffer
            named = [("w", torch.randn(rows * 1024 - 7, requires_grad=True))]
            before = frames_compiled()
            opt = build_optimizer("adamw", named, lr=1e-3, backend="fused")  # compiles here
            named[0][1].grad = torch.randn_like(named[0][1])
            opt.step()
            assert opt.flat_binding.compiled and frames_compiled() > before, rows


def test_a_second_cpu_layout_compiles_symbolic_counts_that_serve_every_later_one(monkeypatch):
    """On CPU a process's first layout of a pass compiles with every size a constant (as CUDA's
    always do); its second with the numbers of rows and tensors as symbols, the row width
    (1024) a constant; and that graph is every later layout's: after a third, a fourth
    compiles nothing (Inductor's cache; the second's code was generated with the cache off).
    The symbolic steps give the static step's numbers bit for bit."""
    from torch._dynamo.utils import counters
    from tests.support.inductor import generated_code, input_sizes, is_constant

    def fresh_process():
        monkeypatch.setattr(compiled_pass, "_COMPILED", {})
        monkeypatch.setattr(compiled_pass, "_FIRST_SIZES", {})

    def steps(rows: int) -> list[torch.Tensor]:   # a layout of its own: 3 AdamW steps
        gen = torch.Generator().manual_seed(rows)
        named = [("w", torch.randn(rows * 1024 - 7, generator=gen).requires_grad_()),
                 ("b", torch.randn(3 * rows, generator=gen).requires_grad_())]
        opt = build_optimizer("adamw", named, lr=1e-2, weight_decay=0.1, backend="fused")
        for _ in range(3):
            for _, p in named:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        assert opt.flat_binding.compiled
        return [p.detach().clone() for _, p in named]

    fresh_process()
    first = input_sizes(generated_code(lambda: steps(3)))
    assert first and all(is_constant(d) for s in first for d in s), first
    second = input_sizes(generated_code(lambda: steps(4)))
    tables = [s for s in second if len(s) == 2]   # (rows, 1024) views, (tensors, k) tables
    assert ("1024" in {s[1] for s in tables} and
            all(not is_constant(s[0]) and is_constant(s[1]) for s in tables)), second
    steps(5)   # (the two above were generated with the cache off: this one fills it)
    missed = counters["inductor"]["fxgraph_cache_miss"]
    symbolic = steps(6)
    assert counters["inductor"]["fxgraph_cache_miss"] == missed   # nothing new compiled
    fresh_process()
    static = steps(6)   # the same layout as a process's first: every size a constant
    assert all(torch.equal(a, b) for a, b in zip(symbolic, static))


# ----------------------------------------------------------------------------- dispatch

def test_backend_dispatch():
    assert optim.resolve_backend("lamb", "auto", torch.device("cpu")) == "fused"
    assert optim.resolve_backend("lamb", "auto", torch.device("cuda")) == "fused"
    assert optim.resolve_backend("lamb", "auto", torch.device("meta")) == "foreach"
    assert optim.resolve_backend("adamw", "reference", torch.device("cpu")) == "reference"
    with pytest.raises(ValueError, match="'apex' runs on CUDA only"):
        optim.resolve_backend("lamb", "apex", torch.device("cpu"))
    opt = build_optimizer("lars", _named(_problem(6)[0]), lr=1e-3, backend="auto")
    assert (opt.requested_backend, opt.backend) == ("auto", "fused")
    assert opt.compile_seconds > 0
    assert "apex" not in optim.available_backends("lars")


@pytest.mark.skipif(optim_apex.available(), reason="NVIDIA apex is installed here")
def test_apex_not_offered_without_apex():
    assert "apex" not in optim.available_backends("lamb")
    with pytest.raises(ValueError, match="backend 'apex' is not available .*amp_C"):
        build_optimizer("lamb", _named(_problem(6)[0]), lr=1e-3, backend="apex")


# ----------------------------------------------------------------------------- memory

@pytest.fixture(scope="module")
def memory_growths() -> dict:
    """memory_growth of the three optimizers, in one fresh process (one torch import, not
    three: each measurement resets the resident-set peak before its step)."""
    root = Path(__file__).resolve().parents[2]
    code = ("import json, tests.support.memory as m; print(json.dumps({n: m.memory_growth(n) "
            "for n in ('lamb', 'adamw', 'lars')}))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(root)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
@pytest.mark.parametrize("name", ["lamb", "adamw", "lars"])
def test_fused_step_allocates_no_model_sized_temporaries(name, memory_growths):
    # One tensor above glibc's largest mmap threshold (32 MiB): its temporaries are always
    # fresh pages, so the foreach control cannot hide them in a reused heap.
    growth = memory_growths[name]
    buffer = sum(torch.Size(s).numel() for s in MEMORY_SHAPES) * 4
    # The control shows the measurement sees temporaries: foreach allocates several.
    assert growth["foreach"] > 0.9 * buffer, growth
    assert growth["fused"] < 0.05 * buffer, growth


# ----------------------------------------------------------------------------- CUDA

@CUDA
@pytest.mark.parametrize("name,hparams", [("lamb", dict(LAMB, weight_decay=0.01)),
                                          ("adamw", dict(ADAMW, weight_decay=0.01)),
                                          ("lars", dict(LARS, weight_decay=0.01))])
@pytest.mark.parametrize("backend", ["foreach", "fused"])
def test_cuda_fp32_backend_equals_reference(name, hparams, backend):
    _compare(name, backend, hparams, device="cuda")


@CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", ["foreach", "fused"])
def test_cuda_low_precision_params_keep_fp32_state(dtype, backend):
    # bf16/fp16 parameters, fp32 state and math, rounded once per step: as the reference.
    # (No separate fp32 master copy of the weights: see kernels.optim_reference.)
    _compare("lamb", backend, dict(LAMB, weight_decay=0.01), tol=1e-2, device="cuda",
             dtype=dtype)


@CUDA
@pytest.mark.skipif(not optim_apex.available(), reason="needs NVIDIA apex with amp_C")
@pytest.mark.parametrize("name,hparams", [("lamb", dict(LAMB, weight_decay=0.01)),
                                          ("adamw", dict(ADAMW, weight_decay=0.01))])
def test_cuda_apex_equals_reference(name, hparams):
    _compare(name, "apex", hparams, tol=1e-5, device="cuda")


def test_fused_leaves_gradients_owned_by_buckets_in_place():
    # An owner that does not share its buffer (share_gradients) made every .grad a view of it
    # before the optimizer is built; the fused backend must read them (copy), never re-point.
    init, grads = _problem(8)
    named, ref = _named(init), _named(init)
    owner = torch.zeros(sum(p.numel() for _, p in named))
    offset = 0
    for _, p in named:
        p.grad = owner[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    views = [p.grad.data_ptr() for _, p in named]
    opt = build_optimizer("lamb", named, lr=1e-2, backend="fused")
    ref_opt = build_optimizer("lamb", ref, lr=1e-2)
    assert opt.flat_binding.external_grads
    for g in grads[:5]:
        for (n, p), (_, q) in zip(named, ref):
            p.grad.copy_(g[n])  # what the bucket allreduce leaves there
            q.grad = g[n].clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        assert [p.grad.data_ptr() for _, p in named] == views
        assert owner.abs().sum().item() == 0.0
    for (n, p), (_, q) in zip(named, ref):
        _assert_rel(p.detach(), q.detach(), 1e-6, n)


def test_an_uncompiled_backend_never_imports_dynamo():
    """torch wraps Optimizer.add_param_group/zero_grad/state_dict/load_state_dict in a guard
    that imports torch._dynamo on first use (1.3 s of every rank's start-up); Presto's
    optimizers call them unwrapped, so the foreach, reference and (on GPU) apex backends start
    without it. A fresh process: build, step, zero_grad, state_dict round trip, per optimizer."""
    code = """
import sys, torch
from runtime.optim.optimizers import build_optimizer
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
for name in ("lamb", "adamw", "lars"):
    for backend in ("foreach", "reference"):
        opt = build_optimizer(name, model.named_parameters(), lr=1e-3, backend=backend)
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        opt.load_state_dict(opt.state_dict())
        assert opt.state_dict()["state"], (name, backend)
print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["no", "dynamo"], proc.stdout + proc.stderr[-2000:]


@pytest.mark.parametrize("name,hparams", [("lamb", dict(LAMB, weight_decay=0.01)),
                                          ("adamw", dict(ADAMW, weight_decay=0.01)),
                                          ("lars", dict(LARS, weight_decay=0.01))])
def test_fp32_master_weights_step_as_fp32_parameters_would(name, hparams):
    """train.precision 'bf16_master': bf16 parameters and gradients, fp32 masters in the
    optimizer's state. Each step equals, bit for bit, the fused fp32 step of parameters that
    are the masters on the same (bf16) gradients, and leaves the parameters the masters
    rounded to bf16; masters start exact (seed_masters), not from the rounded weights.
    (LARS: equal to within an ulp - Inductor's C++ contracts its two-output pass 2 into
    fused multiply-adds otherwise than the one-output pass: 4 of 2,100 elements 1 ulp apart
    after 4 steps; LAMB and AdamW bit for bit.)"""
    exact = name != "lars"
    init, grads = _problem(7)
    bf16 = [(n, t.to(torch.bfloat16).requires_grad_()) for n, t in init.items()]
    fp32 = _named(init)
    opt = build_optimizer(name, bf16, backend="fused", master_weights=True, **hparams)
    opt.seed_masters({id(p): init[n] for n, p in bf16})
    ref = build_optimizer(name, fp32, backend="fused", **hparams)
    assert opt.keeps_masters and not ref.keeps_masters
    for step, g in enumerate(grads[:20]):
        for (n, p), (_, q) in zip(bf16, fp32):
            p.grad = g[n].to(torch.bfloat16)
            q.grad = p.grad.float()
        opt.step(grad_scale=0.5)
        ref.step(grad_scale=0.5)
        masters = opt.masters()
        for (n, p), (_, q) in zip(bf16, fp32):
            if exact:
                assert torch.equal(masters[id(p)], q.detach()), (step, n)
            else:
                torch.testing.assert_close(masters[id(p)], q.detach(), rtol=0,
                                           atol=2e-7 * float(q.detach().abs().max()))
            assert torch.equal(p.detach(), masters[id(p)].to(torch.bfloat16)), (step, n)
    assert any(not torch.equal(q.detach(), init[n]) for n, q in fp32)
    with pytest.raises(ValueError, match="master weights .* need the fused backend"):
        build_optimizer(name, _named(init), backend="foreach", master_weights=True, **hparams)


def test_master_state_round_trip_keeps_fp32_and_continues_identically():
    """An unsharded bf16_master resume: torch's load_state_dict casts floating state to the
    parameter's dtype, which turned the fp32 masters and moments of bf16 parameters into
    bf16 and made the resumed run drift. Loaded, they stay fp32 in the flat buffers, and
    the next steps equal the uninterrupted optimizer's bit for bit."""
    init, grads = _problem(5)
    runs = []
    for _ in range(2):
        named = [(n, t.to(torch.bfloat16).requires_grad_()) for n, t in init.items()]
        opt = build_optimizer("lamb", named, backend="fused", master_weights=True,
                              **dict(LAMB, weight_decay=0.01))
        opt.seed_masters({id(p): init[n] for n, p in named})
        runs.append((named, opt))
    (a, opt_a), (b, opt_b) = runs
    for g in grads[:3]:
        for n, p in a:
            p.grad = g[n].to(torch.bfloat16)
        opt_a.step()
    for (_, p), (_, q) in zip(a, b):
        q.data.copy_(p.data)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    for _, q in b:
        assert {k: v.dtype for k, v in opt_b.state[q].items() if k != "step"} == {
            "master": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32}
    for g in grads[3:6]:
        for (n, p), (_, q) in zip(a, b):
            p.grad = g[n].to(torch.bfloat16)
            q.grad = p.grad.clone()
        opt_a.step()
        opt_b.step()
    masters_a, masters_b = opt_a.masters(), opt_b.masters()
    for (n, p), (_, q) in zip(a, b):
        assert torch.equal(masters_a[id(p)], masters_b[id(q)]), n
        assert torch.equal(p, q), n
