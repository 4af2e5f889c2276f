"""What every part of ``submission.hpo`` shares: where the repository and its scripts are,
the study directory's layout, the exit statuses and the error a study's input raises.

Owns: the names of the study directory's files (study.json, trials/, heartbeats/), the
environment variable that carries an RDB URL to a worker, the exit statuses of the commands.
Never: imports Optuna or the config, or writes anything.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RUN_AND_TIME = ROOT / "run_and_time.sh"
HPO_SUB = ROOT / "submission" / "hpo.sub"
DEFAULT_DIR = ROOT / "results" / "hpo"
STUDY_FILE = "study.json"
STORAGE_ENV = "PRESTO_HPO_STORAGE"   # an RDB URL reaches Slurm workers here, never on disk
EXIT_OK, EXIT_NONE_COMPLETE, EXIT_BAD_INPUT, EXIT_STOPPED = 0, 1, 2, 4


class HpoError(ValueError):
    """Input a study cannot run with; the message names the file, key or value and what to
    do (exit 2, nothing started)."""


def heartbeat_file(study, number: int) -> Path:
    """The file a live worker touches while trial ``number`` runs (its mtime is the beat)."""
    return study.path / "heartbeats" / f"trial_{number}"


def seam(name: str) -> Any:
    """``submission.hpo.<name>`` as it is now (the package's seams, see its docstring): read
    at the call, so a stand-in set on the package is the one used."""
    import submission.hpo
    return getattr(submission.hpo, name)
