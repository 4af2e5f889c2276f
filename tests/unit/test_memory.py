"""The memory estimate and check before launch (runtime.train.memory): the parameter count is
the built model's, exactly; the estimate grows with the micro-batch as it says; a run that
cannot fit is refused with the estimate and the largest micro-batch that would fit - which
then passes; CUDA runs are checked against system.device_memory_gb. The estimate against a
measured peak: tests/integration/test_memory_integration.py."""
from __future__ import annotations

import json

import re

import pytest

from runtime.config import load_config
from runtime.train import memory
from runtime.train.build import build_model
from tests.support.runs import CPU_CONFIG

BASE = ["model.hidden_size=768", "model.num_hidden_layers=12", "model.num_attention_heads=12",
        "model.intermediate_size=3072", "train.global_batch_size=448", 'system.device="cpu"']


@pytest.mark.parametrize("shape", [
    ["model.hidden_size=64", "model.num_hidden_layers=1", "model.num_attention_heads=2",
     "model.intermediate_size=128"],
    ["model.hidden_size=96", "model.num_hidden_layers=3", "model.num_attention_heads=3",
     "model.intermediate_size=200", "model.max_position_embeddings=256"],
])
def test_the_parameter_count_is_the_built_models(shape):
    cfg = load_config(CPU_CONFIG, shape)
    model = build_model(cfg)
    built = sum(p.numel() for p in model.parameters())   # the tied decoder counted once
    assert memory.parameter_count(cfg) == built


def test_bert_base_at_a_local_batch_of_224_is_refused_on_24_gib_and_the_advice_fits():
    cfg = load_config(CPU_CONFIG, BASE)
    est = memory.estimate(cfg)
    assert est.micro_batch == 224 and 105e6 < est.params < 115e6
    have = 24 * memory.GIB
    why = memory.problem(cfg, host_bytes=have)
    assert why and "cannot fit in memory" in why and "224 x 128 tokens" in why, why
    fit = est.largest_micro_batch(have * memory.HEADROOM / 2)
    assert f"largest micro-batch that fits is about {fit} sequences" in why
    accum = 224 // fit + 1
    while 224 % accum:
        accum += 1
    ok = load_config(CPU_CONFIG, [*BASE, f"train.gradient_accumulation_steps={accum}"])
    assert memory.estimate(ok).micro_batch <= fit
    assert memory.problem(ok, host_bytes=have) is None
    assert memory.problem(load_config(CPU_CONFIG), host_bytes=have) is None  # the benchmark


def test_activations_grow_with_the_micro_batch_and_precision_halves_them():
    a = memory.estimate(load_config(CPU_CONFIG, ["train.global_batch_size=32"]))
    b = memory.estimate(load_config(CPU_CONFIG, ["train.global_batch_size=64"]))
    assert b.static == a.static and b.total - a.total == a.per_sample * (b.micro_batch -
                                                                         a.micro_batch)
    half = memory.estimate(load_config(CPU_CONFIG, ['train.precision="bf16"',
                                                    'system.device="cuda"']))
    assert half.per_sample < b.per_sample


def test_a_cuda_run_is_checked_against_the_gpu_memory_it_names():
    big = load_config(CPU_CONFIG, [*BASE[:-1], 'system.device="cuda"'])
    assert memory.problem(big) is None                      # 0: not checked
    small = load_config(CPU_CONFIG, [*BASE[:-1], 'system.device="cuda"',
                                     "system.device_memory_gb=16"])
    assert "one GPU's 16 GiB (system.device_memory_gb)" in memory.problem(small)
    dgx = load_config(CPU_CONFIG.parent / "config_DGXA100_1x8x56x1.toml")
    assert dgx.system.device_memory_gb == 80 and memory.problem(dgx) is None


LARGE = ["model.hidden_size=1024", "model.num_hidden_layers=24", "model.num_attention_heads=16",
         "model.intermediate_size=4096", "train.global_batch_size=512", 'system.device="cpu"']


@pytest.mark.parametrize("accum", [1, 2, 4, 8])
def test_the_micro_batch_is_global_over_ranks_over_accumulation(accum):
    cfg = load_config(CPU_CONFIG, [f"train.gradient_accumulation_steps={accum}"])
    assert memory.estimate(cfg).micro_batch == 64 // 2 // accum == cfg.local_batch_size(2)


def test_bert_large_with_accumulation_8_is_counted_at_its_real_micro_batch_and_refused():
    """BERT-large, global batch 512 on 2 ranks with accumulation 8: a micro-batch of 32 (about
    15.4 GiB a rank), not 4 (7.9 GiB, what the estimate said when it divided by the
    accumulation twice) - refused against a 9.2 GiB share, and the advice it gives fits."""
    cfg = load_config(CPU_CONFIG, [*LARGE, "train.gradient_accumulation_steps=8"])
    est = memory.estimate(cfg)
    assert est.micro_batch == 32 and 15.0 < est.total / memory.GIB < 16.0
    have = int(9.2 * memory.GIB * 2 / memory.HEADROOM)          # 9.2 GiB for each of 2 ranks
    why = memory.problem(cfg, host_bytes=have)
    assert why and "micro-batch of 32 x 128 tokens" in why, why
    m = re.search(r"set train\.gradient_accumulation_steps = (\d+) \(a micro-batch of (\d+)\)",
                  why)
    assert m, why
    fixed = load_config(CPU_CONFIG, [*LARGE, f"train.gradient_accumulation_steps={m[1]}"])
    assert memory.estimate(fixed).micro_batch == int(m[2])
    assert memory.problem(fixed, host_bytes=have) is None
    one_less = [a for a in range(8, int(m[1])) if 256 % a == 0]   # nothing smaller fits
    for a in one_less:
        smaller = load_config(CPU_CONFIG, [*LARGE, f"train.gradient_accumulation_steps={a}"])
        assert memory.problem(smaller, host_bytes=have), a


def test_no_accumulation_can_fit_says_so_instead_of_raising_it():
    cfg = load_config(CPU_CONFIG, [*LARGE, "train.gradient_accumulation_steps=8"])
    why = memory.problem(cfg, host_bytes=int(4 * memory.GIB))
    assert why and "gradient_accumulation_steps" not in why.split("fits")[-1], why
    assert "smaller [model]" in why


def test_the_command_refuses_a_batch_the_ranks_cannot_split_with_exit_2(capsys):
    """`python -m runtime.train.memory` on a global batch the ranks cannot split: the config
    error and exit 2, never a traceback (run_and_time.sh runs it before every launch)."""
    code = memory.main([str(CPU_CONFIG), "--set", "train.global_batch_size=63", "--print"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("config error: ") and "global_batch_size" in err, err


# ------------------------------------------------------------------------------ static shapes
# The probe's values (issue 46): static_rows 4096 needed over 9 GB a rank, 1e9 built a list of
# 1e9 ints per rank in the packing plan, max_seqs_per_row 1e6 asked for 1.7 TB - all after the
# launch, as runtime failures, while this check said 0.98 GiB.
STATIC = ["data.shapes=static", "data.balance=offline_pack", "model.attention=unpadded"]


@pytest.mark.parametrize("override,most", [
    ("data.static_rows=4096", "set data.static_rows to at most 32"),
    ("data.static_rows=1000000000", "set data.static_rows to at most 32"),
    ("data.max_seqs_per_row=1000000", "set data.max_seqs_per_row to at most 25"),
    ("data.shape_bucket=1000000000", "set data.shape_bucket to at most 128"),
])
def test_static_sizes_beyond_the_data_and_length_are_refused_before_launch(override, most,
                                                                           capsys):
    """What run_and_time.sh runs before every launch: exit 2 naming the key and the largest
    value that means anything (a micro-batch of 32 fills at most 32 rows; a row of 128 tokens
    holds at most 25 sequences of at least 5 tokens; a bucket is at most the length)."""
    shapes = ["data.shapes=bucketed"] if "bucket" in override else STATIC
    argv = [str(CPU_CONFIG), "--print"] + [x for o in [*shapes, override] for x in ("--set", o)]
    code = memory.main(argv)
    out = capsys.readouterr()
    assert code == 2 and out.err.startswith(f"config error: {override}") and most in out.err, \
        out.err
    assert out.out == ""
    ok = override.split("=")[0] + "=" + re.search(r"at most (\d+)", out.err)[1]
    assert memory.main([str(CPU_CONFIG)] + [x for o in [*shapes, ok] for x in ("--set", o)]) == 0


def test_the_estimate_counts_static_rows_their_slots_and_the_padded_segments(tmp_path):
    def total(*extra):
        return memory.estimate(load_config(CPU_CONFIG, [*STATIC, *extra])).total
    dynamic = memory.estimate(load_config(CPU_CONFIG)).total
    assert total("data.static_rows=32") > dynamic                  # slots, segments, tables
    assert total("data.static_rows=8") < total("data.static_rows=16") < total("data.static_rows=32")
    assert total("data.max_seqs_per_row=3") < total("data.max_seqs_per_row=12") \
        < total("data.max_seqs_per_row=25")
    # the repad kernel pads each of a row's 3 slots and its tail to the width: 4 segments;
    # the masked-LM slots from the data set's masking rule where it records one
    (tmp_path / "stats.json").write_text(json.dumps({"parameters": {"masked_lm_prob": 0.15}}))
    for data_dir, masked in ((tmp_path, 128 * 15 // 100 + 3),  # floor(width x p) + slots
                             (tmp_path / "none", 3 * 20)):     # no record: slots x max_pred
        rows = memory.estimate(load_config(CPU_CONFIG, [*STATIC, "data.static_rows=26",
                                                        f'data.data_dir="{data_dir}"'])).rows
        assert (rows.count, rows.width, rows.slots, rows.segments) == (26, 128, 3, 4)
        assert rows.masked == masked, data_dir


def test_static_rows_that_cannot_fit_are_refused_with_the_rows_and_slots_that_fit():
    """32 static rows of 25 sequence slots each on 3 GiB for 2 ranks: refused, naming the most
    rows that fit at 25 slots and the most slots that fit at 32 rows - each of which then
    passes, and one more does not."""
    def cfg(rows, slots):
        return load_config(CPU_CONFIG, [*STATIC, f"data.static_rows={rows}",
                                        f"data.max_seqs_per_row={slots}"])
    have = 3 * memory.GIB
    why = memory.problem(cfg(32, 25), host_bytes=have)
    assert why and "32 static rows of 128 tokens (25 sequence slot(s), 26 attention" in why, why
    rows = int(re.search(r"Set data\.static_rows = (\d+) \(the most rows", why)[1])
    slots = int(re.search(r"data\.max_seqs_per_row = (\d+) \(the most sequence slots", why)[1])
    assert 1 <= rows < 32 and 1 <= slots < 25, why
    assert memory.problem(cfg(rows, 25), host_bytes=have) is None
    assert memory.problem(cfg(rows + 1, 25), host_bytes=have)
    assert memory.problem(cfg(32, slots), host_bytes=have) is None
    assert memory.problem(cfg(32, slots + 1), host_bytes=have)
