"""The device-time model's arithmetic (bench.op_cost, bench.device_model, runtime.calibrate.gpus):
a GEMM's FLOPs, bytes and tiles, a multi-tensor op's bytes summed and split by launch, the
special ops' kernels, an Inductor kernel's bytes by its parameters' roles, the price of a kernel,
the two extrapolations, and every number of every GPU row sourced - the ones from a record equal
to the record. The model against the GPU records: bench/results/device_time.json."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from bench.device_model import batch, depth, part_of, price, retarget_attention
from bench.kernel_counter import counting
from bench.op_cost import Cost, generated_costs, kernel_roles, nbytes
from runtime.calibrate import gpus
from runtime.calibrate.gpus import GPUS, gemm_waves, kernel_seconds

REPO = Path(__file__).resolve().parents[2]


def _costs(fn):
    with counting(costs=True) as c:
        fn()
    return list(zip(c.records, c.costs))


def test_a_gemms_flops_bytes_and_tiles():
    a = torch.randn(300, 1024, dtype=torch.bfloat16)
    b = torch.randn(1024, 4096, dtype=torch.bfloat16)
    bias = torch.randn(4096, dtype=torch.bfloat16)
    (mm, [c]), (addmm, [d]) = _costs(lambda: (a @ b, torch.addmm(bias, a, b)))
    assert mm[2] == "mm" and c.kind == "gemm" and c.dtype == "bf16"
    assert c.flops == 2 * 300 * 4096 * 1024
    assert c.bytes == (300 * 1024 + 1024 * 4096 + 300 * 4096) * 2
    assert c.tiles == 3 * 32  # ceil(300 / 128) x 4096 / 128
    assert addmm[2] == "addmm" and d.flops == c.flops and d.bytes == c.bytes + 4096 * 2


def test_a_batched_gemm_counts_every_batch():
    a, b = torch.randn(16, 64, 32), torch.randn(16, 32, 48)
    ((_, [c]),) = _costs(lambda: torch.bmm(a, b))
    assert c.flops == 2 * 64 * 48 * 32 * 16 and c.tiles == 16 and c.dtype == "fp32"
    assert c.bytes == (64 * 32 + 32 * 48 + 64 * 48) * 16 * 4


def test_elementwise_bytes_read_and_written_once_broadcasts_and_in_place():
    x, y = torch.randn(64, 48), torch.randn(48)
    ops = _costs(lambda: (x + y, x.add_(y), x.copy_(x * 2), x.zero_(), x.mul(x)))
    by = [cs[0].bytes for _, cs in ops]
    n = 64 * 48 * 4
    assert by[0] == n + 48 * 4 + n          # the bias counts its own 48, not 64 x 48
    assert by[1] == n + 48 * 4 + n          # in place: read, then written
    assert by[2] == 2 * n and by[3] == 2 * n  # mul; copy_ reads the source, writes the target
    assert by[4] == n                        # zero_ only writes
    assert by[5] == 2 * n                    # x * x reads x once
    assert nbytes(y.expand(64, 48)) == 48 * 4


def test_a_multi_tensor_ops_bytes_are_summed_and_split_by_launch():
    dst = [torch.zeros(1000) for _ in range(450)] + [torch.zeros(70000)]
    src = [torch.ones_like(t) for t in dst]
    ((rec, costs),) = _costs(lambda: torch._foreach_add_(dst, src))
    total = sum(t.numel() for t in dst) * 4 * 3   # dst read + written, src read
    assert rec[3] == len(costs) == 2               # 448 tensors fill a launch at depth 2
    assert sum(c.bytes for c in costs) == pytest.approx(total)
    assert costs[0].bytes == pytest.approx(448 * 1000 * 12)


def test_the_multi_kernel_ops_are_split_as_cuda_launches_them():
    x = torch.randn(32, 64, requires_grad=True)
    w, b = torch.ones(64, requires_grad=True), torch.zeros(64, requires_grad=True)
    emb = torch.randn(100, 64, requires_grad=True)
    idx = torch.tensor([3, 5, 5, 9])

    dy, de = torch.randn(32, 64), torch.randn(4, 64)

    def step():
        (torch.nn.functional.layer_norm(x, (64,), w, b) * dy).sum().backward()
        (torch.nn.functional.embedding(idx, emb) * de).sum().backward()
    got = {r[2]: cs for r, cs in _costs(step)}
    n, stats = 32 * 64 * 4, 2 * 32 * 4
    ln = got["native_layer_norm_backward"]   # dx from dy, x, w, the stats; then dw, db again
    assert [c.bytes for c in ln] == [3 * n + 64 * 4 + stats, 2 * n + stats + 2 * 64 * 4]
    zero, rows = got["embedding_dense_backward"]
    assert zero.bytes == 100 * 64 * 4                 # the whole table's zeros
    assert rows.bytes == 3 * 4 * 64 * 4 + 4 * 8       # its touched rows, not the table
    assert got["embedding"][0].bytes == 2 * 4 * 64 * 4 + 4 * 8


def test_flash_varlen_flops_are_the_sequences_squares():
    from bench.cuda_dispatch import flash_on_cpu
    heads, d = 2, 64
    q, k, v = (torch.randn(8, heads, d, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with flash_on_cpu(), counting(costs=True) as c:
        out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, 5, 5, 0.1, False, False)
        out[0].float().sum().backward()
    flash = {r[2]: cs for r, cs in zip(c.records, c.costs) if r[1] == "attention"}
    (fwd,) = flash["_flash_attention_forward"]
    assert fwd.flops == 4 * d * heads * (3 * 3 + 5 * 5) and fwd.cta_flops == 4 * d * 5 * 5
    dot, main, convert = flash["_flash_attention_backward"]
    assert main.flops == 2.5 * fwd.flops and dot.kind == convert.kind == "memory"


SOURCE = '''
cpp_fused_add_0 = async_compile.cpp_pybinding(['float*', 'const float*', 'float*', 'const int64_t'], r\'\'\'
extern "C"  void  kernel(float* in_out_ptr0,
                       const float* in_ptr0,
                       float* out_ptr0,
                       const int64_t ks0)
{ }
\'\'\')
cpp_fused_mul_1 = async_compile.cpp_pybinding(['const float*', 'float*'], r\'\'\'
extern "C"  void  kernel(const float* in_ptr0, float* out_ptr0) { }
\'\'\')
'''


def test_a_generated_kernels_bytes_follow_its_parameters_roles():
    assert kernel_roles(SOURCE, "cpp_fused_add_0") == ["rw", "r", "w", ""]
    assert kernel_roles(SOURCE, "cpp_fused_mul_1") == ["r", "w"]
    assert kernel_roles(SOURCE, "cpp_fused_nothing_2") is None
    a, b, c = torch.zeros(10), torch.zeros(20), torch.zeros(30)
    (cost,) = generated_costs(["rw", "r", "w", ""], (a, b, c, 7))
    assert cost.bytes == (2 * 10 + 20 + 30) * 4
    assert generated_costs(None, (a, b))[0].bytes == 30 * 4  # unknown roles: each once


def test_the_price_of_a_kernel_is_a_floor_plus_its_larger_work():
    row = GPUS["h200"]
    floor = row.floor_us * 1e-6
    assert kernel_seconds(row, "memory", 0) == pytest.approx(floor)
    ms = row.bandwidth_GBps * 1e9 / 1000   # the bytes of 1 ms at the row's bandwidth
    assert kernel_seconds(row, "memory", ms) == pytest.approx(floor + 1e-3)
    assert kernel_seconds(row, "memory", ms, additive=False) == pytest.approx(1e-3)
    assert kernel_seconds(row, "memory", 1.0, additive=False) == pytest.approx(floor)
    assert gemm_waves(row, 64) == pytest.approx(64 / 132)
    assert gemm_waves(row, 264) == 1.0 and gemm_waves(row, 133) == pytest.approx(133 / 264)
    flops = 2 * 8192 ** 3
    t = kernel_seconds(row, "gemm", 0, flops, "bf16", tiles=64 * 64)
    assert t == pytest.approx(floor + flops / (gpus.H200_GEMM_TFLOPS * 1e12 * 4096 / 4224))
    with pytest.raises(ValueError, match="no fp8 GEMMs"):
        kernel_seconds(GPUS["a100"], "gemm", 0, 1.0, "fp8", 1)


def _dig(d, key):
    for k in key.split("."):
        d = d[k]
    return d


def test_every_gpu_rows_number_is_sourced_and_a_recorded_one_is_its_records():
    for name, row in GPUS.items():
        fields = ["sms", "memory_GiB", "bandwidth_GBps", "floor_us", "attention_tflops",
                  *(f"gemm_tflops.{d}" for d in row.gemm_tflops)]
        for f in fields:
            assert row.sources.get(f), f"{name}: {f} has no source"
        for src in row.sources.values():
            for path in (w.rstrip(",:;()") for w in src.split() if w.startswith("bench/results/")):
                assert (REPO / path).is_file(), f"{name}: {path} does not exist"
    h200 = json.loads((REPO / gpus.H200_RECORD).read_text())["stages"]
    h100 = json.loads((REPO / gpus.H100_RECORD).read_text())["stages"]
    env = json.loads((REPO / gpus.H200_ENV_RECORD).read_text())["stages"]["env"]["result"]
    assert GPUS["h200"].gemm_tflops["bf16"] == _dig(h200, "throughput.result.gemm_peak_tflops")
    assert GPUS["h200"].bandwidth_GBps == _dig(h200, "optimizer.result.copy_GBps")
    assert GPUS["h100"].bandwidth_GBps == _dig(h100, "optimizer.result.copy_GBps")
    assert (GPUS["h200"].sms, GPUS["h200"].memory_GiB) == (env["multiprocessors"],
                                                           env["gpu_memory_GiB"])
    assert (GPUS["h100"].sms, GPUS["h100"].memory_GiB) == (
        h100["env"]["result"]["multiprocessors"], h100["env"]["result"]["gpu_memory_GiB"])
    small = [k for case in ("lamb_presto:fused", "adamw_presto:fused")
             for k in h100["optimizer"]["result"][case]["kernels"]
             if not k["kernel"].startswith("triton") and "indexFunc" not in k["kernel"]]
    assert GPUS["h100"].floor_us == pytest.approx(sum(k["us"] for k in small)
                                                  / sum(k["calls"] for k in small))
    assert "fp8" not in GPUS["a100"].gemm_tflops and GPUS["a100"].sms == 108


def _row(phase, cat, name, tag, *costs):
    return [phase, cat, name, len(costs), tag, [c.to_list() for c in costs]]


def test_parts_and_the_two_extrapolations():
    assert part_of("forward", "gemm", "encoder") == "encoder GEMMs"
    assert part_of("backward", "elementwise", "encoder") == "compiled/elementwise"
    assert part_of("backward", "elementwise", "gradbuf") == "gradient buffer"
    assert part_of("optimizer", "optimizer", "") == "optimizer"
    assert part_of("forward", "attention", "encoder") == "attention"
    assert part_of("forward", "gemm", "") == "embeddings and heads"
    row = GPUS["h100"]
    two = [_row("forward", "gemm", "mm", "encoder", Cost("gemm", 1e6, 1e9, "bf16", 64))] * 2
    four = two * 2
    p2, p4 = price(two, row), price(four, row)
    p24 = depth(p2, p4, 2, 4, 24)
    assert p24["s"] == pytest.approx(12 * p2["s"]) and p24["kernels"] == pytest.approx(24)
    assert p24["by_part"]["encoder GEMMs"]["flops"] == pytest.approx(24e9)
    lo = [_row("forward", "elementwise", "add", "encoder", Cost("memory", 100.0))]
    hi = [_row("forward", "elementwise", "add", "encoder", Cost("memory", 180.0))]
    (got,) = batch(lo, hi, 8, 16, 904)
    assert got[5][0].bytes == pytest.approx(100 + 80 * (904 - 8) / 8)
    with pytest.raises(ValueError, match="different ops"):
        batch(lo, hi + hi, 8, 16, 904)
    att = [_row("forward", "attention", "_flash_attention_forward", "encoder",
                Cost("attention", 10.0, 1000.0, "bf16", 0, 5.0)),
           _row("backward", "attention", "_flash_attention_backward", "encoder",
                Cost("attention", 10.0, 2500.0, "bf16", 0, 12.5))]
    f, b = retarget_attention(att, 100.0, 300.0, 512)
    assert f[5][0].flops == 3000.0 and b[5][0].flops == 7500.0
    assert f[5][0].cta_flops == 4 * 64 * 128 * 512 and b[5][0].cta_flops == 2.5 * 4 * 64 * 128 * 512


def test_the_asked_for_cuts_are_priced_from_the_passes_bytes():
    from bench.device_cuts import what_if
    row = GPUS["h200"]
    params = 336e6
    priced = {"by_op": {
        "optimizer|cpp_fused_sqrt_sum_where_0": {"s": 0, "kernels": 1, "bytes": 22 * params},
        "optimizer|cpp_fused_sqrt_sub_where_1": {"s": 0, "kernels": 1, "bytes": 18 * params},
        "optimizer|index_add_": {"s": 0, "kernels": 2, "bytes": 1e6},
        "gradient buffer|linalg_vector_norm": {"s": 1.7e-4, "kernels": 1, "bytes": 2 * params}}}
    got = what_if(priced, row)
    assert got["parameters"] == pytest.approx(params)
    assert got["lamb_stored_update_fp32_ms"] == pytest.approx(0.0, abs=1e-9)  # +4 B, -4 B
    saved = 4 * params / (row.bandwidth_GBps * 1e9) * 1e3                    # -4 B in bf16
    assert got["lamb_stored_update_bf16_ms"] == pytest.approx(-saved)
    assert got["grad_norm_folded_into_pass1_ms"] == pytest.approx(-0.17)
