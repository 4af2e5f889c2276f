"""The kernel count's rules (bench.kernel_count) and CUDA's dispatch choices on the CPU
(bench.cuda_dispatch), op by op: what launches and what does not, the categories and the
multi-kernel ops, CUDA's autocast lists where they differ from the CPU's, the fused dropout
and the flash stand-in - each registration gone after its ``with``. The whole step and its
ceilings: tests/integration/test_bench_kernel_count_integration.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench import cuda_dispatch
from bench.cuda_dispatch import as_on_cuda, cuda_autocast_lists, cuda_autocast_on_cpu
from bench.kernel_count import MODES, config
from bench.kernel_counter import (MTA_CHUNK, MTA_MAX_CHUNKS, counting, multi_tensor_launches,
                                  summarize)


def names(counter) -> list[str]:
    return [r[2] for r in counter.records]


def test_views_metadata_self_copies_empty_tensors_and_host_work_launch_nothing():
    device = torch.randn(4, 6)
    host = torch.arange(6)
    with counting(host=[host]) as c:
        device.view(-1), device.t(), device.detach(), device[1:], device.expand(2, 4, 6)
        torch.empty(3), torch.empty_like(device)
        device[:2].copy_(device[:2])          # the same memory: ATen returns at once
        torch.zeros(0) + 1                    # nothing to compute
        (host * 2).to(torch.int32)            # the host batch's own work
    assert c.records == []


def test_each_op_that_computes_is_one_launch_in_its_category():
    x = torch.randn(4, 6)
    host = torch.arange(6, dtype=torch.float32)
    with counting(host=[host]) as c:
        y = x + 1
        y.to(torch.bfloat16)                  # a cast
        y.clone()
        x[0].copy_(host)                      # the host-to-device copy
        x.mm(x.t())
        x.sum()
        torch.zeros(3)
    assert [(r[1], r[2], r[3]) for r in c.records] == [
        ("elementwise", "add", 1), ("cast", "_to_copy", 1), ("copy/fill", "clone", 1),
        ("copy/fill", "copy_", 1), ("gemm", "mm", 1), ("reduction", "sum", 1),
        ("copy/fill", "zeros", 1)]


def test_multi_kernel_ops_count_cudas_launches_and_backward_is_counted():
    x = torch.randn(8, 16, requires_grad=True)
    w, b = torch.ones(16, requires_grad=True), torch.zeros(16, requires_grad=True)
    with counting() as c:
        F.layer_norm(x, (16,), w, b).sum().backward()
    by = {r[2]: r for r in c.records}
    assert by["native_layer_norm"][1:] == ("norm", "native_layer_norm", 1)
    assert by["native_layer_norm_backward"][1:] == ("norm", "native_layer_norm_backward", 2)
    assert summarize(c.records)["kernels"] == summarize(c.records)["ops"] + 1


def test_multi_tensor_ops_count_the_launches_multi_tensor_apply_makes():
    """ATen's loop: a launch when 448 tensors (depth 2) or 2,240 chunks of 65,536 elements
    are full, one for the rest; a tensor cut by a full launch goes on in the next."""
    assert multi_tensor_launches(2, [16384] * 305) == 1        # a narrow model's bucket
    assert multi_tensor_launches(2, [16384] * 448) == 1
    assert multi_tensor_launches(2, [16384] * 449) == 2
    assert multi_tensor_launches(1, [1] * 770) == 1 and multi_tensor_launches(1, [1] * 771) == 2
    assert multi_tensor_launches(2, [MTA_CHUNK * MTA_MAX_CHUNKS]) == 1
    assert multi_tensor_launches(2, [MTA_CHUNK * MTA_MAX_CHUNKS + 1]) == 2
    assert multi_tensor_launches(2, [0, 0]) == 0
    assert multi_tensor_launches(2, [13_107_200] * 2) == 1     # two BERT-large buckets
    xs, ys = [torch.zeros(4) for _ in range(3)], [torch.ones(4) for _ in range(3)]
    with counting() as c:
        torch._foreach_add_(xs, ys)
    assert [(r[1], r[2], r[3]) for r in c.records] == [("elementwise", "_foreach_add_", 1)]


@pytest.mark.parametrize("mode,layers,buckets", [("bf16_master_layers", 24, {28}),
                                                   ("bf16_master", 2, {6}),
                                                   ("bf16_autocast", 2, {10}),
                                                   ("bf16_autocast", 24, {51})])
def test_the_narrow_model_has_as_many_buckets_as_bert_large(mode, layers, buckets):
    """Each bucket is one multi-tensor add in the count: the narrow model's cap cuts its
    gradients into as many buckets as BERT-large's at the DGX config's 25 MiB at the same depth
    (BERT-large at 24 layers: 28 in bf16, 54 in fp32, where the narrow layers' sizes allow 51
    or 63 and the nearer is taken); a caller's cap wins."""
    from bench.kernel_count import _bucket_count, _grad_element_size
    from runtime.grad_sync.plan import MB
    cfg = config(*MODES[mode], f"model.num_hidden_layers={layers}")
    element = _grad_element_size(cfg)
    assert _bucket_count(cfg, int(cfg.train.bucket_cap_mb * MB) // element) in buckets
    assert config("train.bucket_cap_mb=3").train.bucket_cap_mb == 3


def test_the_optimizer_phase_is_one_category():
    x = torch.randn(4)
    with counting() as c:
        c.phase = "optimizer"
        x.mul_(2).sum()
    assert {(r[0], r[1]) for r in c.records} == {("optimizer", "optimizer")}


# ------------------------------------------------------------------------------- autocast

def test_cudas_autocast_lists_are_read_from_torchs_header_and_match_its_registrations():
    lists = cuda_autocast_lists()
    cuda_dispatch.check_autocast_lists(lists)
    assert lists["linear"] == "lower_precision_fp" and lists["layer_norm"] == "fp32"
    assert lists["softmax.int"] == "fp32_set_opt_dtype" and lists["index_put"] == "promote"


def test_a_header_missing_an_op_is_refused(tmp_path):
    header = cuda_dispatch.autocast_header().read_text()
    broken = tmp_path / "autocast_mode.h"
    broken.write_text(header.replace("  _(layer_norm)                       \\\n", ""))
    lists = cuda_autocast_lists(broken)
    assert "layer_norm" not in lists
    with pytest.raises(RuntimeError, match="layer_norm"):
        cuda_dispatch.check_autocast_lists(lists)


def _dtypes():
    low = torch.randn(4, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return (F.layer_norm(low, (8,)).dtype, F.softmax(low, -1).dtype, low.sum().dtype,
                F.linear(low.float(), torch.randn(3, 8)).dtype)


def test_cpu_autocast_takes_cudas_policies_inside_and_its_own_after():
    cpu = _dtypes()
    with cuda_autocast_on_cpu() as policies:
        cuda = _dtypes()
    assert policies["layer_norm"] == "fp32" and policies["cat"] == "none"
    # CUDA runs layer_norm, softmax and sum in fp32; the CPU as they come; both cast linear
    assert cuda == (torch.float32, torch.float32, torch.float32, torch.bfloat16)
    assert cpu == (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16)
    assert _dtypes() == cpu


def test_the_policies_cuda_registers_beside_its_lists():
    x = torch.rand(4, 8, dtype=torch.bfloat16)
    with cuda_autocast_on_cpu(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.ops.aten.norm.Scalar(x, 2).dtype == torch.float32
        assert torch.ops.aten.norm.ScalarOpt_dim(x, 2, [1]).shape == (4,)
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            F.binary_cross_entropy(x, x)


def test_cudas_fp32_policy_shows_as_a_cast_in_the_count():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    with cuda_autocast_on_cpu(), counting() as c, torch.autocast("cpu", dtype=torch.bfloat16):
        F.layer_norm(x, (8,))
    assert names(c) == ["_to_copy", "native_layer_norm"]
    assert c.records[0][1] == "cast"


# ------------------------------------------------------------------- dropout and attention

def test_dropout_is_one_fused_kernel_as_on_cuda_and_the_cpus_route_after():
    x = torch.randn(64, requires_grad=True)
    with as_on_cuda(), counting() as c:
        F.dropout(x, 0.1, training=True).sum().backward()
        F.dropout(x, 0.1, training=False)
    assert [n for n in names(c) if "dropout" in n or "bernoulli" in n] == [
        "native_dropout", "native_dropout_backward"]
    with counting() as c:
        F.dropout(x, 0.1, training=True)
    assert "bernoulli_" in names(c) and "native_dropout" not in names(c)


def test_the_flash_stand_in_has_flashs_shapes_and_counts_one_and_three_kernels():
    tokens, heads, d = 10, 2, 8
    q, k, v = (torch.randn(tokens, heads, d, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with as_on_cuda():
        with counting() as c:
            out, lse, rng, _, _ = torch.ops.aten._flash_attention_forward(
                q, k, v, cu, cu, 6, 6, 0.1, False, False)
            out.float().sum().backward()
    assert out.shape == v.shape and out.dtype == torch.bfloat16
    assert lse.shape == (heads, tokens) and lse.dtype == torch.float32
    assert rng.shape == (2,) and rng.dtype == torch.uint64
    assert all(t.grad is not None and t.grad.shape == (tokens, heads, d) for t in (q, k, v))
    flash = [r for r in c.records if r[1] == "attention"]
    assert [(r[2], r[3]) for r in flash] == [("_flash_attention_forward", 1),
                                              ("_flash_attention_backward", 3)]
    with pytest.raises(NotImplementedError):  # no CPU kernel once the with is left
        torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, 6, 6, 0.0, False, False)


def test_only_the_whole_step_graph_is_counted():
    from bench.kernel_count import count_step_kernels
    from runtime.choices import ConfigError
    with pytest.raises(ConfigError, match="train.cuda_graphs=full"):
        count_step_kernels("train.cuda_graphs=none")


@pytest.mark.parametrize("argv, flag", [
    (["--modes", ""], "--modes"), (["--modes", ",,"], "--modes"),
    (["--modes", "bf16_nothing"], "--modes"), (["--hidden", "0"], "--hidden"),
    (["--hidden", "-64"], "--hidden"), (["--layers", "-1"], "--layers"),
    (["--layers", "0"], "--layers"), (["--widths", "0"], "--widths"),
    (["--widths", "abc"], "--widths"), (["--small-layers", "-1"], "--small-layers"),
    (["--layers", "2", "--small-layers", "2"], "--small-layers")])
def test_a_bad_flag_is_refused_with_exit_2_naming_it(argv, flag, capsys):
    from bench.kernel_count import main
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert f"error: {flag}" in err, err  # the flag itself, not a config key it turns into
