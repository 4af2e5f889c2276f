"""Bad input is a clear error before training starts (exit 2, naming the file, key or row):
shards whose checksums match but whose values a model cannot take, a data set that disagrees
with the config, a missing data directory, empty or non-UTF-8 config files, values that make
no sense - in the config check and in ``python -m submission submit`` - and a property-based
test (hypothesis) feeding generated configs and shard contents through validation and
loading: every input is either accepted and trains a step, or refused with exit status 2
and a message.
"""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loaders.dataset import STATS_FILE, TrainLoader, check_data_set, DataSetInfo, load_eval_batches
from loaders.shards import (CHECKSUM_FILE, DataError, Limits, Samples, read_shard, write_checksums,
                            write_shard)
from runtime.config import ConfigError, load_config
from submission.train import exit_code_of
from tests.support.launch import needs_mpiexec
from tests.support.runs import resume_overrides, run_and_time
from tests.support.tiny import tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
CPU_CONFIG = ROOT / "submission" / "configs" / "config_CPU_1x2x32x1.toml"
LIMITS = Limits(vocab_size=30522, max_seq_length=128)


def copy_dataset(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_shard(root: Path, rel: str, edit) -> Path:
    """Change one shard's values and re-sign it: the checksums match, the values are bad."""
    path = root / rel
    samples = read_shard(path)
    edit(samples)
    write_shard(path, samples)
    rels = [line.split("  ", 1)[1] for line in (root / CHECKSUM_FILE).read_text().splitlines()]
    write_checksums(root, rels)
    return path


def train_shards(root: Path) -> list[str]:
    return [s["file"] for s in json.loads((root / STATS_FILE).read_text())["train_shards"]]


# ------------------------------------------------------------------------------ shard values

@pytest.mark.parametrize("column,value,words", [
    ("input_ids", 30600, ["input_ids holds 30600", "[0, 30522)"]),
    ("input_ids", -3, ["input_ids holds -3"]),
    ("masked_lm_positions", 127, ["masked_lm_positions holds 127", "inside the sequence"]),
    ("masked_lm_ids", 31000, ["masked_lm_ids holds 31000"]),
    ("segment_ids", 2, ["segment_ids holds 2"]),
])
def test_out_of_range_values_are_found_before_training_naming_file_and_row(
        small_dataset, tmp_path, column, value, words):
    root = copy_dataset(small_dataset, tmp_path / "data")
    last = train_shards(root)[-1]               # read late in the epoch: found at start-up

    def edit(s: Samples):
        arr = getattr(s, column)[5].copy()
        arr[-1] = value
        getattr(s, column)[5] = arr
        if column == "masked_lm_positions":     # a position past this row's (shortened) end
            keep = int(arr[:-1].max()) + 1          # every other position stays inside
            assert keep <= value
            s.input_ids[5] = s.input_ids[5][:keep]
            s.segment_ids[5] = s.segment_ids[5][:keep]
    bad = rewrite_shard(root, last, edit)
    for rank in (0, 1):                         # the rank whose share holds it finds it
        share = sorted(json.loads((root / STATS_FILE).read_text())["train_shards"],
                       key=lambda s: s["file"])
        try:
            TrainLoader(root, rank, 2, 8, seed=1, limits=LIMITS, prefetch=False).close()
        except DataError as e:
            text = str(e)
            assert str(bad) in text and "row 5" in text, text
            for w in words:
                assert w in text, text
            assert exit_code_of(e) == 2
            break
    else:
        pytest.fail(f"no rank found the bad value; shares {share}")
    # Without verification, the shard is checked when it is loaded (before its first batch).
    loader = TrainLoader(root, 0, 1, 8, seed=1, limits=LIMITS, verify=False, prefetch=False)
    with pytest.raises(DataError, match="row 5"):
        for _ in range(10_000):
            next(loader)
    loader.close()


def test_bad_eval_file_and_a_missing_data_directory(small_dataset, tmp_path):
    root = copy_dataset(small_dataset, tmp_path / "data")
    rewrite_shard(root, "eval/eval.hdf5", lambda s: s.input_ids.__setitem__(
        0, np.asarray([101, 32000, 102], dtype=np.int16)))
    with pytest.raises(DataError, match=r"eval\.hdf5: row 0: input_ids holds"):
        load_eval_batches(root, 0, 1, 8, limits=LIMITS)
    missing = tmp_path / "nowhere"
    for call in (lambda: TrainLoader(missing, 0, 1, 8, seed=1),
                 lambda: DataSetInfo.read(missing)):
        with pytest.raises(DataError, match="does not exist: build the data set"):
            call()


def test_the_data_set_must_agree_with_the_config(small_dataset):
    info = DataSetInfo.read(small_dataset)
    check_data_set(info, max_seq_length=128, max_predictions_per_seq=20, vocab_size=30522)
    with pytest.raises(DataError, match="max_pred = 20, data.max_predictions_per_seq = 19"):
        check_data_set(info, max_seq_length=128, max_predictions_per_seq=19, vocab_size=30522)
    with pytest.raises(DataError, match="seq_len = 128, longer than data.max_seq_length = 64"):
        check_data_set(info, max_seq_length=64, max_predictions_per_seq=20, vocab_size=30522)
    with pytest.raises(DataError, match="model.vocab_size >= 30522"):
        check_data_set(info, max_seq_length=128, max_predictions_per_seq=20, vocab_size=1000)


# ------------------------------------------------------------------------------ config files

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


@pytest.mark.parametrize("override", ["train.log_every_steps=5\ntrain.max_steps=2",
                                      "train.log_every_steps=5\r\ntrain.max_steps=2",
                                      'optim.name="lamb"\noptim.lr=1'])
def test_an_override_holding_a_line_break_is_refused_not_cut_short(override):
    """One argument, two TOML lines: the second key was dropped without a word."""
    with pytest.raises(ConfigError, match="line break") as e:
        load_config(CPU_CONFIG, [override])
    assert repr(override) in str(e.value)


def test_the_config_answers_for_a_key_and_an_override_without_building_a_run():
    """runtime.config's public accessors (submission.hpo checks a search space with them): a
    key's declared type, an override's parts, and a name that is no key refused naming it."""
    from typing import get_args
    from runtime.config import key_type, parse_override
    assert key_type("optim.lr") is float and "lamb" in get_args(key_type("optim.name"))
    for bad in ("optim.lrr", "optim", "source.x", "nosuch.lr"):
        with pytest.raises(ConfigError, match=f"unknown key {bad} "):
            key_type(bad)
    assert parse_override('optim.name="adamw"') == ("optim", "name", "adamw")
    assert parse_override("train.max_steps=7") == ("train", "max_steps", 7)
    assert parse_override("system.launcher=mpirun") == ("system", "launcher", "mpirun")
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        parse_override("optim.lr")


@pytest.mark.parametrize("override,key", [
    ("optim.lr=nan", "optim.lr"), ("optim.lr=inf", "optim.lr"), ("optim.eps=0", "optim.eps"),
    ("optim.beta2=nan", "optim.beta2"), ("data.eval_batch_size=0", "data.eval_batch_size"),
    ("system.dist_timeout_s=0", "system.dist_timeout_s"),
    ("system.dist_timeout_s=nan", "system.dist_timeout_s"),
    ("train.global_batch_size=0", "train.global_batch_size"),
    ("train.log_every_steps=0", "train.log_every_steps"),
    ("train.max_grad_norm=nan", "train.max_grad_norm"), ("schedule.power=inf", "schedule.power"),
    ("train.target_mlm_accuracy=nan", "train.target_mlm_accuracy"),
    ("train.checkpoint_keep=0", "train.checkpoint_keep"),
    ("train.checkpoint_every_samples=-1", "train.checkpoint_every_samples"),
    ("train.max_nonfinite_steps=-1", "train.max_nonfinite_steps"),
    ("model.hidden_dropout_prob=nan", "model.hidden_dropout_prob"),
    ("train.init_loss_scale=inf", "train.init_loss_scale"),
    ("train.seed=-1", "train.seed"), ("train.seed=4294967296", "train.seed"),
])
def test_values_that_make_no_sense_are_refused_by_config_and_submit(override, key, tmp_path):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(CPU_CONFIG, [override])
    from submission import slurm
    with pytest.raises(slurm.SubmitError, match=key.replace(".", r"\.")):
        slurm.plan(CPU_CONFIG, 1, [override], logdir=tmp_path / "logs", ask_slurm=False)


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


# ------------------------------------------------------------------------------ end to end

@pytest.mark.slow  # a run_and_time.sh launch of 2 ranks
@needs_mpiexec
def test_a_bad_shard_stops_run_and_time_with_exit_2_before_anything_is_written(small_dataset,
                                                                               tmp_path):
    """Through run_and_time.sh on 2 ranks: a shard with an id past the vocabulary (checksums
    re-signed) is found before the first step; exit 2 with the file named, and no MLPerf log
    or metrics file is left half-written in the run directory."""
    root = copy_dataset(small_dataset, tmp_path / "data")
    bad = rewrite_shard(root, train_shards(root)[-1],
                        lambda s: s.input_ids.__setitem__(3, np.where(
                            np.arange(len(s.input_ids[3])) == 2, 30600, s.input_ids[3])
                            .astype(np.int16)))
    run_dir = tmp_path / "run"
    proc = run_and_time(resume_overrides(root, **{"train.max_steps": 2}),
                        env_extra={"RUN_DIR": str(run_dir)})
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert f"{bad}: row 3: input_ids holds 30600" in text, text[-3000:]
    assert "exit status 2 (bad input)" in proc.stderr, proc.stderr[-3000:]
    assert not (run_dir / "mlperf_bert.log").exists() and not (run_dir / "metrics.jsonl").exists()
