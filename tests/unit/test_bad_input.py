"""Bad input is a clear error before training starts (exit 2, naming the file, key or row):
shards whose checksums match but whose values a model cannot take, a data set that disagrees
with the config, a missing data directory, overrides and values that make no sense - in the
config check and in ``python -m submission submit``'s plan.

In one process, with real files: config files read by ``python -m runtime.config``, the data
set checks of ``submission submit``, and the property-based tests (hypothesis) whose inputs
either train a step or are refused with exit 2 are in
tests/integration/test_bad_input_integration.py; a bad shard through run_and_time.sh in
tests/e2e/test_bad_input_e2e.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from loaders.dataset import STATS_FILE, TrainLoader, check_data_set, DataSetInfo, load_eval_batches
from loaders.shards import DataError, Limits, Samples
from runtime.config import ConfigError, load_config
from submission.train import exit_code_of
from tests.support.data import copy_dataset, rewrite_shard, train_shards
from tests.support.runs import CPU_CONFIG
from tests.support.launch import ROOT
from tests.support.tiny import VOCAB_ROWS, run_overrides

LIMITS = Limits(vocab_size=30522, max_seq_length=128)


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



def test_a_missing_data_set_is_told_the_build_of_the_configs_shape(tmp_path):
    """The hint names the build that gives the config's sequence length and predictions:
    MLPerf's text (or NVIDIA's HDF5 adopted) for seq 512 / 76, the PyPI text with its flags
    otherwise (basis.presets.build_hint); the trainer and `submit` both say it."""
    from submission import slurm
    missing = tmp_path / "bert_wiki_512"
    with pytest.raises(DataError) as e:
        DataSetInfo.read(missing, 512, 76)
    assert "--mlperf-text results4" in str(e.value) and "loaders.adopt" in str(e.value)
    with pytest.raises(DataError, match=r"`python -m loaders.prepare --out \S+ --seq-len 64 "
                                        r"--max-pred 10` \(docs/DATA.md\)"):
        DataSetInfo.read(missing, 64, 10)
    with pytest.raises(DataError, match=r"`python -m loaders.prepare --out \S+` \(docs/"):
        DataSetInfo.read(missing, 128, 20)            # what prepare builds by default
    dgx = ROOT / "submission" / "configs" / "config_DGXA100_1x8x56x1.toml"
    with pytest.raises(slurm.SubmitError) as e:
        slurm.plan(dgx, 1, [f'data.data_dir="{missing}"'], logdir=tmp_path / "logs",
                   ask_slurm=False)
    assert "does not exist on this host" in str(e.value)
    assert "--mlperf-text results4" in str(e.value) and "loaders.adopt" in str(e.value)


def test_the_data_set_must_agree_with_the_config(small_dataset):
    info = DataSetInfo.read(small_dataset)
    check_data_set(info, max_seq_length=128, max_predictions_per_seq=20, vocab_size=30522)
    with pytest.raises(DataError, match="max_pred = 20, data.max_predictions_per_seq = 19"):
        check_data_set(info, max_seq_length=128, max_predictions_per_seq=19, vocab_size=30522)
    with pytest.raises(DataError, match="seq_len = 128, longer than data.max_seq_length = 64"):
        check_data_set(info, max_seq_length=64, max_predictions_per_seq=20, vocab_size=30522)
    with pytest.raises(DataError, match=f"model.vocab_size >= {VOCAB_ROWS}"):
        check_data_set(info, max_seq_length=128, max_predictions_per_seq=20, vocab_size=1000)


# ------------------------------------------------------------------------------ config files


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
    ("train.profile_steps=[5, 5]", "train.profile_steps"),
    ("train.profile_steps=[99999999999999999999]", "train.profile_steps"),
    ("train.profile_steps=[1501]", "train.profile_steps"),   # past max_steps (1500)
])
def test_values_that_make_no_sense_are_refused_by_config_and_submit(override, key, tmp_path):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(CPU_CONFIG, [override])
    from submission import slurm
    with pytest.raises(slurm.SubmitError, match=key.replace(".", r"\.")):
        slurm.plan(CPU_CONFIG, 1, [override], logdir=tmp_path / "logs", ask_slurm=False)



@pytest.mark.parametrize("other", ['optim.name="adamw"', 'optim.backend="foreach"'])
def test_a_stored_lamb_update_outside_lambs_fused_step_is_refused(other):
    """optim.lamb_update 'stored' is a pass of LAMB's fused step: another optimizer or a
    per-tensor backend is refused by the config, naming the key and the way out."""
    with pytest.raises(ConfigError, match=r"optim\.lamb_update='stored' .* set "
                                          r"optim\.lamb_update 'recompute' otherwise"):
        load_config(CPU_CONFIG, ['optim.lamb_update="stored"', other])
    cfg = load_config(CPU_CONFIG, ['optim.lamb_update="stored"', 'train.precision="bf16_master"'])
    assert cfg.optim.lamb_update == "stored"


def test_profile_steps_say_what_is_wrong_and_are_taken_in_order():
    """train.profile_steps accepted a step twice, a step past max_steps (never profiled) and
    10^20 without a word: each is refused naming the key and what to give; a list out of
    order is a set of steps, taken in increasing order."""
    def refused(steps: str, max_steps: int = 20) -> str:
        with pytest.raises(ConfigError) as e:
            load_config(CPU_CONFIG, [f"train.profile_steps={steps}",
                                     f"train.max_steps={max_steps}"])
        assert exit_code_of(e.value) == 2
        return str(e.value)
    assert refused("[5, 7, 5, 7]") == ("train.profile_steps names step(s) [5, 7] more than "
                                       "once: give each step once, e.g. [5, 7]")
    assert refused("[13, 30, 1000]") == (
        "train.profile_steps: step(s) [30, 1000] come after train.max_steps=20, so the run "
        "ends before them: drop them, or raise train.max_steps (on a resume too)")
    assert refused("[99999999999999999999]").startswith(
        "train.profile_steps: 99999999999999999999 is no step number (it does not fit in 64 "
        "bits)")
    cfg = load_config(CPU_CONFIG, ["train.profile_steps=[13, 12, 20]", "train.max_steps=20"])
    assert cfg.train.profile_steps == [12, 13, 20]


@pytest.mark.parametrize("override, words", [
    ("train.glboal_batch_size=64", ["unknown key", "did you mean train.global_batch_size"]),
    ("train.precision=bf16", ["train.precision", "CPU"]),
    ("optim.lr=-1", ["optim.lr"]),
])
def test_the_config_check_names_what_it_refuses_before_any_launch(small_dataset, tmp_path,
                                                                   override, words):
    """The check run_and_time.sh runs before it launches anything (``python -m runtime.config``
    on the CPU benchmark config and the tiny run's overrides) refuses a misspelt key, a
    precision the CPU cannot run and a negative lr, with exit 2 and the words its stderr shows.
    Through run_and_time.sh: tests/e2e/test_train_e2e.py (a refusal the ranks make) and
    tests/e2e/test_run_and_time.py (the script's refusals)."""
    with pytest.raises(ConfigError) as e:
        load_config(CPU_CONFIG, run_overrides(small_dataset, tmp_path / "run") + [override])
    for word in words:
        assert word in str(e.value)
    assert exit_code_of(e.value) == 2
