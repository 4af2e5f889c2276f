"""docs/MLPERF.md end to end on the small fixtures: every fixture-scale command of the
walkthrough, read from the page (tests/support/walkthrough.py) and run as written, in its
order, each checked for what the page says it checks. The page is the one copy of the
commands and of the fixture config's use; `make mlperf-demo` runs the same blocks.

The official files are stood in for by tests/fixtures/: ``tf_bert_tiny/`` (a 3-layer BERT
written by real TensorFlow with Google's variable names, LAMB slots, two data shards, its
``bert_config.json`` and a character-level ``vocab.txt``: the phase1/ directory) and
``mlperf_text/`` (part files and eval.txt in the reference's format: results4/). NVIDIA's
preprocessed HDF5 is stood in for by the prepared shards rewritten in their layout
(tests/support/nvidia_layout.py); the run config is tests/fixtures/config_TINY_1x2x8x1.toml.

1. ``python -m runtime.model.convert`` - the checkpoint, against the run config's shape
2. ``python -m loaders.prepare --mlperf-text`` - the text into shards and the eval set
2'. NVIDIA's layout, then ``python -m loaders.adopt`` - a data set of it (the runs train on it)
3. ``run_and_time.sh -- train.eval_before_training=true train.max_steps=1`` and the page's
   grep - the first evaluation equals the converted weights' accuracy on the eval set,
   computed here: the 0.34085 check
4. ``python -m submission submit --dry-run``, then ``submit`` to the real one-node Slurm
   cluster of tests/slurm_cluster.py (run.sub: cache clear, srun, run_and_time.sh per
   experiment) and ``status --wait``, 3 experiments - or, where Slurm cannot run here, the
   page's no-Slurm block (run_and_time.sh per experiment as run.sub calls it)
5. ``python -m submission report`` - compliance checker (5.0.0) PASS on every log, an olympic
   mean over 3 runs
6. ``python -m submission package`` - every check that applies passes but the result count,
   which needs MLPerf's 10 runs
"""
from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import pytest
import torch

from tests.support import walkthrough
from tests.support.launch import clean_env
from tests.support.run_docs import unlisted

pytestmark = pytest.mark.slow   # tests/e2e: every test here is slow

NEXP = 3
BLOCK_TIMEOUT_S = 300
ORDER = ["convert", "prepare", "adopt", "first_eval", "grep", "dry_run", "experiments",
         "report", "package"]


def accuracy_of(bert: Path, data: Path) -> tuple[float, int]:
    """The converted weights' masked-LM accuracy on the eval file, computed here, and the
    number of masked positions."""
    from loaders.dataset import load_eval_batches
    from runtime.model.bert import BertForPreTraining
    from runtime.model.config import BertConfig
    from runtime.model.hf import load_pretrained
    model = BertForPreTraining(BertConfig.from_hf_json(bert)).eval()
    load_pretrained(model, bert)
    correct = count = 0
    with torch.no_grad():
        for b in load_eval_batches(data, 0, 1, 16):
            out = model(b.input_ids, b.token_type_ids, b.attention_mask, b.masked_lm_labels)
            correct += int(out.mlm_correct)
            count += int((b.masked_lm_labels != -100).sum())
    return correct / count, count


def first_eval(run_dir: Path) -> dict:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"kind": "eval"' in x][0]


def slurm_env(request) -> dict | None:
    """The session's one-node cluster's client environment; None where Slurm cannot run."""
    try:
        cluster = request.getfixturevalue("slurm_cluster")
    except pytest.skip.Exception as e:
        warnings.warn(f"no Slurm here ({e}): step 4 runs the page's no-Slurm block")
        return None
    return cluster.client_env()


def test_the_walkthrough_from_the_official_inputs_to_a_scored_package(tmp_path, request):
    demo = tmp_path / "demo"
    env = clean_env(DEMO=str(demo))
    page = walkthrough.blocks()
    setup = next(b for b in page if b.id == "setup")
    cluster = slurm_env(request)
    blocks = walkthrough.chosen(page, slurm=cluster is not None)
    assert [b.id for b in blocks] == ORDER          # the page's steps, in the page's order
    outputs = {}
    for b in blocks:
        under_slurm = cluster is not None and b.id == "experiments"
        proc = walkthrough.run(b, setup, dict(cluster, DEMO=str(demo)) if under_slurm else env,
                               timeout=BLOCK_TIMEOUT_S)
        out = proc.stdout + proc.stderr
        assert proc.returncode == b.exit, f"step {b.id}: exit {proc.returncode}, the page " \
            f"says {b.exit}\n{b.text}\n{out[-4000:]}"
        outputs[b.id] = out
    bert, adopted = demo / "bert_tiny", demo / "bert_wiki_64"

    # 1. The checkpoint: read without TensorFlow, checked against the run's shape.
    assert "62 weights" in outputs["convert"] and \
        "125 optimizer variables skipped" in outputs["convert"]
    manifest = json.loads((bert / "manifest.json").read_text())
    assert [s["file"] for s in manifest["sources"]][1:] == [
        "model.ckpt-3.data-00000-of-00002", "model.ckpt-3.data-00001-of-00002"]

    # 2. The text: the reference's procedure per part file, the eval set picked as it picks.
    stats = json.loads((demo / "bert_wiki_text" / "stats.json").read_text())
    assert stats["sequences"]["eval"] == 64 and len(stats["train_shards"]) == 2
    assert stats["eval"]["input_ids_md5"]            # NVIDIA's hdf5_md5.py hash, recorded

    # 2'. NVIDIA's layout (what their prepare_data.sh writes), adopted: the same eval set.
    assert stats["eval"]["input_ids_md5"] in outputs["adopt"]

    # 3. The checkpoint's accuracy before training: the run's first evaluation, by the
    # page's grep, is the converted weights' accuracy computed here.
    want, masked = accuracy_of(bert, adopted)     # other batches and padding than the run's:
    tol = 1.01 / masked                           # ±1 near-tie
    grep = re.search(r'"key": "eval_accuracy", "value": ([0-9.e-]+).*"epoch_num": 0\b',
                     outputs["grep"])
    assert grep and float(grep.group(1)) == pytest.approx(want, abs=tol), outputs["grep"]
    [run3] = (demo / "results").glob("config_TINY_1x2x8x1_seed*")
    assert first_eval(run3)["samples"] == 0
    assert unlisted(run3) == []          # the README's table names every entry of a run dir

    # 4. The experiments: the dry run's checks, then Slurm (or run.sub's per-experiment call).
    logs = demo / "logs"
    assert "--ntasks-per-node=2" in outputs["dry_run"]
    if cluster is not None:
        assert re.search(r"job \d+: COMPLETED", outputs["experiments"]), outputs["experiments"]
    else:
        assert len(re.findall(r"^RESULT,bert,\d+,", outputs["experiments"], re.M)) == NEXP
    for i in range(1, NEXP + 1):
        first = first_eval(logs / f"run_{i}")
        assert first["samples"] == 0
        assert first["eval_accuracy"] == pytest.approx(want, abs=tol)

    # 5. Scoring: the compliance checker on every log, the olympic mean.
    report = json.loads((logs / "report.json").read_text())
    assert [r["status"] for r in report["runs"]] == ["success"] * NEXP
    assert all(r["compliance"] == "pass" for r in report["runs"])
    assert report["olympic"]["score_s"] > 0 and not report["rcp"]["applicable"]   # open

    # 6. The package: every check that applies passes but the count of 10 runs.
    verdicts = {c["name"]: c["verdict"] for c in json.loads(
        (demo / "pkg" / "package_report.json").read_text())["checks"]}
    assert [n for n, v in verdicts.items() if v == "fail"] == [
        "package_checker: number of result files", "package_checker: overall"], \
        outputs["package"]
    assert verdicts["package_checker: compliance of each result (ruleset 5.0.0)"] == "pass"
    assert os.path.isfile(demo / "pkg" / "Presto" / "results" / "tiny_cpu" / "bert"
                          / "result_2.txt")


def test_the_demo_refuses_a_directory_holding_an_earlier_walkthrough(tmp_path, capsys):
    """`make mlperf-demo` twice: the second would find finished runs in its run
    directories; it says so before running anything."""
    (tmp_path / "bert_tiny").mkdir()
    assert walkthrough.main(["--dir", str(tmp_path)]) == 2
    assert "holds an earlier walkthrough" in capsys.readouterr().err
