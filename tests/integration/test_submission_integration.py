"""Scoring and packaging checks that run MLPerf's own checkers as child processes: the RCP check
(``mlperf_logging.rcp_checker``) on synthetic closed BERT-large logs, and the system
description of this machine through ``mlperf_logging.system_desc_checker``. The rest of
``python -m submission`` and run.sub with stub sbatch/srun: tests/e2e/test_submission.py."""
from __future__ import annotations

import json
import os
import sys

import torch

from submission import report as rep
from submission.sysinfo import collect, system_description
from tests.support.launch import ROOT
from tests.support.mllog import CLOSED_ACCS, simulate
from tests.support.runs import CPU_CONFIG


# ------------------------------------------------------------------------------ report


def test_rcp_check_runs_for_closed_bert_large_logs(tmp_path):
    slow = [0.3 + 0.02 * i for i in range(16)] + [0.721]      # ~2.5 M samples at batch 448
    runs = []
    for i in range(3):
        log = simulate(tmp_path / f"s{i}.log", slow[:len(slow) - 1 + (i % 2)] + [0.721])
        runs.append(rep.analyse_log(f"s{i}", log))
    res = rep.rcp_check(runs, None)
    assert res["applicable"] and res["passed"], res
    fast = [rep.analyse_log(f"f{i}", simulate(tmp_path / f"f{i}.log", CLOSED_ACCS)) for i in range(3)]
    res = rep.rcp_check(fast, None)
    assert res["applicable"] and res["passed"] is False and "RCP test FAILED" in res["message"]
    res = rep.rcp_check(fast[:2], None)
    assert res["passed"] is None and "needs at least 3 runs" in res["message"]


# ------------------------------------------------------------------------------ package

def test_system_description_passes_the_checker(tmp_path):
    from runtime.config import load_config
    from submission.package import _run_checker
    facts = collect(ROOT)
    # Which torch runs, without importing it: a CPU build cannot run a CUDA config.
    if "+cpu" in torch.__version__:
        assert facts["software"]["torch_build"] == "CPU only"
    assert facts["software"]["executable"] == sys.executable
    desc = system_description(facts, load_config(CPU_CONFIG), "Presto", "CPU_2core")
    assert desc["host_processor_vcpu_count"] == str(os.cpu_count())
    assert desc["accelerators_per_node"] == "0" and desc["number_of_nodes"] == "1"
    assert desc["status"] == "Research, Development, or Internal (RDI)"
    path = tmp_path / "CPU_2core.json"
    path.write_text(json.dumps(desc))
    text = _run_checker("mlperf_logging.system_desc_checker", str(path), "training", "5.0.0")
    assert "System description checker passed for CPU_2core" in text, text
    del desc["cooling"]
    path.write_text(json.dumps(desc))
    text = _run_checker("mlperf_logging.system_desc_checker", str(path), "training", "5.0.0")
    assert "Missing field cooling" in text
