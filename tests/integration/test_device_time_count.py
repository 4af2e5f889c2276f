"""bench.device_time's counting end to end, on a real training step: bench.device_cases in its
child process (as bench.device_time runs it) counts an eager step at small widths under CUDA's
dispatch, each encoder GEMM's FLOPs come out as the Linears' (2 · tokens · in · out, forward,
input gradient and weight gradient), attention is flash varlen, every part of the model is
there, and the step prices on a GPU row. The unit tests (tests/unit/test_device_time.py) hold
each op's arithmetic; this one holds that a step's ops reach it - the trainer's parts, the
hooks that tag the encoder and the gradient buffer - which nothing else runs between the
hour-long records."""
from __future__ import annotations

import json
import subprocess
import sys

from tests.support.launch import ROOT

H, I, HEADS, LAYERS = 64, 256, 2, 1
LENGTHS = [100, 200, 300, 450]


def test_a_counted_steps_encoder_gemms_are_its_linears(tmp_path):
    from bench.device_model import PARTS, part_of, price
    from bench.op_cost import Cost
    from runtime.calibrate.gpus import GPUS

    spec = {"kind": "step", "layers": LAYERS, "graph": "none", "data": {"lengths": LENGTHS},
            "overrides": ["data.balance=random", "train.cuda_graphs=none",
                          "train.global_batch_size=4", f"model.hidden_size={H}", f"model.num_attention_heads={HEADS}",
                          f"model.intermediate_size={I}"]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", "bench.device_cases", str(tmp_path / "spec.json"),
                           str(tmp_path / "out.json")], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["meta"]["layers"] == LAYERS and out["meta"]["hidden_size"] == H
    rows = out["steps"][0]

    def costs(r):
        return [Cost.from_list(c) for c in r[5]]

    gemms = [c for r in rows if r[4] == "encoder" for c in costs(r) if c.kind == "gemm"]
    # a layer's Linears: Q, K, V, the attention output (h x h each), the FFN's two (h x i)
    # - whether Q, K and V are one GEMM or three, the same FLOPs
    per_token = 2 * (4 * H * H + 2 * H * I)
    flops = sum(c.flops for c in gemms)
    tokens = flops / (3 * per_token * LAYERS)   # forward, input gradient, weight gradient
    assert tokens == int(tokens) and tokens > 0, (flops, per_token)
    # the batch's real tokens are sums of the set's lengths: no padding reached a GEMM
    # a batch of 4 of the set's sequences, unpadded: the GEMMs saw their real tokens only
    sums = {a + b + c + d for a in LENGTHS for b in LENGTHS for c in LENGTHS for d in LENGTHS}
    assert int(tokens) in sums, tokens
    # the DGX config fuses Q, K and V into one GEMM (model.fusions "qkv"): 4 Linears a layer
    assert "qkv" in out["meta"]["fusions"] and len(gemms) == 3 * 4 * LAYERS, len(gemms)
    attention = [r for r in rows if r[1] == "attention"]
    assert attention and all(r[4] == "encoder" for r in attention), attention
    parts = {part_of(r[0], r[1], r[4]) for r in rows}
    assert {"encoder GEMMs", "attention", "optimizer", "embeddings and heads"} <= parts \
        <= set(PARTS), parts
    priced = price(rows, GPUS["h100"])
    assert priced["flops"] >= flops and priced["s"] > priced["kernels"] * GPUS["h100"].floor_us \
        * 1e-6 > 0
