"""Optimizers: hand-computed LAMB/AdamW/LARS steps, torch.optim.AdamW parity, registry,
BERT parameter grouping, gradient-norm clipping coefficient."""

import copy
import math

import pytest
import torch

from kernels import optim_reference as ref
from runtime.optim import optimizers as optim
from runtime.optim.groups import excluded_from_decay, param_groups_for_bert
from runtime.optim.optimizers import build_optimizer

B1, B2, EPS = 0.9, 0.999, 1e-6


def _named(**tensors):
    """(name, leaf tensor) pairs with the given values; '__' in a keyword stands for '.'."""
    return [(name.replace("__", "."), torch.tensor(v, dtype=torch.float32, requires_grad=True))
            for name, v in tensors.items()]


def _set_grads(named, grads):
    for (_, p), g in zip(named, grads):
        p.grad = torch.tensor(g, dtype=torch.float32)


def _values(named):
    return [p.detach().tolist() for _, p in named]


def _close(actual, expected, tol=1e-6):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a == pytest.approx(e, rel=tol, abs=tol), (actual, expected)


# ----------------------------------------------------------------------------- LAMB

def test_lamb_one_step_hand_computed():
    # weight: decayed + adapted; bias: excluded (no decay, ratio 1); zero weight: ratio 1.
    named = _named(enc__dense__weight=[3.0, 4.0], enc__dense__bias=[0.5, -0.5],
                   enc__zero__weight=[0.0, 0.0])
    _set_grads(named, [[1.0, -1.0], [0.2, 0.4], [0.3, -0.4]])
    opt = build_optimizer("lamb", named, lr=0.1, weight_decay=0.01, eps=EPS)
    opt.step()

    # Step 1 with bias correction: m̂ = g, v̂ = g², so r = g/(|g| + eps).
    r_w = [1.0 / (1.0 + EPS), -1.0 / (1.0 + EPS)]
    u_w = [r_w[0] + 0.01 * 3.0, r_w[1] + 0.01 * 4.0]
    ratio = math.sqrt(3.0**2 + 4.0**2) / math.sqrt(u_w[0]**2 + u_w[1]**2)
    w = [3.0 - 0.1 * ratio * u_w[0], 4.0 - 0.1 * ratio * u_w[1]]
    b = [0.5 - 0.1 * 0.2 / (0.2 + EPS), -0.5 - 0.1 * 0.4 / (0.4 + EPS)]
    z = [0.0 - 0.1 * 0.3 / (0.3 + EPS), 0.0 + 0.1 * 0.4 / (0.4 + EPS)]
    # Sanity on the literal numbers: ratio = 5/sqrt(1.03² + 0.96²) ≈ 3.5511.
    assert ratio == pytest.approx(5.0 / math.sqrt(1.03**2 + 0.96**2), rel=1e-5)
    got = _values(named)
    _close(got[0], w)
    _close(got[1], b)
    _close(got[2], z)


def _lamb_scalar_reference(x, grads, lr, wd, adapt, bias_correction, eps=EPS, clamp=None):
    """Plain-Python LAMB over a list of steps (independent of the code under test)."""
    m = [0.0] * len(x)
    v = [0.0] * len(x)
    x = list(x)
    for t, g in enumerate(grads, start=1):
        m = [B1 * mi + (1 - B1) * gi for mi, gi in zip(m, g)]
        v = [B2 * vi + (1 - B2) * gi * gi for vi, gi in zip(v, g)]
        c1 = 1 - B1**t if bias_correction else 1.0
        c2 = 1 - B2**t if bias_correction else 1.0
        u = [(mi / c1) / (math.sqrt(vi / c2) + eps) + wd * xi for mi, vi, xi in zip(m, v, x)]
        xn = math.sqrt(sum(xi * xi for xi in x))
        un = math.sqrt(sum(ui * ui for ui in u))
        phi = xn if clamp is None else min(xn, clamp)
        ratio = phi / un if (adapt and xn > 0 and un > 0) else 1.0
        x = [xi - lr * ratio * ui for xi, ui in zip(x, u)]
    return x


@pytest.mark.parametrize("bias_correction", [True, False])
def test_lamb_two_steps_hand_computed(bias_correction):
    grads = [[0.5, -1.0, 2.0], [-0.25, 0.5, 1.0]]
    named = _named(layer__weight=[1.0, -2.0, 0.5], layer__LayerNorm__weight=[1.0, 1.0, 1.0])
    opt = build_optimizer("lamb", named, lr=0.01, weight_decay=0.1,
                          bias_correction=bias_correction)
    for g in grads:
        _set_grads(named, [g, g])
        opt.step()
    got = _values(named)
    _close(got[0], _lamb_scalar_reference([1.0, -2.0, 0.5], grads, 0.01, 0.1, True,
                                          bias_correction))
    _close(got[1], _lamb_scalar_reference([1.0, 1.0, 1.0], grads, 0.01, 0.0, False,
                                          bias_correction))


def test_lamb_without_bias_correction_literal():
    # Step 1, no bias correction: m = 0.1·g, v = 0.001·g², r = 0.1·g/(√0.001·|g| + eps).
    named = _named(w__bias=[1.0])
    _set_grads(named, [[2.0]])
    opt = build_optimizer("lamb", named, lr=0.5, bias_correction=False)
    opt.step()
    r = 0.1 * 2.0 / (math.sqrt(0.001) * 2.0 + EPS)  # ≈ 3.16218
    _close(_values(named)[0], [1.0 - 0.5 * r])


def test_lamb_trust_clamp():
    named = _named(dense__weight=[30.0, 40.0])
    _set_grads(named, [[1.0, 1.0]])
    opt = build_optimizer("lamb", named, lr=0.1, weight_decay=0.0, trust_clamp=10.0)
    opt.step()
    r = 1.0 / (1.0 + EPS)
    ratio = 10.0 / math.sqrt(2 * r * r)  # φ(‖x‖=50) clamped to 10
    _close(_values(named)[0], [30.0 - 0.1 * ratio * r, 40.0 - 0.1 * ratio * r])


def test_lamb_use_nvlamb_adapts_excluded_but_keeps_their_zero_decay():
    named = _named(dense__bias=[3.0, 4.0])
    _set_grads(named, [[1.0, -1.0]])
    opt = build_optimizer("lamb", named, lr=0.1, weight_decay=0.5, use_nvlamb=True)
    opt.step()
    r = [1.0 / (1.0 + EPS), -1.0 / (1.0 + EPS)]  # λ = 0 for a bias even with nvlamb
    ratio = 5.0 / math.sqrt(r[0]**2 + r[1]**2)
    _close(_values(named)[0], [3.0 - 0.1 * ratio * r[0], 4.0 - 0.1 * ratio * r[1]])
    # Without nvlamb the bias moves by lr·r only (ratio 1).
    named2 = _named(dense__bias=[3.0, 4.0])
    _set_grads(named2, [[1.0, -1.0]])
    build_optimizer("lamb", named2, lr=0.1, weight_decay=0.5).step()
    _close(_values(named2)[0], [3.0 - 0.1 * r[0], 4.0 - 0.1 * r[1]])


def test_lamb_zero_update_norm_gives_ratio_one():
    # g = 0 and λ = 0: u = 0, ratio := 1, parameter unchanged (no NaN from 0/0).
    named = _named(dense__weight=[1.0, 2.0])
    _set_grads(named, [[0.0, 0.0]])
    build_optimizer("lamb", named, lr=0.1, weight_decay=0.0).step()
    assert _values(named)[0] == [1.0, 2.0]


# ----------------------------------------------------------------------------- AdamW

def test_adamw_one_step_hand_computed():
    named = _named(dense__weight=[1.0, -2.0], dense__bias=[0.5, 0.5])
    _set_grads(named, [[0.5, 0.25], [1.0, -1.0]])
    build_optimizer("adamw", named, lr=0.1, weight_decay=0.2, eps=1e-8).step()
    # Step 1 with bias correction: u = g/(|g|+eps) + λx.
    e = 1e-8
    w = [1.0 - 0.1 * (0.5 / (0.5 + e) + 0.2 * 1.0),
         -2.0 - 0.1 * (0.25 / (0.25 + e) + 0.2 * -2.0)]
    b = [0.5 - 0.1 * (1.0 / (1.0 + e)), 0.5 - 0.1 * (-1.0 / (1.0 + e))]
    got = _values(named)
    _close(got[0], w)  # ≈ [0.88, -2.06]
    _close(got[1], b)  # [0.4, 0.6]


# fp64: the formulas agree to rounding noise. fp32: both sides round differently (torch
# divides by √(1−β2^t) after the sqrt and decays x before the Adam step), about one ulp
# (2.4e-7 at |x| ≈ 2–4) per step, so 10 steps stay within a few ulp.
@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 4e-6)])
def test_adamw_matches_torch_adamw_over_10_steps(dtype, atol):
    gen = torch.Generator().manual_seed(0)
    shapes = {"enc.dense.weight": (7, 5), "enc.dense.bias": (7,),
              "enc.LayerNorm.weight": (5,), "head.weight": (3, 7)}
    init = {n: torch.randn(s, generator=gen, dtype=dtype) for n, s in shapes.items()}
    grads = [{n: torch.randn(s, generator=gen, dtype=dtype) for n, s in shapes.items()}
             for _ in range(10)]

    ours = [(n, t.clone().requires_grad_()) for n, t in init.items()]
    theirs = [(n, t.clone().requires_grad_()) for n, t in init.items()]
    opt = build_optimizer("adamw", ours, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8,
                          weight_decay=0.05)
    groups = [{"params": [p for n, p in theirs if not excluded_from_decay(n)],
               "weight_decay": 0.05},
              {"params": [p for n, p in theirs if excluded_from_decay(n)],
               "weight_decay": 0.0}]
    torch_opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                                  foreach=False)
    for g in grads:
        for (n, p), (_, q) in zip(ours, theirs):
            p.grad = g[n].clone()
            q.grad = g[n].clone()
        opt.step()
        torch_opt.step()
    for (n, p), (_, q) in zip(ours, theirs):
        assert p.dtype == dtype
        torch.testing.assert_close(p, q, rtol=0, atol=atol, msg=n)


# ----------------------------------------------------------------------------- LARS

def test_lars_two_steps_hand_computed():
    named = _named(dense__weight=[3.0, 4.0], dense__bias=[1.0, 1.0],
                   zero__weight=[0.0, 0.0])
    lr, mom, tc, wd, eps = 0.1, 0.9, 0.001, 0.01, 1e-9
    opt = build_optimizer("lars", named, lr=lr, momentum=mom, trust_coefficient=tc,
                          weight_decay=wd, eps=eps)
    _set_grads(named, [[0.6, 0.8], [0.5, -0.5], [1.0, 2.0]])
    opt.step()
    # weight: ‖w‖ = 5, ‖g‖ = 1 → local_lr = 0.001·5/(1 + 0.01·5 + eps).
    local = tc * 5.0 / (1.0 + wd * 5.0 + eps)
    buf_w = [lr * local * (0.6 + wd * 3.0), lr * local * (0.8 + wd * 4.0)]
    w1 = [3.0 - buf_w[0], 4.0 - buf_w[1]]
    # bias: excluded → local_lr = 1, λ = 0: plain momentum SGD.
    buf_b = [lr * 0.5, lr * -0.5]
    b1 = [1.0 - buf_b[0], 1.0 - buf_b[1]]
    # zero weight: ‖w‖ = 0 → local_lr = 1; λw = 0.
    buf_z = [lr * 1.0, lr * 2.0]
    z1 = [-buf_z[0], -buf_z[1]]
    got = _values(named)
    _close(got[0], w1)
    _close(got[1], b1)
    _close(got[2], z1)

    # Second step on the weight: momentum carries the first buffer.
    _set_grads(named, [[0.0, 1.0], [0.0, 0.0], [0.0, 0.0]])
    opt.step()
    wn = math.sqrt(w1[0]**2 + w1[1]**2)
    local2 = tc * wn / (1.0 + wd * wn + eps)
    buf2 = [mom * buf_w[0] + lr * local2 * (0.0 + wd * w1[0]),
            mom * buf_w[1] + lr * local2 * (1.0 + wd * w1[1])]
    _close(_values(named)[0], [w1[0] - buf2[0], w1[1] - buf2[1]])


# ----------------------------------------------------------------------------- grad_scale

def _random_named(seed):
    gen = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(s, generator=gen).requires_grad_())
            for n, s in [("a.weight", (4, 3)), ("a.bias", (4,)), ("b.LayerNorm.weight", (3,))]]


@pytest.mark.parametrize("name", ["lamb", "adamw", "lars"])
@pytest.mark.parametrize("scale", [0.37, torch.tensor(0.37)])
def test_grad_scale_equals_prescaled_grads(name, scale):
    folded, prescaled = _random_named(1), _random_named(1)
    opt_f = build_optimizer(name, folded, lr=0.05)
    opt_p = build_optimizer(name, prescaled, lr=0.05)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        for (_, p), (_, q) in zip(folded, prescaled):
            g = torch.randn(p.shape, generator=gen)
            p.grad = g.clone()
            q.grad = g * 0.37
        opt_f.step(grad_scale=scale)
        opt_p.step()
    for (n, p), (_, q) in zip(folded, prescaled):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)


# ----------------------------------------------------------------------------- behaviour

def test_params_without_grad_are_skipped_and_lr_zero_is_allowed():
    named = _random_named(3)
    before = [p.detach().clone() for _, p in named]
    opt = build_optimizer("lamb", named, lr=1e-3)
    named[0][1].grad = torch.ones_like(named[0][1])
    optim.set_lr(opt, 0.0)  # first warm-up step of the poly schedule
    opt.step()
    for (_, p), b in zip(named, before):
        assert torch.equal(p.detach(), b)
    assert opt.state[named[0][1]]["step"] == 1
    assert named[1][1] not in opt.state


def test_state_dict_round_trip_continues_identically():
    a, b = _random_named(4), _random_named(4)
    opt_a = build_optimizer("lamb", a, lr=1e-2)
    for _, p in a:
        p.grad = torch.full_like(p, 0.5)
    opt_a.step()
    for (_, p), (_, q) in zip(a, b):
        q.data.copy_(p.data)
    opt_b = build_optimizer("lamb", b, lr=1e-2)
    # deepcopy: as after torch.save/load (load_state_dict may alias same-dtype tensors).
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    for (_, p), (_, q) in zip(a, b):
        p.grad = torch.full_like(p, -0.25)
        q.grad = torch.full_like(q, -0.25)
    opt_a.step()
    opt_b.step()
    for (_, p), (_, q) in zip(a, b):
        assert torch.equal(p, q)


def test_bf16_params_keep_fp32_state():
    p = torch.tensor([1.0, 2.0], dtype=torch.bfloat16, requires_grad=True)
    opt = build_optimizer("lamb", [("dense.weight", p)], lr=0.1)
    p.grad = torch.tensor([0.5, 0.5], dtype=torch.bfloat16)
    opt.step()
    assert p.dtype == torch.bfloat16
    assert opt.state[p]["exp_avg"].dtype == torch.float32


# ----------------------------------------------------------------------------- registry

def test_registered_names():
    assert {"lamb", "adamw", "lars"} <= set(optim.available_optimizers())
    assert "use_nvlamb" in optim.optimizer_hparam_names("lamb")
    assert "use_nvlamb" not in optim.optimizer_hparam_names("adamw")


def test_duplicate_name_refused():
    with pytest.raises(ValueError, match="'lamb' is already registered"):
        optim.register_optimizer("lamb")(lambda named_parameters, *, lr: None)
    name = "test_only_duplicate"
    try:
        optim.register_optimizer(name)(lambda named_parameters, *, lr: None)
        with pytest.raises(ValueError, match="already registered"):
            optim.register_optimizer(name)(lambda named_parameters, *, lr: None)
    finally:
        optim._OPTIMIZERS.pop(name, None)


def test_unknown_name_lists_available():
    with pytest.raises(ValueError) as e:
        build_optimizer("sgdd", _random_named(0), lr=1.0)
    msg = str(e.value)
    assert "'sgdd'" in msg and "adamw" in msg and "lamb" in msg and "lars" in msg


@pytest.mark.parametrize("name,key,value,rule", [
    ("lamb", "lr", 0.0, "> 0"),
    ("lamb", "lr", -1e-3, "> 0"),
    ("lamb", "beta1", 1.0, "[0, 1)"),
    ("adamw", "beta2", -0.1, "[0, 1)"),
    ("adamw", "eps", 0.0, "> 0"),
    ("lamb", "eps", -1e-6, "> 0"),
    ("lars", "momentum", 1.0, "[0, 1)"),
    ("lars", "trust_coefficient", 0.0, "> 0"),
    ("lamb", "weight_decay", -0.01, ">= 0"),
    ("lamb", "trust_clamp", 0.0, "None or"),
])
def test_bad_hyperparameter_names_key_and_range(name, key, value, rule):
    hp = {"lr": 1e-3, key: value}
    with pytest.raises(ValueError) as e:
        build_optimizer(name, _random_named(0), **hp)
    assert f"'{key}'" in str(e.value) and rule in str(e.value)


def test_unknown_or_missing_hyperparameter_and_bad_backend():
    with pytest.raises(ValueError, match="unknown hyperparameter.*'momentum'.*accepted: lr"):
        build_optimizer("adamw", _random_named(0), lr=1e-3, momentum=0.9)
    with pytest.raises(ValueError, match="'lr'.*required"):
        build_optimizer("lamb", _random_named(0))
    with pytest.raises(ValueError, match="backend 'fast'.*available backends: auto, "
                                         "(apex, )?foreach, fused, reference"):
        build_optimizer("lamb", _random_named(0), lr=1e-3, backend="fast")
    with pytest.raises(ValueError, match="'beta1'"):
        optim.Lamb([torch.zeros(2, requires_grad=True)], lr=1e-3, beta1=1.5)


# ----------------------------------------------------------------------------- grouping

def test_param_groups_for_bert():
    names = [
        "bert.embeddings.word_embeddings.weight",
        "bert.embeddings.LayerNorm.weight",
        "bert.embeddings.LayerNorm.bias",
        "bert.encoder.layer.0.attention.self.query.weight",
        "bert.encoder.layer.0.attention.self.query.bias",
        "bert.encoder.layer.0.output.layer_norm.weight",
        "cls.predictions.transform.LayerNorm.gamma",
        "cls.predictions.transform.ln.beta",
        "cls.predictions.transform.dense.weight",
        "frozen.weight",
    ]
    named = [(n, torch.zeros(2, requires_grad=(n != "frozen.weight"))) for n in names]
    groups = param_groups_for_bert(named, 0.01)
    assert len(groups) == 2
    decay, no_decay = groups
    assert decay["weight_decay"] == 0.01 and decay["adapt"] is True
    assert no_decay["weight_decay"] == 0.0 and no_decay["adapt"] is False
    assert decay["param_names"] == [
        "bert.embeddings.word_embeddings.weight",
        "bert.encoder.layer.0.attention.self.query.weight",
        "cls.predictions.transform.dense.weight",
    ]
    assert no_decay["param_names"] == [
        "bert.embeddings.LayerNorm.weight",
        "bert.embeddings.LayerNorm.bias",
        "bert.encoder.layer.0.attention.self.query.bias",
        "bert.encoder.layer.0.output.layer_norm.weight",
        "cls.predictions.transform.LayerNorm.gamma",
        "cls.predictions.transform.ln.beta",
    ]
    assert [len(g["params"]) for g in groups] == [3, 6]
    # The optimizer keeps the grouping (and names) it was built with.
    opt = build_optimizer("lamb", named, lr=1e-3, weight_decay=0.01)
    assert [g["adapt"] for g in opt.param_groups] == [True, False]
    assert opt.param_groups[1]["param_names"][0] == "bert.embeddings.LayerNorm.weight"


# ----------------------------------------------------------------------------- clipping

def test_global_grad_norm_and_clip_coefficient():
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([[12.0]], dtype=torch.bfloat16)]
    norm = ref.global_grad_norm(grads)
    assert norm.dtype == torch.float32 and norm.item() == pytest.approx(13.0)
    coef, total = ref.clip_coefficient(grads, 1.0)
    assert total.item() == pytest.approx(13.0)
    assert coef.item() == pytest.approx(1.0 / (13.0 + 1e-6), rel=1e-6)
    coef, _ = ref.clip_coefficient(grads, 100.0)
    assert coef.item() == 1.0
    assert ref.global_grad_norm([]).item() == 0.0
    with pytest.raises(ValueError, match="max_norm"):
        ref.clip_coefficient(grads, 0.0)
    # Folding coef into the step equals clip_grad_norm_ on the gradients.
    g = [torch.tensor([3.0, 4.0]), torch.tensor([12.0])]
    clipped = [t.clone() for t in g]
    ps = [torch.zeros_like(t, requires_grad=True) for t in clipped]
    for p, t in zip(ps, clipped):
        p.grad = t
    torch.nn.utils.clip_grad_norm_(ps, 1.0)
    coef, _ = ref.clip_coefficient(g, 1.0)
    for p, t in zip(ps, g):
        torch.testing.assert_close(p.grad, t * coef)


def test_kernels_is_a_leaf_package():
    import ast
    import pathlib
    for path in [pathlib.Path(ref.__file__)]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) \
                    else [node.module or ""]
                for m in mods:
                    assert m.split(".")[0] not in {"runtime", "loaders", "submission"}, path


def test_the_registry_and_the_config_name_the_same_optimizers_and_every_backend_is_a_row():
    from typing import get_args
    from runtime.choices import OptimizerName
    assert optim.available_optimizers() == tuple(sorted(get_args(OptimizerName)))
    for name in get_args(OptimizerName):
        rows = optim._BACKENDS[name]
        assert {"reference", "foreach", "fused"} <= set(rows)
        assert all((r.step is None) != (r.flat is None) for r in rows.values())
        assert set(optim.available_backends(name)) == set(rows) | {"auto"}
