"""``python -m bench.gpu_wheels``: does the CUDA install (requirements-gpu.txt, `make venv-gpu`)
resolve for a GPU machine's Python and platform - without downloading its gigabytes of wheels?

pip resolves it as on the target: ``pip install --dry-run --report`` for CPython ``--python``
(3.12) on manylinux x86_64 up to glibc ``--glibc`` (2.35: Ubuntu 22.04, what CUDA images are
built on), binary wheels only, from PyPI, isolated from this machine's pip configuration (its
local wheel directory and caps); ``--use-feature=fast-deps`` has pip read each wheel's
metadata through HTTP range requests instead of downloading it. requirements-data.txt, which
installs with ``--no-deps``, is resolved the same way without dependencies.

    python -m bench.gpu_wheels [--python 3.12] [--glibc 2.35] [--out bench/results/gpu_wheels.json]

Prints every package that would install with its wheel, and whether torch is the CUDA build
(the CUDA packages its wheel pins); writes the record (bench/common.py's header) with pip's
commands. Exit 0: both sets resolve and torch is a CUDA build; 1: not; 2: pip could not run.
Owns: the pip commands and reading their reports. Never: downloads a whole wheel or installs
anything (``--dry-run``, a temporary ``--target``).
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import REPO
from bench.harness import Benchmark, Goal, Stop, option, run

GPU_REQUIREMENTS = REPO / "requirements-gpu.txt"
NO_DEPS = REPO / "requirements-data.txt"
INDEX = "https://pypi.org/simple"
CUDA_PREFIXES = ("nvidia-", "cuda-", "triton")


def platforms(glibc: str) -> list[str]:
    """Every manylinux tag a glibc ``glibc`` x86_64 machine takes, newest first (pip takes
    ``--platform`` literally: it does not add the older ones)."""
    major, minor = (int(x) for x in glibc.split("."))
    return [*(f"manylinux_{major}_{m}_x86_64" for m in range(minor, 4, -1)),
            "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]


def pip_command(requirements: Path, report: Path, target: Path, python: str, glibc: str,
                deps: bool = True) -> list[str]:
    """The dry run that resolves ``requirements`` for the target (module docstring)."""
    abi = "cp" + python.replace(".", "")
    cmd = [sys.executable, "-m", "pip", "install", "--isolated", "--use-feature=fast-deps",
           "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
           "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
           "--abi", abi, "--target", str(target), "--index-url", INDEX]
    for p in platforms(glibc):
        cmd += ["--platform", p]
    return cmd + ([] if deps else ["--no-deps"]) + ["-r", str(requirements)]


def installs(report: dict) -> list[dict]:
    """name, version, wheel file and requested-or-not of every package a pip report would
    install, sorted by name."""
    out = []
    for item in report.get("install", []):
        meta, url = item["metadata"], item["download_info"]["url"]
        out.append({"name": meta["name"].lower(), "version": meta["version"],
                    "file": url.rsplit("/", 1)[-1], "requested": item.get("requested", False)})
    return sorted(out, key=lambda p: p["name"])


def cuda_build(packages: list[dict]) -> list[str]:
    """The CUDA runtime packages of the set (torch's CUDA build pins them; the CPU wheel none)."""
    return [f"{p['name']}=={p['version']}" for p in packages
            if p["name"].startswith(CUDA_PREFIXES)]


def resolve(requirements: Path, python: str, glibc: str, deps: bool = True) -> dict:
    """pip's dry run: {"command", "returncode", "packages", "error"}."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = pip_command(requirements, report, Path(tmp) / "target", python, glibc, deps)
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=900)
        packages = installs(json.loads(report.read_text())) if report.is_file() else []
    errors = [line for line in proc.stderr.splitlines() if line.startswith("ERROR")]
    return {"command": shlex.join(["python", *cmd[1:]]), "returncode": proc.returncode,
            "packages": packages, "error": "\n".join(errors) or proc.stderr[-2000:]
            if proc.returncode else ""}


SETS = (("requirements_gpu", GPU_REQUIREMENTS, True), ("requirements_data", NO_DEPS, False))
"""The sets resolved: the record's key, the file, whether with dependencies."""


def measure(r, case) -> dict:
    _, requirements, deps = case
    try:
        return resolve(requirements, r.args.python, r.args.glibc, deps)
    except (OSError, ValueError, subprocess.TimeoutExpired) as e:
        raise Stop(f"pip could not run: {e}", 2) from None


def summary(r) -> dict:
    gpu, data = r.results
    cuda = cuda_build(gpu["packages"])
    torch = next((p for p in gpu["packages"] if p["name"] == "torch"), None)
    return {"resolves": not gpu["returncode"] and not data["returncode"] and bool(cuda)
            and torch is not None, "requirements_gpu": gpu, "requirements_data": data,
            "cuda_packages": cuda}


def table(rec: dict) -> str:
    gpu, data, cuda = rec["requirements_gpu"], rec["requirements_data"], rec["cuda_packages"]
    lines = [f"| package | version | wheel (CPython {rec['python']}, {rec['platform']}) |",
             "|---|---|---|"]
    lines += [f"| {p['name']} | {p['version']} | {p['file']} |"
              for p in gpu["packages"] + data["packages"]]
    for which, x in (("requirements-gpu.txt", gpu), ("requirements-data.txt", data)):
        lines.append(f"{which}: " + (f"resolves, {len(x['packages'])} packages"
                                     if not x["returncode"] else
                                     f"does not resolve: {x['error']}"))
    torch = next((p for p in gpu["packages"] if p["name"] == "torch"), None)
    lines.append(f"torch {torch and torch['version']}: " + (
        f"the CUDA build ({len(cuda)} CUDA packages: "
        f"{', '.join(c for c in cuda if 'cuda-runtime' in c or 'cudnn' in c or 'nccl' in c)})"
        if cuda else "NOT a CUDA build (no CUDA package in the set)"))
    return "\n".join(lines)


BENCHMARK = Benchmark(
    "gpu_wheels", __doc__, measure, cases=lambda r: SETS,
    options=(option("--python", default="3.12",
                    help="the GPU machine's CPython (default 3.12)"),
             option("--glibc", default="2.35", help="its glibc (default 2.35: Ubuntu 22.04)"),
             option("--out", type=Path, help="write the record here")),
    fields=lambda a: {"python": a.python, "platform": f"manylinux x86_64, glibc {a.glibc}"},
    summary=summary, table=table,
    goals=(Goal("resolves", "both sets resolve and torch is the CUDA build",
                lambda rec: rec["resolves"], gate=True),),
    line=lambda rec: {"resolves": rec["resolves"],
                      "packages": len(rec["requirements_gpu"]["packages"])
                      + len(rec["requirements_data"]["packages"]),
                      "cuda_packages": len(rec["cuda_packages"])})


def main(argv=None) -> int:
    return run(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
