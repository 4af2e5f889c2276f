"""The GPU pages' shape: docs/GPU_QUICKSTART.md comes first in docs/GPU.md's reading order, the
run history lives in docs/benchmarks/gpu.md (GPU.md is the reference, not a diary), and every
config, make target and file the quick start names exists."""
from __future__ import annotations

import re

from tests.support.launch import ROOT

DOCS = ROOT / "docs"


def test_the_quick_start_is_first_and_the_run_history_is_a_benchmark_page():
    gpu = (DOCS / "GPU.md").read_text()
    links = re.findall(r"\]\(([^)#]+\.md)", gpu)
    assert links[0] == "GPU_QUICKSTART.md"
    assert not re.search(r"^## (First|Second) run", gpu, re.M)
    history = (DOCS / "benchmarks" / "gpu.md").read_text()
    assert "### First run: one H100, 2026-11-24" in history
    assert "### Second run: one H200, 2026-11-27/28" in history
    assert "## What reading found before any GPU" in history


def test_what_the_quick_start_names_exists():
    page = (DOCS / "GPU_QUICKSTART.md").read_text()
    configs = set(re.findall(r"config_DGXH[0-9]+_[0-9x]+\.toml", page))
    assert configs == {p.name for p in (ROOT / "submission" / "configs").glob("config_DGXH*")}
    make = (ROOT / "Makefile").read_text()
    for target in set(re.findall(r"\bmake ([a-z-]+)", page)):
        assert re.search(rf"^{target}:", make, re.M), target
    for path in ("Dockerfile", "requirements-gpu.txt", "bench/gpu_wheels.py",
                 "bench/results/gpu_wheels.json"):
        assert (ROOT / path).is_file(), path
