"""A GPU's step profile predicted by the device-time model, for the tuner's projection:
``python -m runtime.calibrate.tune --simulate FABRIC --profile model:h100[:MODE[:CONFIG]]``.

    model:h100                          the best mode (bf16_master_layers) at 2 full rows
    model:h200:bf16_autocast            bf16 autocast at 2 full rows
    model:a100:bf16_master:throughput   at the largest batch the records measured

The numbers come from ``model_profiles.json`` beside this file, which ``python -m
bench.device_time --profiles ...`` writes from its counted, priced steps (the GPU rows and the
pricing are runtime.calibrate.gpus'). Why a file and not a call: the prediction counts a step
under bench's CUDA dispatch emulation, and runtime never imports bench
(tests/unit/test_layering.py); the file says which commit and command made it.

How a predicted profile differs from a measured one (a ``[profile]`` TOML of a lent GPU):
  * its step is the sum of kernel durations - busy time - as if the step ran back to back on
    the device (a whole-step graph measured 1.07x its busy time on the H200); nothing of the
    host (launch gaps, eager Python) is in it, so it suits ``cuda_graphs = "full"`` steps;
  * forward + backward is the busy time less the optimizer phase (the gradient buffer's adds
    and zeroing stay in it), at the one local batch the prediction counted; the projection
    scales it linearly to other batches, as it does a measured figure;
  * the optimizer phase is the model's (the fused LAMB's passes at its bytes, its small
    kernels at the floor), expressed as the bytes per parameter the tuner's formula takes;
  * the gradients' ready times within backward are the layer split of the CPU measurement
    the file names (a measured split scaled, as for every profile).

Owns: reading a ``model:`` spec into the tuner's GpuProfile fields and its layer split.
Never: counts or prices (bench.device_time does), or measures.
"""
from __future__ import annotations

import json
from pathlib import Path

PROFILES = Path(__file__).resolve().parent / "systems" / "model_profiles.json"
DEFAULT_MODE = "bf16_master_layers"
DEFAULT_CONFIG = "rows2"
CONFIGS = {"rows2": "full", "throughput": "none"}
"""Each predicted configuration and its train.cuda_graphs (2 full rows: the whole-step graph;
the largest batch: eager)."""


def is_model(spec: str) -> bool:
    return str(spec).startswith("model:")


def model_profile_fields(spec: str, path: Path = PROFILES) -> tuple[dict, Path]:
    """(the GpuProfile's fields, the layer split file) of ``spec`` (module docstring);
    runtime.calibrate.tune.project.load_profile builds the profile from them."""
    from runtime.calibrate.gpus import gpu as gpu_row
    from runtime.calibrate.tune.fabric import FabricError
    from runtime.calibrate.tune.simulate import StepProfile

    parts = str(spec).split(":")[1:]
    if not parts or not parts[0] or len(parts) > 3:
        raise FabricError(f"--profile {spec}: write model:GPU[:MODE[:CONFIG]], e.g. model:h100 "
                          f"or model:h200:bf16_autocast:throughput")
    name, mode, config = (parts + [DEFAULT_MODE, DEFAULT_CONFIG][len(parts) - 1:])[:3]
    try:
        row = gpu_row(name)
    except ValueError as e:
        raise FabricError(f"--profile {spec}: {e}") from None
    if not path.is_file():
        raise FabricError(f"--profile {spec}: {path} does not exist; make it with `python -m "
                          f"bench.device_time --profiles {path}`")
    data = json.loads(path.read_text())
    table = data["profiles"].get(name.lower(), {})
    if mode not in table:
        raise FabricError(f"--profile {spec}: no mode {mode!r} predicted for {name} in {path} "
                          f"(modes: {', '.join(sorted(table)) or 'none'})")
    if config not in CONFIGS or config not in table[mode]:
        raise FabricError(f"--profile {spec}: configuration {config!r} unknown; choose from "
                          f"{', '.join(CONFIGS)}")
    p = table[mode][config]
    split = path.parent / data["layer_split"]
    params = StepProfile.from_json(json.loads(split.read_text())["profile"]).total_elements()
    compute_s = (p["busy_ms"] - p["optimizer_ms"]) / 1e3
    hbm = row.bandwidth_GBps
    return dict(
        name=f"{row.name}, predicted (bench.device_time), {mode}, {config}",
        sequences_per_second=p["local_batch"] / compute_s, layer_split=str(split),
        hbm_GBps=hbm, optimizer_bytes_per_param=p["optimizer_ms"] / 1e3 * hbm * 1e9 / params,
        reduce_bytes=p.get("reduce_bytes", 2), element_bytes=p.get("element_bytes", 4),
        tokens_per_sequence=p["tokens_per_sequence"],
        max_local_batch=max(1, int(p["local_batch"])), cuda_graphs=CONFIGS[config],
        source=f"{path.name}: {data.get('source', '')}"), split
