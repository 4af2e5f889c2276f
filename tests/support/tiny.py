"""The one tiny BERT of the test suite, as overrides of the built-in defaults (or of the CPU
benchmark config, for run_and_time.sh runs).

One shape everywhere (1 layer, hidden 64, 2 heads, intermediate 128, an 8,192-row
vocabulary): every test that trains a tiny model builds the same parameter set, so what is
measured or cached for one holds for all. The vocabulary is the first ``VOCAB_ROWS`` entries
of the uncased BERT vocabulary (``write_vocab``; ``small_dataset`` is tokenised with it and
the synthetic sets draw their ids below it): at hidden 64 the vocabulary's rows are almost
the whole model - the MLM decoder, the embedding's gradient, its optimizer update and its
all-reduce - and a step with the real 30,522 rows took 2.7x one with 8,192 (docs/
DEVELOPING.md, "Test suite time"). A test on a data set of a larger vocabulary sets
``model.vocab_size`` itself (a run refuses a data set whose vocabulary is larger).

``optim.backend = "foreach"``: building a Trainer compiles nothing (``auto`` means the fused
step, compiled with torch.compile in every process: seconds per Trainer and per rank). The
tests of the default, compiled pairing (tests/ranks/test_hot_path.py,
tests/integration/test_optim_backends.py, the checkpoint round trip per backend) ask for it
explicitly. Runs draw no loss_accuracy.png (``train.plot =
false``: 1 s each); tests/e2e/test_train_e2e.py draws one.
"""
from __future__ import annotations

from pathlib import Path

from basis.model_shape import SIZES

VOCAB_ROWS = 8192
"""The tiny model's vocabulary: every special token, every character and every '##' letter
and digit piece of the uncased BERT vocabulary lie below it (the last, '##q', at 4,160), so
real text still tokenises into word pieces, not [UNK]."""

SHAPE = {**{f"model.{k}": v for k, v in SIZES["tiny"].items()},  # 1 layer, hidden 64, 2 heads
         "model.vocab_size": VOCAB_ROWS}
BACKEND = {"optim.backend": '"foreach"'}   # the default pairing's tests override it: "auto"
TINY = {**SHAPE, **BACKEND, "train.global_batch_size": 16}

# The e2e runs: 16 samples a step, evaluations every 160 samples (32 per eval batch), a short
# warm-up; the default dropout of the CPU benchmark config (0.1). 80 steps reach 0.03.
RUN = {**TINY, "train.eval_iter_start_samples": 160, "train.eval_iter_samples": 160,
       "train.max_steps": 80, "train.log_every_steps": 10, "data.eval_batch_size": 32,
       "schedule.warmup_steps": 5, "schedule.total_steps": 200,
       "train.target_mlm_accuracy": 0.03, "train.plot": "false"}


def write_vocab(path: Path) -> Path:
    """The tiny vocabulary's vocab.txt at ``path``: the first ``VOCAB_ROWS`` lines of the
    uncased BERT vocabulary (loaders.tokenization's default, from its PyPI package)."""
    from loaders import tokenization
    lines = tokenization.default_vocab_path().read_text(encoding="utf-8").splitlines(True)
    path.write_text("".join(lines[:VOCAB_ROWS]), encoding="utf-8")
    return path


def as_overrides(values: dict) -> list[str]:
    """{"section.key": value} -> ["section.key=value", ...] (values as TOML literals)."""
    return [f"{k}={v}" for k, v in values.items()]


def tiny_overrides(data_dir, *extra: str) -> list[str]:
    """The tiny model on ``data_dir``, on the CPU, dropout off (a test computing the same
    gradient twice needs it deterministic); ``extra`` overrides win."""
    return [f'data.data_dir="{data_dir}"', *as_overrides(TINY), "model.hidden_dropout_prob=0",
            "model.attention_probs_dropout_prob=0", 'system.device="cpu"', *extra]


def tiny_config(data_dir, *extra: str):
    """The loaded config of ``tiny_overrides`` (built-in defaults underneath)."""
    from runtime.config import load_config
    return load_config(None, tiny_overrides(data_dir, *extra))


def run_overrides(data_dir, out=None, **extra) -> list[str]:
    """Overrides after ``run_and_time.sh --`` (over the CPU benchmark config) for a 2-rank run
    of the tiny model on ``data_dir``, a few seconds on 2 cores; ``out`` becomes
    train.output_dir. ``extra``: {"section.key": TOML literal}, winning."""
    values = {"data.data_dir": f'"{data_dir}"', **RUN}
    if out is not None:
        values["train.output_dir"] = f'"{out}"'
    values.update(extra)
    return as_overrides(values)


def toml_text(values: dict) -> str:
    """{"section.key": TOML literal} as a config file's text, one table per section."""
    sections: dict[str, list[str]] = {}
    for key, value in values.items():
        section, name = key.split(".", 1)
        sections.setdefault(section, []).append(f"{name} = {value}")
    return "".join(f"[{s}]\n" + "\n".join(lines) + "\n" for s, lines in sections.items())


def write_toml(path: Path, values: dict) -> Path:
    path.write_text(toml_text(values))
    return path
