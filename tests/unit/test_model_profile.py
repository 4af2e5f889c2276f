"""The tuner's ``--profile model:GPU[:MODE[:CONFIG]]`` (runtime.calibrate.tune.model_profile):
a predicted step from bench.device_time's profile file as the projection's GpuProfile, and the
errors that name what to write instead."""
from __future__ import annotations

import json

import pytest

from runtime.calibrate.gpus import GPUS
from runtime.calibrate.tune.fabric import FabricError
from runtime.calibrate.tune.model_profile import PROFILES
from runtime.calibrate.tune.project import load_profile


def _file(tmp_path, busy=12.0, optimizer=3.0):
    entry = {"local_batch": 4, "tokens_per_sequence": 256.0, "busy_ms": busy,
             "optimizer_ms": optimizer, "by_part_ms": {}}
    data = {"source": "a test", "layer_split": str(PROFILES.parent /
                                                   "h100_bert_large_seq512_b4_profile.json"),
            "profiles": {"h100": {"bf16_master_layers": {"rows2": entry,
                                                         "throughput": {**entry,
                                                                        "local_batch": 488}}}}}
    path = tmp_path / "model_profiles.json"
    path.write_text(json.dumps(data))
    return path


def test_a_predicted_profile_is_the_busy_step_less_its_optimizer(tmp_path):
    path = _file(tmp_path)
    gp, cpu, _ = load_profile("model:h100", path)
    assert gp.sequences_per_second == pytest.approx(4 / 9e-3)
    assert gp.hbm_GBps == GPUS["h100"].bandwidth_GBps and gp.cuda_graphs == "full"
    opt = cpu.total_elements() * gp.optimizer_bytes_per_param / (gp.hbm_GBps * 1e9)
    assert opt == pytest.approx(3e-3)
    assert gp.tokens_per_sequence == 256.0 and "predicted" in gp.name
    big, _, _ = load_profile("model:h100:bf16_master_layers:throughput", path)
    assert big.cuda_graphs == "none" and big.max_local_batch == 488


@pytest.mark.parametrize("spec, words", [
    ("model:", "model:GPU"), ("model:h100:a:b:c", "model:GPU"), ("model:v100", "no GPU row"),
    ("model:h100:fp4", "no mode 'fp4'"), ("model:h100:bf16_master_layers:huge", "'huge' unknown")])
def test_a_bad_model_spec_says_what_to_write(tmp_path, spec, words):
    with pytest.raises(FabricError, match=words):
        load_profile(spec, _file(tmp_path))


def test_no_profile_file_says_how_to_make_it(tmp_path):
    with pytest.raises(FabricError, match="bench.device_time --profiles"):
        load_profile("model:h100", tmp_path / "none.json")


def test_load_profile_takes_a_model_spec():
    if not PROFILES.is_file():
        pytest.skip("no model_profiles.json yet")
    gp, _, _ = load_profile("model:h100")
    assert "predicted" in gp.name and gp.sequences_per_second > 0
