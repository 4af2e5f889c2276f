"""The ``attention`` stage of ``python -m bench.gpu``: which attention kernel is fastest for
each of the model's paths, forward and backward, in bf16 with dropout 0.1 (the MLPerf model's).

BERT-large's attention (16 heads of 64) at sequence 512 on real lengths of the seq-512 data
set: the padded path ([b, heads, L, L] scores, a key mask) under each SDPA backend that takes
a mask - cuDNN, memory-efficient, math; the packed path (a block-diagonal [b, 1, L, L] mask)
likewise; the unpadded path's varlen kernels - FlashAttention-2 varlen
(``kernels.attention.flash_varlen``, what ``cuda_varlen`` runs), jagged tensors into SDPA, and
the repad kernel (padded to the longest sequence). Each timed over back-to-back calls after a
warm-up; a backend that refuses the inputs is recorded as such. On CPU (``--smoke``) the
padded and unpadded kernels that run there, on small shapes: the harness is what is tested.

Owns: the kernels and backends compared, and the fastest per path.
Never: changes which kernel the model runs (kernels/attention.py's rule does).
"""
from __future__ import annotations

import time
from typing import Any, Callable

from bench.gpu.harness import Run, synchronize


def _time(fn: Callable[[], Any], reps: int) -> float:
    for _ in range(2):
        fn()
    synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    synchronize()
    return (time.perf_counter() - t0) / reps


def stage_attention(run: Run) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from kernels import attention as attn
    from loaders.dataset import TrainLoader
    from runtime.model.bert import additive_mask, packed_attention_mask

    heads, d = (16, 64) if run.cuda else (2, 32)
    b = 16 if run.cuda else 4
    dtype = torch.bfloat16 if run.cuda else torch.float32
    dev, p, reps = run.device, 0.1, (10 if run.cuda else 2)
    with TrainLoader(run.data("seq512"), 0, 1, b, 5, verify=False) as loader:
        batch = next(loader).to(dev)
    rows, width = batch.input_ids.shape
    out = run.result({"rows": rows, "width": width, "heads": heads, "head_dim": d,
                      "real_tokens": batch.num_real_tokens, "dropout": p,
                      "dtype": str(dtype).removeprefix("torch.")})

    def leaf(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype, requires_grad=True)

    def fwd_bwd(fn):
        def call():
            o = fn()
            o.backward(torch.ones_like(o))
        return call

    q, k, v = (leaf(rows, heads, width, d) for _ in range(3))
    masks = {"padded": additive_mask(batch.attention_mask.bool()[:, None, None, :], q),
             "packed": additive_mask(packed_attention_mask(batch.attention_mask), q)}
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "math": SDPBackend.MATH} if run.cuda else {"math": SDPBackend.MATH}
    for path, mask in masks.items():
        res = {}
        for name, backend in backends.items():
            def sdpa(mask=mask, backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
            try:
                res[name] = {"ms": _time(fwd_bwd(sdpa), reps) * 1e3}
            except Exception as e:  # noqa: BLE001 - a backend refusing these inputs
                res[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        out[path] = res
    lay = batch.layout
    varlen = attn.Varlen.from_host(lay.cu_seqlens, lay.token_in_seq, lay.seq_of_token,
                                   lay.max_len, lay.min_len, lay.lengths)
    t = lay.num_tokens
    qt, kt, vt = (leaf(t, heads, d) for _ in range(3))
    kernels = ["flash_varlen", "jagged", "repad"] if run.cuda else ["repad", "per_sequence"]
    res = {}
    for name in kernels:
        def run_kernel(name=name):
            return attn.varlen_attention(qt, kt, vt, varlen, p, name)
        try:
            res[name] = {"ms": _time(fwd_bwd(run_kernel), reps) * 1e3}
        except Exception as e:  # noqa: BLE001
            res[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    out["unpadded"] = res
    out["fastest"] = {path: min((k for k, v in out[path].items() if "ms" in v),
                                key=lambda k: out[path][k]["ms"], default=None)
                      for path in ("padded", "packed", "unpadded")}
    return dict(out)
