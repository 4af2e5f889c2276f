"""train.precision's rows (runtime.choices.PRECISIONS): one per name, their refusals before
launch, what the memory estimate and the step's forward make of each, and the CPU's GEMMs of
16-bit operands (kernels.cpu_gemm) against their reference."""
from typing import get_args

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_gemm
from runtime.choices import PRECISIONS, ConfigError, Precision
from runtime.config import load_config
from runtime.model import precision
from runtime.numerics import resolve

CPU_CONFIG = "submission/configs/config_CPU_1x2x32x1.toml"


def test_one_row_per_precision_and_the_help_names_each():
    assert set(PRECISIONS) == set(get_args(Precision))
    cfg = load_config(CPU_CONFIG, ["train.precision=bf16_master"])
    assert cfg.train.precision == "bf16_master"
    from runtime.config.sections import TrainConfig
    import dataclasses
    doc = next(f for f in dataclasses.fields(TrainConfig) if f.name == "precision").metadata["doc"]
    for name in PRECISIONS:
        assert f"'{name}'" in doc
    for name, row in PRECISIONS.items():
        assert row.master == name.endswith("_master")
        assert row.loss_scale == name.startswith("fp16")



def test_the_dtype_names_are_one_list():
    """The precision rows, ``train.allreduce_dtype`` and the one torch table (the rows', which
    the gradient sync's reduce dtype is read from: runtime.numerics) speak of the dtypes
    basis.dtypes names."""
    from basis.dtypes import TORCH_NAMES
    from runtime.choices import ReduceDtype
    assert precision.DTYPES == {
        "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    assert set(TORCH_NAMES) == set(precision.DTYPES)
    named = {r.params for r in PRECISIONS.values()} | {r.autocast for r in PRECISIONS.values()}
    assert named - {None} <= set(TORCH_NAMES)
    assert set(get_args(ReduceDtype)) == set(TORCH_NAMES) | {"auto"}


@pytest.mark.parametrize("overrides,keys", [
    (["train.precision=bf16_master", "optim.backend=foreach"], ("train.precision", "optim.backend")),
    (["train.precision=bf16_master", "optim.backend=reference"], ("train.precision", "optim.backend")),
    (["train.precision=bf16_master", "train.grad_sync=ddp"], ("train.precision", "train.grad_sync")),
    (["train.precision=fp16_master"], ("train.precision", "system.device")),
    (["train.precision=bf16"], ("train.precision", "system.device")),
])
def test_what_cannot_combine_is_refused_before_launch_naming_the_keys(overrides, keys):
    with pytest.raises(ConfigError) as got:
        load_config(CPU_CONFIG, overrides)
    for key in keys:
        assert key in str(got.value)
    assert "train.precision='fp32'" in str(got.value)   # the way out


def test_master_weights_keep_the_bytes_per_parameter_and_halve_activations():
    from runtime.train.memory import estimate
    fp32 = estimate(load_config(CPU_CONFIG, []))
    master = estimate(load_config(CPU_CONFIG, ["train.precision=bf16_master"]))
    # 3 x 4 B + 8 B of moments against 3 x 2 B + 8 B + 4 B of masters
    assert fp32.static == fp32.params * 20 and master.static == master.params * 18
    assert master.per_sample < fp32.per_sample


def test_the_step_runs_its_rows_forward():
    cpu = torch.device("cpu")
    assert isinstance(precision.autocast(resolve("bf16_master"), cpu), cpu_gemm.Fp32Gemms)
    assert not isinstance(precision.autocast(resolve("fp32"), cpu), cpu_gemm.Fp32Gemms)
    assert isinstance(precision.autocast(resolve("bf16"), cpu), torch.autocast)


def test_the_cpus_16_bit_gemms_equal_their_reference_forward_and_backward():
    """fp32 arithmetic on the bf16 operands, the output (and each gradient) rounded once;
    the mode leaves fp32 alone."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, 64, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(32, 64, generator=gen).bfloat16().requires_grad_()
    b = torch.randn(32, generator=gen).bfloat16().requires_grad_()
    with cpu_gemm.Fp32Gemms():
        y = F.linear(x, w, b)
    ref_in = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    ref = cpu_gemm.linear_reference(*ref_in)
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref)
    gy = torch.randn(y.shape, generator=gen).bfloat16()
    y.backward(gy)
    ref.backward(gy)
    for got, want in zip((x, w, b), ref_in):
        assert got.grad.dtype == torch.bfloat16
        torch.testing.assert_close(got.grad.float(), want.grad.float(), rtol=0, atol=0)
    x32 = torch.randn(3, 8, generator=gen)
    w32 = torch.randn(4, 8, generator=gen)
    with cpu_gemm.Fp32Gemms():
        assert torch.equal(F.linear(x32, w32), F.linear(x32, w32))
