"""The import direction run_and_time.sh → submission → runtime → {loaders, kernels} holds,
and only runtime/env.py reads the launcher's rank variables."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "loaders": {"runtime", "submission", "kernels"},
    "kernels": {"runtime", "submission", "loaders"},
    "runtime": {"submission"},
}
RANK_VARS = re.compile(r"\b(PMI_RANK|PMI_SIZE|OMPI_COMM_WORLD_\w+|SLURM_PROCID|SLURM_LOCALID|"
                       r"LOCAL_RANK|WORLD_SIZE|MPI_LOCALRANKID)\b")


def imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_direction(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        wrong = imported_packages(path) & FORBIDDEN[package]
        if wrong:
            bad.append(f"{path.relative_to(ROOT)} imports {sorted(wrong)}")
    assert not bad, "one-way imports broken:\n" + "\n".join(bad)


def test_only_env_module_reads_rank_variables():
    readers = []
    for package in ("runtime", "loaders", "kernels", "submission"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "runtime" / "env.py":
                continue
            for line in path.read_text().splitlines():
                if "environ" in line and RANK_VARS.search(line):
                    readers.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert not readers, "rank variables read outside runtime/env.py:\n" + "\n".join(readers)
