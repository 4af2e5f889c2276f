"""No Python file of the repository is over 650 lines (the team's cap: a file a reader can
hold in mind; past it, a room is doing two things - split it by what each part owns)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CAP = 650


def python_files(root: Path) -> list[Path]:
    """Every .py file under ``root`` but in hidden folders (.venv, .cache, .git), build
    outputs (data/) and __pycache__."""
    return sorted(p for p in root.rglob("*.py")
                  if not any(part.startswith(".") or part in ("__pycache__", "data")
                             for part in p.relative_to(root).parts[:-1]))


def over_cap(files: list[Path], cap: int = CAP) -> list[str]:
    out = []
    for p in files:
        with open(p, "rb") as f:
            n = sum(1 for _ in f)
        if n > cap:
            out.append(f"{p}: {n} lines")
    return out


def test_over_cap_counts_lines(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / ".venv").mkdir()
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * 651)
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n" * 650)
    (tmp_path / ".venv" / "vendored.py").write_text("x = 1\n" * 2000)
    files = python_files(tmp_path)
    assert [p.name for p in files] == ["long.py", "short.py"]
    assert over_cap(files) == [f"{tmp_path / 'pkg' / 'long.py'}: 651 lines"]


def test_no_python_file_is_over_650_lines():
    files = python_files(ROOT)
    assert any(p.parts[-2:] == ("train", "checkpoint.py") for p in files)
    bad = over_cap(files)
    assert not bad, (f"Python files over {CAP} lines (split each by what its parts own, and "
                     "say so in the module docstrings):\n" + "\n".join(bad))
