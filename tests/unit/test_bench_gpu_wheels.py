"""bench.gpu_wheels without the network: the pip dry run it builds for a GPU machine (the
target's tags, binary wheels only, lazy metadata, this machine's pip configuration ignored) and
how it reads pip's report. The resolution itself, against PyPI: bench/results/gpu_wheels.json."""
from __future__ import annotations

from pathlib import Path

from bench.gpu_wheels import cuda_build, installs, pip_command, platforms


def test_the_dry_run_targets_the_gpu_machine_and_downloads_no_wheel(tmp_path):
    cmd = pip_command(Path("requirements-gpu.txt"), tmp_path / "r.json", tmp_path / "t",
                      "3.12", "2.35")
    flags = " ".join(cmd)
    for flag in ("--dry-run", "--use-feature=fast-deps", "--isolated", "--only-binary=:all:",
                 "--python-version 3.12", "--abi cp312", "--implementation cp",
                 "--index-url https://pypi.org/simple", "-r requirements-gpu.txt"):
        assert flag in flags
    assert "--no-deps" not in cmd
    plats = [cmd[i + 1] for i, c in enumerate(cmd) if c == "--platform"]
    assert plats == platforms("2.35")
    assert plats[0] == "manylinux_2_35_x86_64" and "manylinux_2_18_x86_64" in plats \
        and plats[-1] == "manylinux1_x86_64"       # NCCL's wheel is manylinux_2_18
    assert pip_command(Path("r.txt"), tmp_path / "r", tmp_path / "t", "3.12", "2.35",
                       deps=False)[-3] == "--no-deps"


def test_a_report_is_read_into_packages_and_the_cuda_build_is_told_from_the_cpu_one():
    def item(name, version, url):
        return {"metadata": {"name": name, "version": version},
                "download_info": {"url": url}, "requested": name == "torch"}
    report = {"install": [
        item("torch", "2.13.0", "https://x/torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl"),
        item("nvidia-cudnn-cu13", "9.20.0.48", "https://x/nvidia_cudnn_cu13-9.20.0.48.whl"),
        item("Jinja2", "3.1.6", "https://x/jinja2-3.1.6-py3-none-any.whl")]}
    got = installs(report)
    assert [p["name"] for p in got] == ["jinja2", "nvidia-cudnn-cu13", "torch"]
    assert got[2]["file"] == "torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl"
    assert cuda_build(got) == ["nvidia-cudnn-cu13==9.20.0.48"]
    assert cuda_build([p for p in got if p["name"] != "nvidia-cudnn-cu13"]) == []   # CPU
