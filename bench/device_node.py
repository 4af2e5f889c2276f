"""The device-time model's predictions as the tuner's profiles, and 8 GPUs of a node: the
predicted step on each GPU with the sharded LAMB (``optim.shard = "node"``: 1/8 of the update,
the buckets reduce-scattered, the parameters all-gathered) and the gradient reduction priced by
the tuner's fabric model (runtime.calibrate.tune.fabric), beside NVIDIA's MLPerf v3.1 step
(3,472 H100s, 2 packed rows a GPU: about 17.5 ms with its allreduce and sharded LAMB,
docs/REFERENCES.md §10).

The node's step is the tuner's own projection (runtime.calibrate.tune.project.step_points at 8
GPUs, local batch 4, global_after clipping, its tuned buckets) of the ``model:`` profile
(runtime.calibrate.tune.model_profile): what ``python -m runtime.calibrate.tune --simulate
runtime/calibrate/tune/systems/dgx_h100.toml --profile model:h100 --gpus 8`` computes.

Owns: the profile file's layout (``write_profiles``), the fabric of each GPU's node
(``FABRICS``), ``node_predictions``. Never: counts or prices kernels (bench.device_time), or
changes the tuner's model.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from runtime.calibrate.tune.model_profile import PROFILES

SYSTEMS = PROFILES.parent
LAYER_SPLIT = "h100_bert_large_seq512_b4_profile.json"
"""The gradients' ready times within backward the tuner scales (measured on the H100 with
``--profile-only``, 2026-11-24: the only GPU layer split there is)."""
FABRICS = {"h100": "dgx_h100.toml", "h200": "dgx_h100.toml", "a100": "dgx_a100_8xhdr.toml"}
NVIDIA_STEP_MS = 17.5
"""NVIDIA's MLPerf v3.1 BERT step on 3,472 H100s at 2 packed rows a GPU (docs/REFERENCES.md §10:
global batch over the logs' throughput; the issue quotes 17.6)."""
TOKENS_PER_SEQUENCE = {"rows2": 256.0, "throughput": 127.933}
"""Real tokens a sequence: 2 full rows of 512 hold 2 sequences each; the throughput batch is the
seq-512 set's (its mean length)."""


def element_sizes(overrides: list[str]) -> dict:
    """Bytes of a parameter and its gradient, and of a gradient in the all-reduce, in the mode
    of ``overrides`` on the DGX config (train.allreduce_dtype 'fp32' there: 4 in every mode)."""
    from bench.gpu.harness import DGX_CONFIG
    from runtime.config import load_config
    cfg = load_config(DGX_CONFIG, overrides)
    master = cfg.train.precision.endswith("_master")
    reduce = {"fp32": 4, "bf16": 2, "fp16": 2}.get(cfg.train.allreduce_dtype,
                                                   2 if master else 4)
    return {"element_bytes": 2 if master else 4, "reduce_bytes": reduce}


def profiles(predictions: dict, commit: str, modes: dict,
             layer_split: str | Path = LAYER_SPLIT) -> dict:
    """The profile file's content (runtime.calibrate.tune.model_profile reads it); ``modes``:
    each mode's config overrides (bench.device_time.modes)."""
    out: dict = {}
    for mode, per_gpu in predictions.items():
        sizes = element_sizes(modes[mode])
        for gpu, p in per_gpu.items():
            if "error" in p:
                continue
            for config in ("rows2", "throughput"):
                c = p[config]
                out.setdefault(gpu, {}).setdefault(mode, {})[config] = {
                    "local_batch": c["local_batch"], "tokens_per_sequence":
                        TOKENS_PER_SEQUENCE[config], **sizes, "busy_ms": c["ms"],
                    "optimizer_ms": c["by_part"]["optimizer"]["ms"],
                    "by_part_ms": {k: v["ms"] for k, v in c["by_part"].items()}}
    return {"source": f"python -m bench.device_time at {commit} (bench/results/device_time.json)",
            "layer_split": str(layer_split), "profiles": out}


def write_profiles(predictions: dict, path: Path, commit: str, modes: dict) -> Path:
    path = Path(path)
    path.write_text(json.dumps(profiles(predictions, commit, modes), indent=1) + "\n")
    print(f"profiles: {path}")
    return path


def node_predictions(predictions: dict, modes: dict, gpus: int = 8,
                     local_batch: int = 4) -> dict:
    """Each mode and GPU at ``gpus`` GPUs of a node, 2 full rows a GPU: the tuner's tuned step
    unsharded and with optim.shard = node (module docstring)."""
    from runtime.calibrate.tune.fabric import load_fabric
    from runtime.calibrate.tune.project import load_profile, step_points
    out: dict = {"nvidia_step_ms": NVIDIA_STEP_MS, "gpus": gpus, "local_batch": local_batch}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model_profiles.json"
        path.write_text(json.dumps(profiles(predictions, "this run", modes,
                                            SYSTEMS / LAYER_SPLIT)))
        for mode, per_gpu in predictions.items():
            for g, p in per_gpu.items():
                if "error" in p:
                    continue
                gp, cpu, _ = load_profile(f"model:{g}:{mode}:rows2", path)
                fabric = load_fabric(SYSTEMS / FABRICS[g])
                row = {"fabric": FABRICS[g], "one_gpu_ms": p["rows2"]["ms"]}
                for key, shard in (("unsharded", 1), ("sharded", gpus)):
                    (pt,) = step_points(gp, cpu, fabric, gpus, local_batch, "global_after",
                                        plans_wanted=["tuned"], shard=shard)
                    row[key] = {"step_ms": pt.step_s * 1e3, "compute_ms": pt.compute_s * 1e3,
                                "exposed_comm_ms": pt.exposed_s * 1e3,
                                "optimizer_ms": pt.optimizer_s * 1e3,
                                "update_ms": pt.update_s * 1e3, "gather_ms": pt.gather_s * 1e3,
                                "buckets": pt.buckets,
                                "vs_nvidia": pt.step_s * 1e3 / NVIDIA_STEP_MS}
                out.setdefault(mode, {})[g] = row
    return out
