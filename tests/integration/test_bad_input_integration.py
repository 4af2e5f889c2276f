"""Bad input is a clear error before training starts (exit 2 and a message), through the real
entry points in one process or one child process: empty or non-UTF-8 config files (and one
starting with a UTF-8 byte-order mark, read alike) in ``python -m runtime.config``, the data
set and the config file in ``python -m submission submit``, and a property-based test
(hypothesis) feeding generated configs and shard contents through validation and loading:
every input is either accepted and trains a step, or refused with exit status 2 and a
message. The pure checks: tests/unit/test_bad_input.py."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loaders.dataset import STATS_FILE
from loaders.shards import Samples, write_checksums, write_shard
from runtime.config import ConfigError, load_config
from submission.train import exit_code_of
from tests.support.launch import ROOT
from tests.support.runs import CPU_CONFIG
from tests.support.tiny import tiny_overrides


# ------------------------------------------------------------------------------ config files

def test_an_fp8_refusal_is_exit_2_from_the_command_run_and_time_runs():
    proc = subprocess.run([sys.executable, "-m", "runtime.config", str(CPU_CONFIG), "--set",
                           "model.fp8=tensorwise", "--set", "train.precision=fp16", "--set",
                           "system.device=cuda", "--get", "model.fp8"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "model.fp8='tensorwise' with train.precision='fp16'" in proc.stderr, proc.stderr


@pytest.mark.parametrize("content,words", [
    (b"", ["sets nothing", "BERT-base"]), (b"# just a comment\n\n", ["sets nothing"]),
    (b"[train]\nseed = 1 # \xff\xfe\n", ["not UTF-8", "line 2"]),
    (b"[train]\nseed = \n", ["not valid TOML"]),
])
def test_empty_or_undecodable_config_files(tmp_path, content, words):
    path = tmp_path / "config_X_1x1x1x1.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    for w in words:
        assert w in str(e.value)
    proc = subprocess.run([sys.executable, "-m", "runtime.config", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and str(path) in proc.stderr


def test_a_config_starting_with_a_utf8_bom_is_read_like_the_same_file_without_it(tmp_path):
    """Windows editors save UTF-8 with a byte-order mark: TOML said "Invalid statement (at
    line 1, column 1)"."""
    path = tmp_path / CPU_CONFIG.name
    path.write_bytes(b"\xef\xbb\xbf" + CPU_CONFIG.read_bytes())
    assert load_config(path).to_dict() == load_config(CPU_CONFIG).to_dict()
    proc = subprocess.run([sys.executable, "-m", "runtime.config", str(path), "--get",
                           "train.seed"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "42", proc.stderr


def test_submit_checks_the_data_set_and_the_config_file(small_dataset, tmp_path):
    from submission import slurm
    data = f'data.data_dir="{small_dataset}"'
    slurm.plan(CPU_CONFIG, 1, [data], logdir=tmp_path / "a", ask_slurm=False)
    with pytest.raises(slurm.SubmitError, match="max_predictions_per_seq = 19"):
        slurm.plan(CPU_CONFIG, 1, [data, "data.max_predictions_per_seq=19"],
                   logdir=tmp_path / "b", ask_slurm=False)
    with pytest.raises(slurm.SubmitError, match="does not exist on this host"):
        slurm.plan(CPU_CONFIG, 1, [f'data.data_dir="{tmp_path / "none"}"'],
                   logdir=tmp_path / "c", ask_slurm=False)
    empty = tmp_path / "config_E_1x2x32x1.toml"
    empty.write_text("")
    with pytest.raises(slurm.SubmitError, match="sets nothing"):
        slurm.plan(empty, 1, [], logdir=tmp_path / "d", ask_slurm=False)
    with pytest.raises(slurm.SubmitError, match="train.checkpoint_dir"):
        slurm.check_overrides(["train.checkpoint_dir=/x"])
    proc = subprocess.run([sys.executable, "-m", "submission", "submit", "--config",
                           str(CPU_CONFIG), "--nexp", "1", "--logdir", str(tmp_path / "e"),
                           "--set", data, "--set", "optim.lr=nan", "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "optim.lr" in proc.stderr, proc.stderr


# ------------------------------------------------------------------------------ properties

# Keys and values a hostile user might pass: the dangerous ones for each type.
NUMBERS = st.sampled_from([0, 1, -1, 2, 3, 7, 16, 1e-3, 0.5, 1e4, float("nan"), float("inf"),
                           -float("inf"), 1e300, -0.0])
KEYS = ["optim.lr", "optim.eps", "optim.beta1", "optim.beta2", "optim.weight_decay",
        "train.max_grad_norm", "train.global_batch_size", "train.gradient_accumulation_steps",
        "train.log_every_steps", "train.max_steps", "train.target_mlm_accuracy",
        "train.init_loss_scale", "train.checkpoint_keep", "train.max_nonfinite_steps",
        "train.checkpoint_every_samples", "data.eval_batch_size", "data.max_predictions_per_seq",
        "data.max_seq_length", "schedule.warmup_steps", "schedule.total_steps",
        "schedule.power", "system.dist_timeout_s", "model.hidden_dropout_prob",
        "model.layer_norm_eps", "train.eval_iter_samples"]


def _text(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value == math.inf else
                                                 "-inf" if value == -math.inf else repr(value))
    return str(value)


def _base(data_dir, out) -> list[str]:
    """The tiny model of tests/support/tiny.py, 8 samples a step, one step."""
    return tiny_overrides(data_dir, f'train.output_dir="{out}"', "train.global_batch_size=8",
                          "train.max_steps=1", "data.eval_batch_size=16")


def _one_step(cfg, ctx) -> None:
    """Build the trainer and run one step (no evaluation, no run events)."""
    from runtime.train.trainer import Trainer
    cfg.local_batch_size(1)
    trainer = Trainer(cfg, ctx, log=lambda m: None)
    try:
        trainer.setup()
        trainer.train_step(iter(trainer.train_loader))
    finally:
        trainer.close()


@settings(max_examples=25, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(KEYS), NUMBERS), min_size=1, max_size=3))
def test_generated_configs_train_a_step_or_are_refused_with_exit_2(small_dataset, single_ctx,
                                                                   tmp_path, pairs):
    overrides = _base(small_dataset, tmp_path / "run") + [f"{k}={_text(v)}" for k, v in pairs]
    try:
        cfg = load_config(None, overrides)
        _one_step(cfg, single_ctx)
    except Exception as e:  # noqa: BLE001 - the property: refused as bad input, with words
        assert exit_code_of(e) == 2, f"{overrides}: {type(e).__name__}: {e}"
        assert len(str(e)) > 20
        assert any(k in str(e) for k, _ in pairs) or "data set" in str(e) or \
            "divisible" in str(e), str(e)


SAMPLE = st.fixed_dictionaries({
    "length": st.integers(0, 140),
    "bad_id": st.sampled_from([None, -1, 30522, 32767, 0]),
    "positions": st.lists(st.integers(-2, 140), max_size=4),
    "segment": st.sampled_from([0, 1, 2, -1]),
    "nsp": st.sampled_from([0, 1, 2]),
})


def _samples(rows: list[dict], rng) -> Samples:
    cols = {"input_ids": [], "segment_ids": [], "masked_lm_positions": [], "masked_lm_ids": []}
    nsp = []
    for r in rows:
        n = r["length"]
        ids = rng.integers(999, 30000, size=n).astype(np.int16)
        if n:
            ids[0] = 101
            if r["bad_id"] is not None:
                ids[-1] = r["bad_id"]
        seg = np.zeros(n, dtype=np.int16)
        if n:
            seg[n // 2:] = r["segment"]
        pos = np.asarray(r["positions"], dtype=np.int16)
        cols["input_ids"].append(ids)
        cols["segment_ids"].append(seg)
        cols["masked_lm_positions"].append(pos)
        cols["masked_lm_ids"].append(rng.integers(999, 30000, size=len(pos)).astype(np.int16))
        nsp.append(r["nsp"])
    return Samples(**cols, next_sentence_labels=np.asarray(nsp, dtype=np.int8))


@settings(max_examples=25, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(SAMPLE, min_size=8, max_size=12))
def test_generated_shard_contents_train_a_step_or_are_refused_with_exit_2(small_dataset,
                                                                        single_ctx, tmp_path,
                                                                        rows):
    """One train shard of generated samples replaces the small set's (checksums re-signed):
    a shard the model can take trains; anything else is a DataError naming the file."""
    root = tmp_path / "data"
    if root.exists():
        shutil.rmtree(root)
    shutil.copytree(small_dataset, root)
    stats = json.loads((root / STATS_FILE).read_text())
    rel = stats["train_shards"][0]["file"]
    for extra in stats["train_shards"][1:]:
        (root / extra["file"]).unlink()
    stats["train_shards"] = [{"file": rel, "samples": len(rows)}]
    (root / STATS_FILE).write_text(json.dumps(stats))
    write_shard(root / rel, _samples(rows, np.random.default_rng(0)))
    write_checksums(root, [STATS_FILE, rel, "eval/eval.hdf5", "vocab.txt"])
    cfg = load_config(None, _base(root, tmp_path / "run"))
    valid = all(1 <= r["length"] <= 128 and r["bad_id"] in (None, 0) and r["segment"] in (0, 1)
                and r["nsp"] in (0, 1) and all(0 <= p < r["length"] for p in r["positions"])
                for r in rows)
    try:
        _one_step(cfg, single_ctx)
    except Exception as e:  # noqa: BLE001
        assert exit_code_of(e) == 2, f"{type(e).__name__}: {e}"
        assert str(root / rel) in str(e), str(e)
        assert not valid, f"a valid shard was refused: {e}"
        return
    assert valid, f"a shard with values out of range trained: {rows}"
