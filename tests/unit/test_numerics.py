"""The run's numerics as one value (runtime.numerics): train.precision, model.fp8 and
train.allreduce_dtype resolved once, what every reader takes from it (the bytes the memory
estimate counts, the peaks MFU is read against, the MLPerf log's step choices), the one
refusal of what does not compose, and no reader left comparing a precision's name."""
import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from runtime.choices import PRECISIONS, ConfigError
from runtime.config import load_config
from runtime.config.__main__ import main as config_main
from basis.dtypes import BYTES, TORCH_NAMES
from runtime.numerics import FP8, Numerics, resolve

ROOT = Path(__file__).resolve().parents[2]
CPU_CONFIG = "submission/configs/config_CPU_1x2x32x1.toml"


def test_each_dtype_name_has_the_bytes_of_the_torch_dtype_it_stands_for():
    from runtime.model.precision import DTYPES
    assert set(DTYPES) == set(TORCH_NAMES) == set(BYTES) - {FP8}
    for name, dtype in DTYPES.items():
        assert torch.empty((), dtype=dtype).element_size() == BYTES[name], name
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert BYTES[FP8] == torch.empty((), dtype=fp8).element_size()
    for row in PRECISIONS.values():   # every row names dtypes the table knows
        assert row.params in DTYPES and (row.autocast is None or row.autocast in DTYPES)


@pytest.mark.parametrize("precision,fp8,reduce,want", [
    ("fp32", "none", "auto", dict(params="fp32", autocast=None, gemm="fp32", reduce="fp32",
                                  master=False, loss_scale=False, param_bytes=4,
                                  master_bytes=0, activation_bytes=4, reduce_bytes=4,
                                  peak_dtypes=("fp32",), narrow_params=False)),
    ("bf16", "none", "fp32", dict(params="fp32", autocast="bf16", gemm="bf16", reduce="fp32",
                                  param_bytes=4, activation_bytes=2, peak_dtypes=("bf16",))),
    ("fp16", "none", "auto", dict(autocast="fp16", loss_scale=True, master=False)),
    ("bf16_master", "tensorwise", "auto", dict(
        params="bf16", autocast=None, gemm="bf16", reduce="bf16", master=True,
        loss_scale=False, param_bytes=2, master_bytes=4, activation_bytes=2, reduce_bytes=2,
        peak_dtypes=("bf16", "fp8"), narrow_params=True)),
    ("bf16_master", "none", "fp32", dict(reduce="fp32", reduce_bytes=4)),
    ("fp16_master", "none", "auto", dict(params="fp16", reduce="fp16", master=True,
                                         loss_scale=True, master_bytes=4)),
])
def test_resolve_composes_the_three_keys(precision, fp8, reduce, want):
    n = resolve(precision, fp8, reduce)
    assert (n.precision, n.fp8) == (precision, fp8)
    for attr, value in want.items():
        assert getattr(n, attr) == value, attr
    with pytest.raises(dataclasses.FrozenInstanceError):
        n.master = not n.master


@pytest.mark.parametrize("precision", ["fp16", "fp16_master"])
def test_fp8_beside_a_scaled_loss_is_refused_in_one_place_naming_both_keys(precision, capsys):
    with pytest.raises(ConfigError) as got:
        resolve(precision, "tensorwise")
    said = str(got.value)
    assert f"model.fp8='tensorwise' with train.precision='{precision}'" in said
    assert "'fp32', 'bf16', 'bf16_master'" in said and "model.fp8='none'" in said
    # the command-line check: exit 2, the same sentence
    argv = [CPU_CONFIG, "--set", f"train.precision={precision}", "--set", "system.device=cuda",
            "--set", "model.fp8=rowwise"]
    assert config_main(argv) == 2
    assert f"model.fp8='rowwise' with train.precision='{precision}'" in capsys.readouterr().err


def test_the_config_resolves_its_numerics():
    cfg = load_config(CPU_CONFIG, ["train.precision=bf16_master", "train.allreduce_dtype=fp32"])
    assert cfg.numerics() == Numerics(precision="bf16_master", fp8="none", params="bf16",
                                      autocast=None, reduce="fp32", master=True,
                                      loss_scale=False)
    assert cfg.numerics().describe()["allreduce_dtype"] == "fp32"


def test_an_fp8_runs_mfu_says_which_peak_it_is_against_and_gives_fp8s_beside_it():
    from runtime.observe.mfu import Peak, figures, peak_of
    n = resolve("bf16_master", "tensorwise")
    h100 = peak_of("NVIDIA H100 80GB HBM3", n.peak_dtypes)
    assert h100.tflops == 989.4 and h100.others == (("fp8", 1978.9),)
    assert "H100 bf16 dense" in h100.source and "mfu_fp8 against H100 fp8 dense" in h100.source
    f = figures(2 * 989.4e12, 2, 1.0, h100)
    assert f["mfu"] == pytest.approx(1.0) and f["mfu_fp8"] == pytest.approx(989.4 / 1978.9)
    a100 = peak_of("NVIDIA A100-SXM4-80GB", n.peak_dtypes)   # no FP8 tensor cores: said so
    assert a100.tflops == 312.0 and a100.others == ()
    assert "MFU counts them against the bf16 peak" in a100.source
    assert "mfu_fp8" not in figures(1e12, 1, 1.0, a100)
    cpu = peak_of(None, n.peak_dtypes)                       # no peak at all on a CPU
    assert cpu.tflops is None and "fp8" in cpu.source
    # without FP8: the peak as it always was
    assert peak_of("NVIDIA H100 80GB HBM3", resolve("bf16").peak_dtypes) == \
        Peak(989.4, "H100 bf16 dense, datasheet")


# Where a precision's name may still be compared: the rows (runtime/choices.py) and the one
# resolver (runtime/numerics.py). Every other engine file reads the resolved value.
NAMES = {"fp32", "bf16", "fp16", "bf16_master", "fp16_master"}
READERS = ("runtime/model/precision.py", "runtime/train/build.py",
           "runtime/calibrate/tune/__main__.py", "runtime/calibrate/tune/measure.py", "runtime/train/memory.py",
           "runtime/train/step.py", "runtime/observe/mfu.py", "runtime/optim/optimizers.py",
           "runtime/grad_sync/__init__.py", "runtime/train/run_control.py",
           "submission/mllog_callback.py")


def _name_branches(path: Path) -> list[str]:
    """Comparisons (==, !=, in) with a precision or dtype name, and PRECISIONS looked up."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            consts = [c.value for c in [node.left, *node.comparators]
                      if isinstance(c, ast.Constant)]
            if any(v in NAMES for v in consts):
                found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) \
                and node.value.id == "PRECISIONS":
            found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_reader_branches_on_a_precisions_name():
    bad = [b for f in READERS for b in _name_branches(ROOT / f)]
    assert not bad, "read the run's Numerics instead:\n" + "\n".join(bad)
    assert _name_branches(ROOT / "runtime/numerics.py")   # (the check sees the resolver's)
